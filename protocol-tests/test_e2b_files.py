"""envd's file API as E2B's SDKs use it (issue 35, the files half of its second bullet),
driven with the pinned SDKs exactly as an E2B user's code drives them: remove and rename
semantics, symlink targets, file metadata, gzip uploads and signed URLs; each with the
hostile cases (a kernel's symlinks, a gzip bomb, forged and expired signatures). On both
sandbox backends where the backend matters (`any_backend`); the JavaScript SDK's calls for
each item run from files.mjs."""

import asyncio
import gzip
import json
import os
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest
import requests

from conftest import ALICE, BOB

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

JS_DIR = Path(__file__).parent / "e2b-js"


def _run(sbx, code):
    ex = sbx.run_code(code)
    assert ex.error is None, ex.error
    return ex


def _fresh(sbx, *names):
    """Until each sandbox has a workspace of its own, sandboxes of one key share one: what
    an earlier test left under these names goes first (a missing one is no error here, so
    that each test, run against a broker without envd's remove, fails at its own item)."""
    from e2b.exceptions import NotFoundException

    for n in names:
        try:
            sbx.files.remove(n)
        except NotFoundException:
            pass


@pytest.fixture
def host_dir():
    """A directory on the host, outside every workspace: what a kernel's symlink points at."""
    d = tempfile.mkdtemp(prefix="kb-hostile-")
    Path(d, "precious").write_text("keep me")
    Path(d, "sub").mkdir()
    Path(d, "sub", "also").write_text("keep me too")
    os.chmod(d, 0o755)
    yield Path(d)
    subprocess.run(["rm", "-rf", d])


def test_remove_is_envds_and_never_follows_a_kernels_symlink(any_backend, host_dir):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        _fresh(sbx, "tree", "top-link", "via")
        # A missing path: no error (envd's os.RemoveAll).
        sbx.files.remove("/home/user/never-was.txt")
        sbx.files.remove("never/was/either")
        # A directory that is not empty goes with everything in it.
        sbx.files.write("/home/user/tree/a.txt", "a")
        sbx.files.write("/home/user/tree/deep/er/b.txt", "b")
        # The kernel plants links to a host directory and a host file inside the tree.
        _run(sbx, f"import os; os.symlink({str(host_dir)!r}, 'tree/deep/to-host');"
                  f"os.symlink({str(host_dir / 'precious')!r}, 'tree/file-link')")
        sbx.files.remove("/home/user/tree")
        assert not sbx.files.exists("tree")
        assert (host_dir / "precious").read_text() == "keep me"
        assert (host_dir / "sub" / "also").read_text() == "keep me too"
        # A link at the top is removed as the link, its target untouched.
        _run(sbx, f"import os; os.symlink({str(host_dir)!r}, 'top-link')")
        sbx.files.remove("top-link")
        assert not sbx.files.exists("top-link")
        assert (host_dir / "precious").exists()
        # Through a linked directory: refused, nothing on the host removed.
        _run(sbx, f"import os; os.symlink({str(host_dir)!r}, 'via')")
        with pytest.raises(Exception):
            sbx.files.remove("via/precious")
        assert (host_dir / "precious").exists()
        # The kernel sees the removal.
        assert _run(sbx, "import os; os.path.exists('tree')").text == "False"


def test_rename_overwrites_as_envd_does(any_backend, host_dir):
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        _fresh(sbx, "a.txt", "b.txt", "d1", "d2", "d3", "dest-link", "c.txt", "via", "e.txt")
        sbx.files.write("a.txt", "new")
        sbx.files.write("b.txt", "old")
        info = sbx.files.rename("a.txt", "/home/user/b.txt")
        assert info.name == "b.txt"
        assert sbx.files.read("b.txt") == "new"
        assert not sbx.files.exists("a.txt")
        # A directory over an empty directory replaces it (rename(2), Go's os.Rename) ...
        sbx.files.write("d1/x.txt", "x")
        sbx.files.make_dir("d2")
        sbx.files.rename("d1", "d2")
        assert sbx.files.read("d2/x.txt") == "x"
        # ... and over one that is not empty fails, both left as they were.
        sbx.files.write("d3/y.txt", "y")
        with pytest.raises(SandboxException):
            sbx.files.rename("d2", "d3")
        assert sbx.files.read("d3/y.txt") == "y" and sbx.files.read("d2/x.txt") == "x"
        # Over a kernel's symlink to a host file: the link is replaced, the host file kept.
        _run(sbx, f"import os; os.symlink({str(host_dir / 'precious')!r}, 'dest-link')")
        sbx.files.write("c.txt", "mine")
        sbx.files.rename("c.txt", "dest-link")
        assert sbx.files.read("dest-link") == "mine"
        assert (host_dir / "precious").read_text() == "keep me"
        # Into a linked directory: refused.
        _run(sbx, f"import os; os.symlink({str(host_dir)!r}, 'via')")
        sbx.files.write("e.txt", "e")
        with pytest.raises(Exception):
            sbx.files.rename("e.txt", "via/planted")
        assert not (host_dir / "planted").exists()


def test_symlinks_carry_their_target_and_are_never_followed(any_backend, host_dir):
    from e2b import FileType
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        _fresh(sbx, "data.csv", "sub", "link", "abs", "hostdir")
        sbx.files.write("data.csv", "a,b\n")
        _run(sbx, "import os; os.makedirs('sub', exist_ok=True); os.symlink('data.csv', 'link');"
                  "os.symlink('../data.csv', 'sub/up'); os.symlink('/etc/hostname', 'abs');"
                  f"os.symlink({str(host_dir)!r}, 'hostdir')")
        info = sbx.files.get_info("link")
        assert info.type == FileType.SYMLINK
        workdirs = ("/workspace", "/home/user")
        assert info.symlink_target in [f"{w}/data.csv" for w in workdirs], info
        assert sbx.files.get_info("sub/up").symlink_target == info.symlink_target
        assert sbx.files.get_info("abs").symlink_target == "/etc/hostname"
        listed = {e.name: e for e in sbx.files.list(".")}
        assert listed["link"].symlink_target == info.symlink_target
        assert listed["data.csv"].symlink_target is None
        # A link to a host directory: described, never entered or read through.
        host = sbx.files.get_info("hostdir")
        assert host.symlink_target == str(host_dir) and host.type == FileType.SYMLINK
        with pytest.raises(Exception):
            sbx.files.list("hostdir")
        with pytest.raises(Exception):
            sbx.files.read("hostdir/precious")


def test_file_metadata_is_stored_as_envd_stores_it(any_backend):
    from e2b.exceptions import InvalidArgumentException
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        _fresh(sbx, "m.txt", "n.txt", "lnk")
        assert str(sbx._envd_version) == "0.6.4"
        w = sbx.files.write("/home/user/m.txt", "x", metadata={"Owner": "data team", "run": "7"})
        assert w.metadata == {"owner": "data team", "run": "7"}
        info = sbx.files.get_info("m.txt")
        assert info.metadata == {"owner": "data team", "run": "7"}
        assert {e.name: e.metadata for e in sbx.files.list(".")}["m.txt"] == info.metadata
        # As envd stores it: user.e2b.<key> extended attributes the kernel reads too.
        attrs = _run(sbx, "import os; sorted(os.listxattr('m.txt'))").text
        assert "user.e2b.owner" in attrs and "user.e2b.run" in attrs
        # Overwriting replaces the metadata (none now).
        sbx.files.write("m.txt", "y")
        assert sbx.files.get_info("m.txt").metadata is None
        # Set inside the sandbox (setfattr): read back; a value that is not UTF-8 is skipped.
        _run(sbx, "import os; os.setxattr('m.txt', 'user.e2b.k', b'v');"
                  "os.setxattr('m.txt', 'user.e2b.bad', b'\\xff\\xfe'); os.setxattr('m.txt', 'user.other', b'z')")
        assert sbx.files.get_info("m.txt").metadata == {"k": "v"}
        # The SDK's own checks, then the broker's on what the SDK does not check.
        with pytest.raises(InvalidArgumentException):
            sbx.files.write("n.txt", "x", metadata={"bad key": "v"})
        big = {f"k{i}": "v" * 250 for i in range(20)}
        with pytest.raises(InvalidArgumentException) as ei:
            sbx.files.write("n.txt", "x", metadata=big)
        assert "total metadata size" in str(ei.value)
        assert not sbx.files.exists("n.txt")
        # A kernel's symlink in the file's place: refused, nothing set on the target.
        _run(sbx, "import os; os.symlink('/etc/hostname', 'lnk')")
        with pytest.raises(Exception):
            sbx.files.write("lnk", "x", metadata={"a": "b"})


def _envd_headers(sbx):
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}


def test_gzip_uploads_decompress_within_the_limit(any_backend):
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        _fresh(sbx, "big.csv", "bomb.bin", "bad.bin")
        text = "line of csv,1,2,3\n" * 50000
        w = sbx.files.write("/home/user/big.csv", text, gzip=True)
        assert w.path.endswith("/big.csv")
        assert sbx.files.read("big.csv") == text
        assert _run(sbx, "len(open('big.csv').read())").text == str(len(text))
        base = os.environ["E2B_SANDBOX_URL"] + "/files"
        # A gzip bomb: 200 MiB of zeros in ~200 KiB, past the 100 MiB --max-file-bytes: 413,
        # nothing written.
        bomb = gzip.compress(b"\0" * (200 << 20), compresslevel=9)
        assert len(bomb) < 1 << 20
        r = requests.post(base, params={"path": "bomb.bin"}, data=bomb, headers={
            **_envd_headers(sbx), "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert r.status_code == 413, r.text
        assert not sbx.files.exists("bomb.bin")
        # Not gzip: a clear 400, nothing written.
        r = requests.post(base, params={"path": "bad.bin"}, data=b"plain bytes", headers={
            **_envd_headers(sbx), "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert r.status_code == 400 and "not valid gzip" in r.json()["message"], r.text
        cut = gzip.compress(b"x" * 100000)[:-20]
        r = requests.post(base, params={"path": "bad.bin"}, data=cut, headers={
            **_envd_headers(sbx), "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert r.status_code == 400, r.text
        r = requests.post(base, params={"path": "bad.bin"}, data=b"x", headers={
            **_envd_headers(sbx), "Content-Type": "application/octet-stream", "Content-Encoding": "br"})
        assert r.status_code == 400 and "unsupported Content-Encoding" in r.json()["message"]
        assert not sbx.files.exists("bad.bin")


def test_gzip_and_metadata_with_the_async_sdk_streaming(e2b_env):
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            async def chunks():
                for i in range(200):
                    yield f"row {i}\n".encode() * 100

            w = await sbx.files.write("/home/user/astream.txt", chunks(), gzip=True,
                                      metadata={"source": "async"})
            assert w.metadata == {"source": "async"}
            want = "".join(f"row {i}\n" * 100 for i in range(200))
            assert await sbx.files.read("astream.txt") == want
            assert (await sbx.files.get_info("astream.txt")).metadata == {"source": "async"}
            await sbx.files.remove("astream.txt")
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_signed_urls_work_with_a_plain_http_client(any_backend):
    from e2b_code_interpreter import Sandbox

    a = Sandbox.create(timeout=120)
    b = Sandbox.create(timeout=120)
    try:
        _fresh(a, "x.txt", "up.txt")
        a.files.write("/home/user/x.txt", "from a")
        _fresh(b, "y.txt")
        b.files.write("/home/user/y.txt", "from b")
        url = a.download_url("/home/user/x.txt")
        # Where the SDK puts it with E2B_SANDBOX_URL: that URL's origin + /files.
        assert urllib.parse.urlparse(url).path == "/files"
        r = requests.get(url)
        assert r.status_code == 200 and r.content == b"from a"
        assert requests.get(b.download_url("/home/user/y.txt")).content == b"from b"
        assert requests.get(a.download_url("x.txt", use_signature_expiration=60)).content == b"from a"
        up = a.upload_url("/home/user/up.txt", use_signature_expiration=60)
        r = requests.post(up, files={"file": ("up.txt", b"uploaded")})
        assert r.status_code == 200, r.text
        assert a.files.read("up.txt") == "uploaded"

        def refused(method, url, why, **kw):
            r = requests.request(method, url, **kw)
            assert r.status_code == 401, (r.status_code, r.text)
            assert r.json() == {"code": 401, "message": why}, r.text

        # Expired, tampered, another path, another operation: envd's 401s.
        refused("GET", a.download_url("x.txt", use_signature_expiration=-5), "signature is already expired")
        q = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
        files = url.split("?")[0]
        refused("GET", files + "?" + urllib.parse.urlencode({**q, "path": "/home/user/up.txt"}), "invalid signature")
        refused("GET", files + "?" + urllib.parse.urlencode({**q, "signature": q["signature"][:-2] + "AA"}),
                "invalid signature")
        refused("GET", files + "?" + urllib.parse.urlencode({**q, "signature_expiration": "99999999999"}),
                "invalid signature")
        refused("POST", url, "invalid signature", files={"file": ("x.txt", b"overwrite")})
        refused("GET", up, "invalid signature")
        assert a.files.read("x.txt") == "from a"
        # Without a signature or token: nothing.
        r = requests.get(files, params={"path": "/home/user/x.txt"})
        assert r.status_code in (400, 401), r.text
        # A query that does not parse (an expiry that is no number): E2B's 400, as JSON.
        for route in (files, os.environ["E2B_SANDBOX_URL"] + "/files"):
            r = requests.get(route, params={**q, "signature_expiration": "-3.19e-295"})
            assert r.status_code == 400, (r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/json"), r.headers
            assert r.json()["code"] == 400 and "signature_expiration" in r.json()["message"], r.text
        # A sandbox that ended: its URLs stop working.
        a.kill()
        refused("GET", url, "invalid signature")
    finally:
        for s in (a, b):
            try:
                s.kill()
            except Exception:
                pass


def _wait_events(handle, want, timeout=10):
    """Polls a sync watch handle until `want(events)` holds."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += handle.get_new_events()
        if want(seen):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"events seen: {seen}")


def test_watch_dir_sync_recursive_with_entries(any_backend, host_dir):
    from e2b import FilesystemEventType
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=120) as sbx:
        _fresh(sbx, "watched")
        sbx.files.make_dir("/home/user/watched")
        _run(sbx, f"import os; os.symlink({str(host_dir)!r}, 'watched/to-host')")
        h = sbx.files.watch_dir("/home/user/watched", recursive=True, include_entry=True,
                                allow_network_mounts=True)
        sbx.files.write("watched/a.txt", "a")
        _run(sbx, "import os; os.makedirs('watched/sub/deeper')")
        events = _wait_events(h, lambda ev: any(e.name == "sub" for e in ev))
        created = {e.name: e for e in events if e.type == FilesystemEventType.CREATE}
        assert "a.txt" in created, events
        assert created["a.txt"].entry is not None and created["a.txt"].entry.size in (0, 1)
        # New subdirectories are watched (recursive): a file written by the kernel there.
        _run(sbx, "open('watched/sub/deeper/k.txt', 'w').write('k')")
        _run(sbx, "import os; os.remove('watched/a.txt')")
        events = _wait_events(h, lambda ev: any(e.name == "sub/deeper/k.txt" for e in ev)
                              and any(e.type == FilesystemEventType.REMOVE for e in ev))
        assert any(e.name == "a.txt" and e.type == FilesystemEventType.REMOVE for e in events), events
        # The host side of a kernel's link is never watched.
        (host_dir / "changed").write_text("x")
        time.sleep(0.5)
        assert not any("changed" in e.name for e in h.get_new_events())
        h.stop()
        # A link as the directory to watch is refused; so is a file, and a missing path.
        for bad in ("watched/to-host", "watched/sub/deeper/k.txt", "watched/nope"):
            with pytest.raises(Exception):
                sbx.files.watch_dir(bad)


def test_watch_dir_async_stream_ends_with_the_sandbox(e2b_env):
    from e2b import FilesystemEventType
    from e2b_code_interpreter import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            await sbx.files.remove("awatched")
            await sbx.files.make_dir("awatched")
            seen, done = [], asyncio.Event()

            def on_event(e):
                seen.append(e)
                if any(x.name == "b/c.txt" for x in seen):
                    done.set()

            h = await sbx.files.watch_dir("awatched", on_event, recursive=True, include_entry=True)
            await sbx.files.write("awatched/one.txt", "1")
            await sbx.run_code("import os; os.makedirs('awatched/b'); open('awatched/b/c.txt','w').write('c')")
            await asyncio.wait_for(done.wait(), 15)
            one = [e for e in seen if e.name == "one.txt" and e.type == FilesystemEventType.CREATE]
            assert one and one[0].entry is not None, seen
            await h.stop()
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_watchers_are_bounded_and_another_sandboxs_are_unreachable(e2b_env):
    from e2b_code_interpreter import Sandbox

    a = Sandbox.create(timeout=120)
    try:
        _fresh(a, "bounded")
        a.files.make_dir("bounded")
        h = a.files.watch_dir("bounded")
        # Another sandbox (even the same user's) cannot read or stop it.
        b = Sandbox.create(timeout=120)
        try:
            for method in ("GetWatcherEvents", "RemoveWatcher"):
                r = requests.post(os.environ["E2B_SANDBOX_URL"] + f"/filesystem.Filesystem/{method}",
                                  json={"watcherId": h._watcher_id},
                                  headers={"E2b-Sandbox-Id": b.sandbox_id,
                                           "X-Access-Token": b._envd_access_token})
                assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
        finally:
            b.kill()
        # Another user's sandbox: not found either.
        bob = Sandbox.create(timeout=60, api_key=BOB)
        try:
            r = requests.post(os.environ["E2B_SANDBOX_URL"] + "/filesystem.Filesystem/GetWatcherEvents",
                              json={"watcherId": h._watcher_id},
                              headers={"E2b-Sandbox-Id": bob.sandbox_id,
                                       "X-Access-Token": bob._envd_access_token})
            assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
        finally:
            bob.kill()
        # A flood of files: the broker's buffer stays bounded (events past it are dropped).
        _run(a, "import os\nfor i in range(15000): open(f'bounded/f{i}', 'w').close()")
        time.sleep(1)
        events = h.get_new_events()
        assert 0 < len(events) <= 10000, len(events)
        # Watches per user are bounded.
        extra = []
        with pytest.raises(Exception) as ei:
            for _ in range(40):
                extra.append(a.files.watch_dir("bounded"))
        assert "limit" in str(ei.value)
        for w in extra:
            w.stop()
        h.stop()
        a.files.remove("bounded")
        # A sandbox's end ends its watchers.
        h = a.files.watch_dir(".")
        a.kill()
        with pytest.raises(Exception):
            h.get_new_events()
    finally:
        try:
            a.kill()
        except Exception:
            pass


@pytest.mark.skipif(not (JS_DIR / "node_modules").is_dir(), reason="run scripts/setup --test (npm ci in protocol-tests/e2b-js)")
def test_javascript_sdk_files(any_backend, host_dir):
    env = dict(os.environ, HOST_DIR=str(host_dir))
    r = subprocess.run(["node", str(JS_DIR / "files.mjs")], cwd=JS_DIR, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["removedMissing"] is True
    assert report["treeGone"] is True
    assert (host_dir / "precious").read_text() == "keep me"
    assert report["renamed"] == "new"
    assert report["symlinkTarget"] in ("/workspace/data.csv", "/home/user/data.csv"), report
    assert report["metadata"] == {"owner": "js"}, report
    assert report["owner"] == ["user", "user"], report
    assert report["gzip"] == "z" * 10000
    assert report["signedDownload"] == "from js"
    assert report["signedUpload"] == "up from js"
    assert report["expired"] == 401
    assert "top.txt" in report["watched"] and "in/deep.txt" in report["watched"], report
    assert report["topEntry"] == "top.txt", report


def test_owner_and_group_are_names(any_backend):
    """envd names an entry's owner and group from the sandbox's user database (e2b-dev/infra
    packages/envd/internal/services/filesystem/utils.go, `getFileOwnership`; the SDK's
    EntryInfo `owner`/`group` are strings): the sandbox user's files read `user`."""
    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=60) as sbx:
        sbx.files.write("/home/user/x", "1")
        sbx.files.make_dir("/home/user/d")
        sbx.run_code("import os; os.symlink('x', 'l')")
        info = sbx.files.get_info("/home/user/x")
        assert (info.owner, info.group) == ("user", "user"), info
        listed = {e.name: (e.owner, e.group) for e in sbx.files.list("/home/user")}
        assert listed["x"] == listed["d"] == listed["l"] == ("user", "user"), listed
        assert sbx.files.get_info("/home/user").owner == "user"
        if any_backend == "local":
            # The name the sandbox itself gives the owner.
            shown = sbx.commands.run("stat -c '%U %G' x").stdout.split()
            assert shown == ["user", "user"], shown


def test_an_upload_refused_for_its_headers_is_answered_after_its_body(e2b_env):
    """A refusal for a header (here invalid metadata) waits for the body the client is still
    sending: answered unread, the connection was closed under the client's write, and E2B's
    SDK raised a broken pipe instead of the refusal (seen in CI). The body read, the
    connection stays open for the next request."""
    import socket
    from urllib.parse import urlsplit

    from e2b_code_interpreter import Sandbox

    with Sandbox.create(timeout=60) as sbx:
        url = urlsplit(os.environ["E2B_SANDBOX_URL"])
        headers = _envd_headers(sbx)
        body = b"x" * 1000

        def request(metadata_value):  # over the total size allowed: refused
            return (
                f"POST {url.path}/files?path=race.txt HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"E2b-Sandbox-Id: {headers['E2b-Sandbox-Id']}\r\n"
                f"X-Access-Token: {headers['X-Access-Token']}\r\n"
                f"X-Metadata-Bad: {metadata_value}\r\n"
                "Content-Type: application/octet-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()

        with socket.create_connection((url.hostname, url.port), timeout=30) as s:
            s.sendall(request("v" * 5000))
            time.sleep(0.5)
            s.sendall(body)
            first = s.recv(65536)
            assert first.startswith(b"HTTP/1.1 400"), first
            assert b"invalid metadata" in first, first
            # The same connection answers a good upload.
            s.sendall(request("ok") + body)
            second = b""
            while b"\r\n\r\n" not in second:
                chunk = s.recv(65536)
                assert chunk, second
                second += chunk
            assert second.startswith(b"HTTP/1.1 200"), second
        assert sbx.files.read("race.txt") == "x" * 1000
