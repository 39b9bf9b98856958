//! The reaper: no process outlives its session. The container outlives each session, so a kernel's
//! end must take along everything the kernel started, whatever it did to escape (a new
//! session, a double fork, ignoring SIGTERM/SIGINT/SIGHUP), without touching the user's
//! other sessions in the same container. Two mechanisms, both unprivileged and both inside
//! the container (so they work the same with rootless Docker or Podman, where the host
//! cannot signal the container's processes):
//! - Each kernel runs under its own `tini -s`, a child subreaper: a daemon that double-forks
//!   is reparented to its kernel's tini, not to the container's PID 1, so it stays in its
//!   session's process subtree (and another session's end leaves it alone). tini also
//!   reaps those orphans when they exit, so zombies do not pile up against the pids limit.
//! - When a kernel ends (killed by the broker, or by itself), a reaper exec ([`REAPER`],
//!   a short python script reading `/proc`) kills, until a scan finds none left, the
//!   process subtree of that kernel's exec and every orphan reparented to PID 1 (all of
//!   whose session has ended: a live session's orphans go to its tini), sparing PID 1's
//!   own `sleep infinity`. Each round SIGSTOPs every target before SIGKILLing any, so a
//!   process that forks in a loop cannot outrun it. The exec of a kernel is recognised by
//!   parent pid 0 (only `docker exec` makes those; a kernel cannot) and its argv holding
//!   its connection file, never by the pid file, which the kernel can overwrite. Other
//!   execs (other kernels, interrupts, counters) are never targets. One reaper per
//!   container at a time (`ContainerInfo::reaping`). Measured: ~0.1 s for a kernel with a
//!   new-session child, a daemon, a signal-deaf process and a fork runner.
//!   Limits: a process of the session that ptraces another session's tini could hide
//!   under it (same uid: one trust domain, see `mod.rs`); on shutdown the container is
//!   removed whole instead.

use std::time::{Duration, Instant};

use bollard::Docker;
use tokio::time::timeout;

use super::daemon::error_text;
use super::exec::{kernel_log, DockerKernel};
use super::running::{container_reason, exec_output};
use super::{EXEC_TIMEOUT, LOG_TAIL_BYTES, PYTHON_INSIDE, REAP_LIMIT_SECS, RUN_DIR_INSIDE};

/// The reaper, run by the container's python (`-I -S`: no site, no current directory on
/// the path, since `/workspace` is the kernel's) as the kernels' uid. Arguments: the ended
/// kernel's connection file and log. It kills, until a scan of `/proc` finds none left:
/// the process subtree of the exec whose argv holds that connection file (exec processes
/// have parent 0 in the container's pid namespace; a kernel cannot make one), and every
/// descendant of PID 1 except its first child (the container's `sleep infinity`, started
/// before any exec, so no later process can have an earlier start time). Each round
/// stops every target before killing any, so a forking process cannot outrun it; zombies
/// are skipped (their parent reaps them). Prints `killed rounds`, exits 2 if processes
/// were still appearing after the time limit.
pub(super) const REAPER: &str = r#"
import os, signal, sys, time
conn, log, limit = sys.argv[1].encode(), sys.argv[2], float(sys.argv[3])
me = os.getpid()
def scan():
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(b")") + 2:].split()
        procs[int(name)] = (rest[0], int(rest[1]), int(rest[19]))
    return procs
def targets():
    procs = scan()
    children = {}
    for pid, (_, ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    roots = []
    for pid in children.get(0, []):
        if pid in (1, me):
            continue
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if conn in argv:
            roots.append(pid)
    orphans = sorted(children.get(1, []), key=lambda p: (procs[p][2], p))
    roots += orphans[1:]
    found, stack = [], roots
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        if procs[pid][0] != b"Z":
            found.append(pid)
    return found
def send(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
try:
    os.unlink(log)
except OSError:
    pass
killed, rounds, deadline = set(), 0, time.monotonic() + limit
while True:
    found = targets()
    if not found:
        break
    send(found, signal.SIGSTOP)
    send(found, signal.SIGKILL)
    killed.update(found)
    rounds += 1
    if time.monotonic() > deadline:
        print(len(killed), rounds, "still", len(found))
        sys.exit(2)
    time.sleep(0.01)
print(len(killed), rounds)
"#;

/// Runs [`REAPER`] in the kernel's container for this kernel, one reaper per container at
/// a time. Called when a kernel is killed and when it ended by itself (then only its
/// orphans are left). Failures are logged: a removed container has nothing left to reap.
pub(super) async fn reap(docker: &Docker, shared: &DockerKernel) {
    let conn = format!("{RUN_DIR_INSIDE}/{}/connection.json", shared.dir);
    let log = kernel_log(&shared.dir);
    let limit = REAP_LIMIT_SECS.to_string();
    let cmd = [PYTHON_INSIDE, "-I", "-S", "-c", REAPER, &conn, &log, &limit];
    let _serial = shared.container.reaping.lock().await;
    let started = Instant::now();
    let limit = EXEC_TIMEOUT + Duration::from_secs(u64::from(REAP_LIMIT_SECS));
    match timeout(limit, exec_output(docker, &shared.container.id, &cmd)).await {
        Ok(Ok((0, out))) => tracing::debug!(
            session = %shared.watch.session_id,
            killed_rounds = %out.trim(),
            ms = started.elapsed().as_millis() as u64,
            "reaped the kernel's processes"
        ),
        Ok(Ok((code, out))) => {
            if container_reason(docker, &shared.container).await.is_some() {
                // The container is gone (removed under the reaper): nothing is left.
                tracing::debug!(session = %shared.watch.session_id, code, "reaper ended with its container");
            } else {
                tracing::warn!(
                    session = %shared.watch.session_id,
                    code,
                    output = %out.trim(),
                    "the reaper did not reach a fixed point; processes of the session may be left"
                );
            }
        }
        Ok(Err(e)) => {
            tracing::debug!(session = %shared.watch.session_id, error = %error_text(&e), "reaper exec failed")
        }
        Err(_) => tracing::warn!(session = %shared.watch.session_id, "the reaper exec timed out"),
    }
}

/// The end of a dead kernel's stdout/stderr (from the container's `/tmp`), then removes it.
pub(super) async fn kernel_log_tail(docker: &Docker, shared: &DockerKernel) -> String {
    let log = kernel_log(&shared.dir);
    let script = format!("tail -c {LOG_TAIL_BYTES} {log} 2>/dev/null; rm -f {log}");
    match timeout(
        EXEC_TIMEOUT,
        exec_output(docker, &shared.container.id, &["sh", "-c", &script]),
    )
    .await
    {
        Ok(Ok((_, out))) => out.trim().replace('\n', " | "),
        _ => String::new(),
    }
}
