#!/usr/bin/env python3
"""Diagnostic probes behind the findings in BENCHMARKS.md (not part of the benchmark table).

    bench/.venv/bin/python bench/probes.py cold-connect   # kernel bound its sockets vs session ready
    bench/.venv/bin/python bench/probes.py first-execute  # pooled create vs the kernel's first cell
    bench/.venv/bin/python bench/probes.py history        # 100 kernels: shared vs private IPython history
    bench/.venv/bin/python bench/probes.py users          # broker, 100 sessions over 4 users vs 100 users

Each starts what it measures itself and stops it (same helpers as bench.py). The broker is
KERNEL_BROKER_BIN or target/release/kernel-broker.
"""
import argparse
import glob
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

BIN = os.environ.get("KERNEL_BROKER_BIN", str(bench.REPO / "target/release/kernel-broker"))


def med(xs):
    return round(statistics.median(xs) * 1000, 1)


def cold_connect(n=10):
    """When do the kernel's five ipc sockets exist, and when does POST /v1/sessions answer?
    The broker connects with the zeromq crate, whose connect retries a missing ipc socket
    with exponential backoff (50, 100, 200, 400, 800 ms ...)."""
    b = bench.Broker(BIN, "local", pool_size=0)
    try:
        b.delete(b.create())
        rows = []
        for _ in range(n):
            seen = {}
            stop = threading.Event()
            t0 = time.perf_counter()

            def watch():
                while not stop.is_set():
                    for f in glob.glob(b.data_dir + "/run/*/k-*"):
                        seen.setdefault(f, time.perf_counter() - t0)
                    time.sleep(0.002)

            th = threading.Thread(target=watch)
            th.start()
            r = requests.post(b.url + "/v1/sessions", json={}, headers=b.h(), timeout=60)
            ready = time.perf_counter() - t0
            stop.set()
            th.join()
            bound = max(seen.values()) if len(seen) >= 5 else float("nan")
            rows.append((bound, ready))
            print(f"sockets bound {bound * 1000:5.0f} ms   session ready {ready * 1000:5.0f} ms   gap {(ready - bound) * 1000:4.0f} ms")
            b.delete(bench.Sess(r.json()["id"]))
            time.sleep(0.5)
        print(json.dumps({"bound_p50_ms": med([r[0] for r in rows]), "ready_p50_ms": med([r[1] for r in rows]),
                          "gap_p50_ms": med([r[1] - r[0] for r in rows])}))
    finally:
        b.stop()


def first_execute(n=15):
    """A pooled create, then two `1+1` over REST: the kernel's first cell costs extra."""
    b = bench.Broker(BIN, "local", pool_size=1)
    try:
        b.delete(b.create())
        cr, first, second = [], [], []
        for _ in range(n):
            b.wait_pool(1)
            time.sleep(0.5)
            t0 = time.perf_counter()
            sid = requests.post(b.url + "/v1/sessions", json={}, headers=b.h(), timeout=60).json()["id"]
            t1 = time.perf_counter()
            for lst in (first, second):
                t = time.perf_counter()
                requests.post(f"{b.url}/v1/sessions/{sid}/execute", json={"code": "1+1"}, headers=b.h(), timeout=60)
                lst.append(time.perf_counter() - t)
            cr.append(t1 - t0)
            requests.delete(f"{b.url}/v1/sessions/{sid}", headers=b.h(), timeout=60)
        print(json.dumps({"pooled_create_p50_ms": med(cr), "first_1p1_p50_ms": med(first), "second_1p1_p50_ms": med(second)}))
    finally:
        b.stop()
    f = bench.Floor()
    try:
        first, second = [], []
        for _ in range(8):
            s = f.create()
            c = f.client(s, "jupyter_client")
            time.sleep(0.3)
            for lst in (first, second):
                t = time.perf_counter()
                c.execute("1+1")
                lst.append(time.perf_counter() - t)
            f.delete(s)
        print(json.dumps({"floor_first_1p1_p50_ms": med(first), "floor_second_1p1_p50_ms": med(second)}))
    finally:
        f.stop()


def history(n=100, duration=15):
    """100 bare kernels in a loop of `1+1`: each with its own HOME, 4 HOMEs shared by 25 each
    (as the broker's 4 users' workspaces are), and 4 shared HOMEs with the history in memory."""
    for label, groups, memory in [("private HOME each", 0, False), ("4 shared HOMEs", 4, False),
                                  ("4 shared HOMEs, history in memory", 4, True)]:
        f = bench.Floor()
        if memory:
            spec = pathlib.Path(f.tmp, "python3/kernel.json")
            d = json.loads(spec.read_text())
            d["argv"].append("--HistoryManager.hist_file=:memory:")
            spec.write_text(json.dumps(d))
        homes = [tempfile.mkdtemp(dir=f.tmp) for _ in range(max(1, groups))]
        counter = iter(range(10**6))
        lock = threading.Lock()

        def create(path="jupyter_client", user=0, f=f, homes=homes, groups=groups):
            from jupyter_client import KernelManager
            with lock:
                i = next(counter)
            home = homes[i % groups] if groups else tempfile.mkdtemp(dir=f.tmp)
            km = KernelManager(kernel_name="python3", kernel_spec_manager=f.ksm,
                               connection_file=f"{f.tmp}/k-{uuid.uuid4().hex}.json")
            km.start_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, HOME=home))
            kc = km.client()
            kc.start_channels()
            s = bench.Sess(uuid.uuid4().hex, 0, km, kc)
            with f.lock:
                f.live[s.id] = s
            bench.wait_ready(kc)
            return s

        f.create = create
        try:
            out = bench.bench_concurrency(f, [n], ["jupyter_client"], duration, "jupyter_client", lambda i: 0)
            r = out["concurrency"][str(n)]["jupyter_client"]
            print(json.dumps({"kernels": label, "executes_per_s": r["executes_per_s"], "p50_ms": r["latency"]["p50_ms"],
                              "p99_ms": r["latency"]["p99_ms"], "max_ms": r["latency"]["max_ms"],
                              "per_session_ok_min_median_max": r["per_session_ok_min_median_max"]}))
        finally:
            f.stop()
        time.sleep(20)  # let the machine settle between runs


def users(n=100, duration=15, only=None):
    """The broker with 100 sessions spread over 4 users (25 kernels share each user's
    workspace, so its ~/.ipython history), over 4 users with the history in memory (a kernel
    spec with --HistoryManager.hist_file=:memory:), and over 100 users (one each)."""
    for k, (u, memory) in enumerate(((4, False), (4, True), (n, False))):
        if only is not None and k != only:
            continue
        bench.USERS = u
        extra = []
        if memory:
            kdir = tempfile.mkdtemp(prefix="kb-probe-kernels-")
            os.chmod(kdir, 0o755)
            on = pathlib.Path(kdir, "python3")
            on.mkdir()
            os.chmod(on, 0o755)
            spec = json.loads((bench.REPO / "kernels/python3/kernel.json").read_text())
            spec["argv"].append("--HistoryManager.hist_file=:memory:")
            (on / "kernel.json").write_text(json.dumps(spec))
            os.chmod(on / "kernel.json", 0o644)
            extra = ["--python", str(bench.KERNEL_PYTHON)]
        orig = bench.subprocess.Popen

        def popen(args, extra=extra, kdir=kdir if memory else None, **kw):
            if "serve" in args:
                args = list(args) + extra
                if kdir:  # a flag may be given once: replace bench.py's --kernels-dir
                    args[args.index("--kernels-dir") + 1] = kdir
            return orig(args, **kw)

        bench.subprocess.Popen = popen
        try:
            b = bench.Broker(BIN, "local", pool_size=1)
        finally:
            bench.subprocess.Popen = orig
        try:
            b.delete(b.create())
            out = bench.bench_concurrency(b, [n], ["agent_ws"], duration, "agent", lambda i, u=u: i % u)
            r = out["concurrency"][str(n)]["agent_ws"]
            print(json.dumps({"users": u, "history_in_memory": memory, "executes_per_s": r["executes_per_s"],
                              "p50_ms": r["latency"]["p50_ms"], "p99_ms": r["latency"]["p99_ms"],
                              "max_ms": r["latency"]["max_ms"],
                              "per_session_ok_min_median_max": r["per_session_ok_min_median_max"]}), flush=True)
        finally:
            b.stop()
        time.sleep(20)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=["cold-connect", "first-execute", "history", "users"])
    p.add_argument("--only", type=int, help="users: run only variant 0 (4 users), 1 (4 users, history in memory) or 2 (100 users)")
    a = p.parse_args()
    if a.probe == "users":
        users(only=a.only)
    else:
        {"cold-connect": cold_connect, "first-execute": first_execute, "history": history}[a.probe]()
    bench.run_cleanups()


if __name__ == "__main__":
    main()
