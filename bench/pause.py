"""Pausing sessions to disk and resuming them (issue 37): the figures of BENCHMARKS.md,
"Pause and resume".

    bench/.venv/bin/python bench/pause.py [--runs 15] [--mb 200] [--binary PATH] [--workspace own|shared]
                                          [--sandbox local|docker] [--idle SECONDS]
    bench/.venv/bin/python bench/pause.py --sessions 1000 [--active 100] [--rounds 3]

One broker (the local sandbox unless `--sandbox docker`, release build, run as root with
CRIU 4; on Docker a paused session's container goes and its resume makes one), sessions with a
workspace of their own (`--workspace shared`: sharing their user's, as REST's default
sessions and Jupyter kernels do), driven through the agent API (REST):

  - a session holding pandas and a DataFrame of `--mb` MB: pause p50/p90 (POST .../pause,
    its answer), and per GiB of the kernel's memory (its cgroup leaf's charge before the
    pause); resume -> first result p50/p90 (`1+1` sent to the paused session: the execution
    resumes it); the images' size on disk;
  - a bare data-stack session (pandas imported, no data): resume -> first result p50.

`--idle S` waits S seconds between each pause and the resume after it (a paused session is
used again later, not at once; on Docker the paused container's removal, about a second of
the engine's, runs after the pause's answer and a resume waits for it).

With `--sessions N` (density): N sessions are made, each importing pandas and holding a
small DataFrame, with `--pause-after 2`, so the broker pauses each once it is idle; then
`--rounds` rounds, each driving `--active` sessions chosen at random (each reads its
DataFrame's sum: a resume when it was paused). Reported: the time to make them, the p50/p99
of those executions, failures, the host's memory in use (MemTotal - MemAvailable) and the
paused images' bytes on disk.

Each figure is a wall-clock time seen by the client or read from /proc, the cgroup tree
or the data directory; nothing is taken from the broker's own reports.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402
from branch import Api, kernel_of, leaf_charged, ms  # noqa: E402


# The sessions' workspace (`--workspace`).
WORKSPACE = "own"


def meminfo_used():
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        fields[k] = int(v.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def paused_bytes(broker):
    total = 0
    for root, _, files in os.walk(Path(broker.data_dir) / ("paused-docker" if broker.sandbox == "docker" else "paused")):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total


# Seconds between a pause and its resume (`--idle`).
IDLE = 0.0


def measure_one(api, broker, mb, runs):
    sid = api.call("POST", "/v1/sessions", {"workspace": WORKSPACE})["id"]
    rows = mb * (1 << 20) // 80
    api.run(sid, f"import pandas as pd, numpy as np\ndf = pd.DataFrame(np.random.rand({rows}, 10))")
    pauses, per_gib, resumes, images = [], [], [], []
    # The first kernel's leaf is named after the session (a resumed one's after its own new
    # id): its charge before the first pause stands for the kernel's memory in every run.
    charged = leaf_charged(kernel_of(broker, sid)) or 0
    for _ in range(runs):
        start = time.monotonic()
        paused = api.call("POST", f"/v1/sessions/{sid}/pause")
        took = time.monotonic() - start
        pauses.append(took)
        if charged:
            per_gib.append(took / (charged / 2**30))
        images.append(paused["image_bytes"])
        time.sleep(IDLE)
        start = time.monotonic()
        api.run(sid, "1+1")
        resumes.append(time.monotonic() - start)
    out = api.run(sid, "float(df.iloc[0, 0]) >= 0")
    assert out["results"][-1]["data"]["text/plain"] == "True", out
    api.call("DELETE", f"/v1/sessions/{sid}")
    return {
        "kernel_leaf_charged_mib": round(charged / 2**20, 1),
        "pause_p50_ms": ms(pauses, 0.5),
        "pause_p90_ms": ms(pauses, 0.9),
        "pause_per_gib_p50_s": round(sorted(per_gib)[len(per_gib) // 2], 3) if per_gib else None,
        "resume_to_first_result_p50_ms": ms(resumes, 0.5),
        "resume_to_first_result_p90_ms": ms(resumes, 0.9),
        "image_mib_p50": round(sorted(images)[len(images) // 2] / 2**20, 1),
    }


def measure_bare(api, runs):
    sid = api.call("POST", "/v1/sessions", {"workspace": WORKSPACE})["id"]
    api.run(sid, "import pandas as pd, numpy as np")
    resumes, images = [], []
    for _ in range(runs):
        images.append(api.call("POST", f"/v1/sessions/{sid}/pause")["image_bytes"])
        time.sleep(IDLE)
        start = time.monotonic()
        api.run(sid, "1+1")
        resumes.append(time.monotonic() - start)
    api.call("DELETE", f"/v1/sessions/{sid}")
    return {
        "bare_resume_to_first_result_p50_ms": ms(resumes, 0.5),
        "bare_resume_to_first_result_p90_ms": ms(resumes, 0.9),
        "bare_image_mib_p50": round(sorted(images)[len(images) // 2] / 2**20, 1),
    }


def density(api, broker, n, active, rounds):
    made, failures, lat = [], 0, []
    before = meminfo_used()
    start = time.monotonic()
    for i in range(n):
        try:
            sid = api.call("POST", "/v1/sessions", {"workspace": WORKSPACE})["id"]
            api.run(sid, f"import pandas as pd\ndf = pd.DataFrame({{'v': range({i}, {i} + 1000)}})")
            made.append((sid, i))
        except Exception as e:  # counted, and said
            failures += 1
            print(f"session {i}: {e}", file=sys.stderr)
        if i % 50 == 49:
            print(f"{i + 1} made, {time.monotonic() - start:.0f} s, host memory in use "
                  f"{meminfo_used() / 2**30:.1f} GiB", file=sys.stderr)
    create_s = time.monotonic() - start
    time.sleep(5)
    used_all_paused = meminfo_used()
    for _ in range(rounds):
        for sid, i in random.sample(made, min(active, len(made))):
            t = time.monotonic()
            try:
                out = api.run(sid, "int(df['v'].sum())")
                want = sum(range(i, i + 1000))
                if out["results"][-1]["data"]["text/plain"] != str(want):
                    raise RuntimeError(f"wrong state: {out['results']}")
                lat.append(time.monotonic() - t)
            except Exception as e:
                failures += 1
                print(f"session {sid}: {e}", file=sys.stderr)
    states = {}
    for s in api.call("GET", "/v1/sessions"):
        states[s["state"]] = states.get(s["state"], 0) + 1
    return {
        "sessions": n,
        "made": len(made),
        "create_all_s": round(create_s, 1),
        "active_per_round": active,
        "rounds": rounds,
        "execute_p50_ms": ms(lat, 0.5) if lat else None,
        "execute_p99_ms": ms(lat, 0.99) if lat else None,
        "failures": failures,
        "states_at_end": states,
        "host_memory_in_use_before_gib": round(before / 2**30, 2),
        "host_memory_in_use_all_paused_gib": round(used_all_paused / 2**30, 2),
        "paused_images_gib": round(paused_bytes(broker) / 2**30, 2),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=0, help="density: this many sessions")
    ap.add_argument("--active", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--binary", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--workspace", choices=["own", "shared"], default="own")
    ap.add_argument("--sandbox", choices=["local", "docker"], default="local")
    ap.add_argument("--idle", type=float, default=0.0, help="seconds between a pause and its resume")
    args = ap.parse_args()
    extra = ["--session-memory-limit", str(max(1 << 30, 3 * args.mb << 20))]
    if args.sessions:
        extra = ["--pause-after", "2", "--session-memory-limit", str(256 << 20)]
    b = bench.Broker(args.binary, sandbox=args.sandbox, pool_size=0, tag="-pause", memory_limit=20 << 30, extra_args=extra,
                     max_sessions=max(200, args.sessions + 10))
    global WORKSPACE, IDLE
    WORKSPACE, IDLE = args.workspace, args.idle
    out = {"mb": args.mb, "runs": args.runs, "workspace": args.workspace, "sandbox": args.sandbox,
           "idle_s": args.idle}
    try:
        api = Api(b)
        if args.sessions:
            out = density(api, b, args.sessions, args.active, args.rounds)
        else:
            out.update(measure_one(api, b, args.mb, args.runs))
            out.update(measure_bare(api, args.runs))
    finally:
        b.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
