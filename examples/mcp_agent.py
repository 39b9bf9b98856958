#!/usr/bin/env python3
"""An agent's tool calls through MCP: the official Python SDK (`mcp` on PyPI) connects to
kernel-broker and runs a load -> profile -> fix -> plot analysis with `run_python`, each step
seeing the variables of the steps before, and saves the chart it receives as image content.

    # in a virtual environment (README, "The same over the WebSocket stream"):
    pip install mcp==2.3.0
    # Streamable HTTP, straight to the broker:
    KERNEL_BROKER_TOKEN=... python3 examples/mcp_agent.py --url http://127.0.0.1:8888
    # stdio, through `kernel-broker mcp` (what a stdio-only host runs):
    KERNEL_BROKER_TOKEN=... python3 examples/mcp_agent.py --url http://127.0.0.1:8888 \\
        --stdio target/release/kernel-broker   # the binary scripts/serve builds
"""
import argparse
import asyncio
import base64
import os
import sys

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

CSV = "region,units,unit_price\nnorth,10,2.5\nsouth,4,3.0\neast,7,1.25\nwest,12,2.0\n"
STEPS = [
    ("profile", "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(df.describe())\ndf.head()"),
    # A mistake an agent makes: the column is unit_price. The tool answers isError with the
    # KeyError and its traceback; the next step fixes it.
    ("mistake", "df['revenue'] = df['units'] * df['price']"),
    ("fix", "df['revenue'] = df['units'] * df['unit_price']\ndf.groupby('region')['revenue'].sum()"),
    ("plot", "import matplotlib.pyplot as plt\ndf.plot.bar(x='region', y='revenue', title='Revenue by region')\nplt.show()"),
]


def client_for(args, token):
    if args.stdio:
        return Client(StdioServerParameters(
            command=args.stdio, args=["mcp", "--url", args.url, "--token", token]))
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx2.Timeout(30, read=300))
    return Client(streamable_http_client(args.url.rstrip("/") + "/mcp", http_client=http))


async def main(args, token):
    async with client_for(args, token) as client:
        print("tools:", ", ".join(t.name for t in (await client.list_tools()).tools))
        r = await client.call_tool("upload_file", {
            "path": "sales.csv", "content_base64": base64.b64encode(CSV.encode()).decode()})
        print("upload:", r.content[0].text)
        for name, code in STEPS:
            r = await client.call_tool("run_python", {"code": code})
            print(f"--- {name} ({'error' if r.is_error else 'ok'})")
            for block in r.content:
                if block.type == "text":
                    print(block.text if not r.is_error else block.text.splitlines()[0])
                elif block.type == "image":
                    with open(args.out, "wb") as f:
                        f.write(base64.b64decode(block.data))
                    print(f"[{block.mime_type} saved to {args.out}]")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8888")
    p.add_argument("--stdio", metavar="KERNEL_BROKER_BINARY",
                   help="connect over stdio through `KERNEL_BROKER_BINARY mcp`")
    p.add_argument("--out", default="chart.png")
    args = p.parse_args()
    token = os.environ.get("KERNEL_BROKER_TOKEN")
    if not token:
        sys.exit("set KERNEL_BROKER_TOKEN to your token")
    asyncio.run(main(args, token))
