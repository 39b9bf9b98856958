"""A broker killed (SIGKILL) while it held checkpoints (issue 36): their kernels stay frozen,
and a frozen process does not die of SIGKILL until thawed, so neither the sandbox's end nor
the container engine can take them. The next broker on the same data directory thaws and
ends them, on both sandboxes, and nothing is left (the suite's end-of-run check looks for
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
    # The checkpoint is the session's first kernel, in the leaf named after the session.
    frozen = pids_in_leaf(sid)
    assert frozen, "no process in the checkpoint's leaf"
    first.kill9()
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
