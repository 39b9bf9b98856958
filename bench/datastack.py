"""Kernels born ready for data work (issue 12): the figures of BENCHMARKS.md, "Data stack",
with fork-server starts (the default) and without (`--fork-server false --preload none`).

    bench/.venv/bin/python bench/datastack.py [--runs 15] [--sessions 300] [--binary PATH]
        [--backend local|docker]

For each mode, through the agent API (REST), same client:
  - pooled session -> the data-stack import cell answered;
  - fresh session -> first matplotlib chart (plot + show of 100 points), and a second chart
    in the same session;
  - pool empty: session create -> first result (`1+1`);
  - private memory (USS) per idle kernel with the stack imported, and the template's;
  - `--sessions` live sessions over 4 users, each with pandas imported, running small cells
    concurrently: failures, p50/p99 and the total memory of the broker's cgroup.
Once per run: matplotlib's own cost of the chart outside any kernel (the chart's floor).
"""

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402

IMPORTS = "import pandas as pd, numpy as np\nimport matplotlib.pyplot as plt"
CHART = "import matplotlib.pyplot as plt\nplt.plot(range(100))\nplt.show()"


def p(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def timed(client, code):
    start = time.monotonic()
    r = client.execute(code)
    if r.status != "ok":
        raise RuntimeError(f"{code!r}: {r.status}")
    return time.monotonic() - start


def docker_leaves(broker):
    """(user, leaf) -> pids, from the memory cgroups of the broker's containers (a kernel's
    leaf and the template's are directories of its user's container cgroup); the first
    container's cgroup stands for the base."""
    ids = subprocess.run(["docker", "ps", "-q", "--no-trunc", "--filter",
                          f"label=org.kernel-broker.data-dir={broker.data_dir}"],
                         capture_output=True, text=True, check=True).stdout.split()
    out, bases = {}, []
    for cid in ids:
        user = subprocess.run(["docker", "inspect", "-f",
                               '{{index .Config.Labels "org.kernel-broker.user"}}', cid],
                              capture_output=True, text=True, check=True).stdout.strip()
        base = Path("/sys/fs/cgroup/memory/docker", cid)
        if not base.is_dir():
            base = Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope")
        bases.append(base)
        for leaf in base.iterdir():
            if leaf.is_dir() and leaf.name != "init":
                out[(user, leaf.name)] = [int(x) for x in (leaf / "cgroup.procs").read_text().split()]
    return bases, out


def leaves(broker):
    """(user, session dir) -> pids, from the broker's memory cgroup."""
    if broker.sandbox == "docker":
        return docker_leaves(broker)
    base = Path("/sys/fs/cgroup/memory", broker.cgroup_name)
    if not base.is_dir():
        base = Path("/sys/fs/cgroup", broker.cgroup_name)
    out = {}
    for user in base.iterdir():
        if not user.is_dir():
            continue
        for leaf in user.iterdir():
            if leaf.is_dir():
                pids = [int(x) for x in (leaf / "cgroup.procs").read_text().split()]
                out[(user.name, leaf.name)] = pids
    return base, out


def uss(pid):
    try:
        return psutil.Process(pid).memory_full_info().uss
    except psutil.Error:
        return 0


def cgroup_memory(base):
    if isinstance(base, list):  # docker: one cgroup per user's container
        return sum(cgroup_memory(b) for b in base)
    for name in ("memory.usage_in_bytes", "memory.current"):
        f = base / name
        if f.exists():
            return int(f.read_text())
    return 0


def pss(pid):
    try:
        return psutil.Process(pid).memory_full_info().pss
    except psutil.Error:
        return 0


def kernel_pid(pids):
    """The kernel among a leaf's processes: the largest (a plain Docker kernel's leaf also
    holds its tini, a plain local one bwrap's init)."""
    return max(pids, key=uss)


# The chart cell's own work as the inline backend does it (a figure, the plot, a tight PNG),
# in the kernels' Python outside any kernel, after three warm-up charts: what no broker can
# take off the chart figures above.
CHART_FLOOR = """
import statistics, time
import matplotlib
matplotlib.use("agg")
import matplotlib.pyplot as plt
from IPython.core.pylabtools import print_figure
def chart():
    start = time.perf_counter()
    fig = plt.figure()
    plt.plot(range(100))
    print_figure(fig, "png", bbox_inches="tight")
    plt.close(fig)
    return time.perf_counter() - start
for _ in range(3):
    chart()
print(statistics.median(chart() for _ in range(%d)) * 1000)
"""


def chart_floor(runs):
    out = subprocess.run([str(bench.KERNEL_PYTHON), "-c", CHART_FLOOR % runs],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def measure(binary, fork, runs, sessions, backend):
    mode = "fork server" if fork else "plain start"
    extra = [] if fork else ["--fork-server", "false", "--preload", "none"]
    res = {"mode": mode, "backend": backend}

    # Pooled sessions: the import cell, then the first chart on the same fresh session.
    b = bench.Broker(binary, sandbox=backend, pool_size=1, tag="-ds", extra_args=extra)
    try:
        s = b.create()  # starts the template (fork mode)
        b.client(s, "rest").execute("1")
        b.delete(s)
        imports, charts, seconds = [], [], []
        for _ in range(runs):
            b.wait_pool(1)
            s = b.create()
            c = b.client(s, "rest")
            imports.append(timed(c, IMPORTS))
            b.delete(s)
            b.wait_pool(1)
            s = b.create()
            c = b.client(s, "rest")
            charts.append(timed(c, CHART))
            seconds.append(timed(c, CHART))
            b.delete(s)
        res["pooled_import_p50_ms"] = p(imports, 0.5)
        res["fresh_first_chart_p50_ms"] = p(charts, 0.5)
        res["second_chart_p50_ms"] = p(seconds, 0.5)
    finally:
        b.stop()

    # Pool empty: create -> first result.
    b = bench.Broker(binary, sandbox=backend, pool_size=0, tag="-ds", extra_args=extra)
    try:
        s = b.create()
        b.client(s, "rest").execute("1")
        b.delete(s)
        firsts = []
        for _ in range(runs):
            start = time.monotonic()
            s = b.create()
            r = b.client(s, "rest").execute("1+1")
            assert r.status == "ok", r.status
            firsts.append(time.monotonic() - start)
            b.delete(s)
        res["create_to_first_result_p50_ms"] = p(firsts, 0.5)

        # Memory of idle kernels with the stack imported.
        ids = [b.create() for _ in range(10)]
        for s in ids:
            b.client(s, "rest").execute(IMPORTS)
        time.sleep(1)
        base, by_leaf = leaves(b)
        kernel_uss = [uss(kernel_pid(pids)) for (u, leaf), pids in by_leaf.items()
                      if any(leaf == s.id for s in ids) and pids]
        # The other leaves: each user's template (its sandbox's init and the template) and
        # its stem (one process forked ahead of need). A stem shares all of its template's
        # pages, so each one's USS leaves those out: their PSS sum is the pair's share.
        others = [pids for (u, leaf), pids in by_leaf.items()
                  if all(leaf != s.id for s in ids) and pids]
        template_uss = [sum(uss(x) for x in pids) for pids in others if len(pids) > 1]
        res["stems_uss_mb"] = [round(sum(uss(x) for x in pids) / 1e6, 1)
                               for pids in others if len(pids) == 1]
        res["templates_and_stems_pss_mb"] = round(
            sum(pss(x) for pids in others for x in pids) / 1e6, 1)
        res["kernel_uss_mb_median"] = statistics.median(kernel_uss) / 1e6
        res["kernel_rss_mb_median"] = statistics.median(
            psutil.Process(kernel_pid(by_leaf[(u, s.id)])).memory_info().rss
            for s in ids for u in [f"bench{s.user}"] if (u, s.id) in by_leaf) / 1e6
        res["templates_uss_mb"] = [round(x / 1e6, 1) for x in template_uss]
        for s in ids:
            b.delete(s)
    finally:
        b.stop()

    # Many live sessions with pandas imported, small cells concurrently.
    if sessions:
        # Each user's total must admit its share of the sessions at 200 MiB each.
        b = bench.Broker(binary, sandbox=backend, pool_size=0, tag="-ds",
                         extra_args=extra + ["--session-memory-limit", str(200 << 20),
                                             # one keep-alive connection per session
                                             "--max-connections", "4096",
                                             "--max-connections-per-client", "2048"])
        try:
            made = []
            start = time.monotonic()
            for i in range(sessions):
                made.append(b.create(user=i % bench.USERS))
            res["sessions_created_s"] = time.monotonic() - start
            clients = [b.client(s, "rest") for s in made]
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda c: c.execute("import pandas as pd"), clients))
            lat, failed = [], 0

            def cell(c):
                t = time.monotonic()
                r = c.execute("df = pd.DataFrame({'x': range(100)}); int(df.x.sum())")
                return r.status, time.monotonic() - t

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                for status, t in pool.map(cell, clients * 3):
                    if status != "ok":
                        failed += 1
                    lat.append(t)
            base, _ = leaves(b)
            res["many"] = {
                "sessions": sessions,
                "executions": len(lat),
                "failed": failed,
                "p50_ms": p(lat, 0.5),
                "p99_ms": p(lat, 0.99),
                "cgroup_memory_gb": cgroup_memory(base) / 1e9,
            }
        finally:
            b.stop()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--mode", choices=["both", "fork", "plain"], default="both")
    ap.add_argument("--backend", choices=["local", "docker"], default="local")
    a = ap.parse_args()
    out = [{"matplotlib_chart_floor_ms": chart_floor(max(a.runs, 9))}]
    print(json.dumps(out[0]), flush=True)
    try:
        for fork in {"both": (False, True), "fork": (True,), "plain": (False,)}[a.mode]:
            # Plain kernels hold ~125 MB each: 300 of them do not fit this machine.
            r = measure(a.binary, fork, a.runs, a.sessions if fork else min(a.sessions, 100),
                        a.backend)
            print(json.dumps(r), flush=True)
            out.append(r)
    finally:
        bench.run_cleanups()
    Path("bench-results").mkdir(exist_ok=True)
    suffix = "" if a.backend == "local" else f"-{a.backend}"
    Path(f"bench-results/datastack{suffix}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
