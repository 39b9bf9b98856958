//! The sandbox layer: where kernels run and what they may touch.
//!
//! A [`Sandbox`] launches one kernel process per session inside a user's isolation
//! boundary (namespaces and cgroups for [`local`], a container for `docker`) and hands
//! back a [`KernelProcess`] to interrupt, watch and terminate it. The broker talks to the
//! kernel over ZeroMQ `ipc://` sockets in a runtime directory the sandbox shares with the
//! kernel, so the kernel needs no network at all.
//!
//! Layout:
//! - Both backends: `command.rs` (the types of [`Sandbox::run_command`]), `boot.rs` (the
//!   kernel bootstrap script, compiled in; which specs it starts; the preload list),
//!   `environ.rs` (a tenant's environment checked, and written for the kernel to read after
//!   the privilege drop), `watched.rs` (the one kernel handle: a watcher task owns the
//!   process, kills it on request, cleans up, then publishes the `ExitReason`),
//!   `fork_server/` (the fork-server template protocol's client, the host pid of a
//!   template's child, a forked kernel's end), `pidfd.rs` and `procfs.rs` (process handles
//!   and readings), `cgroup/` (the user's totals and a leaf per kernel with its own memory
//!   and pids limits, v1 and v2; `nested.rs`: the same inside a container's cgroup),
//!   `exhaustion.rs` (which resource ended a kernel), `seccomp.rs` (the syscall filter),
//!   `egress.rs` and `netns.rs` (a user's network policy: proxy variables and a listener in
//!   the kernel's network namespace), `fsutil/` (root's file operations, by descriptor where
//!   a kernel can write), `workspace_fs.rs` (a workspace is its own ext4 file system of the
//!   user's quota), `template_slots.rs`, `fork.rs` (what forking a live kernel exchanges
//!   between the session layer and a backend).
//! - [`local`]: each kernel under bubblewrap (pid, net, ipc, uts, mount namespaces; only
//!   `lo`), dropped by setpriv to a per-user uid: `bwrap.rs` (the argv and mount plan, pure),
//!   `python.rs` (the kernels' Python at neutral paths), `files.rs` (runtime directory,
//!   connection file), `process.rs` (spawn into the cgroup leaf), `reaper.rs` (exit and
//!   cleanup), `template/` (fork-server templates and, on cgroup v1, stems forked ahead of
//!   need), `keep.rs` and `adopt.rs` (`--keep-sessions`), `fork.rs` (a live kernel's fork
//!   adopted), `command.rs`, `check.rs`, `host.rs`.
//! - `docker`: one container per user, a kernel an exec under its own `tini -s`:
//!   `container.rs` (the container's spec and lifecycle), `limits.rs` (the check that its
//!   cgroup enforces what was asked), `exec.rs` (the kernel's exec and its exit status),
//!   `running.rs` (what the daemon says of a container or exec), `place.rs` (a process moved
//!   into its own leaf), `reaper.rs` (nothing outlives its session), `template.rs`,
//!   `watch.rs` (exec poller, OOM attribution), `daemon.rs`, `engine.rs` (Docker or
//!   Podman), `keep/` (`--keep-sessions`).
//!
//! Architecture invariant: this layer knows nothing of sessions, HTTP or the Jupyter
//! messages themselves; it only knows processes, users, limits and files. The session layer
//! holds an `Arc<dyn Sandbox>` and never names a backend.

pub mod boot;
pub mod carry;
pub mod cgroup;
pub mod command;
pub(crate) mod criu;
pub mod docker;
pub mod egress;
pub mod environ;
pub mod exhaustion;
pub mod fork;
pub(crate) mod fork_server;
pub(crate) mod fsutil;
pub mod held;
pub mod launch_error;
mod limits;
pub mod local;
mod log_filter;
mod loop_release;
pub(crate) mod netns;
pub(crate) mod own_workspace;
pub mod pause;
pub(crate) mod pidfd;
#[cfg(test)]
mod privileged_fs_tests;
pub(crate) mod procfs;
pub mod seccomp;
pub(crate) mod sudo;
pub(crate) mod template_slots;
pub(crate) mod watched;
pub(crate) mod workspace_fs;

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

pub use limits::{
    runtime_env, thread_env, KernelLimits, UserLimits, DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_MEMORY, DEFAULT_SESSION_PIDS, KERNEL_BASE_MEMORY, KERNEL_OOM_SCORE_ADJ,
    PROCESS_MEMORY,
};
pub use log_filter::LogFilter;

/// Who a kernel runs for.
#[derive(Debug, Clone)]
pub struct SandboxUser {
    /// The broker user's name (from the users file); safe as a path component
    /// (validated by config: `[A-Za-z0-9_.-]+`).
    pub name: String,
    /// Stable small index of the user (order in the users file); backends derive a host
    /// uid from it where they need one.
    pub index: u32,
    pub limits: UserLimits,
}

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub session_id: Uuid,
    pub user: SandboxUser,
    /// Kernel spec name, e.g. `python3`.
    pub kernel_name: String,
    /// HMAC key for the connection file (hex string), fresh per kernel.
    pub key: String,
    /// Extra environment for the kernel process.
    pub env: Vec<(String, String)>,
    /// The kernel's own memory and process limits.
    pub limits: KernelLimits,
    /// The own workspace this kernel works in, named by the session that owns it (an E2B
    /// sandbox's contexts use their sandbox's); `None`: the user's shared workspace.
    pub own_workspace: Option<Uuid>,
}

#[cfg(test)]
impl LaunchSpec {
    /// A spec for user `u` (index 0, default limits) with key `abc`, for unit tests.
    pub(crate) fn example() -> Self {
        Self {
            session_id: Uuid::nil(),
            user: SandboxUser {
                name: "u".into(),
                index: 0,
                limits: Default::default(),
            },
            kernel_name: "python3".into(),
            key: "abc".into(),
            env: vec![],
            limits: UserLimits::default().kernel(None),
            own_workspace: None,
        }
    }
}

pub use crate::kernel::KernelEndpoints;
pub use launch_error::{LaunchRefusal, StepFailed};
/// The login name of a sandbox with a workspace of its own (E2B's sandbox user).
pub use own_workspace::LOGIN as OWN_WORKSPACE_LOGIN;

/// What adopting a kernel an earlier run of the broker kept (`--keep-sessions`) needs: the
/// session it serves, its user and its limits, as the session layer recorded them.
#[derive(Debug, Clone)]
pub struct AdoptSpec {
    pub session_id: Uuid,
    pub user: SandboxUser,
    pub limits: KernelLimits,
    /// The workspace of its own the session's kernel works in, as its record says (the
    /// local sandbox's tickets do not say; Docker's do, by container).
    pub own_workspace: Option<Uuid>,
}

/// Why a kept kernel was not adopted.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The kernel ended while no broker watched it; what it held is reclaimed.
    #[error("{0}")]
    Ended(ExitReason),
    /// The sandbox kept no kernel for this session (or it is not this sandbox's).
    #[error("no kernel was kept for this session")]
    Missing,
    #[error(transparent)]
    Failed(#[from] SandboxError),
}

/// A running kernel and the means to reach it.
pub struct Launched {
    pub endpoints: KernelEndpoints,
    pub process: Box<dyn KernelProcess>,
}

/// Why a kernel process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// Exited by itself with this code.
    Exited(i32),
    /// Killed by this signal (not by the memory limit).
    Signaled(i32),
    /// Killed by the kernel's OOM killer because the kernel's memory limit was reached.
    OutOfMemory { limit_bytes: u64 },
    /// Killed by the OOM killer of the host, which ran out of memory as a whole while this
    /// kernel was within its limit.
    HostOutOfMemory { limit_bytes: u64 },
    /// Ended on an error after its process and thread limit was reached (a thread or a
    /// process it needed could not be created).
    OutOfPids { limit: u64, exit: Box<ExitReason> },
    /// Ended on an error while its user's workspace was full.
    DiskFull {
        quota_bytes: u64,
        exit: Box<ExitReason>,
    },
    /// Terminated on the broker's request.
    Terminated,
    /// The sandbox lost track of it (container removed, daemon gone); the text says what happened.
    Lost(String),
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitReason::Exited(code) => write!(f, "the kernel process exited with code {code}"),
            ExitReason::Signaled(sig) => write!(f, "the kernel process was killed by signal {sig}"),
            ExitReason::OutOfMemory { limit_bytes } => write!(
                f,
                "the kernel was killed because it ran out of memory (limit {} MiB)",
                limit_bytes >> 20
            ),
            ExitReason::HostOutOfMemory { limit_bytes } => write!(
                f,
                "the kernel was killed because the host ran out of memory (the kernel was \
                 within its own limit of {} MiB)",
                limit_bytes >> 20
            ),
            ExitReason::OutOfPids { limit, exit } => write!(
                f,
                "{exit}: it reached its limit of {limit} processes and threads (pids)"
            ),
            ExitReason::DiskFull { quota_bytes, exit } => write!(
                f,
                "{exit}: the workspace is full (disk quota {} MiB)",
                quota_bytes >> 20
            ),
            ExitReason::Terminated => write!(f, "the kernel was shut down"),
            ExitReason::Lost(why) => write!(f, "the kernel was lost: {why}"),
        }
    }
}

/// A kernel process inside a sandbox. Dropping it without `terminate` must still not leak
/// the process (backends kill on drop as a last resort).
#[async_trait]
pub trait KernelProcess: Send + Sync {
    /// Deliver SIGINT to the kernel (the fallback when an `interrupt_request` is not answered).
    async fn interrupt(&self) -> Result<(), SandboxError>;
    /// Resolves when the process has ended; may be awaited by several tasks, and again
    /// after it resolved (it then returns the same reason at once).
    async fn wait(&self) -> ExitReason;
    /// Kill the kernel and everything it started, and reclaim what the launch created
    /// (cgroup, runtime directory). Idempotent.
    async fn terminate(&self);
    /// Memory the kernel uses now, in bytes, as its cgroup counts it (what its limit is
    /// compared with); `None` when the backend cannot tell or the kernel has ended.
    fn memory_used(&self) -> Option<u64> {
        None
    }
    /// CPU time the kernel's processes have used, in nanoseconds, as its cgroup leaf counts
    /// it (`cgroup::CpuClock`); `None` when the backend cannot tell or the kernel has ended.
    fn cpu_time_ns(&self) -> Option<u64> {
        None
    }
    /// Lets go of the kernel without ending it: the broker is stopping with
    /// `--keep-sessions`, and the next run adopts it ([`Sandbox::adopt`]). The watcher stops
    /// watching; nothing is killed or removed, and a later drop of the handle kills nothing.
    fn release(&self) {}
    /// A host process in the kernel's network namespace, where the egress proxy's listener
    /// is opened (`egress.rs`); `None` when the backend cannot tell.
    async fn network_pid(&self) -> Option<i32> {
        None
    }
    /// The kernel serves `session` from now on (a pooled kernel handed to a session), so
    /// what it does is attributed to that session.
    fn serves(&self, _session: Uuid) {}
    /// The id the sandbox launched (and keeps) this kernel under: its session's, or, for a
    /// kernel a resume or a rewind made, a kernel id of its own (`None`: not known).
    fn kernel_id(&self) -> Option<Uuid> {
        None
    }
    /// Where this kernel can be forked (`fork.rs`); `None`: it cannot be.
    fn fork_origin(&self) -> Option<fork::ForkOrigin> {
        None
    }
    /// Holds the kernel as a checkpoint (`true`: every process of its leaf frozen and
    /// the OOM killer's first choice, `oom_score_adj` 1000) or lets it run again (`false`,
    /// its `oom_score_adj` kept). Blocking (a few writes to the cgroup file system).
    fn hold_as_checkpoint(&self, _hold: bool) -> Result<(), SandboxError> {
        Err(SandboxError::Unsupported("this kernel cannot be frozen"))
    }
    /// Whether [`Self::hold_as_checkpoint`] can work for this kernel: asked before a
    /// checkpoint forks it, so a kernel whose copy could not be frozen is refused whole.
    fn can_hold_as_checkpoint(&self) -> bool {
        false
    }
    /// Waits until nothing of the sandbox's is still moving this kernel between cgroup
    /// leaves (a held checkpoint's, `held.rs`, gives its leaf to the checkpoint in the
    /// background): asked before the kernel is forked, so a fork starts where it belongs.
    async fn settle(&self) {}
    /// Makes the kernel an ordinary live one for the OOM killer again (`oom_score_adj`
    /// [`KERNEL_OOM_SCORE_ADJ`]): a kernel forked from a checkpoint inherits the
    /// checkpoint's 1000.
    fn set_live_oom_score(&self) -> Result<(), SandboxError> {
        Ok(())
    }
    /// Sends SIGCONT to the kernel and every process of its leaf: a checkpoint asked to
    /// fork, and a spare made live, are sent it, undoing any SIGSTOP a kernel of their
    /// session sent them (the live kernel's child, or parent, of the same uid), so a
    /// stopped checkpoint answers instead of leaving the rewind to wait out its bound.
    /// Blocking (reads the leaf's `cgroup.procs`); harmless to a process that is not
    /// stopped.
    fn continue_stopped(&self) {}
}

/// A place where kernels run.
#[async_trait]
pub trait Sandbox: Send + Sync {
    /// `local` or `docker`.
    fn name(&self) -> &'static str;
    /// Check the backend can work at all (binaries present, cgroups writable, daemon up);
    /// the error tells the operator what to do.
    async fn check(&self) -> Result<(), SandboxError>;
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, SandboxError>;
    /// The host directory holding this user's persistent workspace (created if missing).
    fn workspace(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError>;
    /// The host directory of the own workspace `key` (a session's id, see
    /// [`LaunchSpec::own_workspace`]) as its kernels see it at `/home/user` and
    /// `/workspace`: the one its session's launch made (an error once it is removed);
    /// `None`: this backend has no own workspaces, and such sessions work in the user's
    /// shared one.
    fn own_workspace(
        &self,
        _user: &SandboxUser,
        _key: Uuid,
    ) -> Result<Option<PathBuf>, SandboxError> {
        Ok(None)
    }
    /// Removes the own workspace `key` and all in it (its session ended); nothing of its
    /// kernels may run any more. Removing one that does not exist is no error.
    async fn remove_own_workspace(&self, _user: &SandboxUser, _key: Uuid) {}
    /// The host uid and gid that own files in this user's workspace (what the kernel runs
    /// as), so files the broker writes there stay writable by the kernel. `None`: leave
    /// ownership as it falls.
    fn workspace_owner(&self, _user: &SandboxUser) -> Option<(u32, u32)> {
        None
    }
    /// Called when a user has no live session any more (backends may release per-user
    /// resources after their own grace period).
    async fn user_idle(&self, _user: &SandboxUser) {}
    /// Reclaim everything on broker shutdown, and what an earlier run left behind on start.
    /// A sandbox that keeps kernels ([`Self::keeps_kernels`]) instead releases its kernels
    /// and leaves what they hold (cgroups, runtime directories, mounts, containers) for the
    /// next run to adopt.
    async fn shutdown(&self);
    /// Whether kernels outlive the broker process (`--keep-sessions`): launched so that they
    /// survive its end, kill -9 included, and kept at its shutdown.
    fn keeps_kernels(&self) -> bool {
        false
    }
    /// Adopts the kernel an earlier run kept for `spec.session_id`: watched, limited and
    /// reachable again as if launched by this run (the key is the session layer's to keep).
    /// A kernel that ended meanwhile is [`AdoptError::Ended`], with what it held reclaimed.
    async fn adopt(&self, _spec: AdoptSpec) -> Result<Launched, AdoptError> {
        Err(AdoptError::Missing)
    }
    /// Called once after every session was offered for adoption: ends the kept kernels no
    /// session adopted and reclaims what they held.
    async fn discard_unadopted(&self) {}
    /// Prepares forking the live kernel `parent` into a kernel for `spec` (`fork.rs`): the
    /// child's runtime directory and the connection its `kb_fork_request` names. A backend
    /// or a kernel that cannot be forked is [`fork::ForkError::Unsupported`].
    async fn prepare_fork(
        &self,
        _parent: &dyn KernelProcess,
        _spec: LaunchSpec,
    ) -> Result<fork::PreparedFork, fork::ForkError> {
        Err(fork::ForkError::Unsupported(format!(
            "the {} sandbox cannot fork a live kernel; the local and docker sandboxes can",
            self.name()
        )))
    }
    /// Adopts the child the parent kernel reported (`pid`, in the kernel's pid namespace,
    /// untrusted): checked to be the parent's direct child of its uid, moved into a cgroup
    /// leaf of its own with the spec's limits, watched. On error nothing of it is left.
    async fn adopt_fork(
        &self,
        prepared: fork::PreparedFork,
        pid: i64,
    ) -> Result<Launched, fork::ForkError> {
        self.discard_fork(prepared).await;
        Err(fork::ForkError::NotItsChild {
            pid,
            why: "this sandbox does not fork kernels",
        })
    }
    /// Prepares a held checkpoint of the live kernel `parent` (`held.rs`): the kernel's
    /// child will be held, waiting on a control socket of the broker's, which the request
    /// (`{"hold": {"control": ...}}`) names. [`fork::ForkError::Unsupported`] where the
    /// backend keeps frozen copies instead (the session layer then takes one of those).
    async fn prepare_checkpoint(
        &self,
        _parent: &dyn KernelProcess,
        _spec: LaunchSpec,
    ) -> Result<fork::PreparedFork, fork::ForkError> {
        Err(fork::ForkError::Unsupported(format!(
            "the {} sandbox keeps no held checkpoints",
            self.name()
        )))
    }
    /// Adopts the held child the parent kernel reported (`pid`, untrusted, checked as a
    /// fork's), once it is connected to its control socket: watched, the OOM killer's first
    /// choice, and given the leaf its parent had (the parent moves to a new one, so the
    /// pages the parent rewrites later stay charged to the checkpoint). On error nothing
    /// of it is left.
    async fn adopt_checkpoint(
        &self,
        prepared: fork::PreparedFork,
        pid: i64,
    ) -> Result<fork::HeldCheckpoint, fork::ForkError> {
        self.discard_fork(prepared).await;
        Err(fork::ForkError::NotItsChild {
            pid,
            why: "this sandbox keeps no held checkpoints",
        })
    }
    /// Gives a prepared fork up (the kernel refused it or never answered): its runtime
    /// directory goes.
    async fn discard_fork(&self, _prepared: fork::PreparedFork) {}
    /// Prepares pausing the live kernel `kernel` to disk (`pause.rs`): the directory its
    /// images go in and the `kb_fork_request` for its held child. `spec` is the session's,
    /// under a new kernel id. A backend or a kernel that cannot be paused is
    /// [`fork::ForkError::Unsupported`].
    async fn prepare_pause(
        &self,
        _kernel: &dyn KernelProcess,
        _spec: LaunchSpec,
    ) -> Result<fork::PreparedFork, fork::ForkError> {
        Err(fork::ForkError::Unsupported(format!(
            "the {} sandbox cannot pause a kernel to disk yet; the local sandbox can, as root \
             with CRIU 4",
            self.name()
        )))
    }
    /// Dumps the held child `pid` the kernel reported for `prepared` (untrusted, checked as
    /// a fork's) into its images; on error nothing of them is left.
    async fn dump_paused(
        &self,
        prepared: fork::PreparedFork,
        pid: i64,
    ) -> Result<pause::PausedImage, fork::ForkError> {
        self.discard_fork(prepared).await;
        Err(fork::ForkError::NotItsChild {
            pid,
            why: "this sandbox does not pause kernels",
        })
    }
    /// Restores the kernel `image` holds into a new sandbox for `spec` (the session's,
    /// under a new kernel id), woken and building its kernel. The images stay until
    /// [`Sandbox::discard_paused`].
    async fn resume_paused(
        &self,
        _image: &pause::PausedImage,
        _spec: LaunchSpec,
    ) -> Result<Launched, fork::ForkError> {
        Err(fork::ForkError::Unsupported(format!(
            "the {} sandbox cannot resume a paused kernel",
            self.name()
        )))
    }
    /// Whether paused kernels outlive the broker here (their images are kept at a stop and
    /// found again by [`Sandbox::paused_images`]).
    fn keeps_paused(&self) -> bool {
        false
    }
    /// Whether a paused kernel may end (and [`Sandbox::release_paused`] run) after the
    /// pause is answered, beside a resume: where the kernel restored has a kernel id,
    /// runtime directory and leaf of its own and shares nothing with the paused one but
    /// the session's workspace (which the paused kernel, killed, no longer writes) and
    /// memory (which the resume's admission waits for when it must). Not where a pause
    /// lets a container go once no kernel runs in it (Docker: a resume of one E2B
    /// context could take the container another context's end is removing).
    fn paused_kernel_ends_after_answer(&self) -> bool {
        false
    }
    /// The paused kernels an earlier run left with their records (each once: the first call
    /// takes them); whoever takes one resumes or discards it.
    async fn paused_images(&self) -> Vec<pause::PausedImage> {
        Vec::new()
    }
    /// The paused kernel of a session with the own workspace `key` has ended: what the
    /// sandbox held for that session alone may go until its resume (the Docker sandbox's
    /// container of its own; the workspace stays).
    async fn release_paused(&self, _user: &SandboxUser, _key: Uuid) {}
    /// How this sandbox's paused kernels are carried to other nodes (`carry.rs`), if it can.
    fn carry(&self) -> Option<&dyn carry::SandboxCarry> {
        None
    }
    /// Removes a paused kernel's images.
    async fn discard_paused(&self, image: pause::PausedImage) {
        fsutil::remove_dir_logged(image.dir).await;
    }
    /// Prepares a snapshot of the live kernel `kernel` (`snapshot.rs`): the snapshot's own
    /// workspace (`spec.own_workspace`) made, a copy of the kernel's, and the directory its
    /// images go in; the `kb_fork_request` for the held child that [`Sandbox::dump_paused`]
    /// then dumps. The kernel goes on as it was.
    async fn prepare_snapshot(
        &self,
        _kernel: &dyn KernelProcess,
        _spec: LaunchSpec,
    ) -> Result<fork::PreparedFork, fork::ForkError> {
        Err(fork::ForkError::Unsupported(format!(
            "the {} sandbox cannot snapshot a kernel yet; the local sandbox can, as root with \
             CRIU 4",
            self.name()
        )))
    }
    /// A new kernel for `spec` (a session with a workspace of its own) from the snapshot
    /// `image`: its workspace a copy of the snapshot's, the images restored into a new
    /// sandbox and woken. The snapshot stays as it is; on error nothing of the new kernel
    /// is left.
    async fn start_from_snapshot(
        &self,
        _image: &pause::PausedImage,
        _spec: LaunchSpec,
    ) -> Result<Launched, fork::ForkError> {
        Err(fork::ForkError::Unsupported(format!(
            "the {} sandbox cannot start a kernel from a snapshot",
            self.name()
        )))
    }
    /// The snapshots an earlier run left with their records (each once: the first call
    /// takes them); whoever takes one keeps or discards it.
    async fn snapshot_images(&self) -> Vec<pause::PausedImage> {
        Vec::new()
    }
    /// Removes a snapshot: its images and its copy of the workspace.
    async fn discard_snapshot(&self, image: pause::PausedImage) {
        fsutil::remove_dir_logged(image.dir).await;
    }
    /// How long a launch may take before the broker gives up.
    fn launch_timeout(&self) -> Duration {
        Duration::from_secs(30)
    }
    /// Runs a command in the user's sandbox, isolated and limited as the user's kernels
    /// are (`command.rs`).
    async fn run_command(
        &self,
        spec: command::CommandSpec,
    ) -> Result<command::RunningCommand, SandboxError> {
        Err(SandboxError::Launch {
            user: spec.user.name,
            reason: LaunchRefusal::CannotRun {
                backend: self.name(),
                what: "commands",
            },
        })
    }
}

/// Errors of the sandbox layer; each message tells the operator what to do.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The backend cannot work here. `reason` is the sentence for the operator (what is
    /// missing, what to do), which already tells the cause's text; the cause itself, when
    /// an error of its own, is kept as the source.
    #[error("the {backend} sandbox is not usable: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    #[error("could not launch the kernel for user {user}: {reason}")]
    Launch { user: String, reason: LaunchRefusal },
    /// A launch step failed with an error of its own, kept as the source.
    #[error("could not launch the kernel for user {user}: {source}")]
    LaunchFailed {
        user: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{what} at {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `reason` tells what failed (with the cause's text); the cause, when an error of its
    /// own, is kept as the source.
    #[error("cgroup error ({path}): {reason}")]
    Cgroup {
        path: PathBuf,
        reason: String,
        #[source]
        source: Option<std::io::Error>,
    },
    /// The kernel cannot do what was asked here (`what`).
    #[error("{0}")]
    Unsupported(&'static str),
}
