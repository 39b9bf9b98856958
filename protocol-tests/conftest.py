"""Shared harness of the protocol tests: a real kernel-broker binary (local sandbox, real
ipykernel) on 127.0.0.1 with an ephemeral port, and two users.

The broker binary is target/debug/kernel-broker (scripts/test builds it); set
KERNEL_BROKER_BIN to use another build.
"""
import glob
import hashlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
# Under pytest-xdist (scripts/test runs the suite with `-n`) each worker is a process of its
# own with its own session fixtures; its brokers' names carry the worker's name, so the
# end-of-run check of one worker never counts another's live brokers as leftovers.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
CGROUP_PREFIX = f"kernel-broker-proto-{WORKER}-"
TMP_PREFIX = f"kb-proto-{WORKER}-"
# The runtime bases of every broker the run started.
RUN_BASES = set()
ALICE = "alice-token-0001"
BOB = "bob-token-0002"


def restartable_port():
    """A free port for a broker that is started again on it: below the machine's ephemeral
    range (net.ipv4.ip_local_port_range), which no outgoing connection and no bind to port 0
    is given, so nothing takes it while the broker is down (a port-0 port can be)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    low = min(10_000, first // 2)
    for _ in range(100):
        if first <= low + 1_000:
            break
        port = random.randrange(low, first)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    def __init__(self, extra_args=(), env=None, data_dir=None, listen="127.0.0.1:0"):
        self.tmp = tempfile.TemporaryDirectory(prefix=TMP_PREFIX)
        tmp = Path(self.tmp.name)
        users = tmp / "users.toml"
        users.write_text(
            f'[[user]]\nname = "alice"\ntoken = "{ALICE}"\n\n'
            f'[[user]]\nname = "bob"\ntoken = "{BOB}"\n'
        )
        # data_dir: reuse another broker's directory (a restart on the same data).
        self.data_dir = Path(data_dir) if data_dir is not None else tmp / "data"
        # One cgroup name per data directory: a broker restarted on the data of one that was
        # SIGKILLed sweeps what that one left (its startup sweep looks under its own name).
        # A fresh name per broker left the killed broker's leaves behind for good.
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
        self.cgroup_name = f"{CGROUP_PREFIX}{digest}"
        # The broker's runtime base as root (`fsutil::data_dir_hash`): checked at the end.
        absolute = os.path.abspath(self.data_dir)
        self.run_base = "/run/kernel-broker-" + hashlib.sha256(absolute.encode()).hexdigest()[:8]
        RUN_BASES.add(self.run_base)
        binary = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))
        args = [
            binary, "serve",
            "--listen", listen,
            "--users-file", str(users),
            "--data-dir", str(self.data_dir),
            "--kernels-dir", str(REPO / "kernels"),
            "--cgroup-name", self.cgroup_name,
            *extra_args,
        ]
        full_env = dict(os.environ)
        full_env.setdefault("KERNEL_BROKER_LOG", "info")
        full_env.pop("KERNEL_BROKER_TOKEN", None)
        full_env.update(env or {})
        # An address given is tried again for 10 s while it is in use (a broker restarted on
        # its port: something may hold it for a moment).
        for _ in range(20):
            if self._launch(args, full_env):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{listen} stayed in use for 10 s:\n" + "".join(self.log))
        self.host = self.url.removeprefix("http://")

    def _launch(self, args, env):
        """Starts the process; False when it exited because its address is in use."""
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     env=env, text=True)
        self.log = []
        ready = threading.Event()
        self.url = None

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"ready on http://([0-9.:]+)", line)
                if m and not ready.is_set():
                    self.url = "http://" + m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(60) or self.url is None:
            if self.proc.poll() is not None and any("Address already in use" in line for line in self.log):
                # It bound nothing and made nothing: only the process to reap. (stop() would
                # also sweep the cgroups and runtime directory of this data directory, which
                # a restart under --keep-sessions finds its kept kernels in.)
                self.proc.wait(10)
                return False
            self.stop()
            raise RuntimeError("broker did not start:\n" + "".join(self.log))
        return True

    def headers(self, token=ALICE):
        return {"Authorization": f"token {token}"}

    def api(self, method, path, token=ALICE, **kw):
        kw.setdefault("timeout", 60)
        return requests.request(method, self.url + path, headers=self.headers(token), **kw)

    def kill9(self):
        """SIGKILL the broker: no shutdown, no flush (its data directory is kept)."""
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self):
        """SIGTERM the broker and wait for it; its data directory is kept."""
        self.proc.terminate()
        assert self.proc.wait(60) == 0, "".join(self.log[-30:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # A broker killed with SIGKILL (and not restarted) leaves its cgroup leaves: kill what
        # runs in them and remove them, as its next start would have.
        remove_cgroups(self.cgroup_name)
        shutil.rmtree(self.run_base, ignore_errors=True)
        # A broker killed with SIGKILL leaves its workspace file systems mounted (a later
        # broker on the same data directory reuses them); unmount what lies below us.
        top = os.path.realpath(self.tmp.name) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split(" ")[4] for line in f]
        for point in sorted((p for p in points if p.startswith(top)), reverse=True):
            subprocess.run(["umount", "-l", point], check=False)
        self.tmp.cleanup()


def cgroup_dirs(name_glob):
    """Cgroup directories of brokers named by `name_glob`, on v1 and v2 hierarchies."""
    found = []
    for pattern in ("/sys/fs/cgroup/*/" + name_glob, "/sys/fs/cgroup/" + name_glob):
        found += [d for d in glob.glob(pattern) if os.path.isdir(d)]
    return found


def remove_cgroups(name):
    """Kills the processes in a broker's cgroup tree and removes it, deepest first."""
    for base in cgroup_dirs(name):
        for _ in range(50):
            dirs = sorted((root for root, _, _ in os.walk(base)), key=len, reverse=True)
            pids = []
            for d in dirs:
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids += [int(p) for p in f.read().split()]
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for d in dirs:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            if not os.path.isdir(base):
                break
            time.sleep(0.1)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """The suite's end-of-run check: no broker cgroup, kernel process, runtime directory or
    temporary directory of ours (this worker's) survives the run (a leak fails the run,
    naming it)."""
    before_tmp = set(glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")))
    before_cgroups = set(cgroup_dirs(CGROUP_PREFIX + "*"))
    yield
    time.sleep(0.5)
    left = []
    left += [d for d in cgroup_dirs(CGROUP_PREFIX + "*") if d not in before_cgroups]
    left += [d for d in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*"))
             if d not in before_tmp]
    left += [d for d in sorted(RUN_BASES) if os.path.exists(d)]
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left += [line.strip() for line in out.splitlines()
             if "ipykernel_launcher" in line and TMP_PREFIX in line]
    assert not left, "the protocol tests left behind:\n  " + "\n  ".join(left)


@pytest.fixture(scope="session")
def broker():
    b = Broker()
    yield b
    b.stop()


@pytest.fixture
def fresh_broker():
    """A broker of one's own, for tests that restart or kill it."""
    brokers = []

    def make(*args, **kw):
        b = Broker(*args, **kw)
        brokers.append(b)
        return b

    yield make
    # Newest first: a later broker may use an earlier one's data directory.
    for b in reversed(brokers):
        b.stop()


def wait_for(pred, timeout=30, interval=0.1, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


# The E2B SDK suites' fixtures (test_e2b*.py): the SDKs read only these three variables.
@pytest.fixture
def e2b_env(broker, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", broker.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", broker.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    return broker


def _docker_usable():
    if shutil.which("docker") is None:
        return False
    r = subprocess.run(["docker", "image", "inspect", "kernel-broker/python-kernel"], capture_output=True)
    return r.returncode == 0


@pytest.fixture(scope="session")
def docker_broker():
    """The session's broker on the Docker sandbox, shared as `broker` is (started on first
    use): what `any_backend`'s docker half runs against. A test that restarts a broker or needs
    flags of its own starts one with `fresh_broker`."""
    if not _docker_usable():
        pytest.skip("Docker or the kernel image (docker/build.sh) is missing")
    b = Broker(extra_args=["--sandbox", "docker"])
    yield b
    b.stop()


@pytest.fixture(params=["local", "docker"])
def any_backend(request, monkeypatch):
    b = request.getfixturevalue("broker" if request.param == "local" else "docker_broker")
    monkeypatch.setenv("E2B_API_URL", b.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", b.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    return request.param


def criu_ready():
    """CRIU 4 where the broker looks (scripts/setup-criu); KB_REQUIRE_CRIU=1 (CI) requires it."""
    for path in ("/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/local/bin/criu"):
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        except OSError:
            continue
        if "Version: 4" in out:
            return True
    if os.environ.get("KB_REQUIRE_CRIU") == "1":
        raise RuntimeError("KB_REQUIRE_CRIU=1 but CRIU 4 is not installed: run scripts/setup-criu")
    return False


# A copy of a kernel into a sandbox of its own (an E2B fork, a pause) is made with CRIU:
# without it the broker refuses (409).
needs_criu = pytest.mark.skipif(not criu_ready(), reason="CRIU 4 is not installed (scripts/setup-criu)")
