"""A real `jupyter server --gateway-url=<broker>` in front of the broker, driven through
jupyter_server's own REST and WebSocket API the way JupyterLab drives it. Every kernel
operation here goes through jupyter_server's GatewayClient / GatewayKernelManager /
GatewayWebSocketConnection, the canonical client of a kernel gateway.
"""
import base64
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import requests

from conftest import ALICE, BOB, wait_for
from test_jupyter_client import (
    PNG_MAGIC,
    TICKS,
    AgentStream,
    KernelWS,
    is_status,
    parent_id,
    summary,
    ticks_in,
)

VENV_BIN = Path(__file__).resolve().parent / ".venv" / "bin"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterServer:
    """`jupyter server` in gateway mode, on 127.0.0.1 only, with its own config dirs."""

    def __init__(self, broker_url, gateway_token, app="server", extra_args=()):
        self.tmp = tempfile.mkdtemp(prefix="kb-gateway-")
        root = Path(self.tmp) / "root"
        root.mkdir()
        self.port = free_port()
        self.token = uuid.uuid4().hex
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_base = f"ws://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JUPYTER_", "KERNEL_"))}
        env.update({
            "JUPYTER_CONFIG_DIR": str(Path(self.tmp) / "config"),
            "JUPYTER_DATA_DIR": str(Path(self.tmp) / "data"),
            "JUPYTER_RUNTIME_DIR": str(Path(self.tmp) / "runtime"),
            "JUPYTER_PLATFORM_DIRS": "1",
            "HOME": self.tmp,
        })
        self.log_path = Path(self.tmp) / "server.log"
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen([
            str(VENV_BIN / "jupyter"), app,
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.open_browser=False",
            f"--ServerApp.root_dir={root}",
            f"--gateway-url={broker_url}",
            f"--GatewayClient.auth_token={gateway_token}",
            "--GatewayClient.auth_scheme=token",
            "--GatewayClient.request_timeout=60",
            "--GatewayClient.connect_timeout=30",
            "--ServerApp.log_level=DEBUG",
            *(["--allow-root"] if os.geteuid() == 0 else []),
            *extra_args,
        ], stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(self._answers, timeout=90, interval=0.3, what="jupyter server to answer")
        except AssertionError:
            self.stop()
            raise AssertionError("jupyter server did not start:\n" + self.log())

    def _answers(self):
        if self.proc.poll() is not None:
            raise AssertionError("jupyter server exited:\n" + self.log())
        try:
            return self.api("GET", "/api/status", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def api(self, method, path, **kw):
        kw.setdefault("timeout", 90)
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return requests.request(method, self.url + path, headers=headers, **kw)

    def ws(self, kernel_id, **kw):
        return KernelWS(None, kernel_id, token=self.token, base=self.ws_base, **kw)

    def log(self):
        try:
            return self.log_path.read_text()[-8000:]
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def jupyter(broker):
    js = JupyterServer(broker.url, ALICE)
    yield js
    js.stop()


@pytest.fixture
def clients():
    opened = []

    def track(c):
        opened.append(c)
        return c

    yield track
    for c in opened:
        c.close()


def broker_kernel_ids(broker, token=ALICE):
    r = broker.api("GET", "/api/kernels", token=token)
    assert r.status_code == 200
    return {k["id"] for k in r.json()}


def start_through_gateway(jupyter, body=None):
    r = jupyter.api("POST", "/api/kernels", json=body or {"name": "python3"})
    assert r.status_code == 201, r.text + jupyter.log()
    return r.json()


# ---------------------------------------------------------------------------------------


def test_kernelspecs_are_proxied(jupyter, broker):
    r = jupyter.api("GET", "/api/kernelspecs")
    assert r.status_code == 200, r.text
    body = r.json()
    ours = broker.api("GET", "/api/kernelspecs").json()
    assert body["default"] == ours["default"] == "python3"
    assert set(body["kernelspecs"]) == set(ours["kernelspecs"])
    assert (body["kernelspecs"]["python3"]["spec"]["display_name"]
            == ours["kernelspecs"]["python3"]["spec"]["display_name"])
    one = jupyter.api("GET", "/api/kernelspecs/python3")
    assert one.status_code == 200, one.text
    assert one.json()["name"] == "python3"


def test_notebook_kernel_through_the_gateway(jupyter, broker, clients):
    model = start_through_gateway(jupyter)
    kid = model["id"]
    try:
        assert model["name"] == "python3"
        # The kernel is the broker's, owned by the gateway's token (alice), not bob's.
        assert kid in broker_kernel_ids(broker)
        assert kid not in broker_kernel_ids(broker, BOB)
        # jupyter server's kernel list refreshes every model from the broker's list
        # (parsing last_activity); a format it cannot parse would make this a 500.
        listed = jupyter.api("GET", "/api/kernels")
        assert listed.status_code == 200, listed.text + jupyter.log()
        assert kid in [k["id"] for k in listed.json()]
        got = jupyter.api("GET", f"/api/kernels/{kid}")
        assert got.status_code == 200 and got.json()["id"] == kid

        c = clients(jupyter.ws(kid))
        reply, _ = c.request("kernel_info_request")
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["protocol_version"].startswith("5.")
        assert c.run("answer = 6 * 7").reply["content"]["status"] == "ok"
        ex = c.run("print('via gateway')\nanswer")
        assert ex.result == "42" and ex.stdout == "via gateway\n"

        ex = c.run("import matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\nplt.show()",
                   timeout=120)
        pngs = [m for m in ex.of_type("display_data") if "image/png" in m["content"]["data"]]
        assert pngs, [summary(m) for m in ex.iopub]
        assert base64.b64decode(pngs[0]["content"]["data"]["image/png"]).startswith(PNG_MAGIC)

        ex = c.run("1 / 0")
        assert ex.reply["content"]["ename"] == "ZeroDivisionError"
        assert ex.of_type("error")[0]["content"]["traceback"]

        # stdin through the proxy.
        req = c.execute("who = input('who? ')", allow_stdin=True)
        got = c.recv_until(lambda m: m["msg_type"] == "input_request", what="input_request")
        assert got[-1]["channel"] == "stdin"
        c.send("stdin", "input_reply", {"value": "gateway"}, parent=got[-1]["header"])
        assert c.wait_execution(req, got=got).reply["content"]["status"] == "ok"
        assert c.run("who").result == "'gateway'"

        # Interrupt through jupyter server's REST API.
        req = c.execute("import time\nprint('zzz', flush=True)\ntime.sleep(30)")
        got = c.recv_until(lambda m: m["msg_type"] == "stream" and parent_id(m) == req["header"]["msg_id"],
                           what="the sleeping cell to start")
        r = jupyter.api("POST", f"/api/kernels/{kid}/interrupt", json={})
        assert r.status_code == 204, r.text
        ex = c.wait_execution(req, timeout=20, got=got)
        assert ex.reply["content"]["ename"] == "KeyboardInterrupt"

        # Restart through jupyter server's REST API: state is gone, the socket still works.
        r = jupyter.api("POST", f"/api/kernels/{kid}/restart", json={})
        assert r.status_code == 200, r.text + jupyter.log()
        assert r.json()["id"] == kid
        c.recv_until(lambda m: is_status(m, "restarting"), what="status restarting")
        ex = c.run("answer")
        assert ex.reply["content"]["ename"] == "NameError"
        assert kid in broker_kernel_ids(broker)
    finally:
        d = jupyter.api("DELETE", f"/api/kernels/{kid}")
    assert d.status_code == 204, d.text
    assert broker.api("GET", f"/api/kernels/{kid}").status_code == 404
    assert kid not in [k["id"] for k in jupyter.api("GET", "/api/kernels").json()]


def test_jupyterlab_session_through_the_gateway(jupyter, broker, clients):
    """What JupyterLab does when it opens a notebook: POST /api/sessions."""
    r = jupyter.api("POST", "/api/sessions", json={
        "path": "analysis.ipynb", "name": "analysis.ipynb", "type": "notebook",
        "kernel": {"name": "python3"}})
    assert r.status_code == 201, r.text + jupyter.log()
    session = r.json()
    kid = session["kernel"]["id"]
    try:
        assert session["path"] == "analysis.ipynb"
        assert kid in broker_kernel_ids(broker)
        listed = jupyter.api("GET", "/api/sessions")
        assert listed.status_code == 200, listed.text
        assert session["id"] in [s["id"] for s in listed.json()]
        # JupyterLab connects with the session's id as the client's session_id... its own.
        c = clients(jupyter.ws(kid, session_id=str(uuid.uuid4())))
        ex = c.run("import os\nprint(os.getpid() > 0)\n'lab'")
        assert ex.result == "'lab'" and ex.stdout == "True\n"
    finally:
        d = jupyter.api("DELETE", f"/api/sessions/{session['id']}")
    assert d.status_code == 204, d.text
    wait_for(lambda: broker.api("GET", f"/api/kernels/{kid}").status_code == 404, timeout=20,
             what="the broker's session to go with the notebook's")


def test_agent_session_opened_in_a_notebook_through_the_gateway(jupyter, broker, clients):
    """An agent's session, adopted by JupyterLab through jupyter server's sessions API
    (`kernel: {id}`), is the same kernel: the notebook sees the agent's variables and the
    output of the agent's executions, live."""
    s = broker.api("POST", "/v1/sessions", json={})
    assert s.status_code == 201, s.text
    sid = s.json()["id"]
    try:
        ex = broker.api("POST", f"/v1/sessions/{sid}/execute",
                        json={"code": "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})"})
        assert ex.json()["status"] == "ok", ex.text
        r = jupyter.api("POST", "/api/sessions", json={
            "path": "agent.ipynb", "name": "agent.ipynb", "type": "notebook",
            "kernel": {"id": sid, "name": "python3"}})
        assert r.status_code == 201, r.text + jupyter.log()
        assert r.json()["kernel"]["id"] == sid
        c = clients(jupyter.ws(sid))
        assert c.run("int(df['a'].sum())").result == "6"
        agent = AgentStream(broker, sid)
        try:
            agent.send({"type": "execute", "id": "a1", "code": "print('agent is working')"})
            agent.until(lambda f: f.get("type") == "done", what="the agent's done")
        finally:
            agent.close()
        c.recv_until(lambda m: m["msg_type"] == "stream"
                     and "agent is working" in m["content"]["text"],
                     what="the agent's output in the notebook")
        jupyter.api("DELETE", f"/api/sessions/{r.json()['id']}")
    finally:
        broker.api("DELETE", f"/v1/sessions/{sid}")


def test_reconnect_through_the_gateway_gets_missed_output(jupyter, clients):
    """The browser's socket to jupyter server drops mid-cell and comes back with the same
    session_id; jupyter server reconnects to the broker with it, and the output produced
    meanwhile arrives."""
    kid = start_through_gateway(jupyter)["id"]
    try:
        sid = str(uuid.uuid4())
        first = jupyter.ws(kid, session_id=sid)
        req = first.execute(TICKS)
        first.recv_until(lambda m: ticks_in([m]), what="the first tick")
        first.close()
        before = ticks_in(first.seen)
        time.sleep(5.5)
        second = clients(jupyter.ws(kid, session_id=sid))
        ex = second.wait_execution(req, timeout=30)
        after = ticks_in(second.seen)
        assert sorted(set(before + after)) == list(range(8)), (before, after)
        assert ex.reply["content"]["status"] == "ok"
    finally:
        jupyter.api("DELETE", f"/api/kernels/{kid}")


def test_comm_buffers_do_not_break_the_gateway_connection(jupyter, clients):
    """jupyter server's gateway proxy decodes every frame from the gateway as UTF-8 text, so
    one binary frame kills its read loop and the notebook silently stops receiving. The
    broker sends that proxy text frames only: a kernel message with binary buffers
    (ipywidgets, bqplot...) arrives without its buffers, and the connection lives on.
    Buffers from the browser to the kernel (binary frames the proxy passes on) do arrive."""
    from test_jupyter_client import ECHO_TARGET
    kid = start_through_gateway(jupyter)["id"]
    try:
        c = clients(jupyter.ws(kid))
        ex = c.run("from comm import create_comm\n"
                   "kc = create_comm(target_name='t', data={'x': 1}, buffers=[bytes(range(256))])\n"
                   "kc.send({'y': 2}, buffers=[b'\\xff\\xfe\\x00'])\n"
                   "'after buffers'", timeout=30)
        assert ex.result == "'after buffers'"
        opens = ex.of_type("comm_open")
        assert opens and opens[0]["content"]["data"] == {"x": 1}
        assert ex.of_type("comm_msg")[0]["content"]["data"] == {"y": 2}
        assert c.run("'still alive'", timeout=30).result == "'still alive'"
        # Browser to kernel: jupyter_server's proxy passes a binary frame from the browser
        # on as a *text* frame (tornado's write_message(bytes) without binary=True), which
        # RFC 6455 makes the broker refuse (1007). The buffers are lost upstream; what the
        # broker guarantees is that the proxy's reconnect (same session_id) resumes the
        # notebook's connection with nothing else lost.
        assert c.run(ECHO_TARGET).reply["content"]["status"] == "ok"
        comm_id = uuid.uuid4().hex
        c.send("shell", "comm_open", {"comm_id": comm_id, "target_name": "echo", "data": {}})
        c.recv_until(lambda m: m["msg_type"] == "comm_msg"
                     and m["content"].get("comm_id") == comm_id, what="the echo's greeting")
        c.send("shell", "comm_msg", {"comm_id": comm_id, "data": {"n": 1}},
               buffers=[b"\x00\x01\x02\xff", b"abc"])
        time.sleep(3)  # the proxy notices and reconnects (GatewayClient.gateway_retry_interval)
        assert c.run("'alive after binary'", timeout=60).result == "'alive after binary'"
    finally:
        jupyter.api("DELETE", f"/api/kernels/{kid}")


def test_idle_expiry_looks_like_culling_to_jupyter_server(fresh_broker):
    """A kernel the broker expired answers 410 to the gateway; jupyter server treats it as
    culled on the gateway: it drops it from its kernels and sessions, and nothing 500s."""
    b = fresh_broker(["--idle-timeout", "3"])
    js = JupyterServer(b.url, ALICE)
    try:
        kid = start_through_gateway(js)["id"]
        s = js.api("POST", "/api/sessions", json={
            "path": "idle.ipynb", "name": "idle.ipynb", "type": "notebook",
            "kernel": {"name": "python3"}})
        assert s.status_code == 201, s.text
        wait_for(lambda: b.api("GET", f"/api/kernels/{kid}").status_code == 410, timeout=30,
                 interval=0.5, what="the broker to expire the idle kernel")
        wait_for(lambda: b.api("GET", f"/api/kernels/{s.json()['kernel']['id']}").status_code
                 == 410, timeout=30, interval=0.5, what="the session's kernel to expire")
        listed = js.api("GET", "/api/kernels")
        assert listed.status_code == 200, listed.text + js.log()
        assert listed.json() == []
        sessions = js.api("GET", "/api/sessions")
        assert sessions.status_code == 200, sessions.text + js.log()
        assert sessions.json() == []
        assert js.api("GET", f"/api/kernels/{kid}").status_code == 404
        # And a new kernel through the same jupyter server works.
        kid2 = start_through_gateway(js)["id"]
        c = js.ws(kid2)
        try:
            assert c.run("'fresh'").result == "'fresh'"
        finally:
            c.close()
        js.api("DELETE", f"/api/kernels/{kid2}")
    finally:
        js.stop()
