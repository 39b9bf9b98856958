#!/usr/bin/env python3
"""kernel-broker benchmark suite: starts every system itself, drives them all with the same
client code in one run, prints one table and writes JSON.

    bench/run [--quick] [--json PATH] [--systems floor,local,docker,kg] [--sessions 10,100]

(bench/run sets up bench/.venv and builds the release binary, then runs this file.)

Systems, each started and stopped here, one after the other (never two at once):
  floor   jupyter_client directly against a bare ipykernel (no sandbox, no server)
  local   kernel-broker, local sandbox (bubblewrap + cgroups), release build
  docker  kernel-broker --sandbox docker (skipped when the kernel image is missing)
  kg      Jupyter Kernel Gateway (PyPI), driven over /api/kernels/{id}/channels
Every kernel is the same: kernels/.venv's ipykernel (docker: the image built from the same
pins). Clients ("paths"):
  agent_ws        broker /v1/sessions/{id}/stream (JSON frames; waits for `done`)
  rest            broker POST /v1/sessions/{id}/execute
  jupyter_ws      /api/kernels/{id}/channels, legacy JSON frames (broker and KG alike):
                  execute_request, then wait for execute_reply and iopub status idle
  jupyter_client  the floor: BlockingKernelClient.execute_interactive over ZeroMQ
Every client sets TCP_NODELAY on its own socket.

Measures: cold start (create -> first `1+1` result; the broker with --pool-size 0), pooled
start (the broker's warm pool refilled between samples), `1+1` round trips, a cell printing
100,000 lines, a cell displaying a ~2 MB PNG, aggregate executes/s with N concurrent
sessions each running `1+1` in a loop (failures counted), and memory: server RSS per idle
session and the kernels' own RSS per session.
"""
import argparse
import atexit
import base64
import collections
import concurrent.futures
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import requests
import websocket

REPO = Path(__file__).resolve().parent.parent
KERNEL_PYTHON = REPO / "kernels/.venv/bin/python"
DOCKER_IMAGE = "kernel-broker/python-kernel:latest"
USERS = 4  # concurrency sessions are spread over this many broker users (--broker-users)
TIMEOUT = 120  # seconds: the bound on any single wait below

STREAM_LINES = 100_000
STREAM_CODE = f"for _i in range({STREAM_LINES}):\n    print(f'line {{_i:06d}}')"
STREAM_BYTES = STREAM_LINES * len("line 000000\n")
PNG_SIDE = 756  # random RGB noise, saved as RGBA: ~3.5 bytes per pixel as PNG, ~2.0 MB
PNG_SETUP = (
    "import io as _io, numpy as _np, matplotlib as _mpl\n"
    "_mpl.use('Agg')\n"
    "import matplotlib.pyplot as _plt\n"
    "from IPython.display import Image as _Image, display as _display\n"
    "_buf = _io.BytesIO()\n"
    f"_plt.imsave(_buf, _np.random.default_rng(0).integers(0, 256, ({PNG_SIDE}, {PNG_SIDE}, 3), dtype=_np.uint8), format='png')\n"
    "_png = _buf.getvalue()\n"
    "len(_png)"
)
PNG_CODE = "_display(_Image(data=_png))"

# --------------------------------------------------------------------------------------
# process hygiene: everything started here is stopped at exit, whatever happens

_CLEANUPS = []
_CLEANUP_LOCK = threading.Lock()


def on_exit(fn):
    with _CLEANUP_LOCK:
        _CLEANUPS.append(fn)
    return fn


def run_cleanups():
    while True:
        with _CLEANUP_LOCK:
            if not _CLEANUPS:
                return
            fn = _CLEANUPS.pop()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            print(f"bench: cleanup failed: {e}", file=sys.stderr)


atexit.register(run_cleanups)


def _on_signal(signum, frame):
    run_cleanups()
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, _on_signal)


def log(*a):
    print("bench:", *a, file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc, descendants=(), grace=30):
    """SIGTERM, wait, SIGKILL; then SIGKILL whatever of `descendants` is still alive."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for p in descendants:
        try:
            if p.is_running():
                p.kill()
        except psutil.Error:
            pass


def drain(stream, sink, on_line=None):
    # KB_BENCH_LOG_FILE: every line of the broker's log appended there too (with
    # KB_BENCH_LOG=debug, the broker's own timings of each step).
    copy = os.environ.get("KB_BENCH_LOG_FILE")

    def pump():
        out = open(copy, "a") if copy else None
        for line in stream:
            sink.append(line)
            if out:
                out.write(line)
                out.flush()
            if on_line:
                on_line(line)
        if on_line:
            on_line(None)

    threading.Thread(target=pump, daemon=True).start()


def descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def is_kernel(p):
    """The kernel's own python process (not bwrap or a shell wrapped around it). A kernel
    forked from a fork-server template keeps the template's command line: it is a child of
    the template (the template itself is not a kernel)."""
    try:
        cmd = p.cmdline()
        if not cmd or not os.path.basename(cmd[0]).startswith("python"):
            return False
        if any("ipykernel" in a for a in cmd):
            return True
        boot = [a for a in cmd if a.endswith("kernel_broker_boot.py")]
        if boot:
            parent = p.parent()
            return parent is not None and any(a.endswith("kernel_broker_boot.py") for a in parent.cmdline())
        return False
    except psutil.Error:
        return False


def rss_kib(pid):
    try:
        return psutil.Process(pid).memory_info().rss // 1024
    except psutil.Error:
        return 0


def kernel_memory(procs):
    rss = uss = n = 0
    for p in procs:
        try:
            mi = p.memory_full_info()
        except psutil.Error:
            continue
        rss += mi.rss
        uss += mi.uss
        n += 1
    return {"kernel_processes": n, "kernel_rss_total_kib": rss // 1024, "kernel_uss_total_kib": uss // 1024}


def cpu_seconds(pid):
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def nodelay(ws):
    ws.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --------------------------------------------------------------------------------------
# statistics


def pct(samples, p):
    s = sorted(samples)
    k = max(0, min(len(s) - 1, round(p / 100 * (len(s) - 1))))
    return s[k]


def summary(samples):
    """Seconds in, milliseconds out."""
    if not samples:
        return {"n": 0}
    return {"n": len(samples), "p50_ms": round(pct(samples, 50) * 1000, 3),
            "p99_ms": round(pct(samples, 99) * 1000, 3), "mean_ms": round(statistics.mean(samples) * 1000, 3),
            "min_ms": round(min(samples) * 1000, 3), "max_ms": round(max(samples) * 1000, 3)}


# --------------------------------------------------------------------------------------
# clients: one interface, .execute(code) -> Result


class Result:
    __slots__ = ("status", "stdout_bytes", "display_bytes", "png_bytes", "wire_bytes")

    def __init__(self):
        self.status = None
        self.stdout_bytes = 0  # stdout text delivered to the client (UTF-8 bytes)
        self.display_bytes = 0  # display_data / execute_result payloads delivered
        self.png_bytes = 0  # decoded size of the largest image/png delivered
        self.wire_bytes = 0  # everything the client received for this execution

    def add_data(self, data):
        for mime, v in (data or {}).items():
            s = v if isinstance(v, str) else json.dumps(v)
            self.display_bytes += len(s)
            if mime == "image/png":
                self.png_bytes = max(self.png_bytes, len(base64.b64decode(s)))


class AgentWS:
    """kernel-broker's agent stream."""

    def __init__(self, base, sid, token):
        self.url = base.replace("http://", "ws://") + f"/v1/sessions/{sid}/stream"
        self.token = token
        self.n = 0
        self.connect()

    def connect(self):
        self.ws = websocket.create_connection(self.url, header=[f"Authorization: Bearer {self.token}"],
                                              timeout=TIMEOUT, skip_utf8_validation=True)
        nodelay(self.ws)

    def execute(self, code, timeout=TIMEOUT):
        self.n += 1
        cid = f"c{self.n}"
        r = Result()
        deadline = time.monotonic() + timeout
        self.ws.send(json.dumps({"type": "execute", "id": cid, "code": code, "timeout_seconds": timeout}))
        while True:
            self.ws.settimeout(max(0.01, deadline - time.monotonic()))
            raw = self.ws.recv()
            r.wire_bytes += len(raw)
            f = json.loads(raw)
            if f.get("id") != cid:
                continue
            t = f["type"]
            if t == "stdout":
                r.stdout_bytes += len(f["text"].encode())
            elif t in ("display", "result"):
                r.add_data(f.get("data"))
            elif t == "done":
                r.status = f["execution"]["status"]
                return r

    def close(self):
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass


class Rest:
    """kernel-broker's POST /v1/sessions/{id}/execute."""

    def __init__(self, base, sid, token):
        self.url = f"{base}/v1/sessions/{sid}/execute"
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    def connect(self):
        self.http.close()

    def execute(self, code, timeout=TIMEOUT):
        resp = self.http.post(self.url, json={"code": code, "timeout_seconds": timeout}, timeout=timeout + 10)
        resp.raise_for_status()
        r = Result()
        r.wire_bytes = len(resp.content)
        x = resp.json()
        r.status = x["status"]
        r.stdout_bytes = len(x["stdout"].encode())
        for item in x["results"]:
            r.add_data(item["data"])
        return r

    def close(self):
        self.http.close()


def parse_legacy_binary(data):
    """Jupyter's legacy binary WebSocket frame: u32 count, u32 offsets, JSON msg, buffers."""
    n = int.from_bytes(data[0:4], "big")
    offsets = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(n)]
    end = offsets[1] if n > 1 else len(data)
    return json.loads(data[offsets[0]:end])


class JupyterWS:
    """The Jupyter kernels API's channels WebSocket, legacy JSON framing (as jupyter_server's
    GatewayClient speaks it), for the broker and Kernel Gateway alike."""

    def __init__(self, base, kid, token):
        self.url = base.replace("http://", "ws://") + f"/api/kernels/{kid}/channels"
        self.token = token
        self.session = uuid.uuid4().hex
        self.connect()

    def connect(self):
        self.ws = websocket.create_connection(f"{self.url}?session_id={self.session}",
                                              header=[f"Authorization: token {self.token}"], timeout=TIMEOUT,
                                              skip_utf8_validation=True)
        nodelay(self.ws)

    def execute(self, code, timeout=TIMEOUT):
        msg_id = uuid.uuid4().hex
        now = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "bench",
                       "session": self.session, "date": now, "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }))
        r = Result()
        reply = idle = False
        deadline = time.monotonic() + timeout
        while not (reply and idle):
            self.ws.settimeout(max(0.01, deadline - time.monotonic()))
            opcode, data = self.ws.recv_data()
            r.wire_bytes += len(data)
            msg = parse_legacy_binary(data) if opcode == websocket.ABNF.OPCODE_BINARY else json.loads(data)
            if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                continue
            mt = msg["header"]["msg_type"]
            c = msg.get("content") or {}
            if mt == "execute_reply":
                r.status = c.get("status")
                reply = True
            elif mt == "status":
                idle = idle or c.get("execution_state") == "idle"
            elif mt == "stream" and c.get("name") == "stdout":
                r.stdout_bytes += len(c.get("text", "").encode())
            elif mt in ("display_data", "execute_result"):
                r.add_data(c.get("data"))
        return r

    def close(self):
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass


def wait_ready(kc, timeout=TIMEOUT):
    """A kernel_info_request answered on shell, and its status seen on iopub (so the SUB
    socket is connected). jupyter_client's own wait_for_ready also waits until iopub has
    been quiet for 0.2 s, and polls shell in 1 s steps: that would time jupyter_client,
    not the kernel, so the floor uses this instead."""
    from queue import Empty
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg_id = kc.kernel_info()
        replied = False
        step = time.monotonic() + 5
        while not replied and time.monotonic() < min(step, deadline):
            try:
                m = kc.get_shell_msg(timeout=max(0.01, min(step, deadline) - time.monotonic()))
            except Empty:
                break
            replied = m["parent_header"].get("msg_id") == msg_id
        if not replied:
            continue
        step = time.monotonic() + 0.5
        while time.monotonic() < step:
            try:
                m = kc.get_iopub_msg(timeout=max(0.01, step - time.monotonic()))
            except Empty:
                break
            if (m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                    and m["content"]["execution_state"] == "idle"):
                return
    raise RuntimeError("the kernel did not answer kernel_info")


class FloorClient:
    """The floor: jupyter_client's Session (signing, serialisation) on the ZeroMQ sockets of
    a BlockingKernelClient, polled directly, with no server in between. (Its
    execute_interactive costs ~4 ms more per call in asyncio plumbing, which would flatter
    every server measured against it.)"""

    def __init__(self, kc):
        import zmq
        self.zmq = zmq
        self.kc = kc
        self.session = kc.session
        self.shell = kc.shell_channel.socket
        self.iopub = kc.iopub_channel.socket
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)

    def connect(self):
        pass

    def execute(self, code, timeout=TIMEOUT):
        zmq = self.zmq
        msg = self.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                                   "user_expressions": {}, "allow_stdin": False,
                                                   "stop_on_error": True})
        msg_id = msg["header"]["msg_id"]
        self.session.send(self.shell, msg)
        r = Result()
        reply = idle = False
        deadline = time.monotonic() + timeout
        while not (reply and idle):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no execute_reply and idle in time")
            events = dict(self.poller.poll(left * 1000))
            for sock in (self.iopub, self.shell):
                if sock not in events:
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    r.wire_bytes += sum(len(f) for f in frames)
                    _, parts = self.session.feed_identities(frames)
                    m = self.session.deserialize(parts)
                    if m["parent_header"].get("msg_id") != msg_id:
                        continue
                    mt = m["header"]["msg_type"]
                    c = m["content"]
                    if mt == "execute_reply":
                        r.status = c["status"]
                        reply = True
                    elif mt == "status":
                        idle = idle or c["execution_state"] == "idle"
                    elif mt == "stream" and c.get("name") == "stdout":
                        r.stdout_bytes += len(c["text"].encode())
                    elif mt in ("display_data", "execute_result"):
                        r.add_data(c.get("data"))
        return r

    def close(self):
        pass


# --------------------------------------------------------------------------------------
# systems


class Sess:
    __slots__ = ("id", "user", "km", "kc")

    def __init__(self, id, user=0, km=None, kc=None):
        self.id, self.user, self.km, self.kc = id, user, km, kc


class Broker:
    label = "kernel-broker"

    def __init__(self, binary, sandbox="local", pool_size=1, tag="", extra_args=(), data_dir=None,
                 memory_limit=16 << 30, max_sessions=200, kernels_dir=None):
        self.sandbox = sandbox
        self.tmp = tempfile.mkdtemp(prefix=f"kb-bench-{sandbox}{tag}-")
        on_exit(lambda: shutil.rmtree(self.tmp, ignore_errors=True))
        self.data_dir = data_dir or f"{self.tmp}/data"
        self.cgroup_name = f"kernel-broker-bench-{uuid.uuid4().hex[:10]}"
        self.tokens = [f"bench-{i}-{uuid.uuid4().hex}" for i in range(USERS)]
        users = Path(self.tmp, "users.toml")
        users.write_text("".join(f'[[user]]\nname = "bench{i}"\ntoken = "{t}"\n\n' for i, t in enumerate(self.tokens)))
        args = [str(binary), "serve", "--listen", "127.0.0.1:0", "--users-file", str(users),
                "--data-dir", self.data_dir, "--kernels-dir", str(kernels_dir or REPO / "kernels"),
                "--cgroup-name", self.cgroup_name,
                "--sandbox", sandbox, "--pool-size", str(pool_size),
                # one user's limits cover all its kernels: room for 100 sessions over 4 users
                "--memory-limit", str(memory_limit), "--pids-limit", "8192", "--cpu-limit", "2",
                "--max-sessions-per-user", str(max_sessions), *extra_args]
        env = dict(os.environ, KERNEL_BROKER_LOG=os.environ.get("KB_BENCH_LOG", "warn,kernel_broker::server=info"))
        env.pop("KERNEL_BROKER_TOKEN", None)
        self.log = collections.deque(maxlen=200)
        ready = threading.Event()
        self.url = None

        def on_line(line):
            if line is None:
                ready.set()
            elif "ready on http://" in line and self.url is None:
                self.url = "http://" + line.split("ready on http://")[1].split()[0]
                ready.set()

        self.args, self.env = args, env
        self.proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        on_exit(self.stop)
        drain(self.proc.stderr, self.log, on_line)
        if not ready.wait(TIMEOUT) or self.url is None:
            self.stop()
            raise RuntimeError("kernel-broker did not start:\n" + "".join(self.log))
        self.pid = self.proc.pid

    def restart(self, sig=signal.SIGTERM):
        """Stops the broker with `sig` and starts it again with the same settings on the same
        address and data directory (with --keep-sessions its sessions come back). Returns
        (seconds to stop, seconds until the new process was ready)."""
        started = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(TIMEOUT)
        stopped = time.monotonic() - started
        args = list(self.args)
        args[args.index("--listen") + 1] = self.url.removeprefix("http://")
        ready = threading.Event()

        def on_line(line):
            if line is None or "ready on http://" in line:
                ready.set()

        spawned = time.monotonic()
        self.proc = subprocess.Popen(args, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        drain(self.proc.stderr, self.log, on_line)
        if not ready.wait(TIMEOUT) or self.proc.poll() is not None:
            raise RuntimeError("kernel-broker did not start again:\n" + "".join(self.log))
        self.pid = self.proc.pid
        return stopped, time.monotonic() - spawned

    def h(self, user=0):
        return {"Authorization": f"Bearer {self.tokens[user]}"}

    def create(self, path="agent", user=0):
        if path == "jupyter":
            r = requests.post(self.url + "/api/kernels", json={"name": "python3"}, headers=self.h(user), timeout=TIMEOUT)
        else:
            r = requests.post(self.url + "/v1/sessions", json={}, headers=self.h(user), timeout=TIMEOUT)
        if r.status_code != 201:
            raise RuntimeError(f"create: {r.status_code} {r.text}")
        return Sess(r.json()["id"], user)

    def delete(self, s):
        requests.delete(f"{self.url}/v1/sessions/{s.id}", headers=self.h(s.user), timeout=TIMEOUT)

    def client(self, s, path):
        tok = self.tokens[s.user]
        return {"agent_ws": AgentWS, "rest": Rest, "jupyter_ws": JupyterWS}[path](self.url, s.id, tok)

    def healthz(self):
        return requests.get(self.url + "/healthz", timeout=10).json()

    def wait_pool(self, want=1, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthz().get("pooled_kernels", 0) >= want:
                return True
            time.sleep(0.05)
        return False

    def helper_procs(self):
        """Sandbox processes that are not kernels (bwrap), for the local sandbox."""
        return [p for p in descendants(self.pid) if not is_kernel(p)] if self.sandbox == "local" else []

    def kernel_procs(self):
        if self.sandbox == "local":
            return [p for p in descendants(self.pid) if is_kernel(p)]
        # docker: the kernels are execs in this broker's containers; find them by cgroup
        out = subprocess.run(["docker", "ps", "-q", "--no-trunc", "--filter",
                              f"label=org.kernel-broker.data-dir={self.data_dir}"],
                             capture_output=True, text=True, timeout=60).stdout.split()
        ids = set(out)
        procs = []
        if not ids:
            return procs
        for p in psutil.process_iter():
            try:
                cg = Path(f"/proc/{p.pid}/cgroup").read_text()
            except OSError:
                continue
            if any(i in cg for i in ids) and is_kernel(p):
                procs.append(p)
        return procs

    def stop(self):
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        kids = descendants(self.proc.pid)
        stop_process(self.proc, kids, grace=60)
        if self.sandbox == "docker":
            ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=org.kernel-broker.data-dir={self.data_dir}"],
                                 capture_output=True, text=True, timeout=60).stdout.split()
            if ids:
                log(f"removing {len(ids)} container(s) the broker left behind")
                subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=120)
        # A broker that keeps sessions (--keep-sessions) leaves its workspace file systems
        # mounted for its next run; there is none: unmount what lies below the data.
        top = os.path.realpath(self.data_dir) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split(" ")[4] for line in f]
        for point in sorted((p for p in points if p.startswith(top)), reverse=True):
            subprocess.run(["umount", "-l", point], check=False)


class KernelGateway:
    label = "Kernel Gateway"

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="kb-bench-kg-")
        on_exit(lambda: shutil.rmtree(self.tmp, ignore_errors=True))
        spec = Path(self.tmp, "jupyter/kernels/python3")
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(KERNEL_PYTHON), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (bench)", "language": "python"}))
        self.token = uuid.uuid4().hex
        port = free_port()
        env = dict(os.environ, JUPYTER_PATH=f"{self.tmp}/jupyter", JUPYTER_DATA_DIR=f"{self.tmp}/data",
                   JUPYTER_RUNTIME_DIR=f"{self.tmp}/runtime", JUPYTER_CONFIG_DIR=f"{self.tmp}/config",
                   JUPYTER_PLATFORM_DIRS="1", HOME=f"{self.tmp}/home", KG_ENV_WHITELIST="HOME")
        os.makedirs(f"{self.tmp}/home")
        exe = Path(sys.executable).parent / "jupyter-kernelgateway"
        self.proc = subprocess.Popen(
            [str(exe), "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={port}",
             f"--KernelGatewayApp.auth_token={self.token}", "--JupyterWebsocketPersonality.list_kernels=True",
             "--KernelGatewayApp.port_retries=0"],
            env=env, cwd=self.tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        on_exit(self.stop)
        self.log = collections.deque(maxlen=200)
        drain(self.proc.stderr, self.log)
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                if requests.get(self.url + "/api/kernelspecs", headers=self.h(), timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("Kernel Gateway did not start:\n" + "".join(self.log))
            time.sleep(0.1)

    def h(self, user=0):
        return {"Authorization": f"token {self.token}"}

    def create(self, path="jupyter", user=0):
        # Each kernel gets a HOME of its own, as the floor's do: kernels sharing one HOME share
        # one IPython history database, whose SQLite locking stalls executions for up to
        # seconds under concurrency. That is IPython's cost, not the gateway's.
        home = tempfile.mkdtemp(prefix="home-", dir=self.tmp)
        r = requests.post(self.url + "/api/kernels", json={"name": "python3", "env": {"HOME": home}},
                          headers=self.h(), timeout=TIMEOUT)
        if r.status_code != 201:
            raise RuntimeError(f"create: {r.status_code} {r.text}")
        return Sess(r.json()["id"], 0)

    def delete(self, s):
        requests.delete(f"{self.url}/api/kernels/{s.id}", headers=self.h(), timeout=TIMEOUT)

    def client(self, s, path):
        assert path == "jupyter_ws"
        return JupyterWS(self.url, s.id, self.token)

    def kernel_procs(self):
        return [p for p in descendants(self.pid) if is_kernel(p)]

    def stop(self):
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        kids = descendants(self.proc.pid)
        stop_process(self.proc, kids, grace=30)


class Floor:
    """Bare ipykernels started by jupyter_client's KernelManager (no server)."""
    label = "floor"

    def __init__(self):
        from jupyter_client.kernelspec import KernelSpecManager
        self.tmp = tempfile.mkdtemp(prefix="kb-bench-floor-")
        on_exit(lambda: shutil.rmtree(self.tmp, ignore_errors=True))
        os.makedirs(f"{self.tmp}/python3")
        Path(f"{self.tmp}/python3/kernel.json").write_text(json.dumps(
            {"argv": [str(KERNEL_PYTHON), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
             "display_name": "bench", "language": "python"}))
        self.ksm = KernelSpecManager(kernel_dirs=[self.tmp])
        self.live = {}
        self.lock = threading.Lock()
        self.pid = os.getpid()
        on_exit(self.stop)

    def create(self, path="jupyter_client", user=0):
        from jupyter_client import KernelManager
        km = KernelManager(kernel_name="python3", kernel_spec_manager=self.ksm,
                           connection_file=f"{self.tmp}/kernel-{uuid.uuid4().hex}.json")
        home = tempfile.mkdtemp(prefix="home-", dir=self.tmp)  # its own ~/.ipython: nothing shared
        km.start_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, HOME=home))
        kc = km.client()
        kc.start_channels()
        s = Sess(uuid.uuid4().hex, 0, km, kc)
        with self.lock:
            self.live[s.id] = s
        try:
            wait_ready(kc)
        except Exception:
            self.delete(s)
            raise
        return s

    def delete(self, s):
        with self.lock:
            self.live.pop(s.id, None)
        try:
            s.kc.stop_channels()
        finally:
            s.km.shutdown_kernel(now=True)

    def client(self, s, path):
        return FloorClient(s.kc)

    def kernel_procs(self):
        procs = []
        for s in list(self.live.values()):
            try:
                procs.append(psutil.Process(s.km.provisioner.process.pid))
            except (psutil.Error, AttributeError):
                pass
        return procs

    def stop(self):
        for s in list(self.live.values()):
            try:
                self.delete(s)
            except Exception as e:  # noqa: BLE001
                log(f"floor: could not stop a kernel: {e}")


# --------------------------------------------------------------------------------------
# measurements


def check(r, what):
    if r.status != "ok":
        raise RuntimeError(f"{what}: status {r.status}")
    return r


def first_result(system, create_path, exec_path, user=0):
    """create -> first `1+1` result; returns (seconds, session)."""
    t0 = time.perf_counter()
    s = system.create(create_path, user)
    c = system.client(s, exec_path)
    try:
        r = c.execute("1+1")
        dt = time.perf_counter() - t0
    finally:
        c.close()
    check(r, "first 1+1")
    if r.display_bytes <= 0:
        raise RuntimeError("first 1+1 produced no result")
    return dt, s


def bench_starts(system, create_path, exec_path, n, pooled=False):
    samples = []
    for i in range(n):
        if pooled and not system.wait_pool(1):
            raise RuntimeError("the warm pool did not fill")
        dt, s = first_result(system, create_path, exec_path)
        samples.append(dt)
        system.delete(s)
    return summary(samples)


def bench_roundtrip(client, n, warmup=20):
    samples = []
    for i in range(n + warmup):
        t0 = time.perf_counter()
        check(client.execute("1+1"), "1+1")
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return summary(samples)


def bench_bulk(client, code, produced_bytes, reps):
    """Time to done for a cell with big output; MB/s over the bytes the cell produced."""
    times, last = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        last = check(client.execute(code), "bulk cell")
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    produced = produced_bytes or last.png_bytes
    return {"reps": reps, "time_to_done_ms": round(t * 1000, 1), "min_ms": round(min(times) * 1000, 1),
            "bytes_produced": produced, "mb_per_s": round(produced / t / 1e6, 2),
            "stdout_bytes_received": last.stdout_bytes, "display_bytes_received": last.display_bytes,
            "wire_bytes_received": last.wire_bytes}


def bench_single_session(system, paths, n_rt, reps):
    """Round trips, 100k-line stream and 2 MB PNG on one session, over each path in turn."""
    s = system.create("agent" if isinstance(system, Broker) else "jupyter")
    out = {"roundtrip_1p1": {}, "stream_100k_lines": {}, "png_2mb": {}}
    try:
        for path in paths:
            c = system.client(s, path)
            try:
                if path == paths[0]:
                    check(c.execute(PNG_SETUP), "PNG setup")
                out["roundtrip_1p1"][path] = bench_roundtrip(c, n_rt)
                out["stream_100k_lines"][path] = bench_bulk(c, STREAM_CODE, STREAM_BYTES, reps)
                out["png_2mb"][path] = bench_bulk(c, PNG_CODE, 0, reps)
            finally:
                c.close()
            log(f"  {path}: 1+1 p50 {out['roundtrip_1p1'][path]['p50_ms']} ms, "
                f"100k lines {out['stream_100k_lines'][path]['time_to_done_ms']} ms, "
                f"PNG {out['png_2mb'][path]['time_to_done_ms']} ms")
    finally:
        system.delete(s)
    return out


def create_many(system, n, first, path_create, user_of=lambda i: 0, workers=4):
    """n sessions, each created and given one `1+1` (so it is ready and has run once)."""
    sessions = [None] * n
    errors = []

    def one(i):
        dt, s = first_result(system, path_create, first, user_of(i))
        sessions[i] = s

    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(one, i) for i in range(n)]:
            try:
                f.result(timeout=TIMEOUT * 4)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
    return [s for s in sessions if s is not None], errors


def run_load(system, sessions, path, duration, code="1+1"):
    """Every session in its own thread, executing `code` in a loop for `duration` seconds."""
    n = len(sessions)
    clients = [None] * n
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        futs = {ex.submit(system.client, s, path): i for i, s in enumerate(sessions)}
        for f, i in futs.items():
            clients[i] = f.result(timeout=TIMEOUT)
    ok = [0] * n
    failed = [0] * n
    errors = collections.Counter()
    lat = [[] for _ in range(n)]
    barrier = threading.Barrier(n + 1, timeout=TIMEOUT)
    box = {}

    def worker(i):
        c = clients[i]
        barrier.wait()
        end = box["end"]
        broken = 0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                r = c.execute(code, timeout=60)
                if r.status == "ok":
                    ok[i] += 1
                    lat[i].append(time.perf_counter() - t0)
                else:
                    failed[i] += 1
                    errors[f"status {r.status}"] += 1
            except Exception as e:  # noqa: BLE001
                failed[i] += 1
                errors[type(e).__name__ + ": " + str(e)[:100]] += 1
                broken += 1
                try:
                    c.close()
                    c.connect()
                except Exception:  # noqa: BLE001
                    pass
                if broken > 3:
                    return

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    cpu0 = cpu_seconds(system.pid) if not isinstance(system, Floor) else None
    box["end"] = time.perf_counter() + duration
    t0 = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join(duration + 90)
    elapsed = time.perf_counter() - t0
    cpu = cpu_seconds(system.pid) - cpu0 if cpu0 is not None else None
    stuck = sum(t.is_alive() for t in threads)
    for c in clients:
        c.close()
    total = sum(ok)
    res = {"sessions": n, "duration_s": round(elapsed, 2), "executes_ok": total, "failures": sum(failed) + stuck,
           "executes_per_s": round(total / elapsed, 1), "latency": summary([x for l in lat for x in l]),
           # fairness: executions completed by the least and most served session
           "per_session_ok_min_median_max": [min(ok), int(statistics.median(ok)), max(ok)],
           "errors": dict(errors.most_common(5))}
    if cpu is not None:
        res["server_cpu_s"] = round(cpu, 2)
        res["server_cpu_ms_per_execute"] = round(cpu * 1000 / max(1, total), 3)
    return res


def bench_concurrency(system, levels, paths, duration, create_path, user_of):
    """Grows the set of sessions to each level; measures memory at each, then the load."""
    out = {"concurrency": {}, "memory": {}}
    sessions, errors = [], []
    time.sleep(1)
    rss0 = rss_kib(system.pid)
    try:
        for n in levels:
            t0 = time.perf_counter()
            more, errs = create_many(system, n - len(sessions), paths[0], create_path,
                                     user_of=lambda i, base=len(sessions): user_of(base + i))
            sessions += more
            errors += errs
            log(f"  {len(sessions)} sessions up in {time.perf_counter() - t0:.1f} s ({len(errs)} failed)")
            if len(sessions) < n:
                raise RuntimeError(f"only {len(sessions)} of {n} sessions started: {errs[:3]}")
            time.sleep(2)
            rss_n = rss_kib(system.pid)
            km = kernel_memory(system.kernel_procs())
            mem = {"sessions": n, **km,
                   "kernel_rss_per_kernel_kib": round(km["kernel_rss_total_kib"] / max(1, km["kernel_processes"]), 1),
                   "kernel_uss_per_kernel_kib": round(km["kernel_uss_total_kib"] / max(1, km["kernel_processes"]), 1)}
            if isinstance(system, Broker):
                mem["pooled_kernels"] = system.healthz().get("pooled_kernels")
                helpers = system.helper_procs()
                if helpers:
                    mem["sandbox_helper_processes"] = len(helpers)
                    mem["sandbox_helper_rss_per_kernel_kib"] = round(
                        sum(rss_kib(p.pid) for p in helpers) / max(1, km["kernel_processes"]), 1)
            if not isinstance(system, Floor):  # the floor has no server (rss_n is this process)
                mem.update(server_rss_kib_0=rss0, server_rss_kib_n=rss_n,
                           server_rss_per_session_kib=round((rss_n - rss0) / n, 1))
            out["memory"][str(n)] = mem
            log(f"  memory at {n}: server +{mem.get('server_rss_per_session_kib')} KiB/session, "
                f"kernel {mem['kernel_rss_per_kernel_kib']} KiB RSS / {mem['kernel_uss_per_kernel_kib']} KiB USS each "
                f"({km['kernel_processes']} kernels)")
            out["concurrency"][str(n)] = {}
            for path in paths:
                r = run_load(system, sessions, path, duration)
                out["concurrency"][str(n)][path] = r
                log(f"  load {n} x {path}: {r['executes_per_s']} exec/s, {r['failures']} failed, "
                    f"p50 {r['latency'].get('p50_ms')} ms, p99 {r['latency'].get('p99_ms')} ms {r['errors'] or ''}")
    finally:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            for f in [ex.submit(system.delete, s) for s in sessions]:
                try:
                    f.result(timeout=TIMEOUT)
                except Exception as e:  # noqa: BLE001
                    log(f"  delete failed: {e!r}")
        log(f"  {len(sessions)} sessions deleted in {time.perf_counter() - t0:.1f} s")
    out["create_errors"] = errors
    return out


# --------------------------------------------------------------------------------------
# per system


def run_floor(cfg):
    f = Floor()
    res = {"system": "jupyter_client -> bare ipykernel (no sandbox, no server)"}
    try:
        res["cold_start"] = {"jupyter_client": bench_starts(f, "jupyter_client", "jupyter_client", cfg.n_cold)}
        log(f"  cold start p50 {res['cold_start']['jupyter_client']['p50_ms']} ms")
        s = f.create()
        c = f.client(s, "jupyter_client")
        try:
            check(c.execute(PNG_SETUP), "PNG setup")
            res["roundtrip_1p1"] = {"jupyter_client": bench_roundtrip(c, cfg.n_rt)}
            res["stream_100k_lines"] = {"jupyter_client": bench_bulk(c, STREAM_CODE, STREAM_BYTES, cfg.reps)}
            res["png_2mb"] = {"jupyter_client": bench_bulk(c, PNG_CODE, 0, cfg.reps)}
        finally:
            f.delete(s)
        log(f"  1+1 p50 {res['roundtrip_1p1']['jupyter_client']['p50_ms']} ms")
        res.update(bench_concurrency(f, cfg.levels, ["jupyter_client"], cfg.duration, "jupyter_client", lambda i: 0))
    finally:
        f.stop()
    return res


def run_kg(cfg):
    kg = KernelGateway()
    res = {"system": "Jupyter Kernel Gateway 3.0.1 (PyPI), /api/kernels + channels WebSocket"}
    try:
        res["cold_start"] = {"jupyter_ws": bench_starts(kg, "jupyter", "jupyter_ws", cfg.n_cold)}
        log(f"  cold start p50 {res['cold_start']['jupyter_ws']['p50_ms']} ms")
        res.update(bench_single_session(kg, ["jupyter_ws"], cfg.n_rt, cfg.reps))
        res.update(bench_concurrency(kg, cfg.levels, ["jupyter_ws"], cfg.duration, "jupyter", lambda i: 0))
        res["server_rss_kib_end"] = rss_kib(kg.pid)
    finally:
        kg.stop()
    return res


def run_broker(cfg, sandbox):
    res = {"system": f"kernel-broker, {sandbox} sandbox ({cfg.broker_bin})"}
    # cold starts: a broker without a warm pool
    b = Broker(cfg.broker_bin, sandbox, pool_size=0, tag="-cold")
    try:
        dt, s = first_result(b, "agent", "rest")  # the user's first session also sets up its sandbox
        b.delete(s)
        res["first_session_of_user_ms"] = round(dt * 1000, 1)
        res["cold_start"] = {"rest": bench_starts(b, "agent", "rest", cfg.n_cold),
                             "jupyter_ws": bench_starts(b, "jupyter", "jupyter_ws", cfg.n_cold)}
        log(f"  first session {res['first_session_of_user_ms']} ms; cold start p50 "
            f"{res['cold_start']['rest']['p50_ms']} ms (rest), {res['cold_start']['jupyter_ws']['p50_ms']} ms (jupyter)")
    finally:
        b.stop()
    # everything else: the default configuration (warm pool of 1 per user)
    b = Broker(cfg.broker_bin, sandbox, pool_size=1)
    try:
        res.update(bench_single_session(b, ["agent_ws", "jupyter_ws", "rest"], cfg.n_rt, cfg.reps))
        res["pooled_start"] = {"rest": bench_starts(b, "agent", "rest", cfg.n_pooled, pooled=True),
                               "agent_ws": bench_starts(b, "agent", "agent_ws", cfg.n_pooled, pooled=True),
                               "jupyter_ws": bench_starts(b, "jupyter", "jupyter_ws", cfg.n_pooled, pooled=True)}
        log("  pooled start p50 " + ", ".join(f"{k} {v['p50_ms']} ms" for k, v in res["pooled_start"].items()))
        res.update(bench_concurrency(b, cfg.levels, ["agent_ws", "jupyter_ws", "rest"], cfg.duration, "agent",
                                     lambda i: i % USERS))
        res["server_rss_kib_end"] = rss_kib(b.pid)
    finally:
        b.stop()
    return res


# --------------------------------------------------------------------------------------
# report


def get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def table(results, levels):
    s = results["systems"]
    cols = [("floor", "floor"), ("kg", "Kernel Gateway"), ("local", "broker local"), ("docker", "broker docker")]
    cols = [(k, n) for k, n in cols if k in s and "error" not in s[k] and "skipped" not in s[k]]
    # (label, {system: (section path...)}, decimals)
    B = lambda *p: p  # noqa: E731
    rows = [
        ("cold start → first result, p50 ms", {"floor": B("cold_start", "jupyter_client", "p50_ms"), "kg": B("cold_start", "jupyter_ws", "p50_ms"),
                                                "broker": B("cold_start", "rest", "p50_ms")}, 0),
        ("cold start, Jupyter API path, p50 ms", {"kg": B("cold_start", "jupyter_ws", "p50_ms"), "broker": B("cold_start", "jupyter_ws", "p50_ms")}, 0),
        ("pooled start → first result (REST), p50 ms", {"broker": B("pooled_start", "rest", "p50_ms")}, 1),
        ("pooled start (REST), p99 ms", {"broker": B("pooled_start", "rest", "p99_ms")}, 1),
        ("pooled start (agent WS), p50 ms", {"broker": B("pooled_start", "agent_ws", "p50_ms")}, 1),
        ("pooled start (Jupyter WS), p50 ms", {"broker": B("pooled_start", "jupyter_ws", "p50_ms")}, 1),
        ("1+1 round trip, agent WS, p50 ms", {"floor": B("roundtrip_1p1", "jupyter_client", "p50_ms"), "kg": B("roundtrip_1p1", "jupyter_ws", "p50_ms"),
                                               "broker": B("roundtrip_1p1", "agent_ws", "p50_ms")}, 2),
        ("1+1 round trip, agent WS, p99 ms", {"floor": B("roundtrip_1p1", "jupyter_client", "p99_ms"), "kg": B("roundtrip_1p1", "jupyter_ws", "p99_ms"),
                                               "broker": B("roundtrip_1p1", "agent_ws", "p99_ms")}, 2),
        ("1+1 round trip, Jupyter WS, p50 ms", {"floor": B("roundtrip_1p1", "jupyter_client", "p50_ms"), "kg": B("roundtrip_1p1", "jupyter_ws", "p50_ms"),
                                                 "broker": B("roundtrip_1p1", "jupyter_ws", "p50_ms")}, 2),
        ("1+1 round trip, Jupyter WS, p99 ms", {"floor": B("roundtrip_1p1", "jupyter_client", "p99_ms"), "kg": B("roundtrip_1p1", "jupyter_ws", "p99_ms"),
                                                 "broker": B("roundtrip_1p1", "jupyter_ws", "p99_ms")}, 2),
        ("1+1 round trip, REST, p50 ms", {"floor": B("roundtrip_1p1", "jupyter_client", "p50_ms"), "kg": B("roundtrip_1p1", "jupyter_ws", "p50_ms"),
                                           "broker": B("roundtrip_1p1", "rest", "p50_ms")}, 2),
        ("1+1 round trip, REST, p99 ms", {"floor": B("roundtrip_1p1", "jupyter_client", "p99_ms"), "kg": B("roundtrip_1p1", "jupyter_ws", "p99_ms"),
                                           "broker": B("roundtrip_1p1", "rest", "p99_ms")}, 2),
        ("100k lines: time to done, Jupyter WS, ms", {"floor": B("stream_100k_lines", "jupyter_client", "time_to_done_ms"),
                                                       "kg": B("stream_100k_lines", "jupyter_ws", "time_to_done_ms"),
                                                       "broker": B("stream_100k_lines", "jupyter_ws", "time_to_done_ms")}, 0),
        ("100k lines: MB/s, Jupyter WS (all delivered)", {"floor": B("stream_100k_lines", "jupyter_client", "mb_per_s"),
                                                          "kg": B("stream_100k_lines", "jupyter_ws", "mb_per_s"),
                                                          "broker": B("stream_100k_lines", "jupyter_ws", "mb_per_s")}, 2),
        ("100k lines: time to done, agent WS, ms", {"broker": B("stream_100k_lines", "agent_ws", "time_to_done_ms")}, 0),
        ("100k lines: time to done, REST, ms", {"broker": B("stream_100k_lines", "rest", "time_to_done_ms")}, 0),
        ("2 MB PNG: time to done, Jupyter WS, ms", {"floor": B("png_2mb", "jupyter_client", "time_to_done_ms"), "kg": B("png_2mb", "jupyter_ws", "time_to_done_ms"),
                                                    "broker": B("png_2mb", "jupyter_ws", "time_to_done_ms")}, 0),
        ("2 MB PNG: MB/s, Jupyter WS", {"floor": B("png_2mb", "jupyter_client", "mb_per_s"), "kg": B("png_2mb", "jupyter_ws", "mb_per_s"),
                                        "broker": B("png_2mb", "jupyter_ws", "mb_per_s")}, 1),
        ("2 MB PNG: MB/s, agent WS", {"broker": B("png_2mb", "agent_ws", "mb_per_s")}, 1),
        ("2 MB PNG: MB/s, REST", {"broker": B("png_2mb", "rest", "mb_per_s")}, 1),
    ]
    for n in levels:
        rows += [
            (f"{n} sessions: executes/s, agent WS", {"floor": B("concurrency", str(n), "jupyter_client", "executes_per_s"),
                                                      "kg": B("concurrency", str(n), "jupyter_ws", "executes_per_s"),
                                                      "broker": B("concurrency", str(n), "agent_ws", "executes_per_s")}, 0),
            (f"{n} sessions: executes/s, Jupyter WS", {"floor": B("concurrency", str(n), "jupyter_client", "executes_per_s"),
                                                        "kg": B("concurrency", str(n), "jupyter_ws", "executes_per_s"),
                                                        "broker": B("concurrency", str(n), "jupyter_ws", "executes_per_s")}, 0),
            (f"{n} sessions: executes/s, REST", {"floor": B("concurrency", str(n), "jupyter_client", "executes_per_s"),
                                                  "kg": B("concurrency", str(n), "jupyter_ws", "executes_per_s"),
                                                  "broker": B("concurrency", str(n), "rest", "executes_per_s")}, 0),
            (f"{n} sessions: latency under load p50 ms, agent WS", {"floor": B("concurrency", str(n), "jupyter_client", "latency", "p50_ms"),
                                                                    "kg": B("concurrency", str(n), "jupyter_ws", "latency", "p50_ms"),
                                                                    "broker": B("concurrency", str(n), "agent_ws", "latency", "p50_ms")}, 0),
            (f"{n} sessions: latency under load p99 ms, agent WS", {"floor": B("concurrency", str(n), "jupyter_client", "latency", "p99_ms"),
                                                                    "kg": B("concurrency", str(n), "jupyter_ws", "latency", "p99_ms"),
                                                                    "broker": B("concurrency", str(n), "agent_ws", "latency", "p99_ms")}, 0),
            (f"{n} sessions: server CPU ms per execute, agent WS", {"kg": B("concurrency", str(n), "jupyter_ws", "server_cpu_ms_per_execute"),
                                                                    "broker": B("concurrency", str(n), "agent_ws", "server_cpu_ms_per_execute")}, 2),
            (f"{n} sessions: failed executions (all paths)", {k: ("__failures__", str(n)) for k in ("floor", "kg", "broker")}, 0),
            (f"{n} sessions: server RSS per idle session, KiB", {"kg": B("memory", str(n), "server_rss_per_session_kib"),
                                                                  "broker": B("memory", str(n), "server_rss_per_session_kib")}, 0),
            (f"{n} sessions: kernel RSS per kernel, MiB", {k: ("__mib__", str(n), "kernel_rss_per_kernel_kib") for k in ("floor", "kg", "broker")}, 1),
            (f"{n} sessions: kernel USS per kernel, MiB", {k: ("__mib__", str(n), "kernel_uss_per_kernel_kib") for k in ("floor", "kg", "broker")}, 1),
        ]

    def value(sysname, spec):
        path = spec.get("broker" if sysname in ("local", "docker") else sysname)
        if path is None:
            return None
        d = s[sysname]
        if path[0] == "__failures__":
            c = get(d, "concurrency", path[1])
            return sum(v["failures"] for v in c.values()) if c else None
        if path[0] == "__mib__":
            v = get(d, "memory", *path[1:])
            return v / 1024 if v is not None else None
        return get(d, *path)

    head = ["measure"] + [n for _, n in cols]
    brokers = [k for k, _ in cols if k in ("local", "docker")]
    for k in brokers:
        name = dict(cols)[k].replace("broker ", "")
        if "floor" in s and "floor" in dict(cols):
            head.append(f"{name} ÷ floor")
        if "kg" in dict(cols):
            head.append(f"{name} ÷ KG")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, spec, dec in rows:
        vals = {k: value(k, spec) for k, _ in cols}
        if all(vals[k] is None for k in brokers):
            continue
        cells = [label] + ["" if vals[k] is None else f"{vals[k]:,.{dec}f}" for k, _ in cols]
        for k in brokers:
            for other in ("floor", "kg"):
                if other not in dict(cols):
                    continue
                a, o = vals[k], vals.get(other)
                cells.append(f"{a / o:.2f}" if a is not None and o not in (None, 0) and "failed" not in label else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Floor and Kernel Gateway have one client path each (jupyter_client over ZeroMQ; the Jupyter "
                 "channels WebSocket), shown on every row of that measure. Ratios are broker ÷ other: below 1 is "
                 "better for times and memory, above 1 for MB/s and executes/s.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------


def docker_image_ok():
    try:
        return subprocess.run(["docker", "image", "inspect", DOCKER_IMAGE], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main():
    global USERS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few iterations, 3 sessions, no 100-session run (smoke test)")
    p.add_argument("--json", default=str(REPO / "bench-results/latest.json"), help="write the results here")
    p.add_argument("--systems", default="floor,local,docker,kg", help="comma list of floor, local, docker, kg")
    p.add_argument("--sessions", help="concurrency levels, comma list (default 10,100; --quick: 3)")
    p.add_argument("--duration", type=float, help="seconds of load per concurrency run (default 15; --quick: 2)")
    p.add_argument("--broker-users", type=int, default=4,
                   help="broker users the concurrency sessions are spread over (default 4)")
    p.add_argument("--broker-bin", default=os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/release/kernel-broker")))
    cfg = p.parse_args()
    USERS = cfg.broker_users
    cfg.n_rt = 30 if cfg.quick else 500
    cfg.n_cold = 2 if cfg.quick else 10
    cfg.n_pooled = 3 if cfg.quick else 30
    cfg.reps = 1 if cfg.quick else 3
    cfg.levels = [int(x) for x in (cfg.sessions or ("3" if cfg.quick else "10,100")).split(",")]
    cfg.duration = cfg.duration or (2.0 if cfg.quick else 15.0)
    if not Path(cfg.broker_bin).exists():
        p.error(f"{cfg.broker_bin} is missing: build it (cargo build --release) or use bench/run")
    if not KERNEL_PYTHON.exists():
        p.error(f"{KERNEL_PYTHON} is missing: run kernels/setup.sh (or scripts/setup)")

    results = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["bench/bench.py"] + sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                    "kernel": platform.release(), "python": platform.python_version()},
        "config": {"quick": cfg.quick, "roundtrips": cfg.n_rt, "cold_samples": cfg.n_cold, "pooled_samples": cfg.n_pooled,
                   "bulk_reps": cfg.reps, "concurrency_levels": cfg.levels, "load_seconds": cfg.duration,
                   "stream_lines": STREAM_LINES, "stream_bytes": STREAM_BYTES, "broker_bin": cfg.broker_bin,
                   "broker_flags": "--pool-size 1 (0 for cold starts) --memory-limit 17179869184 --pids-limit 8192 "
                                   f"--cpu-limit 2 --max-sessions-per-user 200, {USERS} users"},
        "systems": {},
    }
    wanted = [x.strip() for x in cfg.systems.split(",") if x.strip()]
    runners = {"floor": run_floor, "local": lambda c: run_broker(c, "local"),
               "docker": lambda c: run_broker(c, "docker"), "kg": run_kg}
    failed = False
    for name in wanted:
        if name not in runners:
            p.error(f"unknown system {name}")
        if name == "docker" and not docker_image_ok():
            results["systems"]["docker"] = {"skipped": f"docker image {DOCKER_IMAGE} not available"}
            log("docker: skipped (no image)")
            continue
        log(f"== {name}")
        t0 = time.perf_counter()
        load0 = os.getloadavg()
        try:
            results["systems"][name] = runners[name](cfg)
        except Exception as e:  # noqa: BLE001 - record and go on with the next system
            import traceback
            traceback.print_exc()
            results["systems"][name] = {"error": repr(e)}
            failed = True
        results["systems"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        results["systems"][name]["loadavg_before_after"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
        run_cleanups()

    results["table_markdown"] = table(results, cfg.levels)
    print(results["table_markdown"])
    Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.json).write_text(json.dumps(results, indent=2))
    log(f"results written to {cfg.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
