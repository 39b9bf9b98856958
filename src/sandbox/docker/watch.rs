//! The watcher of one kernel: polls its exec, kills it when asked, classifies its end,
//! cleans up, and publishes the reason.
//!
//! Out of memory: a kernel has its own cgroup leaf inside the container (see `exec.rs`), so
//! past its own limit the OOM killer picks among its processes only, and the leaf's
//! `oom_kill` counter (read on the host) says so. What follows is the fallback for a kernel
//! without a leaf (the broker could not manage cgroups): with a memory limit on the
//! container, the kernel's OOM killer kills the biggest process in it, and the
//! container survives. Docker does not report that per exec, so a kernel whose exec ended
//! by SIGKILL (137) is reported as [`ExitReason::OutOfMemory`] only if the container's
//! cgroup counter `oom_kill` (`memory.events` on cgroup v2, `memory.oom_control` on v1,
//! read from inside the container) went up by a kill no other kernel has claimed yet;
//! otherwise it is [`ExitReason::Signaled`]`(9)`. An OOM kill of some other process (a
//! subprocess the kernel started) can thus be attributed to a kernel killed later by
//! `kill -9`; rare, and said here to stay honest. If the OOM killer hits tini instead, the
//! container dies and every kernel in it ends with OutOfMemory (`State.OOMKilled`).
//!
//! A kernel forked from its user's template (`template.rs`) has no exec: [`watch_forked`]
//! sees its end through a pidfd, takes its status from the template, and always has a leaf.

use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bollard::Docker;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use tokio::time::{sleep, timeout};

use super::daemon::{error_text, status_of};
use super::exec::{recorded_status, DockerKernel};
use super::reaper::{kernel_log_tail, reap};
use super::running::{container_reason, exec_output, ContainerInfo};
use super::{Inner, DAEMON_GRACE, EXEC_TIMEOUT, POLL_INTERVAL, TERMINATE_TIMEOUT};
use crate::sandbox::cgroup::ContainerCgroup;
use crate::sandbox::exhaustion::{disk_full, explain, Evidence};
use crate::sandbox::fork_server::forked_status;
use crate::sandbox::fsutil::remove_dir_logged;
use crate::sandbox::pidfd;
use crate::sandbox::procfs::zombie_status;
use crate::sandbox::watched::{ExitPublisher, WatchedKernel};
use crate::sandbox::ExitReason;
use crate::sync::lock;

/// Where a forked kernel's exit status comes from.
pub(super) enum ForkedStatus {
    /// Its template reaps it and reports the raw status.
    Template(oneshot::Receiver<i32>),
    /// A live kernel's fork (`fork.rs`): the kernel it was forked from reaps it (between
    /// its executions), so the status is read from the zombie while its pidfd still names
    /// it; once reaped it is unknown, and its leaf's counters tell what they can.
    Zombie,
}

impl ForkedStatus {
    /// The status its template reported (never, for a live kernel's fork).
    async fn reported(&mut self) -> Result<i32, oneshot::error::RecvError> {
        match self {
            ForkedStatus::Template(rx) => rx.await,
            ForkedStatus::Zombie => std::future::pending().await,
        }
    }

    /// Its status once its pidfd says it ended.
    async fn after_end(
        &mut self,
        pidfd: &AsyncFd<OwnedFd>,
        host_pid: Option<i32>,
    ) -> std::io::Result<std::process::ExitStatus> {
        match self {
            ForkedStatus::Template(rx) => forked_status(pidfd, rx).await,
            ForkedStatus::Zombie => {
                let _ready = pidfd.readable().await?;
                // Read while not reaped (its pidfd still names an unreaped process), the
                // status was this process's, not a reuse of its pid's.
                host_pid
                    .and_then(zombie_status)
                    .filter(|_| pidfd::exists(pidfd.get_ref()))
                    .map(std::process::ExitStatus::from_raw)
                    .ok_or_else(|| {
                        std::io::Error::other(
                            "its exit status is unknown (the kernel it was forked from reaped it)",
                        )
                    })
            }
        }
    }
}

/// How a forked kernel's wait ended.
enum ForkedEnd {
    /// The template reaped it: the raw wait status.
    Status(i32),
    /// Its pidfd says it ended (the status follows from the template).
    Gone,
    /// The template stopped working while the kernel may still run.
    TemplateLost,
    Kill,
    Release,
}

/// Registers a kernel that has no exec of its own (forked from a template or a live kernel,
/// or restored from a copy) under `session` and watches it through `watch_fd`; returns its
/// handle.
pub(super) fn register_forked(
    inner: &Arc<Inner>,
    session: uuid::Uuid,
    shared: Arc<DockerKernel>,
    exit: ExitPublisher,
    watch_fd: AsyncFd<OwnedFd>,
    status: ForkedStatus,
) -> WatchedKernel<DockerKernel> {
    inner.kernels.insert(session, shared.clone());
    tokio::spawn(watch_forked(
        inner.clone(),
        shared.clone(),
        exit,
        watch_fd,
        status,
    ));
    WatchedKernel::new(shared, TERMINATE_TIMEOUT)
}

/// Watches a kernel forked from its user's template (`template.rs`): no exec to poll, so
/// its end is seen through its pidfd and its status comes from the template, which reaps
/// it; classified with the same mapping as an exec's end ([`classify_exec_end`]: its own
/// leaf's OOM kill vs a kill vs an exit). Everything it started is in its leaf, whatever
/// it was reparented to: the leaf's removal ends it, and nothing else of the container.
pub(super) async fn watch_forked(
    inner: Arc<Inner>,
    shared: Arc<DockerKernel>,
    exit: ExitPublisher,
    pidfd: AsyncFd<OwnedFd>,
    mut status: ForkedStatus,
) {
    let docker = shared.docker.clone();
    let host_pid = shared.forked.as_ref().map(|f| f.host_pid);
    let end = tokio::select! {
        raw = status.reported() => match raw {
            Ok(raw) => ForkedEnd::Status(raw),
            Err(_) => ForkedEnd::TemplateLost,
        },
        ready = pidfd.readable() => match ready {
            Ok(_) => ForkedEnd::Gone,
            Err(_) => ForkedEnd::TemplateLost,
        },
        () = shared.watch.kill_requested() => ForkedEnd::Kill,
        () = shared.watch.release_requested() => ForkedEnd::Release,
    };
    let reason = match end {
        ForkedEnd::Release => return,
        ForkedEnd::Kill => {
            kill_leaf(&shared).await;
            // Reaped by its template at once; only a dead template leaves it unreported.
            let _ = timeout(TERMINATE_TIMEOUT, status.after_end(&pidfd, host_pid)).await;
            ExitReason::Terminated
        }
        ForkedEnd::Status(raw) => forked_reason(&docker, &shared, raw).await,
        ForkedEnd::Gone => match status.after_end(&pidfd, host_pid).await {
            Ok(s) => forked_reason(&docker, &shared, s.into_raw()).await,
            // Its template went first (with the container, most likely), or the kernel it
            // was forked from reaped it: its own leaf's OOM kill still tells that end.
            Err(e) => {
                settled_reason(&docker, &shared.container, || {
                    match shared.leaf.as_ref().and_then(|l| l.oom_kills()) {
                        Some(kills) if kills > 0 => ExitReason::OutOfMemory {
                            limit_bytes: shared.limits.memory_bytes,
                        },
                        _ => ExitReason::Lost(format!("the forked kernel ended: {e}")),
                    }
                })
                .await
            }
        },
        ForkedEnd::TemplateLost => {
            kill_leaf(&shared).await;
            settled_reason(&docker, &shared.container, || {
                ExitReason::Lost("its fork-server template stopped working".to_string())
            })
            .await
        }
    };
    let reason = shared.watch.reason_or_terminated(reason);
    // Nothing to reap one by one: the leaf's removal kills what is left.
    end_kernel(&inner, &shared, &reason, true).await;
    exit.publish(reason);
}

/// How long the daemon is given to report a container's end after its processes died.
const CONTAINER_SETTLE: Duration = Duration::from_secs(3);

/// Why a forked kernel ended whose template went without its status: the container's end
/// if that is what took them (a removal kills the processes before the daemon reports the
/// container stopped or gone, so it is asked again for [`CONTAINER_SETTLE`]), else
/// `otherwise()`.
async fn settled_reason(
    docker: &Docker,
    container: &ContainerInfo,
    otherwise: impl FnOnce() -> ExitReason,
) -> ExitReason {
    let deadline = Instant::now() + CONTAINER_SETTLE;
    loop {
        if let Some(reason) = container_reason(docker, container).await {
            return reason;
        }
        if Instant::now() >= deadline {
            return otherwise();
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// A forked kernel's raw wait status as an exec's exit code (signal N is 128 + N), then
/// classified as an exec's end.
async fn forked_reason(docker: &Docker, shared: &DockerKernel, raw: i32) -> ExitReason {
    let status = std::process::ExitStatus::from_raw(raw);
    let code = match status.signal() {
        Some(sig) => 128 + i64::from(sig),
        None => i64::from(status.code().unwrap_or(-1)),
    };
    classify_exec_end(docker, shared, Some(code)).await
}

async fn kill_leaf(shared: &DockerKernel) {
    if let Some(leaf) = &shared.leaf {
        leaf.kill_all().await;
    }
}

/// Watches one kernel until it ends or is killed; then cleans up and publishes the reason.
pub(super) async fn watch_kernel(
    inner: Arc<Inner>,
    shared: Arc<DockerKernel>,
    exit: ExitPublisher,
) {
    let docker = shared.docker.clone();
    let (reason, reaped) = loop {
        tokio::select! {
            () = sleep(POLL_INTERVAL) => {}
            // Released (`--keep-sessions` shutdown): the kernel is the next run's; nothing
            // is ended, removed or published.
            () = shared.watch.release_requested() => return,
            () = shared.watch.kill_requested() => {
                // On shutdown the whole container is being removed: nothing to reap one by
                // one, only the end to wait for.
                kill_kernel(&docker, &shared, !inner.removing_containers()).await;
                break (ExitReason::Terminated, true);
            }
        }
        match poll_exec(&docker, &shared).await {
            Poll::Running => continue,
            Poll::Ended(reason) => break (reason, false),
        }
    };
    let reason = shared.watch.reason_or_terminated(reason);
    end_kernel(&inner, &shared, &reason, reaped).await;
    exit.publish(reason);
}

/// What follows a kernel's end, whoever saw it (its watcher, or an adoption that found it
/// ended): logs it, reaps what it left unless `reaped`, removes its leaf, its session
/// directory, its ticket, and its entry in the kernel table.
pub(super) async fn end_kernel(
    inner: &Inner,
    shared: &DockerKernel,
    reason: &ExitReason,
    reaped: bool,
) {
    let docker = &shared.docker;
    let session = shared.watch.session_id;
    match reason {
        ExitReason::Terminated | ExitReason::Exited(0) => {
            tracing::info!(%session, user = %shared.watch.user, %reason, "kernel ended");
        }
        // A forked kernel's output went to its template's stderr (the broker's log).
        _ if shared.forked.is_some() => {
            tracing::warn!(%session, user = %shared.watch.user, %reason, "forked kernel ended");
        }
        _ => {
            let tail = kernel_log_tail(docker, shared).await;
            tracing::warn!(%session, user = %shared.watch.user, %reason, last_output = %tail, "kernel ended");
        }
    }
    if !reaped && !inner.removing_containers() {
        // Ended by itself: what it started outlives it, reparented to PID 1.
        reap(docker, shared).await;
    }
    if let Some(leaf) = &shared.leaf {
        ContainerCgroup::remove_leaf(leaf).await;
    }
    remove_dir_logged(shared.host_dir.clone()).await;
    if inner.cfg.keep_kernels {
        inner.remove_ticket(session).await;
    }
    inner.kernels.remove(&session);
}

enum Poll {
    Running,
    Ended(ExitReason),
}

/// Asks the daemon about the kernel's exec; tolerates a silent daemon for [`DAEMON_GRACE`].
async fn poll_exec(docker: &Docker, shared: &DockerKernel) -> Poll {
    let since = Instant::now();
    loop {
        match docker.inspect_exec(&shared.exec_id).await {
            // Podman keeps saying "running" after the process ended (`engine.rs`): its
            // pidfd says, and the kernel's command wrote the status.
            Ok(exec) if exec.running == Some(true) => {
                return match &shared.exec_pidfd {
                    Some(fd) if pidfd::ended(fd).unwrap_or(false) => {
                        Poll::Ended(classify_unreported_exec_end(docker, shared).await)
                    }
                    _ => Poll::Running,
                }
            }
            Ok(exec) => {
                return Poll::Ended(classify_exec_end(docker, shared, exec.exit_code).await)
            }
            // The exec is gone: the container was removed.
            Err(e) if status_of(&e) == Some(404) => {
                return Poll::Ended(
                    container_reason(docker, &shared.container)
                        .await
                        .unwrap_or_else(|| {
                            ExitReason::Lost("the user's container was removed".to_string())
                        }),
                )
            }
            Err(e) => {
                if since.elapsed() >= DAEMON_GRACE {
                    return Poll::Ended(ExitReason::Lost(format!(
                        "lost contact with the Docker daemon: {}",
                        error_text(&e)
                    )));
                }
                tracing::debug!(session = %shared.watch.session_id, error = %error_text(&e), "cannot inspect the kernel's exec; retrying");
                tokio::select! {
                    () = sleep(Duration::from_secs(1)) => {}
                    () = shared.watch.kill_requested() => return Poll::Running,
                }
            }
        }
    }
}

/// Why a kernel's exec ended: the container's end if the container stopped, else the
/// exec's exit code (see the module comment for how SIGKILL becomes OutOfMemory).
pub(super) async fn classify_exec_end(
    docker: &Docker,
    shared: &DockerKernel,
    exit_code: Option<i64>,
) -> ExitReason {
    if let Some(reason) = container_reason(docker, &shared.container).await {
        return reason;
    }
    let code = exit_code.unwrap_or(-1);
    if let Some(leaf) = &shared.leaf {
        let reason = if code == 128 + i64::from(libc::SIGKILL) && leaf.oom_kills() > Some(0) {
            ExitReason::OutOfMemory {
                limit_bytes: shared.limits.memory_bytes,
            }
        } else {
            exit_reason_from_code(code)
        };
        let evidence = Evidence {
            reached_memory_limit: leaf.reached_memory_limit(),
            pids_refused: leaf.pids_refused(),
            disk_full: shared.quota_bytes > 0 && disk_full(&shared.workspace),
        };
        return explain(reason, evidence, &shared.limits, shared.quota_bytes);
    }
    if code == 128 + i64::from(libc::SIGKILL) {
        match oom_kills(docker, &shared.container.id).await {
            Some(count) => {
                if claim_oom(&shared.container, count) {
                    return ExitReason::OutOfMemory {
                        limit_bytes: shared.container.memory_limit,
                    };
                }
            }
            None => {
                // The counter is unreadable: maybe the container is going away right now.
                if let Some(reason) = container_reason(docker, &shared.container).await {
                    return reason;
                }
            }
        }
    }
    exit_reason_from_code(code)
}

/// How a kernel ended whose exec's process is gone while the daemon says it runs (Podman:
/// see `engine.rs`): by the status its command recorded ([`recorded_status`]), classified as
/// an exec's end; without one, [`classify_unreported_end`].
pub(super) async fn classify_unreported_exec_end(
    docker: &Docker,
    shared: &DockerKernel,
) -> ExitReason {
    match recorded_status(&shared.host_dir) {
        Some(code) => classify_exec_end(docker, shared, Some(code)).await,
        None => classify_unreported_end(docker, shared).await,
    }
}

/// How a kernel ended whose exec the daemon never reported as ended (Podman: see
/// `engine.rs`): its exit status is unknown, so only what the cgroups tell is said: killed
/// for its memory if its leaf (else its container, unattributed kill) saw an OOM kill, else
/// lost, saying why no more is known.
async fn classify_unreported_end(docker: &Docker, shared: &DockerKernel) -> ExitReason {
    if let Some(reason) = container_reason(docker, &shared.container).await {
        return reason;
    }
    let oom = match &shared.leaf {
        Some(leaf) => (leaf.oom_kills() > Some(0)).then_some(shared.limits.memory_bytes),
        None => oom_kills(docker, &shared.container.id)
            .await
            .filter(|count| claim_oom(&shared.container, *count))
            .map(|_| shared.container.memory_limit),
    };
    match oom {
        Some(limit_bytes) => ExitReason::OutOfMemory { limit_bytes },
        None => ExitReason::Lost(UNREPORTED_END.into()),
    }
}

/// Why a kernel that ended unwatched under Podman has no exit status.
pub const UNREPORTED_END: &str = "the kernel ended without a recorded exit status, and the \
     daemon (Podman) does not report how a detached exec ended";

/// Exit code of an exec'd process as a reason (Docker reports signal N as 128 + N).
fn exit_reason_from_code(code: i64) -> ExitReason {
    match code {
        129..=192 => ExitReason::Signaled((code - 128) as i32),
        c => ExitReason::Exited(i32::try_from(c).unwrap_or(-1)),
    }
}

/// Takes one not yet attributed OOM kill of the container, if there is one.
fn claim_oom(container: &ContainerInfo, count: u64) -> bool {
    let mut claimed = lock(&container.oom_claimed);
    if count > *claimed {
        *claimed += 1;
        true
    } else {
        false
    }
}

/// The container's OOM-kill counter, read from its own cgroup (v2, then v1).
async fn oom_kills(docker: &Docker, container: &str) -> Option<u64> {
    let script = "cat /sys/fs/cgroup/memory.events 2>/dev/null || \
                  cat /sys/fs/cgroup/memory/memory.oom_control";
    let (code, out) = timeout(
        EXEC_TIMEOUT,
        exec_output(docker, container, &["sh", "-c", script]),
    )
    .await
    .ok()?
    .ok()?;
    if code != 0 {
        return None;
    }
    parse_oom_kill(&out)
}

/// The `oom_kill N` line of `memory.events` (v2) or `memory.oom_control` (v1).
fn parse_oom_kill(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some("oom_kill"))
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

/// Kills the kernel with everything it started (see [`reap`]) unless `reap_first` is false,
/// and waits until Docker reports the exec ended (or the container gone). Errors only
/// logged: the container may be going away at the same time.
async fn kill_kernel(docker: &Docker, shared: &DockerKernel, reap_first: bool) {
    if reap_first {
        reap(docker, shared).await;
    }
    let deadline = Instant::now() + TERMINATE_TIMEOUT;
    while Instant::now() < deadline {
        // Under Podman the exec never reads as ended (`engine.rs`): its process's pidfd says.
        if let Some(fd) = &shared.exec_pidfd {
            if pidfd::ended(fd).unwrap_or(false) {
                return;
            }
            sleep(Duration::from_millis(100)).await;
            continue;
        }
        match docker.inspect_exec(&shared.exec_id).await {
            Ok(exec) if exec.running == Some(true) => {}
            Ok(_) => return,
            Err(e) if status_of(&e) == Some(404) => return,
            Err(e) => tracing::debug!(error = %error_text(&e), "inspecting a killed kernel failed"),
        }
        sleep(Duration::from_millis(100)).await;
    }
    tracing::warn!(session = %shared.watch.session_id, "the kernel's exec still runs after SIGKILL");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    #[test]
    fn oom_kill_counters_parse_for_both_cgroup_versions() {
        let v2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kill(v2), Some(2));
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n";
        assert_eq!(parse_oom_kill(v1), Some(5));
        // Kernels before 4.13 have no counter in memory.oom_control.
        assert_eq!(parse_oom_kill("oom_kill_disable 0\nunder_oom 0\n"), None);
        assert_eq!(parse_oom_kill(""), None);
    }

    #[test]
    fn exec_exit_codes_map_to_reasons() {
        assert_eq!(exit_reason_from_code(0), ExitReason::Exited(0));
        assert_eq!(exit_reason_from_code(3), ExitReason::Exited(3));
        assert_eq!(exit_reason_from_code(128), ExitReason::Exited(128));
        assert_eq!(exit_reason_from_code(130), ExitReason::Signaled(2));
        assert_eq!(exit_reason_from_code(137), ExitReason::Signaled(9));
        assert_eq!(exit_reason_from_code(255), ExitReason::Exited(255));
        assert_eq!(exit_reason_from_code(-1), ExitReason::Exited(-1));
    }

    #[test]
    fn each_oom_kill_is_claimed_once() {
        let c = ContainerInfo {
            id: "x".into(),
            name: "x".into(),
            memory_limit: 1,
            oom_claimed: Mutex::new(0),
            reaping: tokio::sync::Mutex::new(()),
            own: None,
        };
        assert!(!claim_oom(&c, 0));
        assert!(claim_oom(&c, 2));
        assert!(claim_oom(&c, 2));
        assert!(!claim_oom(&c, 2));
        assert!(claim_oom(&c, 3));
    }
}
