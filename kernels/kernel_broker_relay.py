"""A kernel that speaks ZeroMQ over TCP only, behind the ``ipc`` sockets the broker connects to.

The broker connects to a kernel's five sockets as Unix sockets in the kernel's runtime
directory (the ``ipc`` transport): a sandbox has no network of its own that the broker could
reach. Some kernels cannot bind ``ipc`` addresses (Deno's, whose host must be a name or an
address; jjava's, on JeroMQ). For their specs (``metadata.kernel_broker.transport: "tcp"``)
the broker starts this script in the sandbox instead, as the kernel's user:

    python -I kernel_broker_relay.py [--idle-last] IPC_CONNECTION TCP_CONNECTION -- KERNEL ARGV...

It writes TCP_CONNECTION (the same key, five free ports on 127.0.0.1 of the sandbox's own
network namespace), starts the kernel with it, listens on the Unix sockets IPC_CONNECTION
names, and splices each connection the broker makes to the kernel's TCP port of the same
channel, byte for byte: ZMTP is the same protocol over both transports, so nothing is
re-framed. It forwards SIGINT and SIGTERM to the kernel and ends with it, with its status.

With ``--idle-last`` (Deno's spec) it repairs one fault of the kernel's: Deno publishes an
execution's ``execute_result`` from another task than its ``status: idle``, so about one
execution in twenty has its result published just after its idle (measured: 0.1 ms after),
and a client that ends an execution at its idle, as the protocol says it may, loses the
result. On the IOPub stream from the kernel the relay reads the ZMTP frames (never their
signatures or contents beyond the header's type and parent) and holds an idle whose
execution has shown no result yet until its result comes or ``IDLE_HOLD`` passes without
a message of that execution (its printed output comes late the same way, through Deno's
stdio task: each of its messages restarts the wait, up to ``IDLE_HOLD_MAX``), then sends
the idle after them: an execution that has a result never loses it, nor its output; one
without a result pays the hold.

Nothing here is trusted more than the kernel: the relay runs in the kernel's sandbox, with
its uid, limits and syscall filter, and the broker treats what it relays as the kernel's.
"""

import asyncio
import json
import os
import signal
import socket
import sys

CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
# How long a connection of the broker waits for the kernel's port to open (the kernel's
# start-up: a JVM takes seconds).
CONNECT_PATIENCE = 120.0
CHUNK = 256 * 1024
# How long an idle waits for its execution's late result or output after the last message
# of it (--idle-last), and at most in all.
IDLE_HOLD = 0.010
IDLE_HOLD_MAX = 2.0
# The ZMTP greeting's length (ZMTP 3), passed on as it is.
GREETING = 64


def free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_private(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)


async def pump(reader, writer):
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


async def connect_kernel(port, child):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_PATIENCE
    delay = 0.002
    while True:
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if child.returncode is not None or loop.time() > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)


async def read_frame(reader):
    """One ZMTP frame: (flags, the frame's bytes as sent)."""
    head = await reader.readexactly(1)
    flags = head[0]
    if flags & 0x02:
        size_bytes = await reader.readexactly(8)
        size = int.from_bytes(size_bytes, "big")
    else:
        size_bytes = await reader.readexactly(1)
        size = size_bytes[0]
    body = await reader.readexactly(size)
    return flags, head + size_bytes + body, body


def header_of(bodies):
    """(msg_type, parent msg_id, execution_state) of a Jupyter message's frames."""
    try:
        at = bodies.index(b"<IDS|MSG>")
        header = json.loads(bodies[at + 2])
        parent = json.loads(bodies[at + 3])
        state = None
        if header.get("msg_type") == "status":
            state = json.loads(bodies[at + 5]).get("execution_state")
        return header.get("msg_type"), parent.get("msg_id"), state
    except (ValueError, IndexError, AttributeError, TypeError):
        return None, None, None


async def read_messages(reader, queue):
    """The kernel's ZMTP stream as whole messages (or commands) on `queue`; None at its end."""
    try:
        while True:
            parts, bodies = [], []
            while True:
                flags, raw, body = await read_frame(reader)
                parts.append(raw)
                bodies.append(body)
                if flags & 0x04 or not flags & 0x01:
                    break  # a command, or the message's last frame
            command = bool(flags & 0x04)
            await queue.put((b"".join(parts), None if command else bodies))
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        await queue.put(None)


async def pump_idle_last(reader, writer):
    """The kernel's IOPub to the broker, an idle sent after its execution's late result."""
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue(maxsize=64)
    results = set()  # executions whose result has been seen
    held = None  # [raw bytes of an idle, its parent, when it goes, when it goes at the latest]
    reading = None
    try:
        writer.write(await reader.readexactly(GREETING))
        reading = asyncio.create_task(read_messages(reader, queue))
        while True:
            wait = None if held is None else max(0.0, held[2] - loop.time())
            try:
                item = await asyncio.wait_for(queue.get(), wait)
            except asyncio.TimeoutError:
                writer.write(held[0])
                results.discard(held[1])
                held = None
                await writer.drain()
                continue
            if item is None:
                break
            message, bodies = item
            kind, parent, state = header_of(bodies) if bodies is not None else (None, None, None)
            if kind in ("execute_result", "error"):
                results.add(parent)
            if kind == "status" and state == "idle" and parent not in results and held is None:
                now = loop.time()
                held = [message, parent, now + IDLE_HOLD, now + IDLE_HOLD_MAX]
                continue
            writer.write(message)
            if held is not None and parent == held[1] and kind not in ("execute_result", "error"):
                # Its output, late: the idle waits on after it.
                held[2] = min(loop.time() + IDLE_HOLD, held[3])
            elif held is not None and (parent == held[1] or kind == "status"):
                writer.write(held[0])
                results.discard(held[1])
                held = None
            if kind == "status" and state == "idle":
                results.discard(parent)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        if reading is not None:
            reading.cancel()
        if held is not None:
            try:
                writer.write(held[0])
            except OSError:
                pass
        try:
            writer.close()
        except OSError:
            pass


def serve_channel(name, port, child, idle_last):
    async def on_connection(reader, writer):
        try:
            k_reader, k_writer = await connect_kernel(port, child)
        except OSError:
            writer.close()
            return
        sock = k_writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        from_kernel = pump_idle_last if idle_last and name == "iopub" else pump
        await asyncio.gather(pump(reader, k_writer), from_kernel(k_reader, writer))

    return on_connection


async def main(ipc_file, tcp_file, argv, idle_last=False):
    with open(ipc_file) as f:
        conn = json.load(f)
    if conn.get("transport") != "ipc":
        raise SystemExit("kernel_broker_relay: %s is not an ipc connection file" % ipc_file)
    ports = free_ports(len(CHANNELS))
    tcp = dict(conn, transport="tcp", ip="127.0.0.1")
    for name, port in zip(CHANNELS, ports):
        tcp[name + "_port"] = port
    write_private(tcp_file, tcp)

    child = await asyncio.create_subprocess_exec(*argv)
    loop = asyncio.get_running_loop()

    def forward(signum):
        if child.returncode is None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, forward, signum)

    servers = []
    for name, port in zip(CHANNELS, ports):
        path = "%s-%s" % (conn["ip"], conn[name + "_port"])
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        handler = serve_channel(name, port, child, idle_last)
        servers.append(await asyncio.start_unix_server(handler, path=path))

    code = await child.wait()
    for s in servers:
        s.close()
    return code


def run():
    args = sys.argv[1:]
    idle_last = bool(args) and args[0] == "--idle-last"
    if idle_last:
        args = args[1:]
    if len(args) < 4 or args[2] != "--":
        raise SystemExit(
            "usage: kernel_broker_relay.py [--idle-last] IPC_CONNECTION TCP_CONNECTION -- ARGV..."
        )
    code = asyncio.run(main(args[0], args[1], args[3:], idle_last))
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    run()
