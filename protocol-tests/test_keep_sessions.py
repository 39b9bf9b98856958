"""`--keep-sessions` with real clients: a notebook in a real `jupyter server
--gateway-url=<broker>` keeps its kernel, variables and execution count while the broker is
restarted under it (SIGTERM and kill -9), and the documented upgrade procedure
(bench/upgrade.py, old and new binary on one data directory) keeps every session.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import ALICE, REPO, restartable_port
from test_gateway import JupyterServer, clients, start_through_gateway  # noqa: F401 (fixture)


def run_until_answered(c, code, timeout=60):
    """Runs `code` on `c`, again while jupyter server is still reconnecting to the broker
    (a message sent while its upstream WebSocket is down is lost, as with any gateway)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            return c.run(code, timeout=5)
        except (AssertionError, TimeoutError) as e:
            last = e
            time.sleep(0.5)
    raise AssertionError(f"no answer to {code!r} within {timeout} s: {last}")


def test_a_notebook_keeps_its_kernel_across_broker_restarts(fresh_broker, clients):
    port = restartable_port()
    first = fresh_broker(["--keep-sessions"], listen=f"127.0.0.1:{port}")
    data = first.data_dir
    js = JupyterServer(first.url, ALICE)
    try:
        kid = start_through_gateway(js)["id"]
        c = clients(js.ws(kid))
        ex = c.run("x = 41")
        assert ex.reply["content"]["status"] == "ok"
        count = ex.reply["content"]["execution_count"]

        # An orderly stop and a new process on the same data directory and port: the open
        # notebook connection carries on (jupyter server reconnects to the gateway).
        first.terminate()
        second = fresh_broker(["--keep-sessions"], listen=f"127.0.0.1:{port}", data_dir=data)
        ex = run_until_answered(c, "x + 1")
        assert ex.result == "42", ex.reply
        assert ex.reply["content"]["execution_count"] == count + 1
        assert kid in [k["id"] for k in js.api("GET", "/api/kernels").json()], js.log()
        events = second.api("GET", f"/v1/sessions/{kid}/events?channel=broker").json()["events"]
        kinds = [e["kind"] for e in events]
        assert "session_kept" in kinds and "broker_restarted" in kinds, kinds

        # kill -9: no stop at all. A new connection (a reloaded JupyterLab tab) finds the
        # kernel and its state too.
        time.sleep(2.5)  # the records' journal interval
        second.kill9()
        third = fresh_broker(["--keep-sessions"], listen=f"127.0.0.1:{port}", data_dir=data)
        c2 = clients(js.ws(kid))
        ex = run_until_answered(c2, "x + 2")
        assert ex.result == "43", ex.reply
        assert ex.reply["content"]["execution_count"] == count + 2
    finally:
        js.stop()
    third.terminate()
    # A start without the flag ends the kept kernel: nothing is left behind.
    last = fresh_broker([], data_dir=data)
    assert last.api("GET", f"/api/kernels/{kid}").status_code == 404


def test_the_upgrade_procedure_keeps_every_session():
    binary = Path(REPO / "target/debug/kernel-broker")
    out = subprocess.run(
        [sys.executable, str(REPO / "bench/upgrade.py"), "--old-bin", str(binary), "--sessions", "3"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    figures = json.loads(out.stdout)
    assert figures["failed_checks"] == []
    assert figures["in_flight_answer"]["ename"] == "BrokerRestarted"
    assert figures["gap_seconds"] > 0
