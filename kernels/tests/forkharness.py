"""Shared harness of the fork tests: a real kernel started through the boot script on ipc
sockets in a temporary directory, clients, and ``kb_fork_request``."""

import json
import queue
import os
import secrets
import subprocess
import sys
import time

import zmq
from jupyter_client import BlockingKernelClient

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.dirname(HERE)
KERNEL_PYTHON = os.path.join(KERNELS, ".venv", "bin", "python")
BOOT = os.path.join(KERNELS, "kernel_broker_boot.py")
PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
TIMEOUT = 60
# A fork answers before it binds its sockets: the clients' connections retry every 5 ms
# instead of ZeroMQ's 100.
CONTEXT = zmq.Context()
CONTEXT.setsockopt(zmq.RECONNECT_IVL, 5)


def client():
    """A kernel client on the tests' context."""
    return BlockingKernelClient(context=CONTEXT)


def connection(prefix):
    info = {name: i + 1 for i, name in enumerate(PORTS)}
    info.update(
        transport="ipc", ip=str(prefix), key=secrets.token_hex(16), signature_scheme="hmac-sha256"
    )
    return info


class Kernel:
    """A kernel process started by the boot script: plainly (``kernel`` mode), or forked
    by a template (``template`` mode, the broker's default) when `template` is true."""

    def __init__(self, directory, name="k", template=False):
        self.directory = str(directory)
        self.info = connection(os.path.join(self.directory, name))
        self.connection_file = os.path.join(self.directory, name + ".json")
        with open(self.connection_file, "w") as f:
            json.dump(self.info, f)
        self.log = open(os.path.join(self.directory, name + ".log"), "w")
        args = ["-f", self.connection_file, "--HistoryManager.hist_file=:memory:"]
        mode = ["template", "--preload", "numpy"] if template else ["kernel", "--"] + args
        self.proc = subprocess.Popen(
            [KERNEL_PYTHON, "-I", BOOT] + mode,
            stdin=subprocess.PIPE if template else subprocess.DEVNULL,
            stdout=subprocess.PIPE if template else subprocess.DEVNULL,
            stderr=self.log, cwd=self.directory, env=kernel_environment(),
        )
        self.pid = self.proc.pid
        try:
            self._start(template, args)
        except BaseException:
            self.proc.kill()
            if self.pid != self.proc.pid:
                os.kill(self.pid, 9)
            self.proc.wait(TIMEOUT)
            self.log.close()
            raise

    def _start(self, template, args):
        if template:
            self.template = self.proc
            assert self._answer().get("ready"), "the template did not start"
            self._ask({"op": "fork", "id": "1", "args": args, "env": {},
                       "connection_file": self.connection_file})
            self.pid = self._answer()["pid"]
            self._ask({"op": "go", "id": "1"})
            assert self._answer().get("released") == "1"
        self.client = connect(self.info)

    def _ask(self, request):
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def _answer(self):
        return json.loads(self.proc.stdout.readline())

    def stop(self):
        self.client.stop_channels()
        if self.pid != self.proc.pid:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)
        self.log.close()


def kernel_environment():
    """The test's environment without pytest's marker: ipykernel does not capture the
    descriptors 1 and 2 of a kernel that sees it, and these tests check that capture."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def connect(info, timeout=TIMEOUT):
    kc = client()
    kc.load_connection_info(info)
    kc.start_channels()
    # Not `wait_for_ready`: it calls a kernel dead when one heartbeat is late, which a
    # loaded machine starting a kernel can make happen. A kernel_info reply, and an IOPub
    # message after it (IOPub is subscribed), are the proof.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg_id = kc.kernel_info()
        try:
            while kc.get_shell_msg(timeout=1)["parent_header"].get("msg_id") != msg_id:
                pass
            kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue
        while True:  # the rest of the kernel_info's IOPub messages
            try:
                kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                return kc
    raise TimeoutError("no kernel_info reply from %s" % info["ip"])


def run(kc, code, timeout=TIMEOUT, allow_error=False):
    """Executes `code`; returns (reply content, IOPub messages of the execution)."""
    outputs = []
    reply = kc.execute_interactive(code, output_hook=outputs.append, timeout=timeout)
    content = reply["content"]
    if not allow_error:
        assert content["status"] == "ok", (code, content)
    return content, outputs


def wait_reply(kc, msg_id, timeout=TIMEOUT):
    """The content of the shell reply to request `msg_id` (other replies are passed over)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def text(outputs):
    """stdout text and text/plain results of an execution's outputs, joined."""
    parts = []
    for msg in outputs:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            parts.append(content["text"])
        elif kind in ("execute_result", "display_data"):
            parts.append(content["data"].get("text/plain", ""))
    return "".join(parts)


def value(kc, expression):
    """The repr of `expression` evaluated in the kernel, as Python sees it."""
    _, outputs = run(kc, "print(repr(%s))" % expression)
    return text(outputs).strip()


def fork_request(kc, content, timeout=TIMEOUT):
    """Sends ``kb_fork_request`` with `content`; returns the reply's content."""
    msg = kc.session.msg("kb_fork_request", content)
    kc.shell_channel.send(msg)
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            assert reply["msg_type"] == "kb_fork_reply"
            return reply["content"]


class Fork:
    """A child kernel made by ``kb_fork_request``."""

    def __init__(self, parent_client, directory, name):
        self.info = connection(os.path.join(str(directory), name))
        start = time.perf_counter()
        reply = fork_request(parent_client, {"connection": self.info})
        self.reply_seconds = time.perf_counter() - start
        assert reply["status"] == "ok", reply
        self.pid = reply["pid"]
        try:
            self.client = connect(self.info)
        except BaseException:
            os.kill(self.pid, 9)
            raise

    def stop(self):
        self.client.stop_channels()
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def private_dirty_kb(pid):
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise AssertionError("no Private_Dirty in smaps_rollup")
