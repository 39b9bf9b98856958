"""E2B's SDKs against a command's working directory, as an E2B user's code meets it.

envd checks a command's `cwd` before starting it (e2b-dev/infra
packages/envd/internal/services/process/handler/handler.go: `os.Stat` of the resolved path,
`connect.CodeInvalidArgument` "cwd '...' does not exist"): no `start` event, the command
never runs, and the SDKs raise `InvalidArgumentException` (Python, e2b/envd/rpc.py's code
map) / `InvalidArgumentError` (JavaScript). The broker asks the sandbox itself (a `test -e`
run inside it), never the host, so hostile paths stay paths inside the sandbox.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

e2b = pytest.importorskip("e2b")

from e2b import CommandExitException, Sandbox  # noqa: E402
from e2b.exceptions import InvalidArgumentException  # noqa: E402

JS_DIR = Path(__file__).parent / "e2b-js"


def test_a_missing_cwd_is_refused_before_the_command_starts(any_backend):
    sbx = Sandbox.create(timeout=60)
    try:
        with pytest.raises(InvalidArgumentException) as e:
            sbx.commands.run("touch ran", cwd="/home/user/missing")
        assert "cwd '/home/user/missing' does not exist" in str(e.value)
        # Relative paths resolve from /home/user, as envd's do.
        with pytest.raises(InvalidArgumentException) as e:
            sbx.commands.run("touch ran", cwd="missing/deeper")
        assert "cwd '/home/user/missing/deeper' does not exist" in str(e.value)
        # In the background too: nothing starts, nothing is listed.
        with pytest.raises(InvalidArgumentException):
            sbx.commands.run("touch ran", cwd="/nowhere", background=True)
        assert not sbx.files.exists("ran")
        assert sbx.commands.list() == []
        # Directories that exist keep working; a command that fails still fails as itself.
        sbx.files.make_dir("sub")
        assert sbx.commands.run("pwd", cwd="/home/user/sub").stdout == "/home/user/sub\n"
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        with pytest.raises(CommandExitException):
            sbx.commands.run("exit 3", cwd="/home/user/sub")
    finally:
        sbx.kill()


def test_hostile_cwds_are_paths_inside_the_sandbox(any_backend):
    sbx = Sandbox.create(timeout=60)
    try:
        # Shell syntax in the path is a path, never run.
        for cwd in ("$(touch pwned)", "`touch pwned`", "x; touch pwned", "-n", "--"):
            with pytest.raises(InvalidArgumentException):
                sbx.commands.run("true", cwd=cwd)
        assert not sbx.files.exists("pwned")
        # A directory the kernel makes with such a name works as a directory.
        sbx.files.make_dir("$(touch pwned)")
        r = sbx.commands.run("pwd", cwd="$(touch pwned)")
        assert r.stdout.endswith("/$(touch pwned)\n"), r.stdout
        assert not sbx.files.exists("pwned")
        # Symlinks the kernel plants are followed inside the sandbox only: one to a host
        # path the sandbox does not have is missing; a loop is refused by the command's cd.
        sbx.commands.run("ln -s /root to-root; ln -s loop loop", cwd="/home/user")
        host_has_it = os.path.isdir("/root")
        assert host_has_it
        try:
            r = sbx.commands.run("ls -A", cwd="to-root")
            listed = r.stdout.split()
            assert sorted(listed) != sorted(os.listdir("/root")) or listed == [], listed
        except (InvalidArgumentException, CommandExitException):
            pass
        with pytest.raises((InvalidArgumentException, CommandExitException)):
            sbx.commands.run("touch ran", cwd="loop")
        assert not sbx.files.exists("ran")
    finally:
        sbx.kill()


def test_another_users_token_cannot_probe_a_sandbox(e2b_env, monkeypatch):
    from conftest import BOB

    sbx = Sandbox.create(timeout=60)
    try:
        monkeypatch.setenv("E2B_API_KEY", BOB)
        with pytest.raises(Exception) as e:
            Sandbox.connect(sbx.sandbox_id).commands.run("true", cwd="/home/user/missing")
        assert not isinstance(e.value, InvalidArgumentException), e.value
    finally:
        sbx.kill()


@pytest.mark.skipif(not (JS_DIR / "node_modules").is_dir(), reason="run scripts/setup --test (npm ci in protocol-tests/e2b-js)")
def test_javascript_sdk_missing_cwd(e2b_env):
    r = subprocess.run(
        ["node", str(JS_DIR / "cwd.mjs")], cwd=JS_DIR, env=dict(os.environ),
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["missing"].startswith("InvalidArgumentError: "), report
    assert "cwd '/home/user/js-missing' does not exist" in report["missing"], report
    assert report["ran"] is False
    assert report["here"] == "/home/user/js-here\n"
