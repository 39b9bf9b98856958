"""The upgrade procedure of kernel-broker with --keep-sessions, run and measured.

    bench/upgrade --sessions 10                       old = new = target/release/kernel-broker
    bench/upgrade --old-bin OLD --new-bin NEW         a real upgrade between two builds

1. The old binary serves with --keep-sessions on a fixed port; N sessions each get state
   (`x = i`, a file in the workspace), and one more runs a 3 s cell when the stop comes.
2. A client executes `x` on session 0 in a loop (a real kernel round trip each time).
3. SIGTERM to the old process; as soon as it has exited, the new binary starts on the same
   data directory and port (the procedure the README documents).
4. Measured: the gap between the last answer of the old process and the first of the new,
   how long the stop and the start took; checked: every session is back with its variables,
   file and execution count, the running cell was answered "BrokerRestarted" and the kernel
   finished it.

Prints the figures as JSON; exits 1 if any check fails. Run as root (the local sandbox).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
TOKEN = "upgrade-" + uuid.uuid4().hex


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One broker process on `port` and `data_dir`."""

    def __init__(self, binary, port, data_dir, users, cgroup, sandbox):
        env = dict(os.environ, KERNEL_BROKER_LOG="info")
        env.pop("KERNEL_BROKER_TOKEN", None)
        self.log = []
        self.spawned = time.monotonic()
        self.proc = subprocess.Popen(
            [str(binary), "serve", "--keep-sessions", "--listen", f"127.0.0.1:{port}",
             "--users-file", str(users), "--data-dir", str(data_dir),
             "--kernels-dir", str(REPO / "kernels"), "--cgroup-name", cgroup,
             "--sandbox", sandbox, "--pool-size", "0"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                if "ready on http://" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(120) or self.proc.poll() is not None:
            raise RuntimeError("the broker did not start:\n" + "".join(self.log[-30:]))
        self.ready_after = time.monotonic() - self.spawned

    def stop(self, sig=signal.SIGTERM):
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(120)
        return time.monotonic() - started


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-bin", default=str(REPO / "target/release/kernel-broker"))
    ap.add_argument("--new-bin", help="default: a copy of --old-bin (same code, a new file)")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--sandbox", default="local", choices=["local", "docker"])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kb-upgrade-"))
    new_bin = args.new_bin
    if new_bin is None:
        new_bin = tmp / "kernel-broker.new"
        shutil.copy2(args.old_bin, new_bin)
    users = tmp / "users.toml"
    users.write_text(f'[[user]]\nname = "alice"\ntoken = "{TOKEN}"\nmax_sessions = {args.sessions + 2}\n'
                     f'memory_bytes = {(args.sessions + 2) * (256 << 20)}\n')
    port, data_dir = free_port(), tmp / "data"
    cgroup = f"kernel-broker-upgrade-{uuid.uuid4().hex[:10]}"
    url = f"http://127.0.0.1:{port}"
    h = {"Authorization": f"Bearer {TOKEN}"}
    checks, figures = [], {"sessions": args.sessions, "sandbox": args.sandbox}
    run = Run(args.old_bin, port, data_dir, users, cgroup, args.sandbox)
    try:
        ids = []
        for i in range(args.sessions):
            s = requests.post(f"{url}/v1/sessions", json={}, headers=h, timeout=60).json()
            ids.append(s["id"])
            r = requests.post(f"{url}/v1/sessions/{s['id']}/execute", headers=h, timeout=60,
                              json={"code": f"x = {i}\nopen('state-{i}.txt', 'w').write('session {i}')"}).json()
            assert r["status"] == "ok", r
        busy = requests.post(f"{url}/v1/sessions", json={}, headers=h, timeout=60).json()["id"]

        answers, stop_polling = [], threading.Event()

        def poll():
            while not stop_polling.is_set():
                try:
                    r = requests.post(f"{url}/v1/sessions/{ids[0]}/execute", headers=h, timeout=10,
                                      json={"code": "x"})
                    if r.status_code == 200 and r.json().get("status") == "ok":
                        answers.append(time.monotonic())
                except requests.RequestException:
                    pass
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        in_flight = {}

        def run_busy():
            r = requests.post(f"{url}/v1/sessions/{busy}/execute", headers=h, timeout=60,
                              json={"code": "import time\ntime.sleep(3)\ndone = 1"})
            in_flight["answer"] = r.json()

        t = threading.Thread(target=run_busy)
        t.start()
        time.sleep(1.0)

        # The procedure: SIGTERM the old process, start the new one as soon as it is gone.
        signalled = time.monotonic()
        figures["old_stop_seconds"] = round(run.stop(), 3)
        run = Run(new_bin, port, data_dir, users, cgroup, args.sandbox)
        figures["new_start_seconds"] = round(run.ready_after, 3)
        t.join(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(a > signalled + figures["old_stop_seconds"] for a in answers):
            time.sleep(0.05)
        time.sleep(0.5)
        stop_polling.set()
        poller.join()

        before = [a for a in answers if a <= signalled]
        after = [a for a in answers if a > signalled]
        # The old process may still answer between the signal and its exit.
        last_old = max([a for a in answers if a <= signalled + figures["old_stop_seconds"]], default=None)
        first_new = min([a for a in answers if a > signalled + figures["old_stop_seconds"]], default=None)
        figures["answers_before"] = len(before)
        figures["answers_after"] = len(after)
        if last_old is None or first_new is None:
            checks.append("no answers on one side of the restart")
        else:
            figures["gap_seconds"] = round(first_new - last_old, 3)

        ans = in_flight.get("answer", {})
        figures["in_flight_answer"] = {"status": ans.get("status"), "ename": (ans.get("error") or {}).get("ename")}
        if (ans.get("error") or {}).get("ename") != "BrokerRestarted":
            checks.append(f"the running cell was answered {ans}")
        r = requests.post(f"{url}/v1/sessions/{busy}/execute", headers=h, timeout=60,
                          json={"code": "done", "timeout_seconds": 30}).json()
        if r.get("results", [{}])[0].get("data", {}).get("text/plain") != "1":
            checks.append(f"the kernel did not finish the running cell: {r}")

        for i, sid in enumerate(ids):
            s = requests.get(f"{url}/v1/sessions/{sid}", headers=h, timeout=30).json()
            if s.get("state") != "idle":
                checks.append(f"session {i}: {s}")
                continue
            r = requests.post(f"{url}/v1/sessions/{sid}/execute", headers=h, timeout=60,
                              json={"code": "x"}).json()
            if r.get("results", [{}])[0].get("data", {}).get("text/plain") != str(i):
                checks.append(f"session {i} lost x: {r}")
            f = requests.get(f"{url}/v1/sessions/{sid}/files/state-{i}.txt", headers=h, timeout=30)
            if f.text != f"session {i}":
                checks.append(f"session {i} lost its file: {f.status_code} {f.text[:100]}")
        for sid in ids + [busy]:
            requests.delete(f"{url}/v1/sessions/{sid}", headers=h, timeout=60)
    finally:
        run.stop()
        if args.sandbox == "docker":
            # A keeping stop leaves the user's container for the next run: none comes.
            ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=org.kernel-broker.data-dir={data_dir}"],
                                 capture_output=True, text=True, timeout=60).stdout.split()
            if ids:
                subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=120)
        # A last start without --keep-sessions would end kept kernels; every session was
        # deleted above, so nothing is left but the workspace mount.
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        for point in sorted((m.split(" ")[4] for m in mounts if m.split(" ")[4].startswith(str(tmp))), reverse=True):
            subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(tmp, ignore_errors=True)

    figures["failed_checks"] = checks
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    sys.exit(1 if checks else 0)


if __name__ == "__main__":
    main()
