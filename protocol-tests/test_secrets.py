"""Secrets and the pre-execution policy (issue 39), against the real broker and kernels.

A secret given at create reaches the kernel as an environment variable and is never
returned or written verbatim: printed plainly, split across two prints, base64-encoded,
inside a traceback, a DataFrame's repr and an HTML display, it shows as `[secret:NAME]` in
every API answer, agent-stream and Jupyter-channel frame, the recording, the exported
notebook, the broker's log and every file under the data directory; the kernel still sees
the real value. The broker's own credentials and the default credential patterns are
masked without being declared. A policy rule refusing `import socket` refuses it before it
reaches the kernel, through every front door.
"""

import asyncio
import base64
import hashlib
import json
import os
import time
from pathlib import Path

import httpx2
import pytest
import websocket
from jupyter_client.session import Session as JupyterSession
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from conftest import ALICE, BOB, wait_for
from test_jupyter_client import RECV_TIMEOUT, AgentStream
from test_agent_stream import run as stream_run

SECRET = "kb-S3cr3t-" + hashlib.sha256(b"issue 39").hexdigest()[:20]
B64 = base64.b64encode(SECRET.encode()).decode()
HEX = SECRET.encode().hex()
FORMS = [SECRET, B64, HEX, B64.rstrip("=")[4:-4]]

# Each leaks the secret a different way; the kernel must still compute with the real value.
LEAKS = {
    "plain": "import os\nk = os.environ['API_KEY']\nprint(k)",
    "split": "import sys, time\nprint(k[:7], end='', flush=True)\ntime.sleep(0.3)\nprint(k[7:], flush=True)",
    "base64": "import base64\nprint(base64.b64encode(k.encode()).decode())",
    # Split around a display: the execution's stdout is read as one text.
    "split_display": "import time\nprint(k[:9], end='', flush=True)\ndisplay('between')\n"
                     "time.sleep(0.2)\nprint(k[9:], flush=True)",
    "hex": "k.encode().hex()",
    "traceback": "def f(x):\n    raise KeyError(x)\nf(k)",
    "dataframe": "import pandas as pd\npd.DataFrame({'key': [k], 'n': [1]})",
    "html": "from IPython.display import HTML, display\ndisplay(HTML(f'<b>{k}</b>'))",
    "stderr": "import sys\nprint('err', k, file=sys.stderr)",
    # Past Python's streams: the process's own file descriptors, and a child process's.
    "fd2": "import os\nos.write(2, (k + '\\n').encode()); os.write(1, (k + '\\n').encode())",
    "subprocess": "import subprocess\nsubprocess.run(['sh', '-c', 'echo $API_KEY; echo $API_KEY >&2'])",
}


def leaks_anywhere(text):
    return [f for f in FORMS if f in text]


def create(broker, **body):
    r = broker.api("POST", "/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def execute(broker, sid, code, token=ALICE):
    r = broker.api("POST", f"/v1/sessions/{sid}/execute", token, json={"code": code}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def all_events(b, sid):
    out, after = [], 0
    while True:
        r = b.api("GET", f"/v1/sessions/{sid}/events", params={"after": after, "limit": 500})
        assert r.status_code == 200, r.text
        page = r.json()["events"]
        if not page:
            return out
        out += page
        after = page[-1]["seq"]


def files_holding(root, needles):
    """Files under `root` whose bytes hold any of `needles` (the data directory: recordings,
    kept records, logs)."""
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if any(x.encode() in data for x in needles):
                found.append(str(p))
    return found


def test_a_secret_never_leaves_the_broker_verbatim(any_backend, request):
    broker = request.getfixturevalue("broker" if any_backend == "local" else "docker_broker")
    s = create(broker, secrets={"API_KEY": SECRET})
    sid = s["id"]
    assert s["secrets"] == ["API_KEY"] and SECRET not in json.dumps(s)
    try:
        answers = []
        for name, code in LEAKS.items():
            r = execute(broker, sid, code)
            answers.append(r.text)
            assert not leaks_anywhere(r.text), (name, r.text)
            assert "[secret:API_KEY]" in r.text, (name, r.text)
        # The kernel computes with the real value.
        r = execute(broker, sid, "import hashlib\nprint(hashlib.sha256(k.encode()).hexdigest(), len(k))")
        assert r.json()["stdout"].split() == [hashlib.sha256(SECRET.encode()).hexdigest(), str(len(SECRET))]
        # Split across two stream messages, it still arrives masked whole and in order.
        split = json.loads(answers[1])
        assert split["stdout"] == "[secret:API_KEY]\n", split
        around = json.loads(answers[3])
        assert around["stdout"] == "[secret:API_KEY]\n", around
        err = json.loads(answers[5])["error"]
        assert err["ename"] == "KeyError" and "[secret:API_KEY]" in err["evalue"], err
        # The agent stream's frames.
        stream = AgentStream(broker, sid)
        try:
            frames = stream_run(stream, LEAKS["split"] + "\n" + LEAKS["html"])
        finally:
            stream.close()
        assert not leaks_anywhere(json.dumps(frames)), frames
        # The session JSON, the recording, the notebook, the replay's cells and the log.
        for path in ("", "/events?limit=1000", "/notebook"):
            r = broker.api("GET", f"/v1/sessions/{sid}{path}")
            assert r.status_code == 200, (path, r.text)
            assert not leaks_anywhere(r.text), (path, leaks_anywhere(r.text))
        assert "[secret:API_KEY]" in broker.api("GET", f"/v1/sessions/{sid}/notebook").text
        assert not leaks_anywhere("".join(broker.log))
    finally:
        broker.api("DELETE", f"/v1/sessions/{sid}")
    # Nothing the broker wrote holds it: recordings, records, its log.
    wait_for(lambda: not files_holding(broker.data_dir, [SECRET, B64]), timeout=10,
             what="no file under the data directory holding the secret")


def test_a_jupyter_client_sees_masked_messages_and_the_policy(fresh_broker, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('[[rule]]\nname = "no-sockets"\nmessage = "no network code here"\n'
                      'deny_imports = ["socket"]\n')
    b = fresh_broker(extra_args=["--policy", str(policy)])
    r = b.api("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    kid = r.json()["id"]
    session = JupyterSession(key=b"", username="notebook")
    ws = websocket.create_connection(
        f"ws://{b.host}/api/kernels/{kid}/channels?session_id={session.session}",
        header=[f"Authorization: token {ALICE}"], timeout=RECV_TIMEOUT)

    def run(code):
        msg = session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                              "user_expressions": {}, "allow_stdin": False,
                                              "stop_on_error": True})
        ws.send(session.pack(dict(msg, channel="shell")).decode())
        seen, idle, reply = [], False, None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (idle and reply):
            m = json.loads(ws.recv())
            if m["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
                continue
            seen.append(m)
            if m["msg_type"] == "execute_reply":
                reply = m
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                idle = True
        assert idle and reply, seen
        return seen, reply

    try:
        # The broker's own token printed by a notebook is masked as a known credential.
        seen, reply = run(f"print('{ALICE}')")
        assert reply["content"]["status"] == "ok"
        assert [m["content"]["text"] for m in seen if m["msg_type"] == "stream"] == ["[secret:broker-token]\n"]
        seen, reply = run("reached = True\nimport socket")
        assert reply["content"]["status"] == "error", reply
        assert reply["content"]["ename"] == "PolicyViolation"
        assert "no-sockets" in reply["content"]["evalue"] and "no network code here" in reply["content"]["evalue"]
        assert [m["msg_type"] for m in seen if m["msg_type"] != "execute_reply"] == ["status", "error", "status"]
        # The kernel never saw it: nothing of the cell ran.
        seen, reply = run("print('reached' in globals())")
        assert [m["content"]["text"] for m in seen if m["msg_type"] == "stream"] == ["False\n"]
    finally:
        ws.close()
    events = all_events(b, kid)
    refused = [e for e in events if e.get("kind") == "execution_refused"]
    assert len(refused) == 1 and refused[0]["detail"]["rule"] == "no-sockets", refused


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_the_policy_refuses_before_the_kernel_at_every_agent_front_door(fresh_broker, tmp_path, monkeypatch,
                                                                         backend):
    if backend == "docker":
        from conftest import _docker_usable
        if not _docker_usable():
            pytest.skip("Docker or the kernel image (docker/build.sh) is missing")
    policy = tmp_path / "policy.toml"
    policy.write_text('[[rule]]\nname = "no-sockets"\ndeny_imports = ["socket"]\n\n'
                      '[[rule]]\nname = "bob-no-eval"\nusers = ["bob"]\ndeny_calls = ["eval"]\n')
    b = fresh_broker(extra_args=["--policy", str(policy), "--sandbox", backend])
    sid = create(b)["id"]
    for code in ("reached = True\nimport socket", "__import__('socket')", "from socket import create_connection",
                 "import importlib\nimportlib.import_module('socket')",
                 "getattr(__builtins__, '__import__')('socket')", "exec('import socket')"):
        ex = execute(b, sid, code).json()
        assert ex["status"] == "error" and ex["error"]["ename"] == "PolicyViolation", (code, ex)
        assert "no-sockets" in ex["error"]["evalue"], ex
    # None of it reached the kernel.
    assert execute(b, sid, "'reached' in globals()").json()["results"][0]["data"]["text/plain"] == "False"
    # Allowed code runs; a rule for bob only leaves alice alone.
    assert execute(b, sid, "eval('1 + 1')").json()["results"][0]["data"]["text/plain"] == "2"
    bob = b.api("POST", "/v1/sessions", BOB, json={}).json()["id"]
    ex = execute(b, bob, "eval('1 + 1')", token=BOB).json()
    assert ex["error"]["ename"] == "PolicyViolation" and "bob-no-eval" in ex["error"]["evalue"]
    # The agent stream.
    stream = AgentStream(b, sid)
    try:
        done = stream_run(stream, "import socket")[-1]
    finally:
        stream.close()
    assert done["execution"]["error"]["ename"] == "PolicyViolation", done
    # E2B's SDK.
    monkeypatch.setenv("E2B_API_URL", b.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", b.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    from e2b_code_interpreter import Sandbox
    with Sandbox.create() as sbx:
        ex = sbx.run_code("import socket")
        assert ex.error is not None and ex.error.name == "PolicyViolation", ex
        assert sbx.run_code("1 + 2").text == "3"

    # MCP.
    async def mcp():
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {ALICE}"},
                                  timeout=httpx2.Timeout(30, read=300))
        async with Client(streamable_http_client(b.url + "/mcp", http_client=http)) as client:
            r = await client.call_tool("run_python", {"code": "import socket"})
            text = "".join(c.text for c in r.content if c.type == "text")
            assert "PolicyViolation" in text and "no-sockets" in text, text
    asyncio.run(mcp())


def test_secrets_through_e2b_mcp_and_known_credentials(broker, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", broker.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", broker.url + "/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    from e2b_code_interpreter import Sandbox
    # envVars the metadata names are secrets; the others are plain variables.
    with Sandbox.create(envs={"API_KEY": SECRET, "PLAIN": "plain-value"},
                        metadata={"kernel_broker_secrets": "API_KEY,LATER"}) as sbx:
        ex = sbx.run_code("import os\nprint(os.environ['API_KEY'], os.environ['PLAIN'])")
        assert ex.logs.stdout == ["[secret:API_KEY] plain-value\n"], ex
        out = sbx.commands.run("echo $API_KEY; echo $API_KEY | base64")
        assert out.stdout == "[secret:API_KEY]\n[secret:API_KEY]\n" or not leaks_anywhere(out.stdout), out
        assert "[secret:API_KEY]" in out.stdout and not leaks_anywhere(out.stdout), out
        # A later `envs` of a declared name is masked from then on; it reaches the kernel.
        later = "later-" + SECRET[::-1]
        ex = sbx.run_code("import os\nprint(os.environ['LATER'])", envs={"LATER": later})
        assert ex.logs.stdout == ["[secret:LATER]\n"], ex
        ex = sbx.run_code("import os\nprint(len(os.environ['API_KEY']))")
        assert ex.logs.stdout == [f"{len(SECRET)}\n"]
        # Another language's default context gets the sandbox's secrets too.
        ex = sbx.run_code("echo $API_KEY", language="bash")
        assert "".join(ex.logs.stdout).strip() == "[secret:API_KEY]", ex
        # The broker's tokens, the kernel's own key and credential formats are masked unasked.
        ex = sbx.run_code(
            "from ipykernel.kernelapp import IPKernelApp\n"
            f"print('{BOB}', IPKernelApp.instance().session.key.decode(), 'AKIA' + 'IOSFODNN7EXAMPLE')")
        assert ex.logs.stdout == ["[secret:broker-token] [secret:kernel-key] [secret:aws-access-key]\n"], ex

    async def mcp():
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {ALICE}"},
                                  timeout=httpx2.Timeout(30, read=300))
        async with Client(streamable_http_client(broker.url + "/mcp", http_client=http)) as client:
            r = await client.call_tool("create_session", {"secrets": {"DB_PASSWORD": SECRET}})
            made = json.loads(r.content[0].text)
            assert made["secrets"] == ["DB_PASSWORD"], made
            r = await client.call_tool("run_python", {"session_id": made["id"],
                                                      "code": "import os; print(os.environ['DB_PASSWORD'])"})
            text = "".join(c.text for c in r.content if c.type == "text")
            assert "[secret:DB_PASSWORD]" in text and not leaks_anywhere(text), text
            r = await client.call_tool("create_session", {"secrets": {"K": "abc"}})
            assert r.is_error and "shorter than 4" in r.content[0].text
            await client.call_tool("delete_session", {"session_id": made["id"]})
    asyncio.run(mcp())


def test_bad_secrets_are_refused(broker):
    for body, words in (
        ({"secrets": {"K": "abc"}}, "shorter than 4"),
        ({"secrets": {"LD_PRELOAD": "/tmp/evil.so"}}, "LD_PRELOAD"),
        ({"secrets": {"1BAD": "abcdef"}}, "not a valid environment variable name"),
        ({"secrets": {"K": "a\u0000bcdef"}}, "NUL"),
        ({"secrets": {"K": 5}}, ""),
        ({"secrets": {f"K{i}": "abcdef" for i in range(33)}}, "32"),
        ({"secrets": {"K": "x" * 5000}}, "longer than"),
        ({"secrets": {f"K{i}": "x" * 3000 for i in range(3)}}, "8192"),
    ):
        r = broker.api("POST", "/v1/sessions", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body.keys(), r.text)
    r = broker.api("POST", "/v1/sessions", json={"secrets": {"K": "abcdef"},
                                                   "snapshot": "00000000-0000-0000-0000-000000000000"})
    assert r.status_code == 400 and "snapshot" in r.json()["error"]["message"], r.text


def test_secrets_stay_masked_after_the_broker_restarts(fresh_broker):
    b = fresh_broker(extra_args=["--keep-sessions"])
    sid = create(b, secrets={"API_KEY": SECRET})["id"]
    execute(b, sid, "import os\nk = os.environ['API_KEY']")
    data_dir = b.data_dir
    b.terminate()
    # The kept record holds the secrets sealed, never verbatim.
    assert not files_holding(data_dir, [SECRET, B64, HEX]), files_holding(data_dir, [SECRET])
    b2 = fresh_broker(extra_args=["--keep-sessions"], data_dir=data_dir)
    r = execute(b2, sid, "print(k)")
    assert r.json()["stdout"] == "[secret:API_KEY]\n", r.text
    assert b2.api("GET", f"/v1/sessions/{sid}").json()["secrets"] == ["API_KEY"]
