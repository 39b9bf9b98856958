"""The load-profile-fix-plot flow an agent runs through MCP, shared by the Python SDK's tests
(test_mcp.py, over Streamable HTTP and over stdio). The TypeScript SDK's script
(mcp-ts/flow.mjs) and the Inspector's test run the same steps."""
import base64
import json

CSV = "region,units,unit_price\nnorth,10,2.5\nsouth,4,3.0\neast,7,1.25\n"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

PROFILE = "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(df.describe())\ndf.shape"
BROKEN = "df['revenue'] = df['units'] * df['price']"
FIXED = "df['revenue'] = df['units'] * df['unit_price']\nfloat(round(df['revenue'].sum(), 2))"
PLOT = (
    "import matplotlib.pyplot as plt\n"
    "ax = df.plot.bar(x='region', y='revenue', title='revenue by region')\n"
    "plt.show()"
)


def texts(result):
    return [c.text for c in result.content if c.type == "text"]


async def run_flow(client, path="sales.csv"):
    """Runs the flow on a connected `mcp.Client`; returns the chart's PNG bytes."""
    tools = {t.name: t for t in (await client.list_tools()).tools}
    for name in ("run_python", "upload_file", "read_file", "list_files", "restart_session",
                 "list_sessions", "interrupt_session"):
        assert name in tools, sorted(tools)
    schema = tools["run_python"].input_schema
    assert schema["required"] == ["code"], schema
    assert {"code", "session_id", "timeout_seconds"} <= set(schema["properties"]), schema

    r = await client.call_tool("upload_file", {
        "path": path, "content_base64": base64.b64encode(CSV.encode()).decode()})
    assert not r.is_error, texts(r)

    r = await client.call_tool("run_python", {"code": PROFILE.replace("sales.csv", path)})
    assert not r.is_error, texts(r)
    out = "\n".join(texts(r))
    assert "unit_price" in out and "mean" in out, out
    assert "(3, 3)" in out, out

    r = await client.call_tool("run_python", {"code": BROKEN})
    assert r.is_error, texts(r)
    err = texts(r)[-1]
    assert err.startswith("KeyError: 'price'"), err
    assert "Traceback:" in err and "\x1b[" not in err, err

    r = await client.call_tool("run_python", {"code": FIXED})
    assert not r.is_error, texts(r)
    assert texts(r) == ["45.75"], texts(r)

    r = await client.call_tool("run_python", {"code": PLOT})
    assert not r.is_error, texts(r)
    images = [c for c in r.content if c.type == "image"]
    assert len(images) == 1, r.content
    assert images[0].mime_type == "image/png"
    png = base64.b64decode(images[0].data)
    assert png.startswith(PNG_SIGNATURE), png[:16]

    r = await client.call_tool("read_file", {"path": path})
    assert texts(r) == [CSV], texts(r)
    r = await client.call_tool("list_files", {})
    listed = json.loads(texts(r)[0])
    assert path in [f["path"] for f in listed["files"]], listed
    return png
