"""Kernels beyond Python (issue 38): the figures of BENCHMARKS.md, "Languages".

    bench/.venv/bin/python bench/languages.py [--runs 5] [--trips 50] [--binary PATH]
                                              [--sandbox local|docker] [--only r,java]

For each kernel (python3, r, javascript, bash, java, sql), through the agent API (REST), on
one broker (release build; the local sandbox unless `--sandbox docker`):

  - cold create -> first result: `POST /v1/sessions {"kernel"}` then the language's `1+1`,
    on a broker without a warm pool (`--pool-size 0`), p50 of `--runs`;
  - pooled create -> first result: the same on a broker with a pool of one kernel per spec
    (each spec's own pool size set aside, so Java's is measured too), each create after
    its pool has refilled;
  - the `1+1` round trip, p50 of `--trips`, and its ratio to Python's;
  - an idle kernel's memory: its cgroup leaf's charge after its first result.

Each figure is a wall-clock time seen by the client or read from the cgroup tree.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402
from branch import Api, leaf_charged, ms  # noqa: E402

# The language's `1 + 1` and the text its answer holds.
ONE_PLUS_ONE = {
    "python3": ("1 + 1", "2"),
    "r": ("1 + 1", "[1] 2"),
    "javascript": ("1 + 1", "2"),
    "bash": ("echo $((1 + 1))", "2"),
    "java": ("1 + 1", "2"),
    "sql": ("SELECT 1 + 1 AS two", "2"),
}


def answered(out, want):
    texts = [out["stdout"]] + [r["data"].get("text/plain", "") for r in out["results"]]
    return out["status"] == "ok" and any(want in t for t in texts)


def first_result(api, kernel):
    """(seconds from the create to the first result, session id)."""
    code, want = ONE_PLUS_ONE[kernel]
    start = time.monotonic()
    sid = api.call("POST", "/v1/sessions", {"kernel": kernel})["id"]
    out = api.call("POST", f"/v1/sessions/{sid}/execute", {"code": code})
    took = time.monotonic() - start
    if not answered(out, want):
        raise RuntimeError(f"{kernel}: {out}")
    return took, sid


def leaf_of(broker, sid):
    """The cgroup charge of the session's kernel (the leaf named after it)."""
    procs = bench.descendants(broker.pid) if broker.sandbox == "local" else broker.kernel_procs()
    for p in procs:
        try:
            if sid in Path(f"/proc/{p.pid}/cgroup").read_text():
                return leaf_charged(p.pid)
        except OSError:
            continue
    return None


def kernels_without_pool_sizes():
    """A copy of kernels/'s specs without their own pool sizes (Java's 0), beside the
    kernels' environment, for the pooled broker."""
    tmp = Path(tempfile.mkdtemp(prefix="kb-bench-kernels-"))
    for spec in (bench.REPO / "kernels").glob("*/kernel.json"):
        dest = tmp / spec.parent.name
        shutil.copytree(spec.parent, dest, ignore=shutil.ignore_patterns("__pycache__"))
        raw = json.loads(spec.read_text())
        raw.get("metadata", {}).get("kernel_broker", {}).pop("pool_size", None)
        (dest / "kernel.json").write_text(json.dumps(raw))
    return tmp


def cold(args, kernels):
    b = bench.Broker(args.binary, sandbox=args.sandbox, pool_size=0, tag="-lang-cold",
                     memory_limit=20 << 30)
    out = {}
    try:
        api = Api(b)
        for kernel in kernels:
            times, memory = [], []
            for _ in range(args.runs):
                took, sid = first_result(api, kernel)
                times.append(took)
                time.sleep(0.5)
                charge = leaf_of(b, sid)
                if charge:
                    memory.append(charge)
                api.call("DELETE", f"/v1/sessions/{sid}")
            out[kernel] = {"cold_ms_p50": ms(times, 0.5), "cold_ms_max": ms(times, 1.0),
                           "idle_mib": round(sorted(memory)[len(memory) // 2] / (1 << 20), 1) if memory else None}
    finally:
        b.stop()
    return out


def pooled(args, kernels):
    specs = kernels_without_pool_sizes()
    b = bench.Broker(args.binary, sandbox=args.sandbox, pool_size=1, tag="-lang-pool",
                     memory_limit=20 << 30, kernels_dir=specs,
                     extra_args=["--python", str(bench.REPO / "kernels/.venv/bin/python")])
    out = {}
    try:
        api = Api(b)
        for kernel in kernels:
            # The first create of a spec starts its pool; each measured one finds it full.
            _, sid = first_result(api, kernel)
            api.call("DELETE", f"/v1/sessions/{sid}")
            times, trips = [], []
            for _ in range(args.runs):
                time.sleep(args.refill)
                took, sid = first_result(api, kernel)
                times.append(took)
                api.call("DELETE", f"/v1/sessions/{sid}")
            time.sleep(args.refill)
            _, sid = first_result(api, kernel)
            code, want = ONE_PLUS_ONE[kernel]
            for _ in range(args.trips):
                trips.append(api.timed(sid, code))
            api.call("DELETE", f"/v1/sessions/{sid}")
            out[kernel] = {"pooled_ms_p50": ms(times, 0.5), "pooled_ms_max": ms(times, 1.0),
                           "round_trip_ms_p50": ms(trips, 0.5), "round_trip_ms_p90": ms(trips, 0.9)}
    finally:
        b.stop()
        shutil.rmtree(specs, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--trips", type=int, default=50)
    ap.add_argument("--refill", type=float, default=4.0, help="seconds for a pool to refill")
    ap.add_argument("--sandbox", default="local", choices=["local", "docker"])
    ap.add_argument("--only", default=",".join(ONE_PLUS_ONE))
    ap.add_argument("--binary", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--json")
    args = ap.parse_args()
    kernels = [k for k in args.only.split(",") if k]
    result = {k: {} for k in kernels}
    for measure in (cold, pooled):
        for k, v in measure(args, kernels).items():
            result[k].update(v)
        print(json.dumps(result), file=sys.stderr, flush=True)
    python = result.get("python3", {}).get("round_trip_ms_p50")
    if python:
        for v in result.values():
            if v.get("round_trip_ms_p50"):
                v["round_trip_vs_python"] = round(v["round_trip_ms_p50"] / python, 2)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
