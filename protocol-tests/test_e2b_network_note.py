"""Code written for E2B's sandboxes, which have the internet, meets a sandbox with loopback
only here: its failed connection says why and which setting would allow it (issue 35), in
E2B's own SDK (pinned: e2b 2.63.0, e2b-code-interpreter 2.11.5), on both backends.

The note is a line of the traceback the kernel shows (``kernels/kernel_broker_network.py``
adds it to the exception with ``add_note`` when IPython shows it), so it is in
``execution.error.traceback``; ``error.name`` and ``error.value`` are the exception's own,
and code that catches the error sees it unchanged. A refused loopback connection has no note.
"""

import socket

import pytest

pytest.importorskip("e2b_code_interpreter")

NOTE = (
    "kernel-broker: this sandbox has no network (loopback only); an operator allows hosts "
    "with --egress-allow or a user's egress_allow (docs/API.md, Network policy)"
)


def test_a_failed_connection_names_the_setting_that_would_allow_it(any_backend):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    try:
        # E2B's own documentation's pattern: data read from a URL.
        ex = sbx.run_code("import pandas as pd\ndf = pd.read_csv('https://example.com/data.csv')")
        assert ex.error is not None
        assert ex.error.name == "URLError", ex.error
        assert "Temporary failure in name resolution" in ex.error.value, ex.error
        assert NOTE in ex.error.traceback, ex.error.traceback
        assert NOTE not in ex.error.value

        ex = sbx.run_code("import socket\nsocket.create_connection(('93.184.216.34', 80), timeout=30)")
        assert ex.error.name == "OSError", ex.error
        assert NOTE in ex.error.traceback, ex.error.traceback

        # Caught as before: same type, no note where nothing is shown.
        ex = sbx.run_code(
            "import urllib.request\n"
            "try:\n    urllib.request.urlopen('http://example.com/', timeout=30)\n"
            "except OSError as e:\n    print(type(e).__name__, getattr(e, '__notes__', None))"
        )
        assert ex.error is None, ex.error
        assert ex.logs.stdout == ["URLError None\n"]

        # A refused loopback connection is not the sandbox's network: no note.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ex = sbx.run_code(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=30)")
        assert ex.error.name == "ConnectionRefusedError", ex.error
        assert "kernel-broker:" not in ex.error.traceback, ex.error.traceback
    finally:
        sbx.kill()
