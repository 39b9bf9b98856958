"""Smoke run of the soak (bench/soak.py --cycles 20): sessions created, executed on (ok,
error, timeout, interrupt, agent stream), killed (os._exit, SIGKILL from outside, out of
memory) and deleted by two workers, with two broker restarts (--keep-sessions: SIGTERM, then
SIGKILL) in the middle that long-lived sessions must survive; then nothing may have leaked (kernel processes, cgroup
processes and directories, runtime directories, broker descriptors, threads, memory) and
every answered execution must be in its recording. The full run (thousands of cycles) is
`bench/soak`, outside CI; its figures are in BENCHMARKS.md.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

BENCH_PY = REPO / "bench/.venv/bin/python"


@pytest.mark.timeout(900)
def test_soak_smoke(tmp_path):
    subprocess.run([str(REPO / "bench/setup")], check=True, timeout=1200)
    binary = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))
    assert os.path.exists(binary), f"{binary} is missing: cargo build first (scripts/test does)"
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [str(BENCH_PY), str(REPO / "bench/soak.py"), "--cycles", "20", "--workers", "2", "--restarts", "2",
         "--broker-bin", binary, "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=840,
    )
    sys.stderr.write(proc.stderr[-10000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    figures = json.loads(out.read_text())
    assert figures["leaks"] == {}
    assert figures["wrong_outcomes"] == [] and figures["errors"] == []
    assert figures["recordings_missing"] == []
    assert figures["restart_failures"] == []
    assert figures["restarts"]["sigterm"] == 1 and figures["restarts"]["sigkill"] == 1
    assert figures["restarts"]["in_flight"] == {"sigterm:BrokerRestarted": 1, "sigkill:connection_error": 1}
    assert figures["restarts"]["state_kept"] == 2 * 4  # every long-lived session, both times
    # Every kind of step ran at least once in 20 cycles (seeded), deaths included.
    assert figures["executions_answered"] >= 20
    assert {"ok", "delete"} <= set(figures["outcomes"])
    assert figures["outcomes"]["delete"].get("http_204", 0) == figures["sessions"]
