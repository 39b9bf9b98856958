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

Meanwhile the broker runs with --keep-sessions and is restarted `--restarts` times, SIGTERM
and SIGKILL in turn, at cycle boundaries (the workers pause): one long-lived session per
user must come back each time with its variables (a counter bumped before every restart),
and a cell running on one of them when the broker stops must be answered ("BrokerRestarted"
after a SIGTERM, a broken connection after a SIGKILL) and finished by its kernel.

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
        # Workers pause at cycle boundaries while the broker restarts.
        self.gate = threading.Condition()
        self.active = 0
        self.pausing = False

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
        with self.gate:
            while self.pausing:
                self.gate.wait()
            self.active += 1
        try:
            self._cycle(user)
        finally:
            with self.gate:
                self.active -= 1
                self.gate.notify_all()

    def pause(self):
        """Waits until no cycle runs and keeps new ones from starting."""
        with self.gate:
            self.pausing = True
            while self.active:
                self.gate.wait()

    def resume(self):
        with self.gate:
            self.pausing = False
            self.gate.notify_all()

    def _cycle(self, user):
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


class Restarts:
    """The broker's restarts with --keep-sessions and the long-lived sessions that must
    survive them (one per user, `n` counting the restarts they saw)."""

    def __init__(self, soak):
        self.soak, self.b = soak, soak.b
        self.kept = []
        self.n = 0
        self.figures = {"restarts": 0, "sigterm": 0, "sigkill": 0, "stop_seconds": [], "start_seconds": [],
                        "state_kept": 0, "in_flight": {}}
        self.failures = []
        for u in range(bench.USERS):
            s = self.b.create(user=u)
            assert self.soak.rest(s, "n = 0") == "ok"
            self.kept.append(s)

    def restart(self, i):
        sig = signal.SIGTERM if i % 2 == 0 else signal.SIGKILL
        self.soak.pause()
        try:
            self.n += 1
            for s in self.kept:
                if self.soak.rest(s, "n += 1") != "ok":
                    self.failures.append(f"restart {i}: n += 1 failed on {s.id}")
            if sig == signal.SIGKILL:
                time.sleep(2.5)  # the session records' journal interval
            busy = self.kept[i % len(self.kept)]
            answer = {}

            def run():
                try:
                    r = requests.post(f"{self.b.url}/v1/sessions/{busy.id}/execute", headers=self.b.h(busy.user),
                                      json={"code": "import time\ntime.sleep(2)\nn += 1000"}, timeout=60)
                    answer["v"] = (r.json().get("error") or {}).get("ename") or r.json().get("status")
                except requests.RequestException as e:
                    answer["v"] = "connection_error"

            t = threading.Thread(target=run)
            t.start()
            time.sleep(0.7)
            stop, start = self.b.restart(sig)
            t.join(60)
            name = "sigterm" if sig == signal.SIGTERM else "sigkill"
            self.figures["restarts"] += 1
            self.figures[name] += 1
            self.figures["stop_seconds"].append(round(stop, 3))
            self.figures["start_seconds"].append(round(start, 3))
            key = f"{name}:{answer.get('v')}"
            self.figures["in_flight"][key] = self.figures["in_flight"].get(key, 0) + 1
            allowed = {"sigterm": {"BrokerRestarted"}, "sigkill": {"connection_error"}}[name]
            if answer.get("v") not in allowed:
                self.failures.append(f"restart {i} ({name}): the running cell was answered {answer.get('v')}")
            time.sleep(2)  # the kernel finishes the cell meanwhile
            for s in self.kept:
                want = self.n + (1000 if s is busy else 0)
                r = requests.post(f"{self.b.url}/v1/sessions/{s.id}/execute", headers=self.b.h(s.user),
                                  json={"code": "n", "timeout_seconds": 30}, timeout=60).json()
                got = ((r.get("results") or [{}])[0].get("data") or {}).get("text/plain")
                if got != str(want):
                    self.failures.append(f"restart {i} ({name}): session {s.id} has n = {got}, not {want}: {r}")
                else:
                    self.figures["state_kept"] += 1
                if s is busy:
                    requests.post(f"{self.b.url}/v1/sessions/{s.id}/execute", headers=self.b.h(s.user),
                                  json={"code": "n -= 1000"}, timeout=60)
        finally:
            self.soak.resume()

    def close(self):
        for s in self.kept:
            self.b.delete(s)


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
    ap.add_argument("--restarts", type=int, default=4,
                    help="broker restarts with --keep-sessions during the run (SIGTERM and SIGKILL in turn)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    b = bench.Broker(args.broker_bin, sandbox=args.sandbox, pool_size=0, tag="-soak", memory_limit=MEMORY_LIMIT,
                     extra_args=["--keep-sessions"])
    soak = Soak(b, args.seed)
    # Warm-up: one cycle per user, so first-use costs (user cgroups, workspaces, lazily
    # grown pools) are in the baseline.
    for u in range(bench.USERS):
        soak.cycle(u)
    restarts = Restarts(soak)
    time.sleep(1)
    before = census(b)
    log("before:", before)
    # Restarts spread over the run: after these many cycles each.
    every = max(1, args.cycles // (args.restarts + 1)) if args.restarts else None
    restart_at = {every * (k + 1): k for k in range(args.restarts)} if every else {}

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
            if i + 1 in restart_at:
                k = restart_at[i + 1]
                log(f"restart {k + 1} of {args.restarts} after {i + 1} cycles")
                try:
                    restarts.restart(k)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"restart {k}: {type(e).__name__}: {e}")
            if (i + 1) % 100 == 0:
                log(f"{i + 1} cycles, {time.monotonic() - started:.0f} s")

    threads = [threading.Thread(target=worker) for _ in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started

    restarts.close()
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
        "restarts": restarts.figures, "restart_failures": restarts.failures[:50],
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    b.stop()
    bad = bool(leaks or soak.wrong or errors or missing or restarts.failures)
    log("FAILED" if bad else "passed", f"({soak.sessions} sessions, {elapsed:.0f} s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
