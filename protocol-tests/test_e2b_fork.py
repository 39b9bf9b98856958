"""E2B's fork (`Sandbox.fork`, `sbx.fork()`, `AsyncSandbox.fork`) through E2B's own, unmodified
Python SDK (pinned: e2b 2.63.0, e2b-code-interpreter 2.11.5), written as an E2B user's code is:
a sandbox with a file and a variable, forked; each fork reads the same file and the same
variable, then goes its own way (its file changed, the original's is not); everything killed.

The broker answers E2B's fork route through the session layer's fork (`Registry::fork`): a
sandbox is a session with a workspace of its own, so each fork is a copy of its kernel (CRIU 4,
`scripts/setup-criu`) in a sandbox of its own with a copy of its workspace: on the local
sandbox and on Docker (a container of its own). The refusals the SDK gets whole (no such
sandbox, another user's, a count above the broker's 8) are tested too.
"""

import asyncio
import datetime

import pytest

from conftest import BOB, needs_criu

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")


ORIGINAL = "written before the fork\n"
CHANGED = "changed in the fork\n"


def made(results):
    """The sandboxes of a fork's answer: E2B's SDK returns an exception in place of each fork
    that failed; any is raised here."""
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def prepared(sbx):
    """The state the forks must carry: a file in the sandbox and a variable in its kernel."""
    info = sbx.files.write("fork-note.txt", ORIGINAL)
    assert info.path == "/home/user/fork-note.txt"
    ex = sbx.run_code("forked_value = {'answer': 6 * 7}\nforked_value['answer']")
    assert ex.error is None, ex.error
    assert ex.text == "42"


def goes_its_own_way(original, fork):
    """`fork` carries `original`'s file and variable, then changes its file alone."""
    assert fork.sandbox_id != original.sandbox_id
    assert fork.files.read("fork-note.txt") == ORIGINAL
    ex = fork.run_code("forked_value['answer']")
    assert ex.error is None, ex.error
    assert ex.text == "42"
    fork.files.write("fork-note.txt", CHANGED)
    assert fork.files.read("fork-note.txt") == CHANGED
    assert original.files.read("fork-note.txt") == ORIGINAL
    # The kernels are apart too.
    assert fork.run_code("forked_value['answer'] = 1").error is None
    assert original.run_code("forked_value['answer']").text == "42"


def seconds_left(sbx):
    end = sbx.get_info().end_at
    return (end - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


@needs_criu
def test_a_sandbox_forks_itself(any_backend):
    """`sbx.fork()`: one fork, with E2B's default timeout for forks (15 s)."""
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120)
    forks = []
    try:
        prepared(sbx)
        forks = made(sbx.fork())
        assert len(forks) == 1
        (fork,) = forks
        assert isinstance(fork, Sandbox)
        assert 0 < seconds_left(fork) <= 15
        goes_its_own_way(sbx, fork)
    finally:
        for f in forks:
            f.kill()
        sbx.kill()


@needs_criu
def test_a_sandbox_is_forked_by_its_id(any_backend):
    """`Sandbox.fork(sandbox_id, count=2, timeout=...)`: two forks, each its own sandbox."""
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120)
    forks = []
    try:
        prepared(sbx)
        forks = made(Sandbox.fork(sbx.sandbox_id, count=2, timeout=90))
        assert len(forks) == 2
        assert len({f.sandbox_id for f in forks}) == 2
        listed = {s.sandbox_id for s in Sandbox.list().next_items()}
        for fork in forks:
            assert fork.sandbox_id in listed
            assert 60 < seconds_left(fork) <= 90
            goes_its_own_way(sbx, fork)
        # Each fork is a sandbox of its own: killing one leaves the other and the original.
        forks[0].kill()
        assert not forks[0].is_running()
        assert forks[1].is_running() and sbx.is_running()
    finally:
        for f in forks:
            f.kill()
        sbx.kill()


@needs_criu
def test_an_async_sandbox_is_forked(any_backend):
    """`AsyncSandbox.fork(sandbox_id)`, the async SDK's class method."""
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        forks = []
        try:
            await sbx.files.write("fork-note.txt", ORIGINAL)
            ex = await sbx.run_code("forked_value = {'answer': 6 * 7}")
            assert ex.error is None, ex.error
            forks = made(await AsyncSandbox.fork(sbx.sandbox_id))
            assert len(forks) == 1
            (fork,) = forks
            assert isinstance(fork, AsyncSandbox)
            assert fork.sandbox_id != sbx.sandbox_id
            assert await fork.files.read("fork-note.txt") == ORIGINAL
            ex = await fork.run_code("forked_value['answer']")
            assert ex.error is None and ex.text == "42", ex
            await fork.files.write("fork-note.txt", CHANGED)
            assert await fork.files.read("fork-note.txt") == CHANGED
            assert await sbx.files.read("fork-note.txt") == ORIGINAL
        finally:
            for f in forks:
                await f.kill()
            await sbx.kill()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_refused_forks_raise_what_e2bs_sdk_raises(e2b_env):
    """What is refused before any fork is tried is the whole request's error, in E2B's
    shape: the SDK raises it from `fork` (a missing sandbox as `SandboxNotFoundException`)."""
    from e2b.exceptions import SandboxException, SandboxNotFoundException
    from e2b_code_interpreter import Sandbox

    with pytest.raises(SandboxNotFoundException):
        Sandbox.fork("00000000-0000-4000-8000-000000000000")
    sbx = Sandbox.create(timeout=60)
    sessions = lambda: {s["id"] for s in e2b_env.api("GET", "/v1/sessions").json()}
    before = sessions()
    try:
        # E2B makes up to 20 forks a request, the broker 8: more is refused whole.
        with pytest.raises(SandboxException, match=r"400: .*between 1 and 8"):
            sbx.fork(count=9)
        # Another user's sandbox is one that does not exist.
        with pytest.raises(SandboxNotFoundException):
            Sandbox.fork(sbx.sandbox_id, api_key=BOB)
        assert sessions() == before, "nothing was made"
    finally:
        sbx.kill()
