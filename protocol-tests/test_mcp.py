"""MCP (issue 14) through the official Python SDK (`mcp` on PyPI, pinned in
requirements.txt), unmodified: over Streamable HTTP at /mcp and over stdio through
`kernel-broker mcp --url URL --token TOKEN`. Each runs the load-profile-fix-plot flow
(mcp_flow.py) against a real broker with real kernels."""
import asyncio
import json
import os
import subprocess

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from conftest import ALICE, BOB, REPO, needs_criu
from mcp_flow import CSV, run_flow, texts

BINARY = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))


def http_client(broker, token=ALICE):
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx2.Timeout(30, read=300))
    return Client(streamable_http_client(broker.url + "/mcp", http_client=http))


def stdio_client(broker, token=ALICE):
    return Client(StdioServerParameters(
        command=BINARY, args=["mcp", "--url", broker.url, "--token", token]))


def sessions(broker, token=ALICE):
    r = broker.api("GET", "/v1/sessions", token)
    assert r.status_code == 200, r.text
    return r.json()


def test_flow_over_streamable_http(broker):
    async def main():
        before = {s["id"] for s in sessions(broker)}
        async with http_client(broker) as client:
            assert client.protocol_version == "2025-11-25"
            assert client.server_info.name == "kernel-broker"
            await run_flow(client, "http-sales.csv")
            # State persists: `df` from the flow is still there.
            r = await client.call_tool("run_python", {"code": "len(df)"})
            assert texts(r) == ["3"], texts(r)
            # The MCP session's own session is an ordinary broker session.
            made = [s for s in sessions(broker) if s["id"] not in before]
            assert len(made) == 1, made
            own = made[0]["id"]
            # Made by MCP, with the client's name and version from its initialize.
            assert made[0]["front_door"] == "mcp", made
            # (the SDK's own name when the client gives none: mcp.client.session's default)
            assert made[0]["metadata"] == {"client": "mcp", "client_version": "0.1.0"}, made
            listed = json.loads(texts(await client.call_tool("list_sessions", {}))[0])
            mine = [s for s in listed["sessions"] if s["this_connection"]]
            assert [s["id"] for s in mine] == [own]
            # Resources: the workspace file and the session's notebook.
            uris = [str(r.uri) for r in (await client.list_resources()).resources]
            assert "kernel-broker://workspace/http-sales.csv" in uris, uris
            csv = (await client.read_resource("kernel-broker://workspace/http-sales.csv")).contents[0]
            assert csv.text == CSV and csv.mime_type == "text/plain", csv
            nb_uri = f"kernel-broker://sessions/{own}/notebook.ipynb"
            assert nb_uri in uris, uris
            nb = json.loads((await client.read_resource(nb_uri)).contents[0].text)
            sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
            assert any("unit_price" in s for s in sources), sources
            # Recorded like any session: the REST notebook export has the same cells.
            r = broker.api("GET", f"/v1/sessions/{own}/notebook")
            assert r.status_code == 200
        # Closing the MCP session (the SDK sends DELETE) ends its broker session.
        for _ in range(100):
            if own not in {s["id"] for s in sessions(broker)}:
                break
            await asyncio.sleep(0.1)
        assert own not in {s["id"] for s in sessions(broker)}
        # (the session leaves the list first, then its kernel stops and the close is recorded)
        for _ in range(100):
            closed = [e["detail"] for e in broker.api(
                "GET", f"/v1/sessions/{own}/events?type=session_closed").json()["events"]]
            if closed:
                break
            await asyncio.sleep(0.1)
        assert closed == [{"by": "mcp_session_ended"}], closed
        # Replayable like any recorded session: the cells run again in a new session, and
        # the chart and the KeyError come back as recorded.
        r = broker.api("POST", f"/v1/sessions/{own}/replay", timeout=120)
        assert r.status_code == 201, r.text
        replay = r.json()
        assert any("unit_price" in c["code"] for c in replay["cells"]), replay
        assert all(c["same_output"] for c in replay["cells"]), replay["cells"]
        broker.api("DELETE", f"/v1/sessions/{replay['session']['id']}")
    asyncio.run(main())


def test_flow_over_stdio(broker):
    async def main():
        before = {s["id"] for s in sessions(broker)}
        async with stdio_client(broker) as client:
            assert client.server_info.name == "kernel-broker"
            assert client.protocol_version == "2025-11-25"
            await run_flow(client, "stdio-sales.csv")
            made = {s["id"] for s in sessions(broker)} - before
            assert len(made) == 1, made
        # The host closed the relay's stdin: the relay ended its MCP session at the broker,
        # and with it the session it had made.
        for _ in range(100):
            if not made & {s["id"] for s in sessions(broker)}:
                break
            await asyncio.sleep(0.1)
        assert not made & {s["id"] for s in sessions(broker)}
    asyncio.run(main())


def test_progress_streams_output(broker):
    async def main():
        seen = []

        async def progress(value, total, message):
            seen.append((value, message))

        async with http_client(broker) as client:
            code = "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.4)"
            r = await client.call_tool("run_python", {"code": code}, progress_callback=progress)
            assert not r.is_error, texts(r)
            assert texts(r) == ["tick 0\ntick 1\ntick 2\n"], texts(r)
        messages = "".join(m or "" for _, m in seen)
        assert "tick 0" in messages and "tick 2" in messages, seen
        values = [v for v, _ in seen]
        assert values == sorted(values) and len(set(values)) == len(values), values
    asyncio.run(main())


def test_bad_input_is_explained(broker):
    async def main():
        async with http_client(broker) as client:
            with pytest.raises(MCPError) as e:
                await client.call_tool("no_such_tool", {})
            assert "no_such_tool" in str(e.value)
            assert e.value.code == -32602 and "the tools are: " in str(e.value), e.value
            # Arguments that do not fit the schema: a tool error saying which (MCP 2025-11-25
            # reports input validation as a tool error, so the model can correct itself).
            r = await client.call_tool("run_python", {"code": 42})
            assert r.is_error and "invalid type: integer `42`, expected a string" in texts(r)[0], texts(r)
            r = await client.call_tool("upload_file", {"path": "x.csv"})
            assert r.is_error and "missing field `content_base64`" in texts(r)[0], texts(r)
            # Bob's session is not found for alice, exactly as a missing one.
            bob = broker.api("POST", "/v1/sessions", BOB, json={}).json()["id"]
            r = await client.call_tool("run_python", {"code": "1", "session_id": bob})
            assert r.is_error and texts(r) == [f"no session {bob}"], texts(r)
            r = await client.call_tool("run_python", {"code": "x" * (2 << 20)})
            assert r.is_error and "the limit is" in texts(r)[0], texts(r)
            broker.api("DELETE", f"/v1/sessions/{bob}", BOB)
    asyncio.run(main())


def test_stdio_relay_says_what_is_wrong(broker):
    """`kernel-broker mcp` with a bad token or no broker: the host's request gets a JSON-RPC
    error, the relay exits non-zero saying why (stderr), and nothing hangs."""
    init = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "pytest", "version": "1"}}}) + "\n"
    for url, token in [(broker.url, "not-a-token"), ("http://127.0.0.1:1", ALICE)]:
        p = subprocess.Popen([BINARY, "mcp", "--url", url, "--token", token],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        p.stdin.write(init)
        p.stdin.flush()
        answer = json.loads(p.stdout.readline())
        assert answer["id"] == 1 and answer["error"]["code"] == -32603, answer
        assert "the broker did not take the message" in answer["error"]["message"], answer
        assert p.wait(20) == 1
        assert "is the token right?" in p.stderr.read()
        p.stdin.close()
    # The host writes its request and closes stdin at once (as `echo ... | kernel-broker mcp`
    # does): the request is still answered with the error, and the exit is still 1.
    for url, token in [(broker.url, "not-a-token"), ("http://127.0.0.1:1", ALICE)]:
        p = subprocess.run([BINARY, "mcp", "--url", url, "--token", token],
                           input=init, capture_output=True, text=True, timeout=30)
        answer = json.loads(p.stdout.splitlines()[0])
        assert answer["id"] == 1 and answer["error"]["code"] == -32603, (url, p.stdout)
        assert p.returncode == 1, (url, p.returncode, p.stderr)
        assert "is the token right?" in p.stderr, p.stderr
    # A good token and a running broker: the answer, then exit 0 soon after stdin ends.
    p = subprocess.run([BINARY, "mcp", "--url", broker.url, "--token", ALICE],
                       input=init, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, (p.returncode, p.stderr)
    answer = json.loads(p.stdout.splitlines()[0])
    assert answer["id"] == 1 and answer["result"]["serverInfo"]["name"] == "kernel-broker", answer
    p = subprocess.run([BINARY, "mcp", "--url", "https://example.org", "--token", ALICE],
                       input="", capture_output=True, text=True, timeout=20)
    assert p.returncode == 1 and "must be the broker's http:// address" in p.stderr, p.stderr


def test_fork_checkpoint_and_rewind_through_the_sdk(broker):
    """Issue 36 through MCP: a checkpoint, work that goes wrong, a rewind to the checkpoint,
    a fork of the live session and one of the checkpoint, each seen from the variables; and
    another user's session or checkpoint is answered as a missing one."""
    async def main():
        async with http_client(broker) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            for name in ("fork_session", "checkpoint", "list_checkpoints", "rewind"):
                assert name in tools, sorted(tools)
            assert tools["rewind"].input_schema["required"] == ["checkpoint_id"]
            # Nothing to checkpoint before the connection has a session: none is made.
            r = await client.call_tool("checkpoint", {})
            assert r.is_error and "no session yet" in texts(r)[0], texts(r)

            value(await client.call_tool("run_python", {"code": "import random\nrandom.seed(5)\nrows = [1, 2, 3]"}))
            cp = json.loads(value(await client.call_tool("checkpoint", {}))[0])
            assert cp["execution_count"] == 1, cp
            lost = value(await client.call_tool("run_python", {"code": "del rows\nlost = random.random()\nlost"}))
            r = await client.call_tool("run_python", {"code": "rows"})
            assert r.is_error and texts(r)[-1].startswith("NameError"), texts(r)

            listed = json.loads(value(await client.call_tool("list_checkpoints", {}))[0])
            assert [c["id"] for c in listed["checkpoints"]] == [cp["id"]], listed
            assert listed["budget"]["count"] >= 1, listed

            said = value(await client.call_tool("rewind", {"checkpoint_id": cp["id"]}))[0]
            assert said.startswith("rewound session ") and cp["id"] in said and "(1)" in said, said
            # The state of the checkpoint: `rows` back, the same next random number.
            assert value(await client.call_tool("run_python", {"code": "rows"})) == ["[1, 2, 3]"]
            assert value(await client.call_tool("run_python", {"code": "random.random()"})) == lost
            r = await client.call_tool("run_python", {"code": "lost"})
            assert r.is_error and texts(r)[-1].startswith("NameError"), texts(r)

            # A fork of the live session, two at once: each has `rows`; the original keeps its own.
            made = json.loads(value(await client.call_tool("fork_session", {"count": 2}))[0])
            forks = [s["id"] for s in made["sessions"]]
            assert len(forks) == 2 and all(s["state"] == "idle" for s in made["sessions"]), made
            value(await client.call_tool("run_python", {"code": "rows.append(4)", "session_id": forks[0]}))
            assert value(await client.call_tool("run_python", {"code": "rows", "session_id": forks[0]})) == ["[1, 2, 3, 4]"]
            assert value(await client.call_tool("run_python", {"code": "rows", "session_id": forks[1]})) == ["[1, 2, 3]"]
            assert value(await client.call_tool("run_python", {"code": "rows"})) == ["[1, 2, 3]"]
            # A fork of the checkpoint.
            value(await client.call_tool("run_python", {"code": "rows = None"}))
            made = json.loads(value(await client.call_tool("fork_session", {"checkpoint_id": cp["id"]}))[0])
            from_cp = made["sessions"][0]["id"]
            assert value(await client.call_tool("run_python", {"code": "rows", "session_id": from_cp})) == ["[1, 2, 3]"]
            r = await client.call_tool("fork_session", {"checkpoint_id": cp["id"], "count": 2})
            assert r.is_error and "one session at a time" in texts(r)[0], texts(r)
            r = await client.call_tool("fork_session", {"count": 9})
            assert r.is_error, texts(r)

            # Bob's session and checkpoint: missing, as ones that never existed.
            bob = broker.api("POST", "/v1/sessions", BOB, json={}).json()["id"]
            assert broker.api("POST", f"/v1/sessions/{bob}/execute", BOB, json={"code": "secret = 1"}).status_code == 200
            bob_cp = broker.api("POST", f"/v1/sessions/{bob}/checkpoints", BOB)
            assert bob_cp.status_code == 201, bob_cp.text
            bob_cp = bob_cp.json()["id"]
            for tool, args in (("fork_session", {"session_id": bob}),
                               ("fork_session", {"session_id": bob, "checkpoint_id": bob_cp}),
                               ("checkpoint", {"session_id": bob}),
                               ("list_checkpoints", {"session_id": bob}),
                               ("rewind", {"session_id": bob, "checkpoint_id": bob_cp})):
                r = await client.call_tool(tool, args)
                assert r.is_error and texts(r) == [f"no session {bob}"], (tool, texts(r))
            # Bob's checkpoint named against alice's own session: not hers.
            for tool, args in (("rewind", {"checkpoint_id": bob_cp}),
                               ("fork_session", {"checkpoint_id": bob_cp})):
                r = await client.call_tool(tool, args)
                assert r.is_error and "checkpoint" in texts(r)[0], (tool, texts(r))
            r = await client.call_tool("rewind", {"checkpoint_id": "not-a-uuid"})
            assert r.is_error and "checkpoint ids are UUIDs" in texts(r)[0], texts(r)
            mine = {s["id"] for s in sessions(broker)}
            assert set(forks) | {from_cp} <= mine, mine
            assert bob not in mine
            broker.api("DELETE", f"/v1/sessions/{bob}", BOB)
            # The forks outlive the connection; end them.
        for sid in forks + [from_cp]:
            assert broker.api("DELETE", f"/v1/sessions/{sid}", ALICE).status_code == 204
    asyncio.run(main())


def value(r):
    """A tool result's texts, which must not be an error."""
    assert not r.is_error, texts(r)
    return texts(r)


@needs_criu
def test_pause_and_resume_through_the_sdk(broker):
    """Issue 37 through MCP: a session paused to disk comes back on its next run_python, or
    on resume_session, with its variables; another user's session is a missing one."""
    async def main():
        async with http_client(broker) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            assert {"pause_session", "resume_session"} <= tools, sorted(tools)
            value(await client.call_tool("run_python", {"code": "kept = [1, 2, 3]\nit = iter(kept); next(it)"}))
            paused = json.loads(value(await client.call_tool("pause_session", {}))[0])
            assert paused["state"] == "paused" and paused["image_bytes"] > 0, paused
            sid = paused["id"]
            assert broker.api("GET", f"/v1/sessions/{sid}").json()["state"] == "paused"
            # The next use resumes it.
            assert value(await client.call_tool("run_python", {"code": "(kept, next(it))"})) == ["([1, 2, 3], 2)"]
            value(await client.call_tool("pause_session", {}))
            resumed = json.loads(value(await client.call_tool("resume_session", {}))[0])
            assert resumed["state"] == "idle", resumed
            assert value(await client.call_tool("run_python", {"code": "next(it)"})) == ["3"]

            bob = broker.api("POST", "/v1/sessions", BOB, json={"workspace": "own"}).json()["id"]
            for tool in ("pause_session", "resume_session"):
                r = await client.call_tool(tool, {"session_id": bob})
                assert r.is_error and texts(r) == [f"no session {bob}"], (tool, texts(r))
            assert broker.api("GET", f"/v1/sessions/{bob}", BOB).json()["state"] == "idle"
            broker.api("DELETE", f"/v1/sessions/{bob}", BOB)
            assert broker.api("DELETE", f"/v1/sessions/{sid}", ALICE).status_code == 204
    asyncio.run(main())


@needs_criu
def test_snapshots_through_the_sdk(broker):
    """Issue 37 through MCP: a snapshot of this connection's session, a new session started
    from it (by name) with its variables while the original goes on, listed and deleted;
    another user's snapshot is a missing one."""
    async def main():
        async with http_client(broker) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            assert {"snapshot_session", "list_snapshots", "delete_snapshot"} <= tools, sorted(tools)
            value(await client.call_tool("run_python", {"code": "kept = [1, 2, 3]\nit = iter(kept); next(it)"}))
            snap = json.loads(value(await client.call_tool("snapshot_session", {"name": "step-1"}))[0])
            assert snap["name"] == "step-1" and snap["image_bytes"] > 0, snap
            value(await client.call_tool("run_python", {"code": "kept.append(4)"}))
            made = json.loads(value(await client.call_tool("create_session", {"snapshot": "step-1"}))[0])
            assert value(await client.call_tool("run_python", {"code": "(kept, next(it))", "session_id": made["id"]})) == ["([1, 2, 3], 2)"]
            assert value(await client.call_tool("run_python", {"code": "kept"})) == ["[1, 2, 3, 4]"]
            listed = json.loads(value(await client.call_tool("list_snapshots", {}))[0])
            assert [s["snapshot_id"] for s in listed["snapshots"]] == [snap["snapshot_id"]]

            r = await client.call_tool("snapshot_session", {"name": "bad name"})
            assert r.is_error and "snapshot name" in texts(r)[0], texts(r)
            r = await client.call_tool("create_session", {"snapshot": "no-such"})
            assert r.is_error and "no snapshot" in texts(r)[0], texts(r)
        async with http_client(broker, BOB) as bob:
            r = await bob.call_tool("create_session", {"snapshot": snap["snapshot_id"]})
            assert r.is_error and "no snapshot" in texts(r)[0], texts(r)
            r = await bob.call_tool("delete_snapshot", {"snapshot": snap["snapshot_id"]})
            assert r.is_error, texts(r)
            assert json.loads(value(await bob.call_tool("list_snapshots", {}))[0]) == {"snapshots": []}
        async with http_client(broker) as client:
            value(await client.call_tool("delete_snapshot", {"snapshot": "step-1"}))
            assert json.loads(value(await client.call_tool("list_snapshots", {}))[0]) == {"snapshots": []}
        assert broker.api("DELETE", f"/v1/sessions/{made['id']}", ALICE).status_code == 204
        for s in sessions(broker):
            if s["id"] == snap["session_id"]:
                broker.api("DELETE", f"/v1/sessions/{s['id']}", ALICE)
    asyncio.run(main())
