"""Recording as clients see it: every acknowledged execution survives `kill -9` of the
broker, and the notebook export is valid for the real `nbformat` package."""
import base64
import threading

import nbformat
import requests

from conftest import ALICE, BOB, wait_for


def create(b, token=ALICE):
    r = b.api("POST", "/v1/sessions", token=token, json={})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def execute(b, sid, code, token=ALICE, **kw):
    r = b.api("POST", f"/v1/sessions/{sid}/execute", token=token, json={"code": code, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def all_events(b, sid, token=ALICE):
    events, after = [], 0
    while True:
        r = b.api("GET", f"/v1/sessions/{sid}/events", token=token, params={"after": after, "limit": 500})
        assert r.status_code == 200, r.text
        page = r.json()
        events += page["events"]
        if page["next_after"] is None:
            return events
        after = page["next_after"]


def test_acknowledged_executions_survive_kill9(fresh_broker):
    b = fresh_broker()
    sessions = [create(b) for _ in range(3)]
    acked = []  # (session, i): answered 200 before the kill
    lock = threading.Lock()
    stop = threading.Event()

    def agent(sid):
        i = 0
        while not stop.is_set():
            try:
                r = requests.post(f"{b.url}/v1/sessions/{sid}/execute", headers=b.headers(),
                                  json={"code": f"print('cell {i}')\n{i} * {i}"}, timeout=30)
            except requests.RequestException:
                return  # the broker was killed mid-request: not acknowledged
            if r.status_code != 200:
                return
            assert r.json()["stdout"] == f"cell {i}\n"
            with lock:
                acked.append((sid, i))
            i += 1

    threads = [threading.Thread(target=agent, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    # Kill while executions are in flight on every session.
    wait_for(lambda: len(acked) >= 30, timeout=120, what="30 acknowledged executions")
    b.kill9()
    stop.set()
    for t in threads:
        t.join(30)
    with lock:
        acked_before_kill = list(acked)

    b2 = fresh_broker(data_dir=b.data_dir)
    for sid in sessions:
        events = all_events(b2, sid)
        done = {
            e["detail"]["execution"]["stdout"]
            for e in events
            if e.get("kind") == "execution_done"
        }
        requests_sent = {
            e["content"]["code"]
            for e in events
            if e.get("msg_type") == "execute_request" and e["direction"] == "to_kernel"
        }
        for s, i in acked_before_kill:
            if s != sid:
                continue
            assert f"cell {i}\n" in done, f"acknowledged execution {i} of {sid} is not recorded"
            assert f"print('cell {i}')\n{i} * {i}" in requests_sent
        seqs = [e["seq"] for e in events]
        assert seqs == list(range(1, len(seqs) + 1))
        # The restarted broker closed the session the killed one left open.
        assert events[-1]["kind"] == "broker_stopped"
    listing = {r["id"]: r for r in b2.api("GET", "/v1/recordings").json()}
    for sid in sessions:
        assert listing[sid]["end_reason"] == "broker_stopped"
        assert listing[sid]["state"] == "closed"
        assert listing[sid]["live"] is False
    # The old sessions are gone from the registry, their recordings are not.
    assert b2.api("GET", f"/v1/sessions/{sessions[0]}").status_code == 404
    assert b2.api("GET", f"/v1/sessions/{sessions[0]}/events", token=BOB).status_code == 404


CHART = """import matplotlib
import matplotlib.pyplot as plt
plt.plot([1, 3, 2])
plt.title('chart')
plt.show()"""


def test_notebook_is_valid_nbformat(fresh_broker):
    b = fresh_broker()
    sid = create(b)
    execute(b, sid, "print('a')\nprint('b')\nimport sys\nprint('warn', file=sys.stderr)\n40 + 2")
    execute(b, sid, CHART)
    execute(b, sid, "from IPython.display import display, Markdown\ndisplay(Markdown('**bold**'))\n{'k': [1, 2]}")
    x = execute(b, sid, "{}['missing']")
    assert x["status"] == "error"
    execute(b, sid, "import time\ntime.sleep(5)", timeout_seconds=0.5)
    assert b.api("POST", f"/v1/sessions/{sid}/restart").status_code == 200
    execute(b, sid, "'after restart'")

    r = b.api("GET", f"/v1/sessions/{sid}/notebook")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ipynb+json")
    nb = nbformat.reads(r.text, as_version=4)
    nbformat.validate(nb)
    assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.metadata.language_info.name == "python"

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.source for c in code][0].startswith("print('a')")
    assert len(code) == 6
    first = code[0]
    assert first.execution_count == 1
    kinds = [(o.output_type, o.get("name")) for o in first.outputs]
    assert kinds == [("stream", "stdout"), ("stream", "stderr"), ("execute_result", None)]
    assert first.outputs[0].text == "a\nb\n"
    assert first.outputs[2].data["text/plain"] == "42"
    assert first.outputs[2].execution_count == 1

    chart = code[1].outputs
    pngs = [o for o in chart if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0].data["image/png"]).startswith(b"\x89PNG")

    md = [o for o in code[2].outputs if o.output_type == "display_data"]
    assert md and "text/markdown" in md[0].data

    err = code[3].outputs[-1]
    assert err.output_type == "error"
    assert err.ename == "KeyError"
    assert err.traceback

    markers = [c for c in nb.cells if c.cell_type == "markdown"]
    assert any("restarted" in c.source for c in markers)
    assert code[5].outputs[0].data["text/plain"] == "'after restart'"
    assert code[5].execution_count == 1
    assert len({c.id for c in nb.cells}) == len(nb.cells)

    # Still there, and still valid, after the session is gone.
    assert b.api("DELETE", f"/v1/sessions/{sid}").status_code == 204
    r = b.api("GET", f"/v1/sessions/{sid}/notebook")
    assert r.status_code == 200
    nbformat.validate(nbformat.reads(r.text, as_version=4))
    assert b.api("GET", f"/v1/sessions/{sid}/notebook", token=BOB).status_code == 404


def test_a_notebook_frontends_cells_are_recorded(fresh_broker):
    """Code run from a Jupyter client over /api/kernels/{id}/channels is recorded too, and
    shows up in the notebook and in the replay."""
    import json
    import time

    import websocket
    from jupyter_client.session import Session

    b = fresh_broker()
    r = b.api("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    kid = r.json()["id"]
    session = Session(key=b"", username="notebook")
    ws = websocket.create_connection(
        f"ws://{b.host}/api/kernels/{kid}/channels?session_id={session.session}",
        header=[f"Authorization: token {ALICE}"], timeout=30)
    try:
        msg = session.msg("execute_request", {"code": "print('from a notebook')\n6 * 7", "silent": False,
                                              "store_history": True, "user_expressions": {},
                                              "allow_stdin": False, "stop_on_error": True})
        ws.send(session.pack(dict(msg, channel="shell")).decode())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = json.loads(ws.recv())
            if m["msg_type"] == "execute_reply" and m["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                break
        else:
            raise AssertionError("no execute_reply")
    finally:
        ws.close()

    def recorded():
        events = all_events(b, kid)
        return any(e.get("msg_type") == "execute_reply" for e in events) and events
    events = wait_for(recorded, timeout=10, what="the execute_reply in the recording")
    req = [e for e in events if e["direction"] == "to_kernel" and e.get("msg_type") == "execute_request"]
    assert [e["msg_id"] for e in req] == [msg["header"]["msg_id"]]
    assert req[0]["channel"] == "shell"
    assert req[0]["header"]["username"] == "notebook"

    nb = nbformat.reads(b.api("GET", f"/v1/sessions/{kid}/notebook").text, as_version=4)
    nbformat.validate(nb)
    (cell,) = [c for c in nb.cells if c.cell_type == "code"]
    assert cell.source == "print('from a notebook')\n6 * 7"
    assert [o.output_type for o in cell.outputs] == ["stream", "execute_result"]
    assert cell.outputs[1].data["text/plain"] == "42"

    r = b.api("POST", f"/v1/sessions/{kid}/replay", timeout=120)
    assert r.status_code == 201, r.text
    (replayed,) = r.json()["cells"]
    assert replayed["same_output"] is True, replayed["diff"]
    assert replayed["recorded_status"] is None  # no agent Execution was recorded for it


def test_a_clean_stop_closes_every_recording(fresh_broker):
    b = fresh_broker()
    sid = create(b)
    execute(b, sid, "x = 1")
    b.proc.terminate()  # SIGTERM: sessions shut down, recordings flushed
    assert b.proc.wait(30) == 0
    b2 = fresh_broker(data_dir=b.data_dir)
    events = all_events(b2, sid)
    assert events[-1]["kind"] == "session_closed"
    assert [e["msg_type"] for e in events if e["direction"] == "to_kernel"][-1] == "shutdown_request"
    (r,) = [r for r in b2.api("GET", "/v1/recordings").json() if r["id"] == sid]
    assert r["end_reason"] == "closed"
