"""Checkpoints as held children, measured in the kernel alone (issue 36): what the design
BENCHMARKS.md names ("Branching through the broker") would cost, before it is built.

    protocol-tests/.venv/bin/python bench/held.py [--steps 100] [--mb 200]

A kernel started by the boot script (`kernels/tests/forkharness.py`) holds pandas, a
DataFrame of `--mb` MB and a 128 MB numpy buffer. Each step asks it for a *held* child
(`kb_fork_request {"hold": ...}`, what a CRIU copy starts from: single-threaded, its
sockets and pipes closed, waiting for a signal) and then changes 1 MB of the buffer. Printed:
the `1+1` round trip, the held fork's reply p50/p90, a step plus its held fork, and what the
held children cost once every step ran (`Private_Dirty` and page tables, from /proc). The
held children are killed at the end. No broker, no cgroup: the kernel's side only.
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "tests"))
from forkharness import Kernel, fork_request, run  # noqa: E402


def proc_kb(pid, name, key):
    with open("/proc/%d/%s" % (pid, name)) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="kb-held-")
    kernel = Kernel(directory)
    kc = kernel.client
    run(kc, "import numpy as np, pandas as pd\n"
            "df = pd.DataFrame(np.random.rand(%d * 1024 * 1024 // 80, 10))\n"
            "buf = np.zeros(max(128, %d) * 1024 * 1024 // 8)" % (args.mb, args.steps))
    trips = []
    for _ in range(20):
        start = time.perf_counter()
        run(kc, "1+1")
        trips.append(time.perf_counter() - start)
    replies, steps, pids = [], [], []
    try:
        for i in range(args.steps):
            start = time.perf_counter()
            reply = fork_request(kc, {"hold": {"connection_file": os.path.join(directory, "c%d.json" % i)}})
            replies.append(time.perf_counter() - start)
            assert reply["status"] == "ok", reply
            pids.append(reply["pid"])
            start = time.perf_counter()
            run(kc, "buf[%d:%d] += 1" % (i * 131072, (i + 1) * 131072))
            steps.append(time.perf_counter() - start + replies[-1])
        time.sleep(0.5)
        dirty = [proc_kb(p, "smaps_rollup", "Private_Dirty") for p in pids]
        tables = [proc_kb(p, "status", "VmPTE") for p in pids]
        ms = lambda xs, q: round(sorted(xs)[int(q * (len(xs) - 1))] * 1000, 2)  # noqa: E731
        print("kernel RSS: %.0f MiB" % (proc_kb(kernel.pid, "status", "VmRSS") / 1024))
        print("1+1 round trip, p50: %s ms" % ms(trips, 0.5))
        print("held fork reply, p50 / p90: %s / %s ms" % (ms(replies, 0.5), ms(replies, 0.9)))
        print("a step (1 MB changed) and its held fork, p50: %s ms" % ms(steps, 0.5))
        print("a held child's Private_Dirty after the step that followed it, p50: %.1f MiB"
              % (statistics.median(dirty[:-1] or dirty) / 1024))
        print("a held child's page tables, p50: %.2f MiB" % (statistics.median(tables) / 1024))
        print("%d held children: Private_Dirty + page tables: %.0f MiB"
              % (len(pids), (sum(dirty) + sum(tables)) / 1024))
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        kernel.stop()


if __name__ == "__main__":
    main()
