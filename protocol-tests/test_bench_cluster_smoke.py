"""Smoke test of the cluster benchmark (bench/cluster.py --smoke, issue 16): one node with
SQLite, one with PostgreSQL and three nodes on one database each run a few seconds of
create and execute load, with no failure, and land in the JSON with sane values. No timing
thresholds: this checks that the benchmark works, not how fast anything is.

PostgreSQL: the run's server (`KB_TEST_POSTGRES_URL`), else the benchmark starts its own.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

BENCH_PY = REPO / "bench/.venv/bin/python"


@pytest.mark.timeout(900)
def test_cluster_benchmark_smoke(tmp_path):
    subprocess.run([str(REPO / "bench/setup")], check=True, timeout=1200)
    binary = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))
    assert os.path.exists(binary), f"{binary} is missing: cargo build first (scripts/test does)"
    out = tmp_path / "cluster.json"
    proc = subprocess.run(
        [str(BENCH_PY), str(REPO / "bench/cluster.py"), "--smoke", "--json", str(out),
         "--broker-bin", binary],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    sys.stderr.write(proc.stderr[-20000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert results["failures"] == 0, results["failures"]
    assert set(results["summary"]) == {"single", "single-pg", "cluster3"}, list(results["summary"])
    for name, r in results["summary"].items():
        assert r["create"]["failures"] == 0 and r["execute"]["failures"] == 0, (name, r)
        assert r["create"]["sessions_per_s"] > 0, (name, r["create"])
        assert r["execute"]["executes_per_s"] > 0, (name, r["execute"])
    placed = results["summary"]["cluster3"]["execute"]["placed_per_node"]
    assert len(placed) == 3, placed
    assert results["summary"]["cluster3"]["execute"]["forwarded_share"] > 0
