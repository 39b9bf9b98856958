#!/usr/bin/env python3
"""Create and execute throughput of a three-node kernel-broker cluster against one node
(issue 16), on one machine.

    bench/cluster                      full run: every configuration 3 times, the median run reported
    bench/cluster --smoke              a bounded smoke run (a few seconds of load per phase)
    bench/cluster --help               every option

Configurations, each started here and stopped before the next (never two at once):
  single      one broker, no cluster flags (recordings in its SQLite file)
  single-pg   one broker with --database-url (recordings in PostgreSQL, no cluster mode)
  cluster3    three brokers on one database, each with --advertise-url its own address;
              the clients are spread evenly over the three addresses, as a load balancer would

Every broker: local sandbox, release build, one users file with 4 users (the clients are
spread over them; --users), --max-sessions-per-user 200, --memory-limit 16 GiB per user, default
--pool-size 1 and fork server, recording on (the defaults). Each run gets a database of its own.

Phases of one run (after a warm-up: a session per user per node, then --warmup seconds of
the create phase, discarded, so every node has each user's fork-server template and pool):
  create   C clients, each in a loop for --duration seconds: POST /v1/sessions -> POST
           /v1/sessions/{id}/execute `1+1` -> DELETE; client i asks node i % nodes, as user
           i % 4. Sessions/s (completed cycles / elapsed), p50/p99 of the create and of the
           first execution, failures (any status but 201 / ok / 204, or an exception).
  execute  S sessions made up front (session j through node j % nodes, as user j % 4; the
           cluster places each where it has most headroom), each given one `1+1`; then C
           clients, client i cycling through sessions i, i+C, i+2C, ... (so no two clients
           share a session), each request sent to a node picked at random: executions/s,
           p50/p99, the share of requests that landed on another node than the session's
           (forwarded), failures.
CPU time is counted per part over each phase: the broker processes, the kernels (every
process below a broker: kernels, their sandboxes, the fork servers; ended ones through
their parents' reaped-children times), PostgreSQL (the postmaster and
its backends, reaped ones included), this client process, and the machine's total
(/proc/stat), so where the time goes is measured, not guessed.

PostgreSQL: KB_TEST_POSTGRES_URL (a server URL, postgres://USER@HOST:PORT) when set, else a
throwaway server from scripts/pg-test-server (fsync=off), stopped at the end.
Run as root (the local sandbox).
"""
import argparse
import collections
import concurrent.futures
import datetime
import json
import os
import platform
import random
import re
import shutil
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (process hygiene, log draining, statistics)

REPO = bench.REPO
USERS = 4
TIMEOUT = 120
PSQL = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))


def log(*a):
    print("cluster:", *a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# PostgreSQL


class Postgres:
    """The server: KB_TEST_POSTGRES_URL, or one started here (and stopped at exit)."""

    def __init__(self):
        self.url = os.environ.get("KB_TEST_POSTGRES_URL")
        self.dir = None
        if not self.url:
            out = subprocess.run([str(REPO / "scripts/pg-test-server"), "start"], check=True,
                                 capture_output=True, text=True, timeout=180).stdout
            env = dict(re.findall(r"export (\w+)=([^;\s]+)", out))
            self.url, self.dir = env["KB_TEST_POSTGRES_URL"], env["KB_PG_SERVER_DIR"]
            bench.on_exit(self.stop)
            log(f"PostgreSQL started: {self.url} ({self.dir})")
        self.created = []

    def psql(self, db, sql):
        if not PSQL:
            raise RuntimeError("psql not found under /usr/lib/postgresql/*/bin")
        return subprocess.run([str(PSQL[-1]), "-X", "-q", "-A", "-t", "-F", "\t", "-d", f"{self.url}/{db}", "-c", sql],
                              check=True, capture_output=True, text=True, timeout=60).stdout

    def fresh(self):
        name = f"kb_cluster_bench_{uuid.uuid4().hex[:12]}"
        self.psql("postgres", f"CREATE DATABASE {name}")
        self.created.append(name)
        return f"{self.url}/{name}", name

    def drop_all(self):
        for name in self.created:
            try:
                self.psql("postgres", f"DROP DATABASE IF EXISTS {name}")
            except Exception as e:  # noqa: BLE001
                log(f"could not drop {name}: {e}")
        self.created.clear()

    def postmaster(self):
        """The server's postmaster process (its port is the URL's)."""
        port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                return psutil.Process(c.pid)
        return None

    def stop(self):
        if self.dir:
            subprocess.run([str(REPO / "scripts/pg-test-server"), "stop", self.dir], check=False, timeout=120)
            log("PostgreSQL stopped")
            self.dir = None


# --------------------------------------------------------------------------------------
# brokers


def tree_cpu_s(pid):
    """CPU seconds of everything below process `pid`, live and gone: the reaped children's
    times it holds, and each live descendant's own and reaped children's times (a process is
    counted once: live, or in the live ancestor that reaped it)."""
    try:
        root = psutil.Process(pid)
        t = root.cpu_times()
        total = t.children_user + t.children_system
        kids = root.children(recursive=True)
    except psutil.Error:
        return 0.0
    for k in kids:
        try:
            t = k.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


class Node:
    """One broker process on a port chosen beforehand (a cluster node advertises it)."""

    def __init__(self, binary, users_file, tag, extra=()):
        self.tmp = tempfile.mkdtemp(prefix=f"kb-cluster-bench-{tag}-")
        bench.on_exit(lambda: shutil.rmtree(self.tmp, ignore_errors=True))
        self.port = bench.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cgroup_name = f"kernel-broker-cbench-{uuid.uuid4().hex[:10]}"
        args = [str(binary), "serve", "--listen", f"127.0.0.1:{self.port}", "--users-file", str(users_file),
                "--data-dir", f"{self.tmp}/data", "--kernels-dir", str(REPO / "kernels"),
                "--cgroup-name", self.cgroup_name, "--sandbox", "local",
                "--memory-limit", str(16 << 30), "--pids-limit", "8192", "--cpu-limit", "2",
                "--max-sessions-per-user", "200",
                *[a.replace("{url}", self.url) for a in extra]]
        env = dict(os.environ, KERNEL_BROKER_LOG="warn,kernel_broker::server=info,"
                   "kernel_broker::session::registry::carry=info")
        env.pop("KERNEL_BROKER_TOKEN", None)
        self.log = collections.deque(maxlen=400)
        ready = threading.Event()

        def on_line(line):
            if line is None or "ready on http://" in line:
                ready.set()

        self.proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        bench.on_exit(self.stop)
        bench.drain(self.proc.stderr, self.log, on_line)
        if not ready.wait(TIMEOUT) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"kernel-broker did not start:\n" + "".join(self.log))

    def kernel_cpu_s(self):
        return tree_cpu_s(self.pid)

    def broker_cpu_s(self):
        return bench.cpu_seconds(self.pid)

    def healthz(self):
        return requests.get(self.url + "/healthz", timeout=10).json()

    def errors_logged(self):
        return [l.rstrip() for l in self.log if " ERROR " in l or " WARN " in l]

    def stop(self):
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        bench.stop_process(self.proc, bench.descendants(self.proc.pid), grace=60)


class Setup:
    """One configuration: its nodes and users."""

    def __init__(self, kind, binary, pg):
        self.kind = kind
        self.tokens = [f"cbench-{i}-{uuid.uuid4().hex}" for i in range(USERS)]
        self.tmp = tempfile.mkdtemp(prefix="kb-cluster-bench-users-")
        bench.on_exit(lambda: shutil.rmtree(self.tmp, ignore_errors=True))
        users = Path(self.tmp, "users.toml")
        users.write_text("".join(f'[[user]]\nname = "bench{i}"\ntoken = "{t}"\n\n' for i, t in enumerate(self.tokens)))
        self.db = None
        extra = []
        if kind in ("single-pg", "cluster3"):
            url, self.db = pg.fresh()
            extra = ["--database-url", url]
        if kind == "cluster3":
            extra += ["--advertise-url", "{url}"]
        n = 3 if kind == "cluster3" else 1
        self.nodes = []
        try:
            for i in range(n):
                self.nodes.append(Node(binary, users, f"{kind}-{i}", extra))
        except Exception:
            self.stop()
            raise
        self.pg = pg
        if kind == "cluster3":
            self.wait_peers()
        self.node_ids = {}

    def wait_peers(self):
        """Until every node is registered with a live lease (placement reads the table)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = self.pg.psql(self.db, "SELECT count(*) FROM nodes WHERE lost_at IS NULL").strip()
            if rows == str(len(self.nodes)):
                return
            time.sleep(0.2)
        raise RuntimeError("the cluster's nodes did not all register")

    def node_index(self):
        """node id -> index in self.nodes (from the nodes table's advertised URLs)."""
        if self.kind != "cluster3":
            return {}
        if not self.node_ids:
            for line in self.pg.psql(self.db, "SELECT id, advertise_url FROM nodes").splitlines():
                nid, url = line.split("\t")
                for i, n in enumerate(self.nodes):
                    if n.url == url.rstrip("/"):
                        self.node_ids[nid] = i
        return self.node_ids

    def session_nodes(self, ids):
        """session id -> index of the node holding it (cluster3: from the recordings' `node`)."""
        if self.kind != "cluster3":
            return {i: 0 for i in ids}
        idx = self.node_index()
        out = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            want = ",".join(f"'{i}'" for i in ids)
            for line in self.pg.psql(self.db, f"SELECT id, node FROM sessions WHERE id IN ({want})").splitlines():
                sid, nid = line.split("\t")
                out[sid] = idx.get(nid)
            if len(out) == len(ids):
                break
            time.sleep(0.2)
        return out

    def placements_recorded(self):
        """Sessions recorded per node index so far (cluster3)."""
        if self.kind != "cluster3":
            return None
        idx = self.node_index()
        counts = [0] * len(self.nodes)
        for line in self.pg.psql(self.db, "SELECT node, count(*) FROM sessions GROUP BY node").splitlines():
            nid, c = line.split("\t")
            if nid in idx:
                counts[idx[nid]] += int(c)
        return counts

    def h(self, user):
        return {"Authorization": f"Bearer {self.tokens[user]}"}

    def stop(self):
        for n in self.nodes:
            n.stop()


# --------------------------------------------------------------------------------------
# CPU accounting


def machine_busy_s():
    """(busy, of which irq + softirq) CPU seconds of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    # user, nice, system, irq, softirq (not idle, iowait, or the hypervisor's steal)
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / hz, (v[5] + v[6]) / hz


def pg_cpu_s(postmaster):
    if postmaster is None:
        return 0.0
    try:
        t = postmaster.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for c in postmaster.children():
            try:
                ct = c.cpu_times()
                total += ct.user + ct.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0.0


class Cpu:
    def __init__(self, setup, postmaster):
        self.setup, self.postmaster = setup, postmaster
        self.me = psutil.Process()

    def snap(self):
        t = self.me.cpu_times()
        return {"brokers": sum(n.broker_cpu_s() for n in self.setup.nodes),
                "kernels": sum(n.kernel_cpu_s() for n in self.setup.nodes),
                "postgres": pg_cpu_s(self.postmaster) if self.setup.db else 0.0,
                "client": t.user + t.system,
                **dict(zip(("machine", "irq"), machine_busy_s()))}

    @staticmethod
    def per_op(a, b, ops):
        d = {k: b[k] - a[k] for k in a}
        # other: busy time no process above was charged with (the rest of the machine;
        # interrupts and softirqs, e.g. loopback TCP, are shown apart as irq)
        d["other"] = d["machine"] - sum(v for k, v in d.items() if k != "machine")
        return {f"{k}_ms_per_op": round(v * 1000 / max(1, ops), 2) for k, v in d.items()}


# --------------------------------------------------------------------------------------
# phases


def http():
    s = requests.Session()
    s.headers["Connection"] = "keep-alive"
    return s


def run_threads(n, target, duration):
    barrier = threading.Barrier(n + 1, timeout=TIMEOUT)
    box = {}

    def wrap(i):
        barrier.wait()
        target(i, box["end"])

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    box["end"] = time.perf_counter() + duration
    t0 = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join(duration + TIMEOUT)
    return time.perf_counter() - t0, sum(t.is_alive() for t in threads)


def phase_create(setup, clients, duration, cpu):
    nodes = setup.nodes
    creates, firsts, cycles = [], [], []
    slow = []  # (seconds into the phase, seconds) of creates over 1 s
    failures = collections.Counter()
    lock = threading.Lock()
    done = [0] * clients

    def worker(i, end):
        node = nodes[i % len(nodes)]
        user = i % USERS
        s = http()
        s.headers.update(setup.h(user))
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            sid = None
            start = end - duration
            try:
                r = s.post(node.url + "/v1/sessions", json={}, timeout=TIMEOUT)
                t1 = time.perf_counter()
                if t1 - t0 > 1:
                    with lock:
                        slow.append((round(t0 - start, 1), round(t1 - t0, 2)))
                if r.status_code != 201:
                    with lock:
                        failures[f"create {r.status_code} {r.text[:120]}"] += 1
                    time.sleep(0.2)
                    continue
                sid = r.json()["id"]
                r = s.post(f"{node.url}/v1/sessions/{sid}/execute", json={"code": "1+1"}, timeout=TIMEOUT)
                t2 = time.perf_counter()
                ok = r.status_code == 200 and r.json().get("status") == "ok"
                if not ok:
                    with lock:
                        failures[f"execute {r.status_code} {r.text[:120]}"] += 1
                r = s.delete(f"{node.url}/v1/sessions/{sid}", timeout=TIMEOUT)
                sid = None
                t3 = time.perf_counter()
                if r.status_code != 204:
                    with lock:
                        failures[f"delete {r.status_code} {r.text[:120]}"] += 1
                    continue
                if ok:
                    with lock:
                        creates.append(t1 - t0)
                        firsts.append(t2 - t1)
                        cycles.append(t3 - t0)
                    done[i] += 1
            except Exception as e:  # noqa: BLE001
                with lock:
                    failures[type(e).__name__ + ": " + str(e)[:100]] += 1
                if sid:
                    try:
                        s.delete(f"{node.url}/v1/sessions/{sid}", timeout=TIMEOUT)
                    except Exception:  # noqa: BLE001
                        pass
        s.close()

    before_place = setup.placements_recorded()
    c0 = cpu.snap()
    elapsed, stuck = run_threads(clients, worker, duration)
    c1 = cpu.snap()
    total = sum(done)
    res = {"clients": clients, "duration_s": round(elapsed, 2), "sessions_completed": total,
           "sessions_per_s": round(total / elapsed, 2), "failures": sum(failures.values()) + stuck,
           "create": bench.summary(creates), "first_execute": bench.summary(firsts), "cycle": bench.summary(cycles),
           "per_client_min_max": [min(done), max(done)], "errors": dict(failures.most_common(5)),
           "creates_over_1s": len(slow), "creates_over_1s_at_s_took_s": sorted(slow)[:12],
           "cpu": Cpu.per_op(c0, c1, total)}
    after_place = setup.placements_recorded()
    if after_place is not None:
        res["placed_per_node"] = [a - b for a, b in zip(after_place, before_place)]
    return res


def make_sessions(setup, n):
    nodes = setup.nodes
    out = [None] * n
    errors = []

    def one(j):
        node, user = nodes[j % len(nodes)], j % USERS
        r = requests.post(node.url + "/v1/sessions", json={}, headers=setup.h(user), timeout=TIMEOUT)
        if r.status_code != 201:
            raise RuntimeError(f"create {r.status_code} {r.text[:200]}")
        sid = r.json()["id"]
        r = requests.post(f"{node.url}/v1/sessions/{sid}/execute", json={"code": "1+1"}, headers=setup.h(user),
                          timeout=TIMEOUT)
        if r.status_code != 200 or r.json().get("status") != "ok":
            raise RuntimeError(f"first execute {r.status_code} {r.text[:200]}")
        out[j] = (sid, user)

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        for f in [ex.submit(one, j) for j in range(n)]:
            try:
                f.result(timeout=TIMEOUT * 4)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
    return [s for s in out if s], errors


def delete_sessions(setup, sessions):
    def one(s):
        sid, user = s
        requests.delete(f"{setup.nodes[0].url}/v1/sessions/{sid}", headers=setup.h(user), timeout=TIMEOUT)

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        list(ex.map(one, sessions))


def phase_execute(setup, clients, n_sessions, duration, cpu, seed):
    nodes = setup.nodes
    t0 = time.perf_counter()
    sessions, errors = make_sessions(setup, n_sessions)
    made_s = time.perf_counter() - t0
    if errors or len(sessions) < n_sessions:
        delete_sessions(setup, sessions)
        raise RuntimeError(f"only {len(sessions)} of {n_sessions} sessions: {errors[:3]}")
    owner = setup.session_nodes([s[0] for s in sessions])
    placed = collections.Counter(owner.values())
    lat = []
    forwarded_lat, local_lat = [], []
    failures = collections.Counter()
    lock = threading.Lock()
    done = [0] * clients
    forwarded = [0] * clients

    def worker(i, end):
        rng = random.Random(seed * 1000 + i)
        mine = sessions[i::clients]
        conns = []
        for u in range(USERS):
            row = []
            for _ in nodes:
                s = http()
                s.headers.update(setup.h(u))
                row.append(s)
            conns.append(row)
        k = 0
        while time.perf_counter() < end:
            sid, user = mine[k % len(mine)]
            k += 1
            ni = rng.randrange(len(nodes))
            t0 = time.perf_counter()
            try:
                r = conns[user][ni].post(f"{nodes[ni].url}/v1/sessions/{sid}/execute", json={"code": "1+1"},
                                         timeout=TIMEOUT)
                dt = time.perf_counter() - t0
                if r.status_code == 200 and r.json().get("status") == "ok":
                    fw = owner.get(sid) != ni
                    with lock:
                        lat.append(dt)
                        (forwarded_lat if fw else local_lat).append(dt)
                    done[i] += 1
                    forwarded[i] += fw
                else:
                    with lock:
                        failures[f"execute {r.status_code} {r.text[:120]}"] += 1
            except Exception as e:  # noqa: BLE001
                with lock:
                    failures[type(e).__name__ + ": " + str(e)[:100]] += 1
        for row in conns:
            for s in row:
                s.close()

    try:
        c0 = cpu.snap()
        elapsed, stuck = run_threads(clients, worker, duration)
        c1 = cpu.snap()
    finally:
        delete_sessions(setup, sessions)
    total = sum(done)
    return {"clients": clients, "sessions": n_sessions, "sessions_made_in_s": round(made_s, 2),
            "placed_per_node": [placed.get(i, 0) for i in range(len(nodes))],
            "duration_s": round(elapsed, 2), "executes_ok": total, "executes_per_s": round(total / elapsed, 1),
            "failures": sum(failures.values()) + stuck, "latency": bench.summary(lat),
            "forwarded_share": round(sum(forwarded) / max(1, total), 3),
            "latency_forwarded": bench.summary(forwarded_lat), "latency_local": bench.summary(local_lat),
            "per_client_min_max": [min(done), max(done)], "errors": dict(failures.most_common(5)),
            "cpu": Cpu.per_op(c0, c1, total)}


def one_run(kind, binary, pg, cfg, rep):
    setup = Setup(kind, binary, pg)
    try:
        postmaster = pg.postmaster() if setup.db else None
        cpu = Cpu(setup, postmaster)
        # warm-up: every user's first session on every node (its sandbox, fork server, pool)
        warm, errs = make_sessions(setup, USERS * len(setup.nodes))
        delete_sessions(setup, warm)
        if errs:
            raise RuntimeError(f"warm-up failed: {errs[:3]}")
        # and a short churn, discarded: every user's fork server and pool on every node
        if cfg.warmup > 0:
            w = phase_create(setup, cfg.clients, cfg.warmup, cpu)
            if w["failures"]:
                raise RuntimeError(f"warm-up churn failed: {w['errors']}")
        time.sleep(cfg.settle)
        res = {"config": kind, "nodes": len(setup.nodes), "repeat": rep,
               "load_avg_start": [round(x, 2) for x in os.getloadavg()]}
        res["create"] = phase_create(setup, cfg.clients, cfg.duration, cpu)
        c = res["create"]
        log(f"  {kind} #{rep} create: {c['sessions_per_s']} sessions/s, create p50 {c['create'].get('p50_ms')} "
            f"p99 {c['create'].get('p99_ms')} ms, first exec p50 {c['first_execute'].get('p50_ms')} ms, "
            f"{c['failures']} failed, placed {c.get('placed_per_node')} {c['errors'] or ''}")
        time.sleep(cfg.settle)
        res["execute"] = phase_execute(setup, cfg.clients, cfg.sessions, cfg.duration, cpu, rep)
        e = res["execute"]
        log(f"  {kind} #{rep} execute: {e['executes_per_s']} exec/s, p50 {e['latency'].get('p50_ms')} "
            f"p99 {e['latency'].get('p99_ms')} ms, forwarded {e['forwarded_share']}, placed {e['placed_per_node']}, "
            f"{e['failures']} failed {e['errors'] or ''}")
        res["broker_log_warnings"] = [w for n in setup.nodes for w in n.errors_logged()][:20]
        res["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        return res
    finally:
        setup.stop()


def median_run(runs, key):
    """The run whose `key` throughput is the median (the lower middle of an even count)."""
    s = sorted(runs, key=key)
    return s[(len(s) - 1) // 2]


def table(summary):
    rows = [
        ("create: sessions/s", lambda r: r["create"]["sessions_per_s"], 2),
        ("create: POST /v1/sessions p50 ms", lambda r: r["create"]["create"].get("p50_ms"), 1),
        ("create: POST /v1/sessions p99 ms", lambda r: r["create"]["create"].get("p99_ms"), 1),
        ("create: first `1+1` p50 ms", lambda r: r["create"]["first_execute"].get("p50_ms"), 1),
        ("create: first `1+1` p99 ms", lambda r: r["create"]["first_execute"].get("p99_ms"), 1),
        ("create: failures", lambda r: r["create"]["failures"], 0),
        ("create: creates over 1 s", lambda r: r["create"]["creates_over_1s"], 0),
        ("create: CPU ms/session brokers", lambda r: r["create"]["cpu"]["brokers_ms_per_op"], 1),
        ("create: CPU ms/session kernels", lambda r: r["create"]["cpu"]["kernels_ms_per_op"], 1),
        ("create: CPU ms/session PostgreSQL", lambda r: r["create"]["cpu"]["postgres_ms_per_op"], 1),
        ("create: CPU ms/session client", lambda r: r["create"]["cpu"]["client_ms_per_op"], 1),
        ("create: CPU ms/session irq + softirq", lambda r: r["create"]["cpu"].get("irq_ms_per_op"), 1),
        ("create: CPU ms/session unattributed", lambda r: r["create"]["cpu"]["other_ms_per_op"], 1),
        ("create: CPU ms/session machine", lambda r: r["create"]["cpu"]["machine_ms_per_op"], 1),
        ("create: sessions placed per node", lambda r: r["create"].get("placed_per_node"), None),
        ("execute: executions/s", lambda r: r["execute"]["executes_per_s"], 1),
        ("execute: `1+1` p50 ms", lambda r: r["execute"]["latency"].get("p50_ms"), 2),
        ("execute: `1+1` p99 ms", lambda r: r["execute"]["latency"].get("p99_ms"), 2),
        ("execute: forwarded share", lambda r: r["execute"]["forwarded_share"], 2),
        ("execute: p50 ms local / forwarded", lambda r: (r["execute"]["latency_local"].get("p50_ms"),
                                                          r["execute"]["latency_forwarded"].get("p50_ms")), None),
        ("execute: failures", lambda r: r["execute"]["failures"], 0),
        ("execute: CPU ms/exec brokers", lambda r: r["execute"]["cpu"]["brokers_ms_per_op"], 2),
        ("execute: CPU ms/exec kernels", lambda r: r["execute"]["cpu"]["kernels_ms_per_op"], 2),
        ("execute: CPU ms/exec PostgreSQL", lambda r: r["execute"]["cpu"]["postgres_ms_per_op"], 2),
        ("execute: CPU ms/exec client", lambda r: r["execute"]["cpu"]["client_ms_per_op"], 2),
        ("execute: CPU ms/exec irq + softirq", lambda r: r["execute"]["cpu"].get("irq_ms_per_op"), 2),
        ("execute: CPU ms/exec unattributed", lambda r: r["execute"]["cpu"]["other_ms_per_op"], 2),
        ("execute: CPU ms/exec machine", lambda r: r["execute"]["cpu"]["machine_ms_per_op"], 2),
        ("execute: sessions placed per node", lambda r: r["execute"]["placed_per_node"], None),
    ]
    kinds = list(summary)
    out = ["| measure | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name, f, digits in rows:
        cells = []
        for k in kinds:
            try:
                v = f(summary[k])
            except (KeyError, TypeError):
                v = None
            if v is None:
                cells.append("")
            elif isinstance(v, (list, tuple)):
                cells.append(" / ".join("" if x is None else str(x) for x in v))
            elif digits == 0:
                cells.append(str(int(v)))
            else:
                cells.append(f"{v:,.{digits}f}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    global USERS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker-bin", default=str(REPO / "target/release/kernel-broker"))
    ap.add_argument("--configs", default="single,single-pg,cluster3")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients in each phase (C)")
    ap.add_argument("--sessions", type=int, default=24, help="long-lived sessions of the execute phase (S)")
    ap.add_argument("--duration", type=float, default=20, help="seconds of load per phase")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median one is reported")
    ap.add_argument("--users", type=int, default=4, help="users the clients and sessions are spread over")
    ap.add_argument("--warmup", type=float, default=5,
                    help="seconds of create churn before the measured phases (discarded)")
    ap.add_argument("--settle", type=float, default=2, help="seconds of quiet before each phase")
    ap.add_argument("--smoke", action="store_true",
                    help="bounded run for CI: C=2, S=3, 3 s per phase, one run per configuration")
    ap.add_argument("--json", default=str(REPO / "bench-results/cluster.json"))
    cfg = ap.parse_args()
    if cfg.smoke:
        cfg.clients, cfg.sessions, cfg.duration, cfg.repeats, cfg.settle, cfg.warmup = 2, 3, 3, 1, 0.5, 1
    USERS = cfg.users
    kinds = [k for k in cfg.configs.split(",") if k]
    for k in kinds:
        if k not in ("single", "single-pg", "cluster3"):
            ap.error(f"unknown configuration {k}")
    if cfg.sessions < cfg.clients:
        ap.error("--sessions must be at least --clients (each client has sessions of its own)")
    if os.geteuid() != 0:
        log("warning: not root; the local sandbox needs root")
    started = time.monotonic()
    pg = Postgres() if any(k != "single" for k in kinds) else None
    runs = {k: [] for k in kinds}
    failed = 0
    try:
        for rep in range(1, cfg.repeats + 1):
            for k in kinds:  # interleaved: a slow patch of the shared machine hits every configuration
                log(f"{k}, run {rep} of {cfg.repeats}")
                r = one_run(k, cfg.broker_bin, pg, cfg, rep)
                runs[k].append(r)
                failed += r["create"]["failures"] + r["execute"]["failures"]
    finally:
        if pg:
            pg.drop_all()
    # the median run by each phase's throughput
    summary = {}
    for k, rs in runs.items():
        c = median_run(rs, lambda r: r["create"]["sessions_per_s"])
        e = median_run(rs, lambda r: r["execute"]["executes_per_s"])
        summary[k] = {"create": c["create"], "execute": e["execute"], "create_run": c["repeat"], "execute_run": e["repeat"]}
    out = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
           "binary": cfg.broker_bin, "settings": {k: getattr(cfg, k) for k in
                                                   ("configs", "clients", "sessions", "duration", "repeats", "users", "warmup", "smoke")},
           "summary": summary, "runs": runs, "failures": failed,
           "wall_s": round(time.monotonic() - started, 1)}
    Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.json).write_text(json.dumps(out, indent=1))
    print(f"C={cfg.clients} clients, S={cfg.sessions} sessions, {USERS} users, {cfg.duration:g} s per phase, "
          f"median of {cfg.repeats} run(s); failures in all runs: {failed}; {out['wall_s']} s in all")
    print(table(summary))
    log(f"JSON: {cfg.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
