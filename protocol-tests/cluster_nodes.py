"""Nodes of a cluster for the protocol tests (issue 16): brokers on one PostgreSQL database,
each on a port of its own that it advertises.

PostgreSQL: the run's server (`KB_TEST_POSTGRES_URL`, exported by scripts/test), else one
started for the module with scripts/pg-test-server; a fresh database either way, dropped at
the end. Databases are handled with Debian's `psql`, not a Python driver.
"""
import glob
import os
import re
import shutil
import subprocess
import uuid

import pytest

from conftest import REPO, Broker, restartable_port, wait_for

LEASE = "3"


def psql_bin():
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/psql"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p)])
    if found:
        return found[-1]
    which = shutil.which("psql")
    if which:
        return which
    pytest.fail("psql is not installed (apt-get install postgresql)")


def sql(url, query):
    """Runs `query` on database `url`; the rows, each a list of column strings."""
    r = subprocess.run(
        [psql_bin(), "-X", "-q", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1",
         "-d", url, "-c", query],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"psql {query!r}: {r.stderr}"
    return [line.split("\t") for line in r.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def pg_server():
    """The base URL (no database) of a PostgreSQL server."""
    url = os.environ.get("KB_TEST_POSTGRES_URL", "").rstrip("/")
    if url:
        yield url
        return
    r = subprocess.run([str(REPO / "scripts/pg-test-server"), "start"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"scripts/pg-test-server start failed:\n{r.stderr}"
    exports = dict(re.findall(r"export (\w+)=([^;\s]+)", r.stdout))
    url, server_dir = exports.get("KB_TEST_POSTGRES_URL"), exports.get("KB_PG_SERVER_DIR")
    assert url and server_dir, f"unexpected output of pg-test-server: {r.stdout!r}"
    try:
        yield url.rstrip("/")
    finally:
        subprocess.run([str(REPO / "scripts/pg-test-server"), "stop", server_dir],
                       check=False, timeout=120)


@pytest.fixture(scope="module")
def database(pg_server):
    """A fresh database of this module's own; its URL. Dropped at the end."""
    name = f"kb_cluster_{uuid.uuid4().hex}"
    sql(f"{pg_server}/postgres", f"CREATE DATABASE {name}")
    try:
        yield f"{pg_server}/{name}"
    finally:
        sql(f"{pg_server}/postgres", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def node(database, *extra):
    """A broker of the cluster of `database` on a port of its own, advertised as such."""
    port = restartable_port()
    return Broker(
        extra_args=["--database-url", database,
                    "--advertise-url", f"http://127.0.0.1:{port}",
                    "--node-lease", LEASE, *extra],
        listen=f"127.0.0.1:{port}",
    )


def node_id(broker):
    return (broker.data_dir / "node-id").read_text().strip()


def holder(database, sid):
    """The node id that holds session `sid` (its recording names it)."""
    def find():
        rows = sql(database, f"SELECT node FROM sessions WHERE id = '{sid}'")
        return rows[0][0] if rows else None
    return wait_for(find, timeout=15, interval=0.1, what=f"the recording of {sid}")
