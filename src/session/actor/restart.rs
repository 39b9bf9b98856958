//! Restarting a session's kernel: a fresh one from the pool or the sandbox in place of
//! the one it had; the running execution ends.

use tokio::time::Instant;

use super::Actor;
use crate::session::error::SessionError;
use crate::session::event::SessionEvent;
use crate::session::execution::{ExecutionError, ExecutionStatus};
use crate::session::launch::start_kernel;
use crate::session::lifecycle::LifecycleEvent;
use crate::session::state::SessionState;
use crate::wire::Signer;

impl Actor {
    /// Replace the kernel with a fresh one; the running execution ends with `status`.
    pub(super) async fn restart(
        &mut self,
        status: ExecutionStatus,
        why: &str,
    ) -> Result<(), SessionError> {
        let ename = if status == ExecutionStatus::Timeout {
            "TimeoutError"
        } else {
            "KernelRestarted"
        };
        self.finish(
            status,
            Some(ExecutionError {
                ename: ename.into(),
                evalue: why.to_string(),
                traceback: Vec::new(),
            }),
        );
        self.recorder.event(
            &self.session,
            &LifecycleEvent::KernelRestarted {
                reason: why.to_string(),
            },
        );
        self.session.set_state(SessionState::Starting);
        self.session.publish(SessionEvent::Restarted);
        if let Some(old) = self.kernel.take() {
            old.process.terminate().await;
        }
        self.routes.clear();
        let asked = Instant::now();
        // A pooled kernel has the user's default limits: only for a session that has them.
        // Its own reservation is dropped at once: the session's covers it, and the old
        // kernel is gone.
        let pooled = (self.session.limits == self.session.user.limits.kernel(None))
            .then(|| {
                self.pool
                    .take(&self.session.user, &self.session.kernel_name)
            })
            .flatten();
        let started = match pooled {
            Some((_, live, _memory)) => {
                // Launched for the pool under an id of its own: what the kernel does from
                // now on is this session's (its egress requests, for one).
                live.process.serves(self.session.id);
                Ok((live, true))
            }
            None => {
                // With checkpoints held, one of them is the sandbox's kernel under the
                // session's id: the new kernel gets an id of its own and serves the session.
                let fresh = self.checkpoints.any_held();
                let spec = if fresh {
                    self.child_spec()
                } else {
                    self.session.launch_spec(Signer::random_key())
                };
                start_kernel(&self.sandbox, spec, self.config.kernel)
                    .await
                    .inspect(|live| {
                        if fresh {
                            live.process.serves(self.session.id);
                        }
                    })
                    .map(|live| (live, false))
            }
        };
        match started {
            Ok((live, pooled)) => {
                self.recorder.event(
                    &self.session,
                    &LifecycleEvent::KernelStarted {
                        startup_seconds: asked.elapsed().as_secs_f64(),
                        pooled,
                    },
                );
                let (process, key) = (live.process.clone(), live.key.clone());
                self.kernel = Some(live);
                self.dead_reason = None;
                self.session.reset_execution_count();
                self.session.set_state(SessionState::Idle);
                self.session.set_kernel(process, &key).await;
                Ok(())
            }
            Err(e) => {
                let reason = format!("the restart failed: {e}");
                self.mark_dead(reason);
                Err(e)
            }
        }
    }
}
