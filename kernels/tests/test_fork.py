"""The in-kernel fork (``kernel_broker_fork.py``) against real kernels.

Each test starts a kernel through the boot script (``kernel`` mode) on ipc sockets in a
temporary directory, sends ``kb_fork_request`` and talks to the child with a second
client. Run with a Python that has jupyter_client and pytest (protocol-tests' venv):

    protocol-tests/.venv/bin/python -m pytest kernels/tests/test_fork.py

The kernels themselves run with ``kernels/.venv/bin/python``.
"""

import json
import os
import signal
import statistics
import sys
import textwrap
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from forkharness import (  # noqa: E402
    TIMEOUT,
    Fork,
    Kernel,
    alive,
    client,
    connect,
    connection,
    fork_request,
    private_dirty_kb,
    run,
    text,
    value,
    wait_reply,
)


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    yield k
    k.stop()


@pytest.fixture
def forks():
    made = []
    yield made
    for f in made:
        f.stop()


def make_fork(kernel_client, directory, name, forks):
    f = Fork(kernel_client, directory, name)
    forks.append(f)
    return f


STATE = """
import os, random, sys
import numpy as np
import matplotlib.pyplot as plt

x = 42
def double(v):
    return 2 * v
class Point:
    def __init__(self, a):
        self.a = a
p = Point(3)
squares = (i * i for i in range(100))
next(squares); next(squares)
text_file = open({path!r})
first_line = text_file.readline()
raw = os.open({path!r}, os.O_RDONLY)
first_bytes = os.read(raw, 3)
random.seed(7); random.random()
np.random.seed(3)
fig, ax = plt.subplots()
ax.plot([1, 2, 3], [3, 1, 2])
plt.close(fig)
os.chdir({cwd!r})
os.environ["KB_FORK_TEST"] = "carried"
"""


def write_data_file(tmp_path):
    """A file longer than a read buffer, so positions are the descriptor's own."""
    path = tmp_path / "data.txt"
    path.write_text("abcdefghij\n" + "".join("line %05d\n" % i for i in range(5000)))
    return str(path)


def test_every_kind_of_state_is_carried(kernel, forks, tmp_path):
    path = write_data_file(tmp_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    kc = kernel.client
    run(kc, STATE.format(path=path, cwd=str(cwd)))
    reply, outputs = run(kc, "x + 1")
    assert "43" in text(outputs)
    count = reply["execution_count"]

    child = make_fork(kc, tmp_path, "c1", forks).client

    # The execution count and In/Out history go on from the parent's.
    reply, outputs = run(child, "In[%d], Out[%d]" % (count, count))
    assert reply["execution_count"] == count + 1
    assert "('x + 1', 43)" in text(outputs)
    # Variables, functions and classes defined in cells, an imported module.
    assert value(child, "x") == "42"
    assert value(child, "double(21)") == "42"
    assert value(child, "(p.a, type(p) is Point, Point(5).a)") == "(3, True, 5)"
    assert value(child, "np.arange(3).sum()") == "np.int64(3)"
    # A generator part-way, in both.
    assert value(child, "next(squares)") == "4"
    assert value(kc, "next(squares)") == "4"
    # Random state: the same next numbers in both.
    child_random = value(child, "(random.random(), np.random.rand())")
    assert child_random == value(kc, "(random.random(), np.random.rand())")
    # An open file with its position; reading in the child does not move the parent.
    assert value(child, "first_line") == repr("abcdefghij\n")
    assert value(child, "text_file.readline()") == repr("line 00000\n")
    assert value(child, "os.read(raw, 3)") == "b'def'"
    assert value(child, "os.read(raw, 3)") == "b'ghi'"
    assert value(kc, "os.read(raw, 3)") == "b'def'"
    assert value(kc, "text_file.readline()") == repr("line 00000\n")
    run(child, "text_file.seek(0); os.lseek(raw, 0, 0)")
    assert value(kc, "os.read(raw, 3)") == "b'ghi'"
    # A matplotlib figure: kept, and shown through the child's own IOPub.
    assert value(child, "[[int(y) for y in l.get_ydata()] for l in ax.lines]") == "[[3, 1, 2]]"
    _, outputs = run(child, "display(fig)")
    assert any(
        m["msg_type"] == "display_data" and "image/png" in m["content"]["data"] for m in outputs
    )
    # The inline backend still shows a new figure at the end of a cell.
    _, outputs = run(child, "plt.plot([1, 2]); None")
    assert any(
        m["msg_type"] == "display_data" and "image/png" in m["content"]["data"] for m in outputs
    )
    # The working directory and environment.
    assert value(child, "os.getcwd()") == repr(str(cwd))
    assert value(child, "os.environ['KB_FORK_TEST']") == repr("carried")


def test_the_parent_moving_its_files_straight_after_the_fork_does_not_move_the_childs(kernel, forks, tmp_path):
    """The parent goes on as soon as ``fork()`` returns, before the child has reopened its
    files (it runs a few milliseconds later): here a cell's at-fork hook reads on in the
    parent at once, through the offsets the two still share. The child starts from the
    offsets of the fork all the same."""
    path = write_data_file(tmp_path)
    kc = kernel.client
    run(
        kc,
        "import os\n"
        "raw = os.open(%r, os.O_RDONLY)\n"
        "os.read(raw, 3)\n"
        "os.register_at_fork(after_in_parent=lambda: os.read(raw, 4000))\n" % path,
    )
    for i in range(3):
        child = make_fork(kc, tmp_path, "q%d" % i, forks).client
        assert value(child, "os.lseek(raw, 0, os.SEEK_CUR)") == str(3 + 4000 * i)
        assert value(child, "os.read(raw, 3)") == repr(open(path, "rb").read()[3 + 4000 * i :][:3])
    assert value(kc, "os.lseek(raw, 0, os.SEEK_CUR)") == str(3 + 4000 * 3)


def test_a_kernel_born_of_the_template_forks(tmp_path, forks):
    """The broker's kernels are forked from a template (non-dumpable, descriptors closed,
    the template's objects frozen): such a kernel forks as well."""
    kernel = Kernel(tmp_path, template=True)
    try:
        kc = kernel.client
        run(kc, "import numpy as np\nx = np.arange(4)")
        child = make_fork(kc, tmp_path, "c1", forks).client
        assert value(child, "int(x.sum())") == "6"
        run(child, "x[0] = 100")
        assert value(kc, "int(x.sum())") == "6"
        assert value(child, "int(x.sum())") == "106"
    finally:
        kernel.stop()


def test_parent_and_child_go_their_own_ways(kernel, forks, tmp_path):
    kc = kernel.client
    run(kc, "import os\nx = 1\nnames = ['a']")
    child = make_fork(kc, tmp_path, "c1", forks).client
    run(child, "x = 2\nnames.append('child')\nos.chdir('/')\nos.environ['ONLY'] = 'child'")
    assert value(kc, "x") == "1"
    assert value(kc, "names") == "['a']"
    assert value(kc, "os.getcwd()") == repr(str(tmp_path))
    assert value(kc, "os.environ.get('ONLY')") == "None"
    run(kc, "x = 3\ny = 'parent'")
    assert value(child, "x") == "2"
    assert value(child, "'y' in globals()") == "False"
    assert value(child, "os.getpid() != %d" % kernel.pid) == "True"
    # Output goes to each one's own clients: C-level writes too (the child's descriptors 1
    # and 2 feed pipes of its own, not the parent's).
    # The raw write is read from the pipe by a thread of the child's, which may come late
    # on a loaded machine: the cell waits for it, so the text belongs to this execution.
    code = "import time; print('from the child'); os.write(1, b'raw child\\n'); time.sleep(1)"
    _, outputs = run(child, code)
    _, outputs2 = run(child, "import sys; sys.stdout.flush()")
    assert "from the child" in text(outputs)
    assert "raw child" in text(outputs) + text(outputs2)
    _, outputs = run(kc, "print('from the parent')")
    assert text(outputs) == "from the parent\n"


def test_interrupt_reaches_the_child_alone(kernel, forks, tmp_path):
    kc = kernel.client
    run(kc, "import time, os")
    fork = make_fork(kc, tmp_path, "c1", forks)
    child = fork.client

    # A signal to the child's pid: the sleeping cell wakes with KeyboardInterrupt.
    msg_id = child.execute("time.sleep(30)")
    time.sleep(1.0)
    parent_msg = kc.execute("time.sleep(2); 'parent slept'")
    os.kill(fork.pid, signal.SIGINT)
    start = time.monotonic()
    reply = wait_reply(child, msg_id)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - start < 5
    assert wait_reply(kc, parent_msg)["status"] == "ok"

    # An interrupt_request on the child's control channel.
    msg_id = child.execute("time.sleep(30)")
    time.sleep(1.0)
    child.control_channel.send(child.session.msg("interrupt_request", {}))
    reply = wait_reply(child, msg_id)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    # Every thread of the child but the main one blocks SIGINT, as in a fresh kernel
    # (the boot script's rule), so the interrupt lands where the cell runs. (Read once
    # the kernel is idle: from a cell's end to its request's end the main thread holds
    # SIGINT too, see `interrupts_reach_cells_only`.)
    wait_idle(child, msg_id)
    for task in os.listdir("/proc/%d/task" % fork.pid):
        with open("/proc/%d/task/%s/status" % (fork.pid, task)) as f:
            blocked = int(next(l for l in f if l.startswith("SigBlk:")).split()[1], 16)
        assert bool(blocked & (1 << (signal.SIGINT - 1))) == (int(task) != fork.pid), task
    # A SIGINT between executions is ignored, as by a fresh kernel.
    os.kill(fork.pid, signal.SIGINT)
    time.sleep(0.3)
    assert value(child, "1 + 1") == "2"
    assert value(kc, "1 + 1") == "2"


def wait_idle(kc, msg_id, timeout=TIMEOUT):
    """Until the kernel says it is idle after request `msg_id`."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if (msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id):
            return


def test_a_busy_kernel_forks_when_its_execution_ends(kernel, forks, tmp_path):
    """Shell messages queue behind a running execution: the fork waits for it, and the
    child holds what the execution left."""
    kc = kernel.client
    kc.execute("import time\ntime.sleep(1.5)\nx = 'after'")
    time.sleep(0.3)
    start = time.monotonic()
    fork = make_fork(kc, tmp_path, "c1", forks)
    assert time.monotonic() - start > 1.0
    assert value(kc, "x") == repr("after")  # (the execution's reply was passed over)
    assert value(fork.client, "x") == repr("after")


def test_input_in_the_child(kernel, forks, tmp_path):
    child = make_fork(kernel.client, tmp_path, "c1", forks).client
    outputs = []
    reply = child.execute_interactive(
        "answer = input('name? ')",
        allow_stdin=True,
        stdin_hook=lambda msg: child.input("from the child's stdin"),
        output_hook=outputs.append,
        timeout=TIMEOUT,
    )
    assert reply["content"]["status"] == "ok"
    assert value(child, "answer") == repr("from the child's stdin")


def test_an_error_in_the_child_is_reported(kernel, forks, tmp_path):
    child = make_fork(kernel.client, tmp_path, "c1", forks).client
    reply, outputs = run(child, "1 / 0", allow_error=True)
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError"
    errors = [m for m in outputs if m["msg_type"] == "error"]
    assert errors and errors[0]["content"]["ename"] == "ZeroDivisionError"
    assert value(child, "1 + 1") == "2"


def unix_socket_paths(pid):
    """The paths of the unix sockets process `pid` holds."""
    inodes = set()
    for name in os.listdir("/proc/%d/fd" % pid):
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, name))
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in list(f)[1:]]
    return {row[7] for row in rows if len(row) >= 8 and row[6] in inodes}


def test_the_child_outlives_its_parent(kernel, forks, tmp_path):
    run(kernel.client, "import os\nx = 'kept'")
    fork = make_fork(kernel.client, tmp_path, "c1", forks)
    # The child holds none of the parent's sockets (they end with the parent), its own.
    paths = unix_socket_paths(fork.pid)
    assert not [p for p in paths if p.startswith(kernel.info["ip"] + "-")], paths
    assert [p for p in paths if p.startswith(fork.info["ip"] + "-")], paths
    kernel.proc.kill()
    kernel.proc.wait(TIMEOUT)
    assert value(fork.client, "x") == repr("kept")
    assert value(fork.client, "os.getppid() != %d" % kernel.pid) == "True"


def test_two_forks_and_a_fork_of_a_fork(kernel, forks, tmp_path):
    kc = kernel.client
    run(kc, "import os\nx = 0")
    a = make_fork(kc, tmp_path, "a", forks)
    b = make_fork(kc, tmp_path, "b", forks)
    assert len({kernel.pid, a.pid, b.pid}) == 3
    run(a.client, "x = 'a'")
    run(b.client, "x = 'b'")
    assert value(a.client, "x") == repr("a")
    assert value(b.client, "x") == repr("b")
    assert value(kc, "x") == "0"
    # A fork of the fork carries the fork's state, then goes its own way.
    aa = make_fork(a.client, tmp_path, "aa", forks)
    assert value(aa.client, "x") == repr("a")
    run(aa.client, "x = 'aa'")
    assert value(a.client, "x") == repr("a")
    assert value(aa.client, "os.getpid()") == str(aa.pid)
    # The forks are not their parent's children: its shutdown does not end them.
    kc.shutdown()
    kernel.proc.wait(TIMEOUT)
    assert alive(a.pid) and alive(b.pid) and alive(aa.pid)
    assert value(b.client, "x") == repr("b")
    # A fork shuts down like a kernel: it replies, and its process ends.
    reply = b.client.shutdown(reply=True, timeout=TIMEOUT)
    assert reply["content"]["status"] == "ok"
    deadline = time.monotonic() + 10
    while alive(b.pid):
        assert time.monotonic() < deadline, "the fork did not end after shutdown"
        time.sleep(0.1)
    # So does one that runs exit() in a cell.
    aa.client.execute("exit()")
    deadline = time.monotonic() + 10
    while alive(aa.pid):
        assert time.monotonic() < deadline, "the fork did not end after exit()"
        time.sleep(0.1)
    assert value(a.client, "x") == repr("a")


def test_a_fork_of_a_fork_that_has_not_run_draws_what_the_original_would(kernel, forks, tmp_path):
    """A checkpoint's copy never runs a cell: a fork of it (a rewind) must start from the
    `random` state its first execution would start from, not from what its start-up drew
    since it was built."""
    kc = kernel.client
    run(kc, "import random\nrandom.seed(11)")
    a = make_fork(kc, tmp_path, "a", forks)
    aa = make_fork(a.client, tmp_path, "aa", forks)  # `a` has run nothing yet
    expected = value(kc, "random.random()")
    assert value(aa.client, "random.random()") == expected
    assert value(a.client, "random.random()") == expected


def test_an_ended_fork_is_reaped(kernel, forks, tmp_path):
    kc = kernel.client
    fork = make_fork(kc, tmp_path, "c1", forks)
    assert value(kc, "__import__('os').getpid()") == str(kernel.pid)
    os.kill(fork.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists("/proc/%d" % fork.pid):
        assert time.monotonic() < deadline, "fork %d left a zombie" % fork.pid
        run(kc, "None")  # the parent reaps its ended forks after each execution
        time.sleep(0.1)


def test_what_is_not_carried_fails_clearly(kernel, forks, tmp_path):
    kc = kernel.client
    run(kc, textwrap.dedent("""
        import os, threading, subprocess, time
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait, daemon=True)
        worker.start()
        sleeper = subprocess.Popen(['sleep', '30'])
    """))
    child = make_fork(kc, tmp_path, "c1", forks).client
    # Threads a cell started do not exist in the fork.
    assert value(child, "worker.is_alive()") == "False"
    assert value(kc, "worker.is_alive()") == "True"
    # A subprocess stays the parent's: the fork cannot wait for it (Popen.wait and poll
    # take the ECHILD for an exit and say 0: the documented caveat).
    reply, _ = run(child, "os.waitpid(sleeper.pid, 0)", allow_error=True)
    assert reply["status"] == "error" and reply["ename"] == "ChildProcessError"
    assert value(kc, "sleeper.poll()") == "None"
    run(kc, "stop.set(); sleeper.kill(); sleeper.wait()")


BAD_CONNECTIONS = {
    "no connection": {},
    "connection not an object": {"connection": "ipc:///tmp/x"},
    "missing port": {"drop": "hb_port"},
    "port as a string": {"set": ("shell_port", "1")},
    "port zero": {"set": ("iopub_port", 0)},
    "port as a bool": {"set": ("stdin_port", True)},
    "ports not distinct": {"set": ("control_port", 1)},
    "tcp transport": {"set": ("transport", "tcp")},
    "empty key": {"set": ("key", "")},
    "key not a string": {"set": ("key", 5)},
    "unknown signature scheme": {"set": ("signature_scheme", "hmac-md5")},
    "path outside the directory": {"ip": "/tmp/kb-fork-outside/x"},
    "relative path": {"ip": "x"},
    "path with ..": {"ip": "{dir}/sub/../../x"},
    "path through a missing directory": {"ip": "{dir}/missing/x"},
    "path of existing sockets": {"ip": "{dir}/k"},
    "path too long": {"ip": "{dir}/" + "x" * 200},
}


@pytest.mark.parametrize("case", sorted(BAD_CONNECTIONS))
def test_bad_requests_are_refused(kernel, tmp_path, case):
    kc = kernel.client
    run(kc, "x = 'still here'")
    change = BAD_CONNECTIONS[case]
    if case in ("no connection", "connection not an object"):
        content = change
    else:
        conn = connection(str(tmp_path / "c"))
        if "drop" in change:
            del conn[change["drop"]]
        if "set" in change:
            conn[change["set"][0]] = change["set"][1]
        if "ip" in change:
            conn["ip"] = change["ip"].format(dir=str(tmp_path))
        content = {"connection": conn}
    reply = fork_request(kc, content)
    assert reply["status"] == "error", reply
    assert reply["ename"] == "ForkRefused" and reply["evalue"]
    assert "pid" not in reply
    assert value(kc, "x") == repr("still here")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("c-")) == []


def test_a_request_on_a_subshell_is_refused(kernel, tmp_path):
    kc = kernel.client
    run(kc, "x = 'main'")
    create = kc.session.msg("create_subshell_request", {})
    kc.control_channel.send(create)
    reply = kc.control_channel.get_msg(timeout=TIMEOUT)
    assert reply["content"]["status"] == "ok", reply["content"]
    subshell = reply["content"]["subshell_id"]
    msg = kc.session.msg("kb_fork_request", {"connection": connection(str(tmp_path / "c"))})
    msg["header"]["subshell_id"] = subshell
    kc.shell_channel.send(msg)
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            break
    assert reply["content"]["status"] == "error"
    assert "subshell" in reply["content"]["evalue"]
    assert value(kc, "x") == repr("main")


def test_fork_speed_and_memory_with_a_200_mb_dataframe(kernel, tmp_path):
    """fork -> first result in the child, p50 over 20 (goal: 30 ms), and the child's private
    memory right after the fork (goal: 10 MB). Prints the numbers."""
    kc = kernel.client
    run(kc, textwrap.dedent("""
        import numpy as np, pandas as pd
        df = pd.DataFrame(np.random.rand(25_000_000 // 10, 10))  # 200 MB of float64
        int(df.memory_usage().sum())
    """), timeout=120)
    assert int(value(kc, "int(df.memory_usage(index=False).sum())")) >= 200_000_000

    def round_trip(client):
        start = time.perf_counter()
        msg_id = client.execute("1+1", silent=True, user_expressions={"r": "1+1"})
        reply = wait_reply(client, msg_id)
        assert reply["user_expressions"]["r"]["data"]["text/plain"] == "2"
        return time.perf_counter() - start

    before = statistics.median(round_trip(kc) for _ in range(20))
    firsts, replies, private = [], [], []
    for i in range(20):
        info = connection(str(tmp_path / ("b%d" % i)))
        start = time.perf_counter()
        reply = fork_request(kc, {"connection": info})
        replied = time.perf_counter()
        assert reply["status"] == "ok", reply
        child = client()
        child.load_connection_info(info)
        child.start_channels()
        try:
            msg_id = child.execute("1+1", silent=True, user_expressions={"r": "1+1"})
            result = wait_reply(child, msg_id)
            done = time.perf_counter()
            assert result["user_expressions"]["r"]["data"]["text/plain"] == "2"
            # Built and serving: what the fork itself made is in its figure.
            private.append(private_dirty_kb(reply["pid"]))
        finally:
            child.stop_channels()
            os.kill(reply["pid"], signal.SIGKILL)
        firsts.append(done - start)
        replies.append(replied - start)
    after = statistics.median(round_trip(kc) for _ in range(20))
    numbers = {
        "fork_to_first_result_ms_p50": round(statistics.median(firsts) * 1000, 1),
        "fork_to_first_result_ms_max": round(max(firsts) * 1000, 1),
        "fork_reply_ms_p50": round(statistics.median(replies) * 1000, 1),
        "child_private_dirty_mb_p50": round(statistics.median(private) / 1024, 1),
        "child_private_dirty_mb_max": round(max(private) / 1024, 1),
        "parent_round_trip_ms_before": round(before * 1000, 2),
        "parent_round_trip_ms_after": round(after * 1000, 2),
        "parent_private_dirty_mb": round(private_dirty_kb(kernel.pid) / 1024, 1),
    }
    print("\nkb_fork numbers:", json.dumps(numbers))
    out = os.environ.get("KB_FORK_NUMBERS")
    if out:
        with open(out, "w") as f:
            json.dump(numbers, f)
    # Loose bounds: the goals are reported, not enforced, on a loaded shared machine.
    assert numbers["fork_to_first_result_ms_p50"] < 1000
    assert numbers["child_private_dirty_mb_p50"] < 100


def fd_count(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def test_a_lineage_of_forks_holds_one_generations_machinery(kernel, forks, tmp_path):
    """A checkpoint after every execution makes a lineage of forks, each the fork of the
    last: each closes its parent's machinery, so the descriptors do not pile up, while what
    the cells opened is kept."""
    path = tmp_path / "lines.txt"
    path.write_text("".join("line %d\n" % i for i in range(100)))
    kc = kernel.client
    run(kc, "import os, socket\nx = 0\nf = open(%r)\nf.readline()\na, b = socket.socketpair()" % str(path))
    counts = []
    client = kc
    # 95 generations nest 35 + 11 x 95 frames: past the default recursion limit of 1000
    # unless each fork makes room.
    for generation in range(95):
        fork = make_fork(client, tmp_path, "g%d" % generation, forks)
        run(fork.client, "x += 1")
        counts.append(fd_count(fork.pid))
        client = fork.client
        if len(forks) > 3:
            forks.pop(0).stop()
    assert value(client, "x") == "95"
    # Room for the cells' own recursion too.
    run(client, "def deep(n):\n    return 0 if n == 0 else 1 + deep(n - 1)")
    assert value(client, "deep(800)") == "800"
    # The cell's file (its own offset in each generation) and socket pair are still there.
    assert value(client, "f.readline()") == repr("line 1\n")
    assert value(client, "a.send(b'hi') and b.recv(2)") == repr(b"hi")
    assert counts[-1] <= counts[0] + 2, counts


def test_a_fork_of_a_fork_keeps_its_own_output_through_a_collection(kernel, forks, tmp_path):
    """Each generation's app configures the kernel's logger again, dropping the handler
    ipykernel pointed at the parent's copy of descriptor 2 (a FileIO that closes its number
    when collected); the child reuses that number for its own copy. A collection in the
    grandchild must not close the descriptors its streams and log write to. (Collection
    off until then: when it runs is otherwise a matter of allocation counts.)"""
    run(kernel.client, "import gc\ngc.disable()")
    first = make_fork(kernel.client, tmp_path, "f1", forks)
    run(first.client, "y = 1")
    second = make_fork(first.client, tmp_path, "f2", forks)
    check = (
        "import gc, logging, os, sys\n"
        "gc.collect()\n"
        "fds = [sys.stdout._original_stdstream_copy, sys.stderr._original_stdstream_copy]\n"
        "fds += [h.stream.fileno() for h in logging.getLogger('IPKernelApp').handlers\n"
        "        if isinstance(h, logging.StreamHandler)]\n"
        "for fd in fds:\n"
        "    os.fstat(fd)\n"
        "os.system('echo from-a-subprocess')\n"
        "import time; time.sleep(0.5)\n"
    )
    _, outputs = run(second.client, check)
    assert "from-a-subprocess" in text(outputs), outputs
    assert value(second.client, "y") == "1"


def test_a_kernel_holding_more_than_fd_setsize_descriptors_forks(kernel, forks, tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip("the hard limit on descriptors (%d) is below 1400" % hard)
    kc = kernel.client
    run(kc, textwrap.dedent("""
        import os, resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096, hard))
        held = [os.open('/dev/null', os.O_RDONLY) for _ in range(1200)]
        y = max(held) > 1024
    """))
    assert value(kc, "y") == "True"
    fork = make_fork(kc, tmp_path, "many", forks)
    assert value(fork.client, "len(held)") == "1200"


def test_a_fork_after_clients_came_and_went(kernel, forks, tmp_path):
    """The machinery noted at the first execution includes the connections of clients
    that were attached then; once they leave, their descriptor numbers are free for the
    fork's own pipe or a cell's file, which the child must not close as machinery."""
    extra = [connect(kernel.info) for _ in range(3)]
    for c in extra:
        run(c, "1")
    for c in extra:
        c.stop_channels()
    time.sleep(0.5)
    path = tmp_path / "after.txt"
    path.write_text("kept\n")
    kc = kernel.client
    run(kc, "files = [open(%r) for _ in range(8)]" % str(path))
    for n in range(3):
        fork = make_fork(kc, tmp_path, "after%d" % n, forks)
        assert value(fork.client, "[f.read() for f in files]") == repr(["kept\n"] * 8)
        run(kc, "[f.seek(0) for f in files]")


def test_a_lineage_past_its_bound_is_refused_clearly(kernel, forks, tmp_path):
    kc = kernel.client
    run(kc, "import sys\nsys.modules['kernel_broker_fork'].MAX_GENERATIONS = 2")
    a = make_fork(kc, tmp_path, "a", forks)
    b = make_fork(a.client, tmp_path, "b", forks)
    reply = fork_request(b.client, {"connection": connection(str(tmp_path / "c"))})
    assert reply["status"] == "error", reply
    assert "restart the session" in reply["evalue"] and "2 times" in reply["evalue"], reply
    # The kernel that refused goes on; its parent still forks.
    assert value(b.client, "1 + 1") == "2"
    make_fork(kc, tmp_path, "d", forks)


BAD_HOLDS = {
    "hold not an object": [1],
    "no connection file": {},
    "connection file not a string": {"connection_file": 5},
    "relative connection file": {"connection_file": "c.json"},
    "connection file with ..": {"connection_file": "{dir}/x/../../c.json"},
    "connection file outside the fork directory": {"connection_file": "/etc/c.json"},
    "connection file with a NUL": {"connection_file": "{dir}/c\0.json"},
    "private not a list": {"connection_file": "{dir}/c.json", "private": "/tmp"},
    "private relative": {"connection_file": "{dir}/c.json", "private": ["tmp"]},
    "private not strings": {"connection_file": "{dir}/c.json", "private": [3]},
    "private too many": {"connection_file": "{dir}/c.json", "private": ["/tmp"] * 9},
}


@pytest.mark.parametrize("case", sorted(BAD_HOLDS))
def test_bad_hold_requests_are_refused(kernel, tmp_path, case):
    kc = kernel.client
    run(kc, "x = 'still here'")
    hold = BAD_HOLDS[case]
    if isinstance(hold, dict) and isinstance(hold.get("connection_file"), str):
        hold = dict(hold, connection_file=hold["connection_file"].format(dir=str(tmp_path)))
    reply = fork_request(kc, {"hold": hold})
    assert reply["status"] == "error", reply
    assert reply["ename"] == "ForkRefused" and reply["evalue"]
    assert "pid" not in reply
    assert value(kc, "x") == repr("still here")


def test_a_held_child_keeps_only_its_files_and_wakes_only_for_the_broker(kernel, tmp_path):
    """A held child (what the broker dumps with CRIU for a copy into a sandbox of its own)
    keeps the files cells opened and nothing else (CRIU cannot carry a socket or a pipe, and
    the kernel's own output, here a log file, is not carried),
    with 0-2 on /dev/null, and waits for the wake signal from outside its pid namespace:
    one sent from within (as here, or by another process of the sandbox) does not wake it."""
    kc = kernel.client
    data = tmp_path / "held.txt"
    data.write_text("one\ntwo\n")
    run(
        kc,
        "import socket, os\n"
        "held_file = open(%r)\n"
        "held_file.readline()\n"
        "a, b = socket.socketpair()\n"
        "r, w = os.pipe()\n" % str(data),
    )
    reply = fork_request(kc, {"hold": {"connection_file": str(tmp_path / "c.json")}})
    assert reply["status"] == "ok", reply
    pid = reply["pid"]
    try:
        # Read once its answer's pipe is closed (it answers, then closes it, then waits).
        deadline = time.monotonic() + TIMEOUT
        while True:
            targets = {}
            for fd in os.listdir("/proc/%d/fd" % pid):
                try:
                    targets[int(fd)] = os.readlink("/proc/%d/fd/%s" % (pid, fd))
                except FileNotFoundError:
                    continue
            if not any(t.startswith("pipe:") for t in targets.values()):
                break
            assert time.monotonic() < deadline, targets
            time.sleep(0.01)
        assert [targets[fd] for fd in (0, 1, 2)] == ["/dev/null"] * 3, targets
        rest = {fd: t for fd, t in targets.items() if fd > 2}
        # The file the cell opened, and not the kernel's own output, a file here (its log):
        # a sandbox may remove that log once the kernel that wrote it ends.
        assert set(rest.values()) == {str(data)}, rest
        # Waiting (in sigtimedwait, which takes the wake signal off the blocked set while it
        # waits: SigBlk says nothing), not running.
        deadline = time.monotonic() + TIMEOUT
        while True:
            with open("/proc/%d/status" % pid) as f:
                state = [line for line in f if line.startswith("State:")][0]
            if "S (sleeping)" in state or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert "S (sleeping)" in state, state
        # From this pid namespace: ignored, it stays held and binds nothing. (Signal 40's
        # default action ends a process: had it not been waited for, it would be gone.)
        os.kill(pid, 40)
        time.sleep(0.3)
        assert alive(pid)
        assert not (tmp_path / "c.json").exists()
        assert unix_socket_paths(pid) == set()
    finally:
        os.kill(pid, signal.SIGKILL)
    # The parent goes on, its own file where it was.
    assert value(kc, "held_file.readline()") == repr("two\n")


def test_a_held_child_stopped_longer_than_its_timeout_still_waits_to_be_woken(kernel, tmp_path):
    """A held child is dumped for a pause or a snapshot and restored any time later, its
    clock then past any deadline it had: the time it spends stopped must not count. Here it
    waits at most 2 s, is stopped for 4 s (as a dump and a restore stop it), and still waits
    to be woken after; left alone, it ends by itself once 2 s have passed."""
    kc = kernel.client
    run(kc, "import kernel_broker_fork as _kbf\n_kbf.HOLD_TIMEOUT = 2.0\n_kbf.HOLD_STEP = 0.2")
    reply = fork_request(kc, {"hold": {"connection_file": str(tmp_path / "c.json")}})
    assert reply["status"] == "ok", reply
    pid = reply["pid"]
    try:
        time.sleep(0.3)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(4)
        os.kill(pid, signal.SIGCONT)
        time.sleep(1)
        assert alive(pid), "a held child stopped past its timeout ended on waking"
        # Its timeout runs again from there: it ends by itself, never woken.
        deadline = time.monotonic() + TIMEOUT
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), "a held child never woken ends by itself"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_held_child_holding_what_would_not_come_back_refuses(kernel, tmp_path):
    """A kernel sharing its user's workspace is paused with `"private"`: the directories of
    its sandbox that the one it resumes in will not have. A held child holding a file there
    (open, mapped, or as its working directory) refuses, naming it, and is gone; the kernel
    goes on, and once it lets go the hold is granted."""
    kc = kernel.client
    private = tmp_path / "private"
    private.mkdir()
    run(kc, "import mmap, os\npf = open(%r, 'w+')\npf.write('x' * 4096); pf.flush()\n"
            "mm = mmap.mmap(pf.fileno(), 4096)" % str(private / "held.txt"))
    hold = {"connection_file": str(tmp_path / "c.json"), "private": [str(private)]}
    reply = fork_request(kc, {"hold": hold})
    assert reply["status"] == "error" and reply["ename"] == "ForkRefused", reply
    assert str(private / "held.txt") in reply["evalue"] and "would not come back" in reply["evalue"]
    assert value(kc, "mm[:1]") == repr(b"x")
    # Mapped only (the file closed), it still refuses; as its working directory too.
    run(kc, "pf.close()")
    assert fork_request(kc, {"hold": hold})["status"] == "error"
    run(kc, "mm.close(); os.chdir(%r)" % str(private))
    reply = fork_request(kc, {"hold": hold})
    assert reply["status"] == "error" and "working directory" in reply["evalue"], reply
    run(kc, "os.chdir('/')")
    reply = fork_request(kc, {"hold": hold})
    assert reply["status"] == "ok", reply
    try:
        os.kill(reply["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_line(sock, timeout=TIMEOUT):
    """One line from `sock`, parsed as JSON."""
    sock.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        assert chunk, "the held checkpoint closed its control socket"
        data += chunk
    return json.loads(data)


def test_a_held_checkpoint_forks_a_kernel_at_each_wake_and_ends_with_its_control(kernel, forks, tmp_path):
    """A checkpoint's held child (``{"hold": {"control": ...}}``) connects to the broker's
    control socket before it answers, holds no socket but that one and runs no thread
    (the live kernel's thread is not carried), and forks a kernel with the state of the
    moment it was taken for each connection sent to it, however the live kernel went on;
    a bad connection is refused without ending it; closing the socket ends it."""
    import socket
    import struct

    kc = kernel.client
    data = write_data_file(tmp_path)
    run(
        kc,
        "import os, threading, time, random\n"
        "x = 41\n"
        "random.seed(5)\n"
        "threading.Thread(target=time.sleep, args=(600,), name='ticker', daemon=True).start()\n"
        "data = os.open(%r, os.O_RDONLY)\n"
        "os.read(data, 3)\n" % data,
    )
    path = str(tmp_path / "ctl")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(TIMEOUT)
    reply = fork_request(kc, {"hold": {"control": path}})
    assert reply["status"] == "ok", reply
    held = reply["pid"]
    try:
        control, _ = listener.accept()
        creds = control.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        assert struct.unpack("3i", creds)[0] == held
        run(kc, "x = 100; random.random(); os.read(data, 3)")
        assert os.listdir("/proc/%d/task" % held) == [str(held)]
        assert unix_socket_paths(held) <= {path, ""}, unix_socket_paths(held)
        expected = value(kc, "random.seed(5) or random.random()")
        for i in range(2):
            info = connection(os.path.join(str(tmp_path), "w%d" % i))
            control.sendall((json.dumps({"connection": info}) + "\n").encode())
            answer = read_line(control)
            assert answer["status"] == "ok", answer
            child = connect(info)
            f = Fork.__new__(Fork)
            f.info, f.pid, f.client = info, answer["pid"], child
            forks.append(f)
            assert value(child, "x") == "41"
            assert value(child, "random.random()") == expected
            assert value(child, "'ticker' in [t.name for t in threading.enumerate()]") == "False"
            # Each starts at the checkpoint's offsets: neither the live kernel's reading
            # since, nor the kernel forked from it before, moved them.
            assert value(child, "os.read(data, 3)") == "b'def'"
            run(child, "x = 7; os.read(data, 3)")
            # The child holds no control socket of the checkpoint's.
            assert path not in unix_socket_paths(answer["pid"])
        assert value(kc, "x") == "100"
        bad = connection("/etc/kb")
        control.sendall((json.dumps({"connection": bad}) + "\n").encode())
        answer = read_line(control)
        assert answer["status"] == "error" and "outside" in answer["evalue"], answer
        control.sendall(b"not json\n")
        assert read_line(control)["status"] == "error"
        assert alive(held)
        control.close()
        deadline = time.monotonic() + TIMEOUT
        while alive(held):
            assert time.monotonic() < deadline, "the checkpoint outlived its control socket"
            time.sleep(0.01)
        # Its children are kernels of their own and go on.
        assert value(forks[0].client, "x") == "7"
    finally:
        try:
            os.kill(held, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_held_checkpoint_without_its_control_ends_and_bad_ones_are_refused(kernel, tmp_path):
    """No broker listening: the held child (which answered once its files were its own)
    ends, and the kernel goes on; a control path outside the fork directory is refused."""
    kc = kernel.client
    reply = fork_request(kc, {"hold": {"control": str(tmp_path / "nobody")}})
    assert reply["status"] == "ok", reply
    deadline = time.monotonic() + TIMEOUT
    while alive(reply["pid"]):
        assert time.monotonic() < deadline, "a held child without its broker lives on"
        time.sleep(0.01)
    for bad in [{"control": "/etc/ctl"}, {"control": 5}, {"control": str(tmp_path) + "/../x"}]:
        reply = fork_request(kc, {"hold": bad})
        assert reply["status"] == "error", (bad, reply)
    assert value(kc, "1 + 1") == "2"
