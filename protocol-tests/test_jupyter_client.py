"""The Jupyter kernels API of the broker, driven the way real Jupyter clients drive it.

REST answers are parsed as jupyter_server's GatewayClient parses them (the `last_activity`
format, `connections` as an int, 201 + Location, 204s). WebSocket messages are made with
`jupyter_client.session.Session` (its `msg()` and its JSON packer) and sent over
websocket-client to `/api/kernels/{id}/channels`, in Jupyter's legacy JSON framing and in
the `v1.kernel.websocket.jupyter.org` binary framing; frames are decoded with jupyter_server's
own codecs (`deserialize_binary_message`, `deserialize_msg_from_ws_v1`). One test also drives
the kernel through jupyter_server's `GatewayKernelClient`, a real `AsyncKernelClient` that
talks WebSocket.
"""
import base64
import datetime
import json
import os
import struct
import time
import uuid
from urllib.parse import quote

import pytest
import requests
import websocket
from jupyter_client.jsonutil import extract_dates
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_binary_message,
    serialize_msg_to_ws_v1,
)

from conftest import ALICE, BOB, wait_for

V1 = "v1.kernel.websocket.jupyter.org"
# Seconds any single wait for a frame may take before the test fails.
RECV_TIMEOUT = 30
KERNEL_STATES = {"starting", "idle", "busy", "restarting", "autorestarting", "dead"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------
# A Jupyter client over WebSocket


class KernelWS:
    """One notebook-frontend connection to `/api/kernels/{id}/channels`.

    Messages are built by jupyter_client's Session and serialised with its packer; frames
    from the broker are decoded with jupyter_server's codecs. Every received message is kept
    in `self.seen` (with its channel and whether it came as a binary frame).
    """

    def __init__(self, broker, kernel_id, token=ALICE, session_id=None, v1=False,
                 auth="header", connect_timeout=RECV_TIMEOUT, base=None):
        """`base` (e.g. ws://127.0.0.1:PORT) connects to another server than the broker,
        such as a jupyter server in gateway mode."""
        self.kernel_id = kernel_id
        self.session = Session(key=b"", username="protocol-test",
                               **({"session": session_id} if session_id else {}))
        if session_id:
            # jupyter_client numbers msg_ids per Session object ("<session>_<pid>_<n>"); a
            # second client object with the same session_id must not repeat them.
            self.session.message_count = int.from_bytes(os.urandom(4), "big")
        self.v1 = v1
        base = base or f"ws://{broker.host}"
        url = (f"{base}/api/kernels/{kernel_id}/channels"
               f"?session_id={quote(self.session.session)}")
        headers = []
        if auth == "header":
            headers.append(f"Authorization: token {token}")
        elif auth == "query":
            url += f"&token={quote(token)}"
        self.ws = websocket.create_connection(
            url, header=headers, subprotocols=[V1] if v1 else None, timeout=connect_timeout)
        self.seen = []

    # -- sending

    def send(self, channel, msg_type, content=None, parent=None, buffers=(), metadata=None):
        msg = self.session.msg(msg_type, content if content is not None else {},
                               parent=parent, metadata=metadata)
        self.send_msg(channel, msg, buffers)
        return msg

    def send_msg(self, channel, msg, buffers=()):
        if self.v1:
            parts = [self.session.pack(msg[k])
                     for k in ("header", "parent_header", "metadata", "content")]
            self.ws.send_binary(serialize_msg_to_ws_v1(parts + list(buffers), channel))
        elif buffers:
            framed = dict(msg, channel=channel, buffers=list(buffers))
            self.ws.send_binary(serialize_binary_message(framed))
        else:
            self.ws.send(self.session.pack(dict(msg, channel=channel)).decode())

    # -- receiving

    def recv(self, timeout=RECV_TIMEOUT):
        """The next Jupyter message; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message from the broker in time")
            self.ws.settimeout(left)
            try:
                opcode, data = self.ws.recv_data()
            except websocket.WebSocketTimeoutException:
                raise TimeoutError("no message from the broker in time") from None
            if opcode == websocket.ABNF.OPCODE_TEXT:
                msg = json.loads(data.decode("utf-8"))
                msg.setdefault("buffers", [])
                msg["_binary"] = False
            elif opcode == websocket.ABNF.OPCODE_BINARY:
                msg = decode_v1(data) if self.v1 else deserialize_binary_message(data)
                msg["_binary"] = True
            else:
                continue
            msg["msg_type"] = msg["header"]["msg_type"]
            self.seen.append(msg)
            return msg

    def recv_until(self, pred, timeout=RECV_TIMEOUT, what="a message"):
        """Messages up to and including the first that satisfies `pred`."""
        deadline = time.monotonic() + timeout
        got = []
        while True:
            left = deadline - time.monotonic()
            try:
                m = self.recv(max(left, 0.001))
            except TimeoutError:
                raise AssertionError(
                    f"timed out waiting for {what}; got {[summary(x) for x in got]}") from None
            got.append(m)
            if pred(m):
                return got

    def drain(self, quiet=1.0):
        """Messages until none arrives for `quiet` seconds."""
        got = []
        while True:
            try:
                got.append(self.recv(quiet))
            except TimeoutError:
                return got

    # -- requests

    def request(self, msg_type, content=None, channel="shell", timeout=RECV_TIMEOUT, **kw):
        """Send a request; return (reply, every message received meanwhile)."""
        req = self.send(channel, msg_type, content, **kw)
        got = self.recv_until(lambda m: is_reply_to(m, req), timeout,
                              what=f"the reply to {msg_type}")
        return got[-1], got

    def execute(self, code, allow_stdin=False, silent=False, stop_on_error=True):
        return self.send("shell", "execute_request", {
            "code": code, "silent": silent, "store_history": not silent,
            "user_expressions": {}, "allow_stdin": allow_stdin, "stop_on_error": stop_on_error,
        })

    def run(self, code, timeout=60, **kw):
        """Execute and wait for both the execute_reply and the closing idle status."""
        req = self.execute(code, **kw)
        return self.wait_execution(req, timeout)

    def wait_execution(self, req, timeout=60, got=()):
        got = list(got)
        done = lambda: (any(is_reply_to(m, req) for m in got)
                        and any(is_status(m, "idle", req) for m in got))
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            try:
                got.append(self.recv(max(left, 0.001)))
            except TimeoutError:
                raise AssertionError(
                    f"execution did not finish in {timeout}s: {[summary(x) for x in got]}"
                ) from None
        return Execution(req, got)

    def close(self):
        try:
            self.ws.close(timeout=2)
        except Exception:
            pass


class Execution:
    """What one execute_request produced, as seen by the client."""

    def __init__(self, req, msgs):
        self.req = req
        self.msgs = msgs
        mine = [m for m in msgs if parent_id(m) == req["header"]["msg_id"]]
        self.reply = next(m for m in mine if m["msg_type"] == "execute_reply")
        self.iopub = [m for m in mine if m["channel"] == "iopub"]

    def of_type(self, t):
        return [m for m in self.iopub if m["msg_type"] == t]

    @property
    def stdout(self):
        return "".join(m["content"]["text"] for m in self.of_type("stream")
                       if m["content"]["name"] == "stdout")

    @property
    def result(self):
        r = self.of_type("execute_result")
        return r[0]["content"]["data"]["text/plain"] if r else None


def decode_v1(frame):
    """A v1 binary frame as a message dict, checked against the layout as well."""
    count = struct.unpack_from("<Q", frame, 0)[0]
    offsets = struct.unpack_from(f"<{count}Q", frame, 8)
    assert offsets[0] == 8 * (count + 1), "the first part starts right after the offsets"
    assert offsets[-1] == len(frame), "the last offset is the frame's length"
    assert list(offsets) == sorted(offsets)
    channel, parts = deserialize_msg_from_ws_v1(frame)
    assert len(parts) >= 4, "header, parent_header, metadata and content"
    header, parent, metadata, content = (json.loads(p) for p in parts[:4])
    return {"channel": channel, "header": extract_dates(header),
            "parent_header": extract_dates(parent), "metadata": metadata, "content": content,
            "buffers": [bytes(b) for b in parts[4:]]}


def parent_id(m):
    return (m.get("parent_header") or {}).get("msg_id")


def is_reply_to(m, req):
    return (m["channel"] in ("shell", "control")
            and m["msg_type"].endswith("_reply")
            and parent_id(m) == req["header"]["msg_id"])


def is_status(m, state, req=None):
    return (m["channel"] == "iopub" and m["msg_type"] == "status"
            and m["content"].get("execution_state") == state
            and (req is None or parent_id(m) == req["header"]["msg_id"]))


def summary(m):
    c = m.get("content", {})
    extra = c.get("execution_state") or c.get("name") or c.get("status") or ""
    return f"{m.get('channel')}:{m.get('msg_type')}:{extra}"


def ws_base(broker):
    return f"ws://{broker.host}"


# ---------------------------------------------------------------------------------------
# Fixtures


def parse_last_activity(v):
    # Exactly what jupyter_server's GatewayKernelManager.refresh_model does.
    return datetime.datetime.strptime(v, "%Y-%m-%dT%H:%M:%S.%fZ")


def check_kernel_model(model, kernel_id=None):
    assert set(model) >= {"id", "name", "last_activity", "execution_state", "connections"}
    assert str(uuid.UUID(model["id"])) == model["id"]
    if kernel_id:
        assert model["id"] == kernel_id
    assert model["name"] == "python3"
    parse_last_activity(model["last_activity"])
    assert model["execution_state"] in KERNEL_STATES
    assert isinstance(model["connections"], int) and int(model["connections"]) >= 0


def start_kernel(broker, token=ALICE, body=None):
    r = broker.api("POST", "/api/kernels", token=token,
                   json=body if body is not None else {"name": "python3"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.fixture
def kernel(broker):
    kid = start_kernel(broker)
    yield kid
    broker.api("DELETE", f"/api/kernels/{kid}")


@pytest.fixture
def clients():
    """Opens KernelWS clients and closes them at the end."""
    opened = []

    def open_(*a, **kw):
        c = KernelWS(*a, **kw)
        opened.append(c)
        return c

    yield open_
    for c in opened:
        c.close()


# ---------------------------------------------------------------------------------------
# REST


def test_kernelspecs_as_jupyter_parses_them(broker):
    r = broker.api("GET", "/api/kernelspecs")
    assert r.status_code == 200
    body = r.json()
    assert body["default"] == "python3"
    assert "python3" in body["kernelspecs"]
    for name, model in body["kernelspecs"].items():
        assert model["name"] == name
        assert isinstance(model["resources"], dict)
        # jupyter_client's own KernelSpec accepts it.
        spec = KernelSpec(**model["spec"])
        assert spec.display_name and spec.language
    assert body["kernelspecs"]["python3"]["spec"]["language"] == "python"
    # The other languages' specs (issue 38), each as its kernel.json says.
    languages = {n: m["spec"]["language"] for n, m in body["kernelspecs"].items()}
    assert languages == {"python3": "python", "r": "R", "javascript": "typescript",
                         "bash": "bash", "java": "java", "sql": "sql"}, languages
    one = broker.api("GET", "/api/kernelspecs/python3")
    assert one.status_code == 200
    assert one.json() == body["kernelspecs"]["python3"]
    missing = broker.api("GET", "/api/kernelspecs/cobol")
    assert missing.status_code == 404
    assert "message" in missing.json()


def test_kernel_lifecycle_over_rest(broker):
    r = broker.api("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    model = r.json()
    check_kernel_model(model)
    kid = model["id"]
    assert r.headers["Location"] == f"/api/kernels/{kid}"
    try:
        g = broker.api("GET", f"/api/kernels/{kid}")
        assert g.status_code == 200
        check_kernel_model(g.json(), kid)
        listed = broker.api("GET", "/api/kernels").json()
        assert kid in [k["id"] for k in listed]
        for k in listed:
            check_kernel_model(k)
        # jupyter_server sends `{}` with interrupt and restart.
        i = broker.api("POST", f"/api/kernels/{kid}/interrupt", json={})
        assert i.status_code == 204, i.text
        assert i.content == b""
        rs = broker.api("POST", f"/api/kernels/{kid}/restart", json={})
        assert rs.status_code == 200, rs.text
        check_kernel_model(rs.json(), kid)
        assert rs.json()["execution_state"] in {"idle", "starting", "busy"}
        # A restart is activity: last_activity moves forward.
        assert (parse_last_activity(rs.json()["last_activity"])
                >= parse_last_activity(model["last_activity"]))
    finally:
        d = broker.api("DELETE", f"/api/kernels/{kid}")
    assert d.status_code == 204, d.text
    assert broker.api("GET", f"/api/kernels/{kid}").status_code == 404
    assert broker.api("DELETE", f"/api/kernels/{kid}").status_code == 404
    assert kid not in [k["id"] for k in broker.api("GET", "/api/kernels").json()]


def test_start_kernel_with_gateway_body(broker):
    """What jupyter_server's GatewayKernelManager really posts: env with KERNEL_ vars, the
    working dir being a path on the *client's* host."""
    kid = start_kernel(broker, body={"name": "python3", "env": {
        "KERNEL_LAUNCH_TIMEOUT": "40", "KERNEL_WORKING_DIR": "/home/somebody/notebooks",
        "KERNEL_USERNAME": "somebody"}})
    try:
        check_kernel_model(broker.api("GET", f"/api/kernels/{kid}").json(), kid)
    finally:
        broker.api("DELETE", f"/api/kernels/{kid}")
    # An empty body starts the default kernel, as in jupyter_server (`get_json_body()` is
    # None) and Kernel Gateway.
    r = broker.api("POST", "/api/kernels", data=b"")
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "python3"
    broker.api("DELETE", f"/api/kernels/{r.json()['id']}")
    bad = broker.api("POST", "/api/kernels", json={"name": "cobol"})
    assert bad.status_code == 404
    assert "message" in bad.json()
    garbage = broker.api("POST", "/api/kernels", data=b"{not json")
    assert garbage.status_code == 400


def test_token_forms(broker, kernel):
    path = f"/api/kernels/{kernel}"
    url = broker.url + path
    assert requests.get(url, headers={"Authorization": f"token {ALICE}"}, timeout=30).status_code == 200
    assert requests.get(url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=30).status_code == 200
    assert requests.get(url, params={"token": ALICE}, timeout=30).status_code == 200
    assert requests.get(url, timeout=30).status_code == 401
    assert requests.get(url, headers={"Authorization": "token nope"}, timeout=30).status_code == 401
    assert requests.get(broker.url + "/api/kernels", timeout=30).status_code == 401
    assert requests.get(broker.url + "/api/kernelspecs", timeout=30).status_code == 401
    # The WebSocket accepts the header and the query form too, and refuses neither-nor.
    for auth in ("header", "query"):
        c = KernelWS(broker, kernel, auth=auth)
        try:
            reply, _ = c.request("kernel_info_request")
            assert reply["content"]["status"] == "ok"
        finally:
            c.close()
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        KernelWS(broker, kernel, auth="none")
    assert e.value.status_code == 401


def test_other_users_kernels_are_not_found(broker, kernel):
    assert kernel not in [k["id"] for k in broker.api("GET", "/api/kernels", token=BOB).json()]
    for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/interrupt"),
                         ("POST", "/restart")]:
        r = broker.api(method, f"/api/kernels/{kernel}{path}", token=BOB, json={})
        assert r.status_code == 404, (method, path, r.status_code)
        unknown = broker.api(method, f"/api/kernels/{uuid.uuid4()}{path}", json={})
        assert unknown.status_code == 404
        # Bob's answer is the same as for a kernel that does not exist (apart from the id).
        assert r.json()["error"]["code"] == unknown.json()["error"]["code"]
    assert broker.api("GET", "/api/kernels/not-a-uuid").status_code == 404
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        KernelWS(broker, kernel, token=BOB)
    assert e.value.status_code == 404
    # Alice's kernel survived Bob's attempts.
    assert broker.api("GET", f"/api/kernels/{kernel}").status_code == 200


def test_sessions_and_kernels_are_the_same_thing(broker, clients):
    s = broker.api("POST", "/v1/sessions", json={})
    assert s.status_code == 201, s.text
    sid = s.json()["id"]
    kid = start_kernel(broker)
    try:
        kernels = {k["id"]: k for k in broker.api("GET", "/api/kernels").json()}
        assert sid in kernels
        check_kernel_model(kernels[sid], sid)
        sessions = [x["id"] for x in broker.api("GET", "/v1/sessions").json()]
        assert kid in sessions
        assert broker.api("GET", f"/v1/sessions/{kid}").json()["kernel"] == "python3"
        # State set through the agent API is there for the notebook client, and back.
        ex = broker.api("POST", f"/v1/sessions/{sid}/execute", json={"code": "shared = 41"})
        assert ex.json()["status"] == "ok", ex.text
        c = clients(broker, sid)
        assert c.run("shared += 1").reply["content"]["status"] == "ok"
        ex = broker.api("POST", f"/v1/sessions/{sid}/execute", json={"code": "shared"})
        assert ex.json()["results"][0]["data"]["text/plain"] == "42"
        # The open WebSocket counts as a connection in both views.
        assert broker.api("GET", f"/api/kernels/{sid}").json()["connections"] >= 1
        # The front door that made a session owns its life: Jupyter deleting the agent's
        # session only lets go of it, and it goes on with its state.
        assert broker.api("DELETE", f"/api/kernels/{sid}").status_code == 204
        assert broker.api("GET", f"/v1/sessions/{sid}").json()["state"] == "idle"
        ex = broker.api("POST", f"/v1/sessions/{sid}/execute", json={"code": "shared"})
        assert ex.json()["results"][0]["data"]["text/plain"] == "42"
        # Its own API ends it, and it is gone from the other view too.
        assert broker.api("DELETE", f"/v1/sessions/{sid}").status_code == 204
        assert broker.api("GET", f"/api/kernels/{sid}").status_code in (404, 410)
        # The agent API ends a kernel the Jupyter API made.
        assert broker.api("DELETE", f"/v1/sessions/{kid}").status_code == 204
        assert broker.api("GET", f"/api/kernels/{kid}").status_code == 404
    finally:
        broker.api("DELETE", f"/v1/sessions/{sid}")
        broker.api("DELETE", f"/api/kernels/{kid}")


# ---------------------------------------------------------------------------------------
# WebSocket: the message flows a notebook uses


def test_kernel_info(broker, kernel, clients):
    c = clients(broker, kernel)
    req = c.send("shell", "kernel_info_request")
    got = c.recv_until(lambda m: is_reply_to(m, req), what="kernel_info_reply")
    reply = got[-1]
    content = reply["content"]
    assert content["status"] == "ok"
    assert content["protocol_version"].startswith("5.")
    assert content["language_info"]["name"] == "python"
    assert content["implementation"] == "ipython"
    assert reply["channel"] == "shell"
    # Legacy frames carry msg_id and msg_type at the top level too, and a parseable date.
    assert reply["msg_id"] == reply["header"]["msg_id"]
    assert reply["msg_type"] == reply["header"]["msg_type"] == "kernel_info_reply"
    assert reply["parent_header"]["msg_id"] == req["header"]["msg_id"]
    assert reply["parent_header"]["session"] == c.session.session
    assert isinstance(extract_dates(dict(reply["header"]))["date"], datetime.datetime)
    # The kernel's busy/idle around it, on iopub, with the request as parent.
    # iopub and shell are separate sockets: the idle may have come before the reply.
    rest = got
    if not any(is_status(m, "idle", req) for m in got):
        rest = got + c.recv_until(lambda m: is_status(m, "idle", req), what="idle")
    assert any(is_status(m, "busy", req) for m in rest)
    # kernel_info also works on the control channel, as JupyterLab's debugger uses it.
    reply, _ = c.request("kernel_info_request", channel="control")
    assert reply["channel"] == "control" and reply["content"]["status"] == "ok"


def test_execute_keeps_state_and_reports_everything(broker, kernel, clients):
    c = clients(broker, kernel)
    first = c.run("x = 20\nprint('hello from the kernel')")
    assert first.reply["content"]["status"] == "ok"
    assert first.stdout == "hello from the kernel\n"
    n = first.reply["content"]["execution_count"]
    assert [m["content"]["code"] for m in first.of_type("execute_input")] == [
        "x = 20\nprint('hello from the kernel')"]
    states = [m["content"]["execution_state"] for m in first.of_type("status")]
    assert states[0] == "busy" and states[-1] == "idle"
    second = c.run("x * 2 + 2")
    assert second.reply["content"]["status"] == "ok"
    assert second.reply["content"]["execution_count"] == n + 1
    assert second.result == "42"
    assert second.of_type("execute_result")[0]["content"]["execution_count"] == n + 1
    # silent executions do not count.
    silent = c.run("y = x", silent=True)
    assert silent.reply["content"]["status"] == "ok"
    assert c.run("y").result == "20"


def test_matplotlib_figure_arrives_as_png_display_data(broker, kernel, clients):
    c = clients(broker, kernel)
    ex = c.run("import matplotlib.pyplot as plt\n"
               "plt.plot([1, 3, 2])\n"
               "plt.title('protocol test')\n"
               "plt.show()", timeout=120)
    assert ex.reply["content"]["status"] == "ok"
    displays = ex.of_type("display_data")
    assert displays, [summary(m) for m in ex.iopub]
    data = displays[0]["content"]["data"]
    assert base64.b64decode(data["image/png"]).startswith(PNG_MAGIC)
    assert "text/plain" in data
    assert isinstance(displays[0]["content"]["metadata"], dict)


def test_error_has_a_traceback(broker, kernel, clients):
    c = clients(broker, kernel)
    ex = c.run("def f():\n    return {}['price']\nf()")
    content = ex.reply["content"]
    assert content["status"] == "error"
    assert content["ename"] == "KeyError"
    assert content["evalue"] == "'price'"
    errors = ex.of_type("error")
    assert len(errors) == 1
    assert errors[0]["content"]["ename"] == "KeyError"
    tb = errors[0]["content"]["traceback"]
    assert isinstance(tb, list) and len(tb) >= 2
    assert any("f()" in line for line in tb)
    # With stop_on_error, a request queued behind the failed one is aborted; the next one runs.
    assert c.run("1 + 1").result == "2"


def test_stdin_input_request_round_trip(broker, kernel, clients):
    c = clients(broker, kernel)
    req = c.execute("name = input('x? ')\nprint('got', name)", allow_stdin=True)
    got = c.recv_until(lambda m: m["channel"] == "stdin" and m["msg_type"] == "input_request",
                       what="input_request")
    ir = got[-1]
    assert ir["content"]["prompt"] == "x? "
    assert ir["content"]["password"] is False
    assert parent_id(ir) == req["header"]["msg_id"]
    c.send("stdin", "input_reply", {"value": "Ada"}, parent=ir["header"])
    ex = c.wait_execution(req, got=got)
    assert ex.reply["content"]["status"] == "ok"
    assert "got Ada" in ex.stdout
    assert c.run("name").result == "'Ada'"


def test_input_without_allow_stdin_fails_cleanly(broker, kernel, clients):
    c = clients(broker, kernel)
    ex = c.run("input('x? ')", allow_stdin=False)
    assert ex.reply["content"]["status"] == "error"
    assert ex.reply["content"]["ename"] == "StdinNotImplementedError"


def test_interrupt_over_rest_stops_a_running_cell(broker, kernel, clients):
    c = clients(broker, kernel)
    req = c.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(30)")
    got = c.recv_until(lambda m: m["msg_type"] == "stream" and parent_id(m) == req["header"]["msg_id"],
                       what="the cell to start")
    t0 = time.monotonic()
    r = broker.api("POST", f"/api/kernels/{kernel}/interrupt", json={})
    assert r.status_code == 204, r.text
    ex = c.wait_execution(req, timeout=20, got=got)
    assert time.monotonic() - t0 < 15
    assert ex.reply["content"]["status"] == "error"
    assert ex.reply["content"]["ename"] == "KeyboardInterrupt"
    assert [e["content"]["ename"] for e in ex.of_type("error")] == ["KeyboardInterrupt"]
    # The kernel and its state are still there.
    assert c.run("1 + 1").result == "2"


def test_restart_over_rest_announces_restarting_and_clears_state(broker, kernel, clients):
    c = clients(broker, kernel)
    assert c.run("before_restart = 1").reply["content"]["status"] == "ok"
    r = broker.api("POST", f"/api/kernels/{kernel}/restart", json={})
    assert r.status_code == 200, r.text
    got = c.recv_until(lambda m: is_status(m, "restarting"), timeout=30,
                       what="iopub status restarting")
    assert got[-1]["header"]["msg_type"] == "status"
    # Then, without the client asking, a status that ends "restarting" in the frontend's
    # indicator (JupyterLab shows "Restarting" until a new state arrives).
    c.recv_until(lambda m: m["msg_type"] == "status"
                 and m["content"]["execution_state"] in ("idle", "starting"),
                 timeout=30, what="a status after restarting")
    # The same WebSocket keeps working with the new kernel, as JupyterLab expects.
    reply, _ = c.request("kernel_info_request")
    assert reply["content"]["status"] == "ok"
    ex = c.run("before_restart")
    assert ex.reply["content"]["status"] == "error"
    assert ex.reply["content"]["ename"] == "NameError"
    assert ex.reply["content"]["execution_count"] == 1
    assert broker.api("GET", f"/api/kernels/{kernel}").json()["execution_state"] in {"idle", "busy"}
    # A restart someone else asks for (the agent API) is announced the same way.
    assert c.run("again = 1").reply["content"]["status"] == "ok"
    assert broker.api("POST", f"/v1/sessions/{kernel}/restart").status_code == 200
    c.recv_until(lambda m: is_status(m, "restarting"), what="restarting (agent's restart)")
    c.recv_until(lambda m: is_status(m, "idle"), what="idle after the agent's restart")
    assert c.run("again").reply["content"]["ename"] == "NameError"


def test_complete_and_inspect(broker, kernel, clients):
    c = clients(broker, kernel)
    c.run("import collections\nmy_long_variable = 3")
    reply, _ = c.request("complete_request", {"code": "my_long_v", "cursor_pos": 9})
    content = reply["content"]
    assert content["status"] == "ok"
    assert "my_long_variable" in content["matches"]
    assert content["cursor_start"] == 0 and content["cursor_end"] == 9
    reply, _ = c.request("complete_request", {"code": "collections.Ord", "cursor_pos": 15})
    assert "collections.OrderedDict" in reply["content"]["matches"] or \
        "OrderedDict" in reply["content"]["matches"]
    reply, _ = c.request("inspect_request", {"code": "collections.OrderedDict",
                                             "cursor_pos": 23, "detail_level": 0})
    assert reply["content"]["status"] == "ok"
    assert reply["content"]["found"] is True
    assert "OrderedDict" in reply["content"]["data"]["text/plain"]
    reply, _ = c.request("is_complete_request", {"code": "for i in range(3):"})
    assert reply["content"]["status"] == "incomplete"
    reply, _ = c.request("history_request", {"output": False, "raw": True,
                                             "hist_access_type": "tail", "n": 5})
    assert reply["content"]["status"] == "ok"


# ---------------------------------------------------------------------------------------
# Comms and binary buffers

ECHO_TARGET = """
def _echo_target(comm, open_msg):
    comm.send({'opened_with': open_msg['content']['data']})
    @comm.on_msg
    def _on(msg):
        comm.send({'echo': msg['content']['data'],
                   'sizes': [len(bytes(b)) for b in msg['buffers']]},
                  buffers=[bytes(b)[::-1] for b in msg['buffers']])
get_ipython().kernel.comm_manager.register_target('echo', _echo_target)
"""


def test_comm_info_and_client_opened_comm(broker, kernel, clients):
    c = clients(broker, kernel)
    assert c.run(ECHO_TARGET).reply["content"]["status"] == "ok"
    reply, _ = c.request("comm_info_request", {})
    assert reply["content"]["status"] == "ok"
    assert isinstance(reply["content"]["comms"], dict)
    comm_id = uuid.uuid4().hex
    c.send("shell", "comm_open", {"comm_id": comm_id, "target_name": "echo",
                                  "data": {"hi": 1}})
    got = c.recv_until(lambda m: m["msg_type"] == "comm_msg"
                       and m["content"].get("comm_id") == comm_id, what="the comm's greeting")
    assert got[-1]["content"]["data"] == {"opened_with": {"hi": 1}}
    reply, _ = c.request("comm_info_request", {"target_name": "echo"})
    assert comm_id in reply["content"]["comms"]
    # A comm_msg with buffers from the client (a legacy binary frame) reaches the kernel,
    # and the kernel's answer with buffers arrives as a legacy binary frame.
    c.send("shell", "comm_msg", {"comm_id": comm_id, "data": {"n": 2}},
           buffers=[b"\x00\x01\x02\xff", b"abc"])
    got = c.recv_until(lambda m: m["msg_type"] == "comm_msg"
                       and m["content"].get("comm_id") == comm_id, what="the echo")
    echo = got[-1]
    assert echo["content"]["data"] == {"echo": {"n": 2}, "sizes": [4, 3]}
    assert echo["_binary"] is True
    assert [bytes(b) for b in echo["buffers"]] == [b"\xff\x02\x01\x00", b"cba"]
    c.send("shell", "comm_close", {"comm_id": comm_id, "data": {}})
    wait_for(lambda: comm_id not in c.request("comm_info_request", {})[0]["content"]["comms"],
             timeout=20, what="the comm to close")


KERNEL_COMM = (
    "from comm import create_comm\n"
    "kc = create_comm(target_name='from_kernel', data={'hello': 1}, buffers=[b'\\x00\\xffopen'])\n"
    "kc.send({'n': 2}, buffers=[bytes(range(256)), b''])\n"
)


def check_binary_layout_legacy(frame):
    nbufs = struct.unpack_from("!I", frame, 0)[0]
    offsets = struct.unpack_from(f"!{nbufs}I", frame, 4)
    assert offsets[0] == 4 * (nbufs + 1)
    assert list(offsets) == sorted(offsets) and offsets[-1] <= len(frame)


def test_kernel_comm_with_buffers_legacy_binary_frame(broker, kernel, clients):
    c = clients(broker, kernel)
    raw_frames = []
    orig = c.ws.recv_data

    def spy(*a, **kw):
        op, data = orig(*a, **kw)
        if op == websocket.ABNF.OPCODE_BINARY:
            raw_frames.append(data)
        return op, data

    c.ws.recv_data = spy
    ex = c.run(KERNEL_COMM)
    assert ex.reply["content"]["status"] == "ok", ex.reply["content"]
    opens = ex.of_type("comm_open")
    msgs = ex.of_type("comm_msg")
    assert len(opens) == 1 and len(msgs) == 1
    assert opens[0]["_binary"] and msgs[0]["_binary"]
    assert opens[0]["content"]["target_name"] == "from_kernel"
    assert opens[0]["content"]["data"] == {"hello": 1}
    assert [bytes(b) for b in opens[0]["buffers"]] == [b"\x00\xffopen"]
    assert msgs[0]["content"]["data"] == {"n": 2}
    assert [bytes(b) for b in msgs[0]["buffers"]] == [bytes(range(256)), b""]
    assert opens[0]["channel"] == "iopub"
    assert raw_frames
    for f in raw_frames:
        check_binary_layout_legacy(f)
    # Messages without buffers stay text frames.
    assert not ex.reply["_binary"]


def test_v1_subprotocol(broker, kernel, clients):
    c = clients(broker, kernel, v1=True)
    assert c.ws.getsubprotocol() == V1
    reply, got = c.request("kernel_info_request")
    assert reply["content"]["status"] == "ok" and reply["channel"] == "shell"
    assert all(m["_binary"] for m in got), "v1 frames are all binary"
    ex = c.run("v = 6 * 7\nprint('v1 says', v)\nv")
    assert ex.result == "42" and ex.stdout == "v1 says 42\n"
    assert ex.reply["content"]["status"] == "ok"
    # Buffers both ways in the v1 framing.
    ex = c.run(ECHO_TARGET + "\n" + KERNEL_COMM)
    assert ex.reply["content"]["status"] == "ok", ex.reply["content"]
    msgs = ex.of_type("comm_msg")
    assert [bytes(b) for b in msgs[0]["buffers"]] == [bytes(range(256)), b""]
    comm_id = uuid.uuid4().hex
    c.send("shell", "comm_open", {"comm_id": comm_id, "target_name": "echo", "data": {}})
    c.send("shell", "comm_msg", {"comm_id": comm_id, "data": {"n": 3}},
           buffers=[b"\x01\x02", b"\xfe"])
    got = c.recv_until(lambda m: m["msg_type"] == "comm_msg"
                       and m["content"].get("comm_id") == comm_id
                       and "echo" in m["content"]["data"], what="the v1 echo")
    assert got[-1]["content"]["data"]["sizes"] == [2, 1]
    assert [bytes(b) for b in got[-1]["buffers"]] == [b"\x02\x01", b"\xfe"]
    # stdin over v1.
    req = c.execute("answer = input('v1? ')", allow_stdin=True)
    got = c.recv_until(lambda m: m["msg_type"] == "input_request", what="input_request")
    assert got[-1]["channel"] == "stdin"
    c.send("stdin", "input_reply", {"value": "yes"}, parent=got[-1]["header"])
    assert c.wait_execution(req, got=got).reply["content"]["status"] == "ok"
    assert c.run("answer").result == "'yes'"


def test_v1_is_not_chosen_unless_offered(broker, kernel, clients):
    c = clients(broker, kernel)
    assert not c.ws.getsubprotocol()
    reply, got = c.request("kernel_info_request")
    assert not any(m["_binary"] for m in got)
    # A client offering something else alongside v1 still gets v1.
    ws = websocket.create_connection(
        f"{ws_base(broker)}/api/kernels/{kernel}/channels?session_id={uuid.uuid4()}",
        header=[f"Authorization: token {ALICE}"],
        subprotocols=["something.else", V1], timeout=RECV_TIMEOUT)
    try:
        assert ws.getsubprotocol() == V1
    finally:
        ws.close()


# ---------------------------------------------------------------------------------------
# Several clients on one kernel


class AgentStream:
    """The agent's WebSocket, /v1/sessions/{id}/stream, JSON text frames."""

    def __init__(self, broker, sid, token=ALICE):
        self.ws = websocket.create_connection(
            f"ws://{broker.host}/v1/sessions/{sid}/stream",
            header=[f"Authorization: token {token}"], timeout=RECV_TIMEOUT)
        self.frames = []

    def send(self, frame):
        self.ws.send(json.dumps(frame))

    def recv(self, timeout=RECV_TIMEOUT):
        self.ws.settimeout(timeout)
        try:
            f = json.loads(self.ws.recv())
        except websocket.WebSocketTimeoutException:
            raise TimeoutError from None
        self.frames.append(f)
        return f

    def until(self, pred, timeout=60, what="a frame"):
        deadline = time.monotonic() + timeout
        got = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}: {got}")
            try:
                got.append(self.recv(left))
            except TimeoutError:
                continue
            if pred(got[-1]):
                return got

    def close(self):
        try:
            self.ws.close(timeout=2)
        except Exception:
            pass


def test_notebook_and_agent_share_a_kernel(broker, kernel, clients):
    nb = clients(broker, kernel)
    other = clients(broker, kernel)  # a second notebook client, another session_id
    agent = AgentStream(broker, kernel)
    try:
        # The agent's execution: the notebook clients see its iopub.
        agent.send({"type": "execute", "id": "c1",
                    "code": "from_agent = 5\nprint('agent output')\nfrom_agent * 2"})
        frames = agent.until(lambda f: f.get("type") == "done" and f.get("id") == "c1",
                             what="the agent's done")
        kinds = [f["type"] for f in frames if f.get("id") == "c1"]
        assert kinds[-1] == "done"
        assert {"type": "stdout", "id": "c1", "text": "agent output\n"} in frames
        assert any(f["type"] == "result" and f["data"]["text/plain"] == "10" for f in frames)
        assert frames[-1]["execution"]["status"] == "ok"
        for client in (nb, other):
            got = client.recv_until(
                lambda m: m["msg_type"] == "stream" and "agent output" in m["content"]["text"],
                what="the agent's output on iopub")
            got += client.recv_until(lambda m: m["msg_type"] == "execute_result",
                                     what="the agent's result on iopub")
            assert got[-1]["content"]["data"]["text/plain"] == "10"
            assert all(m["channel"] == "iopub" for m in got), [summary(m) for m in got]
            client.recv_until(lambda m: is_status(m, "idle") and
                              parent_id(m) == parent_id(got[-1]), what="idle after the agent")

        # The notebook's execution: the other notebook client sees its iopub but not its
        # reply; the agent sees the kernel go busy and idle, and the variable.
        ex = nb.run("from_nb = from_agent + 1\nprint('notebook output')")
        assert ex.reply["content"]["status"] == "ok"
        msg_id = ex.req["header"]["msg_id"]
        seen = other.recv_until(lambda m: is_status(m, "idle", ex.req),
                                what="the notebook's idle on the other client")
        assert any(m["msg_type"] == "stream" and m["content"]["text"] == "notebook output\n"
                   for m in seen)
        seen += other.drain(1.5)
        assert not [m for m in seen if m["channel"] != "iopub" and parent_id(m) == msg_id], \
            "a reply went to a client that did not ask"
        # The agent stream gets the notebook's output as external frames (id null).
        frames = agent.until(lambda f: f.get("external") and f.get("type") == "stdout",
                             timeout=10, what="the notebook's output on the agent stream")
        assert frames[-1] == {"type": "stdout", "id": None, "text": "notebook output\n",
                              "external": True}
        assert {"type": "status", "state": "busy"} in agent.frames
        agent.until(lambda f: f == {"type": "status", "state": "idle"}, timeout=10,
                    what="the agent to see the kernel idle")
        assert not [f for f in agent.frames if f.get("type") == "done" and f.get("id") is None]
        agent.send({"type": "execute", "id": "c2", "code": "from_nb"})
        frames = agent.until(lambda f: f.get("type") == "done" and f.get("id") == "c2",
                             what="c2 done")
        assert any(f["type"] == "result" and f["data"]["text/plain"] == "6" for f in frames)

        # Two notebook clients' requests at once: each gets exactly its own replies.
        r1 = nb.send("shell", "kernel_info_request")
        r2 = other.send("shell", "kernel_info_request")
        nb.recv_until(lambda m: is_reply_to(m, r1), what="nb's reply")
        other.recv_until(lambda m: is_reply_to(m, r2), what="other's reply")
        nb.drain(1.0)
        other.drain(0.2)
        assert not [m for m in nb.seen if is_reply_to(m, r2)]
        assert not [m for m in other.seen if is_reply_to(m, r1)]
    finally:
        agent.close()


def test_agent_and_notebook_executions_interleave(broker, kernel, clients):
    """Both clients submit at the same time; the kernel runs them one after the other and
    each client gets its own complete answer."""
    nb = clients(broker, kernel)
    agent = AgentStream(broker, kernel)
    try:
        agent.send({"type": "execute", "id": "slow",
                    "code": "import time\nfor i in range(3):\n    print('a', i, flush=True)\n    time.sleep(0.3)\n'agent done'"})
        agent.until(lambda f: f.get("type") == "stdout", what="the agent's cell to start")
        ex = nb.run("print('nb ran')\n'nb done'", timeout=60)
        assert ex.result == "'nb done'" and ex.stdout == "nb ran\n"
        frames = agent.until(lambda f: f.get("type") == "done" and f.get("id") == "slow",
                             what="the agent's done")
        execution = frames[-1]["execution"]
        assert execution["status"] == "ok"
        assert execution["stdout"] == "a 0\na 1\na 2\n"
        assert execution["results"][-1]["data"]["text/plain"] == "'agent done'"
        assert "nb ran" not in execution["stdout"]
    finally:
        agent.close()


# ---------------------------------------------------------------------------------------
# Reconnects

TICKS = ("import time\n"
         "for i in range(8):\n"
         "    print(f'tick {i}', flush=True)\n"
         "    time.sleep(0.5)\n"
         "'all ticks'")


def ticks_in(msgs):
    out = []
    for m in msgs:
        if m["msg_type"] == "stream" and m["channel"] == "iopub":
            out += [int(line.split()[1]) for line in m["content"]["text"].splitlines()
                    if line.startswith("tick ")]
    return out


def test_reconnect_with_same_session_id_gets_what_it_missed(broker, kernel):
    sid = str(uuid.uuid4())
    first = KernelWS(broker, kernel, session_id=sid)
    req = first.execute(TICKS)
    first.recv_until(lambda m: ticks_in([m]), what="the first tick")
    first.close()
    before = ticks_in(first.seen)
    time.sleep(5.5)  # the cell finishes while nobody is connected
    second = KernelWS(broker, kernel, session_id=sid)
    try:
        # The reconnected client uses a new Session object but the same session_id, as a
        # browser tab does after a network blip; the old request's parent header is what
        # ties the messages to it.
        ex = second.wait_execution(req, timeout=30)
        after = ticks_in(second.seen)
        assert sorted(before + after) == list(range(8)), (before, after)
        assert ex.reply["content"]["status"] == "ok"
        assert ex.result == "'all ticks'"
        assert is_status(second.seen[-1], "idle", req) or any(
            is_status(m, "idle", req) for m in second.seen)
    finally:
        second.close()


def test_reconnect_with_other_session_id_gets_no_replay(broker, kernel):
    sid = str(uuid.uuid4())
    first = KernelWS(broker, kernel, session_id=sid)
    req = first.execute("print('only for the first')")
    first.wait_execution(req)
    first.close()
    time.sleep(0.5)
    stranger = KernelWS(broker, kernel)
    try:
        reply, got = stranger.request("kernel_info_request")
        got += stranger.drain(1.0)
        assert not [m for m in got if parent_id(m) == req["header"]["msg_id"]]
    finally:
        stranger.close()


def test_overlapping_reconnects_do_not_replay_twice(broker, kernel):
    """JupyterLab's reconnect (after a restart, or a network blip) may open the new socket
    before the broker has seen the old one close. What the newer socket already delivered
    must not be replayed to a later reconnect with the same session_id."""
    sid = str(uuid.uuid4())
    a = KernelWS(broker, kernel, session_id=sid)
    a.request("kernel_info_request")
    b = KernelWS(broker, kernel, session_id=sid)
    try:
        a.close()
        time.sleep(0.5)
        ex = b.run("print('seen by b')")
        assert ex.stdout == "seen by b\n"
        c = KernelWS(broker, kernel, session_id=sid)
        try:
            c.request("kernel_info_request")
            got = c.seen + c.drain(1.0)
            dup = [summary(m) for m in got if parent_id(m) == ex.req["header"]["msg_id"]]
            assert not dup, f"replayed to the third socket although delivered: {dup}"
        finally:
            c.close()
    finally:
        b.close()


# ---------------------------------------------------------------------------------------
# Death, and frames the broker must survive


def test_kernel_death_is_announced_and_restart_revives(broker, clients):
    kid = start_kernel(broker)
    try:
        c1 = clients(broker, kid)
        c2 = clients(broker, kid)
        c1.execute("import os\nos._exit(1)")
        for c in (c1, c2):
            c.recv_until(lambda m: is_status(m, "dead"), timeout=30, what="status dead")
        wait_for(lambda: broker.api("GET", f"/api/kernels/{kid}").json()["execution_state"] == "dead",
                 timeout=10, what="the model to say dead")
        # The notebook's "restart kernel" brings it back on the same id.
        r = broker.api("POST", f"/api/kernels/{kid}/restart", json={})
        assert r.status_code == 200, r.text
        assert r.json()["execution_state"] != "dead"
        assert c1.run("1 + 2").result == "3"
    finally:
        broker.api("DELETE", f"/api/kernels/{kid}")


def test_delete_closes_or_silences_the_socket(broker):
    kid = start_kernel(broker)
    c = KernelWS(broker, kid)
    try:
        c.request("kernel_info_request")
        assert broker.api("DELETE", f"/api/kernels/{kid}").status_code == 204
        # The client learns the kernel is gone: a dead status or the socket closing.
        deadline = time.monotonic() + 20
        ended = False
        while time.monotonic() < deadline and not ended:
            try:
                m = c.recv(2)
                ended = is_status(m, "dead")
            except TimeoutError:
                continue
            except (websocket.WebSocketConnectionClosedException, ConnectionError, OSError):
                ended = True
        assert ended, [summary(m) for m in c.seen]
    finally:
        c.close()


def test_malformed_frames_do_not_break_anything(broker, kernel, clients):
    c = clients(broker, kernel)
    good_header = json.loads(c.session.pack(c.session.msg("kernel_info_request", {})["header"]))
    bad_frames_text = [
        "this is not json",
        "",
        "[]",
        "null",
        json.dumps({"channel": "shell"}),
        json.dumps({"header": {}, "content": {}, "channel": "shell"}),
        json.dumps({"header": good_header, "parent_header": {}, "metadata": {},
                    "content": {}, "channel": "mars"}),
        json.dumps({"header": "string", "channel": "shell"}),
        json.dumps({"header": good_header, "content": "not an object", "channel": "shell"}),
        "{" * 10000,
    ]
    for f in bad_frames_text:
        c.ws.send(f)
    for f in [b"", b"\x00", os.urandom(64), struct.pack("!I", 0xFFFFFFFF) + b"x" * 20,
              struct.pack("!III", 2, 12, 999999) + b"{}"]:
        c.ws.send_binary(f)
    # A message on iopub or hb from the client is not sent to the kernel; nothing breaks.
    c.send("iopub", "status", {"execution_state": "busy"})
    reply, got = c.request("kernel_info_request")
    assert reply["content"]["status"] == "ok"
    assert c.run("2 ** 10").result == "1024"
    v1 = clients(broker, kernel, v1=True)
    for f in [b"", os.urandom(100), struct.pack("<Q", 3) + b"\x00" * 24,
              struct.pack("<Q", 7) + struct.pack("<7Q", 64, 69, 2, 1, 0, 5, 10**12) + b"shell"]:
        v1.ws.send_binary(f)
    v1.ws.send("text on a v1 socket")
    reply, _ = v1.request("kernel_info_request")
    assert reply["content"]["status"] == "ok"
    assert requests.get(broker.url + "/healthz", timeout=10).status_code == 200


def test_client_headers_and_metadata_reach_the_kernel_unchanged(broker, kernel, clients):
    """The broker forwards client messages as they are: extra header fields and metadata
    (JupyterLab's cellId) survive, and the reply's parent_header is the client's header."""
    c = clients(broker, kernel)
    reply, _ = c.request("kernel_info_request")
    assert reply["content"]["status"] == "ok"
    # A message with extra header fields and metadata passes as is.
    msg = c.session.msg("execute_request", {
        "code": "1", "silent": False, "store_history": False, "user_expressions": {"u": "1+1"},
        "allow_stdin": False, "stop_on_error": True}, metadata={"cellId": "abc", "deletedCells": []})
    msg["header"]["x-extra"] = "kept"
    c.send_msg("shell", msg)
    ex = c.wait_execution(msg)
    assert ex.reply["content"]["user_expressions"]["u"]["data"]["text/plain"] == "2"
    assert ex.reply["parent_header"]["x-extra"] == "kept"
    assert ex.reply["parent_header"]["msg_id"] == msg["header"]["msg_id"]


# ---------------------------------------------------------------------------------------
# jupyter_client's own client machinery


def test_gateway_kernel_client_from_jupyter_server(broker, kernel, monkeypatch):
    """jupyter_server's GatewayKernelClient is a jupyter_client AsyncKernelClient that talks
    WebSocket. It opens its socket without credentials (upstream), so the token header is
    added to its `websocket.create_connection` call."""
    import asyncio

    from jupyter_server.gateway import managers
    from jupyter_server.gateway.gateway_client import GatewayClient

    gw = GatewayClient.instance()
    monkeypatch.setattr(gw, "url", broker.url)
    monkeypatch.setattr(gw, "ws_url", f"ws://{broker.host}")
    real_connect = managers.websocket.create_connection

    def connect(url, **kw):
        kw.setdefault("header", []).append(f"Authorization: token {ALICE}")
        return real_connect(url, **kw)

    monkeypatch.setattr(managers.websocket, "create_connection", connect)

    async def main():
        kc = managers.GatewayKernelClient(kernel_id=kernel, session=Session(key=b""))
        await kc.start_channels()
        try:
            await asyncio.wait_for(kc.wait_for_ready(timeout=30), 40)
            info = await kc.kernel_info(reply=True, timeout=30)
            assert info["content"]["protocol_version"].startswith("5.")
            reply = await kc.execute("kc_var = 'through jupyter_client'", reply=True, timeout=30)
            assert reply["content"]["status"] == "ok"
            msg_id = kc.execute("kc_var.upper()")
            result = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                m = await kc.get_iopub_msg(timeout=30)
                if m["parent_header"].get("msg_id") != msg_id:
                    continue
                if m["msg_type"] == "execute_result":
                    result = m["content"]["data"]["text/plain"]
                if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                    break
            assert result == "'THROUGH JUPYTER_CLIENT'"
            reply = await kc._async_recv_reply(msg_id, timeout=30)
            assert reply["content"]["status"] == "ok"
            comp = await kc.complete("kc_v", reply=True, timeout=30)
            assert "kc_var" in comp["content"]["matches"]
            insp = await kc.inspect("kc_var", reply=True, timeout=30)
            assert insp["content"]["found"]
        finally:
            kc.stop_channels()

    asyncio.run(asyncio.wait_for(main(), 120))
