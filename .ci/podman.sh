#!/usr/bin/env bash
# CI: the Docker backend's test suites against rootful Podman's Docker-compatible API service
# (docs/HOSTS-podman.md). Idempotent; runs as root:
#   1. installs podman (and debootstrap) with apt if missing,
#   2. starts `podman system service` on $SOCKET (log: /tmp/podman.log) unless one answers,
#   3. builds kernel-broker/python-kernel:latest into Podman's store offline
#      (KB_ENGINE=podman docker/build-offline.sh) unless it carries the current inputs hash,
#   4. runs the Docker suites with the test harness pointed at Podman (KB_DOCKER_SOCKET),
#   5. stops the service it started and fails if containers, pods, mounts or cgroups of the
#      tests are left (scripts/leftovers before and after, which lists Podman's containers
#      and container cgroups too; plus any kernel-broker container or pod in Podman).
#
# Environment:
#   KB_PODMAN_SOCKET   the service's socket (default /run/podman/podman.sock)
#   KB_FORCE_BUILD=1   rebuild the image even if it is up to date
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
export DEBIAN_FRONTEND=noninteractive
export CARGO_TERM_COLOR=never

SOCKET="${KB_PODMAN_SOCKET:-/run/podman/podman.sock}"
LOG=/tmp/podman.log
IMAGE="kernel-broker/python-kernel:latest"
HASH_LABEL="org.kernel-broker.inputs-hash"
# Podman's settings for this host (see below).
CONF=/tmp/kb-podman-containers.conf
log() { printf '[podman] %s\n' "$*" >&2; }
[[ $EUID -eq 0 ]] || { log "run as root (rootful Podman)"; exit 1; }
start=$(date +%s)

# 1. packages
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v debootstrap >/dev/null || missing+=(debootstrap)
# runc: crun (what apt picks when no runc is installed) refuses hosts with cgroup v1 and an
# empty cgroup2 mount beside it ("cgroups in hybrid mode not supported"), as this one.
command -v runc >/dev/null || missing+=(runc)
if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
podman --version >&2

# 2. the service
service_up() { curl -sf --max-time 5 --unix-socket "$SOCKET" http://d/_ping >/dev/null 2>&1; }
pid=""
start_service() {
    mkdir -p "$(dirname "$SOCKET")"
    echo "=== $(date -Is) podman system service ${CONTAINERS_CONF:+(CONTAINERS_CONF=$CONTAINERS_CONF)}" >>"$LOG"
    # --time=0: no idle exit. setsid: out of this script's process group.
    setsid podman system service --time=0 "unix://$SOCKET" >>"$LOG" 2>&1 </dev/null &
    pid=$!
    local i
    for ((i = 0; i < 30; i++)); do
        service_up && return 0
        kill -0 "$pid" 2>/dev/null || { tail -n 15 "$LOG" >&2; return 1; }
        sleep 1
    done
    log "the service did not answer within 30 s (log: $LOG)"
    return 1
}
stop_service() {
    [[ -n "$pid" ]] || return 0
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
}
trap stop_service EXIT

# Podman's settings for this host, for the service and the image build alike: runc (above),
# and where root may not raise rlimits (no CAP_SYS_RESOURCE: a CI runner that is itself a
# container) containers get this shell's hard limits instead of Podman's higher defaults,
# which every container start would fail on ("error setting rlimit type 7"). RLIMIT_NPROC
# also stays within pid_max: conmon runs with that as its own limit.
{
    printf '[engine]\nruntime = "runc"\n'
    if ! (ulimit -Hn 1048576) 2>/dev/null; then
        nofile=$(ulimit -Hn)
        nproc=$(ulimit -Hu)
        pid_max=$(cat /proc/sys/kernel/pid_max)
        [[ "$nproc" == unlimited || "$nproc" -gt "$pid_max" ]] && nproc=$pid_max
        log "root may not raise rlimits here: containers get nofile=$nofile nproc=$nproc ($CONF)"
        printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' \
            "$nofile" "$nofile" "$nproc" "$nproc"
    fi
} >"$CONF"
export CONTAINERS_CONF="$CONF"

if service_up; then
    log "a Podman service already answers on $SOCKET (left running)"
else
    start_service || { log "could not start the Podman service (log: $LOG)"; exit 1; }
    log "service up (pid $pid, log $LOG)"
fi

# 3. the image, built in Podman itself (no registry, no pulls)
want="$(docker/build-offline.sh --print-hash)"
have="$(podman image inspect -f "{{ index .Config.Labels \"$HASH_LABEL\" }}" "$IMAGE" 2>/dev/null || true)"
if [[ "$have" == "$want" && "${KB_FORCE_BUILD:-0}" != 1 ]]; then
    log "$IMAGE is up to date in Podman (inputs hash ${want:0:12})"
else
    log "building $IMAGE in Podman (has '${have:0:12}', want '${want:0:12}')"
    KB_ENGINE=podman docker/build-offline.sh
fi

# 4. the suites, against Podman (tests/it/common/engine.rs)
export KB_DOCKER_SOCKET="unix://$SOCKET"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
our_containers() { podman ps -a --filter label=org.kernel-broker.managed=true --format '{{.Names}}'; }
before="$(DOCKER_HOST="$KB_DOCKER_SOCKET" scripts/leftovers | sort)"
status=0
suites='test(/^sandbox_contract::docker::/) | test(/^(sandbox_docker|sandbox_docker_own|sandbox_docker_parent|fork_server_docker|keep_docker)::/) | test(/^fork_copy::docker::/)'
log "cargo nextest run --test it -E '$suites'"
cargo nextest run --no-fail-fast --test it -E "$suites" || status=1

# 5. nothing left behind
stop_service
after="$(DOCKER_HOST="$KB_DOCKER_SOCKET" scripts/leftovers | sort)"
new="$(comm -13 <(echo "$before") <(echo "$after"))"
left="$(our_containers; podman pod ls -q)"
left="$(echo "$left" | sed '/^$/d')"
if [[ -n "$new" || -n "$left" ]]; then
    log "left behind:"
    printf '%s\n' "$new" "$left" | sed '/^$/d' >&2
    status=1
fi
log "done in $(( $(date +%s) - start ))s (status $status)"
exit "$status"
