"""A Jupyter kernel for SQL: DuckDB over the session's workspace.

One in-memory DuckDB database per kernel, so tables and views persist across executions of
the session; the working directory is the workspace, so ``SELECT * FROM 'sales.csv'`` reads
the session's files. A cell may hold several statements: all run, and the last one's rows
come back as the cell's result, as a table in three forms (``text/plain``, ``text/html`` and
``application/vnd.dataresource+json``, the machine-readable one). An error is the kernel's
``error`` with DuckDB's message. An interrupt (``interrupt_request`` or SIGINT) interrupts the
running query. An execution's environment variables (``metadata.kernel_broker.env``, E2B's
``envs``) are set for it alone and put back after, acknowledged in its reply as the Python
kernels' hooks do.

Run as ``python -I kernel_broker_sql.py -f CONNECTION_FILE`` (``kernels/sql/kernel.json``).
"""

import asyncio
import datetime
import decimal
import html
import json
import os
import signal
import uuid

import duckdb
from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

# Rows a result shows at most (the broker's output limit applies on top).
MAX_ROWS = int(os.environ.get("KERNEL_BROKER_SQL_MAX_ROWS", "1000"))


def plain(value):
    """A JSON-safe value for the data resource."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


def text(value):
    return "NULL" if value is None else str(value)


def table_plain(names, rows, more):
    cells = [[text(v) for v in row] for row in rows]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    line = lambda values: " | ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()
    out = [line(names), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    if more:
        out.append("(the first %d rows)" % len(rows))
    else:
        out.append("(%d row%s)" % (len(rows), "" if len(rows) == 1 else "s"))
    return "\n".join(out)


def table_html(names, rows, more):
    head = "".join("<th>%s</th>" % html.escape(n) for n in names)
    body = "".join(
        "<tr>%s</tr>" % "".join("<td>%s</td>" % html.escape(text(v)) for v in row) for row in rows
    )
    note = "<p>the first %d rows</p>" % len(rows) if more else ""
    return "<table><thead><tr>%s</tr></thead><tbody>%s</tbody></table>%s" % (head, body, note)


class DuckDBKernel(Kernel):
    implementation = "kernel-broker-sql"
    implementation_version = "1.0"
    language = "sql"
    language_version = duckdb.__version__
    language_info = {
        "name": "sql",
        "mimetype": "application/sql",
        "file_extension": ".sql",
        "codemirror_mode": "sql",
        "pygments_lexer": "sql",
    }
    banner = "SQL (DuckDB %s) over the session's workspace" % duckdb.__version__

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        config = {}
        limit = os.environ.get("KERNEL_BROKER_MEMORY_LIMIT")
        if limit and limit.isdigit() and int(limit) > 0:
            # DuckDB's own budget, below the kernel's: its operators spill to /tmp past it.
            config["memory_limit"] = "%dMB" % max(64, int(limit) * 6 // 10 // (1 << 20))
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            config["threads"] = int(threads)
        config["temp_directory"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "duckdb")
        # No extension is fetched: a sandbox has no network.
        config["autoinstall_known_extensions"] = False
        self.con = duckdb.connect(":memory:", config=config)

    def _run(self, code):
        cursor = self.con.execute(code)
        if cursor.description is None:
            return None
        names = [d[0] for d in cursor.description]
        types = [str(d[1]) for d in cursor.description]
        rows = cursor.fetchmany(MAX_ROWS + 1)
        more = len(rows) > MAX_ROWS
        return names, types, rows[:MAX_ROWS], more

    async def do_execute(
        self, code, silent, store_history=True, user_expressions=None, allow_stdin=False, **kwargs
    ):
        env = self._asked_env()
        if env is None:
            return await self._execute(code, silent)
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            reply = await self._execute(code, silent)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        reply["kernel_broker_env"] = "restored"
        return reply

    def _asked_env(self):
        """The execution's variables (``metadata.kernel_broker.env``), if it asks for any."""
        try:
            env = self.get_parent("shell").get("metadata", {}).get("kernel_broker", {}).get("env")
        except (AttributeError, TypeError):
            return None
        if not isinstance(env, dict) or not env:
            return None
        if not all(isinstance(k, str) and isinstance(v, str) and "\0" not in k + v for k, v in env.items()):
            return None
        return env

    async def _execute(self, code, silent):
        if not code.strip():
            return self._ok()
        previous = signal.signal(signal.SIGINT, lambda *_: self.con.interrupt())
        try:
            result = await asyncio.to_thread(self._run, code)
        except duckdb.InterruptException:
            return self._error(silent, "KeyboardInterrupt", "the query was interrupted")
        except duckdb.Error as e:
            return self._error(silent, type(e).__name__, str(e))
        finally:
            signal.signal(signal.SIGINT, previous)
        if result is not None and not silent:
            names, types, rows, more = result
            # A statement that returns no rows of its own (CREATE, SET) shows nothing.
            if not (names == ["Count"] and not rows) and not (names == ["Success"] and rows == [(True,)]):
                resource = {
                    "schema": {"fields": [{"name": n, "type": t} for n, t in zip(names, types)]},
                    "data": [{n: plain(v) for n, v in zip(names, row)} for row in rows],
                }
                self.send_response(
                    self.iopub_socket,
                    "execute_result",
                    {
                        "execution_count": self.execution_count,
                        "data": {
                            "text/plain": table_plain(names, rows, more),
                            "text/html": table_html(names, rows, more),
                            "application/vnd.dataresource+json": resource,
                        },
                        "metadata": {},
                    },
                )
        return self._ok()

    def _ok(self):
        return {
            "status": "ok",
            "execution_count": self.execution_count,
            "payload": [],
            "user_expressions": {},
        }

    def _error(self, silent, ename, evalue):
        content = {"ename": ename, "evalue": evalue, "traceback": ["%s: %s" % (ename, evalue)]}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return dict(content, status="error", execution_count=self.execution_count)

    def do_complete(self, code, cursor_pos):
        return {"status": "ok", "matches": [], "cursor_start": cursor_pos, "cursor_end": cursor_pos, "metadata": {}}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=DuckDBKernel)
