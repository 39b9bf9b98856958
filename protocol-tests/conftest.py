"""Shared harness of the protocol tests: a real kernel-broker binary (local sandbox, real
ipykernel) on 127.0.0.1 with an ephemeral port, and two users.

The broker binary is target/debug/kernel-broker (scripts/test builds it); set
KERNEL_BROKER_BIN to use another build.
"""
import os
import re
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
ALICE = "alice-token-0001"
BOB = "bob-token-0002"


class Broker:
    def __init__(self, extra_args=(), env=None, data_dir=None, listen="127.0.0.1:0", cgroup=None):
        self.tmp = tempfile.TemporaryDirectory(prefix="kb-proto-")
        tmp = Path(self.tmp.name)
        users = tmp / "users.toml"
        users.write_text(
            f'[[user]]\nname = "alice"\ntoken = "{ALICE}"\n\n'
            f'[[user]]\nname = "bob"\ntoken = "{BOB}"\n'
        )
        # cgroup: another broker's (a restart that adopts its kernels).
        self.cgroup = cgroup or f"kernel-broker-proto-{uuid.uuid4().hex[:12]}"
        # data_dir: reuse another broker's directory (a restart on the same data).
        self.data_dir = Path(data_dir) if data_dir is not None else tmp / "data"
        binary = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))
        args = [
            binary, "serve",
            "--listen", listen,
            "--users-file", str(users),
            "--data-dir", str(self.data_dir),
            "--kernels-dir", str(REPO / "kernels"),
            "--cgroup-name", self.cgroup,
            *extra_args,
        ]
        full_env = dict(os.environ)
        full_env.setdefault("KERNEL_BROKER_LOG", "info")
        full_env.pop("KERNEL_BROKER_TOKEN", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     env=full_env, text=True)
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
            self.stop()
            raise RuntimeError("broker did not start:\n" + "".join(self.log))
        self.host = self.url.removeprefix("http://")

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
        # A broker killed with SIGKILL leaves its workspace file systems mounted (a later
        # broker on the same data directory reuses them); unmount what lies below us.
        top = os.path.realpath(self.tmp.name) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split(" ")[4] for line in f]
        for point in sorted((p for p in points if p.startswith(top)), reverse=True):
            subprocess.run(["umount", "-l", point], check=False)
        self.tmp.cleanup()


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
