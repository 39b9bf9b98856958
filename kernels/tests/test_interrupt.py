"""Interrupts against real kernels started through the boot script, the way the broker
starts them: plainly, forked by a template, and copied by ``kb_fork_request``.

    protocol-tests/.venv/bin/python -m pytest kernels/tests/test_interrupt.py
"""

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from forkharness import Fork, Kernel, value, wait_reply  # noqa: E402

# The cell makes the interrupt land at the worst moment, every time: inside ipykernel's
# `_abort_queues`, when it logs "Aborting queue" (after setting the flag, before queuing the
# message that clears it). A client's interrupt racing a failing cell lands there by chance
# (stock ipykernel 7.4, interrupted right after failed cells, was stuck after 11 tries in
# one run and after 40 in another).
INTERRUPT_WHILE_ABORTING = """
import logging, os, signal

class InterruptWhileAborting(logging.Handler):
    def emit(self, record):
        if record.getMessage() == "Aborting queue":
            os.kill(os.getpid(), signal.SIGINT)

kernel_log = get_ipython().kernel.log
kernel_log.addHandler(InterruptWhileAborting())
kernel_log.setLevel(logging.INFO)
"""


# The interrupt lands as ipykernel sends the reply of a cell that has ended (a client's
# interrupt, or a timeout, racing the cell's end): the kernel's session sends the signal
# itself just before it sends an `execute_reply`, once (the cell's own code has ended by
# then, so nothing is there to interrupt).
INTERRUPT_AS_THE_REPLY_GOES = """
import os, signal

_kernel = get_ipython().kernel
_send = _kernel.session.send

def _send_interrupted_once(stream, msg_or_type, *args, **kwargs):
    if msg_or_type == "execute_reply" and _pending:
        _pending.pop()
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes, where a handler raising KeyboardInterrupt runs
            pass
    return _send(stream, msg_or_type, *args, **kwargs)

_pending = []
_kernel.session.send = _send_interrupted_once
"""


def status(kc, code):
    return wait_reply(kc, kc.execute(code))["status"]


@pytest.mark.parametrize("how", ["plain", "template", "fork"])
def test_an_interrupt_as_a_cell_fails_does_not_leave_the_kernel_aborting(tmp_path, how):
    """A failed execution makes ipykernel abort the execute requests already queued, and
    then stop aborting. An interrupt arriving as the failure is being answered (a client's
    interrupt racing the error, a timeout) must not keep it aborting every later request."""
    kernel = Kernel(tmp_path, template=how == "template")
    fork = None
    try:
        kc = kernel.client
        if how == "fork":
            fork = Fork(kc, tmp_path, "c1")
            kc = fork.client
        assert status(kc, INTERRUPT_WHILE_ABORTING) == "ok"
        for attempt in range(3):
            assert status(kc, "1 / 0") == "error"
            # A request that arrived before the abort ended is answered `aborted`, as it
            # should be; the one after it must run.
            first = status(kc, "1 + 1")
            if first == "aborted":
                time.sleep(0.05)
                assert status(kc, "1 + 1") == "ok", "still aborting after try %d" % attempt
            else:
                assert first == "ok", first
        assert value(kc, "'alive'") == repr("alive")
    finally:
        if fork is not None:
            fork.stop()
        kernel.stop()


@pytest.mark.parametrize("how", ["plain", "template", "fork"])
def test_an_interrupt_as_a_cell_ends_loses_no_reply_and_later_interrupts_work(tmp_path, how):
    """An interrupt landing after the cell's code has ended, while its reply is being sent,
    is dropped: the reply arrives (without it the broker would wait out the timeout and
    restart the kernel) and the kernel goes on with its state; an interrupt of a later
    running cell still stops it, and one between executions is still ignored."""
    kernel = Kernel(tmp_path, template=how == "template")
    fork = None
    try:
        kc, pid = kernel.client, kernel.pid
        if how == "fork":
            fork = Fork(kc, tmp_path, "c1")
            kc, pid = fork.client, fork.pid
        assert status(kc, INTERRUPT_AS_THE_REPLY_GOES) == "ok"
        for attempt in range(3):
            # This execution's reply is the one the signal lands on.
            msg_id = kc.execute("_pending.append(1); x = %d" % attempt)
            reply = wait_reply(kc, msg_id, timeout=15)
            assert reply["status"] == "ok", reply
        assert value(kc, "x") == "2"
        # A running cell is still interrupted.
        msg_id = kc.execute("import time; time.sleep(30)")
        time.sleep(1.0)
        os.kill(pid, signal.SIGINT)
        reply = wait_reply(kc, msg_id, timeout=10)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        # A SIGINT between executions is ignored.
        os.kill(pid, signal.SIGINT)
        time.sleep(0.3)
        assert value(kc, "'alive'") == repr("alive")
    finally:
        if fork is not None:
            fork.stop()
        kernel.stop()
