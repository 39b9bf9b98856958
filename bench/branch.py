"""Branching a live session (issue 36): the figures of BENCHMARKS.md, "Fork and checkpoints".

    bench/.venv/bin/python bench/branch.py [--runs 15] [--mb 200] [--binary PATH] [--own]
                                           [--sandbox local|docker]

One broker (the local sandbox unless `--sandbox docker`, release build, fork-server starts:
the default), one session
holding pandas and a DataFrame of `--mb` MB, driven through the agent API (REST):

  - fork -> first result: POST /v1/sessions/{id}/fork, then `1+1` in the fork, p50/p90;
  - the original's next `1+1` right after each fork, against its `1+1` before any fork
    (back to back) and against its `1+1` after the same pause without a fork (the pause
    alone slows a `1+1`: caches gone cold, the CPU clocked down);
  - the fork's private memory right after forking: its kernel's USS, and the memory its
    cgroup leaf is charged;
  - checkpoints, where the broker has them (POST /v1/sessions/{id}/checkpoints): take p50
    (back to back, and each after 200 ms idle),
    rewind -> next result p50 (back to back, and each after 200 ms idle: a second rewind to
    a checkpoint takes the kernel the first made for it meanwhile), and 100 checkpoints of a session that changes 1 MB a step
    (the memory the checkpoints hold in all), and `1+1` round trips with
    `checkpoint_every_execution` against without (back to back, and 200 ms apart).

With `--own` the session has a workspace of its own (`"workspace": "own"`, an E2B sandbox's
shape) and only the fork is measured: each fork is a copy of the kernel made with CRIU in a
sandbox of its own, with a copy of the workspace (`docs/CRIU.md`); the workspace holds a
`--own-files-mb` MB file besides. On Docker each copy is a container of its own.

Each figure is a wall-clock time seen by the client or a memory figure read from /proc and
the cgroup tree; nothing is taken from the broker's own reports. Run as root.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402

TIMEOUT = 120


def ms(values, q):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)


class Api:
    def __init__(self, broker):
        self.b = broker

    def call(self, method, path, body=None, want=(200, 201, 204)):
        r = requests.request(method, self.b.url + path, json=body, headers=self.b.h(0), timeout=TIMEOUT)
        if r.status_code not in want:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r.json() if r.content else None

    def run(self, sid, code):
        out = self.call("POST", f"/v1/sessions/{sid}/execute", {"code": code})
        if out["status"] != "ok":
            raise RuntimeError(f"{code!r}: {out}")
        return out

    def timed(self, sid, code):
        start = time.monotonic()
        self.run(sid, code)
        return time.monotonic() - start


def kernel_of(broker, sid):
    """The kernel process of session `sid`: the one whose cgroup leaf is named after it (a
    plain or restored kernel: the Python process of its leaf)."""
    for p in broker.kernel_procs():
        try:
            if sid in Path(f"/proc/{p.pid}/cgroup").read_text():
                return p.pid
        except OSError:
            continue
    for p in psutil.process_iter():
        try:
            if sid in Path(f"/proc/{p.pid}/cgroup").read_text():
                cmd = p.cmdline()
                if cmd and Path(cmd[0]).name.startswith("python"):
                    return p.pid
        except (OSError, psutil.Error):
            continue
    return None


def leaf_charged(pid):
    """Bytes charged to the memory cgroup of process `pid` (v1 or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "memory":
            f = Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.usage_in_bytes")
            return int(f.read_text())
        if controllers == "":
            f = Path("/sys/fs/cgroup", path.lstrip("/"), "memory.current")
            if f.exists():
                return int(f.read_text())
    return None


def measure_fork(api, broker, sid, runs):
    res = {}
    base = [api.timed(sid, "1+1") for _ in range(runs)]
    firsts, afters, idles, uss, charged = [], [], [], [], []
    for _ in range(runs):
        start = time.monotonic()
        made = api.call("POST", f"/v1/sessions/{sid}/fork", {})
        fork = made["sessions"][0]["id"]
        api.run(fork, "1+1")
        firsts.append(time.monotonic() - start)
        pid = kernel_of(broker, fork)
        if pid is not None:
            uss.append(psutil.Process(pid).memory_full_info().uss)
            charged.append(leaf_charged(pid) or 0)
        gap = time.monotonic() - start
        afters.append(api.timed(sid, "1+1"))
        api.call("DELETE", f"/v1/sessions/{fork}")
        # The same `1+1` after the same time without a fork: what the original's next
        # execution costs after that pause anyway (caches gone cold, the CPU clocked down).
        time.sleep(0.2)
        api.timed(sid, "1+1")
        time.sleep(gap)
        idles.append(api.timed(sid, "1+1"))
    res["fork_to_first_result_p50_ms"] = ms(firsts, 0.5)
    res["fork_to_first_result_p90_ms"] = ms(firsts, 0.9)
    res["original_1plus1_before_p50_ms"] = ms(base, 0.5)
    res["original_1plus1_after_fork_p50_ms"] = ms(afters, 0.5)
    res["original_1plus1_after_the_same_pause_without_a_fork_p50_ms"] = ms(idles, 0.5)
    if uss:
        res["fork_private_uss_mib_p50"] = round(statistics.median(uss) / 2**20, 1)
        res["fork_leaf_charged_mib_p50"] = round(statistics.median(charged) / 2**20, 1)
    return res


def measure_checkpoints(api, sid, runs, rows):
    r = requests.post(f"{api.b.url}/v1/sessions/{sid}/checkpoints", headers=api.b.h(0), timeout=TIMEOUT)
    if r.status_code == 404 and "checkpoint" not in r.text:
        return {"checkpoints": "not built"}
    if r.status_code != 201:
        return {"checkpoints": f"refused: {r.status_code} {r.text[:200]}"}
    first = r.json()["id"]
    res = {}
    takes, rewinds = [], []
    for _ in range(runs):
        start = time.monotonic()
        api.call("POST", f"/v1/sessions/{sid}/checkpoints")
        takes.append(time.monotonic() - start)
    # The same after a pause: a take back to back with the one before first waits for
    # that one's leaf move (a held checkpoint's, in the background otherwise).
    idle_takes = []
    for _ in range(runs):
        time.sleep(0.2)
        start = time.monotonic()
        api.call("POST", f"/v1/sessions/{sid}/checkpoints")
        idle_takes.append(time.monotonic() - start)
    for _ in range(runs):
        api.run(sid, "x_after = 1")
        start = time.monotonic()
        api.call("POST", f"/v1/sessions/{sid}/rewind", {"checkpoint": first})
        api.run(sid, "1+1")
        rewinds.append(time.monotonic() - start)
    # The same with 200 ms between the steps (an agent's pace, and time for the kernel a
    # rewind makes for the next rewind to the same checkpoint, where the sandbox makes one).
    idle_rewinds = []
    for _ in range(runs):
        api.run(sid, "x_after = 1")
        time.sleep(0.2)
        start = time.monotonic()
        api.call("POST", f"/v1/sessions/{sid}/rewind", {"checkpoint": first})
        api.run(sid, "1+1")
        idle_rewinds.append(time.monotonic() - start)
    # Every execution: `1+1` round trips in a session holding the same DataFrame that
    # takes a checkpoint after each, against the same in this session without; back to
    # back, and with 200 ms between them (an agent's pace: the checkpoint is taken
    # meanwhile, and what is left is the cost of the first writes after a fork).
    def paced(s):
        out = []
        for _ in range(runs):
            time.sleep(0.2)
            out.append(api.timed(s, "1+1"))
        return out
    plain = [api.timed(sid, "1+1") for _ in range(runs)]
    plain_paced = paced(sid)
    every = api.call("POST", "/v1/sessions", {"checkpoint_every_execution": True})["id"]
    api.run(every, f"import pandas as pd, numpy as np\ndf = pd.DataFrame(np.random.rand({rows}, 10))")
    each = [api.timed(every, "1+1") for _ in range(runs)]
    each_paced = paced(every)
    kept = len(api.call("GET", f"/v1/sessions/{every}/checkpoints").get("checkpoints", []))
    api.call("DELETE", f"/v1/sessions/{every}")
    res["roundtrip_1plus1_p50_ms"] = ms(plain, 0.5)
    res["roundtrip_1plus1_after_200ms_idle_p50_ms"] = ms(plain_paced, 0.5)
    res["roundtrip_1plus1_every_execution_p50_ms"] = ms(each, 0.5)
    res["roundtrip_1plus1_every_execution_after_200ms_idle_p50_ms"] = ms(each_paced, 0.5)
    res["every_execution_checkpoints_kept"] = kept
    res["checkpoint_take_p50_ms"] = ms(takes, 0.5)
    res["checkpoint_take_after_200ms_idle_p50_ms"] = ms(idle_takes, 0.5)
    res["rewind_to_next_result_p50_ms"] = ms(rewinds, 0.5)
    res["rewind_to_next_result_after_200ms_idle_p50_ms"] = ms(idle_rewinds, 0.5)
    listed = api.call("GET", f"/v1/sessions/{sid}/checkpoints")
    for cp in listed.get("checkpoints", []):
        api.call("DELETE", f"/v1/sessions/{sid}/checkpoints/{cp['id']}")
    return res


def measure_hundred(api, broker, sid):
    """100 checkpoints of a session that changes 1 MB a step: what they hold in all."""
    api.run(sid, "import numpy as np\nstep_buf = np.zeros((100, 1 << 17))")  # 100 x 1 MB
    listed = requests.get(f"{api.b.url}/v1/sessions/{sid}/checkpoints", headers=api.b.h(0), timeout=TIMEOUT)
    if listed.status_code != 200:
        return {}
    for i in range(100):
        api.run(sid, f"step_buf[{i}] += 1")
        api.call("POST", f"/v1/sessions/{sid}/checkpoints")
    listed = api.call("GET", f"/v1/sessions/{sid}/checkpoints")
    held = [cp.get("memory_bytes") or 0 for cp in listed.get("checkpoints", [])]
    # The hundred of this run (earlier ones of the session were deleted before it): the
    # first holds what the session held then (the DataFrame, charged to the leaf that
    # first touched it), so the cost of the hundred is what the other 99 hold.
    last = held[-100:]
    return {
        "hundred_checkpoints_kept": len(held),
        "hundred_checkpoints_reported_mib": round(sum(last) / 2**20, 1),
        "hundred_checkpoints_after_the_first_mib": round(sum(last[1:]) / 2**20, 1),
        "per_checkpoint_after_the_first_mib_p50": round(statistics.median(last[1:]) / 2**20, 2) if len(last) > 1 else None,
        "hundred_checkpoints_dropped": len(listed.get("dropped", [])),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--binary", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--own", action="store_true", help="a session with a workspace of its own: forks are copies")
    ap.add_argument("--own-files-mb", type=int, default=20)
    ap.add_argument("--sandbox", choices=["local", "docker"], default="local")
    args = ap.parse_args()
    # The forks' memory is admitted as a session's each: room for the DataFrame in each.
    # Room for the hundred checkpoints (the defaults keep 32 and 2 GiB): what they cost is
    # measured, not what the bounds let through.
    b = bench.Broker(args.binary, sandbox=args.sandbox, pool_size=0, tag="-branch", memory_limit=20 << 30,
                     extra_args=["--session-memory-limit", str(max(1 << 30, 3 * args.mb << 20)),
                                 "--max-checkpoints-per-user", "128",
                                 "--checkpoint-memory-per-user", str(8 << 30)])
    out = {"mb": args.mb, "runs": args.runs, "own_workspace": args.own, "sandbox": args.sandbox}
    try:
        api = Api(b)
        sid = api.call("POST", "/v1/sessions", {"workspace": "own"} if args.own else {})["id"]
        rows = args.mb * (1 << 20) // 80
        api.run(sid, f"import pandas as pd, numpy as np\ndf = pd.DataFrame(np.random.rand({rows}, 10))")
        out["original_leaf_charged_mib"] = round((leaf_charged(kernel_of(b, sid)) or 0) / 2**20, 1)
        if args.own:
            api.run(sid, f"import os\nopen('/home/user/data.bin', 'wb').write(os.urandom({args.own_files_mb << 20}))")
            out["own_files_mb"] = args.own_files_mb
            out.update(measure_fork(api, b, sid, args.runs))
        else:
            out.update(measure_fork(api, b, sid, args.runs))
            out.update(measure_checkpoints(api, sid, args.runs, rows))
            out.update(measure_hundred(api, b, sid))
    finally:
        b.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
