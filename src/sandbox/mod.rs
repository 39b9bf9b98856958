//! The sandbox layer: where kernels run and what they may touch.
//!
//! A [`Sandbox`] launches one kernel process per session inside a user's isolation
//! boundary (namespaces and cgroups for [`local`], a container for `docker`) and hands
//! back a [`KernelProcess`] to interrupt, watch and terminate it. The broker talks to the
//! kernel over ZeroMQ `ipc://` sockets in a runtime directory the sandbox shares with the
//! kernel, so the kernel needs no network at all.
//!
//! Architecture invariant: this layer knows nothing of sessions, HTTP or the Jupyter
//! messages themselves; it only knows processes, users, limits and files. The session layer
//! holds an `Arc<dyn Sandbox>` and never names a backend.

pub mod cgroup;
pub mod docker;
pub(crate) mod fsutil;
pub mod local;
pub mod seccomp;
pub(crate) mod watched;
pub(crate) mod workspace_fs;

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Resource limits applied to everything one user runs (all of that user's kernels together).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UserLimits {
    /// Memory in bytes (RAM; swap is not granted on top).
    pub memory_bytes: u64,
    /// CPU time in cores (1.5 = one and a half cores).
    pub cpus: f64,
    /// Maximum number of processes and threads.
    pub pids: u64,
    /// Size of the user's workspace file system in bytes (writes past it fail with
    /// `ENOSPC`); 0: no quota, a plain directory.
    pub workspace_quota_bytes: u64,
}

impl Default for UserLimits {
    fn default() -> Self {
        Self {
            memory_bytes: 1 << 30,
            cpus: 1.0,
            pids: 256,
            workspace_quota_bytes: 1 << 30,
        }
    }
}

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
        }
    }
}

pub use crate::kernel::KernelEndpoints;

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
    /// Killed by the kernel's OOM killer because the user's memory limit was reached.
    OutOfMemory { limit_bytes: u64 },
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
    async fn shutdown(&self);
    /// How long a launch may take before the broker gives up.
    fn launch_timeout(&self) -> Duration {
        Duration::from_secs(30)
    }
}

/// Errors of the sandbox layer; each message tells the operator what to do.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("the {backend} sandbox is not usable: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("could not launch the kernel for user {user}: {reason}")]
    Launch { user: String, reason: String },
    #[error("{what} at {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cgroup error ({path}): {reason}")]
    Cgroup { path: PathBuf, reason: String },
}
