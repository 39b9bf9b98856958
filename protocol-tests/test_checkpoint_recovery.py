"""A broker killed (SIGKILL) while it held checkpoints (issue 36). Docker's are frozen
copies: a frozen process does not die of SIGKILL until thawed, so neither the sandbox's end
nor the container engine can take them, and the next broker on the same data directory
thaws and ends them. The local sandbox's are held on a control socket of the broker's:
they end with it. On both sandboxes nothing is left (the suite's end-of-run check looks for
cgroups, kernel processes, containers and mounts too)."""
import glob
import os

import pytest

from conftest import _docker_usable, wait_for


def pids_in_leaf(session):
    """Host pids in the cgroup leaves named `session` (any hierarchy, v1 or v2)."""
    pids = set()
    for procs in glob.glob(f"/sys/fs/cgroup/**/{session}/cgroup.procs", recursive=True):
        with open(procs) as f:
            pids.update(int(line) for line in f if line.strip())
    return pids


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sandbox", ["local", "docker"])
def test_checkpoints_left_frozen_by_a_killed_broker_are_ended_by_the_next(fresh_broker, sandbox):
    if sandbox == "docker" and not _docker_usable():
        pytest.skip("Docker or the kernel image (docker/build-offline.sh) is missing")
    args = ["--sandbox", "docker"] if sandbox == "docker" else []
    first = fresh_broker(args)
    sid = first.api("POST", "/v1/sessions", json={}).json()["id"]
    r = first.api("POST", f"/v1/sessions/{sid}/execute", json={"code": "x = 1"})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    r = first.api("POST", f"/v1/sessions/{sid}/checkpoints")
    assert r.status_code == 201, r.text
    # The checkpoint is in the leaf named after the session (local: with the live kernel
    # until it moves to a leaf of its own; Docker: the session's first kernel, frozen).
    frozen = pids_in_leaf(sid)
    assert frozen, "no process in the checkpoint's leaf"
    first.kill9()
    if sandbox == "local":
        # Held: the checkpoint ends once its control socket closes with the broker.
        wait_for(lambda: not any(alive(p) for p in frozen), timeout=30,
                 what="the held checkpoint to end with its broker")
        second = fresh_broker(args, data_dir=first.data_dir)
        wait_for(lambda: not pids_in_leaf(sid), timeout=30, what="the checkpoint's leaf to be emptied")
        sid2 = second.api("POST", "/v1/sessions", json={}).json()["id"]
        r = second.api("POST", f"/v1/sessions/{sid2}/execute", json={"code": "1 + 1"})
        assert r.status_code == 200 and r.json()["results"][-1]["data"]["text/plain"] == "2", r.text
        return
    # The sandbox went with the broker (local: bwrap dies with its parent) or stays (a
    # container): either way the frozen kernel lives on.
    assert all(alive(p) for p in frozen), [open(f"/proc/{p}/status").read()[:200] for p in frozen]

    second = fresh_broker(args, data_dir=first.data_dir)
    wait_for(lambda: not any(alive(p) for p in frozen), timeout=30,
             what="the frozen checkpoint's processes to end")
    assert not pids_in_leaf(sid)
    # The new broker serves.
    sid2 = second.api("POST", "/v1/sessions", json={}).json()["id"]
    r = second.api("POST", f"/v1/sessions/{sid2}/execute", json={"code": "1 + 1"})
    assert r.status_code == 200 and r.json()["results"][-1]["data"]["text/plain"] == "2", r.text
    assert os.path.isdir(second.data_dir)
