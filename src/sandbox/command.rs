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
    /// Run it on a pseudo-terminal of this size (E2B's `pty`): its stdin, stdout and stderr
    /// are the terminal, which is its controlling terminal; the broker holds the master
    /// ([`RunningCommand::stdin`] writes to it, [`RunningCommand::stdout`] reads it, and
    /// stderr is empty). `None`: pipes.
    pub pty: Option<PtySize>,
}

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// Why a command's terminal was not resized.
#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    #[error("the command has no terminal (it was not started with a pty)")]
    NotATerminal,
    #[error("resizing the terminal failed: {0}")]
    Failed(#[source] Box<dyn std::error::Error + Send + Sync>),
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
    /// Sets the size of the command's terminal (its foreground processes get `SIGWINCH`);
    /// a command started without one answers [`ResizeError::NotATerminal`].
    async fn resize(&self, _size: PtySize) -> Result<(), ResizeError> {
        Err(ResizeError::NotATerminal)
    }
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
