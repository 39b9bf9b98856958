//! A checkpoint after every execution, off the next execution's path (issue 36).
//!
//! The kernel serves its shell channel in order: a `kb_fork_request` sent as an execution
//! ends is served before any execution sent after it, so the held child holds the state
//! between the two whatever the broker does meanwhile. So the request is sent and the
//! next execution may follow it at once; the reply (routed to a task, as a fork's is) and
//! the adoption (`Sandbox::adopt_checkpoint`: the pid checked, the control connection
//! taken, the leaves given) run in that task, and the checkpoint is kept, under the
//! session's bounds, when anything next needs the checkpoints or the kernel's identity:
//! any command but an execution and its input, an interrupt or a client's message
//! (`before_command`), the next checkpoint, the session's end. Only where the sandbox
//! holds checkpoints (`Sandbox::prepare_checkpoint`); elsewhere the checkpoint is taken
//! as on demand, before the next execution.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinHandle;
use uuid::Uuid;

use super::held::HeldKernel;
use super::{from_kernel, Actor};
use crate::sandbox::fork::HeldCheckpoint;
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::forking::{
    bounded_reply, checkpoint_failed as failed, fork_error, pid_of_reply, send_fork_request,
    FORK_REPLY_GRACE,
};
use crate::wire::Channel;

/// A checkpoint asked of the live kernel whose reply and adoption are still under way.
pub(super) struct PendingCheckpoint {
    /// The execution count of the state it holds (the session's goes on meanwhile).
    execution_count: u64,
    /// The request's id: its route goes once the checkpoint is kept.
    msg_id: String,
    task: JoinHandle<Result<HeldCheckpoint, SessionError>>,
}

/// Whether an every-execution checkpoint was asked for here.
enum Asked {
    /// Sent; kept later (`keep_pending`).
    Sent,
    /// The sandbox holds no checkpoints for this kernel: take one as on demand.
    NotHeld,
}

impl Actor {
    /// Takes the checkpoint an execution made due (every-execution mode): asked for here,
    /// kept later where the sandbox holds checkpoints, else taken now; either way before
    /// the next execution reaches the kernel. A failure is logged, the session goes on.
    pub(super) async fn checkpoint_if_due(&mut self) {
        if !std::mem::take(&mut self.checkpoints.due) || self.kernel.is_none() {
            return;
        }
        let taken = match self.ask_checkpoint().await {
            Ok(Asked::Sent) => Ok(()),
            Ok(Asked::NotHeld) => self.checkpoint_unheld().await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = taken {
            self.checkpoint_not_taken(e);
        }
    }

    fn checkpoint_not_taken(&mut self, e: SessionError) {
        match e {
            // This session can have none (a plain kernel, the Docker sandbox): stop trying.
            e @ SessionError::ForkRefused { .. } => {
                tracing::info!(session = %self.session.id, reason = %e, "no checkpoints after executions for this session");
                if let Some((policy, _)) = self.checkpoints.policy.as_mut() {
                    policy.every_execution = false;
                }
            }
            e => {
                tracing::warn!(session = %self.session.id, error = %e, "checkpoint after an execution not taken");
            }
        }
    }

    /// Sends the live kernel a held checkpoint's request, its reply routed to a task that
    /// adopts the held child; or says the sandbox holds none for this kernel.
    async fn ask_checkpoint(&mut self) -> Result<Asked, SessionError> {
        self.keep_pending().await;
        let Some(prepared) = self.prepare_held().await? else {
            return Ok(Asked::NotHeld);
        };
        let session = self.session.id;
        let Some(live) = self.kernel.as_mut() else {
            self.sandbox.discard_fork(prepared).await;
            return Err(SessionError::KernelNotRunning);
        };
        let started = Instant::now();
        let (prepared, msg_id) = send_fork_request(&self.sandbox, session, live, prepared)
            .await
            .map_err(|e| failed("checkpoint", e))?;
        let (route, mut replies) = mpsc::channel(8);
        self.routes.insert(msg_id.clone(), route);
        let (sandbox, kernel) = (self.sandbox.clone(), live.process.clone());
        let limit = sandbox.launch_timeout() + FORK_REPLY_GRACE;
        let task = tokio::spawn(async move {
            let reply = async {
                loop {
                    match replies.recv().await {
                        Some((Channel::Shell, m)) => return Some(m),
                        // Its busy and idle statuses.
                        Some(_) => {}
                        None => return None,
                    }
                }
            };
            let answered = tokio::select! {
                r = bounded_reply(session, limit, reply, "the kernel ended before it answered") => r,
                why = kernel.wait() => Err(SessionError::ForkFailed {
                    session,
                    why: format!("the kernel ended before it answered: {why}"),
                    source: None,
                }),
            };
            let pid = match answered.and_then(|m| pid_of_reply(session, &m)) {
                Ok(pid) => pid,
                Err(e) => {
                    sandbox.discard_fork(prepared).await;
                    return Err(failed("checkpoint", e));
                }
            };
            let replied = started.elapsed();
            let held = sandbox
                .adopt_checkpoint(prepared, pid)
                .await
                .map_err(|e| failed("checkpoint", fork_error(session, e)))?;
            tracing::debug!(
                %session,
                replied_us = replied.as_micros() as u64,
                adopted_us = started.elapsed().as_micros() as u64,
                "held checkpoint adopted after its execution"
            );
            Ok(held)
        });
        self.checkpoints.pending = Some(PendingCheckpoint {
            execution_count: self.session.status().execution_count,
            msg_id,
            task,
        });
        Ok(Asked::Sent)
    }

    /// Keeps the checkpoint asked for after the last execution, once it is adopted (or
    /// logs why there is none).
    pub(super) async fn keep_pending(&mut self) {
        let Some(pending) = self.checkpoints.pending.take() else {
            return;
        };
        // Its reply comes with the kernel's other messages, which the actor routes: it goes
        // on serving the kernel meanwhile (an execution sent after it may be running).
        let mut task = pending.task;
        let adopted = loop {
            tokio::select! {
                adopted = &mut task => break adopted,
                k = from_kernel(&mut self.kernel) => self.on_kernel(k).await,
            }
        };
        self.routes.remove(&pending.msg_id);
        match adopted {
            Ok(Ok(held)) => {
                let kernel = HeldKernel::Waiting {
                    process: Arc::from(held.process),
                    control: Arc::new(Mutex::new(held.control)),
                };
                self.keep_checkpoint_of(Uuid::new_v4(), kernel, None, pending.execution_count)
                    .await;
            }
            Ok(Err(e)) => self.checkpoint_not_taken(e),
            Err(e) => {
                tracing::warn!(session = %self.session.id, error = %e, "checkpoint after an execution lost");
            }
        }
    }

    /// `cmd`, to be done, once the checkpoint under way is kept where `cmd` may need the
    /// checkpoints or the live kernel's identity; and a paused session resumed for it.
    pub(super) async fn before_command(&mut self, cmd: Command) -> Option<Command> {
        match &cmd {
            Command::Execute(_)
            | Command::InputReply(_)
            | Command::Interrupt(_)
            | Command::Forward { .. } => {}
            _ => self.keep_pending().await,
        }
        self.resumed_for(cmd).await
    }
}
