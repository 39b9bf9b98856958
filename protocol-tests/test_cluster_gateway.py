"""Cluster mode (issue 16) through a real `jupyter server --gateway-url` pointed at the
*other* node: two brokers, A and B, on one PostgreSQL database; the jupyter server only knows
B. A session held by A is listed, opened in a notebook and executed through B (B forwards
the kernels API and splices the channels WebSocket to A), and it is the same kernel: state
set through A is read in the notebook, state set in the notebook is read through A. A kernel
started through jupyter server is placed by B on the node with the most headroom (A here),
works over the channels, and deleting it through jupyter server removes it cluster-wide.

PostgreSQL and the nodes: cluster_nodes.py.
"""
import uuid

import pytest

from cluster_nodes import database, holder, node, node_id, pg_server, sql  # noqa: F401 (fixtures)
from conftest import ALICE, BOB, wait_for
from test_gateway import JupyterServer, clients  # noqa: F401 (a fixture)
from test_jupyter_client import parent_id

def listed(broker, path, token=ALICE):
    r = broker.api("GET", path, token=token)
    assert r.status_code == 200, f"GET {path} on {broker.url}: {r.status_code} {r.text}"
    return {x["id"] for x in r.json()}


def rest_execute(broker, sid, code):
    r = broker.api("POST", f"/v1/sessions/{sid}/execute", json={"code": code})
    assert r.status_code == 200, f"execute on {broker.url}: {r.status_code} {r.text}"
    x = r.json()
    assert x["status"] == "ok", x
    return x


def main_result(x):
    return next((r["data"]["text/plain"] for r in x["results"] if r.get("is_main_result")),
                None)


class Cluster:
    """Nodes A and B, the session `held_by_a` (made before B existed, `x = 41` set in it
    through A) and `probe`, a session held by B (it makes B's headroom the smaller one:
    B is sized for 2 sessions)."""

    def __init__(self, database):
        self.database = database
        self.a = self.b = None
        self.sessions = []

    def stop(self):
        for sid in self.sessions:
            for n in (self.a, self.b):
                if n is not None and n.proc.poll() is None:
                    try:
                        n.api("DELETE", f"/v1/sessions/{sid}", timeout=30)
                        break
                    except Exception:
                        pass
        for n in (self.b, self.a):
            if n is not None:
                n.stop()


@pytest.fixture(scope="module")
def cluster(database):
    c = Cluster(database)
    try:
        c.a = node(database)
        s = c.a.api("POST", "/v1/sessions", json={})
        assert s.status_code == 201, s.text
        c.held_by_a = s.json()["id"]
        c.sessions.append(c.held_by_a)
        assert holder(database, c.held_by_a) == node_id(c.a)
        x = rest_execute(c.a, c.held_by_a, "x = 41")
        c.first_count = x["execution_count"]

        c.b = node(database, "--node-capacity-sessions", "2")
        assert node_id(c.a) != node_id(c.b)
        # B sees A: B's list gathers A's session.
        wait_for(lambda: c.held_by_a in listed(c.b, "/v1/sessions"), timeout=30,
                 interval=0.2, what="node B to list node A's session")
        # A sees B: a session B holds shows in A's list (and A forwards to B).
        p = c.b.api("POST", "/v1/sessions", json={})
        assert p.status_code == 201, p.text
        c.probe = p.json()["id"]
        c.sessions.append(c.probe)
        assert holder(database, c.probe) == node_id(c.b), \
            "a session asked of B while B has more headroom than A stays on B"
        wait_for(lambda: c.probe in listed(c.a, "/v1/sessions"), timeout=30,
                 interval=0.2, what="node A to list node B's session")
        assert main_result(rest_execute(c.a, c.probe, "'probe on B'")) == "'probe on B'"
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def jupyter(cluster):
    """jupyter server in gateway mode, knowing node B only."""
    js = JupyterServer(cluster.b.url, ALICE)
    yield js
    js.stop()



# ---------------------------------------------------------------------------------------


def test_a_session_of_node_a_in_a_notebook_through_node_b(cluster, jupyter, clients):
    a, b, sid = cluster.a, cluster.b, cluster.held_by_a
    # B's list (what jupyter server's GatewayClient reads) gathers A's session. jupyter
    # server itself lists only the kernels it started or was asked to connect to
    # (jupyter_server's GatewayMappingKernelManager.list_kernels filters B's list by them),
    # so it shows up in jupyter server's list once the notebook has it, below.
    assert sid in listed(b, "/api/kernels")
    r = jupyter.api("GET", "/api/kernels")
    assert r.status_code == 200, r.text + jupyter.log()

    # Opened in a notebook (JupyterLab's POST /api/sessions with the kernel's id): jupyter
    # server asks B for the kernel (GET /api/kernels/{id}, forwarded to A).
    r = jupyter.api("POST", "/api/sessions", json={
        "path": "cluster.ipynb", "name": "cluster.ipynb", "type": "notebook",
        "kernel": {"id": sid, "name": "python3"}})
    assert r.status_code == 201, r.text + jupyter.log()
    notebook = r.json()
    try:
        assert notebook["kernel"]["id"] == sid
        # Now jupyter server lists it, its model refreshed from B's gathered list (a kernel
        # missing from it would be taken as culled on the gateway).
        r = jupyter.api("GET", "/api/kernels")
        assert r.status_code == 200, r.text + jupyter.log()
        assert sid in {k["id"] for k in r.json()}, r.json()
        one = jupyter.api("GET", f"/api/kernels/{sid}")
        assert one.status_code == 200, one.text + jupyter.log()
        assert one.json()["id"] == sid
        assert sid in {s["kernel"]["id"] for s in jupyter.api("GET", "/api/sessions").json()}
        c = clients(jupyter.ws(sid, session_id=str(uuid.uuid4())))
        reply, _ = c.request("kernel_info_request")
        assert reply["content"]["status"] == "ok"
        # x was set through A; read (and y set) through jupyter server -> B -> A.
        ex = c.run("print('notebook via B sees x =', x)\ny = x + 1\ny")
        assert ex.reply["content"]["status"] == "ok", ex.reply["content"]
        assert ex.stdout == "notebook via B sees x = 41\n"
        assert ex.result == "42"
        # One kernel, one execution counter: the notebook's cell came after A's.
        count = ex.reply["content"]["execution_count"]
        assert count == cluster.first_count + 1
        # The session has not moved: A still holds it.
        assert holder(cluster.database, sid) == node_id(a)

        # Back through A: the notebook's variable, the next execution count.
        x = rest_execute(a, sid, "y * 2")
        assert main_result(x) == "84", x
        assert x["execution_count"] == count + 1
        # A's execution's output reaches the notebook live, through B's spliced socket.
        x = rest_execute(a, sid, "print('agent on A wrote', y)")
        assert x["stdout"] == "agent on A wrote 42\n", x
        c.recv_until(lambda m: m["msg_type"] == "stream"
                     and "agent on A wrote 42" in m["content"]["text"],
                     what="A's execution's output in the notebook")
        # And B's own REST answers for it (forwarded) agree.
        assert main_result(rest_execute(b, sid, "y")) == "42"
        # Not bob's, on either node.
        assert sid not in listed(a, "/api/kernels", token=BOB)
        assert sid not in listed(b, "/api/kernels", token=BOB)
        assert b.api("GET", f"/api/kernels/{sid}", token=BOB).status_code == 404
    finally:
        d = jupyter.api("DELETE", f"/api/sessions/{notebook['id']}")
    assert d.status_code == 204, d.text + jupyter.log()
    # Closing the notebook shuts its kernel down (jupyter server's DELETE /api/kernels/{id}
    # to B, forwarded to A). The session is the agent's (the REST API made it), so Jupyter
    # only lets go of it: A records the detach and the session goes on, with its variables.
    def detached():
        r = a.api("GET", f"/v1/sessions/{sid}/events?type=session_detached")
        return r.status_code == 200 and [e["detail"] for e in r.json()["events"]]
    wait_for(detached, timeout=30, interval=0.2, what="A to record Jupyter's detach")
    assert detached() == [{"by": "jupyter"}]
    assert main_result(rest_execute(b, sid, "y")) == "42"
    # Its owner's API ends it: gone cluster-wide.
    assert b.api("DELETE", f"/v1/sessions/{sid}").status_code == 204
    wait_for(lambda: a.api("GET", f"/api/kernels/{sid}").status_code == 404, timeout=30,
             interval=0.2, what="A's session to end")
    assert b.api("GET", f"/api/kernels/{sid}").status_code == 404
    assert sid not in listed(a, "/api/kernels") | listed(b, "/api/kernels")
    cluster.sessions.remove(sid)


def test_a_kernel_started_through_jupyter_server_on_b(cluster, jupyter, clients):
    a, b = cluster.a, cluster.b
    r = jupyter.api("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text + jupyter.log()
    kid = r.json()["id"]
    try:
        # Placement: B (sized for 2 sessions, holding the probe) has less headroom than A.
        where = holder(cluster.database, kid)
        assert where == node_id(a), \
            f"placed on {where}, not A ({node_id(a)}, B is {node_id(b)}): the most headroom"
        for n in (a, b):
            assert kid in listed(n, "/api/kernels"), n.url
            assert n.api("GET", f"/api/kernels/{kid}").status_code == 200
        assert kid in {k["id"] for k in jupyter.api("GET", "/api/kernels").json()}

        c = clients(jupyter.ws(kid))
        ex = c.run("1+1")
        assert ex.reply["content"]["status"] == "ok", ex.reply["content"]
        assert ex.result == "2"
        ex = c.run("import os\nprint('pid', os.getpid() > 0)")
        assert ex.stdout == "pid True\n"
        assert all(parent_id(m) for m in ex.iopub)
        # The same kernel through both nodes' REST.
        c.run("z = 'set in the gateway kernel'")
        assert main_result(rest_execute(a, kid, "z")) == "'set in the gateway kernel'"
        assert main_result(rest_execute(b, kid, "z")) == "'set in the gateway kernel'"
    finally:
        d = jupyter.api("DELETE", f"/api/kernels/{kid}")
    assert d.status_code == 204, d.text + jupyter.log()
    for n in (a, b):
        assert kid not in listed(n, "/api/kernels"), n.url
        assert kid not in listed(n, "/v1/sessions"), n.url
        assert n.api("GET", f"/api/kernels/{kid}").status_code == 404, n.url
    assert kid not in {k["id"] for k in jupyter.api("GET", "/api/kernels").json()}
    # Its recording ended (the kernel's node closed it).
    wait_for(lambda: sql(cluster.database,
                         f"SELECT ended_at IS NOT NULL FROM sessions WHERE id = '{kid}'")
             == [["t"]], timeout=15, what="the recording to end")
