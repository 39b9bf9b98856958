#!/usr/bin/env python3
"""An agent-style client: holds one kernel-broker session over the WebSocket stream and runs
a load -> profile -> fix -> plot analysis, step by step, each step seeing the variables of
the steps before. Saves the chart it receives as a PNG.

    # in a virtual environment (README, "The same over the WebSocket stream"):
    pip install websocket-client==1.9.2 requests==2.34.2
    KERNEL_BROKER_TOKEN=... python3 examples/agent_session.py [--url http://127.0.0.1:8888] [--out chart.png]
"""
import argparse
import base64
import json
import os
import sys

import requests
import websocket

STEPS = [
    ("load", """
import pandas as pd, numpy as np
rng = np.random.default_rng(7)
sales = pd.DataFrame({
    "region": rng.choice(["north", "south", "east", "west"], 200),
    "units": rng.integers(1, 20, 200),
    "unit_price": rng.normal(12.5, 2.0, 200).round(2),
})
sales.to_csv("sales.csv", index=False)
df = pd.read_csv("sales.csv")
print(df.shape)
"""),
    ("profile", "df.describe()"),
    # An agent's typical slip: a column that does not exist. The traceback comes back...
    ("mistake", "df['revenue'] = df['units'] * df['price']"),
    # ...and the next step fixes it, using the same DataFrame.
    ("fix", "df['revenue'] = df['units'] * df['unit_price']\ndf.groupby('region')['revenue'].sum().round(2)"),
    ("plot", """
import matplotlib.pyplot as plt
ax = df.groupby('region')['revenue'].sum().plot.bar(color='#4c72b0', title='Revenue by region')
ax.set_ylabel('revenue')
plt.tight_layout()
plt.show()
"""),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default=os.environ.get("KERNEL_BROKER_URL", "http://127.0.0.1:8888"))
    p.add_argument("--token", default=os.environ.get("KERNEL_BROKER_TOKEN"))
    p.add_argument("--out", default="chart.png")
    args = p.parse_args()
    if not args.token:
        sys.exit("set KERNEL_BROKER_TOKEN or pass --token")
    auth = {"Authorization": f"Bearer {args.token}"}

    session = requests.post(f"{args.url}/v1/sessions", json={"idle_timeout_seconds": 300},
                            headers=auth, timeout=60).json()
    sid = session["id"]
    print(f"session {sid} ({session['state']})")
    ws_url = args.url.replace("http", "ws", 1) + f"/v1/sessions/{sid}/stream"
    ws = websocket.create_connection(ws_url, header=[f"Authorization: Bearer {args.token}"], timeout=120)
    saved = False
    try:
        for name, code in STEPS:
            ws.send(json.dumps({"type": "execute", "id": name, "code": code, "timeout_seconds": 60}))
            while True:
                frame = json.loads(ws.recv())
                kind = frame["type"]
                if kind == "stdout":
                    print(f"[{name}] {frame['text']}", end="")
                elif kind == "error":
                    print(f"[{name}] {frame['ename']}: {frame['evalue']}  <- the agent reads this and fixes it")
                elif kind in ("result", "display"):
                    data = frame["data"]
                    if "image/png" in data:
                        with open(args.out, "wb") as f:
                            f.write(base64.b64decode(data["image/png"]))
                        saved = True
                        print(f"[{name}] chart saved to {args.out}")
                    elif "text/plain" in data:
                        print(f"[{name}] {data['text/plain']}")
                elif kind == "done" and frame["id"] == name:
                    x = frame["execution"]
                    print(f"[{name}] {x['status']} in {x['duration_ms']:.0f} ms")
                    break
    finally:
        ws.close()
        requests.delete(f"{args.url}/v1/sessions/{sid}", headers=auth, timeout=60)
    if not saved:
        sys.exit("no chart arrived")


if __name__ == "__main__":
    main()
