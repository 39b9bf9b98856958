"""kernel-broker's in-kernel fork: a live kernel copies itself, state and all, into a new
kernel reachable on sockets the broker names.

The broker writes this file beside ``kernel_broker_boot.py`` (a directory no kernel can
write); the boot script loads it once and installs it in every kernel it runs. It adds one
shell message type:

``kb_fork_request``
    ``{"connection": {"transport": "ipc", "ip": PREFIX, "shell_port": N, "iopub_port": N,
    "stdin_port": N, "control_port": N, "hb_port": N, "key": KEY, "signature_scheme":
    "hmac-sha256"}}``: the child kernel's sockets are ``ipc://PREFIX-PORT``, PREFIX inside
    the fork directory (``KERNEL_BROKER_FORK_ROOT``, else the directory of the kernel's own
    ipc sockets). The answer is ``kb_fork_reply`` ``{"status": "ok", "pid": PID}`` (PID as
    seen in the kernel's pid namespace) as soon as ``fork()`` returns, or ``{"status":
    "error", "ename": ..., "evalue": ...}`` and no child. The child then reopens its files,
    builds its kernel and binds its sockets (10 to 20 ms): a client connects as to any
    starting kernel, retrying until they are bound, and a child that fails to build says
    why on its stderr and exits. (The broker moves the child into a cgroup of its own
    meanwhile, which costs about as long again on cgroup v1: answering at once runs the two
    side by side.)

``kb_fork_request`` with ``{"hold": {"connection_file": PATH}}`` instead of a connection
    makes a *held* child, for a copy of the kernel into another sandbox (a session with a
    workspace of its own: the broker dumps the held child with CRIU and restores it in the
    new sandbox, ``docs/CRIU.md``). The held child separates its files as a fork's child
    does, then closes every descriptor that is not a regular file (CRIU cannot carry a
    socket or a pipe into another sandbox: a network connection, a pipe a cell opened and
    the kernel's own output pipes are not carried), puts 0-2 on ``/dev/null``, answers
    ``{"status": "ok", "pid": PID}`` and waits, signal ``WAKE_SIGNAL`` blocked, for that
    signal sent from outside its pid namespace (``si_pid`` 0: the broker; a process of the
    sandbox cannot wake it), at most ``HOLD_TIMEOUT`` (then it ends: a broker that died
    mid-copy never comes back for it). Woken (in the new sandbox, restored), it reads its connection
    from PATH (the new sandbox's connection file, inside the fork directory), checks it as
    a request's, and builds its kernel on it as a fork's child does. ``PATH`` is read only
    then: at the request it is the parent's sandbox's.

``kb_fork_request`` with ``{"hold": {"control": PATH}}`` makes a *checkpoint*: a held child
    (its files kept as above, nothing else) that connects to the broker's unix socket PATH
    (inside the fork directory; the kernel answers at once, as for a fork, and the broker
    waits for the connection), and then waits on it. Each line the
    broker sends is a fork request's content (``{"connection": ...}``, checked as one): the
    held child forks, its child builds a kernel on that connection as a fork's child does,
    and the held child answers on the socket with the content of a ``kb_fork_reply`` and
    waits for the next. It ends when the broker closes the socket. The broker keeps only the
    connection whose peer is the held child's pid, so the key it sends there reaches no
    other process of the sandbox.

How. Shell messages are dispatched one at a time on the kernel's main thread, so the
request is handled between two executions with the user's state at rest. (A busy kernel
receives it only when its running execution ends: shell messages queue behind it. A broker
that wants the fork now should interrupt first, or refuse.) The handler forks once and
answers at once: it notes its regular files' offsets before the fork, and the child
reopens them at those offsets, so the parent may move its own straight away (waiting for
the child to run, 3 to 6 ms after ``fork()`` returns with a 200 MB DataFrame, was most of a
checkpoint's time). SIGINT is blocked across the fork, so an interrupt of the parent's
process group waits in the child until it ignores it. The child starts a session of its
own (``setsid``), so ipykernel's habit of terminating the children in its process group at
shutdown, and an interrupt sent to the parent's group, leave it alone. The parent reaps
its forks that ended (``waitpid`` on their pids only) at each request and after each
execution. (Forking twice, so that the new kernel is nobody's child, was measured: the
second fork copies the page tables again, ~5 ms with a 200 MB DataFrame.)

In the child only the forking thread exists. The ZeroMQ context, its sockets, the IOPub,
control, shell-channel and heartbeat threads, and the asyncio loop that was running are
the parent's: libzmq is not fork-safe and an epoll instance is shared by both processes
after a fork, so the child never uses, closes or unregisters any of them. They are kept
referenced forever (``_ABANDONED``: no destructor runs) and the child ends with
``os._exit`` (no atexit handler of the parent's runs). The child then builds what
ipykernel's ``IPKernelApp.initialize`` builds, from a fresh application: a new context and
sockets on the named connection, a new Session with the new key, IOPub, heartbeat, control
and shell-channel threads, stdout/stderr streams, and a new kernel object; the kernel finds
the same ``InteractiveShell`` singleton (user namespace, In/Out and the execution count,
imported modules, matplotlib's figures and inline hooks, the working directory, the
environment), which is pointed at the new kernel, session and IOPub. A new asyncio loop
runs the new kernel, nested in the stack of the handler that forked (the old loop is
marked not running and never resumed).

What is and is not carried (tested in ``tests/test_fork.py``):

- The parent's own ipc sockets (listeners and its clients' connections) are closed in the
  child, so they end with the parent. So are the child's copies of the rest of the
  parent's machinery (``_MACHINERY``: its ZeroMQ signalers and epoll instances, its
  threads' pipes, its event loop's selector): a fork of a fork of a fork (a checkpoint
  after every execution makes such a lineage) holds one generation's descriptors, not
  all of theirs. What the cells opened is kept.

- Python's ``random`` module reseeds itself in a forked child; the generator's state is put
  back, so the fork draws the same numbers as the original. numpy's global state and every
  generator object are plain memory and carry over.
- Regular files a cell opened are reopened in the child with the same flags and the
  offset they had at the fork, and put at the same descriptor number, so reading or
  seeking in one process does not move the other. A file deleted or replaced since it was
  opened (or renamed in the moment after the fork) cannot be reopened: it keeps sharing
  its offset. Each kernel forked from a checkpoint reopens them again, so two of them (or
  one and the checkpoint) do not share offsets either. Locks taken with ``flock`` belong to the old open file and are not
  held by the child's copy. Pipes, sockets, terminals and devices stay shared (there is
  nothing to reopen): a network connection a cell opened is the same connection in both.
- Threads a cell started do not exist in the child (only the forking thread survives a
  fork); their ``Thread`` objects say ``is_alive() == False``. Subshells (ipykernel 7's
  threads) are not carried either. Subprocesses a cell started remain the parent's
  children: ``os.waitpid`` on one fails with ``ChildProcessError`` in the child, and
  ``Popen.wait``/``poll`` take that ECHILD for an exit with status 0 (Python's own rule).
- What the user's template imported is frozen out of every kernel's cyclic collector (the
  template's ``gc.freeze``, inherited by each kernel and fork): a collection would write
  to every object it walks and copy its page. Objects a cell made are not frozen: a fork
  collects them as the original does. (A checkpoint's held child still copies about 4 MB
  of the pages it shares with the live kernel just by running CPython's after-fork code
  and its own few hundred lines: type objects' reference counts in libpython's data, the
  heap, allocator arenas. Freezing everything in the child was measured: no change.)
- Files are not copied: the child sees the same file system (a workspace of its own is the
  broker's business). Nor is the process tree's shape: when the parent is its pid
  namespace's init, killing it ends the namespace and every fork in it.
- Comms (widgets) open in the parent are pointed at the child's kernel; their front-end
  peers are the parent's clients, so a widget in the child has no view until reopened.
  ``%connect_info`` in the child knows no connection file (there is none).
- The child starts a new session (``setsid``): an interrupt sent to the parent's process
  group does not reach it. SIGINT is handled as in a fresh kernel: ignored between
  messages, ``KeyboardInterrupt`` in an execution; every thread but the main one blocks it
  (the boot script's ``signals_to_the_main_thread`` patch is inherited).
- The history database: the broker runs kernels with an in-memory history
  (``--HistoryManager.hist_file=:memory:``), plain memory that the fork copies. A kernel
  writing history to a file would share an SQLite connection with its fork; the child
  turns its history writing off instead.
"""

import asyncio
import atexit
import json
import os
import random
import select
import signal
import stat
import sys
import threading
import time

MSG_TYPE = "kb_fork_request"
# What wakes a held child (SIGRTMIN+6 with glibc; the broker sends the same number).
WAKE_SIGNAL = 40
# How long a held child waits to be dumped and woken: one the broker never comes back to (it
# died mid-copy) ends by itself rather than holding its memory for as long as its parent.
# The time it spends stopped does not count: a held child dumped for a pause or a snapshot
# is restored minutes or months later, its clock then far past any deadline it had.
HOLD_TIMEOUT = 600.0
# How long one wait of a held child lasts: a wait that took longer than this and HOLD_STEP
# again was stopped meanwhile (dumped and restored, or frozen), and the timeout starts anew.
HOLD_STEP = 1.0
# The most a connection file read at waking may hold.
MAX_CONNECTION_FILE = 64 * 1024
REPLY_TYPE = "kb_fork_reply"
ROOT_ENV = "KERNEL_BROKER_FORK_ROOT"
PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
# A child that has not answered by then is killed and the fork refused.
READY_TIMEOUT = 30.0
# How often a child that has not answered yet is sent SIGCONT (``read_answer``).
CONTINUE_EVERY = 0.05
# sockaddr_un holds 108 bytes; the longest suffix is "-65535" and a NUL.
MAX_IP_LENGTH = 100
MAX_KEY_LENGTH = 1024
# What a fork adds to the recursion limit of its child (see `become`), and the longest
# lineage served: each generation nests the next kernel in its stack (11 frames, about
# 1.3 KB of the main thread's stack measured), so a lineage is bounded well inside the
# stack's 8 MB; past it a fork is refused, saying why.
GENERATION_FRAMES = 64
MAX_GENERATIONS = 2000

# What a child abandoned from its parent: never closed, never collected.
_ABANDONED = []
# The pids of this kernel's forks that have not been reaped yet.
_FORKS = set()
# The descriptors of this process's kernel machinery (its ZeroMQ context, sockets and
# signalers, its threads' pipes, its event loop's selector): the ones open when its first
# execution starts (or its first fork, if that comes first) that were not open before its
# kernel was built. A fork closes its copies of its parent's, so a lineage of forks (a
# checkpoint after every execution makes one a step) holds one generation's machinery,
# not every generation's. `None` until noted.
_MACHINERY = None
# The descriptors open before this process's kernel was built: none in a started kernel
# (what it has before its first execution is all machinery, 0-2 aside); in a fork, what it
# kept of its parent's (the cells' files and sockets).
_BEFORE_BUILD = frozenset()
# How many forks this process is from a started kernel (0: it is one).
_GENERATION = 0
# Where descriptors 1 and 2 went before the kernel's streams redirected them: copies a
# fork makes once (see `abandon`), or None in a started kernel.
_STD_TARGETS = None
# The `random` state a built fork's first execution will start from, until that execution
# (`restore_random`); None once it ran, or in a started kernel.
_PENDING_RANDOM = None


class ForkRefused(Exception):
    """A request the kernel will not act on; the reply names why."""


def log(message):
    try:
        sys.__stderr__.write("kernel-broker fork: %s\n" % message)
        sys.__stderr__.flush()
    except Exception:
        pass


def fork_root(app):
    """The directory a child's sockets must be in: ``KERNEL_BROKER_FORK_ROOT``, else the
    directory holding this kernel's own ipc sockets."""
    root = os.environ.get(ROOT_ENV)
    if not root:
        if getattr(app, "transport", None) != "ipc" or not getattr(app, "ip", ""):
            return None
        root = os.path.dirname(os.path.abspath(app.ip))
    return os.path.realpath(root)


def validate(content, root):
    """Checks a request's content; returns the child's connection info, or raises
    ForkRefused. Nothing is created before the content is known to be good."""
    if not isinstance(content, dict):
        raise ForkRefused("the content is not an object")
    conn = content.get("connection")
    if not isinstance(conn, dict):
        raise ForkRefused("'connection' is missing or not an object")
    if conn.get("transport", "ipc") != "ipc":
        raise ForkRefused("only the ipc transport is allowed")
    ip = conn.get("ip")
    if not isinstance(ip, str) or not ip:
        raise ForkRefused("'ip' (the sockets' path prefix) is missing or not a string")
    if "\0" in ip or len(ip) > MAX_IP_LENGTH:
        raise ForkRefused("'ip' is too long or holds a NUL")
    if root is None:
        raise ForkRefused("this kernel has no fork directory (%s is not set)" % ROOT_ENV)
    if not os.path.isabs(ip) or os.path.normpath(ip) != ip:
        raise ForkRefused("'ip' must be an absolute, normalised path")
    parent = os.path.realpath(os.path.dirname(ip))
    if os.path.commonpath([root, parent]) != root:
        raise ForkRefused("'ip' is outside the fork directory")
    if not os.path.isdir(parent):
        raise ForkRefused("the directory of 'ip' does not exist")
    ports = {}
    for name in PORTS:
        port = conn.get(name)
        if type(port) is not int or not 0 < port < 65536:
            raise ForkRefused("%r is missing or not a port number" % name)
        ports[name] = port
    if len(set(ports.values())) != len(ports):
        raise ForkRefused("the ports are not distinct")
    for port in ports.values():
        if os.path.lexists("%s-%d" % (ip, port)):
            raise ForkRefused("%s-%d exists already" % (ip, port))
    key = conn.get("key")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise ForkRefused("'key' is missing, empty, too long or not a string")
    scheme = conn.get("signature_scheme", "hmac-sha256")
    if scheme not in ("hmac-sha256", "hmac-sha512"):
        raise ForkRefused("'signature_scheme' must be hmac-sha256 or hmac-sha512")
    info = {"transport": "ipc", "ip": ip, "key": key, "signature_scheme": scheme}
    info.update(ports)
    return info


def validate_hold(hold, root):
    """Checks a hold request's content; returns it, or raises ForkRefused."""
    if not isinstance(hold, dict):
        raise ForkRefused("'hold' is not an object")
    if "control" in hold:
        return {"control": validate_control(hold.get("control"), root)}
    path = hold.get("connection_file")
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
        raise ForkRefused("'hold.connection_file' is missing or not a path")
    if root is None:
        raise ForkRefused("this kernel has no fork directory (%s is not set)" % ROOT_ENV)
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        raise ForkRefused("'hold.connection_file' must be an absolute, normalised path")
    if os.path.commonpath([root, os.path.dirname(path)]) != root:
        raise ForkRefused("'hold.connection_file' is outside the fork directory")
    private = hold.get("private", [])
    if (
        not isinstance(private, list)
        or len(private) > 8
        or not all(
            isinstance(p, str) and p and "\0" not in p and len(p) <= 256 and os.path.isabs(p)
            for p in private
        )
    ):
        raise ForkRefused("'hold.private' must be a list of at most 8 absolute paths")
    return {"connection_file": path, "private": [os.path.normpath(p) for p in private]}


def validate_control(path, root):
    """Checks a checkpoint's control socket path (under the fork directory); returns it."""
    if not isinstance(path, str) or not path or "\0" in path or len(path) > MAX_IP_LENGTH:
        raise ForkRefused("'hold.control' is missing, too long or not a path")
    if root is None:
        raise ForkRefused("this kernel has no fork directory (%s is not set)" % ROOT_ENV)
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        raise ForkRefused("'hold.control' must be an absolute, normalised path")
    if os.path.commonpath([root, os.path.realpath(os.path.dirname(path))]) != root:
        raise ForkRefused("'hold.control' is outside the fork directory")
    return path


def private_files(prefixes):
    """What this process holds under `prefixes` (directories that do not outlive its
    sandbox): open files, mapped files and its working directory; sorted."""
    if not prefixes:
        return []

    def under(path):
        path = path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)

    found = set()
    for fd in open_fds():
        try:
            target = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            continue
        if under(target):
            found.add(target)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and under(parts[5].strip()):
                    found.add(parts[5].strip())
    except OSError:
        pass
    try:
        cwd = os.getcwd()
        if under(cwd):
            found.add(cwd + " (its working directory)")
    except OSError:
        pass
    return sorted(found)


def handle(app, kernel, stream, ident, parent):
    """The ``kb_fork_request`` handler, on the kernel's main thread between executions."""
    try:
        if threading.current_thread() is not threading.main_thread():
            # A subshell's thread: the main thread may be mid-execution, its state in
            # flux, and the child would have no main thread to run on.
            raise ForkRefused("kb_fork_request must be sent to the main shell, not a subshell")
        content = parent.get("content")
        hold = content.get("hold") if isinstance(content, dict) else None
        if hold is not None:
            hold = validate_hold(hold, fork_root(app))
        else:
            info = validate(content, fork_root(app))
        if _GENERATION >= MAX_GENERATIONS:
            raise ForkRefused(
                "this kernel is the fork of a fork %d times over (a checkpoint after each "
                "execution makes one a step), the most a lineage can be: restart the "
                "session, or rewind to an earlier checkpoint" % _GENERATION
            )
        pid = fork(app, kernel, None if hold is not None else info, hold)
        content = {"status": "ok", "pid": pid}
    except ForkRefused as e:
        content = {"status": "error", "ename": "ForkRefused", "evalue": str(e), "traceback": []}
    except Exception as e:
        log("fork failed: %r" % e)
        content = {"status": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": []}
    kernel.session.send(stream, REPLY_TYPE, content, parent, ident=ident)


def fork(app, kernel, info, hold=None):
    """Forks the kernel; returns the new kernel's pid at once (a held child for another
    sandbox's copy, ``{"hold": {"connection_file": ...}}``, may refuse: its pid once it is
    held). The child reopens its files at the offsets they had at the fork (noted here,
    before it), so this process may read and seek in them again straight away: the child
    takes a few milliseconds to be scheduled, and nothing waits for it."""
    reap()
    note_machinery()
    files = file_table()
    waits = hold is not None and "control" not in hold
    read_fd, write_fd = os.pipe() if waits else (None, None)
    # `random` reseeds its generator in every forked child; the fork keeps this one's: the
    # state its next execution starts from (a kernel that has not run since it was built
    # itself holds one, `restore_random`, which its start-up's draws have not touched).
    random_state = _PENDING_RANDOM if _PENDING_RANDOM is not None else random.getstate()
    # An interrupt of this kernel's process group before the child has a session of its
    # own (and ignores SIGINT) waits in the child until then, and is dropped there.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    pid = os.fork()
    if pid == 0:
        try:
            if read_fd is not None:
                os.close(read_fd)
            become(app, kernel, info, write_fd, random_state, hold, files, mask)  # never returns
        finally:
            os._exit(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _FORKS.add(pid)
    if not waits:
        return pid
    os.close(write_fd)
    try:
        answer = read_answer(read_fd, pid)
    finally:
        os.close(read_fd)
    if answer.get("pid") != pid:
        # Failed (it exits after saying why) or silent past the timeout: ended, then reaped.
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
        _FORKS.discard(pid)
        raise ForkRefused(answer.get("error") or "the child ended before it was held")
    return pid


def open_fds():
    """The descriptors open now (the listing's own, closed by the time it returns, left
    out)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        fds.add(int(name))
    return fds


def identity(fd):
    """What a descriptor refers to: (device, inode), or None if it is not open."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def note_machinery():
    """Notes this process's machinery (see ``_MACHINERY``), once: at its first execution,
    before any code of a cell runs, or at its first fork. Each descriptor with what it
    referred to then: the machinery closes some of its own later (a client's connection
    ends) and the number may be reused."""
    global _MACHINERY
    if _MACHINERY is None:
        noted = {}
        for fd in open_fds() - _BEFORE_BUILD - {0, 1, 2}:
            ident = identity(fd)
            if ident is not None:
                noted[fd] = ident
        _MACHINERY = noted


def close_machinery(machinery, keep=()):
    """In a child: closes its copies of the parent's machinery, each only if it still
    refers to what was noted (a number the machinery gave up may have gone to a cell's
    file since, or to the fork's own pipe, `keep`). Closing a descriptor touches only the
    child's table (an epoll registration, a socket, a pipe live on in the parent); the
    objects that held them are abandoned, never used again. Returns the descriptors
    closed."""
    closed = []
    for fd, ident in sorted(machinery.items()):
        if fd <= 2 or fd in keep or identity(fd) != ident:
            continue
        try:
            os.close(fd)
            closed.append(fd)
        except OSError:
            pass
    return closed


def reap(forks=None):
    """Collects the exit status of forks that ended (only those: a subprocess a cell
    started is left to whoever waits for it), and takes them out of `forks` (this kernel's,
    ``_FORKS``, unless a held checkpoint names its own). Called at each request and after
    each execution, so an ended fork stays a zombie at most until then."""
    forks = _FORKS if forks is None else forks
    for pid in list(forks):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            forks.discard(pid)


def read_answer(fd, pid=None):
    """The child's one JSON line on the pipe, or {} at end of file or after the timeout
    (a child that does not answer in time is killed). The child `pid` is sent SIGCONT
    every ``CONTINUE_EVERY`` seconds meanwhile: a thread of a cell may stop this kernel's
    children (SIGSTOP) as they are made, and a stopped child would never answer."""
    data = b""
    deadline = time.monotonic() + READY_TIMEOUT
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return {"error": "the child did not answer within %d s" % READY_TIMEOUT}
        # poll, not select: a kernel may hold more than FD_SETSIZE descriptors.
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(min(left, CONTINUE_EVERY) * 1000):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        answer = json.loads(data)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def say(fd, obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def become(old_app, old_kernel, info, ready_fd, random_state, hold, files, mask):
    """In the forked child: reopens its files (`files`, the parent's table at the fork),
    rebuilds the kernel around the same shell, serves until shut down (with a `hold` for
    another sandbox: answers on `ready_fd`, is held, and builds once woken; with a
    checkpoint's: held on the broker's control socket). Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the parent's loop's wake-up socket is shared
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.setsid()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # The new kernel runs nested in the stack of the handler that forked (about a dozen
        # frames a generation): room for them, so a lineage of forks is not cut short.
        sys.setrecursionlimit(sys.getrecursionlimit() + GENERATION_FRAMES)
        global _GENERATION
        _GENERATION += 1
        _FORKS.clear()  # the parent's forks are not this process's children
        _ABANDONED.append(abandon(old_app, old_kernel))
        global _STD_TARGETS
        if _STD_TARGETS is None:
            _STD_TARGETS = (os.dup(1), os.dup(2))
        # The parent went on at once (and may have moved the shared offsets since: the
        # table holds those of the fork). The broker meanwhile connects, retrying until the
        # sockets are bound, and moves this process into a cgroup of its own (a
        # checkpoint's held child it waits for on its control socket).
        separate_files(files)
        close_parent_sockets(old_app)
        global _MACHINERY, _BEFORE_BUILD
        close_machinery(_MACHINERY or {}, keep={ready_fd})
        _MACHINERY = None
        if hold is not None and "control" in hold:
            # A checkpoint: held, and forks a child for each wake; returns in that child.
            info = held_checkpoint(hold["control"], fork_root(old_app))
        elif hold is not None:
            be_held(ready_fd, hold.get("private") or [])
            ready_fd = None
            info = woken(hold, fork_root(old_app))
        _BEFORE_BUILD = frozenset(open_fds())
        app = rebuild(old_app, old_kernel, info)
        restore_random(app.shell, random_state)
        app.start()
        code = 0
        # Shut down (or `exit()` in a cell): close what the child made, as ipykernel does
        # at exit, so the last replies and IOPub messages go out; a close that blocks
        # (a socket left open keeps the context's termination waiting) ends by SIGALRM.
        signal.alarm(5)
        try:
            app.close()
        except BaseException:
            pass
    except BaseException as e:
        try:
            if ready_fd is not None:
                say(ready_fd, {"error": "the child failed: %r%s" % (e, where(e))})
            log("fork child failed: %r%s" % (e, where(e)))
        except BaseException:
            pass
    finally:
        os._exit(code)


def keep_only_files(ready_fd):
    """In a held child: closes every descriptor but its regular files and `ready_fd`, and
    points 0-2 at ``/dev/null``."""
    global _STD_TARGETS
    # The kernel's own output (what 1 and 2 went to, and the streams' copies of them) is
    # not carried, even where it is a file (a log in the sandbox's /tmp that the sandbox
    # may remove when the kernel that wrote it ends): it closes with the pipes below.
    own_output = set(_STD_TARGETS or ())
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        copy = getattr(stream, "_original_stdstream_copy", None)
        if isinstance(copy, int):
            own_output.add(copy)
    _STD_TARGETS = None
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    for fd in sorted(open_fds()):
        if fd in (ready_fd, null) or fd <= 2:
            continue
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode) and fd not in own_output
        except OSError:
            continue
        if not regular:
            try:
                os.close(fd)
            except OSError:
                pass
    for fd in (0, 1, 2):
        os.dup2(null, fd, inheritable=True)
    os.close(null)


def be_held(ready_fd, private=()):
    """In a held child: keeps only its regular files (0-2 on ``/dev/null``), answers on
    `ready_fd` (closed), and waits for ``WAKE_SIGNAL`` from outside its pid namespace.
    Refuses (says why on `ready_fd` and exits) when it holds anything under `private`:
    directories of its sandbox that the sandbox it will be restored in does not have."""
    keep_only_files(ready_fd)
    held = private_files(private)
    if held:
        shown = ", ".join(held[:5]) + (" and %d more" % (len(held) - 5) if len(held) > 5 else "")
        say(ready_fd, {"error": "it holds %s, in its sandbox's own %s, which would not come "
                       "back: close it (or use a session with a workspace of its own)"
                       % (shown, " or ".join(private))})
        os._exit(1)
    # Its waits are timed by SIGALRM (`ITIMER_REAL`), waited for beside the wake signal:
    # `signal.sigtimedwait` answers a wait that a stop interrupted past its timeout (as a
    # dump and a restore interrupt it) with a siginfo it never filled, which could pass for
    # the broker's. `sigwaitinfo` has no timeout, and returns only signals it took.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [WAKE_SIGNAL, signal.SIGALRM])
    say(ready_fd, {"pid": os.getpid()})
    os.close(ready_fd)
    deadline = time.monotonic() + HOLD_TIMEOUT
    while True:
        before = time.monotonic()
        left = deadline - before
        if left <= 0:
            os._exit(0)  # never woken: nobody will be
        step = min(left, HOLD_STEP)
        signal.setitimer(signal.ITIMER_REAL, step)
        got = signal.sigwaitinfo([WAKE_SIGNAL, signal.SIGALRM])
        if got.si_signo != WAKE_SIGNAL:
            if time.monotonic() - before > step + HOLD_STEP:
                # Stopped meanwhile: restored from a dump (the broker wakes it now; its
                # signal waits, blocked, for the next wait) or frozen. Its time starts anew.
                deadline = time.monotonic() + HOLD_TIMEOUT
            continue
        # SI_USER from a process outside the pid namespace (the broker): si_pid is 0.
        if got.si_code == 0 and got.si_pid == 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            # A tick that came meanwhile goes before SIGALRM is let through again (its
            # default action, which the kernel's shutdown counts on, ends the process).
            signal.sigtimedwait([signal.SIGALRM], 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, set(old) | {WAKE_SIGNAL})
            return


def held_checkpoint(control, root):
    """In a checkpoint's held child, which has answered (once its files were its own):
    keeps only its regular files, connects to the broker's control socket `control` (the
    broker checks the connecting pid, so no other process of the sandbox can take its
    place; one that cannot connect ends), and waits. Each line the broker sends holds a connection (``{"connection": ...}``, checked
    as a request's): it forks, the child returns that connection (and is built into a
    kernel by the caller), and this process answers with the child's pid, as a
    ``kb_fork_reply``'s content, and waits for the next. It ends when the broker closes
    the socket (the checkpoint dropped, its session ended, the broker gone): a checkpoint
    never outlives the broker that holds it. The connection's key travels over that socket
    alone, never through a file another kernel of the sandbox could read."""
    import socket

    keep_only_files(None)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(control)
    except OSError as e:
        log("a checkpoint cannot reach the broker at %s: %s" % (control, e.strerror))
        os._exit(1)
    children = set()
    pending = b""

    def answer(content):
        sock.sendall((json.dumps(content) + "\n").encode())

    while True:
        reap(children)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        # Woken each second while a child may end (to reap it); else only by the broker.
        if not poller.poll(1000 if children else None):
            continue
        try:
            chunk = sock.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            os._exit(0)
        pending += chunk
        if len(pending) > MAX_CONNECTION_FILE:
            os._exit(1)
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                try:
                    request = json.loads(line)
                except ValueError:
                    raise ForkRefused("the request is not JSON")
                info = validate(request, root)
            except ForkRefused as e:
                answer({"status": "error", "ename": "ForkRefused", "evalue": str(e)})
                continue
            pid = os.fork()
            if pid == 0:
                sock.close()
                # Its files' descriptions are this process's, shared with every kernel
                # forked from it: its own before any code of it runs, so no kernel of the
                # checkpoint moves another's offsets (or the checkpoint's, where the next
                # one starts from).
                separate_files()
                return info
            children.add(pid)
            answer({"status": "ok", "pid": pid})


def woken(hold, root):
    """In a held child once woken: its connection, read from the connection file and
    checked as a request's (raises ForkRefused)."""
    path = hold["connection_file"]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ForkRefused("cannot open the connection file %s: %s" % (path, e.strerror))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ForkRefused("the connection file %s is not a regular file" % path)
        data = os.read(fd, MAX_CONNECTION_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONNECTION_FILE:
        raise ForkRefused("the connection file %s is too large" % path)
    try:
        connection = json.loads(data)
    except ValueError:
        raise ForkRefused("the connection file %s is not JSON" % path)
    return validate({"connection": connection}, root)


def where(e):
    """Where in the rebuild an exception was raised (its innermost frame), for the reply."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return " in %s (%s:%d)" % (last.name, os.path.basename(last.filename), last.lineno)


def restore_random(shell, state):
    """Puts `random`'s state back just before the child's first execution: the kernel's
    start-up draws from it too (after the child is built), so it is set last of all. Until
    then it is the state a fork of this kernel takes (`_PENDING_RANDOM`)."""
    global _PENDING_RANDOM
    random.setstate(state)
    _PENDING_RANDOM = state

    def pre_execute():
        global _PENDING_RANDOM
        shell.events.unregister("pre_execute", pre_execute)
        random.setstate(state)
        _PENDING_RANDOM = None

    shell.events.register("pre_execute", pre_execute)


def abandon(old_app, old_kernel):
    """What the parent's kernel owned, kept referenced so that no destructor touches it,
    with its exit handlers unregistered."""
    kept = (
        old_app,
        old_kernel,
        sys.stdout,
        sys.stderr,
        sys.displayhook,
        getattr(old_app, "context", None),
        getattr(old_app, "heartbeat", None),
        getattr(old_app, "iopub_thread", None),
        getattr(old_app, "control_thread", None),
        getattr(old_app, "shell_channel_thread", None),
        # The log's handlers: the child's app configures the same logger again and drops
        # them, and the one ipykernel pointed at the parent's copy of descriptor 2 wraps
        # that number in a FileIO that closes it when collected; the child reuses the
        # number (for its own stderr copy, as a rule), which the collection would close.
        tuple(getattr(getattr(old_app, "log", None), "handlers", ())),
    )
    for fn in (old_app.close, old_app.cleanup_connection_file):
        try:
            atexit.unregister(fn)
        except Exception:
            pass
    # The parent's stdout/stderr streams redirected descriptors 1 and 2 to pipes that the
    # parent's threads read: point them back where they went before, so the child's new
    # streams capture into pipes of their own.
    # A fork's own copies (`_STD_TARGETS`, made once in the first fork of a lineage and
    # inherited, never machinery) are used first: the streams' copies are the parent's
    # machinery, whose numbers a lineage reuses.
    copies = _STD_TARGETS or tuple(
        getattr(stream, "_original_stdstream_copy", None) for stream in (sys.stdout, sys.stderr)
    )
    for fd, copy in zip((1, 2), copies):
        if copy is not None:
            try:
                os.dup2(copy, fd)
            except OSError as e:
                log("cannot point descriptor %d back at the kernel's output: %r" % (fd, e))
    # Never flushed: a flush would go through the parent's IOPub thread.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    sys.displayhook = sys.__displayhook__
    return kept


def file_table(proc="/proc/self/fd"):
    """The regular files the process has open, each as (descriptor, path, flags, offset,
    (device, inode)); the kernel's own output files are left out: what descriptors 0-2
    point at, and what they pointed at before ipykernel put pipes there (the copies its
    streams and a fork keep, which a child points 1 and 2 back at): they stay shared, as a
    log should be."""
    import fcntl

    own = set()
    targets = [0, 1, 2] + list(_STD_TARGETS or ())
    for stream in (sys.stdout, sys.stderr):
        copy = getattr(stream, "_original_stdstream_copy", None)
        if isinstance(copy, int):
            targets.append(copy)
    for fd in targets:
        ident = identity(fd)
        if ident is not None:
            own.add(ident)
    table = []
    for name in os.listdir(proc):
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if fd <= 2 or not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in own:
            continue
        try:
            path = os.readlink("%s/%d" % (proc, fd))
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            offset = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:
            continue  # an O_PATH descriptor: nothing to read, nothing shared to move
        access = flags & (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_SYNC | os.O_DSYNC)
        table.append((fd, path, access, offset, (st.st_dev, st.st_ino)))
    return table


def separate_files(table=None, proc="/proc/self/fd"):
    """Reopens each regular file of `table` (``file_table``'s; now's if None) at the same
    descriptor, with the same flags and the offset of the table: after a fork both
    processes share one open file (one offset); after this the child has its own. Returns
    the descriptors reopened."""
    reopened = []
    for fd, path, access, offset, ident in file_table(proc) if table is None else table:
        try:
            new = os.open(path, access | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # deleted, renamed or unreadable now: stays shared
        try:
            nst = os.fstat(new)
            if (nst.st_dev, nst.st_ino) != ident or identity(fd) != ident:
                continue  # the path names another file now
            os.lseek(new, offset, os.SEEK_SET)
            os.dup2(new, fd, inheritable=os.get_inheritable(fd))
            reopened.append(fd)
        except OSError:
            pass
        finally:
            os.close(new)
    return reopened


def close_parent_sockets(old_app):
    """Closes the child's copies of the parent's ipc sockets (the listening ones and the
    connections its clients made), found by their path in /proc/net/unix. The child never
    uses them; held open, they would outlive the parent: a client connecting to a dead
    parent would wait on a listener nobody accepts from instead of being refused, and a
    connected one would not see the end of its connection. Closing a descriptor touches
    only the child's table; the ZeroMQ objects that named them are never used again.
    Returns the descriptors closed."""
    if getattr(old_app, "transport", None) != "ipc" or not getattr(old_app, "ip", ""):
        return []
    prefix = old_app.ip + "-"
    inodes = set()
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7].startswith(prefix):
                    inodes.add(fields[6])
    except (OSError, StopIteration):
        return []
    closed = []
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            try:
                os.close(int(name))
                closed.append(int(name))
            except OSError:
                pass
    return closed


def rebuild(old_app, old_kernel, info):
    """What ``IPKernelApp.initialize`` builds, on the new connection, around the existing
    shell; the parts that concern the process once (configuration, profile, path,
    extensions, startup code, pylab) are not redone: they are in the inherited state."""
    from ipykernel.kernelapp import IPKernelApp

    shell = old_kernel.shell
    # A new loop for the new kernel; the old one (whose task is running this code) is
    # marked not running and never resumed. Tornado's IOLoop.current() follows asyncio's.
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(asyncio.new_event_loop())

    kernel_class = type(old_kernel)
    IPKernelApp.clear_instance()
    kernel_class.clear_instance()
    app = IPKernelApp.instance(config=old_app.config)
    app.log = old_app.log
    app.kernel_class = kernel_class
    app.profile_dir = old_app.profile_dir
    app.user_ns = getattr(old_app, "user_ns", None)
    app.connection_file = ""
    app.transport = info["transport"]
    app.ip = info["ip"]
    for name in PORTS:
        setattr(app, name, info[name])
    app.session.key = info["key"].encode()
    app.session.signature_scheme = info["signature_scheme"]
    app.init_sockets()
    app.init_heartbeat()
    app._ports = {name[: -len("_port")]: getattr(app, name) for name in PORTS}
    app.init_io()
    app.init_signal()
    # IPythonKernel.__init__ lists the files of every module imported (those the debugger
    # does not step into), asking each module for `__file__`: with the user's modules
    # loaded that is thousands of lookups, some running lazy-import hooks, ~10 ms of the
    # fork. The parent's list is the one a fresh kernel makes (taken before any cell ran).
    import ipykernel.ipkernel as ipkernel_module

    ipkernel_module.sys = _SysWithoutModules(sys)
    try:
        app.init_kernel()
    finally:
        ipkernel_module.sys = sys
    kernel = app.kernel
    kernel._kernel_modules = list(getattr(old_kernel, "_kernel_modules", []))
    if getattr(kernel, "debugger", None) is not None:
        kernel.debugger.kernel_modules = kernel._kernel_modules
    if kernel.shell is not shell:
        raise RuntimeError("the new kernel did not find the existing shell")
    # What IPythonKernel.__init__ gives a shell it creates, and `instance()` skipped.
    shell.kernel = kernel
    try:
        shell.parent = kernel
    except Exception:
        pass
    app.init_shell()
    # Comms made in the parent send through the kernel they captured.
    comms = getattr(getattr(kernel, "comm_manager", None), "comms", {}) or {}
    for comm in list(comms.values()):
        if hasattr(comm, "kernel"):
            comm.kernel = kernel
    history_off(shell)
    sys.stdout.flush()
    sys.stderr.flush()
    install(app)
    for name, args in (("kernel_broker_e2b", (shell, kernel)), ("kernel_broker_network", (shell,))):
        module = sys.modules.get(name)
        if module is not None:
            try:
                module.install(*args)
            except Exception as e:
                log("cannot install %s: %r" % (name, e))
    return app


class _SysWithoutModules:
    """`sys` as ipykernel.ipkernel sees it while the child's kernel is made: no modules."""

    modules = {}

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


def history_off(shell):
    """A history kept in a file has an SQLite connection the parent uses too (and a writer
    thread the child lacks): the child stops writing it. An in-memory history (the
    broker's) is the child's own copy and keeps working."""
    hm = getattr(shell, "history_manager", None)
    if hm is None or str(getattr(hm, "hist_file", "")) == ":memory:":
        return
    try:
        hm.enabled = False
        hm.save_thread = None
    except Exception as e:
        log("cannot turn the history file off: %r" % e)


def install(app):
    """Registers ``kb_fork_request`` on `app`'s kernel."""
    kernel = app.kernel
    if kernel is None:
        return

    def kb_fork_request(stream, ident, parent):
        handle(app, kernel, stream, ident, parent)

    kernel.shell_handlers[MSG_TYPE] = kb_fork_request
    shell = getattr(kernel, "shell", None)
    if shell is not None and reap not in shell.events.callbacks.get("post_execute", []):
        shell.events.register("post_execute", reap)
    if shell is not None and _MACHINERY is None:

        def first_execution():
            shell.events.unregister("pre_execute", first_execution)
            note_machinery()

        shell.events.register("pre_execute", first_execution)

