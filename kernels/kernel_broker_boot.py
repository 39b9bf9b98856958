"""kernel-broker's kernel bootstrap: kernels born with the data stack already imported.

The broker writes this file into a directory no kernel can write and runs it with the kernel
spec's Python, isolated (``python -I``):

``kernel [--preload M,N] -- ARGS``
    One kernel started plainly, without a template (a kernel with a workspace of its own,
    the fork server turned off): imports the modules, then runs ``IPKernelApp`` with the
    ipykernel arguments ``ARGS`` exactly as a forked kernel does (inline backend, E2B's
    hooks below).

``template --preload M,N``
    The fork server of one user and kernel spec, inside that user's sandbox. Imports the
    modules once, says ``{"ready": ...}`` on stdout, then serves requests read from stdin,
    one JSON object per line:

    ``{"op": "fork", "id": ID, "args": [...], "env": {...}, "connection_file": PATH}``
        forks a kernel; answers ``{"forked": ID, "pid": PID}`` (PID as seen in the
        sandbox). The child waits, doing nothing, until
    ``{"op": "go", "id": ID}``
        releases it (the broker has moved it into its own cgroup by then, so everything it
        allocates is charged to it); answers ``{"released": ID}``. It then becomes an
        ordinary ipykernel.
    ``{"op": "fork", "id": ID}`` then ``{"op": "go", "id": ID, "kernel": {"args": ...,
    "env": ..., "connection_file": ...}}``
        the same, with the kernel named only when it is released: the broker forks a
        child ahead of need (a stem), moves it into a cgroup leaf of its own while nobody
        waits, and gives it a kernel to become when a session asks for one.
    ``{"op": "drop", "id": ID}``
        kills a child that was never released (the broker gave up on it).

    When a child ends, the template answers ``{"exited": ID, "status": RAW}`` (the raw
    ``waitpid`` status). End of stdin ends the template.

Every kernel it starts gets ``kernel_broker_e2b.py`` installed (loaded from this script's own
directory, once in the template): E2B's result formats and one execution's environment,
active only in executions whose request asks for them (see that module). And
``kernel_broker_network.py``, loaded the same way: a note on a failed network connection's
traceback naming the setting that would allow it (see that module). And
``kernel_broker_fork.py``: the ``kb_fork_request`` shell message, by which a live kernel
copies itself, with its state, into a new kernel on sockets the broker names (see that
module).

What a fork must not share is reset in the child before any user code runs: the random
generators are reseeded from the OS, every descriptor of the template is closed (stdin is
``/dev/null`` and so is stdout), the process leaves the template's session,
and it is made non-dumpable so that another kernel of the same user cannot read its key
from ``/proc``. Nothing is bound in the user's namespace: the imports live in
``sys.modules`` only. The template starts no thread and no event loop, so forking it is
safe; OpenBLAS (numpy) stops its worker threads at fork and restarts them on demand.
"""

import gc
import json
import os
import signal
import sys
import time

def log(message):
    sys.stderr.write("kernel-broker boot: %s\n" % message)
    sys.stderr.flush()


def warm_matplotlib():
    """Imports pyplot and draws one figure: the font cache, the Agg renderer and the PNG
    writer are loaded and warm, so the first chart of a session costs only its drawing."""
    import io

    import matplotlib

    # The inline backend is imported for real only once a shell exists (see
    # `enable_inline`); the warm-up draws with Agg, which is what the inline backend uses.
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(100), [i * i for i in range(100)])
    ax.set_title("warm-up")
    fig.savefig(io.BytesIO(), format="png")
    try:
        # What the inline backend does with a figure at the end of a cell: a tight PNG.
        import matplotlib_inline.backend_inline  # noqa: F401  (hooks in only with a shell)
        from IPython.core.pylabtools import print_figure

        print_figure(fig, "png", bbox_inches="tight")
    except Exception as e:
        log("cannot warm the inline backend: %r" % e)
    del fig, ax
    del matplotlib, plt


def preload(modules):
    loaded = []
    for name in modules:
        start = time.monotonic()
        try:
            if name == "matplotlib":
                warm_matplotlib()
            else:
                __import__(name)
        except Exception as e:  # a module that fails to import is left out, not fatal
            log("preloading %s failed: %r" % (name, e))
            continue
        loaded.append(name)
        log("preloaded %s in %.0f ms" % (name, (time.monotonic() - start) * 1000))
    return loaded


def prepare_kernel_imports():
    """What every kernel imports before its first cell: done once in the template."""
    import ipykernel.kernelapp  # noqa: F401
    import ipykernel.ipkernel  # noqa: F401
    import ipykernel.zmqshell  # noqa: F401
    import IPython.core.interactiveshell  # noqa: F401
    import IPython.core.completer  # noqa: F401
    import zmq  # noqa: F401  (no context is made: contexts do not survive a fork)

    # What `IPKernelApp.initialize` imports on its way (measured: ~200 ms, most of it the
    # debugger's debugpy), each optional.
    for name in (
        "ipykernel.debugger",
        "debugpy",
        "IPython.core.history",
        "IPython.core.pylabtools",
        "sqlite3",
        "psutil",
        "pdb",
        "pydoc",
        "faulthandler",
        "mimetypes",
        "jedi",
        # Imported by the shell's and kernel's set-up on their way (measured by diffing
        # sys.modules around `initialize` in a forked child).
        "IPython.core.completerlib",
        "IPython.core.debugger",
        "IPython.core.oinspect",
        "IPython.extensions.storemagic",
        "IPython.utils.wildcard",
        "tornado.platform.asyncio",
    ):
        try:
            __import__(name)
        except Exception:
            pass
    warm_command_line()
    load_e2b()
    load_network()
    load_fork()


def warm_command_line():
    """Parses a kernel's command line once with a throwaway application: traitlets builds
    its argument parser from every configurable class and compiles the regular expressions
    it needs (~15 ms of each kernel's `initialize`); the compiled patterns stay in `re`'s
    cache, which forked kernels inherit. Nothing is bound and no singleton is made."""
    try:
        from ipykernel.kernelapp import IPKernelApp

        IPKernelApp().parse_command_line(
            ["-f", "/nonexistent/kernel-broker-warm-up.json", "--HistoryManager.hist_file=:memory:"]
        )
    except Exception as e:
        log("cannot warm the command line parser: %r" % e)


def enable_inline():
    """matplotlib_inline hooks itself into the shell when it is first imported with a shell
    running. In a kernel forked from a template that imported pyplot, that import happened
    before the shell existed, so the hook is installed here, as a fresh kernel would have
    it after `import matplotlib.pyplot`."""
    if "matplotlib.pyplot" not in sys.modules:
        return
    backend = os.environ.get("MPLBACKEND", "")
    if backend != "module://matplotlib_inline.backend_inline":
        return
    try:
        from matplotlib_inline import backend_inline

        backend_inline._enable_matplotlib_integration()
    except Exception as e:
        log("cannot enable the inline backend: %r" % e)


E2B_MODULE = "kernel_broker_e2b"
NETWORK_MODULE = "kernel_broker_network"
FORK_MODULE = "kernel_broker_fork"


def load_sibling(name):
    """Imports ``NAME.py`` from this script's own directory, which the broker wrote and no
    kernel can write. Done in the template, so forked kernels only install it. A missing or
    broken module leaves kernels plain IPython."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        return module
    except Exception as e:
        log("cannot load %s: %r" % (name, e))
        return None


def load_e2b():
    """``kernel_broker_e2b.py``: E2B's result formats, PIL display, one execution's
    environment."""
    return load_sibling(E2B_MODULE)


def load_network():
    """``kernel_broker_network.py``: the note on a failed network connection naming the
    setting that would allow it."""
    return load_sibling(NETWORK_MODULE)


def load_fork():
    """``kernel_broker_fork.py``: the ``kb_fork_request`` shell message, a live kernel
    copying itself into a new kernel. Absent (an older broker did not write it), kernels
    are left without it, quietly."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), FORK_MODULE + ".py")
    if FORK_MODULE not in sys.modules and not os.path.exists(path):
        return None
    return load_sibling(FORK_MODULE)


def install_e2b(app):
    module = load_e2b()
    if module is None:
        return
    try:
        module.install(app.shell, app.kernel)
    except Exception as e:
        log("cannot install %s: %r" % (E2B_MODULE, e))


def install_network(app):
    module = load_network()
    if module is None:
        return
    try:
        module.install(app.shell)
    except Exception as e:
        log("cannot install %s: %r" % (NETWORK_MODULE, e))


def install_fork(app):
    module = load_fork()
    if module is None:
        return
    try:
        module.install(app)
    except Exception as e:
        log("cannot install %s: %r" % (FORK_MODULE, e))


def signals_to_the_main_thread():
    """Every thread started from now on starts with SIGINT blocked, so an interrupt always
    lands on the main thread, where the cell runs. POSIX lets the kernel deliver a signal sent
    to the process to any thread that does not block it; Python then runs its handler on
    the main thread at the next bytecode, but a main thread blocked in a system call
    (``time.sleep``, a read) is woken only if the signal lands on it, so an interrupt caught
    by the IOPub or control thread would leave a sleeping cell asleep. ipykernel's threads
    (IOPub, heartbeat, control, shell channel, output capture) and threads a cell starts
    inherit the mask from the thread that starts them."""
    import threading

    start = threading.Thread.start

    def start_without_sigint(self):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            start(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    threading.Thread.start = start_without_sigint


def interrupts_reach_cells_only():
    """An interrupt stops the cell that runs; one that lands after the cell has ended, while
    ipykernel answers it, is dropped, as one between executions is.

    ipykernel raises ``KeyboardInterrupt`` on SIGINT for the whole of a request's handling,
    not only the cell's code. An interrupt landing after the cell (a client interrupting, or
    a timeout, just as the cell ends) raises in ipykernel's own code instead: caught there
    ("KeyboardInterrupt caught in kernel"), it leaves a request half answered. Two ways were
    measured here, each injected at its line by `kernels/tests/test_interrupt.py`:

    * between setting the abort flag that a failed cell raises and queuing the message that
      clears it (``_abort_queues``): the flag stays set and every later execution of the
      kernel is answered ``aborted`` (a stock ipykernel 7.4, interrupted right after failed
      cells, was stuck so after 11 tries in one run and 40 in another);
    * before the ``execute_reply`` is sent: the reply is lost, the client waits, and the
      broker, which never sees the execution end, restarts the kernel at its timeout.

    So SIGINT is blocked on the main thread once the cell's ``post_execute`` callbacks have
    run (matplotlib's figures drawn, the user's own callbacks: all interruptible) and
    unblocked after the request's handling, once ipykernel has put its between-executions
    handler (SIG_IGN) back, so a signal held meanwhile is dropped then. Every other thread
    blocks SIGINT for good (``signals_to_the_main_thread``), so the process holds it."""
    import threading

    from ipykernel.kernelbase import Kernel

    def hold_interrupts(*_):
        if threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    pre, post = Kernel.pre_handler_hook, Kernel.post_handler_hook

    def pre_handler_hook(self):
        # Last among the cell's post_execute callbacks, whoever registered since.
        shell = getattr(self, "shell", None)
        if shell is not None:
            callbacks = shell.events.callbacks["post_execute"]
            if hold_interrupts in callbacks:
                callbacks.remove(hold_interrupts)
            callbacks.append(hold_interrupts)
        pre(self)

    def post_handler_hook(self):
        try:
            post(self)
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    Kernel.pre_handler_hook = pre_handler_hook
    Kernel.post_handler_hook = post_handler_hook

    # A failed cell's abort comes after its post_execute, so SIGINT is held by then; held
    # here as well, should a request ever fail without its cell's post_execute.
    abort_queues = Kernel._abort_queues

    def guarded(self, *args, **kwargs):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return abort_queues(self, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    Kernel._abort_queues = guarded


def run_kernel(args, after_init=None):
    from ipykernel.kernelapp import IPKernelApp

    signals_to_the_main_thread()
    interrupts_reach_cells_only()

    sys.argv = ["ipykernel_launcher"] + list(args)
    app = IPKernelApp.instance()
    app.initialize(list(args))
    if after_init is not None:
        after_init(app)
    enable_inline()
    install_e2b(app)
    install_network(app)
    install_fork(app)
    app.start()


def reseed():
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception as e:
            log("cannot reseed numpy: %r" % e)


def non_dumpable(name=None):
    """Made non-dumpable: no other process of the same uid may open this one's
    /proc/<pid>/fd, mem or environ. `name` becomes its command name (`ps -o comm`)."""
    try:
        import ctypes

        PR_SET_NAME, PR_SET_DUMPABLE = 15, 4
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        if name:
            libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()), 0, 0, 0)
    except Exception as e:
        log("cannot make the process non-dumpable: %r" % e)


def use_pythonpath(value):
    """Puts the entries of a PYTHONPATH on sys.path, first, where Python would have put them
    at start: the template runs isolated (``-I``: no script directory, no working directory,
    PYTHON* variables not read, so nothing a kernel can write is on its path), and a forked
    kernel's environment did not exist when the template's sys.path was made. The per-user
    packages directory (egress: `pip install` into the workspace) arrives this way."""
    entries = [p for p in value.split(os.pathsep) if p and p not in sys.path]
    sys.path[0:0] = entries
    if entries:
        import importlib

        importlib.invalidate_caches()


def read_release(go_fd):
    """What the template writes on a child's pipe when the broker releases it: ``g``, the
    kernel as a JSON line. Anything else (end of file: the broker gave up on this child, or
    the template is gone) ends the child."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(go_fd, 65536)
        if not chunk:
            os._exit(1)
        data += chunk
    if not data.startswith(b"g"):
        os._exit(1)
    return json.loads(data[1:])


def child_main(go_fd):
    """Runs in the forked child; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        request = read_release(go_fd)
        os.close(go_fd)
        os.setsid()
        # stdin reads nothing; stdout only ever carries ipykernel's connection banner
        # (user output goes to iopub), dropped as a plain kernel's is.
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.closerange(3, max_fd())
        non_dumpable("ipykernel")
        reseed()
        os.environ.update(request.get("env") or {})
        use_pythonpath(os.environ.get("PYTHONPATH", ""))
        connection_file = request.get("connection_file")

        def forget_connection_file(app):
            # The key is in memory now; the file would let another kernel of the same user
            # (same uid) read it.
            if connection_file:
                try:
                    os.unlink(connection_file)
                except OSError:
                    pass

        run_kernel(request["args"], forget_connection_file)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # report, never return into the template's loop
        try:
            log("kernel failed: %r" % e)
        except BaseException:
            pass
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


def max_fd():
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 1024


class Template:
    def __init__(self, control_fd):
        self.children = {}  # pid -> id
        self.waiting = {}  # id -> the write end of the child's go pipe
        self.kernels = {}  # id -> the kernel named at the fork, if it was
        self.out = os.fdopen(control_fd, "w", buffering=1)

    def say(self, obj):
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def fork(self, request):
        ident = str(request["id"])
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            child_main(read_fd)
        os.close(read_fd)
        self.children[pid] = ident
        self.waiting[ident] = write_fd
        if "args" in request:
            self.kernels[ident] = {
                k: request.get(k) for k in ("args", "env", "connection_file")
            }
        self.say({"forked": ident, "pid": pid})

    def release(self, ident, kernel=None):
        """Releases child `ident` to become `kernel`; without one, the child is given up
        and ends."""
        fd = self.waiting.pop(ident, None)
        self.kernels.pop(ident, None)
        if fd is None:
            return
        try:
            if kernel is not None:
                data = b"g" + json.dumps(kernel).encode() + b"\n"
                while data:
                    data = data[os.write(fd, data):]
        finally:
            os.close(fd)

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ident = self.children.pop(pid, None)
            if ident is not None:
                self.release(ident, None)
                self.say({"exited": ident, "status": status})

    def handle(self, line):
        try:
            request = json.loads(line)
            op = request["op"]
            if op == "fork":
                self.fork(request)
            elif op == "go":
                ident = str(request["id"])
                kernel = request.get("kernel") or self.kernels.get(ident)
                if ident not in self.waiting:
                    # Ended (and reaped) before its release: the launch learns it now.
                    self.say({"error": "no child %r is waiting" % ident, "id": ident})
                elif kernel is None:
                    self.say({"error": "no kernel named for %r" % ident, "id": ident})
                else:
                    self.release(ident, kernel)
                    self.say({"released": ident})
            elif op == "drop":
                self.release(str(request["id"]), None)
            else:
                self.say({"error": "unknown op %r" % op})
        except Exception as e:
            self.say({"error": "bad request: %r" % e, "id": request_id(line)})

    def serve(self):
        import selectors

        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        sel = selectors.DefaultSelector()
        sel.register(0, selectors.EVENT_READ, "stdin")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        pending = b""
        while True:
            for key, _ in sel.select():
                if key.data == "wake":
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    self.reap()
                    continue
                chunk = os.read(0, 65536)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip():
                        self.handle(line)
            self.reap()


def request_id(line):
    try:
        return str(json.loads(line).get("id"))
    except Exception:
        return None


def parse(argv):
    """``MODE [--preload M,N] [-- KERNEL ARGS]``: the mode, the modules, and (``kernel``
    mode) the ipykernel arguments after ``--``."""
    mode = argv[0] if argv else ""
    modules = []
    kernel_args = None
    i = 1
    while i < len(argv):
        if argv[i] == "--preload" and i + 1 < len(argv):
            modules = [m for m in argv[i + 1].split(",") if m]
            i += 2
        elif argv[i] == "--" and mode == "kernel":
            kernel_args = argv[i + 1:]
            break
        else:
            raise SystemExit("kernel-broker boot: unknown argument %r" % argv[i])
    return mode, modules, kernel_args


def plain_kernel(modules, args):
    """One kernel started plainly (no template: a workspace of its own, the fork server
    turned off, or a template that failed): the same kernel a fork becomes, in this process.
    Its PYTHONPATH applied (isolated mode read none), the modules imported, then
    `run_kernel`: the inline backend and E2B's hooks as a forked kernel has them."""
    use_pythonpath(os.environ.get("PYTHONPATH", ""))
    preload(modules)
    run_kernel(args)


def main():
    mode, modules, kernel_args = parse(sys.argv[1:])
    if mode == "kernel":
        if kernel_args is None:
            raise SystemExit("kernel-broker boot: 'kernel' needs '-- <ipykernel arguments>'")
        plain_kernel(modules, kernel_args)
        return
    if mode != "template":
        raise SystemExit("kernel-broker boot: the modes are 'template' and 'kernel'")
    start = time.monotonic()
    # Isolated mode read no PYTHONPATH: apply the template's own (see use_pythonpath).
    use_pythonpath(os.environ.get("PYTHONPATH", ""))
    # stdout is the broker's control channel: nothing else may write to it, so what a
    # module prints while it is imported goes to stderr.
    template = Template(os.dup(1))
    os.dup2(2, 1)
    # No kernel (same uid) may open the template's pipes through /proc/<pid>/fd.
    non_dumpable("kb-template")
    loaded = preload(modules)
    prepare_kernel_imports()
    threads = len(os.listdir("/proc/self/task"))
    # Everything imported so far lives as long as the template: moved out of the cyclic
    # collector's reach, a child's collections neither walk nor write to those objects,
    # so their pages stay shared instead of being copied by each kernel's first
    # collection (the fork-server advice of the `gc` module's documentation).
    gc.collect()
    gc.freeze()
    template.say(
        {
            "ready": True,
            "pid": os.getpid(),
            "modules": loaded,
            "threads": threads,
            "seconds": round(time.monotonic() - start, 3),
        }
    )
    template.serve()


if __name__ == "__main__":
    main()
