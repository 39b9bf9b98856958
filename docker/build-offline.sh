#!/usr/bin/env bash
# Build kernel-broker/python-kernel:latest without a container registry.
#
#   1. debootstrap a minimal Debian bookworm rootfs from the host's Debian mirror
#      (cached as a tarball under $KB_CACHE_DIR, so reruns skip this step),
#   2. `docker import` it as kernel-broker/debian-base:bookworm,
#   3. `docker build` docker/Dockerfile on top of it (BASE build arg).
# With KB_ENGINE=podman, steps 2 and 3 are `podman import` and `podman build` into
# Podman's own image store (the one `podman system service` serves; rootful when run as
# root). A shortcut when Docker already holds the image: `docker save IMAGE | podman load`.
#
# Usage: docker/build-offline.sh [--print-hash]
#   --print-hash   print the inputs hash the image gets labelled with, and exit.
#
# Environment:
#   KB_CACHE_DIR        where the rootfs tarball is kept (default /var/cache/kernel-broker)
#   KB_DEBIAN_MIRROR    Debian mirror (default: the one in /etc/apt/sources.list*,
#                       else http://deb.debian.org/debian)
#   KB_DEBIAN_SECURITY_MIRROR  likewise for $SUITE-security (default deb.debian.org)
#   KB_REFRESH_ROOTFS=1 re-run debootstrap even if the cached tarball exists
#   KB_BUILD_CA_FILE    CA bundle pip uses inside the build (default: docker/build-ca.crt,
#                       else $PIP_CERT, $SSL_CERT_FILE, /etc/ssl/certs/ca-certificates.crt)
#   KB_IMAGE            image to build (default kernel-broker/python-kernel:latest)
#   KB_ENGINE           docker (default) or podman: the engine whose image store gets it
#
# Needs root (debootstrap), debootstrap and a running docker daemon (KB_ENGINE=docker)
# or the podman CLI (KB_ENGINE=podman).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

SUITE=bookworm
BASE_IMAGE="kernel-broker/debian-base:${SUITE}"
IMAGE="${KB_IMAGE:-kernel-broker/python-kernel:latest}"
IMAGE_REPO="${IMAGE%:*}"
CACHE_DIR="${KB_CACHE_DIR:-/var/cache/kernel-broker}"
ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
TARBALL="$CACHE_DIR/debian-${SUITE}-minbase-${ARCH}.tar"
HASH_LABEL="org.kernel-broker.inputs-hash"
ENGINE="${KB_ENGINE:-docker}"
case "$ENGINE" in
    docker | podman) ;;
    *) echo "KB_ENGINE must be docker or podman, not '$ENGINE'" >&2; exit 2 ;;
esac

log() { printf '[build-offline] %s\n' "$*" >&2; }

# Hash of everything that determines the image: docker/* (docs and docker/broker/, the
# broker image built on this one, excluded), kernels/requirements.txt and the kernel specs'
# own files the image holds (kernels/<name>/ but python3's).
# .ci/docker-setup.sh compares it with the image label.
inputs_hash() {
    (
        cd "$repo"
        { find docker -path docker/broker -prune -o -type f ! -name '*.md' -print; echo kernels/requirements.txt;
          find kernels/bash kernels/sql kernels/javascript kernels/java kernels/r -type f ! -path '*/__pycache__/*'; } \
            | LC_ALL=C sort | xargs sha256sum
    ) | sha256sum | cut -c1-64
}

if [[ "${1:-}" == "--print-hash" ]]; then
    inputs_hash
    exit 0
elif [[ $# -gt 0 ]]; then
    echo "usage: $0 [--print-hash]" >&2
    exit 2
fi

# The host's Debian mirror for a suite: first URI serving it in deb822 .sources
# files or one-line sources.list files.
host_mirror() {
    local suite="$1" f
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -r "$f" ]] || continue
        awk -v suite="$suite" '
            function flush() { if (uris != "" && has) { split(uris, u, " "); print u[1]; found = 1; exit } uris = ""; has = 0 }
            /^[ \t]*$/ { flush(); next }
            tolower($1) == "uris:"   { uris = ""; for (i = 2; i <= NF; i++) uris = uris " " $i }
            tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) has = 1 }
            END { if (!found) flush() }
        ' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -r "$f" ]] || continue
        sed -E 's/\[[^]]*\]//' "$f" | awk -v suite="$suite" '$1 == "deb" && $3 == suite { print $2 }'
    done
}

MIRROR="${KB_DEBIAN_MIRROR:-$(host_mirror "$SUITE" | head -n1)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
MIRROR="${MIRROR%/}"
SECURITY="${KB_DEBIAN_SECURITY_MIRROR:-$(host_mirror "$SUITE-security" | head -n1)}"
SECURITY="${SECURITY:-http://deb.debian.org/debian-security}"
SECURITY="${SECURITY%/}"

build_rootfs() {
    command -v debootstrap >/dev/null || { log "debootstrap not installed (apt-get install -y debootstrap)"; exit 1; }
    [[ $EUID -eq 0 ]] || { log "debootstrap needs root"; exit 1; }
    mkdir -p "$CACHE_DIR"
    local dir="$CACHE_DIR/rootfs.tmp"
    rm -rf "$dir"
    log "debootstrap --variant=minbase $SUITE from $MIRROR (takes a few minutes)"
    debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$CACHE_DIR/debootstrap.log" 2>&1 || {
        tail -n 30 "$CACHE_DIR/debootstrap.log" >&2
        log "debootstrap failed, full log: $CACHE_DIR/debootstrap.log"
        exit 1
    }

    # Make it look like debian:bookworm-slim: full apt sources, no apt caches,
    # no docs/man/locales installed by later apt-get calls.
    cat >"$dir/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
    cat >"$dir/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    cat >"$dir/etc/apt/apt.conf.d/docker-no-languages" <<'EOF'
Acquire::Languages "none";
EOF
    cat >"$dir/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/cache/apt/*.bin \
           "$dir"/var/lib/apt/lists/* "$dir"/var/log/* "$dir"/tmp/* \
           "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
           "$dir"/usr/share/locale/*
    # docker bind-mounts its own versions of these at run time
    rm -f "$dir/etc/resolv.conf" "$dir/etc/hostname"
    : >"$dir/etc/hostname"

    log "writing $TARBALL"
    # /dev, /proc, /sys are provided by the runtime; keep the directories only.
    tar -C "$dir" --numeric-owner --xattrs --xattrs-include='*' \
        --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* \
        -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    rm -rf "$dir"
}

if [[ "$ENGINE" == docker ]]; then
    docker info >/dev/null 2>&1 || { log "docker daemon not reachable (run .ci/docker-setup.sh)"; exit 1; }
else
    podman info >/dev/null 2>&1 || { log "podman not usable (apt-get install -y podman; see .ci/podman.sh)"; exit 1; }
fi

start=$(date +%s)

if [[ ! -s "$TARBALL" || "${KB_REFRESH_ROOTFS:-0}" == 1 ]]; then
    build_rootfs
else
    log "using cached rootfs $TARBALL (KB_REFRESH_ROOTFS=1 to rebuild)"
fi

rootfs_sha="$(sha256sum "$TARBALL" | cut -c1-64)"
have_sha="$("$ENGINE" image inspect -f "{{ index .Config.Labels \"org.kernel-broker.rootfs-sha256\" }}" "$BASE_IMAGE" 2>/dev/null || true)"
if [[ "$have_sha" == "$rootfs_sha" ]]; then
    log "$BASE_IMAGE is up to date"
else
    log "$ENGINE import -> $BASE_IMAGE"
    "$ENGINE" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' \
        --change "LABEL org.kernel-broker.rootfs-sha256=$rootfs_sha org.kernel-broker.debian-mirror=$MIRROR" \
        --message "debootstrap --variant=minbase $SUITE $MIRROR" \
        "$TARBALL" "$BASE_IMAGE" >/dev/null
fi

# Build from a staged context holding only what the Dockerfile needs, laid out
# like the repository root: the legacy builder ignores docker/Dockerfile.dockerignore
# and the repo root may hold gigabytes of target/ and .venv.
ctx="$(mktemp -d /tmp/kb-docker-ctx.XXXXXX)"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/docker" "$ctx/kernels"
cp "$repo/docker/Dockerfile" "$ctx/docker/"
cp "$repo/kernels/requirements.txt" "$ctx/kernels/"
for k in bash sql javascript java r; do
    mkdir -p "$ctx/kernels/$k"
    find "$repo/kernels/$k" -maxdepth 1 -type f -exec cp {} "$ctx/kernels/$k/" \;
done
# CA bundle for pip inside the build (networks that intercept TLS need the
# host's extra CA; on others this is just the stock Mozilla bundle).
ca="${KB_BUILD_CA_FILE:-}"
if [[ -z "$ca" && -f "$repo/docker/build-ca.crt" ]]; then
    ca="$repo/docker/build-ca.crt"
fi
ca="${ca:-${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
if [[ -s "$ca" ]]; then
    cp "$ca" "$ctx/docker/build-ca.crt"
fi

hash="$(inputs_hash)"
# docker >= 23 clients route `docker build` to buildx; fall back to the classic
# builder when the buildx plugin is missing (as with Debian's docker.io).
# Podman builds with buildah, which has no such split (and --force-rm is its default).
build_flags=()
if [[ "$ENGINE" == docker ]] && ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0
    # don't leave intermediate containers behind when a step fails
    build_flags+=(--force-rm)
fi
log "$ENGINE build -> $IMAGE (inputs hash ${hash:0:12})"
"$ENGINE" build "${build_flags[@]}" \
    --build-arg "BASE=$BASE_IMAGE" \
    --label "$HASH_LABEL=$hash" \
    -f "$ctx/docker/Dockerfile" \
    -t "$IMAGE" -t "$IMAGE_REPO:${hash:0:12}" \
    "$ctx"

# Drop the hash tags of earlier builds (an image still used by a container stays).
# (Podman lists local images as localhost/<name>; the suffix test covers both.)
for old in $("$ENGINE" image ls --format '{{.Repository}}:{{.Tag}}' "$IMAGE_REPO"); do
    if [[ "$old" =~ :[0-9a-f]{12}$ && "$old" != *"$IMAGE_REPO:${hash:0:12}" ]]; then
        "$ENGINE" rmi "$old" >/dev/null 2>&1 || true
    fi
done

log "done in $(( $(date +%s) - start ))s: $IMAGE ($("$ENGINE" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
