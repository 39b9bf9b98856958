"""E2B's snapshots (`sbx.create_snapshot`, `Sandbox.list_snapshots`, `Sandbox.create(snapshot_id)`,
`Sandbox.delete_snapshot`) through E2B's own, unmodified Python SDK (pinned: e2b 2.63.0,
e2b-code-interpreter 2.11.5), written as an E2B user's code is: a sandbox with a file, a
variable and an open file handle is snapshotted, goes on changing, and new sandboxes start
from the snapshot with its state, each its own.

The broker's snapshot (issue 37) is its session's: the kernel's held child dumped with CRIU
(`scripts/setup-criu`) and a copy of the sandbox's files; each sandbox made from it restores
the images into a sandbox of its own over a copy of those files. Local sandbox.
"""

import pytest

from conftest import BOB, needs_criu

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")


@needs_criu
def test_sandboxes_start_from_a_snapshot_with_its_state_each_their_own(e2b_env):
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120)
    made = [sbx]
    try:
        sbx.files.write("notes.txt", "one\ntwo\nthree\n")
        ex = sbx.run_code("fh = open('/home/user/notes.txt'); fh.readline()\nkept = {'n': 6 * 7}")
        assert ex.error is None, ex.error

        snap = sbx.create_snapshot(name="after-notes")
        assert snap.snapshot_id and snap.names == ["after-notes"]
        # The sandbox runs on, and changes after the snapshot.
        assert sbx.is_running()
        assert sbx.run_code("kept['n'] = 0; kept['n']").text == "0"
        sbx.files.write("later.txt", "later")

        listed = Sandbox.list_snapshots().next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
        assert [s.snapshot_id for s in sbx.list_snapshots().next_items()] == [snap.snapshot_id]
        assert Sandbox.list_snapshots(name="after-notes").next_items()[0].names == ["after-notes"]
        assert Sandbox.list_snapshots(name="other").next_items() == []

        # By id, and by name: each the state the snapshot had.
        for template in (snap.snapshot_id, "after-notes"):
            new = Sandbox.create(template, timeout=120)
            made.append(new)
            assert new.sandbox_id != sbx.sandbox_id
            ex = new.run_code("(kept['n'], fh.readline().strip())")
            assert ex.error is None, ex.error
            assert ex.text == "(42, 'two')"
            assert sorted(e.name for e in new.files.list("/home/user")) == ["notes.txt"]
        # Each its own: a change in one is in no other.
        made[1].run_code("kept['n'] = 1")
        made[1].files.write("mine.txt", "x")
        assert made[2].run_code("kept['n']").text == "42"
        assert not made[2].files.exists("mine.txt")
        assert not sbx.files.exists("mine.txt")

        # A filesystem-only snapshot is not built: refused as E2B refuses a disabled one.
        with pytest.raises(SandboxException):
            sbx.create_snapshot(mode="filesystem")

        # Another user sees nothing of it, and cannot delete it; their sandbox made "from"
        # its id is a fresh one.
        assert Sandbox.list_snapshots(api_key=BOB).next_items() == []
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=BOB) is False
        other = Sandbox.create(snap.snapshot_id, api_key=BOB, timeout=60)
        made.append(other)
        assert other.run_code("kept").error.name == "NameError"

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert Sandbox.list_snapshots().next_items() == []
        # The sandboxes made from it run on.
        assert made[2].run_code("kept['n'] + 1").text == "43"
    finally:
        for s in made:
            s.kill()


@needs_criu
def test_snapshots_are_listed_in_pages(e2b_env):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120)
    try:
        assert sbx.run_code("v = 1").error is None
        ids = [sbx.create_snapshot().snapshot_id for _ in range(3)]
        pages = Sandbox.list_snapshots(limit=2)
        seen = []
        while pages.has_next:
            seen.extend(s.snapshot_id for s in pages.next_items())
        assert seen == ids
        for i in ids:
            assert Sandbox.delete_snapshot(i) is True
    finally:
        sbx.kill()
