"""E2B's own SDKs, pinned (protocol-tests/requirements.txt; protocol-tests/e2b-js/), driving
the broker exactly as an E2B user's code does: only E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY are set. The data-analysis pattern (upload a CSV, profile it with pandas, hit a
KeyError, fix it, plot, download the chart), the SDK calls the issue lists, Python sync and
async and JavaScript, and the isolation of commands.run."""

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from conftest import ALICE, BOB

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

HERE = Path(__file__).parent
PNG = b"\x89PNG\r\n\x1a\n"


CSV = "city,temp\nOslo,4\nRome,19\nCairo,30\nLima,18\n"


def test_data_analysis_pattern_with_the_python_sdk(e2b_env):
    from e2b_code_interpreter import Sandbox

    seen = {"stdout": [], "stderr": [], "results": [], "errors": []}
    with Sandbox.create(timeout=300) as sbx:
        # The sandbox is a broker session of the key's user, visible in the agent API.
        ids = [s["id"] for s in e2b_env.api("GET", "/v1/sessions").json()]
        assert sbx.sandbox_id in ids
        kernels = [k["id"] for k in e2b_env.api("GET", "/api/kernels").json()]
        assert sbx.sandbox_id in kernels

        info = sbx.files.write("data.csv", CSV)
        assert info.path == "/home/user/data.csv"
        assert sbx.files.exists("data.csv")
        assert sbx.files.read("data.csv") == CSV

        ex = sbx.run_code(
            "import pandas as pd\ndf = pd.read_csv('data.csv')\nprint(df.shape)\ndf.describe()",
            on_stdout=lambda m: seen["stdout"].append(m.line),
            on_stderr=lambda m: seen["stderr"].append(m.line),
            on_result=lambda r: seen["results"].append(r),
        )
        assert ex.error is None, ex.error
        assert "(4, 2)" in "".join(ex.logs.stdout)
        assert "(4, 2)" in "".join(seen["stdout"])
        assert ex.results and ex.results[0].is_main_result
        assert "temp" in ex.results[0].text and ex.results[0].html

        # The KeyError, then the fix: state is kept between calls.
        ex = sbx.run_code("df['temperature'].mean()", on_error=seen["errors"].append)
        assert ex.error.name == "KeyError"
        assert "temperature" in ex.error.value
        assert "KeyError" in ex.error.traceback
        assert seen["errors"] and seen["errors"][0].name == "KeyError"
        ex = sbx.run_code("float(df['temp'].mean())")
        assert ex.error is None and ex.text == "17.75"

        ex = sbx.run_code(
            "import matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots()\nax.bar(df['city'], df['temp'])\n"
            "fig.savefig('chart.png')\nplt.show()"
        )
        assert ex.error is None, ex.error
        pngs = [r.png for r in ex.results if r.png]
        assert pngs, ex.results
        import base64

        assert base64.b64decode(pngs[0]).startswith(PNG)
        chart = sbx.files.read("chart.png", format="bytes")
        assert bytes(chart).startswith(PNG)

        ex = sbx.run_code("import sys; print('to err', file=sys.stderr)")
        assert "to err" in "".join(ex.logs.stderr)


def test_sdk_calls_the_issue_lists(e2b_env):
    from e2b_code_interpreter import Sandbox
    from e2b.exceptions import TimeoutException

    sbx = Sandbox.create(metadata={"purpose": "kb-test"})
    try:
        # Contexts: other kernels in the same sandbox.
        ctx = sbx.create_code_context()
        sbx.run_code("x = 41", context=ctx)
        assert sbx.run_code("x + 1", context=ctx).text == "42"
        assert sbx.run_code("'x' in dir()").text == "False"
        assert ctx.id in [c.id for c in sbx.list_code_contexts()]
        sbx.restart_code_context(ctx)
        assert sbx.run_code("'x' in dir()", context=ctx).text == "False"
        sbx.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in sbx.list_code_contexts()]

        # run_code timeouts: the SDK gives up, the broker interrupts the kernel.
        with pytest.raises(TimeoutException):
            sbx.run_code("import time; time.sleep(30)", timeout=2)
        ex = sbx.run_code("1 + 1", timeout=20)
        assert ex.text == "2"

        # Files.
        sbx.files.make_dir("sub/dir")
        sbx.files.write("sub/dir/a.txt", "A")
        names = [e.name for e in sbx.files.list("sub/dir")]
        assert names == ["a.txt"]
        sbx.files.rename("sub/dir/a.txt", "sub/b.txt")
        assert not sbx.files.exists("sub/dir/a.txt")
        assert sbx.files.read("sub/b.txt") == "A"
        sbx.files.remove("sub/b.txt")
        assert not sbx.files.exists("sub/b.txt")
        with pytest.raises(Exception):
            sbx.files.read("/etc/passwd")

        # Commands: in the sandbox, streamed, exit codes, background + kill.
        out = []
        r = sbx.commands.run("echo hi; echo oops >&2; pwd; id -u", on_stdout=out.append)
        assert r.exit_code == 0
        assert r.stdout.splitlines()[0] == "hi" and "oops" in r.stderr
        assert "/home/user" in r.stdout
        assert "hi" in "".join(out)
        # A command that prints without bound reaches the client whole; its recording keeps
        # only the start and the end.
        r = sbx.commands.run("yes 0123456789 | head -c 3000000; echo; echo THE-END")
        assert len(r.stdout) == 3000000 + len("\nTHE-END\n")
        from e2b.sandbox.commands.command_handle import CommandExitException

        with pytest.raises(CommandExitException) as ei:
            sbx.commands.run("exit 3")
        assert ei.value.exit_code == 3
        h = sbx.commands.run("sleep 100", background=True)
        assert h.pid in [p.pid for p in sbx.commands.list()]
        assert h.kill()
        with pytest.raises(CommandExitException):
            h.wait()

        # stdin, envs, cwd, attaching to a running command.
        h = sbx.commands.run("read x; echo got $x", background=True, stdin=True)
        again = sbx.commands.connect(h.pid)
        sbx.commands.send_stdin(h.pid, "hello\n")
        assert h.wait().stdout == "got hello\n"
        assert again.wait().exit_code == 0
        r = sbx.commands.run("echo $GREETING; pwd", envs={"GREETING": "hej"}, cwd="/tmp")
        assert r.stdout.split() == ["hej", "/tmp"]
        from e2b.sandbox.filesystem.filesystem import WriteEntry

        written = sbx.files.write_files([WriteEntry(path="m/1.txt", data="1"), WriteEntry(path="m/2.txt", data="22")])
        assert sorted(w.path for w in written) == ["/home/user/m/1.txt", "/home/user/m/2.txt"]
        fi = sbx.files.get_info("m/2.txt")
        assert fi.size == 2 and fi.type.value == "file"

        # Control plane.
        sbx.set_timeout(600)
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.metadata == {"purpose": "kb-test"}
        listed = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sbx.sandbox_id in listed
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.run_code("1 + 2").text == "3"
        assert sbx.is_running()
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in [s["id"] for s in e2b_env.api("GET", "/v1/sessions").json()]
    # The recordings say which front door made each session, with the sandbox's metadata,
    # and who ended it: the kill, and the context's removal.
    def broker_events(sid):
        r = e2b_env.api("GET", f"/v1/sessions/{sid}/events?channel=broker")
        assert r.status_code == 200, r.text
        return [(e["kind"], e["detail"]) for e in r.json()["events"]]

    sandbox = broker_events(sbx.sandbox_id)
    created = [d for k, d in sandbox if k == "session_created"]
    assert created[0]["front_door"] == "e2b" and created[0]["metadata"] == {"purpose": "kb-test"}
    assert [d for k, d in sandbox if k == "session_closed"] == [{"by": "e2b"}], sandbox
    # Each command's end, with what it printed (bounded) and how it ended.
    ended = [d for k, d in sandbox if k == "command_ended"]
    hi = [d for d in ended if d["stdout"].startswith("hi\n")]
    assert len(hi) == 1 and hi[0]["stderr"] == "oops\n" and hi[0]["exit_code"] == 0, ended
    assert hi[0]["stdout_bytes"] == len(hi[0]["stdout"].encode()), hi
    assert any(d["exit_code"] == 3 for d in ended), ended
    flood = [d for d in ended if d["stdout_bytes"] == 3000009]
    assert len(flood) == 1, [d["stdout_bytes"] for d in ended]
    kept = flood[0]["stdout"]
    assert kept.startswith("0123456789\n") and kept.endswith("THE-END\n"), kept[-200:]
    assert "bytes not kept" in kept and len(kept) < 17_000, len(kept)
    assert any(d["stdout"] == "got hello\n" for d in ended), ended
    context = broker_events(ctx.id)
    assert [d["metadata"] for k, d in context if k == "session_created"] == [{"sandbox": sbx.sandbox_id}]
    assert [d for k, d in context if k == "session_closed"] == [{"by": "e2b"}], context


def test_timeout_ends_the_sandbox_unless_extended(e2b_env):
    from e2b_code_interpreter import Sandbox

    short = Sandbox.create(timeout=3)
    kept = Sandbox.create(timeout=3)
    kept.set_timeout(60)
    time.sleep(6)
    ids = [s["id"] for s in e2b_env.api("GET", "/v1/sessions").json()]
    assert short.sandbox_id not in ids
    assert kept.sandbox_id in ids
    assert kept.run_code("1").text == "1"
    kept.kill()


def test_async_sdk(e2b_env):
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create()
        try:
            await sbx.run_code("y = 5")
            ex = await sbx.run_code("y * 2")
            assert ex.text == "10"
            await sbx.files.write("async.txt", "ok")
            assert await sbx.files.read("async.txt") == "ok"
            r = await sbx.commands.run("cat async.txt")
            assert r.stdout == "ok"
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_commands_are_confined_to_the_users_sandbox(any_backend):
    from e2b_code_interpreter import Sandbox

    # Bob's workspace holds a secret Alice's command must not see.
    bob_sbx = Sandbox.create(api_key=BOB)
    bob_sbx.files.write("secret.txt", "bob's")
    sbx = Sandbox.create()
    # The kernels' Python by its path: `bash -l` (how the SDK runs commands) resets PATH
    # from the Docker image's /etc/profile.
    py = {"envs": {"PY": "/opt/kernel-venv/bin/python"}}
    try:
        r = sbx.commands.run(
            "ls / ; cat /etc/hostname 2>&1; ls /root 2>&1; ls /workspace",
        )
        assert "secret.txt" not in r.stdout
        # No network but loopback.
        res = sbx.commands.run(
            "$PY -c \"import socket\ntry:\n socket.create_connection(('1.1.1.1', 53), timeout=3); print('NET')\nexcept OSError as e: print('NONET', e)\"",
            **py,
        )
        assert "NONET" in res.stdout, res.stdout
        # Not root, and not the broker's host: the host's root home is not there.
        assert sbx.commands.run("id -u").stdout.strip() != "0"
        assert sbx.commands.run("test -e /work && echo HOST || echo NOHOST").stdout.strip() == "NOHOST"
        # Limits apply: a command past the kernel's memory limit is killed.
        from e2b.sandbox.commands.command_handle import CommandExitException

        with pytest.raises(CommandExitException) as ei:
            sbx.commands.run("$PY -c \"b = b'x' * (400 << 20); print(len(b))\"", timeout=60, **py)
        # SIGKILLed by its leaf's OOM killer (bwrap reports 128 + 9), not a Python error.
        assert ei.value.exit_code in (137, -1), (ei.value.exit_code, ei.value.stderr)
        ok = sbx.commands.run("$PY -c \"b = b'x' * (100 << 20); print(len(b))\"", timeout=60, **py)
        assert ok.stdout.strip() == str(100 << 20)
        # Killed with its sandbox: a background command ends when the sandbox does.
        sbx.commands.run("sleep 300", background=True)
    finally:
        sbx.kill()
        bob_sbx.kill()
    out = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True, text=True).stdout
    assert out.strip() == "", f"a command outlived its sandbox: {out}"


def test_other_users_sandbox_answers_as_absent(e2b_env):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    try:
        base = e2b_env.url
        r = requests.get(f"{base}/e2b/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": BOB})
        assert r.status_code == 404 and r.json()["code"] == 404
        # Bob's key cannot mint the sandbox's token: a guessed one answers as absent.
        r = requests.post(
            f"{base}/e2b/sandbox/execute",
            headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "0" * 64},
            json={"code": "1"},
        )
        assert r.status_code == 404 and "not found" in r.json()["message"]
        # A sandbox that never was: absent, for a pause as for the rest.
        r = requests.post(f"{base}/e2b/sandboxes/x/pause", headers={"X-API-KEY": ALICE})
        assert r.status_code == 404 and r.json()["code"] == 404
        # Bob pausing alice's sandbox: absent too, and it goes on running.
        r = requests.post(f"{base}/e2b/sandboxes/{sbx.sandbox_id}/pause", headers={"X-API-KEY": BOB})
        assert r.status_code == 404 and r.json()["code"] == 404
        assert sbx.is_running()
        r = requests.get(f"{base}/e2b/templates", headers={"X-API-KEY": ALICE})
        assert r.status_code == 501 and "not supported" in r.json()["message"]
        r = requests.post(f"{base}/e2b/v2/sandboxes", headers={"X-API-KEY": "nope"}, json={})
        assert r.status_code == 401 and r.json()["code"] == 401
    finally:
        sbx.kill()


# Lifecycle (issue 35): what E2B's SDKs see when a sandbox ends, deadlines, and listing.


def _raw_health(base, sandbox_id, token):
    return requests.get(
        f"{base}/e2b/sandbox/health",
        headers={"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": token},
    )


def test_health_reflects_the_sandbox(e2b_env):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    bob = Sandbox.create(api_key=BOB)
    try:
        assert sbx.is_running()
        base = e2b_env.url
        # Another user's sandbox, a token that is not the sandbox's, a sandbox that never
        # was: each "not running", in the same words, nothing more.
        unknown = "00000000-0000-4000-8000-000000000000"
        answers = [
            _raw_health(base, bob.sandbox_id, sbx._envd_access_token),
            _raw_health(base, bob.sandbox_id, "0" * 64),
            _raw_health(base, unknown, sbx._envd_access_token),
            _raw_health(base, "not-a-uuid", "x"),
        ]
        for r, sid in zip(answers, [bob.sandbox_id, bob.sandbox_id, unknown, "not-a-uuid"]):
            assert r.status_code == 502, r.text
            assert r.json() == {"sandboxId": sid, "message": "The sandbox was not found", "code": 502}
        assert bob.is_running()
        r = requests.get(f"{base}/e2b/sandbox/health")
        assert r.status_code == 400
    finally:
        bob.kill()
    sbx.kill()
    assert sbx.is_running() is False
    assert bob.is_running() is False


def test_killing_a_sandbox_drops_its_streams(any_backend):
    import threading

    from e2b import SandboxNotRunningException, TimeoutException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    seen = {}

    def run(name, call):
        t0 = time.monotonic()
        try:
            seen[name] = call()
        except Exception as e:  # noqa: BLE001 - the test looks at what was raised
            seen[name] = e
        seen[name + "_s"] = time.monotonic() - t0

    ctx = sbx.create_code_context()
    threads = [
        threading.Thread(target=run, args=("code", lambda: sbx.run_code("import time; time.sleep(60)"))),
        threading.Thread(target=run, args=("ctx", lambda: sbx.run_code("import time; time.sleep(60)", context=ctx))),
        threading.Thread(target=run, args=("cmd", lambda: sbx.commands.run("sleep 60"))),
    ]
    background = sbx.commands.run("sleep 60", background=True)
    for t in threads:
        t.start()
    time.sleep(3)
    sbx.kill()
    for t in threads:
        t.join(30)
    # As against E2B: the code interpreter's "the sandbox was killed" TimeoutException, and
    # envd's streams a SandboxNotRunningException (a TimeoutException too).
    assert isinstance(seen["code"], TimeoutException), repr(seen["code"])
    assert "killed" in str(seen["code"]), seen["code"]
    assert isinstance(seen["ctx"], TimeoutException) and "killed" in str(seen["ctx"]), repr(seen["ctx"])
    assert isinstance(seen["cmd"], SandboxNotRunningException), repr(seen["cmd"])
    with pytest.raises(SandboxNotRunningException):
        background.wait()
    assert seen["code_s"] < 20 and seen["cmd_s"] < 20, seen


def test_a_sandbox_reaching_its_timeout_drops_its_streams(e2b_env):
    from e2b import SandboxNotRunningException, TimeoutException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=4)
    h = sbx.commands.run("sleep 60", background=True)
    t0 = time.monotonic()
    with pytest.raises(TimeoutException) as ei:
        sbx.run_code("import time; time.sleep(60)")
    assert "killed" in str(ei.value) and time.monotonic() - t0 < 20
    with pytest.raises(SandboxNotRunningException):
        h.wait()
    assert sbx.is_running() is False


def test_killing_a_sandbox_drops_its_streams_async(e2b_env):
    from e2b import SandboxNotRunningException, TimeoutException
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create()
        code = asyncio.create_task(sbx.run_code("import time; time.sleep(60)"))
        cmd = asyncio.create_task(sbx.commands.run("sleep 60"))
        await asyncio.sleep(3)
        await sbx.kill()
        got = await asyncio.gather(code, cmd, return_exceptions=True)
        assert isinstance(got[0], TimeoutException) and "killed" in str(got[0]), repr(got[0])
        assert isinstance(got[1], SandboxNotRunningException), repr(got[1])
        assert await sbx.is_running() is False

    asyncio.run(asyncio.wait_for(main(), 60))


def test_command_deadlines_are_honoured(any_backend):
    from e2b import TimeoutException
    from e2b_code_interpreter import AsyncSandbox, Sandbox

    sbx = Sandbox.create()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 10; echo late > late.txt", timeout=2)
        assert time.monotonic() - t0 < 6
        # Killed at its deadline, as envd runs it: it never got to write.
        h = sbx.commands.run("sleep 10; echo late > late2.txt", background=True, timeout=2)
        with pytest.raises(TimeoutException):
            h.wait()
        time.sleep(9)
        assert not sbx.files.exists("late.txt")
        assert not sbx.files.exists("late2.txt")
        assert sbx.commands.list() == []
        # A deadline the command beats changes nothing.
        assert sbx.commands.run("echo quick", timeout=30).stdout == "quick\n"
    finally:
        sbx.kill()

    async def main():
        a = await AsyncSandbox.create()
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutException):
                await a.commands.run("sleep 10", timeout=2)
            assert time.monotonic() - t0 < 6
            assert await a.commands.list() == []
        finally:
            await a.kill()

    asyncio.run(main())


def _connect_call(base, sbx, method, message, timeout_header):
    body = json.dumps(message).encode()
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": sbx._envd_access_token,
        "Content-Type": "application/connect+json",
    }
    if timeout_header is not None:
        headers["Connect-Timeout-Ms"] = timeout_header
    r = requests.post(
        f"{base}/e2b/sandbox/process.Process/{method}",
        data=b"\x00" + len(body).to_bytes(4, "big") + body,
        headers=headers,
        timeout=30,
    )
    frames, raw = [], r.content
    while raw:
        flags, n = raw[0], int.from_bytes(raw[1:5], "big")
        frames.append((flags, json.loads(raw[5 : 5 + n])))
        raw = raw[5 + n :]
    return r.status_code, frames


def test_hostile_connect_timeouts_are_refused(e2b_env):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    try:
        start = {"process": {"cmd": "/bin/bash", "args": ["-c", "echo ran >> ran.txt"]}}
        for bad in ["abc", "-5", "1.5", "99999999999", "1" * 1000, ""]:
            status, frames = _connect_call(e2b_env.url, sbx, "Start", start, bad)
            assert status == 200 and len(frames) == 1, (bad, frames)
            flags, end = frames[0]
            assert flags == 2 and end["error"]["code"] == "invalid_argument", (bad, end)
            assert "timeout" in end["error"]["message"]
        assert not sbx.files.exists("ran.txt")
        # The longest a Connect deadline can be (10 digits, ~115 days) is a deadline like any.
        status, frames = _connect_call(e2b_env.url, sbx, "Start", start, "9999999999")
        end = [f for _, f in frames if "event" in f and "end" in f["event"]]
        assert end and end[0]["event"]["end"]["exitCode"] == 0, frames
        assert frames[-1] == (2, {})
        # A unary call with a garbage deadline: Connect's 400.
        r = requests.post(
            f"{e2b_env.url}/e2b/sandbox/process.Process/List",
            json={},
            headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token, "Connect-Timeout-Ms": "soon"},
        )
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    finally:
        sbx.kill()


def test_connect_never_shortens_the_deadline(e2b_env):
    import datetime

    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=300)
    try:
        def left():
            end = sbx.get_info().end_at
            return (end - datetime.datetime.now(datetime.timezone.utc)).total_seconds()

        assert 280 < left() <= 300
        again = Sandbox.connect(sbx.sandbox_id, timeout=10)
        assert 280 < left() <= 300, left()
        assert again.run_code("1 + 1").text == "2"
        Sandbox.connect(sbx.sandbox_id, timeout=900)
        assert 880 < left() <= 900, left()
        # set_timeout is the call that shortens.
        sbx.set_timeout(30)
        assert 20 < left() <= 30, left()
    finally:
        sbx.kill()


def test_list_pages_filters_and_orders(e2b_env):
    import datetime
    import uuid

    from e2b import SandboxQuery, SandboxState
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    tag = uuid.uuid4().hex
    made = []
    try:
        for i in range(3):
            made.append(Sandbox.create(metadata={"suite": tag, "i": str(i)}))
            time.sleep(0.05)
        made.append(Sandbox.create(template="other-template", metadata={"suite": tag, "i": "3"}))
        bob = Sandbox.create(api_key=BOB, metadata={"suite": tag})
        made.append(bob)
        ids = [s.sandbox_id for s in made[:4]]
        query = SandboxQuery(metadata={"suite": tag})

        def all_pages(paginator):
            pages = []
            while paginator.has_next:
                pages.append([s.sandbox_id for s in paginator.next_items()])
            return pages

        # Newest first, two a page, the next page named by the x-next-token header.
        pages = all_pages(Sandbox.list(query=query, limit=2))
        assert pages == [ids[::-1][:2], ids[::-1][2:]], pages
        assert all_pages(Sandbox.list(query=query, limit=3, order="asc")) == [ids[:3], ids[3:]]
        assert all_pages(Sandbox.list(query=query, limit=100)) == [ids[::-1]]
        # A page that ends exactly at the last sandbox has no next token.
        p = Sandbox.list(query=query, limit=4)
        assert len(p.next_items()) == 4 and not p.has_next
        # Filters: started after, template, state (nothing is ever paused here).
        after = Sandbox.get_info(ids[1]).started_at
        got = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}, started_after=after)).next_items()
        assert sorted(s.sandbox_id for s in got) == sorted(ids[1:])
        got = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}, template="other-template")).next_items()
        assert [s.sandbox_id for s in got] == [ids[3]]
        got = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}, state=[SandboxState.PAUSED])).next_items()
        assert got == []
        got = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}, state=[SandboxState.RUNNING, SandboxState.PAUSED])).next_items()
        assert len(got) == 4
        # Bob sees only his own, whatever token he forges.
        assert [s.sandbox_id for s in Sandbox.list(query=query, api_key=BOB).next_items()] == [bob.sandbox_id]
        p = Sandbox.list(query=query, limit=1)
        p.next_items()
        stolen = p.next_token
        assert stolen
        got = Sandbox.list(query=query, next_token=stolen, api_key=BOB).next_items()
        assert got == [], got
        import base64

        far = base64.urlsafe_b64encode(b"2999-01-01T00:00:00Z__zzzzzzzz").decode()
        got = Sandbox.list(query=query, next_token=far, api_key=BOB).next_items()
        assert [s.sandbox_id for s in got] == [bob.sandbox_id]
        # Hostile parameters: E2B's 400s.
        base = e2b_env.url
        for params in [
            {"limit": "0"}, {"limit": "-1"}, {"limit": str(10**9)}, {"limit": "ten"},
            {"nextToken": "not base64!"}, {"nextToken": base64.urlsafe_b64encode(b"garbage").decode()},
            {"nextToken": stolen, "order": "asc"}, {"order": "sideways"},
            {"startedAfter": "yesterday"}, {"state": "sleeping"}, {"metadata": "novalue"},
        ]:
            r = requests.get(f"{base}/e2b/v2/sandboxes", params=params, headers={"X-API-KEY": ALICE})
            assert r.status_code == 400, (params, r.status_code, r.text)
            assert r.json()["code"] == 400 and r.json()["message"]
        # What the SDK raises for E2B's 400: a SandboxException with its status.
        with pytest.raises(SandboxException) as ei:
            Sandbox.list(query=query, limit=10**9).next_items()
        assert ei.value.status_code == 400 and "limit" in str(ei.value)
        r = requests.get(f"{base}/e2b/v2/sandboxes", params={"limit": "100", "metadata": f"suite={tag}"}, headers={"X-API-KEY": ALICE})
        assert r.status_code == 200 and "x-next-token" not in r.headers
        r = requests.get(f"{base}/e2b/v2/sandboxes", params={"limit": "1", "metadata": f"suite={tag}"}, headers={"X-API-KEY": ALICE})
        assert r.status_code == 200 and r.headers["x-next-token"]
    finally:
        for s in made:
            s.kill()


JS_DIR = HERE / "e2b-js"


@pytest.mark.skipif(not (JS_DIR / "node_modules").is_dir(), reason="run scripts/setup --test (npm ci in protocol-tests/e2b-js)")
def test_javascript_sdk(e2b_env):
    env = dict(os.environ)
    r = subprocess.run(
        ["node", str(JS_DIR / "flow.mjs")], cwd=JS_DIR, env=env, capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["sum"] == "42"
    assert report["png"] is True
    assert report["file"] == "hello from js"
    assert report["cmd"] == "js-cmd\n"
    assert report["killed"] is True


@pytest.mark.skipif(not (JS_DIR / "node_modules").is_dir(), reason="run scripts/setup --test (npm ci in protocol-tests/e2b-js)")
def test_javascript_sdk_lifecycle(e2b_env):
    r = subprocess.run(
        ["node", str(JS_DIR / "lifecycle.mjs")], cwd=JS_DIR, env=dict(os.environ), capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["running"] is True
    # timeoutMs: the SDK's TimeoutError at the deadline, and the command is gone.
    assert report["deadline"].startswith("TimeoutError"), report
    assert report["deadlineMs"] < 6000 and report["listedAfterDeadline"] == 0, report
    assert report["codeTimeout"].startswith("TimeoutError"), report
    assert report["afterCodeTimeout"] == "2" and report["afterCodeTimeoutMs"] < 5000, report
    assert 280 < report["leftAfterShortConnect"] <= 300, report
    assert 880 < report["leftAfterLongConnect"] <= 900, report
    ids = report["ids"]
    assert report["pagesDesc"] == [ids[::-1][:2], ids[::-1][2:]], report
    assert report["pagesAsc"] == [ids[:2], ids[2:]], report
    assert report["paused"] == [[]], report
    assert sorted(report["startedAfter"][0]) == sorted(ids[1:]), report
    assert report["badLimit"] != "returned" and "limit" in report["badLimit"], report
    # A kill mid-request: the SDK's "the sandbox was killed" TimeoutError for run_code, its
    # sandbox-timeout TimeoutError for the command; isRunning() is false.
    assert report["code"].startswith("TimeoutError") and "killed" in report["code"], report
    assert report["cmd"].startswith("TimeoutError"), report
    assert report["droppedMs"] < 20000, report
    assert report["runningAfterKill"] is False


def _p50(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


@pytest.mark.skipif(not os.environ.get("KB_E2B_BENCH"), reason="set KB_E2B_BENCH=1 to measure")
def test_round_trip_sdk_vs_agent_api(e2b_env):
    from e2b_code_interpreter import Sandbox

    n = int(os.environ.get("KB_E2B_BENCH_N", "200"))
    with Sandbox.create() as sbx:
        sbx.run_code("1+1")
        sdk = []
        for _ in range(n):
            t = time.perf_counter()
            assert sbx.run_code("1+1").text == "2"
            sdk.append(time.perf_counter() - t)
    s = requests.Session()
    sid = e2b_env.api("POST", "/v1/sessions").json()["id"]
    try:
        own = []
        for _ in range(n):
            t = time.perf_counter()
            r = s.post(f"{e2b_env.url}/v1/sessions/{sid}/execute", headers=e2b_env.headers(), json={"code": "1+1"})
            own.append(time.perf_counter() - t)
            assert r.json()["results"][0]["data"]["text/plain"] == "2"
    finally:
        e2b_env.api("DELETE", f"/v1/sessions/{sid}")
    print(f"\nrun_code('1+1') p50 over {n}: E2B SDK {_p50(sdk)*1000:.1f} ms, agent API {_p50(own)*1000:.1f} ms")
