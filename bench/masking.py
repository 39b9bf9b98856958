"""Secrets and masking (issue 39): what masking costs, the figure of BENCHMARKS.md "Masking".

    bench/.venv/bin/python bench/masking.py [--trips 300] [--binary PATH] [--sandbox local|docker]

Two brokers (release build, the local sandbox unless `--sandbox docker`), one after the
other, each with one session, measured with the same client:

  - *baseline*: `--default-secret-patterns false` and a session without secrets: the
    masker holds only the users' tokens and the kernel's key (always on);
  - *masking*: the default credential patterns on and a session with four secrets, so
    every message is scanned for every form of each (about 60 literal forms and 8
    patterns).

Round trips, p50 and p90 of `--trips`, interleaved in blocks so that drift hits both:
  - `1+1` (an execute_input, a status pair, an execute_result and the reply: all scanned);
  - a print of 10 KB of text (a stream message the masker holds the tail of);
  - a leak: a secret printed, masked (the parse-and-rewrite path).

The difference of the `1+1` p50s against the baseline's is the masking cost; the goal is
under 5 % of the baseline's round trip.

Also on the masking broker: create -> first result of a session with secrets (it never
takes a pooled kernel: a pooled kernel was started without them) against one without, p50
of `--runs`, each create after the pool refilled.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402
from branch import Api, ms  # noqa: E402

SECRETS = {f"KEY_{i}": f"bench-secret-{i}-" + "x7Q" * 8 for i in range(4)}
CODES = {
    "one_plus_one": "1 + 1",
    "print_10kb": "print('abcdefghij' * 1000)",
    "leak": "import os; print(os.environ['KEY_0'])",
}


def measure(args, masking):
    extra = [] if masking else ["--default-secret-patterns", "false"]
    b = bench.Broker(args.binary, sandbox=args.sandbox, pool_size=1,
                     tag="-mask" if masking else "-nomask", extra_args=extra)
    try:
        api = Api(b)
        body = {"secrets": SECRETS} if masking else {"secrets": {}}
        sid = api.call("POST", "/v1/sessions", body)["id"]
        if masking:
            out = api.run(sid, CODES["leak"])
            assert out["stdout"] == "[secret:KEY_0]\n", out
        for code in CODES.values():
            if "KEY_0" in code and not masking:
                code = "print('not a secret at all')"
            for _ in range(20):
                api.run(sid, code)
        times = {name: [] for name in CODES}
        for _ in range(args.trips // 10):
            for name, code in CODES.items():
                if name == "leak" and not masking:
                    code = "print('not a secret at all')"
                for _ in range(10):
                    times[name].append(api.timed(sid, code))
        out = {name: {"p50_ms": ms(t, 0.5), "p90_ms": ms(t, 0.9)} for name, t in times.items()}
        if masking:
            api.call("DELETE", f"/v1/sessions/{sid}")
            for label, body in (("create_pooled", {}), ("create_with_secrets", {"secrets": SECRETS})):
                took = []
                for _ in range(args.runs):
                    time.sleep(args.refill)
                    start = time.monotonic()
                    new = api.call("POST", "/v1/sessions", body)["id"]
                    api.run(new, "1 + 1")
                    took.append(time.monotonic() - start)
                    api.call("DELETE", f"/v1/sessions/{new}")
                out[label] = {"p50_ms": ms(took, 0.5), "max_ms": ms(took, 1.0)}
        return out
    finally:
        b.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trips", type=int, default=300)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--refill", type=float, default=3.0, help="seconds for the pool to refill")
    ap.add_argument("--sandbox", default="local", choices=["local", "docker"])
    ap.add_argument("--binary", default=str(bench.REPO / "target/release/kernel-broker"))
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"baseline": measure(args, False), "masking": measure(args, True)}
    base = result["baseline"]["one_plus_one"]["p50_ms"]
    masked = result["masking"]["one_plus_one"]["p50_ms"]
    result["one_plus_one_cost_ms"] = round(masked - base, 3)
    result["one_plus_one_cost_pct"] = round(100 * (masked - base) / base, 1)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
