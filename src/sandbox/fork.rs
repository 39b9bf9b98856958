//! Forking a live kernel (issue 36): what the session layer and a backend exchange.
//!
//! The kernel forks itself (`kernels/kernel_broker_fork.py`, the `kb_fork_request` shell
//! message) into a new kernel listening on ipc sockets the broker names. The sandbox's part
//! is on both sides of that message: before it, [`Sandbox::prepare_fork`] makes the
//! child's runtime directory (inside the parent's sandbox, by descriptor: the kernel can
//! write there) and the connection the request carries; after it,
//! [`Sandbox::adopt_fork`] takes the pid the kernel reported, which is untrusted: it is
//! used only if it is a direct child of the parent kernel's host process, of the kernel's
//! uid, held through a pidfd and checked again after opening it; the child is then moved
//! into a cgroup leaf of its own with the new session's limits and watched through that
//! pidfd like any kernel. Whatever fails, nothing of the child is left.
//!
//! [`Sandbox::prepare_fork`]: super::Sandbox::prepare_fork
//! [`Sandbox::adopt_fork`]: super::Sandbox::adopt_fork

use std::path::PathBuf;

use super::{LaunchSpec, SandboxError};

/// Where a live kernel can be forked: its host process and the directory its forks' runtime
/// directories go in. Known to the backend that launched the kernel; opaque above.
#[derive(Debug, Clone)]
pub struct ForkOrigin {
    /// The kernel's host pid (the process that forks).
    pub(crate) host_pid: i32,
    /// The uid the kernel runs as on the host (`None`: the broker's own, unprivileged).
    pub(crate) uid: Option<u32>,
    /// The host directory the forks' runtime directories are made in (the kernel's fork
    /// root, `KERNEL_BROKER_FORK_ROOT` inside).
    pub(crate) dir: PathBuf,
    /// The same directory as the kernel sees it.
    pub(crate) inside: String,
}

/// A fork about to be asked for: the connection to put in `kb_fork_request`, and what the
/// backend needs to adopt the child or to clean up.
#[derive(Debug)]
pub struct PreparedFork {
    /// The `connection` of the request (ipc transport, the child's socket prefix inside
    /// the sandbox, ports, the new session's key).
    pub connection: serde_json::Value,
    pub(crate) origin: ForkOrigin,
    pub(crate) spec: LaunchSpec,
    /// The child's runtime directory on the host (removed if the fork is given up).
    pub(crate) dir: PathBuf,
}

/// Why a live kernel was not forked.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// This kernel cannot be forked here; the text says why and what would allow it.
    #[error("{0}")]
    Unsupported(String),
    /// The pid the kernel reported is not a process it forked.
    #[error("the kernel reported pid {pid} for its fork, which is not a child it forked: {why}")]
    NotItsChild { pid: i64, why: &'static str },
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}
