#!/usr/bin/env bash
# Idempotent CI/dev setup for the docker sandbox backend:
#   - installs docker.io and debootstrap with apt if missing,
#   - starts dockerd in the background if no daemon answers (log: /tmp/dockerd.log),
#   - builds kernel-broker/python-kernel:latest with docker/build-offline.sh unless
#     the image already carries the current inputs hash (docker/* + kernels/requirements.txt).
#
# Environment:
#   KB_DOCKERD_WAIT   seconds to wait for the daemon (default 60)
#   KB_STORAGE_DRIVER force a storage driver (default: dockerd's choice, then vfs)
#   KB_FORCE_BUILD=1  rebuild the image even if it is up to date
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="kernel-broker/python-kernel:latest"
HASH_LABEL="org.kernel-broker.inputs-hash"
DOCKERD_LOG=/tmp/dockerd.log
WAIT="${KB_DOCKERD_WAIT:-60}"

log() { printf '[docker-setup] %s\n' "$*" >&2; }

SUDO=()
[[ $EUID -eq 0 ]] || SUDO=(sudo)
as_root() { "${SUDO[@]}" "$@"; }

# 1. packages
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# 2. daemon
daemon_up() { timeout 10 docker info >/dev/null 2>&1; }

# Start dockerd with the given extra flags; succeed once `docker info` answers,
# fail if dockerd exits or $WAIT seconds pass.
start_dockerd() {
    log "starting dockerd${*:+ $*} (log: $DOCKERD_LOG)"
    {
        echo "=== $(date -Is) dockerd $*"
    } >>"$DOCKERD_LOG"
    # setsid: keep the daemon alive after this script (and its session) ends.
    # (Not via a shell function: $! must be dockerd itself, not a subshell.)
    "${SUDO[@]}" setsid dockerd "$@" >>"$DOCKERD_LOG" 2>&1 </dev/null &
    local pid=$! i
    for ((i = 0; i < WAIT; i++)); do
        if daemon_up; then
            log "dockerd up after ${i}s (pid $pid)"
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            log "dockerd exited; last log lines:"
            tail -n 15 "$DOCKERD_LOG" >&2
            return 1
        fi
        sleep 1
    done
    log "dockerd did not answer within ${WAIT}s; stopping it"
    as_root kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return 1
}

if daemon_up; then
    log "docker daemon already running"
else
    # A stale pid file from a killed daemon makes dockerd refuse to start.
    if [[ -f /var/run/docker.pid ]] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        as_root rm -f /var/run/docker.pid
    fi
    if [[ -n "${KB_STORAGE_DRIVER:-}" ]]; then
        start_dockerd --storage-driver "$KB_STORAGE_DRIVER"
    else
        # dockerd's default here is overlay2 (ext4 backing fs, cgroup v1,
        # cgroupfs driver); vfs is the slow but always-working fallback, e.g.
        # when /var/lib/docker is itself on overlayfs.
        start_dockerd || start_dockerd --storage-driver vfs || {
            log "could not start dockerd, see $DOCKERD_LOG"
            exit 1
        }
    fi
fi
docker info --format 'docker {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}} ({{.CgroupDriver}})' >&2 || true

# 3. image
want="$("$repo/docker/build-offline.sh" --print-hash)"
have="$(docker image inspect -f "{{ index .Config.Labels \"$HASH_LABEL\" }}" "$IMAGE" 2>/dev/null || true)"
if [[ "$have" == "$want" && "${KB_FORCE_BUILD:-0}" != 1 ]]; then
    log "$IMAGE is up to date (inputs hash ${want:0:12})"
else
    log "building $IMAGE (image has inputs hash '${have:0:12}', want '${want:0:12}')"
    as_root "$repo/docker/build-offline.sh"
fi
