#!/bin/sh
# Entrypoint of kernel-broker/broker (docker/broker/Dockerfile): makes the container's own
# cgroup writable for the broker, then execs its arguments (kernel-broker serve ...).
#
# The broker runs each kernel in a cgroup leaf of its own below the container's cgroup
# (the memory, CPU and pids limits of each kernel and user). Container runtimes mount
# /sys/fs/cgroup read-only, showing the container's own cgroup as the root of each
# hierarchy; with CAP_SYS_ADMIN (and no AppArmor profile that denies mount) this remounts
# the memory, cpu and pids hierarchies (or the v2 one) read-write. Nothing outside the container's cgroup becomes visible: the
# broker's tree stays inside the limits the runtime gave the container (the pod's).
#
# cgroup v2 needs a private cgroup namespace (the default of Docker and containerd on v2),
# and the namespace's root may hold no processes once controllers are enabled for its
# children: every process is moved into an `init` leaf first.
set -eu

log() { echo "kernel-broker-entrypoint: $*" >&2; }

# The hierarchies the broker uses: cgroup2, or v1's memory, cpu and pids (not devices,
# freezer and the rest: those stay read-only).
cgroup_mounts() {
    awk '$3 == "cgroup2" { print $2; next }
         $3 == "cgroup" { n = split($4, o, ","); for (i = 1; i <= n; i++)
                              if (o[i] == "memory" || o[i] == "cpu" || o[i] == "pids") { print $2; break } }' \
        /proc/self/mounts
}

if [ "${KB_SKIP_CGROUP_SETUP:-0}" != 1 ]; then
    for mp in $(cgroup_mounts); do
        [ -w "$mp" ] && continue
        mount -o remount,rw "$mp" 2>/dev/null \
            || mount -o remount,bind,rw "$mp" 2>/dev/null \
            || { log "cannot make $mp writable: the container needs CAP_SYS_ADMIN and no AppArmor profile denying mount (see examples/cluster/README.md)"; exit 1; }
    done

    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        own="$(sed -n 's/^0:://p' /proc/self/cgroup)"
        if [ "$own" != / ] && [ "$own" != /init ]; then
            log "cgroup v2 without a private cgroup namespace (this process is in $own): run the container with --cgroupns=private"
            exit 1
        fi
        mkdir -p /sys/fs/cgroup/init
        # The broker enables memory, cpu and pids for the children of the namespace's
        # root, which v2 allows only once no process is left in it.
        for pid in $(cat /sys/fs/cgroup/cgroup.procs); do
            echo "$pid" > /sys/fs/cgroup/init/cgroup.procs 2>/dev/null || true
        done
    fi
fi

exec "$@"
