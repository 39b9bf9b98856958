#!/usr/bin/env python3
"""kernel-broker under churn: a bounded soak run that looks for leaks and lost work.

    bench/soak [--cycles 2000] [--workers 4] [--sandbox local|docker] [--json PATH]

(bench/soak sets up bench/.venv and builds the release binary, then runs this file; a
smoke run: --cycles 20.)

Each worker repeats cycles across the broker's users: create a session, run 2 to 6 random
steps on it, delete it. The steps: an execution that succeeds, one that raises, one past its
timeout, one interrupted over the agent stream, one over the agent stream; and kernel deaths:
`os._exit` from inside, SIGKILL from outside (the session's cgroup leaf), running out of
memory. Every step's outcome must be one its step allows (a death must read `dead`); every
request must be answered.

Counted before (after a warm-up) and after (every session deleted): kernel processes and
processes in the broker's cgroups, cgroup directories, runtime directories, the broker's file
descriptors, threads and resident memory; then, for every execution the broker acknowledged,
that its recording holds its execute_request and its reply.

Exit status 1 when anything leaked, an outcome was wrong or a recording is missing.
"""
import argparse
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the shared broker harness and clients)

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMORY_LIMIT = 2 << 30  # per user: the out-of-memory step allocates past it


def log(*a):
    print("soak:", *a, file=sys.stderr, flush=True)


class Soak:
    def __init__(self, broker, seed):
        self.b = broker
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes = {}  # step -> {status: count}
        self.wrong = []  # (step, outcome) not allowed for the step
        self.executions = {}  # session id -> (user, executions the broker answered)
        self.sessions = 0

    def note(self, step, status, allowed):
        with self.lock:
            self.outcomes.setdefault(step, {}).setdefault(status, 0)
            self.outcomes[step][status] += 1
            if status not in allowed:
                self.wrong.append((step, status))

    def answered(self, sid, user):
        with self.lock:
            u, n = self.executions.get(sid, (user, 0))
            self.executions[sid] = (u, n + 1)

    # ---- the steps: each returns False when the session is gone (dead)

    def rest(self, s, code, timeout=30):
        r = requests.post(f"{self.b.url}/v1/sessions/{s.id}/execute", headers=self.b.h(s.user),
                          json={"code": code, "timeout_seconds": timeout}, timeout=timeout + 60)
        if r.status_code != 200:
            return f"http_{r.status_code}"
        self.answered(s.id, s.user)
        return r.json()["status"]

    def step_ok(self, s):
        st = self.rest(s, "x = globals().get('x', 0) + 1\nx")
        self.note("ok", st, {"ok"})
        return st == "ok"

    def step_error(self, s):
        st = self.rest(s, "{}['missing']")
        self.note("error", st, {"error"})
        return st == "error"

    def step_timeout(self, s):
        st = self.rest(s, "import time; time.sleep(30)", timeout=1)
        self.note("timeout", st, {"timeout"})
        return st == "timeout"

    def step_ws(self, s, interrupt=False):
        ws = bench.AgentWS(self.b.url, s.id, self.b.tokens[s.user])
        try:
            if not interrupt:
                r = ws.execute("print('hello'); 6 * 7", timeout=60)
                st = r.status
                self.note("ws", st, {"ok"})
            else:
                ws.ws.send(json.dumps({"type": "execute", "id": "long", "code": "import time; time.sleep(30)"}))
                # Interrupt once the session is busy with it (an interrupt that reaches an
                # idle kernel interrupts nothing), then wait for its `done` (the execution
                # timeout, 60 s, is the latest it may come).
                st = None
                busy = False
                deadline = time.monotonic() + 120
                while st is None and time.monotonic() < deadline:
                    ws.ws.settimeout(max(0.1, deadline - time.monotonic()))
                    f = json.loads(ws.ws.recv())
                    if f.get("type") == "status" and f.get("state") == "busy" and not busy:
                        busy = True
                        time.sleep(0.2)
                        ws.ws.send(json.dumps({"type": "interrupt"}))
                    elif f.get("type") == "done" and f.get("id") == "long":
                        st = f["execution"]["status"]
                st = st or "no_done"
                # Interrupted while running ("ok": the interrupt beat the code to the kernel).
                self.note("interrupt", st, {"interrupted", "error", "ok"})
            if st != "no_done":
                self.answered(s.id, s.user)
            return st in ("ok", "error", "interrupted")
        finally:
            ws.close()

    def step_exit(self, s):
        st = self.rest(s, "import os; os._exit(3)")
        self.note("exit", st, {"dead"})
        return False

    def step_sigkill(self, s):
        pids = leaf_pids(self.b.cgroup_name, s)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # The broker notices the end; the session reads dead.
        deadline = time.monotonic() + 30
        state = None
        while time.monotonic() < deadline:
            r = requests.get(f"{self.b.url}/v1/sessions/{s.id}", headers=self.b.h(s.user), timeout=30)
            state = r.json().get("state")
            if state == "dead":
                break
            time.sleep(0.1)
        self.note("sigkill", state if pids else "no_kernel_found", {"dead"})
        return False

    def step_oom(self, s):
        r = requests.get(f"{self.b.url}/v1/sessions/{s.id}", headers=self.b.h(s.user), timeout=30)
        # The session's own limit where the broker has one, else the user's.
        limit = r.json().get("memory_limit_bytes") or MEMORY_LIMIT
        st = self.rest(s, f"a = bytearray({limit + (256 << 20)})", timeout=60)
        # Killed by its cgroup's OOM killer (dead), or refused by the allocator (error).
        self.note("oom", st, {"dead", "error"})
        return st != "dead"

    def cycle(self, user):
        s = self.b.create(user=user)
        with self.lock:
            self.sessions += 1
        steps = [self.step_ok, self.step_ok, self.step_error, self.step_timeout,
                 self.step_ws, lambda s: self.step_ws(s, interrupt=True),
                 self.step_exit, self.step_oom]
        if self.b.sandbox == "local":
            # From outside: the session's cgroup leaf is the local backend's.
            steps.append(self.step_sigkill)
        with self.lock:
            n = self.rng.randint(2, 6)
            plan = [self.rng.choice(steps) for _ in range(n)]
        for step in plan:
            if not step(s):
                break
        r = requests.delete(f"{self.b.url}/v1/sessions/{s.id}", headers=self.b.h(s.user), timeout=60)
        self.note("delete", f"http_{r.status_code}", {"http_204", "http_200"})


def leaf_pids(cgroup_name, s):
    """The processes of a session's cgroup leaf (local backend), from any hierarchy."""
    pids = set()
    for procs in CGROUP_ROOT.glob(f"*/{cgroup_name}/*/{s.id}/cgroup.procs"):
        pids.update(int(p) for p in procs.read_text().split())
    for procs in CGROUP_ROOT.glob(f"{cgroup_name}/*/{s.id}/cgroup.procs"):
        pids.update(int(p) for p in procs.read_text().split())
    return sorted(pids)


def cgroup_dirs(cgroup_name):
    """Directories below the broker's cgroup, in every hierarchy (users and leaves)."""
    n = 0
    for base in list(CGROUP_ROOT.glob(f"*/{cgroup_name}")) + list(CGROUP_ROOT.glob(cgroup_name)):
        n += sum(1 for p in base.rglob("*") if p.is_dir())
    return n


def cgroup_procs(cgroup_name):
    pids = set()
    for base in list(CGROUP_ROOT.glob(f"*/{cgroup_name}")) + list(CGROUP_ROOT.glob(cgroup_name)):
        for procs in base.rglob("cgroup.procs"):
            pids.update(procs.read_text().split())
    return len(pids)


def run_dirs(data_dir):
    """Runtime directories of kernels (local, as root: /run/kernel-broker-<hash>)."""
    h = hashlib.sha256(os.path.abspath(data_dir).encode()).hexdigest()[:8]
    base = Path(f"/run/kernel-broker-{h}")
    return len(list(base.iterdir())) if base.is_dir() else 0


def census(b):
    p = psutil.Process(b.pid)
    return {
        "kernel_processes": len(b.kernel_procs()),
        "cgroup_processes": cgroup_procs(b.cgroup_name),
        "cgroup_dirs": cgroup_dirs(b.cgroup_name),
        "run_dirs": run_dirs(b.data_dir) if b.sandbox == "local" else 0,
        "broker_fds": len(os.listdir(f"/proc/{b.pid}/fd")),
        "broker_threads": p.num_threads(),
        "broker_rss_kib": p.memory_info().rss // 1024,
    }


def recorded(b, sid, user):
    """execute_request and execute_reply events in a session's recording."""
    counts = {"execute_request": 0, "execute_reply": 0}
    after = None
    while True:
        q = {"type": "execute_request,execute_reply", "limit": 1000}
        if after is not None:
            q["after"] = after
        r = requests.get(f"{b.url}/v1/sessions/{sid}/events", params=q, headers=b.h(user), timeout=60)
        r.raise_for_status()
        page = r.json()
        for e in page["events"]:
            if e.get("msg_type") in counts:
                counts[e["msg_type"]] += 1
        after = page.get("next_after")
        if after is None:
            return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sandbox", default="local", choices=["local", "docker"])
    ap.add_argument("--broker-bin", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    b = bench.Broker(args.broker_bin, sandbox=args.sandbox, pool_size=0, tag="-soak", memory_limit=MEMORY_LIMIT)
    soak = Soak(b, args.seed)
    # Warm-up: one cycle per user, so first-use costs (user cgroups, workspaces, lazily
    # grown pools) are in the baseline.
    for u in range(bench.USERS):
        soak.cycle(u)
    time.sleep(1)
    before = census(b)
    log("before:", before)

    started = time.monotonic()
    todo = iter(range(args.cycles))
    todo_lock = threading.Lock()
    errors = []

    def worker():
        while True:
            with todo_lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                soak.cycle(i % bench.USERS)
            except Exception as e:  # noqa: BLE001 - every failure is reported at the end
                errors.append(f"cycle {i}: {type(e).__name__}: {e}")
            if (i + 1) % 100 == 0:
                log(f"{i + 1} cycles, {time.monotonic() - started:.0f} s")

    threads = [threading.Thread(target=worker) for _ in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started

    # Everything deleted: give the broker a moment to reap, then count again.
    time.sleep(3)
    after = census(b)
    log("after:", after)
    leaks = {k: (before[k], after[k]) for k in ("kernel_processes", "cgroup_processes", "cgroup_dirs", "run_dirs")
             if after[k] > before[k]}
    # Descriptors, threads and memory vary a little (tokio's blocking pool grows and
    # shrinks, the allocator and SQLite keep caches): a leak is growth beyond that slack.
    for k, slack in (("broker_fds", 16), ("broker_threads", 16), ("broker_rss_kib", 100 << 10)):
        if after[k] > before[k] + slack:
            leaks[k] = (before[k], after[k])

    missing = []
    for sid, (user, n) in soak.executions.items():
        c = recorded(b, sid, user)
        if c["execute_request"] < n or c["execute_reply"] < min(n, c["execute_request"]) - 1:
            missing.append((sid, n, c))

    figures = {
        "cycles": args.cycles, "workers": args.workers, "sandbox": args.sandbox, "seconds": round(elapsed, 1),
        "sessions": soak.sessions, "executions_answered": sum(n for _, n in soak.executions.values()),
        "outcomes": soak.outcomes, "wrong_outcomes": soak.wrong[:50], "errors": errors[:50],
        "before": before, "after": after, "leaks": leaks, "recordings_missing": missing[:20],
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    b.stop()
    bad = bool(leaks or soak.wrong or errors or missing)
    log("FAILED" if bad else "passed", f"({soak.sessions} sessions, {elapsed:.0f} s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
