#!/usr/bin/env python3
"""kernel-broker benchmarks: starts each system itself and drives it with the same client.

    protocol-tests/.venv/bin/python bench/bench.py [--quick] [--json out.json]

Measures, on this machine:
  - cold session start: POST /v1/sessions until the first result of `1+1` (REST)
  - execute round trip for `1+1` over the agent WebSocket stream, p50/p99
  - the floor: the same round trip with jupyter_client directly against a bare ipykernel
    (same Python environment, no sandbox, no broker)
The broker is the release build (target/release/kernel-broker; built if missing).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests
import websocket

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-token-" + uuid.uuid4().hex[:8]


def pct(samples, p):
    s = sorted(samples)
    k = max(0, min(len(s) - 1, round(p / 100 * (len(s) - 1))))
    return s[k]


def summary(samples):
    return {"n": len(samples), "p50_ms": round(pct(samples, 50) * 1000, 3),
            "p99_ms": round(pct(samples, 99) * 1000, 3), "mean_ms": round(statistics.mean(samples) * 1000, 3)}


class BrokerProc:
    def __init__(self, extra=()):
        binary = REPO / "target/release/kernel-broker"
        if not binary.exists() or os.environ.get("BENCH_REBUILD"):
            subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO, check=True)
        self.tmp = tempfile.TemporaryDirectory(prefix="kb-bench-")
        env = dict(os.environ, KERNEL_BROKER_TOKEN=TOKEN, KERNEL_BROKER_LOG="warn,kernel_broker::server=info")
        self.proc = subprocess.Popen(
            [str(binary), "serve", "--listen", "127.0.0.1:0", "--data-dir", self.tmp.name + "/data",
             "--kernels-dir", str(REPO / "kernels"), "--cgroup-name", "kernel-broker-bench-" + uuid.uuid4().hex[:8],
             *extra],
            env=env, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            if "ready on http://" in line:
                self.url = "http://" + line.split("ready on http://")[1].split()[0]
                break
        else:
            raise RuntimeError("broker did not start")
        self.h = {"Authorization": f"Bearer {TOKEN}"}

    def rss_kib(self):
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1])
        return 0

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.tmp.cleanup()


def bench_cold_start(b, n):
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = requests.post(b.url + "/v1/sessions", json={}, headers=b.h, timeout=60).json()
        x = requests.post(f"{b.url}/v1/sessions/{s['id']}/execute", json={"code": "1+1"}, headers=b.h, timeout=60).json()
        samples.append(time.perf_counter() - t0)
        assert x["status"] == "ok", x
        requests.delete(f"{b.url}/v1/sessions/{s['id']}", headers=b.h, timeout=60)
    return summary(samples)


def bench_ws_roundtrip(b, n):
    s = requests.post(b.url + "/v1/sessions", json={}, headers=b.h, timeout=60).json()
    ws = websocket.create_connection(b.url.replace("http", "ws") + f"/v1/sessions/{s['id']}/stream",
                                     header=[f"Authorization: Bearer {TOKEN}"], timeout=60)
    ws.sock.setsockopt(6, 1, 1)  # TCP_NODELAY on the client too
    json.loads(ws.recv())  # initial status
    samples = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        ws.send(json.dumps({"type": "execute", "id": i, "code": "1+1"}))
        while True:
            f = json.loads(ws.recv())
            if f["type"] == "done" and f["id"] == i:
                break
        if i >= 20:  # warm-up
            samples.append(time.perf_counter() - t0)
    ws.close()
    requests.delete(f"{b.url}/v1/sessions/{s['id']}", headers=b.h, timeout=60)
    return summary(samples)


def bench_floor(n):
    """jupyter_client directly against a bare ipykernel from the same environment."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    py = str(REPO / "kernels/.venv/bin/python")
    specs = tempfile.TemporaryDirectory(prefix="kb-bench-spec-")
    os.makedirs(f"{specs.name}/python3")
    Path(f"{specs.name}/python3/kernel.json").write_text(json.dumps(
        {"argv": [py, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
         "display_name": "bench", "language": "python"}))
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[specs.name]))
    t0 = time.perf_counter()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    reply = kc.execute_interactive("1+1", timeout=60, output_hook=lambda m: None)
    cold = time.perf_counter() - t0
    assert reply["content"]["status"] == "ok"
    samples = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        kc.execute_interactive("1+1", timeout=60, output_hook=lambda m: None)
        if i >= 20:
            samples.append(time.perf_counter() - t0)
    kc.stop_channels()
    km.shutdown_kernel(now=True)
    return {"cold_start_s": round(cold, 3), "roundtrip": summary(samples)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="few iterations (smoke test)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    n_rt = 30 if args.quick else 500
    n_cold = 2 if args.quick else 10
    results = {"machine": {"cpus": os.cpu_count()}, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    floor = bench_floor(n_rt)
    results["floor_jupyter_client"] = floor
    b = BrokerProc()
    try:
        results["broker_local"] = {
            "cold_start_to_first_result": bench_cold_start(b, n_cold),
            "ws_roundtrip_1p1": bench_ws_roundtrip(b, n_rt),
            "broker_rss_kib": b.rss_kib(),
        }
    finally:
        b.stop()

    fl = floor["roundtrip"]["p50_ms"]
    br = results["broker_local"]
    print(f"{'measure':<44}{'p50 ms':>10}{'p99 ms':>10}{'x floor':>9}")
    print(f"{'floor: jupyter_client -> bare ipykernel':<44}{fl:>10.2f}{floor['roundtrip']['p99_ms']:>10.2f}{1.0:>9.2f}")
    w = br["ws_roundtrip_1p1"]
    print(f"{'broker (local sandbox) WebSocket 1+1':<44}{w['p50_ms']:>10.2f}{w['p99_ms']:>10.2f}{w['p50_ms'] / fl:>9.2f}")
    c = br["cold_start_to_first_result"]
    print(f"{'broker cold session start -> first result':<44}{c['p50_ms']:>10.1f}{c['p99_ms']:>10.1f}")
    print(f"{'bare ipykernel cold start -> first result':<44}{floor['cold_start_s'] * 1000:>10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
