//! A command run in a session's sandbox beside its kernel (E2B's `process.Process/Start`):
//! isolated and limited as the session's kernels are, as the session's user, with the
//! session's kernel limits. The api layer asks for it here and never names the sandbox.

use super::error::SessionError;
use super::handle::Session;
use super::registry::Registry;
use crate::sandbox::command::CommandSpec;

pub use crate::sandbox::command::{CommandControl, CommandExit, RunningCommand};
pub use crate::sandbox::environ::{check_user_env, EnvRefused};

/// What to run in a session's sandbox.
pub struct CommandRequest {
    /// The program and its arguments, as the sandbox sees them (`["/bin/bash", "-c", "ls"]`).
    pub argv: Vec<String>,
    /// Environment added to the kernels' own (checked with [`check_user_env`] first).
    pub env: Vec<(String, String)>,
    /// The working directory inside the sandbox (`None`: the workspace).
    pub cwd: Option<String>,
}

impl Registry {
    /// Starts `request` in `session`'s sandbox, as its user and within its kernel limits.
    pub async fn run_command(
        &self,
        session: &Session,
        request: CommandRequest,
    ) -> Result<RunningCommand, SessionError> {
        let spec = CommandSpec {
            user: session.user.clone(),
            argv: request.argv,
            env: request.env,
            cwd: request.cwd,
            limits: session.limits,
        };
        self.sandbox()
            .run_command(spec)
            .await
            .map_err(|source| SessionError::CommandNotStarted {
                session: session.id,
                source,
            })
    }
}
