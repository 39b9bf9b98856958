// The load-profile-fix-plot flow through the official MCP TypeScript SDK
// (@modelcontextprotocol/sdk, pinned in package.json), over Streamable HTTP.
// Usage: node flow.mjs BROKER_URL TOKEN. Prints one JSON line of what it saw; exits non-zero
// (with the reason on stderr) when a step does not answer as it should.
// protocol-tests/test_mcp_ts.py runs it against a real broker.
import assert from "node:assert/strict";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, token] = process.argv.slice(2);
const CSV = "region,units,unit_price\nnorth,10,2.5\nsouth,4,3.0\neast,7,1.25\n";
const PNG_SIGNATURE = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);

const texts = (r) => r.content.filter((c) => c.type === "text").map((c) => c.text);

const transport = new StreamableHTTPClientTransport(new URL("/mcp", url), {
  requestInit: { headers: { Authorization: `Bearer ${token}` } },
});
const client = new Client({ name: "kernel-broker-ts-flow", version: "1.0.0" });
await client.connect(transport);
const seen = { protocolVersion: transport.protocolVersion, sessionId: transport.sessionId };

const tools = (await client.listTools()).tools.map((t) => t.name);
for (const name of ["run_python", "upload_file", "read_file", "list_files", "restart_session", "list_sessions"]) {
  assert.ok(tools.includes(name), `no tool ${name} in ${tools}`);
}

let r = await client.callTool({
  name: "upload_file",
  arguments: { path: "ts-sales.csv", content_base64: Buffer.from(CSV).toString("base64") },
});
assert.ok(!r.isError, texts(r).join("\n"));

r = await client.callTool({
  name: "run_python",
  arguments: { code: "import pandas as pd\ndf = pd.read_csv('ts-sales.csv')\nprint(df.describe())\ndf.shape" },
});
assert.ok(!r.isError, texts(r).join("\n"));
assert.match(texts(r).join("\n"), /\(3, 3\)/);

r = await client.callTool({ name: "run_python", arguments: { code: "df['revenue'] = df['units'] * df['price']" } });
assert.equal(r.isError, true);
const error = texts(r).at(-1);
assert.ok(error.startsWith("KeyError: 'price'"), error);
assert.ok(error.includes("Traceback:") && !error.includes("\u001b["), error);

r = await client.callTool({
  name: "run_python",
  arguments: { code: "df['revenue'] = df['units'] * df['unit_price']\nfloat(round(df['revenue'].sum(), 2))" },
});
assert.deepEqual(texts(r), ["45.75"]);

// Progress: the SDK sends a progressToken when given onprogress.
const progress = [];
r = await client.callTool(
  {
    name: "run_python",
    arguments: {
      code: "import matplotlib.pyplot as plt\nprint('plotting', flush=True)\nax = df.plot.bar(x='region', y='revenue')\nplt.show()",
    },
  },
  undefined,
  { onprogress: (p) => progress.push(p) },
);
assert.ok(!r.isError, texts(r).join("\n"));
const images = r.content.filter((c) => c.type === "image");
assert.equal(images.length, 1);
assert.equal(images[0].mimeType, "image/png");
const png = Buffer.from(images[0].data, "base64");
assert.ok(png.subarray(0, 8).equals(PNG_SIGNATURE), "not a PNG");
assert.ok(progress.some((p) => (p.message ?? "").includes("plotting")), JSON.stringify(progress));

const resources = (await client.listResources()).resources.map((x) => x.uri);
assert.ok(resources.includes("kernel-broker://workspace/ts-sales.csv"), resources.join(" "));

// Bad input: an unknown tool is a JSON-RPC error naming it.
await assert.rejects(client.callTool({ name: "nope", arguments: {} }), /unknown tool "nope"/);

seen.pngBytes = png.length;
seen.progress = progress.length;
await transport.terminateSession();
await client.close();
console.log(JSON.stringify(seen));
