"""E2B's pseudo-terminals (`sandbox.pty`) and metrics (`get_metrics`) through E2B's own SDKs
(pinned: e2b 2.63.0, e2b-code-interpreter 2.11.5; JS @e2b/code-interpreter 2.8.0), written
as an E2B user's code would be, on both sandbox backends where the backend matters.

What E2B does, from its sources: the SDKs' `Pty` (e2b/sandbox_sync/commands/pty.py, the JS
SDK's `Pty` class) start `/bin/bash -i -l` with TERM=xterm-256color, LANG and LC_ALL
C.UTF-8 and `pty: {size: {rows, cols}}`; envd (e2b-dev/infra packages/envd/internal/
services/process/handler/handler.go) runs it on a pty whose output comes as `pty` data
events, writes `SendInput`'s `pty` bytes to it, resizes it on `Update`
(services/process/update.go) and kills it with `SendSignal`.
"""

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import BOB

JS_DIR = Path(__file__).parent / "e2b-js"
PY = "/opt/kernel-venv/bin/python"


class Screen:
    """What a terminal printed, gathered by a thread that iterates the SDK's handle."""

    def __init__(self, handle):
        self.handle = handle
        self.data = bytearray()
        self.lock = threading.Lock()
        self.error = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for _, _, pty in self.handle:
                if pty is not None:
                    with self.lock:
                        self.data.extend(pty)
        except Exception as e:  # the end of the stream, as the SDK raises it
            self.error = e

    def text(self):
        with self.lock:
            return self.data.decode("utf-8", "replace")

    def wait_until(self, pred, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self.text()):
                return self.text()
            time.sleep(0.05)
        raise AssertionError(
            f"never seen; the terminal showed:\n{self.text()[-2000:]!r}; stream error: {self.error!r}"
        )

    def wait_for(self, needle, timeout=30):
        """Waits for a line the terminal printed (not the echo of the input): `needle` at
        the start of a line (after bash's bracketed-paste escapes, if any), then CR LF."""
        line = re.compile(r"(^|[\r\n]|\x1b\[\?2004l\r?)" + re.escape(needle) + r"\r\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if line.search(self.text()):
                return self.text()
            time.sleep(0.05)
        raise AssertionError(
            f"{needle!r} never appeared; the terminal showed:\n{self.text()[-2000:]!r}; "
            f"stream error: {self.error!r}; stream open: {self.thread.is_alive()}"
        )


def _size(rows, cols):
    from e2b.sandbox.commands.command_handle import PtySize

    return PtySize(rows=rows, cols=cols)


def test_a_pty_runs_a_shell_answers_input_resizes_and_is_killed(any_backend):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    try:
        handle = sbx.pty.create(size=_size(24, 80), envs={"GREETING": "hello"}, timeout=120)
        screen = Screen(handle)
        sbx.pty.send_stdin(handle.pid, b"echo hi\n")
        screen.wait_for("hi")
        # A terminal, the controlling one, of the size asked for; the SDK's variables.
        # (/dev/tty opens only for a process with a controlling terminal.)
        sbx.pty.send_stdin(
            handle.pid, b"[ -t 0 ] && echo IS-A-TTY; (exec 3</dev/tty) && echo CTTY; echo $TERM/$GREETING\n"
        )
        screen.wait_for("IS-A-TTY")
        screen.wait_for("CTTY")
        screen.wait_for("xterm-256color/hello")
        sbx.pty.send_stdin(handle.pid, b"stty size\n")
        screen.wait_for("24 80")
        sbx.pty.resize(handle.pid, _size(40, 100))
        sbx.pty.send_stdin(handle.pid, b"stty size\n")
        screen.wait_for("40 100")
        # Job control works on the controlling terminal: a job in the background, listed.
        sbx.pty.send_stdin(handle.pid, b"sleep 30 & jobs; kill %1\n")
        screen.wait_until(lambda t: re.search(r"\[1\]\+ +Running +sleep 30", t))
        # A second client attaches and sees what the first sees.
        other = Screen(sbx.pty.connect(handle.pid, timeout=60))
        sbx.pty.send_stdin(handle.pid, b"echo both-$((40+2))\n")
        screen.wait_for("both-42")
        other.wait_for("both-42")
        # Listed with the command envd ran.
        listed = {p.pid: p for p in sbx.commands.list()}
        assert listed[handle.pid].cmd == "/bin/bash", listed
        assert sbx.pty.kill(handle.pid) is True
        screen.thread.join(30)
        other.thread.join(30)
        assert not screen.thread.is_alive() and not other.thread.is_alive()
        assert handle.pid not in {p.pid for p in sbx.commands.list()}
        # Gone: a second kill finds nothing (the SDK's False), input is refused.
        assert sbx.pty.kill(handle.pid) is False
        from e2b import NotFoundException

        with pytest.raises(NotFoundException):
            sbx.pty.send_stdin(handle.pid, b"x")
        # exit ends the shell: its end event carries the exit code.
        h2 = sbx.pty.create(size=_size(10, 40), cwd="/tmp", timeout=60)
        s2 = Screen(h2)
        sbx.pty.send_stdin(h2.pid, b"pwd; exit 3\n")
        s2.thread.join(30)
        assert "/tmp" in s2.text()
        assert h2._result is not None and h2._result.exit_code == 3, (h2._result, s2.error)
    finally:
        sbx.kill()


def test_a_pty_ends_with_its_sandbox(any_backend):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    handle = sbx.pty.create(size=_size(24, 80), timeout=120)
    screen = Screen(handle)
    sbx.pty.send_stdin(handle.pid, b"echo ready; sleep 737\n")
    screen.wait_for("ready")
    sbx.kill()
    screen.thread.join(30)
    assert not screen.thread.is_alive()
    # The SDK raises the sandbox's end, not a clean exit.
    assert screen.error is not None
    out = subprocess.run(["pgrep", "-f", "sleep 737"], capture_output=True, text=True).stdout
    assert out.strip() == "", f"a terminal's process outlived its sandbox: {out}"


def test_pty_requests_are_bounded_and_confined(any_backend):
    from e2b import InvalidArgumentException, NotFoundException, SandboxException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    bob = Sandbox.create(api_key=BOB)
    try:
        for rows, cols in [(0, 80), (24, 0), (1001, 80), (24, 70000)]:
            with pytest.raises(InvalidArgumentException):
                sbx.pty.create(size=_size(rows, cols), timeout=30)
        assert sbx.commands.list() == []
        handle = sbx.pty.create(size=_size(24, 80), timeout=120)
        screen = Screen(handle)
        with pytest.raises(InvalidArgumentException):
            sbx.pty.resize(handle.pid, _size(0, 0))
        with pytest.raises(InvalidArgumentException):
            sbx.pty.resize(handle.pid, _size(24, 1001))
        # More input than one Connect message may hold: refused, the terminal lives on.
        with pytest.raises(SandboxException):
            sbx.pty.send_stdin(handle.pid, b"x" * (2 << 20))
        # Terminal input to a command without one, stdin to a terminal: refused as envd does.
        cmd = sbx.commands.run("sleep 60", background=True)
        with pytest.raises(SandboxException, match="tty not assigned"):
            sbx.pty.send_stdin(cmd.pid, b"x")
        with pytest.raises(SandboxException, match="tty not assigned"):
            sbx.pty.resize(cmd.pid, _size(10, 10))
        with pytest.raises(SandboxException, match="tty assigned"):
            sbx.commands.send_stdin(handle.pid, "x")
        cmd.kill()
        # Bob's terminal, by its pid through Alice's sandbox: absent.
        bob_pty = bob.pty.create(size=_size(24, 80), timeout=120)
        bob_screen = Screen(bob_pty)
        if bob_pty.pid != handle.pid:
            with pytest.raises(NotFoundException):
                sbx.pty.send_stdin(bob_pty.pid, b"echo stolen\n")
            with pytest.raises(NotFoundException):
                sbx.pty.resize(bob_pty.pid, _size(5, 5))
            with pytest.raises(NotFoundException):
                sbx.pty.connect(bob_pty.pid, timeout=10)
            assert sbx.pty.kill(bob_pty.pid) is False
        bob.pty.send_stdin(bob_pty.pid, b"echo bob-alive\n")
        bob_screen.wait_for("bob-alive")
        assert "stolen" not in bob_screen.text()
        # TIOCSTI: a second terminal of the sandbox pushes input into every terminal it can
        # open; the first one must not run it (only a process's own controlling terminal
        # takes it, and only its own processes read that).
        victim = handle.pid
        attacker = Screen(sbx.pty.create(size=_size(24, 80), timeout=120))
        script = (
            "import fcntl, glob, os, termios\n"
            "me = os.ttyname(0)\n"
            "for t in sorted(set(glob.glob('/dev/pts/[0-9]*') + ['/dev/tty', '/dev/console'])):\n"
            "    try:\n"
            "        fd = os.open(t, os.O_RDWR | os.O_NOCTTY)\n"
            "    except OSError as e:\n"
            "        print('OPEN', t, e.errno); continue\n"
            "    if os.path.realpath(t) == me or t == '/dev/tty':\n"
            "        os.close(fd); continue\n"
            "    try:\n"
            "        for ch in b'echo INJECTED\\n':\n"
            "            fcntl.ioctl(fd, termios.TIOCSTI, bytes([ch]))\n"
            "        print('STI-OK', t)\n"
            "    except OSError as e:\n"
            "        print('STI-REFUSED', t, e.errno)\n"
            "print('DONE-STI')\n"
        )
        sbx.files.write("sti.py", script)
        sbx.pty.send_stdin(attacker.handle.pid, f"{PY} sti.py\n".encode())
        attacker.wait_for("DONE-STI")
        assert "STI-OK" not in attacker.text(), attacker.text()
        sbx.pty.send_stdin(victim, b"echo victim-alive\n")
        try:
            screen.wait_for("victim-alive")
        except AssertionError as e:
            raise AssertionError(f"{e}\nattacker: {attacker.text()!r}\nprocesses: {sbx.commands.list()}")
        assert "INJECTED" not in screen.text()
        # A command without a terminal has none to inject into either.
        r = sbx.commands.run(
            f"{PY} -c \"import fcntl, termios\n"
            "try:\n fcntl.ioctl(0, termios.TIOCSTI, b'x'); print('STI-OK')\n"
            "except OSError as e: print('REFUSED', e.errno)\n"
            "try:\n open('/dev/tty'); print('TTY-OK')\n"
            "except OSError as e: print('NOTTY', e.errno)\"",
        )
        assert "REFUSED" in r.stdout and "NOTTY" in r.stdout, r.stdout
    finally:
        bob.kill()
        sbx.kill()


def test_the_async_sdk_gets_terminal_output_through_on_data(e2b_env):
    """The async SDK's `pty.create(size, on_data=...)` (e2b/sandbox_async/commands/pty.py)."""
    import asyncio

    from e2b.sandbox.commands.command_handle import CommandExitException
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create()
        try:
            seen = bytearray()
            handle = await sbx.pty.create(_size(30, 90), on_data=seen.extend, timeout=60)
            await sbx.pty.send_stdin(handle.pid, b"stty size; exit 5\n")
            with pytest.raises(CommandExitException) as ei:
                await asyncio.wait_for(handle.wait(), 30)
            assert ei.value.exit_code == 5
            assert re.search(rb"(^|[\r\n]|\x1b\[\?2004l\r?)30 90\r\n", bytes(seen)), bytes(seen)
        finally:
            await sbx.kill()

    asyncio.run(main())


@pytest.mark.skipif(not (JS_DIR / "node_modules").is_dir(), reason="run scripts/setup --test (npm ci in protocol-tests/e2b-js)")
def test_javascript_sdk_pty(e2b_env):
    import json

    r = subprocess.run(
        ["node", str(JS_DIR / "pty.mjs")],
        cwd=JS_DIR,
        env={**os.environ, "KB_OTHER_KEY": BOB},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["hi"] and report["size24x80"] and report["size30x120"], report
    assert report["connected"], report
    assert report["killed"] is True and report["killedAgain"] is False, report
    assert report["badSize"].startswith("InvalidArgumentError"), report
    m = report["metric"]
    assert m["cpuCount"] >= 1 and 0 <= m["cpuUsedPct"] <= 100, m
    assert 0 < m["memUsed"] <= m["memTotal"] and 0 < m["diskUsed"] <= m["diskTotal"], m
    assert report["teamCount"] >= 1, report
    assert report["otherUser"].startswith("SandboxNotFoundError"), report


# Metrics: `get_metrics` (e2b/sandbox_sync/main.py, sandbox_api.py `_cls_get_metrics`) calls
# `GET /sandboxes/{id}/metrics?start=&end=` (unix seconds) and reads E2B's SandboxMetric list
# (e2b/api/client/models/sandbox_metric.py; E2B's API fills it from envd's
# packages/envd/internal/host/metrics.go: bytes, percent rounded to 2 decimals).


def test_metrics_measure_the_sandbox(any_backend):
    import datetime

    from e2b import SandboxException, SandboxNotFoundException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    try:
        sbx.run_code("1")
        [m] = sbx.get_metrics()  # the first: one sample, taken now
        assert m.cpu_count >= 1
        assert 0 <= m.cpu_used_pct <= 100
        assert 0 < m.mem_used <= m.mem_total, m
        assert 0 < m.disk_used <= m.disk_total, m
        assert m.mem_cache >= 0
        assert abs((datetime.datetime.now(datetime.timezone.utc) - m.timestamp).total_seconds()) < 30
        # 100 MB more in the kernel: memUsed rises by about that.
        sbx.run_code("held = b'x' * (100 << 20)")
        after = Sandbox.get_metrics(sbx.sandbox_id)[-1]
        rise = after.mem_used - m.mem_used
        assert 90 << 20 <= rise <= 140 << 20, (m.mem_used, after.mem_used)
        # A kernel that spins shows as CPU use while it does (how much depends on what else
        # the machine runs: on a loaded CI host it got 30 % of a core, so the bound is low).
        # Sampled until the spin shows or ends: on a loaded host the execution may start
        # late, and a request's own sample covers only 200 ms.
        spin = threading.Thread(
            target=lambda: sbx.run_code("import time\nt = time.time()\nwhile time.time() - t < 8: pass", timeout=30)
        )
        spin.start()
        samples = []
        while spin.is_alive() and not any(x.cpu_used_pct > 5 for x in samples):
            time.sleep(0.5)
            samples.append(sbx.get_metrics()[-1])
        spin.join()
        assert any(x.cpu_used_pct > 5 for x in samples), samples
        # Files in the workspace count as disk used.
        sbx.run_code("open('big.bin', 'wb').write(b'y' * (20 << 20))")
        disk = sbx.get_metrics()[-1]
        assert disk.disk_used >= m.disk_used + (15 << 20) or disk.disk_total > (50 << 30), (m, disk)
        # A series, as E2B's: the sandbox is sampled every 5 s from the first request on,
        # in time order, the last taken during the request.
        time.sleep(5.5)
        series = sbx.get_metrics()
        assert len(series) >= 2, series
        stamps = [x.timestamp for x in series]
        assert stamps == sorted(stamps), stamps
        assert all(0 < x.mem_used <= x.mem_total for x in series), series
        # An interval that does not reach now has nothing; a reversed one is refused.
        now = datetime.datetime.now(datetime.timezone.utc)
        hour = datetime.timedelta(hours=1)
        assert sbx.get_metrics(start=now - 2 * hour, end=now - hour) == []
        with pytest.raises(SandboxException):
            sbx.get_metrics(start=now, end=now - hour)
        # Another user's sandbox, by id with her key: absent, as everywhere.
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_metrics(sbx.sandbox_id, api_key=BOB)
    finally:
        sbx.kill()
    from e2b_code_interpreter import Sandbox as S

    with pytest.raises(SandboxNotFoundException):
        S.get_metrics(sbx.sandbox_id)
