"""Cluster mode (issue 16) for agents: E2B's own SDK and the official MCP SDK, each pointed at
one address in front of two nodes, a load balancer with no sticky sessions (a round robin:
each HTTP request to the next node). Whichever node a request reaches forwards it to the
node that holds the sandbox or the MCP session, so the SDKs work as against one broker.
"""
import asyncio
import http.client
import itertools
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from cluster_nodes import database, node, pg_server  # noqa: F401 (fixtures)
from conftest import ALICE, BOB, wait_for
from mcp_flow import run_flow, texts

e2b_ci = pytest.importorskip("e2b_code_interpreter")

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-connection", "host", "content-length"}


class RoundRobin:
    """An HTTP load balancer on 127.0.0.1 sending each request to the next upstream in turn,
    streaming answers back as they come (SSE, Connect streams). Counts requests per
    upstream."""

    def __init__(self, upstreams):
        self.upstreams = [urllib.parse.urlsplit(u) for u in upstreams]
        self.turn = itertools.cycle(range(len(upstreams)))
        self.counts = [0] * len(upstreams)
        self.lock = threading.Lock()
        balancer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def relay(self):
                with balancer.lock:
                    i = next(balancer.turn)
                    balancer.counts[i] += 1
                up = balancer.upstreams[i]
                body = self.read_body()
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=300)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                headers["Host"] = up.netloc
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                self.send_response_only(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                length = resp.getheader("content-length")
                if resp.status in (204, 304) or self.command == "HEAD":
                    self.end_headers()
                elif length is not None:
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    self.wfile.write(resp.read())
                else:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                conn.close()

            def read_body(self):
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("content-length") or 0)
                return self.rfile.read(n) if n else None

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def balanced(database):
    """Nodes A and B of one cluster behind a round robin."""
    a = node(database)
    b = node(database)
    lb = None
    try:
        # Each node sees the other: a session made on B is listed by A.
        p = b.api("POST", "/v1/sessions", json={})
        assert p.status_code == 201, p.text
        probe = p.json()["id"]
        wait_for(lambda: probe in {s["id"] for s in a.api("GET", "/v1/sessions").json()},
                 timeout=30, interval=0.2, what="node A to list node B's session")
        wait_for(lambda: a.api("DELETE", f"/v1/sessions/{probe}").status_code == 204,
                 timeout=30, interval=0.2, what="the probe's deletion through A")
        lb = RoundRobin([a.url, b.url])
        yield lb, a, b
    finally:
        if lb is not None:
            lb.close()
        b.stop()
        a.stop()


def test_e2b_sdk_through_a_round_robin(balanced, monkeypatch):
    from e2b_code_interpreter import Sandbox

    lb, a, b = balanced
    monkeypatch.setenv("E2B_API_URL", lb.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", lb.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    before = list(lb.counts)
    with Sandbox.create(timeout=300) as sbx:
        # Listed by both nodes, whichever holds it.
        for n in (a, b):
            assert sbx.sandbox_id in {s["id"] for s in n.api("GET", "/v1/sessions").json()}
        # State across calls that land on alternating nodes.
        for i in range(4):
            ex = sbx.run_code(f"n = globals().get('n', 0) + 1\nprint('call', {i}, n)")
            assert ex.error is None, ex.error
            assert "".join(ex.logs.stdout) == f"call {i} {i + 1}\n"
        ex = sbx.run_code("d = {}\nd['missing']")
        assert ex.error is not None and ex.error.name == "KeyError"
        # envd: files and commands.
        sbx.files.write("cluster.csv", "a,b\n1,2\n")
        assert sbx.files.read("cluster.csv") == "a,b\n1,2\n"
        ex = sbx.run_code("import pandas as pd\nint(pd.read_csv('cluster.csv')['b'].sum())")
        assert ex.error is None and ex.text == "2", (ex.error, ex.text)
        r = sbx.commands.run("cat /workspace/cluster.csv | wc -l")
        assert r.exit_code == 0 and r.stdout.strip() == "2", r
        assert sbx.is_running()
        listed = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sbx.sandbox_id in listed
        sid = sbx.sandbox_id
    # Killed on leaving the block (through whichever node): gone from both.
    for n in (a, b):
        wait_for(lambda n=n: n.api("GET", f"/v1/sessions/{sid}").status_code == 404,
                 timeout=30, interval=0.2, what="the sandbox to be gone")
    used = [now - was for now, was in zip(lb.counts, before)]
    assert min(used) >= 5, f"both nodes took requests: {used}"


def test_mcp_sdk_through_a_round_robin(balanced):
    lb, a, b = balanced

    def sessions(n, token=ALICE):
        return {s["id"] for s in n.api("GET", "/v1/sessions", token).json()}

    async def main():
        before = list(lb.counts)
        existing = sessions(a)
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {ALICE}"},
                                  timeout=httpx2.Timeout(30, read=300))
        async with Client(streamable_http_client(lb.url + "/mcp", http_client=http)) as client:
            assert client.server_info.name == "kernel-broker"
            await run_flow(client, "cluster-sales.csv")
            for i in range(3):
                r = await client.call_tool("run_python", {"code": f"len(df) + {i}"})
                assert texts(r) == [str(3 + i)], texts(r)
            own = sessions(a) - existing
            assert len(own) == 1 and own == sessions(b) - existing, own
            listed = json.loads(texts(await client.call_tool("list_sessions", {}))[0])
            assert [s["id"] for s in listed["sessions"] if s["this_connection"]] == list(own)
            # Bob sees none of it on either node.
            assert not own & (sessions(a, BOB) | sessions(b, BOB))
        used = [now - was for now, was in zip(lb.counts, before)]
        assert min(used) >= 5, f"both nodes took requests: {used}"
        # Closing the MCP session (DELETE through whichever node) ends its broker session.
        wait_for(lambda: not (own & sessions(a)), timeout=30, interval=0.2,
                 what="the MCP session's session to end")
        assert not own & sessions(b)

    asyncio.run(main())
