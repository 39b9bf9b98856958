"""Paused sessions carried between the nodes of a cluster (`--carry-paused`, issue 37): E2B's
own, unmodified Python SDK pauses a sandbox through node A; A is lost (SIGKILL); `connect`
through node B takes the sandbox over from the copy in the database and resumes it there, its
kernel's state (a variable, an open file part-read, a generator part-way) and its files as
they were. Local sandbox, as root with CRIU.
"""
import time

import pytest

from cluster_nodes import database, node, pg_server, sql  # noqa: F401 (fixtures)
from conftest import ALICE, needs_criu, wait_for

e2b_ci = pytest.importorskip("e2b_code_interpreter")

CARRY = ("--carry-paused", "true", "--uid-base", "330000")


@needs_criu
def test_an_e2b_sandbox_paused_on_a_lost_node_is_connected_to_through_another(database, monkeypatch):
    from e2b_code_interpreter import Sandbox

    a = node(database, *CARRY)
    b = node(database, *CARRY)
    try:
        monkeypatch.setenv("E2B_API_KEY", ALICE)
        monkeypatch.setenv("E2B_API_URL", a.url + "/e2b")
        monkeypatch.setenv("E2B_SANDBOX_URL", a.url + "/e2b/sandbox")
        sbx = Sandbox.create(timeout=300)
        sid = sbx.sandbox_id
        assert sid in {s["id"] for s in a.api("GET", "/v1/sessions").json()}, "made on A"
        sbx.files.write("carried.txt", "written on node A\n")
        ex = sbx.run_code(
            "kept = {'answer': 6 * 7}\n"
            "fh = open('/home/user/carried.txt')\n"
            "fh.read(8)\n"
            "g = iter(range(10)); next(g)\n"
            "kept['answer']"
        )
        assert ex.error is None and ex.text == "42", (ex.error, ex.text)
        assert sbx.pause() is True
        # The copy is stored after the pause's answer.
        rows = wait_for(
            lambda: sql(database, f"SELECT bytes FROM paused_copies WHERE session_id = '{sid}'"),
            timeout=60, interval=0.1, what="the sandbox's copy in the database")
        assert int(rows[0][0]) > 1 << 20, rows

        a.kill9()
        monkeypatch.setenv("E2B_API_URL", b.url + "/e2b")
        monkeypatch.setenv("E2B_SANDBOX_URL", b.url + "/e2b/sandbox")

        seen = []

        def connected():
            try:
                return Sandbox.connect(sid, timeout=120)
            except Exception as e:  # A's lease has not lapsed yet: 502, then 503 until taken over
                seen.append(repr(e))
                time.sleep(0.3)
                return None

        try:
            same = wait_for(connected, timeout=60, interval=0.2, what="connect through node B")
        except AssertionError:
            raise AssertionError(f"{seen[-3:]}\n{''.join(b.log[-20:])}")
        assert same.is_running()
        ex = same.run_code("(kept['answer'], fh.read(7), next(g))")
        assert ex.error is None, ex.error
        assert ex.text == "(42, 'on node', 1)"
        assert same.files.read("carried.txt") == "written on node A\n"
        assert sid in {s["id"] for s in b.api("GET", "/v1/sessions").json()}, "B holds it"
        assert sql(database, "SELECT count(*) FROM paused_copies") == [["0"]]
        same.kill()
    finally:
        b.stop()
        a.stop()
