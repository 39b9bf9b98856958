"""MCP (issue 14) through the official TypeScript SDK (@modelcontextprotocol/sdk) and the MCP
Inspector's CLI (@modelcontextprotocol/inspector --cli), both unmodified and pinned in
mcp-ts/package.json + package-lock.json (installed by `scripts/setup --test` with `npm ci`).
Each runs the load-profile-fix-plot flow against a real broker over Streamable HTTP."""
import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ALICE, BOB, Broker
from mcp_flow import BROKEN, CSV, FIXED, PLOT, PNG_SIGNATURE, PROFILE

HERE = Path(__file__).resolve().parent / "mcp-ts"
INSPECTOR = HERE / "node_modules/@modelcontextprotocol/inspector/clients/launcher/build/index.js"


@pytest.fixture(scope="module")
def broker():
    """A broker of this module's own: the SDK's flow checks that its end leaves alice no
    session at all, which only a broker no other test uses at the same time can show (the
    suite runs in two processes, and other files' sandboxes live until their timeouts)."""
    b = Broker()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def node():
    found = shutil.which("node")
    assert found, "node is missing: run scripts/setup --test"
    assert (HERE / "node_modules/@modelcontextprotocol/sdk").is_dir(), \
        "the npm packages are missing: run scripts/setup --test (npm ci in protocol-tests/mcp-ts)"
    return found


def test_typescript_sdk_flow(broker, node):
    p = subprocess.run([node, "flow.mjs", broker.url, ALICE], cwd=HERE, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr + p.stdout
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["protocolVersion"] == "2025-11-25"
    assert seen["sessionId"]
    assert seen["pngBytes"] > 1000
    assert seen["progress"] >= 1
    # The SDK's terminateSession ended the MCP session and so its broker session.
    assert broker.api("GET", "/v1/sessions").json() == []


def inspector(node, broker, *args, token=ALICE, tool_error=False):
    """One Inspector CLI call (each is an MCP session of its own); its JSON answer. The CLI
    exits 5 when a tool answers `isError: true`, still printing the result."""
    p = subprocess.run(
        [node, str(INSPECTOR), "--cli", broker.url + "/mcp",
         "--header", f"Authorization: Bearer {token}", *args],
        cwd=HERE, capture_output=True, text=True, timeout=120)
    assert p.returncode == (5 if tool_error else 0), p.stderr + p.stdout
    return json.loads(p.stdout)


def call(node, broker, tool, tool_error=False, **arguments):
    pairs = [f"{k}={v}" for k, v in arguments.items()]
    args = ["--method", "tools/call", "--tool-name", tool]
    if pairs:
        args += ["--tool-arg", *pairs]
    return inspector(node, broker, *args, tool_error=tool_error)


def texts(result):
    return [c["text"] for c in result["content"] if c["type"] == "text"]


def test_inspector_cli_flow(broker, node):
    tools = [t["name"] for t in inspector(node, broker, "--method", "tools/list")["tools"]]
    assert "run_python" in tools and "upload_file" in tools, tools
    # Each CLI call is a new MCP session, so the flow names one session explicitly.
    made = json.loads(texts(call(node, broker, "create_session"))[0])
    sid = made["id"]
    r = call(node, broker, "upload_file", path="cli-sales.csv",
             content_base64=base64.b64encode(CSV.encode()).decode(), session_id=sid)
    assert not r["isError"], r
    r = call(node, broker, "run_python", code=PROFILE.replace("sales.csv", "cli-sales.csv"),
             session_id=sid)
    assert not r["isError"] and "(3, 3)" in "\n".join(texts(r)), r
    r = call(node, broker, "run_python", code=BROKEN, session_id=sid, tool_error=True)
    assert r["isError"] and texts(r)[-1].startswith("KeyError: 'price'"), r
    r = call(node, broker, "run_python", code=FIXED, session_id=sid)
    assert texts(r) == ["45.75"], r
    r = call(node, broker, "run_python", code=PLOT, session_id=sid)
    images = [c for c in r["content"] if c["type"] == "image"]
    assert len(images) == 1 and images[0]["mimeType"] == "image/png", r
    assert base64.b64decode(images[0]["data"]).startswith(PNG_SIGNATURE)
    # The session is the caller's alone.
    r = inspector(node, broker, "--method", "tools/call", "--tool-name", "run_python",
                  "--tool-arg", "code=print(1)", f"session_id={sid}", token=BOB, tool_error=True)
    assert r["isError"] and texts(r) == [f"no session {sid}"], r
    r = inspector(node, broker, "--method", "resources/read",
                  "--uri", f"kernel-broker://sessions/{sid}/notebook.ipynb")
    nb = json.loads(r["contents"][0]["text"])
    assert any("unit_price" in "".join(c["source"]) for c in nb["cells"]), nb
    call(node, broker, "delete_session", session_id=sid)
