#!/usr/bin/env bash
# Build kernel-broker/broker:latest: the broker with the embedded sandbox (bubblewrap +
# cgroups) on the kernel image, without a container registry.
#
#   1. cargo build --release --bin kernel-broker on the host (Debian's rustc is too old to
#      build it inside the image); the image gets a stripped copy,
#   2. docker/build-offline.sh when kernel-broker/python-kernel:latest is missing,
#   3. docker build docker/broker/Dockerfile on it from a staged context.
#
# Usage: docker/broker/build.sh
#
# Environment:
#   KB_BROKER_IMAGE   image to build (default kernel-broker/broker:latest)
#   KB_KERNEL_IMAGE   base image (default kernel-broker/python-kernel:latest)
#   KB_BROKER_BIN     use this broker binary instead of building target/release/kernel-broker
#   KB_CRIU_BIN       CRIU 4.x to put in the image (default /usr/local/sbin/criu, made by
#                     scripts/setup-criu when missing)
#   KB_ENGINE         docker (default) or podman
#
# Needs cargo (unless KB_BROKER_BIN), a running docker daemon (.ci/docker-setup.sh) and the
# host's Debian mirror (apt-get install bubblewrap inside the build).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

IMAGE="${KB_BROKER_IMAGE:-kernel-broker/broker:latest}"
KERNEL_IMAGE="${KB_KERNEL_IMAGE:-kernel-broker/python-kernel:latest}"
ENGINE="${KB_ENGINE:-docker}"
case "$ENGINE" in
    docker | podman) ;;
    *) echo "KB_ENGINE must be docker or podman, not '$ENGINE'" >&2; exit 2 ;;
esac

log() { printf '[broker-image] %s\n' "$*" >&2; }

start=$(date +%s)

if [[ -n "${KB_BROKER_BIN:-}" ]]; then
    bin="$KB_BROKER_BIN"
else
    log "cargo build --release --bin kernel-broker"
    (cd "$repo" && cargo build --release --bin kernel-broker)
    bin="$repo/target/release/kernel-broker"
fi
[[ -x "$bin" ]] || { log "no broker binary at $bin"; exit 1; }

"$ENGINE" info >/dev/null 2>&1 || { log "$ENGINE is not usable (run .ci/docker-setup.sh)"; exit 1; }
if ! "$ENGINE" image inspect "$KERNEL_IMAGE" >/dev/null 2>&1; then
    if [[ "$KERNEL_IMAGE" == kernel-broker/python-kernel:latest ]]; then
        log "$KERNEL_IMAGE is missing: docker/build-offline.sh"
        KB_ENGINE="$ENGINE" "$repo/docker/build-offline.sh"
    else
        log "$KERNEL_IMAGE is missing"
        exit 1
    fi
fi

# A context of only what the Dockerfile copies (the repository root holds gigabytes of
# target/). The release profile keeps line tables (debug = 1): the image gets a stripped
# copy, about a quarter of the size.
ctx="$(mktemp -d /tmp/kb-broker-ctx.XXXXXX)"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/kernels/python3"
cp "$here/Dockerfile" "$ctx/"
install -m 0755 "$here/entrypoint.sh" "$ctx/entrypoint.sh"
cp "$repo/kernels/python3/kernel.json" "$ctx/kernels/python3/"
if command -v strip >/dev/null; then
    strip -o "$ctx/kernel-broker" "$bin"
else
    cp "$bin" "$ctx/kernel-broker"
fi
chmod 0755 "$ctx/kernel-broker"
# CRIU (pause and resume, forks of sessions with a workspace of their own, snapshots,
# --carry-paused): the host's, built by scripts/setup-criu (Debian 12's 3.17 cannot dump on
# current kernels); its libraries come from Debian in the image.
criu="${KB_CRIU_BIN:-/usr/local/sbin/criu}"
if [[ ! -x "$criu" ]]; then
    log "no CRIU at $criu: scripts/setup-criu"
    "$repo/scripts/setup-criu"
fi
install -m 0755 "$criu" "$ctx/criu"
version="$("$ctx/kernel-broker" --version 2>/dev/null | awk '{ print $NF }' || true)"
commit="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [[ -n "$(git -C "$repo" status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null)" ]]; then
    commit="$commit-dirty"
fi

build_flags=()
if [[ "$ENGINE" == docker ]] && ! docker buildx version >/dev/null 2>&1; then
    # Debian's docker.io has no buildx plugin: the classic builder.
    export DOCKER_BUILDKIT=0
    build_flags+=(--force-rm)
fi
log "$ENGINE build -> $IMAGE (on $KERNEL_IMAGE, broker ${version:-?} at $commit)"
"$ENGINE" build "${build_flags[@]}" \
    --build-arg "KERNEL_IMAGE=$KERNEL_IMAGE" \
    --label "org.kernel-broker.broker-version=${version:-unknown}" \
    --label "org.kernel-broker.broker-commit=$commit" \
    -t "$IMAGE" "$ctx"

log "done in $(( $(date +%s) - start ))s: $IMAGE ($("$ENGINE" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
