"""kernel-broker's note on a failed network connection: why it failed, and which setting
would allow it.

A sandbox has no network but loopback unless the operator gives its user an egress policy
(then allowed hosts are reached through the broker's proxy, named by ``HTTP_PROXY`` /
``HTTPS_PROXY``). Code written for a machine with the internet then fails with a bare
"Temporary failure in name resolution" or "Network is unreachable". This module adds one
note (Python 3.11's ``BaseException.add_note``) to the exception a cell's traceback shows,
when that exception, or one in its chain, is such a failure:

- a name that cannot be resolved (``socket.gaierror`` EAI_AGAIN, EAI_NONAME, EAI_FAIL,
  EAI_NODATA: the sandbox has no DNS);
- a connection with no route (``ENETUNREACH``, ``EHOSTUNREACH``) or no address of its
  family (``EADDRNOTAVAIL``: IPv6 where loopback has none).

A refused connection (a loopback port nobody listens on) is not a network-policy matter and
gets no note. The exception keeps its type and arguments: only its ``__notes__`` grow, and
only when IPython shows it (the shell's ``showtraceback``), so code that catches
``OSError`` / ``ConnectionError`` sees exactly what it saw before. IPython prints notes
after the exception line, so the note is in the ``error`` message's traceback that every
front door passes on (REST, Jupyter, E2B's ``execution.error.traceback``).

The broker writes this file next to ``kernel_broker_boot.py`` (a directory no kernel can
write); the boot script loads it in the fork-server template (or the plain kernel) and
calls :func:`install` once the shell exists. Everything here runs in the kernel, as the
kernel's user; nothing of it reaches the broker but the traceback text, which the broker
treats as any output of the kernel.
"""

import errno
import os
import socket
import sys

MARK = "kernel-broker:"

NO_NETWORK = (
    MARK + " this sandbox has no network (loopback only); an operator allows hosts with "
    "--egress-allow or a user's egress_allow (docs/API.md, Network policy)"
)

THROUGH_PROXY = (
    MARK + " this sandbox has no network of its own (loopback only): the hosts its user's "
    "egress policy allows are reached over HTTP(S) through the broker's proxy in "
    "HTTP_PROXY/HTTPS_PROXY (no name resolution or other protocols of its own); an "
    "operator allows more hosts with --egress-allow or a user's egress_allow "
    "(docs/API.md, Network policy)"
)

# What glibc answers for a name in a namespace with loopback only: EAI_AGAIN (no server
# answers, measured on both backends); the others where resolv.conf names no server.
RESOLUTION_ERRORS = frozenset(
    getattr(socket, name)
    for name in ("EAI_AGAIN", "EAI_NONAME", "EAI_FAIL", "EAI_NODATA")
    if hasattr(socket, name)
)
# What a connect answers there: no route (ENETUNREACH for IPv4 and, with IPv6 on loopback,
# IPv6) or no source address of the family (EADDRNOTAVAIL: IPv6 in Docker's `none`).
UNREACHABLE_ERRORS = frozenset((errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL))

# How far into a chain to look: requests → MaxRetryError → NewConnectionError → gaierror
# is four; a chain built to be long or cyclic ends here.
MAX_CHAIN = 16


def _linked(exc):
    """The exceptions ``exc`` carries: its cause and context, urllib's and urllib3's
    ``reason``, and exceptions among its first arguments (requests wraps that way)."""
    out = [exc.__cause__, exc.__context__]
    try:
        out.append(getattr(exc, "reason", None))
    except Exception:
        pass
    args = getattr(exc, "args", ())
    if isinstance(args, tuple):
        out.extend(args[:4])
    return [e for e in out if isinstance(e, BaseException)]


def is_network_failure(exc):
    """Whether ``exc`` or an exception in its chain is a failure of the sandbox's missing
    network: unresolvable name, no route, no address of the family."""
    seen = set()
    todo = [exc]
    while todo and len(seen) < MAX_CHAIN:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, socket.gaierror):
            if e.errno in RESOLUTION_ERRORS:
                return True
        elif isinstance(e, OSError) and e.errno in UNREACHABLE_ERRORS:
            return True
        todo.extend(_linked(e))
    return False


def note():
    """The note for this kernel: with a proxy in its environment, how its allowed hosts are
    reached; without, that there is no network at all."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("HTTP_PROXY") or ""
    return THROUGH_PROXY if proxy.startswith("http://127.0.0.1:") else NO_NETWORK


def annotate(exc):
    """Adds the note to ``exc`` if it is a network failure and has none yet. Never raises:
    a traceback is shown whatever happens here."""
    try:
        if not isinstance(exc, BaseException) or not is_network_failure(exc):
            return
        notes = getattr(exc, "__notes__", None)
        if isinstance(notes, list) and any(
            isinstance(n, str) and n.startswith(MARK) for n in notes
        ):
            return
        exc.add_note(note())
    except Exception:
        pass


def install(shell):
    """Wraps the shell's ``showtraceback`` (once): the exception about to be shown is
    annotated, then shown by IPython as before."""
    if getattr(shell, "_kernel_broker_network_note", False):
        return
    original = shell.showtraceback

    def showtraceback(*args, **kwargs):
        try:
            exc_tuple = kwargs.get("exc_tuple", args[0] if args else None)
            if exc_tuple is not None:
                value = exc_tuple[1]
            else:
                value = sys.exc_info()[1]
                if value is None:
                    value = getattr(sys, "last_value", None)
            annotate(value)
        except Exception:
            pass
        return original(*args, **kwargs)

    shell.showtraceback = showtraceback
    shell._kernel_broker_network_note = True
