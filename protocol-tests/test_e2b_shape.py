"""An E2B sandbox is E2B's shape (issue 35, first bullet), through E2B's own SDKs (pinned:
e2b 2.63.0, e2b-code-interpreter 2.11.5; @e2b/code-interpreter in e2b-js/shape.mjs),
written as an E2B user's code is: home and working directory /home/user (also
/workspace), a workspace of its own per sandbox removed with it, a /tmp its kernel and
commands share, the user `user`, any working directory the sandbox can see, and a `sudo`
that grants nothing and says why.

What E2B does here was read from E2B's SDK and sources: the SDKs' default user `user`
(e2b/sandbox/filesystem, `default_username`), envd's process start (packages/envd/internal/
services/process/handler/handler.go: HOME=/home/user, `cmd.Dir` = the cwd) and the code
interpreter's context creation (template/server/contexts.py: `%cd <cwd>` in the kernel, 500
"Failed to set working directory" when that fails).

`any_backend` runs a test on the local sandbox and on Docker. On Docker each sandbox is a
container of its own (E2B's model: a sandbox is a machine) with its own workspace and /tmp,
the kernel uid named `user`; its container and workspace go with it (checked with the
Docker API below).
"""
import json
import os
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import requests

from conftest import ALICE, BOB, _docker_usable, wait_for

e2b_code_interpreter = pytest.importorskip("e2b_code_interpreter")
from e2b import CommandExitException  # noqa: E402
from e2b.exceptions import InvalidArgumentException  # noqa: E402
from e2b_code_interpreter import Sandbox  # noqa: E402

JS_DIR = Path(__file__).resolve().parent / "e2b-js"
CSV = "a,b\n1,2\n3,4\n"


def _run(sbx, code, **kw):
    ex = sbx.run_code(code, **kw)
    assert ex.error is None, ex.error
    return ex


def _stdout(ex):
    return "".join(ex.logs.stdout).strip()


def test_the_issue_example_reads_home_user(any_backend):
    # The issue's example, verbatim.
    sandbox = Sandbox.create(timeout=60)
    try:
        data = CSV
        sandbox.files.write("/home/user/data.csv", data)
        sandbox.run_code("import pandas as pd; df = pd.read_csv('/home/user/data.csv')")
        assert _run(sandbox, "print(len(df), list(df.columns))").logs.stdout == ["2 ['a', 'b']\n"]
        # The same file by a relative path and through /workspace, from both sides.
        assert sandbox.files.read("data.csv") == CSV
        assert sandbox.files.read("/workspace/data.csv") == CSV
        info = sandbox.files.write("rel.txt", "r")
        assert info.path == "/home/user/rel.txt"
        assert _stdout(_run(sandbox, "print(open('/workspace/rel.txt').read())")) == "r"
        # Home and working directory of commands.
        r = sandbox.commands.run("pwd; echo $HOME; cat data.csv | wc -l")
        assert r.stdout.split() == ["/home/user", "/home/user", "3"]
        assert _stdout(_run(sandbox, "import os; print(os.getcwd(), os.environ['HOME'])")) == (
            "/home/user /home/user"
        )
    finally:
        sandbox.kill()


def test_two_sandboxes_do_not_share_files(any_backend):
    a = Sandbox.create(timeout=60)
    b = Sandbox.create(timeout=60)
    try:
        a.files.write("x", "1")
        with pytest.raises(Exception):
            b.files.read("x")
        assert not b.files.exists("/home/user/x")
        # Only what b's own kernel made (its IPython profile) is in b's home.
        seen = "import os; print(os.path.exists('/home/user/x'), [n for n in os.listdir('/home/user') if n[0] != '.'])"
        assert _stdout(_run(b, seen)) == "False []"
        r = b.commands.run("(ls /home/user; ls /workspace) | wc -w")
        assert r.stdout.strip() == "0"
    finally:
        a.kill()
        b.kill()


def test_the_workspace_goes_with_the_sandbox_and_follows_no_planted_symlink(e2b_env):
    outside = Path(tempfile.mkdtemp(prefix="kb-shape-outside-"))
    (outside / "precious").write_text("keep me")
    try:
        sbx = Sandbox.create(timeout=60)
        home = Path(e2b_env.data_dir) / "sandboxes" / sbx.sandbox_id
        sbx.files.write("kept.txt", "x")
        assert (home / "home" / "kept.txt").read_text() == "x"
        # The kernel plants symlinks to a host directory and a host file, in its home and
        # in /tmp, and a directory whose entries point out.
        _run(sbx, f"""
import os
os.symlink({str(outside)!r}, '/home/user/link')
os.symlink({str(outside / 'precious')!r}, '/tmp/f')
os.makedirs('/home/user/d/e')
os.symlink({str(outside)!r}, '/home/user/d/e/up')
""")
        sbx.commands.run(f"ln -s {outside} /tmp/dirlink")
        sbx.kill()
        assert not home.exists(), f"{home} is left after the kill"
        assert not (Path(e2b_env.data_dir) / "sandboxes-images" / f"{sbx.sandbox_id}.img").exists()
        assert (outside / "precious").read_text() == "keep me"
    finally:
        for p in outside.iterdir():
            p.unlink()
        outside.rmdir()


def _sandbox_containers(sandbox_id):
    """The containers (any state) labelled with this sandbox, as the Docker API lists them."""
    out = subprocess.run(
        ["docker", "ps", "-aq", "--no-trunc", "--filter", f"label=org.kernel-broker.sandbox={sandbox_id}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    return out.split()


def test_docker_sandbox_is_a_container_of_its_own_gone_with_it(fresh_broker, monkeypatch):
    if not _docker_usable():
        pytest.skip("Docker or the kernel image (docker/build.sh) is missing")
    b = fresh_broker(extra_args=["--sandbox", "docker"])
    monkeypatch.setenv("E2B_API_URL", b.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", b.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    outside = Path(tempfile.mkdtemp(prefix="kb-shape-outside-"))
    (outside / "precious").write_text("keep me")
    try:
        a = Sandbox.create(timeout=60)
        other = Sandbox.create(timeout=60)
        # Each sandbox is a container of its own; a context and a command go into it.
        (ca,), (co,) = _sandbox_containers(a.sandbox_id), _sandbox_containers(other.sandbox_id)
        assert ca != co
        ctx = a.create_code_context()
        _run(a, "open('/tmp/from-context', 'w').write('c')", context=ctx)
        assert a.commands.run("cat /tmp/from-context").stdout == "c"
        with pytest.raises(CommandExitException):
            other.commands.run("cat /tmp/from-context")
        home = Path(b.data_dir) / "sandboxes-docker" / a.sandbox_id
        a.files.write("kept.txt", "x")
        assert (home / "home" / "kept.txt").read_text() == "x"
        # The kernel plants symlinks to a host directory and a host file, in its home and
        # in /tmp, and a directory whose entries point out.
        _run(a, f"""
import os
os.symlink({str(outside)!r}, '/home/user/link')
os.symlink({str(outside / 'precious')!r}, '/home/user/f')
os.makedirs('/home/user/d/e')
os.symlink({str(outside)!r}, '/home/user/d/e/up')
os.symlink({str(outside)!r}, '/tmp/dirlink')
""")
        a.kill()
        wait_for(lambda: not _sandbox_containers(a.sandbox_id), what="the sandbox's container removed")
        wait_for(lambda: not home.exists(), what=f"{home} removed")
        assert (outside / "precious").read_text() == "keep me"
        # The other sandbox lives on, untouched.
        assert other.commands.run("echo ok").stdout == "ok\n"
        assert _sandbox_containers(other.sandbox_id) == [co]
        other.kill()
        wait_for(lambda: not _sandbox_containers(other.sandbox_id), what="the other container removed")
    finally:
        for p in outside.iterdir():
            p.unlink()
        outside.rmdir()


def test_tmp_is_shared_by_the_kernel_and_commands(any_backend):
    sbx = Sandbox.create(timeout=60)
    other = Sandbox.create(timeout=60)
    try:
        sbx.commands.run("echo hi >/tmp/x")
        assert sbx.commands.run("cat /tmp/x").stdout == "hi\n"
        assert _stdout(_run(sbx, "print(open('/tmp/x').read())")) == "hi"
        _run(sbx, "open('/tmp/from-kernel', 'w').write('k')")
        assert sbx.commands.run("cat /tmp/from-kernel").stdout == "k"
        # Private to the sandbox.
        with pytest.raises(CommandExitException):
            other.commands.run("cat /tmp/x")
        assert _stdout(_run(other, "import os; print(os.path.exists('/tmp/x'))")) == "False"
    finally:
        sbx.kill()
        other.kill()


def test_the_sandbox_user_is_called_user(any_backend):
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.files.write("f.txt", "1")
        r = sbx.commands.run("whoami; id; ls -l f.txt")
        who, ids, ls = r.stdout.splitlines()
        assert who == "user"
        assert "(user)" in ids.split()[0] and "(user)" in ids.split()[1], ids
        assert ls.split()[2:4] == ["user", "user"], ls
        assert _stdout(_run(sbx, "import getpass, pwd, os; print(getpass.getuser(), pwd.getpwuid(os.getuid()).pw_dir)")) == (
            "user /home/user"
        )
    finally:
        sbx.kill()


def test_any_working_directory_the_sandbox_sees(any_backend):
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.files.make_dir("sub")
        ctx = sbx.create_code_context(cwd="/home/user/sub")
        assert ctx.cwd == "/home/user/sub"
        assert _stdout(_run(sbx, "import os; print(os.getcwd())", context=ctx)) == "/home/user/sub"
        _run(sbx, "open('made-here.txt', 'w').write('1')", context=ctx)
        assert sbx.files.read("sub/made-here.txt") == "1"
        tmp_ctx = sbx.create_code_context(cwd="/tmp")
        assert _stdout(_run(sbx, "import os; print(os.getcwd())", context=tmp_ctx)) == "/tmp"
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sbx.commands.run("pwd", cwd="/home/user/sub").stdout == "/home/user/sub\n"
        # A directory the sandbox does not have: the context is refused (E2B's server: 500
        # "Failed to set working directory"), the command refused before it starts (envd:
        # invalid_argument "cwd '...' does not exist"; test_e2b_commands_cwd.py).
        with pytest.raises(Exception) as e:
            sbx.create_code_context(cwd="/home/user/missing")
        assert "working directory" in str(e.value)
        with pytest.raises(InvalidArgumentException):
            sbx.commands.run("touch ran", cwd="/home/user/missing")
        assert not sbx.files.exists("ran")
    finally:
        sbx.kill()


def test_hostile_working_directories_stay_inside_the_sandbox(any_backend):
    sbx = Sandbox.create(timeout=60)
    try:
        # `..` resolves inside the sandbox: its own tiny /etc, never the host's.
        ctx = sbx.create_code_context(cwd="../../etc")
        listed = _stdout(_run(sbx, "import os; print(os.getcwd(), sorted(os.listdir('.')))", context=ctx))
        host_etc = f"/etc {sorted(os.listdir('/etc'))}"
        assert listed.startswith("/etc ") and listed != host_etc, listed
        if any_backend == "local":
            assert "shadow" not in listed and "kernel-broker.env" in listed, listed
        r = sbx.commands.run("pwd; ls -A", cwd="../../etc")
        assert r.stdout.split()[0] == "/etc" and sorted(r.stdout.split()[1:]) != sorted(os.listdir("/etc"))
        if any_backend == "local":
            assert "shadow" not in r.stdout
        # /proc/1/root is the sandbox's own init (not the kernel's to enter).
        try:
            ctx = sbx.create_code_context(cwd="/proc/1/root")
        except Exception as e:
            assert "working directory" in str(e)
        else:
            # The sandbox's own root (the container's, on Docker), never the host's.
            seen = json.loads(_stdout(_run(sbx, "import os, json; print(json.dumps(os.listdir('.')))", context=ctx)))
            assert sorted(seen) != sorted(os.listdir("/")) and "work" not in seen, seen
        # A NUL byte: refused, nothing runs.
        with pytest.raises(Exception):
            sbx.create_code_context(cwd="/tmp\0/x")
        with pytest.raises(Exception):
            sbx.commands.run("touch nul-ran", cwd="/tmp\0/x")
        assert not sbx.files.exists("nul-ran")
        assert sbx.is_running()
    finally:
        sbx.kill()


def test_sudo_is_refused_clearly_and_grants_nothing(any_backend):
    sbx = Sandbox.create(timeout=60)
    try:
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("sudo apt-get install -y cowsay")
        assert e.value.exit_code == 1
        assert "grant no privileges" in e.value.stderr and "--egress" in e.value.stderr
        assert "--kernels-dir" in e.value.stderr
        assert "not found" not in e.value.stderr
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("sudo id -u")
        assert e.value.exit_code == 1 and e.value.stdout.strip() == ""
        assert sbx.commands.run("id -u").stdout.strip() != "0"
        got = _stdout(_run(sbx, "import subprocess; p = subprocess.run(['sudo', 'id', '-u'], capture_output=True, text=True); print(p.returncode, repr(p.stdout))"))
        assert got == "1 ''", got
    finally:
        sbx.kill()


def test_another_user_never_reaches_a_sandbox_workspace(e2b_env):
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.files.write("secret.txt", "alice's")
        with pytest.raises(Exception):
            Sandbox.connect(sbx.sandbox_id, api_key=BOB)
        r = e2b_env.api("GET", f"/v1/sessions/{sbx.sandbox_id}/files/secret.txt", token=BOB)
        assert r.status_code == 404
        # Bob's own sandbox sees nothing of alice's.
        bobs = Sandbox.create(timeout=60, api_key=BOB)
        try:
            assert not bobs.files.exists("secret.txt")
            r = bobs.commands.run(f"ls {e2b_env.data_dir} 2>&1; ls /home", )
            assert "alice" not in r.stdout and sbx.sandbox_id not in r.stdout
        except CommandExitException as e:
            assert sbx.sandbox_id not in e.stdout
        finally:
            bobs.kill()
        # Alice's REST files API of her sandbox's session is the sandbox's workspace.
        r = e2b_env.api("GET", f"/v1/sessions/{sbx.sandbox_id}/files/secret.txt")
        assert r.status_code == 200 and r.content == b"alice's"
    finally:
        sbx.kill()


def test_rest_workspace_option(e2b_env):
    for bad in ["bogus", "", 1, None, ["own"], "OWN"]:
        r = e2b_env.api("POST", "/v1/sessions", json={"workspace": bad})
        if bad is None:
            # JSON null is the default.
            assert r.status_code == 201, r.text
            e2b_env.api("DELETE", f"/v1/sessions/{r.json()['id']}")
            continue
        assert r.status_code == 400, (bad, r.status_code, r.text)
    own = e2b_env.api("POST", "/v1/sessions", json={"workspace": "own"}).json()["id"]
    shared = e2b_env.api("POST", "/v1/sessions", json={"workspace": "shared"}).json()["id"]
    try:
        name = f"own-{uuid.uuid4().hex}.txt"
        assert e2b_env.api("PUT", f"/v1/sessions/{own}/files/{name}", data=b"1").status_code in (200, 201, 204)
        assert e2b_env.api("GET", f"/v1/sessions/{shared}/files/{name}").status_code == 404
        ex = e2b_env.api("POST", f"/v1/sessions/{own}/execute", json={
            "code": f"import os; print(os.getcwd(), open({name!r}).read())"}).json()
        assert ex["stdout"].strip() == "/home/user 1", ex
    finally:
        e2b_env.api("DELETE", f"/v1/sessions/{own}")
        e2b_env.api("DELETE", f"/v1/sessions/{shared}")
    assert not (Path(e2b_env.data_dir) / "sandboxes" / own).exists()


@pytest.mark.skipif(not (JS_DIR / "node_modules").is_dir(), reason="run scripts/setup --test (npm ci in protocol-tests/e2b-js)")
def test_javascript_sdk_shape(any_backend):
    r = subprocess.run(
        ["node", str(JS_DIR / "shape.mjs")], cwd=JS_DIR, env=dict(os.environ), capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["rows"] == "2", report
    assert report["read"] == CSV and report["viaWorkspace"] == CSV, report
    assert report["pwd"] == "/home/user\n/home/user\n", report
    assert report["tmp"] == "hi\n" and report["tmpKernel"] == "hi", report
    assert report["ctxCwd"] == "/tmp" and report["cmdCwd"] == "/tmp\n", report
    assert report["missingCwd"].startswith("refused"), report
    assert report["sudo"]["exitCode"] == 1 and "grant no privileges" in report["sudo"]["stderr"], report
    assert report["whoami"] == "user\n", report
    assert report["otherSees"] == "refused", report


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_a_kept_sandbox_keeps_its_workspace_across_a_restart(fresh_broker, monkeypatch, backend):
    extra = []
    sandboxes = "sandboxes"
    if backend == "docker":
        if not _docker_usable():
            pytest.skip("Docker or the kernel image (docker/build.sh) is missing")
        # Docker: the sandbox's own container is kept and adopted with its workspace.
        extra, sandboxes = ["--sandbox", "docker"], "sandboxes-docker"
    first = fresh_broker(["--keep-sessions", *extra])
    data = first.data_dir
    monkeypatch.setenv("E2B_API_URL", first.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", first.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    sbx = Sandbox.create(timeout=600)
    sbx.files.write("kept.txt", "still here")
    sbx.commands.run("echo tmp-kept >/tmp/t")
    home = Path(data) / sandboxes / sbx.sandbox_id
    first.terminate()
    assert (home / "home" / "kept.txt").exists()
    # The next run adopts the session and finds its workspace (and /tmp) again.
    second = fresh_broker(["--keep-sessions", *extra], data_dir=data)
    r = second.api("GET", f"/v1/sessions/{sbx.sandbox_id}/files/kept.txt")
    assert r.status_code == 200 and r.content == b"still here", r.text
    ex = second.api("POST", f"/v1/sessions/{sbx.sandbox_id}/execute", json={
        "code": "import os; print(os.getcwd(), open('kept.txt').read(), open('/tmp/t').read().strip())"}).json()
    assert ex["stdout"].strip() == "/home/user still here tmp-kept", ex
    # Ended there: the workspace goes with it.
    assert second.api("DELETE", f"/v1/sessions/{sbx.sandbox_id}").status_code == 204
    assert not home.exists()
    # A run that keeps nothing removes what an earlier one kept.
    monkeypatch.setenv("E2B_API_URL", second.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", second.url + "/e2b/sandbox")
    left = Sandbox.create(timeout=600)
    left.files.write("x", "1")
    second.terminate()
    assert (Path(data) / sandboxes / left.sandbox_id / "home" / "x").exists()
    fresh_broker(extra, data_dir=data)
    assert not (Path(data) / sandboxes / left.sandbox_id).exists()
    assert not (Path(data) / f"{sandboxes}-images" / f"{left.sandbox_id}.img").exists()
