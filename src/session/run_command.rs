//! A command run in a session's sandbox beside its kernel (E2B's `process.Process/Start`):
//! isolated and limited as the session's kernels are, as the session's user, with the
//! session's kernel limits. The api layer asks for it here and never names the sandbox.
//! Its start and its end are reported to the recording as the session's events.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;

use super::error::SessionError;
use super::handle::Session;
use super::lifecycle::LifecycleEvent;
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
        session: &Arc<Session>,
        request: CommandRequest,
    ) -> Result<RunningCommand, SessionError> {
        let (argv, cwd) = (request.argv.clone(), request.cwd.clone());
        let spec = CommandSpec {
            user: session.user.clone(),
            argv: request.argv,
            env: request.env,
            cwd: request.cwd,
            limits: session.limits,
        };
        let mut running = self.sandbox().run_command(spec).await.map_err(|source| {
            SessionError::CommandNotStarted {
                session: session.id,
                source,
            }
        })?;
        let pid = running.pid;
        self.report(session, &LifecycleEvent::CommandStarted { pid, argv, cwd });
        running.control = Arc::new(Reported {
            inner: running.control,
            registry: self.clone(),
            session: session.clone(),
            pid,
            started: Instant::now(),
            ended: AtomicBool::new(false),
        });
        Ok(running)
    }
}

/// A command's control that reports the command's end, once, the first time it is seen.
/// It holds the sandbox's control and nothing else of the command: dropping it kills the
/// command as dropping the sandbox's would.
struct Reported {
    inner: Arc<dyn CommandControl>,
    registry: Registry,
    session: Arc<Session>,
    pid: u32,
    started: Instant,
    ended: AtomicBool,
}

#[async_trait]
impl CommandControl for Reported {
    async fn signal(&self, signal: i32) {
        self.inner.signal(signal).await
    }

    async fn kill(&self) {
        self.inner.kill().await
    }

    async fn wait(&self) -> CommandExit {
        let exit = self.inner.wait().await;
        if !self.ended.swap(true, Ordering::AcqRel) {
            let event = LifecycleEvent::CommandEnded {
                pid: self.pid,
                exit_code: exit.code,
                signal: exit.signal,
                seconds: self.started.elapsed().as_secs_f64(),
            };
            self.registry.report(&self.session, &event);
        }
        exit
    }
}
