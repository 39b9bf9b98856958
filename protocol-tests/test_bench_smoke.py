"""Smoke test of the benchmark suite (bench/bench.py --quick): every system starts, every
measurement runs and lands in the JSON with sane values. No timing thresholds: this checks
that the benchmark works, not how fast anything is.

bench/setup creates bench/.venv (Kernel Gateway and the clients, pinned in
bench/requirements.txt) if it is missing. The broker is target/debug/kernel-broker (what
scripts/test builds), or KERNEL_BROKER_BIN.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

BENCH_PY = REPO / "bench/.venv/bin/python"


def positive(x):
    return isinstance(x, (int, float)) and x > 0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    subprocess.run([str(REPO / "bench/setup")], check=True, timeout=1200)
    binary = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))
    assert os.path.exists(binary), f"{binary} is missing: cargo build first (scripts/test does)"
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run(
        [str(BENCH_PY), str(REPO / "bench/bench.py"), "--quick", "--json", str(out), "--broker-bin", binary],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )
    sys.stderr.write(proc.stderr[-20000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "| measure |" in proc.stdout  # the table
    return json.loads(out.read_text())


def systems(results):
    s = results["systems"]
    want = ["floor", "local", "kg"]
    if "skipped" not in s.get("docker", {"skipped": "absent"}):
        want.append("docker")
    return [(name, s[name]) for name in want]


@pytest.mark.timeout(1800)
def test_every_system_ran(results):
    s = results["systems"]
    for name in ("floor", "local", "docker", "kg"):
        assert name in s, name
        assert "error" not in s[name], (name, s[name].get("error"))
    assert results["config"]["quick"] is True
    assert results["table_markdown"].startswith("| measure |")


@pytest.mark.timeout(1800)
def test_latency_sections(results):
    for name, r in systems(results):
        paths = {"floor": ["jupyter_client"], "kg": ["jupyter_ws"]}.get(name, ["agent_ws", "jupyter_ws", "rest"])
        cold = ["jupyter_client"] if name == "floor" else ["jupyter_ws"] if name == "kg" else ["rest", "jupyter_ws"]
        for p in cold:
            c = r["cold_start"][p]
            assert c["n"] >= 1 and positive(c["p50_ms"]) and c["p99_ms"] >= c["p50_ms"], (name, p, c)
        for p in paths:
            rt = r["roundtrip_1p1"][p]
            assert rt["n"] >= 10 and positive(rt["p50_ms"]) and rt["p99_ms"] >= rt["p50_ms"], (name, p, rt)
        if name in ("local", "docker"):
            assert positive(r["first_session_of_user_ms"])
            for p in ("rest", "agent_ws", "jupyter_ws"):
                ps = r["pooled_start"][p]
                assert ps["n"] >= 1 and positive(ps["p50_ms"]), (name, p, ps)


@pytest.mark.timeout(1800)
def test_bulk_output_sections(results):
    lines = results["config"]["stream_bytes"]
    for name, r in systems(results):
        paths = {"floor": ["jupyter_client"], "kg": ["jupyter_ws"]}.get(name, ["agent_ws", "jupyter_ws", "rest"])
        for p in paths:
            st = r["stream_100k_lines"][p]
            assert positive(st["time_to_done_ms"]) and positive(st["mb_per_s"]), (name, p, st)
            if p in ("agent_ws", "rest"):
                # the broker's agent API cuts stdout at --output-limit (10,000 characters)
                assert 0 < st["stdout_bytes_received"] <= 10_000, (name, p, st)
            else:
                assert st["stdout_bytes_received"] == lines, (name, p, st)
            png = r["png_2mb"][p]
            assert 1_500_000 < png["bytes_produced"] < 3_000_000, (name, p, png)
            assert positive(png["time_to_done_ms"]) and positive(png["mb_per_s"]), (name, p, png)
            assert png["display_bytes_received"] >= png["bytes_produced"], (name, p, png)


@pytest.mark.timeout(1800)
def test_concurrency_and_memory_sections(results):
    levels = [str(n) for n in results["config"]["concurrency_levels"]]
    assert levels == ["3"]
    for name, r in systems(results):
        for n in levels:
            runs = r["concurrency"][n]
            assert runs, name
            for p, run in runs.items():
                assert run["sessions"] == int(n), (name, p, run)
                assert positive(run["executes_per_s"]) and positive(run["executes_ok"]), (name, p, run)
                assert run["failures"] == 0, (name, p, run)
            mem = r["memory"][n]
            assert mem["kernel_processes"] >= int(n), (name, mem)
            assert positive(mem["kernel_rss_per_kernel_kib"]) and positive(mem["kernel_uss_per_kernel_kib"]), (name, mem)
            if name != "floor":
                assert positive(mem["server_rss_kib_0"]) and positive(mem["server_rss_kib_n"]), (name, mem)
                assert isinstance(mem["server_rss_per_session_kib"], (int, float)), (name, mem)


def run_bench(tmp_path, script, *args, timeout):
    """Runs bench `script` (a path under the repository) with `args` against the broker
    under test; returns the JSON it wrote."""
    subprocess.run([str(REPO / "bench/setup")], check=True, timeout=1200)
    binary = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))
    out = tmp_path / (Path(script).stem + ".json")
    proc = subprocess.run(
        [str(BENCH_PY), str(REPO / script), *args, "--binary", binary, "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
def test_the_languages_benchmark_runs(tmp_path):
    """bench/languages.py, bounded (two light kernels, one run each): every figure lands."""
    got = run_bench(tmp_path, "bench/languages.py", "--runs", "1", "--trips", "3",
                    "--refill", "2", "--only", "python3,bash,sql", timeout=800)
    for kernel in ("python3", "bash", "sql"):
        row = got[kernel]
        for key in ("cold_ms_p50", "pooled_ms_p50", "round_trip_ms_p50", "idle_mib"):
            assert positive(row[key]), (kernel, key, row)
    assert got["python3"]["round_trip_vs_python"] == 1.0


@pytest.mark.timeout(600)
def test_the_masking_benchmark_runs(tmp_path):
    """bench/masking.py, bounded (a few trips, one create each): every figure lands."""
    got = run_bench(tmp_path, "bench/masking.py", "--trips", "10", "--runs", "1", "--refill", "2",
                    timeout=500)
    for side in ("baseline", "masking"):
        for code in ("one_plus_one", "print_10kb", "leak"):
            assert positive(got[side][code]["p50_ms"]), (side, code, got)
    for create in ("create_pooled", "create_with_secrets"):
        assert positive(got["masking"][create]["p50_ms"]), got
    assert isinstance(got["one_plus_one_cost_pct"], float)


@pytest.mark.timeout(600)
def test_the_branch_benchmark_runs(tmp_path):
    """bench/branch.py, bounded (a 20 MB DataFrame, two runs each): every figure lands, the
    hundred checkpoints are all kept, and every execution of the every-execution session
    got its checkpoint."""
    got = run_bench(tmp_path, "bench/branch.py", "--runs", "2", "--mb", "20", timeout=500)
    for key in ("fork_to_first_result_p50_ms", "original_1plus1_after_fork_p50_ms",
                "fork_private_uss_mib_p50", "checkpoint_take_p50_ms",
                "checkpoint_take_after_200ms_idle_p50_ms", "rewind_to_next_result_p50_ms",
                "rewind_to_next_result_after_200ms_idle_p50_ms", "roundtrip_1plus1_p50_ms",
                "roundtrip_1plus1_every_execution_p50_ms",
                "roundtrip_1plus1_every_execution_after_200ms_idle_p50_ms",
                "hundred_checkpoints_after_the_first_mib"):
        assert positive(got[key]), (key, got)
    assert got["hundred_checkpoints_kept"] >= 100, got
    # The DataFrame's cell and four `1+1`s.
    assert got["every_execution_checkpoints_kept"] == 5, got
