//! Sandbox calls that block (a freezer, `oom_score_adj`) run on tokio's blocking pool;
//! their two ways to fail, as one error.

use crate::sandbox::SandboxError;

/// Why a blocking sandbox call did not succeed.
#[derive(Debug, thiserror::Error)]
pub(super) enum BlockingFailed {
    #[error("{0}")]
    Sandbox(#[from] SandboxError),
    #[error("the blocking task ended early: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Runs `f` on the blocking pool and gives its result, or why it did not run to the end.
pub(super) async fn run_blocking<F>(f: F) -> Result<(), BlockingFailed>
where
    F: FnOnce() -> Result<(), SandboxError> + Send + 'static,
{
    Ok(tokio::task::spawn_blocking(f).await??)
}
