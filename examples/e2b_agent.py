#!/usr/bin/env python3
"""An agent written for E2B's SDK, run unmodified against kernel-broker: only the three
environment variables point it at the broker. It uploads a CSV, profiles it with pandas,
hits a KeyError, fixes it, plots, downloads the chart, and runs a shell command in the
same sandbox.

    # in a virtual environment (README, "Using kernel-broker from E2B's SDK"):
    pip install e2b==2.63.0 e2b-code-interpreter==2.11.5
    export E2B_API_URL=http://127.0.0.1:8888/e2b
    export E2B_SANDBOX_URL=http://127.0.0.1:8888/e2b/sandbox
    export E2B_API_KEY=<your kernel-broker token>
    python3 examples/e2b_agent.py [--out chart.png]
"""
import argparse
import sys

from e2b_code_interpreter import Sandbox

CSV = "region,units,unit_price\nnorth,3,12.5\nsouth,7,11.0\neast,2,14.2\nwest,9,10.9\nnorth,4,12.1\n"

STEPS = [
    ("profile", "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(df.shape)\ndf.describe()"),
    # A mistake an agent makes: the column is unit_price, not price.
    ("mistake", "df['revenue'] = df['units'] * df['price']"),
    ("fix", "df['revenue'] = df['units'] * df['unit_price']\ndf.groupby('region')['revenue'].sum()"),
    ("plot", "import matplotlib.pyplot as plt\n"
             "ax = df.groupby('region')['revenue'].sum().plot.bar(title='revenue by region')\n"
             "plt.tight_layout(); plt.savefig('chart.png'); plt.show()"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="chart.png", help="where to save the downloaded chart")
    args = ap.parse_args()
    with Sandbox.create(timeout=600) as sbx:
        print(f"sandbox {sbx.sandbox_id}")
        sbx.files.write("sales.csv", CSV)
        for name, code in STEPS:
            ex = sbx.run_code(code, on_stdout=lambda m: print(f"  [{name}] {m.line}", end=""))
            if ex.error:
                print(f"  [{name}] {ex.error.name}: {ex.error.value}")
                continue
            for r in ex.results:
                if r.png:
                    print(f"  [{name}] chart ({len(r.png)} base64 characters)")
                elif r.text:
                    print(f"  [{name}] {r.text}")
        chart = sbx.files.read("chart.png", format="bytes")
        with open(args.out, "wb") as f:
            f.write(chart)
        print(f"chart saved to {args.out} ({len(chart)} bytes)")
        r = sbx.commands.run("ls -l && wc -l sales.csv")
        print(r.stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
