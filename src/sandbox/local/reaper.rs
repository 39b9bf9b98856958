//! A local kernel after its launch: the handle's backend half (interrupt: SIGINT to the
//! sandboxed command found through the sandbox's init), and the reaper task that owns the
//! bwrap child, kills the kernel when asked, classifies its end (reading the leaf's OOM
//! counter), removes the leaf and the runtime directory, and only then publishes the
//! [`ExitReason`]: once `wait` returns, nothing is left.

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use tokio::io::unix::AsyncFd;
use tokio::process::Child;
use uuid::Uuid;

use super::keep::{reported_exit, KeptKernels};
use super::output::Tail;
use crate::sandbox::cgroup::{Cgroups, CpuClock, Freezer, Leaf};
use crate::sandbox::exhaustion::{disk_full, explain, Evidence};
use crate::sandbox::fork::ForkOrigin;
use crate::sandbox::fork_server::forked_status;
use crate::sandbox::fsutil::remove_dir_logged;
use crate::sandbox::pidfd;
use crate::sandbox::procfs::{children_of, namespace_pid, zombie_status};
use crate::sandbox::watched::{BackendKernel, ExitPublisher, KernelTable, KernelWatch};
use crate::sandbox::{ExitReason, KernelLimits, SandboxError, SandboxUser};
use crate::sync::lock;

/// What waiters hear if the reaper went away without a word.
pub(super) const LOST: &str = "the broker stopped watching the kernel process (runtime shut down)";

/// What a launch and its reaper share.
pub(super) struct LocalKernel {
    pub watch: KernelWatch,
    /// Host pid of the sandbox's init (pid 1 inside), from bwrap's `--info-fd`; set once
    /// bwrap reports it, shortly after the spawn.
    pub init_pid: OnceLock<i32>,
    /// Host pid of bwrap itself.
    pub bwrap_pid: Option<i32>,
    /// Host pid of a kernel forked from a template (`template.rs`): it has no sandbox of
    /// its own, so it is signalled directly.
    pub kernel_pid: Option<i32>,
    /// The leaf's memory use file (none without cgroups); another leaf's once a held
    /// checkpoint took this one (`checkpoint.rs`).
    pub memory_usage: Mutex<Option<PathBuf>>,
    /// What reads the leaf's CPU time (none without cgroups).
    pub cpu: Mutex<Option<CpuClock>>,
    /// The kernel's leaf, which its reaper removes at its end. A held checkpoint's
    /// (`checkpoint.rs`) is the leaf its parent kernel had when it was taken, given to it
    /// once the parent moved to a new one; the two change under this lock, and a reaper
    /// marks its kernel's slot ended under it before it kills the leaf.
    pub leaf: Arc<tokio::sync::Mutex<LeafSlot>>,
    /// Where this kernel can be forked (a kernel forked from a template, or from a kernel).
    pub fork_origin: Option<ForkOrigin>,
    /// What freezes the leaf (a checkpoint's kernel; none without cgroups).
    pub freezer: Option<Freezer>,
    /// The kernel's own workspace (a session with a workspace of its own): it started
    /// plainly, and its forks are copies into sandboxes of their own (`copy.rs`).
    pub own_workspace: Option<Uuid>,
    /// A kernel restored from a copy (`copy.rs`): its host pid, once woken. The sandbox's
    /// command (pid 2 inside) is then CRIU, which waits for it, not the kernel.
    pub restored_pid: OnceLock<i32>,
}

impl LocalKernel {
    /// The host pid of a forked or a restored kernel (known without asking the sandbox).
    fn own_pid(&self) -> Option<i32> {
        self.kernel_pid.or(self.restored_pid.get().copied())
    }

    /// The kernel's host pid: a forked or restored one's, else the sandbox's command.
    fn kernel_host_pid(&self) -> Option<i32> {
        match self.own_pid() {
            Some(pid) => Some(pid),
            None => sandbox_command_pid(*self.init_pid.get()?),
        }
    }
}

#[async_trait]
impl BackendKernel for LocalKernel {
    fn watch(&self) -> &KernelWatch {
        &self.watch
    }

    fn memory_usage_file(&self) -> Option<PathBuf> {
        lock(&self.memory_usage).clone()
    }

    fn cpu_clock(&self) -> Option<CpuClock> {
        lock(&self.cpu).clone()
    }

    fn fork_origin(&self) -> Option<ForkOrigin> {
        if self.fork_origin.is_some() {
            return self.fork_origin.clone();
        }
        // A plain kernel (not forked from a template: a resumed or restored one, or one
        // started without templates). With a workspace of its own its forks are copies;
        // sharing its user's, it can be paused (`pause.rs`), not forked (`fork.rs`).
        let host_pid = self.kernel_host_pid()?;
        let uids = crate::sandbox::procfs::uids_of(host_pid)?;
        Some(ForkOrigin {
            host_pid,
            uid: Some(uids[0]),
            // No template: nothing to fork beside it in (`fork.rs` refuses).
            dir: PathBuf::new(),
            inside: super::RUN_DIR_INSIDE.to_string(),
            pid_namespace: None,
            kernel: None,
            own_workspace: self.own_workspace,
        })
    }

    fn freezer(&self) -> Option<&Freezer> {
        self.freezer.as_ref()
    }

    /// Its leaf's processes, and the kernel itself: a held checkpoint is adopted before
    /// its leaf is its own (`checkpoint.rs`), and has no freezer of its own then.
    fn continue_stopped(&self) {
        if let Some(freezer) = &self.freezer {
            freezer.continue_all();
        }
        if let Some(pid) = self.own_pid() {
            // SAFETY: kill(2) has no memory-safety preconditions. The pid is the kernel's,
            // which has not been reaped (`has_exited` is checked first by the caller).
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
    }

    /// Waits for a held checkpoint's leaf move (`checkpoint.rs`), which holds the lock.
    async fn settle(&self) {
        drop(self.leaf.lock().await);
    }

    /// The sandbox's init (a plain start: one network namespace per kernel) or the forked
    /// kernel itself (in its template's namespace).
    async fn network_pid(&self) -> Option<i32> {
        if self.watch.has_exited() {
            return None;
        }
        self.init_pid.get().copied().or(self.kernel_pid)
    }

    async fn interrupt(&self) -> Result<(), SandboxError> {
        let no_process = |why: &str| SandboxError::Io {
            what: "cannot interrupt the kernel",
            path: PathBuf::from(format!(
                "/proc/{}",
                self.init_pid.get().copied().unwrap_or(0)
            )),
            source: io::Error::new(io::ErrorKind::NotFound, why.to_string()),
        };
        if self.watch.has_exited() {
            return Err(no_process("the kernel process has exited"));
        }
        let pid = match self.own_pid() {
            Some(pid) => pid,
            None => {
                let init = *self
                    .init_pid
                    .get()
                    .ok_or_else(|| no_process("the sandbox's init pid is unknown"))?;
                sandbox_command_pid(init)
                    .ok_or_else(|| no_process("the kernel process is not running"))?
            }
        };
        // Only the kernel: its process group also holds the sandbox's init, which must not
        // see the signal. And to its main thread (tgkill): a signal sent to the process goes
        // to any thread that does not block it, and one handled by another thread (a thread
        // just starting, before it blocks SIGINT) sets Python's flag without waking the main
        // thread from the system call a cell sleeps in: the cell would sleep on (seen once in
        // CI, `interrupt_stops_a_long_sleep`). The main thread's id is the process's.
        // SAFETY: tgkill(2) has no memory-safety preconditions.
        if unsafe { libc::syscall(libc::SYS_tgkill, pid, pid, libc::SIGINT) } != 0 {
            return Err(SandboxError::Io {
                what: "cannot send SIGINT to the kernel",
                path: PathBuf::from(format!("/proc/{pid}")),
                source: io::Error::last_os_error(),
            });
        }
        tracing::debug!(session = %self.watch.session_id, pid, "sent SIGINT to the kernel");
        Ok(())
    }
}

/// The bwrap process a reaper waits for.
pub(super) enum Watched {
    /// Launched by this run: its child, reaped with `waitpid`.
    Child(Child),
    /// Launched by an earlier run and adopted (`--keep-sessions`): not this process's
    /// child, so its end is seen through a pidfd and its exit status read from bwrap's
    /// status file.
    Adopted {
        pidfd: AsyncFd<std::os::fd::OwnedFd>,
        status: PathBuf,
    },
    /// Kept by an earlier run but ended before this one adopted it.
    Gone { status: PathBuf },
    /// Forked from a template (`template.rs`): the template's child, seen ending through a
    /// pidfd; the template reports the raw wait status once it has reaped it.
    Forked {
        pidfd: AsyncFd<std::os::fd::OwnedFd>,
        status: tokio::sync::oneshot::Receiver<i32>,
    },
    /// Forked from a live kernel (`fork.rs`): that kernel's child, which it reaps (or the
    /// sandbox's init once it has ended). Seen ending through a pidfd; its status is read
    /// while it is a zombie, if it still is one then.
    ForkOfKernel {
        pidfd: AsyncFd<std::os::fd::OwnedFd>,
        pid: i32,
    },
}

impl Watched {
    async fn wait(&mut self) -> io::Result<ExitStatus> {
        let status = match self {
            Watched::Child(child) => return child.wait().await,
            Watched::Adopted { pidfd, status } => {
                // Readable once the process has ended.
                let _ready = pidfd.readable().await?;
                status
            }
            Watched::Gone { status } => status,
            Watched::Forked { pidfd, status } => return forked_status(pidfd, status).await,
            Watched::ForkOfKernel { pidfd, pid } => {
                let _ready = pidfd.readable().await?;
                let raw = zombie_status(*pid);
                // Read while not reaped (its pidfd still names an unreaped process), the
                // status was this process's, not a reuse of its pid's.
                return match raw.filter(|_| pidfd::exists(pidfd.get_ref())) {
                    Some(raw) => Ok(ExitStatus::from_raw(raw)),
                    None => Err(io::Error::other(
                        "its exit status is unknown (the kernel it was forked from reaped it)",
                    )),
                };
            }
        };
        reported_exit(status)
            .ok_or_else(|| io::Error::other("its exit status is unknown (bwrap reported none)"))
    }
}

/// A kernel to hand to its reaper, however it came: started in its own sandbox
/// (`process.rs`), forked from a template (`template/`) or adopted (`adopt.rs`).
pub(super) struct Reaped {
    pub session: Uuid,
    pub user: String,
    pub process: Watched,
    /// The sandbox's init, when it is known now (an adopted kernel); a started one sets it
    /// once bwrap reports it.
    pub init_pid: Option<i32>,
    pub bwrap_pid: Option<i32>,
    pub kernel_pid: Option<i32>,
    pub leaf: Option<Leaf>,
    pub cgroups: Option<Arc<Cgroups>>,
    pub rundir: PathBuf,
    pub limits: KernelLimits,
    pub workspace: PathBuf,
    pub quota_bytes: u64,
    pub tail: Tail,
    pub kept: Option<Arc<KeptKernels>>,
    pub fork_origin: Option<ForkOrigin>,
    /// The own workspace the kernel works in, if it has one.
    pub own_workspace: Option<Uuid>,
}

impl Reaped {
    /// A kernel of `user`'s for `session`, watched through `process`, its runtime directory
    /// `rundir`, working in `workspace`: nothing else known of it yet (no pids, leaf,
    /// cgroups, kept record or fork origin; an empty tail).
    pub fn new(
        session: Uuid,
        user: &SandboxUser,
        process: Watched,
        rundir: PathBuf,
        limits: KernelLimits,
        workspace: PathBuf,
    ) -> Self {
        Self {
            session,
            user: user.name.clone(),
            process,
            init_pid: None,
            bwrap_pid: None,
            kernel_pid: None,
            leaf: None,
            cgroups: None,
            rundir,
            limits,
            workspace,
            quota_bytes: user.limits.workspace_quota_bytes,
            tail: Tail::default(),
            kept: None,
            fork_origin: None,
            own_workspace: None,
        }
    }

    /// Registers the kernel in `table` and spawns its reaper, which owns the leaf and the
    /// runtime directory from now on. Returns what a handle and the launch share.
    pub fn spawn(self, table: &KernelTable<LocalKernel>) -> Arc<LocalKernel> {
        let (watch, exit) = KernelWatch::new(self.session, self.user, LOST);
        let init_pid = OnceLock::new();
        if let Some(pid) = self.init_pid {
            let _ = init_pid.set(pid);
        }
        let kernel = Arc::new(LocalKernel {
            watch,
            init_pid,
            bwrap_pid: self.bwrap_pid,
            kernel_pid: self.kernel_pid,
            memory_usage: Mutex::new(self.leaf.as_ref().and_then(Leaf::memory_usage_file)),
            cpu: Mutex::new(self.leaf.as_ref().map(Leaf::cpu_clock)),
            fork_origin: self.fork_origin,
            freezer: self.leaf.as_ref().map(Leaf::freezer),
            own_workspace: self.own_workspace,
            restored_pid: OnceLock::new(),
            leaf: Arc::new(tokio::sync::Mutex::new(LeafSlot {
                leaf: self.leaf,
                ended: false,
            })),
        });
        let reaper = Reaper {
            process: self.process,
            kernel: kernel.clone(),
            exit,
            cgroups: self.cgroups,
            rundir: self.rundir,
            limits: self.limits,
            workspace: self.workspace,
            quota_bytes: self.quota_bytes,
            table: table.clone(),
            tail: self.tail,
            kept: self.kept,
        };
        table.insert(self.session, kernel.clone());
        tokio::spawn(reaper.run());
        kernel
    }
}

/// Owns the bwrap child: waits for it (or kills it), classifies the exit, cleans up.
struct Reaper {
    pub process: Watched,
    pub kernel: Arc<LocalKernel>,
    pub exit: ExitPublisher,
    pub cgroups: Option<Arc<Cgroups>>,
    pub rundir: PathBuf,
    /// The kernel's own limits (its leaf's).
    pub limits: KernelLimits,
    /// The user's workspace and its quota, to tell a full disk.
    pub workspace: PathBuf,
    pub quota_bytes: u64,
    pub table: KernelTable<LocalKernel>,
    pub tail: Tail,
    /// The kept kernels' files (`--keep-sessions`): forgotten once this kernel has ended.
    pub kept: Option<Arc<KeptKernels>>,
}

impl Reaper {
    async fn run(mut self) {
        let status = tokio::select! {
            status = self.process.wait() => status,
            () = self.kernel.watch.kill_requested() => {
                let slot = self.kernel.leaf.clone();
                let mut slot = slot.lock().await;
                slot.ended = true;
                kill_sandbox(
                    slot.leaf.as_ref(),
                    [self.kernel.init_pid.get().copied(), self.kernel.bwrap_pid, self.kernel.own_pid()],
                )
                .await;
                drop(slot);
                self.process.wait().await
            }
            () = self.kernel.watch.release_requested() => {
                // The broker stops and the kernel outlives it: leave everything as it is
                // (the leaf, the runtime directory, the kept files) for the next run.
                tracing::debug!(session = %self.kernel.watch.session_id, "kernel released");
                return;
            }
        };
        // From here the leaf is this reaper's alone: no checkpoint takes it any more.
        let leaf = {
            let mut slot = self.kernel.leaf.lock().await;
            slot.ended = true;
            slot.leaf.take()
        };
        let oom_kills = leaf.as_ref().and_then(Leaf::oom_kills).unwrap_or(0);
        // A fork of a kernel whose status is unknown: its leaf's OOM kill tells one end.
        let status = match status {
            Err(_) if oom_kills > 0 => Ok(ExitStatus::from_raw(libc::SIGKILL)),
            status => status,
        };
        let terminating = self.kernel.watch.terminating();
        let reason = classify_exit(status, terminating, oom_kills, self.limits.memory_bytes);
        let evidence = Evidence {
            reached_memory_limit: leaf.as_ref().is_none_or(|l| l.reached_memory_limit()),
            pids_refused: leaf.as_ref().map_or(0, Leaf::pids_refused),
            disk_full: self.quota_bytes > 0 && disk_full(&self.workspace),
        };
        let reason = explain(reason, evidence, &self.limits, self.quota_bytes);
        let session = self.kernel.watch.session_id;
        match &reason {
            ExitReason::Terminated | ExitReason::Exited(0) => {
                tracing::info!(%session, %reason, "kernel process ended");
            }
            _ => {
                let tail = self.tail.lines();
                if tail.is_empty() {
                    tracing::warn!(%session, %reason, "kernel process ended");
                } else {
                    tracing::warn!(%session, %reason, last_stderr = %tail.join(" | "), "kernel process ended");
                }
            }
        }

        if let (Some(cgroups), Some(leaf)) = (&self.cgroups, &leaf) {
            cgroups.remove_leaf(leaf).await;
        }
        remove_dir_logged(self.rundir.clone()).await;
        if let Some(kept) = self.kept.take() {
            let _ = tokio::task::spawn_blocking(move || kept.forget(session)).await;
        }
        self.table.remove(&session);
        self.exit.publish(reason);
    }
}

/// A kernel's leaf, and whether its reaper has begun its end (then nothing else may
/// change it).
pub(super) struct LeafSlot {
    pub leaf: Option<Leaf>,
    pub ended: bool,
}

/// SIGKILLs everything of one kernel: the whole leaf when there is one; otherwise the
/// sandbox's init (the pid namespace dies with it) and bwrap, or the forked kernel.
async fn kill_sandbox(leaf: Option<&Leaf>, pids: [Option<i32>; 3]) {
    for pid in pids.into_iter().flatten() {
        if pid > 0 {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    if let Some(leaf) = leaf {
        leaf.kill_all().await;
    }
}

/// Turns bwrap's exit status into an [`ExitReason`].
fn classify_exit(
    status: io::Result<ExitStatus>,
    terminating: bool,
    oom_kills: u64,
    memory_limit: u64,
) -> ExitReason {
    if terminating {
        return ExitReason::Terminated;
    }
    let status = match status {
        Ok(status) => status,
        Err(e) => return ExitReason::Lost(format!("waiting for the kernel process failed: {e}")),
    };
    // bwrap reports a command killed by signal N as exit code 128 + N.
    let signal = status.signal().or_else(|| {
        status
            .code()
            .filter(|c| (129..=128 + 64).contains(c))
            .map(|c| c - 128)
    });
    match signal {
        Some(libc::SIGKILL) if oom_kills > 0 => ExitReason::OutOfMemory {
            limit_bytes: memory_limit,
        },
        Some(sig) => ExitReason::Signaled(sig),
        None => ExitReason::Exited(status.code().unwrap_or(-1)),
    }
}

/// The host pid of the sandboxed command: the child of the sandbox's init that is pid 2 in
/// the sandbox (init may also have adopted orphans).
pub(super) fn sandbox_command_pid(init_pid: i32) -> Option<i32> {
    let children = children_of(init_pid);
    children
        .iter()
        .copied()
        .find(|pid| namespace_pid(*pid) == Some(2))
        .or_else(|| children.first().copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_map_to_reasons() {
        let exited = |code: i32| Ok(ExitStatus::from_raw(code << 8));
        let killed = |sig: i32| Ok(ExitStatus::from_raw(sig));
        assert_eq!(classify_exit(exited(0), false, 0, 1), ExitReason::Exited(0));
        assert_eq!(classify_exit(exited(3), false, 0, 1), ExitReason::Exited(3));
        // bwrap's 128 + N convention.
        assert_eq!(
            classify_exit(exited(137), false, 0, 1),
            ExitReason::Signaled(9)
        );
        assert_eq!(
            classify_exit(exited(130), false, 0, 1),
            ExitReason::Signaled(2)
        );
        assert_eq!(
            classify_exit(exited(137), false, 1, 64 << 20),
            ExitReason::OutOfMemory {
                limit_bytes: 64 << 20
            }
        );
        assert_eq!(
            classify_exit(killed(9), false, 2, 5),
            ExitReason::OutOfMemory { limit_bytes: 5 }
        );
        assert_eq!(
            classify_exit(killed(15), false, 2, 5),
            ExitReason::Signaled(15)
        );
        assert_eq!(classify_exit(killed(9), true, 2, 5), ExitReason::Terminated);
        assert!(matches!(
            classify_exit(Err(io::Error::other("x")), false, 0, 0),
            ExitReason::Lost(_)
        ));
    }
}
