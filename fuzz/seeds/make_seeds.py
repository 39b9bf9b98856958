"""Writes the seed corpora (fuzz/corpus/<target>/) from real Jupyter messages: the
requests, replies and outputs an ipykernel session exchanges, in each target's input format
(see fuzz/src/lib.rs). Run once; the files are committed."""
import hashlib, hmac, json, struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "corpus"
KEY = b"0123456789abcdef0123456789abcdef"

def hdr(msg_type, msg_id="a1b2c3d4-0001"):
    return {"msg_id": msg_id, "msg_type": msg_type, "session": "5f0e9c1a", "username": "alice",
            "date": "2026-11-22T23:10:00.123456Z", "version": "5.3"}

PARENT = hdr("execute_request", "p-0001")
MESSAGES = [  # (channel, header, parent, metadata, content, buffers)
    ("shell", hdr("kernel_info_request"), {}, {}, {}, []),
    ("shell", hdr("execute_request"), {}, {}, {"code": "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2]})\ndf.a.sum()", "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": True, "stop_on_error": True}, []),
    ("shell", hdr("execute_reply"), PARENT, {"started": "2026-11-22T23:10:00Z"}, {"status": "ok", "execution_count": 3, "user_expressions": {}, "payload": []}, []),
    ("iopub", hdr("stream"), PARENT, {}, {"name": "stdout", "text": "hello\n"}, []),
    ("iopub", hdr("status"), PARENT, {}, {"execution_state": "idle"}, []),
    ("iopub", hdr("execute_result"), PARENT, {}, {"execution_count": 3, "data": {"text/plain": "3"}, "metadata": {}}, []),
    ("iopub", hdr("error"), PARENT, {}, {"ename": "KeyError", "evalue": "'price'", "traceback": ["\u001b[0;31mKeyError\u001b[0m"]}, []),
    ("stdin", hdr("input_reply"), hdr("input_request", "p-2"), {}, {"value": "42"}, []),
    ("control", hdr("interrupt_request"), {}, {}, {}, []),
    ("shell", hdr("comm_msg"), {}, {}, {"comm_id": "c1", "data": {"method": "update"}}, [b"\x00\x01\x02\x03", b"buffer two"]),
]

def j(v):
    return json.dumps(v, separators=(",", ":")).encode()

def write(target, name, data):
    d = ROOT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)

for i, (channel, h, p, m, c, bufs) in enumerate(MESSAGES):
    parts = [j(h), j(p), j(m), j(c)]
    name = f"{i:02d}-{h['msg_type']}"
    # wire_decode: mode byte, frames joined by 0x00 (buffers with a 0 byte split: fine).
    sig = hmac.new(KEY, b"".join(parts), hashlib.sha256).hexdigest().encode()
    ids = [b"\x00k\x8b\x45\x67"[1:]] if i % 2 else []
    frames = ids + [b"<IDS|MSG>", sig] + parts + [b.replace(b"\x00", b"\x01") for b in bufs]
    write("wire_decode", name + "-signed", bytes([1]) + b"\x00".join(frames))
    write("wire_decode", name + "-resign", bytes([3]) + b"\x00".join(frames))
    frames[len(ids) + 1] = b""
    write("wire_decode", name + "-nokey", bytes([0]) + b"\x00".join(frames))
    # jupyter_framing: legacy JSON (0), legacy binary (1), v1 (2).
    legacy = {"header": h, "parent_header": p, "metadata": m, "content": c, "buffers": [],
              "channel": channel, "msg_id": h["msg_id"], "msg_type": h["msg_type"]}
    write("jupyter_framing", name + "-legacy", bytes([0]) + j(legacy))
    lparts = [j(legacy)] + bufs
    pos = 4 * (len(lparts) + 1)
    out = struct.pack(">I", len(lparts))
    for q in lparts:
        out += struct.pack(">I", pos); pos += len(q)
    write("jupyter_framing", name + "-legacybin", bytes([1]) + out + b"".join(lparts))
    vparts = [channel.encode()] + parts + bufs
    count = len(vparts) + 1
    pos = 8 * (count + 1)
    out = struct.pack("<Q", count)
    for q in vparts:
        out += struct.pack("<Q", pos); pos += len(q)
    out += struct.pack("<Q", pos)
    write("jupyter_framing", name + "-v1", bytes([2]) + out + b"".join(vparts))

# zmtp_reader: a kernel's bytes after the handshake (mode 1, 3) or with it (mode 0).
def frame(body, more=False, command=False):
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body

greeting = bytearray(64); greeting[0] = 0xFF; greeting[8] = 1; greeting[9] = 0x7F; greeting[10] = 3
greeting[12:16] = b"NULL"; greeting[32] = 1
ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"ROUTER"
for i, (channel, h, p, m, c, bufs) in enumerate(MESSAGES[:6]):
    parts = [b"<IDS|MSG>", b""] + [j(h), j(p), j(m), j(c)] + bufs
    body = b"".join(frame(q, more=k < len(parts) - 1) for k, q in enumerate(parts))
    write("zmtp_reader", f"{i:02d}-{h['msg_type']}", bytes([1]) + body)
    write("zmtp_reader", f"{i:02d}-{h['msg_type']}-small", bytes([3]) + body)
ping = frame(b"\x04PING" + b"\x00\x0a" + b"ctx", command=True)
write("zmtp_reader", "ping", bytes([1]) + ping)
write("zmtp_reader", "handshake", bytes([0]) + bytes(greeting) + frame(ready, command=True) + ping)
write("zmtp_reader", "long-frame", bytes([1]) + frame(b"x" * 300))
write("zmtp_reader", "error", bytes([1]) + frame(b"\x05ERROR\x03bye", command=True))

# stream_frame: the agent stream's client frames.
for name, f in [("execute", {"type": "execute", "id": "c1", "code": "1+1", "timeout_seconds": 30}),
                ("execute-int-id", {"type": "execute", "id": 7, "code": "print('hi')"}),
                ("input-reply", {"type": "input_reply", "id": "c1", "value": "42"}),
                ("interrupt", {"type": "interrupt"}),
                ("unknown", {"type": "shutdown"})]:
    write("stream_frame", name, j(f))
