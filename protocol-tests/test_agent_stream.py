"""The agent stream, `/v1/sessions/{id}/stream`, driven with websocket-client: JSON text
frames in, per-execution frames out, `done` always last for its id."""
import base64
import json
import re
import time
import uuid

import pytest
import websocket

from conftest import ALICE, BOB, criu_ready, needs_criu
from test_jupyter_client import PNG_MAGIC, RECV_TIMEOUT, AgentStream

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@pytest.fixture
def session(broker):
    r = broker.api("POST", "/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    yield sid
    broker.api("DELETE", f"/v1/sessions/{sid}")


@pytest.fixture
def stream(broker, session):
    s = AgentStream(broker, session)
    yield s
    s.close()


def run(stream, code, cid=None, timeout=60, **extra):
    cid = cid or uuid.uuid4().hex[:8]
    stream.send({"type": "execute", "id": cid, "code": code, **extra})
    frames = stream.until(lambda f: f.get("type") == "done" and f.get("id") == cid,
                          timeout=timeout, what=f"done for {cid}")
    return [f for f in frames if f.get("id") == cid]


def test_first_frame_is_status_and_execute_streams_then_done(stream):
    first = stream.recv()
    assert first["type"] == "status" and first["state"] in {"idle", "busy"}
    frames = run(stream, "import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7", "c1")
    types = [f["type"] for f in frames]
    assert types[-1] == "done"
    assert types.count("done") == 1
    assert {"type": "stdout", "id": "c1", "text": "out\n"} in frames
    assert {"type": "stderr", "id": "c1", "text": "err\n"} in frames
    result = [f for f in frames if f["type"] == "result"]
    assert result and result[0]["data"]["text/plain"] == "42"
    ex = frames[-1]["execution"]
    assert ex["status"] == "ok"
    assert ex["stdout"] == "out\n" and ex["stderr"] == "err\n"
    assert ex["results"][-1]["is_main_result"] is True
    assert ex["error"] is None and ex["truncated"] is False
    assert isinstance(ex["execution_count"], int) and ex["duration_ms"] >= 0
    # State persists; ids can be any JSON value.
    frames = run(stream, "x = 1", cid=7)
    assert frames[-1]["id"] == 7 and frames[-1]["execution"]["status"] == "ok"


def test_error_frame_then_done(stream):
    frames = run(stream, "{}['price']")
    err = [f for f in frames if f["type"] == "error"]
    assert len(err) == 1
    assert err[0]["ename"] == "KeyError" and err[0]["evalue"] == "'price'"
    assert err[0]["traceback"]
    ex = frames[-1]["execution"]
    assert ex["status"] == "error" and ex["error"]["ename"] == "KeyError"
    assert not any(ANSI.search(line) for line in ex["error"]["traceback"])


def test_display_frame_with_png(stream):
    frames = run(stream, "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()",
                 timeout=120)
    displays = [f for f in frames if f["type"] == "display"]
    assert displays
    assert base64.b64decode(displays[0]["data"]["image/png"]).startswith(PNG_MAGIC)
    assert any("image/png" in r["data"] for r in frames[-1]["execution"]["results"])


def test_input_request_and_reply(stream):
    stream.send({"type": "execute", "id": "in1", "code": "v = input('name? ')\nprint('hi', v)"})
    frames = stream.until(lambda f: f.get("type") == "input_request", what="input_request")
    assert frames[-1] == {"type": "input_request", "id": "in1", "prompt": "name? ",
                          "password": False}
    stream.send({"type": "input_reply", "id": "in1", "value": "Grace"})
    frames = stream.until(lambda f: f.get("type") == "done" and f.get("id") == "in1",
                          what="done")
    assert frames[-1]["execution"]["status"] == "ok"
    assert "hi Grace" in frames[-1]["execution"]["stdout"]


def test_interrupt_frame(stream):
    stream.send({"type": "execute", "id": "long",
                 "code": "import time\nprint('go', flush=True)\ntime.sleep(30)"})
    stream.until(lambda f: f.get("type") == "stdout" and f.get("id") == "long", what="go")
    t0 = time.monotonic()
    stream.send({"type": "interrupt"})
    frames = stream.until(lambda f: f.get("type") == "done" and f.get("id") == "long",
                          timeout=20, what="done after interrupt")
    assert time.monotonic() - t0 < 15
    assert frames[-1]["execution"]["status"] == "interrupted"
    assert run(stream, "1 + 1")[-1]["execution"]["status"] == "ok"


def test_executions_run_in_order(stream):
    stream.send({"type": "execute", "id": "a",
                 "code": "import time\ntime.sleep(0.5)\nprint('a')"})
    stream.send({"type": "execute", "id": "b", "code": "print('b')"})
    frames = stream.until(lambda f: f.get("type") == "done" and f.get("id") == "b",
                          what="done b")
    order = [(f["type"], f.get("id")) for f in frames if f.get("id") in ("a", "b")]
    assert order.index(("done", "a")) < order.index(("stdout", "b"))


def test_bad_frames_get_protocol_error_and_the_stream_lives(stream):
    stream.ws.send("not json")
    stream.ws.send(json.dumps({"type": "teleport"}))
    stream.ws.send(json.dumps({"type": "execute", "id": "x"}))  # no code
    stream.ws.send_binary(b"\x00\x01")
    errors = []
    deadline = time.monotonic() + RECV_TIMEOUT
    while len(errors) < 4 and time.monotonic() < deadline:
        f = stream.recv(RECV_TIMEOUT)
        if f["type"] == "protocol_error":
            errors.append(f)
    assert len(errors) == 4, errors
    assert all(isinstance(e["message"], str) and e["message"] for e in errors)
    assert run(stream, "'still here'")[-1]["execution"]["status"] == "ok"


def test_stream_auth(broker, session):
    ws = websocket.create_connection(
        f"ws://{broker.host}/v1/sessions/{session}/stream?token={ALICE}", timeout=RECV_TIMEOUT)
    try:
        assert json.loads(ws.recv())["type"] == "status"
    finally:
        ws.close()
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        websocket.create_connection(f"ws://{broker.host}/v1/sessions/{session}/stream",
                                    timeout=RECV_TIMEOUT)
    assert e.value.status_code == 401
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        AgentStream(broker, session, token=BOB)
    assert e.value.status_code == 404


def test_two_agent_streams_do_not_get_each_others_frames(broker, session):
    a = AgentStream(broker, session)
    b = AgentStream(broker, session)
    try:
        frames = run(a, "print('for a only')", "only-a")
        assert frames[-1]["execution"]["status"] == "ok"
        time.sleep(1)
        b.ws.settimeout(0.5)
        seen = []
        try:
            while True:
                seen.append(json.loads(b.ws.recv()))
        except websocket.WebSocketTimeoutException:
            pass
        assert not [f for f in seen if f.get("id") == "only-a"], seen
    finally:
        a.close()
        b.close()


def answer(stream, cid, timeout=60):
    frames = stream.until(lambda f: f.get("id") == cid and f.get("type") != "status",
                          timeout=timeout, what=f"the answer to {cid}")
    return frames[-1]


def test_checkpoint_rewind_and_fork_frames(broker, session, stream):
    """Issue 36 on the agent stream: `checkpoint`, `rewind` and `fork` frames, each answered
    with one frame for its id; refusals carry REST's status and code; the stream lives on."""
    run(stream, "rows = [1, 2, 3]")
    stream.send({"type": "checkpoint", "id": "cp1"})
    taken = answer(stream, "cp1")
    assert taken["type"] == "checkpoint_taken", taken
    cp = taken["checkpoint"]
    assert cp["session"] == session and cp["execution_count"] == 1, cp
    run(stream, "del rows")
    stream.send({"type": "rewind", "id": 2, "checkpoint": cp["id"]})
    rewound = answer(stream, 2)
    assert rewound["type"] == "rewound" and rewound["session"]["id"] == session, rewound
    assert rewound["session"]["execution_count"] == 1, rewound
    done = run(stream, "rows")[-1]
    assert done["execution"]["results"][-1]["data"]["text/plain"] == "[1, 2, 3]", done

    # A fork of the live kernel, and one of the checkpoint.
    run(stream, "rows.append(4)")
    stream.send({"type": "fork", "id": "f1", "count": 2})
    forked = answer(stream, "f1")
    assert forked["type"] == "forked" and len(forked["sessions"]) == 2, forked
    stream.send({"type": "fork", "id": "f2", "checkpoint": cp["id"]})
    from_cp = answer(stream, "f2")
    assert from_cp["type"] == "forked" and len(from_cp["sessions"]) == 1, from_cp
    made = [s["id"] for s in forked["sessions"] + from_cp["sessions"]]
    try:
        seen = []
        for sid in made:
            r = broker.api("POST", f"/v1/sessions/{sid}/execute", json={"code": "rows"})
            assert r.status_code == 200, r.text
            seen.append(r.json()["results"][-1]["data"]["text/plain"])
        assert seen == ["[1, 2, 3, 4]", "[1, 2, 3, 4]", "[1, 2, 3]"], seen

        # Refusals: REST's status and code, with the frame's id; the stream goes on.
        stream.send({"type": "rewind", "id": "bad", "checkpoint": "not-a-uuid"})
        bad = answer(stream, "bad")
        assert bad["type"] == "refused" and bad["status"] == 404, bad
        assert bad["error"] == "checkpoint_not_found", bad
        stream.send({"type": "fork", "id": "many", "count": 9})
        many = answer(stream, "many")
        assert many["type"] == "refused" and many["status"] == 400, many
        # Bob's checkpoint is not alice's session's.
        bob = broker.api("POST", "/v1/sessions", BOB, json={}).json()["id"]
        try:
            bob_cp = broker.api("POST", f"/v1/sessions/{bob}/checkpoints", BOB)
            assert bob_cp.status_code == 201, bob_cp.text
            for frame in ({"type": "rewind", "id": "b1", "checkpoint": bob_cp.json()["id"]},
                          {"type": "fork", "id": "b2", "checkpoint": bob_cp.json()["id"]}):
                stream.send(frame)
                got = answer(stream, frame["id"])
                assert got["type"] == "refused" and got["status"] == 404, got
        finally:
            broker.api("DELETE", f"/v1/sessions/{bob}", BOB)
        # One branching operation at a time per connection: a second one while the first
        # runs is refused at once (a fork takes tens of milliseconds; both frames are sent
        # together).
        stream.send({"type": "fork", "id": "one"})
        stream.send({"type": "checkpoint", "id": "two"})
        got = {}
        stream.until(lambda f: f.get("id") in ("one", "two") and f.get("type") != "status"
                     and got.setdefault(f["id"], f) and len(got) == 2, what="both answers")
        first, second = got["one"], got["two"]
        assert second["type"] == "refused" and second["error"] == "busy", second
        assert first["type"] == "forked", first
        made += [s["id"] for s in first["sessions"]]
        # A frame missing its checkpoint is a protocol error, as any malformed frame.
        stream.send({"type": "rewind", "id": "x"})
        err = stream.until(lambda f: f.get("type") == "protocol_error", what="protocol_error")[-1]
        assert "checkpoint" in err["message"], err
        done = run(stream, "len(rows)")[-1]
        assert done["execution"]["results"][-1]["data"]["text/plain"] == "4", done
    finally:
        for sid in made:
            broker.api("DELETE", f"/v1/sessions/{sid}")


@needs_criu
def test_pause_and_resume_frames(broker):
    """Issue 37 on the agent stream: `pause` answered `paused` (with a status frame
    `paused`), then an execution resumes the session with its state; `resume` frames; the
    stream stays open throughout."""
    r = broker.api("POST", "/v1/sessions", json={"workspace": "own"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    s = AgentStream(broker, sid)
    try:
        run(s, "kept = {'a': 1}")
        s.send({"type": "pause", "id": "p1"})
        frames = s.until(lambda f: f.get("id") == "p1" and f.get("type") != "status",
                         timeout=60, what="the answer to p1")
        paused = frames[-1]
        assert paused["type"] == "paused", paused
        assert paused["session"]["id"] == sid and paused["session"]["image_bytes"] > 0, paused
        # The status frame comes before the answer or after it.
        if not any(f.get("type") == "status" and f.get("state") == "paused" for f in frames):
            s.until(lambda f: f.get("type") == "status" and f.get("state") == "paused",
                    timeout=10, what="the paused status")
        done = run(s, "kept['a'] + 1")[-1]
        assert done["execution"]["results"][-1]["data"]["text/plain"] == "2", done
        s.send({"type": "pause", "id": "p2"})
        assert answer(s, "p2")["type"] == "paused"
        s.send({"type": "resume", "id": "r1"})
        resumed = answer(s, "r1")
        assert resumed["type"] == "resumed" and resumed["session"]["state"] == "idle", resumed
        done = run(s, "kept")[-1]
        assert done["execution"]["results"][-1]["data"]["text/plain"] == "{'a': 1}", done
    finally:
        s.close()
        broker.api("DELETE", f"/v1/sessions/{sid}")


def test_a_session_sharing_its_workspace_pauses_unless_it_holds_its_own_tmp(broker, session, stream):
    """A session sharing its user's workspace resumes in a sandbox of its own: a kernel
    holding a file of its sandbox's /tmp is refused (that file would not come back), saying
    which, and runs on; once it lets go, the pause frame pauses it."""
    run(stream, "x = 1\nheld = open('/tmp/held.txt', 'w')")
    stream.send({"type": "pause", "id": "p"})
    got = answer(stream, "p")
    assert got["type"] == "refused", got
    if criu_ready():
        assert got["status"] == 502 and got["error"] == "pause_failed", got
        assert "/tmp/held.txt" in got["message"], got
    else:
        assert got["status"] == 409 and got["error"] == "pause_refused", got
    done = run(stream, "held.close(); x + 1")[-1]
    assert done["execution"]["results"][-1]["data"]["text/plain"] == "2", done
    if criu_ready():
        stream.send({"type": "pause", "id": "p2"})
        assert answer(stream, "p2")["type"] == "paused"
        done = run(stream, "x + 2")[-1]
        assert done["execution"]["results"][-1]["data"]["text/plain"] == "3", done
