"""A kernel that speaks ZeroMQ over TCP only, behind the ``ipc`` sockets the broker connects to.

The broker connects to a kernel's five sockets as Unix sockets in the kernel's runtime
directory (the ``ipc`` transport): a sandbox has no network of its own that the broker could
reach. Some kernels cannot bind ``ipc`` addresses (Deno's, whose host must be a name or an
address; jjava's, on JeroMQ). For their specs (``metadata.kernel_broker.transport: "tcp"``)
the broker starts this script in the sandbox instead, as the kernel's user:

    python -I kernel_broker_relay.py IPC_CONNECTION TCP_CONNECTION -- KERNEL ARGV...

It writes TCP_CONNECTION (the same key, five free ports on 127.0.0.1 of the sandbox's own
network namespace), starts the kernel with it, listens on the Unix sockets IPC_CONNECTION
names, and splices each connection the broker makes to the kernel's TCP port of the same
channel, byte for byte: ZMTP is the same protocol over both transports, so nothing is parsed
or re-framed. It forwards SIGINT and SIGTERM to the kernel and ends with it, with its status.

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


def serve_channel(port, child):
    async def on_connection(reader, writer):
        try:
            k_reader, k_writer = await connect_kernel(port, child)
        except OSError:
            writer.close()
            return
        sock = k_writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump(reader, k_writer), pump(k_reader, writer))

    return on_connection


async def main(ipc_file, tcp_file, argv):
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
        servers.append(await asyncio.start_unix_server(serve_channel(port, child), path=path))

    code = await child.wait()
    for s in servers:
        s.close()
    return code


def run():
    args = sys.argv[1:]
    if len(args) < 4 or args[2] != "--":
        raise SystemExit("usage: kernel_broker_relay.py IPC_CONNECTION TCP_CONNECTION -- ARGV...")
    code = asyncio.run(main(args[0], args[1], args[3:]))
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    run()
