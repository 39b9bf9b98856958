//! Commands run in a user's sandbox besides its kernels (E2B's `commands.run`): the same
//! isolation as the user's kernels (file system view, uid, no network, syscall filter),
//! under a cgroup leaf of their own with a kernel's limits, so a command can neither see
//! more nor use more than the kernel could. Each backend implements
//! [`Sandbox::run_command`](super::Sandbox::run_command) in its own `command.rs`.

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncWrite};

use super::{KernelLimits, SandboxUser};

/// What to run.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    pub user: SandboxUser,
    /// The program and its arguments, as the sandbox sees them (`["/bin/bash", "-c", "ls"]`).
    pub argv: Vec<String>,
    /// Environment added to the kernels' own.
    pub env: Vec<(String, String)>,
    /// The working directory inside the sandbox (`None`: the workspace).
    pub cwd: Option<String>,
    /// The own workspace the command works in (its sandbox's session id, as
    /// [`LaunchSpec::own_workspace`](super::LaunchSpec::own_workspace)); `None`: the
    /// user's shared workspace.
    pub own_workspace: Option<uuid::Uuid>,
    /// The command's own memory and process limits (its leaf's).
    pub limits: KernelLimits,
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandExit {
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
}

/// The broker's handle on a running command: signals, and its end. Dropping it kills the
/// command (nothing outlives its handle).
#[async_trait]
pub trait CommandControl: Send + Sync {
    /// Delivers `signal` to the command's processes.
    async fn signal(&self, signal: i32);
    /// Kills the command and everything it started, and waits until they are gone.
    async fn kill(&self);
    /// Resolves when the command has ended and what it held is reclaimed; may be awaited
    /// by several tasks, and again after.
    async fn wait(&self) -> CommandExit;
}

/// A started command: its standard streams and its control.
pub struct RunningCommand {
    /// A pid naming the command to clients (the sandbox's, not meaningful on the host).
    pub pid: u32,
    pub stdin: Box<dyn AsyncWrite + Send + Unpin>,
    pub stdout: Box<dyn AsyncRead + Send + Unpin>,
    pub stderr: Box<dyn AsyncRead + Send + Unpin>,
    pub control: std::sync::Arc<dyn CommandControl>,
}
