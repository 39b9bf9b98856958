"""The `1+1` round trip of a kernel forked from a template (the default) against the floor,
interleaved: issue 12's goal "the round trip stays <= 1.05x the direct jupyter_client floor".

    bench/.venv/bin/python bench/roundtrip.py [--rounds 7] [--samples 200] [--paths agent_ws,rest]

Single-session round trips move by tens of percent between runs on this shared machine
(BENCHMARKS.md), so the floor (jupyter_client against a bare ipykernel) and the broker's
forked kernel (release build, local sandbox, fork server and preload at their defaults) are
measured in alternating rounds of `--samples` round trips, same client process, and the
ratio is taken per round: the median of those ratios is the figure. A broker kernel started
plainly (`--fork-server false --preload none`, agent WebSocket) is measured in the same
rounds, to tell what the fork server changes from what the broker's hop costs.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--paths", default="agent_ws,rest")
    a = ap.parse_args()
    paths = a.paths.split(",")
    out = {"rounds": a.rounds, "samples": a.samples, "floor_p50_ms": [], "broker_p50_ms": {}}
    try:
        floor = bench.Floor()
        broker = bench.Broker(a.binary, sandbox="local", pool_size=0, tag="-rt")
        plain = bench.Broker(a.binary, sandbox="local", pool_size=0, tag="-rtp",
                             extra_args=["--fork-server", "false", "--preload", "none"])
        fs = floor.create()
        bs = broker.create()
        ps = plain.create()
        fc = floor.client(fs, "jupyter_client")
        bcs = {p: broker.client(bs, p) for p in paths}
        pc = plain.client(ps, "agent_ws")
        for c in [fc, pc, *bcs.values()]:
            c.connect()
        # Forked from the template: its parent is the template, not the sandbox's init (1).
        reply = requests.post(f"{broker.url}/v1/sessions/{bs.id}/execute", headers=broker.h(0),
                              json={"code": "import os; print(os.getppid())"}, timeout=60).json()
        out["broker_kernel_forked"] = reply["stdout"].strip() != "1"
        for p in paths:
            out["broker_p50_ms"][p] = []
        out["plain_agent_ws_p50_ms"] = []
        for r in range(a.rounds):
            out["floor_p50_ms"].append(bench.bench_roundtrip(fc, a.samples)["p50_ms"])
            for p in paths:
                out["broker_p50_ms"][p].append(bench.bench_roundtrip(bcs[p], a.samples)["p50_ms"])
            out["plain_agent_ws_p50_ms"].append(bench.bench_roundtrip(pc, a.samples)["p50_ms"])
            bench.log(f"round {r + 1}: floor {out['floor_p50_ms'][-1]} ms, " + ", ".join(
                f"{p} {out['broker_p50_ms'][p][-1]} ms" for p in paths)
                + f", plain agent_ws {out['plain_agent_ws_p50_ms'][-1]} ms")

        def ratio(xs, ys):
            return round(statistics.median(x / y for x, y in zip(xs, ys)), 3)

        out["ratio_median"] = {p: ratio(out["broker_p50_ms"][p], out["floor_p50_ms"])
                               for p in paths}
        out["plain_agent_ws_ratio_median"] = ratio(out["plain_agent_ws_p50_ms"],
                                                   out["floor_p50_ms"])
        if "agent_ws" in paths:
            out["forked_over_plain_agent_ws"] = ratio(out["broker_p50_ms"]["agent_ws"],
                                                      out["plain_agent_ws_p50_ms"])
    finally:
        bench.run_cleanups()
    print(json.dumps(out))
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/roundtrip.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
