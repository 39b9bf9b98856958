#!/usr/bin/env python3
"""Paused sessions carried between the nodes of a cluster (`--carry-paused`, issue 37): the
figures of BENCHMARKS.md "Pause and resume across nodes".

    bench/.venv/bin/python bench/carry.py [--runs 5] [--mb 200] [--json FILE]

Two brokers (release build, local sandbox, run as root with CRIU 4) on one PostgreSQL
database (KB_TEST_POSTGRES_URL, else a throwaway server from scripts/pg-test-server, which
runs with fsync=off: said in the output), both with `--carry-paused` and one `--uid-base`.
Node A alone makes `--runs` sessions with a workspace of their own holding pandas and a
DataFrame of `--mb` MB, and as many bare ones (pandas imported), and pauses each: the
pause's time as the client sees it, the time from the pause's request until its copy is in
the database (stored after the answer; polled every 20 ms), and the bytes stored
(`paused_copies.bytes`). Then node B starts, A stops
(its lease given up by lapsing: `--node-lease 2`), and each session's first `1+1` through
B is timed: the takeover (the claim, the copy read from the database and written to B's
disk, the images checked) and the resume, to the result.
"""
import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402
import cluster as cb  # noqa: E402

TIMEOUT = 300


def ms(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)


def call(node, token, method, path, body=None):
    r = requests.request(method, node.url + path, json=body, timeout=TIMEOUT,
                         headers={"Authorization": f"Bearer {token}"})
    if r.status_code not in (200, 201, 204):
        raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
    return r.json() if r.content else None


def run(node, token, sid, code):
    out = call(node, token, "POST", f"/v1/sessions/{sid}/execute", {"code": code})
    if out["status"] != "ok":
        raise RuntimeError(f"{code!r}: {out}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--binary", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pg = cb.Postgres()
    url, _ = pg.fresh()
    token = f"carry-{uuid.uuid4().hex}"
    users = Path(bench.tempfile.mkdtemp(prefix="kb-carry-bench-"), "users.toml")
    users.write_text(f'[[user]]\nname = "bench0"\ntoken = "{token}"\n')
    extra = ["--database-url", url, "--advertise-url", "{url}", "--node-lease", "2",
             "--carry-paused", "true", "--uid-base", "340000", "--pool-size", "0",
             "--session-memory-limit", str(max(1 << 30, 3 * args.mb << 20))]
    a = cb.Node(args.binary, users, "carry-a", extra)
    out = {"mb": args.mb, "runs": args.runs,
           "postgres": "KB_TEST_POSTGRES_URL" if pg.dir is None else "scripts/pg-test-server (fsync=off)"}
    try:
        rows = args.mb * (1 << 20) // 80
        kinds = {"data": f"import pandas as pd, numpy as np\ndf = pd.DataFrame(np.random.rand({rows}, 10))",
                 "bare": "import pandas as pd, numpy as np"}
        made = {k: [] for k in kinds}
        pauses = {k: [] for k in kinds}
        stored = {k: [] for k in kinds}
        copied = {k: [] for k in kinds}
        for kind, code in kinds.items():
            for _ in range(args.runs):
                sid = call(a, token, "POST", "/v1/sessions", {"workspace": "own"})["id"]
                run(a, token, sid, code)
                start = time.monotonic()
                call(a, token, "POST", f"/v1/sessions/{sid}/pause")
                pauses[kind].append(time.monotonic() - start)
                while True:  # the copy is stored after the pause's answer
                    got = pg.psql(url.rsplit("/", 1)[1], f"SELECT bytes FROM paused_copies WHERE session_id = '{sid}'")
                    if got.strip():
                        break
                    time.sleep(0.02)
                copied[kind].append(time.monotonic() - start)
                stored[kind].append(int(got.strip()))
                made[kind].append(sid)
        b = cb.Node(args.binary, users, "carry-b", extra)
        try:
            a.stop()
            time.sleep(4)  # A's lease (2 s) lapses: it is no longer live
            takeovers = {k: [] for k in kinds}
            for kind, sids in made.items():
                for sid in sids:
                    start = time.monotonic()
                    while True:
                        r = requests.post(f"{b.url}/v1/sessions/{sid}/execute", json={"code": "1+1"}, timeout=TIMEOUT,
                                          headers={"Authorization": f"Bearer {token}"})
                        if r.status_code == 200:
                            break
                        if r.status_code not in (502, 503):
                            raise RuntimeError(f"{r.status_code} {r.text[:300]}")
                        time.sleep(0.05)
                    took = time.monotonic() - start
                    assert r.json()["results"][-1]["data"]["text/plain"] == "2", r.text
                    takeovers[kind].append(took)
            for sid in made["data"]:
                ok = run(b, token, sid, "float(df.iloc[0, 0]) >= 0")
                assert ok["results"][-1]["data"]["text/plain"] == "True", ok
            for line in b.log:
                if "copy taken in" in line:
                    print("carry:", line.strip()[-160:], file=sys.stderr)
        finally:
            b.stop()
        for kind in kinds:
            out[kind] = {
                "pause_p50_ms": ms(pauses[kind], 0.5),
                "pause_max_ms": ms(pauses[kind], 1.0),
                "copy_stored_after_p50_ms": ms(copied[kind], 0.5),
                "copy_stored_after_max_ms": ms(copied[kind], 1.0),
                "copy_mib_p50": round(statistics.median(stored[kind]) / 2**20, 1),
                "takeover_to_first_result_p50_ms": ms(takeovers[kind], 0.5),
                "takeover_to_first_result_max_ms": ms(takeovers[kind], 1.0),
            }
    finally:
        a.stop()
        pg.drop_all()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
