"""E2B's pause and resume (`sbx.pause()`, `Sandbox.connect`, `is_running`, listing by state)
through E2B's own, unmodified Python SDK (pinned: e2b 2.63.0, e2b-code-interpreter 2.11.5),
written as an E2B user's code is: a sandbox with a file, a variable and an open file handle,
paused, found paused, connected to again, its kernel's state and its files as they were.

The broker pauses a sandbox's session (issue 37): its kernel is written to disk with CRIU
(`scripts/setup-criu`) and ended; `connect` restores it over the same workspace (local: a new
sandbox; Docker: a new container of its own, the old one having gone with the pause, its `/tmp`
put back). Both backends.
"""

import asyncio
import time

import pytest

from conftest import ALICE, BOB, criu_ready, needs_criu, restartable_port

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")


def prepared(sbx):
    """State in the sandbox's kernel (a file held open in its workspace and one in its /tmp)
    and in a second code context; the context's id."""
    sbx.files.write("pause-note.txt", "written before the pause\n")
    ex = sbx.run_code(
        "kept = {'answer': 6 * 7}\n"
        "fh = open('/home/user/pause-note.txt')\n"
        "fh.read(8)\n"
        "th = open('/tmp/held.txt', 'w+'); th.write('in tmp'); th.seek(3)\n"
        "g = iter(range(10)); next(g)\n"
        "kept['answer']"
    )
    assert ex.error is None, ex.error
    assert ex.text == "42"
    ctx = sbx.create_code_context()
    assert sbx.run_code("side = 'context'", context=ctx).error is None
    return ctx


def as_it_was(sbx, ctx):
    ex = sbx.run_code("(kept['answer'], fh.read(6), next(g), th.read())")
    assert ex.error is None, ex.error
    assert ex.text == "(42, 'before', 1, 'tmp')"
    assert sbx.files.read("pause-note.txt") == "written before the pause\n"
    # The context was paused with the sandbox, and resumes on its first use.
    assert sbx.run_code("side", context=ctx).text == "context"


@needs_criu
def test_a_paused_sandbox_is_connected_to_again_with_its_state(any_backend):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120)
    try:
        ctx = prepared(sbx)
        assert sbx.pause() is True
        assert not sbx.is_running()
        # Paused, it is listed as paused (and not as running).
        paused = Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in {s.sandbox_id for s in paused}
        running = Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.RUNNING])).next_items()
        assert sbx.sandbox_id not in {s.sandbox_id for s in running}
        assert sbx.get_info().state == e2b.SandboxState.PAUSED
        # A second pause: E2B's answer for a paused sandbox.
        assert Sandbox.pause(sbx.sandbox_id) is False

        same = Sandbox.connect(sbx.sandbox_id, timeout=90)
        assert same.sandbox_id == sbx.sandbox_id
        assert same.is_running()
        assert same.get_info().state == e2b.SandboxState.RUNNING
        as_it_was(same, ctx)
        # Connecting to a running sandbox changes nothing.
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.run_code("kept['answer'] + 1").text == "43"
    finally:
        sbx.kill()


@needs_criu
def test_an_async_sandbox_pauses_and_resumes(e2b_env):
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            ex = await sbx.run_code("value = 'kept across the pause'")
            assert ex.error is None, ex.error
            assert await sbx.pause() is True
            assert not await sbx.is_running()
            same = await AsyncSandbox.connect(sbx.sandbox_id)
            ex = await same.run_code("value")
            assert ex.error is None and ex.text == "kept across the pause", ex
        finally:
            await sbx.kill()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_pause_refusals_raise_what_e2bs_sdk_raises(any_backend):
    """Another user's sandbox and one that never was are not found; a sandbox running code
    is not paused (the SDK raises E2B's "retry"), and goes on."""
    from e2b.exceptions import SandboxException, SandboxNotFoundException
    from e2b_code_interpreter import Sandbox

    with pytest.raises(SandboxNotFoundException):
        Sandbox.pause("00000000-0000-4000-8000-000000000000")
    sbx = Sandbox.create(timeout=60)
    try:
        assert sbx.run_code("x = 1").error is None
        with pytest.raises(SandboxNotFoundException):
            Sandbox.pause(sbx.sandbox_id, api_key=BOB)
        if criu_ready():
            import threading

            from e2b.exceptions import ServiceBusyException

            t = threading.Thread(target=lambda: sbx.run_code("import time; time.sleep(3)"))
            t.start()
            time.sleep(1)
            with pytest.raises(ServiceBusyException):
                sbx.pause()
            t.join()
        assert sbx.is_running()
        assert sbx.run_code("x + 1").text == "2"
    finally:
        sbx.kill()


@needs_criu
def test_a_malformed_or_oversized_resume_body_is_refused_and_the_sandbox_stays_paused(e2b_env):
    """`connect` and the deprecated `resume` read a bounded JSON body: bytes that are not
    JSON are a 400 and more than 64 KiB a 413, before anything is resumed; the sandbox stays
    paused, and a good `connect` brings it back with its state."""
    import requests
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120)
    try:
        assert sbx.run_code("kept = 'through bad requests'").error is None
        assert sbx.pause() is True
        base = f"{e2b_env.url}/e2b/sandboxes/{sbx.sandbox_id}"
        h = {"X-API-KEY": ALICE, "Content-Type": "application/json"}
        big = b'{"timeout": 60, "pad": "' + b"x" * (70 << 10) + b'"}'
        for route in ("connect", "resume"):
            for body, status in ((b'{"timeout": ', 400), (b"\xff\xfe", 400), (big, 413)):
                r = requests.post(f"{base}/{route}", data=body, headers=h, timeout=30)
                assert r.status_code == status, (route, body[:20], r.status_code, r.text)
                assert r.json().get("message"), r.text
                assert sbx.get_info().state == e2b.SandboxState.PAUSED
        same = Sandbox.connect(sbx.sandbox_id, timeout=90)
        assert same.run_code("kept == 'through bad requests'").text == "True"
    finally:
        sbx.kill()


@needs_criu
def test_a_sandbox_made_to_pause_at_its_timeout_pauses_instead_of_ending(e2b_env):
    """`lifecycle={"on_timeout": "pause"}` (E2B's `autoPause`): at its timeout the sandbox is
    paused, not killed; `connect` brings it back with its state and a new timeout."""
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause"})
    try:
        assert sbx.run_code("kept = 'through the timeout'").error is None
        deadline = time.monotonic() + 30
        while sbx.is_running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not sbx.is_running()
        assert sbx.get_info().state == e2b.SandboxState.PAUSED
        same = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert same.run_code("kept").text == "through the timeout"
        assert 30 < (same.get_info().end_at.timestamp() - time.time()) <= 60
    finally:
        sbx.kill()


@needs_criu
def test_a_paused_sandbox_outlives_the_broker(fresh_broker, monkeypatch):
    """An E2B user pauses a sandbox (or lets `autoPause` do it) and comes back after the
    broker was restarted (SIGTERM, then kill -9): `Sandbox.connect` finds it paused, with its
    metadata, and resumes it with its state; its contexts come back too."""
    from e2b_code_interpreter import Sandbox

    port = restartable_port()
    first = fresh_broker(listen=f"127.0.0.1:{port}")
    for name, value in (("E2B_API_URL", first.url + "/e2b"), ("E2B_SANDBOX_URL", first.url + "/e2b/sandbox"), ("E2B_API_KEY", ALICE)):
        monkeypatch.setenv(name, value)
    sbx = Sandbox.create(timeout=120, metadata={"run": "r-7"})
    try:
        ctx = prepared(sbx)
        assert sbx.run_code("in_ctx = 'ctx'", context=ctx).error is None
        assert sbx.pause() is True
        data = first.data_dir
        first.terminate()
        second = fresh_broker(listen=f"127.0.0.1:{port}", data_dir=data)
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.state == e2b.SandboxState.PAUSED, info
        assert info.metadata == {"run": "r-7"}, info
        listed = Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in {s.sandbox_id for s in listed}
        same = Sandbox.connect(sbx.sandbox_id, timeout=90)
        as_it_was(same, ctx)
        assert same.run_code("in_ctx", context=ctx).text == "ctx"
        # Paused again, and the broker killed: it is still there.
        assert same.pause() is True
        second.kill9()
        fresh_broker(listen=f"127.0.0.1:{port}", data_dir=data)
        again = Sandbox.connect(sbx.sandbox_id, timeout=90)
        assert again.run_code("kept['answer']").text == "42"
        assert [c.id for c in again.list_code_contexts()].count(ctx.id) == 1
    finally:
        try:
            Sandbox.kill(sbx.sandbox_id)
        except Exception:
            pass
