//! The session actor: one task per session that owns the kernel (its process and its
//! client) and the execute queue. Everything that touches the kernel goes through its
//! command channel, so executions run one at a time, in arrival order, and no lock is ever
//! held across an await.
//!
//! This file holds the task's loop and what it does with commands and with the kernel's
//! fate: interrupt, death and shutdown (restart, a fresh kernel from the pool or the
//! sandbox, is in `restart.rs`). The execution in flight (sending, output, deadlines,
//! completion) is in `running.rs`; checkpoints in `checkpoint.rs`, `held.rs` and
//! `pending.rs` (after every execution).

mod blocking;
mod checkpoint;
mod fork;
mod guard;
mod held;
mod pause;
mod pending;
mod restart;
mod running;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::{sleep_until, timeout, Instant};

use super::command::{Command, ExecRequest, ReplyRoute};
use super::config::SessionConfig;
use super::error::SessionError;
use super::execution::{failed, ExecutionError, ExecutionStatus};
use super::front_door::{EndedBy, SessionEnd};
use super::handle::Session;
use super::launch::Live;
use super::lifecycle::LifecycleEvent;
use super::pool::Pool;
use super::recorder::{Direction, Recorder};
use super::state::SessionState;
use crate::kernel::{KernelClient, KernelEvent};
use crate::sandbox::{ExitReason, Sandbox};
use crate::wire::{Channel, Message};

use running::Running;

pub(crate) struct Actor {
    pub session: Arc<Session>,
    pub sandbox: Arc<dyn Sandbox>,
    pub config: SessionConfig,
    pub commands: mpsc::Receiver<Command>,
    pub kernel: Option<Live>,
    /// Executions waiting for the kernel, with when each arrived.
    pub queue: VecDeque<(Instant, ExecRequest)>,
    running: Option<Running>,
    routes: HashMap<String, ReplyRoute>,
    dead_reason: Option<String>,
    recorder: Arc<dyn Recorder>,
    pool: Arc<Pool>,
    /// The last few agent executions' msg_ids: their late iopub is still theirs.
    recent_agent_ids: VecDeque<String>,
    /// The code that puts an execution's variables back, due now (`running.rs`).
    env_restore_due: Option<String>,
    checkpoints: checkpoint::Checkpoints,
    /// The session's kernel on disk while it is paused (`pause.rs`).
    paused: Option<crate::sandbox::pause::PausedImage>,
    /// While it is paused and carried (`--carry-paused`): true until it resumes or ends,
    /// so that a copy still being stored then is not.
    carrying: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The ends of the kernel's streams held back for masking (`guard.rs`).
    hold: crate::secrets::stream::StreamHold,
}

/// Record a message, then send it.
async fn record_send(
    recorder: &dyn Recorder,
    session: &Session,
    client: &KernelClient,
    channel: Channel,
    msg: &Message,
) -> Result<(), crate::kernel::KernelError> {
    let masked = crate::secrets::stream::mask_message(&session.secrets.masker(), msg.clone());
    recorder.message(session, Direction::ToKernel, channel, &masked);
    client.send(channel, msg).await
}

// Kernel events are nearly every value; boxing them would cost an allocation each.
#[allow(clippy::large_enum_variant)]
pub(super) enum FromKernel {
    Event(Option<KernelEvent>),
    Exited(ExitReason),
}

/// The next thing the kernel says or does; pending forever when there is no kernel.
pub(super) async fn from_kernel(kernel: &mut Option<Live>) -> FromKernel {
    match kernel {
        Some(k) => tokio::select! {
            ev = k.events.recv() => FromKernel::Event(ev),
            reason = &mut k.exit => FromKernel::Exited(
                reason.unwrap_or_else(|_| ExitReason::Lost("the process watcher ended".into())),
            ),
        },
        None => std::future::pending().await,
    }
}

impl Actor {
    pub fn new(
        session: Arc<Session>,
        sandbox: Arc<dyn Sandbox>,
        config: SessionConfig,
        commands: mpsc::Receiver<Command>,
        kernel: Option<Live>,
        recorder: Arc<dyn Recorder>,
        pool: Arc<Pool>,
    ) -> Self {
        Self {
            session,
            sandbox,
            config,
            commands,
            kernel,
            queue: VecDeque::new(),
            running: None,
            routes: HashMap::new(),
            dead_reason: None,
            recorder,
            pool,
            recent_agent_ids: VecDeque::new(),
            env_restore_due: None,
            checkpoints: Default::default(),
            paused: None,
            carrying: None,
            hold: Default::default(),
        }
    }

    /// An actor for a session whose kernel is gone (it died while the broker was stopped,
    /// `--keep-sessions`): dead for `reason` until a restart.
    pub fn without_kernel(
        session: Arc<Session>,
        sandbox: Arc<dyn Sandbox>,
        config: SessionConfig,
        commands: mpsc::Receiver<Command>,
        reason: String,
        (recorder, pool): (Arc<dyn Recorder>, Arc<Pool>),
    ) -> Self {
        session.set_dead(reason.clone());
        let mut actor = Self::new(session, sandbox, config, commands, None, recorder, pool);
        actor.dead_reason = Some(reason);
        actor
    }

    pub async fn run(mut self) {
        if self.paused.is_some() {
            self.session.set_state(SessionState::Paused);
        } else if self.dead_reason.is_none() {
            self.session.set_state(SessionState::Idle);
        }
        loop {
            let deadline = self.next_deadline();
            tokio::select! {
                cmd = self.commands.recv() => {
                    match cmd {
                        Some(Command::Shutdown { end, done }) => {
                            self.shutdown(end).await;
                            let _ = done.send(());
                            return;
                        }
                        Some(Command::Detach { done }) => {
                            self.detach();
                            self.end_checkpoints().await;
                            self.detach_paused().await;
                            let _ = done.send(());
                            return;
                        }
                        Some(Command::TakenOver { done }) => {
                            self.detach();
                            self.end_checkpoints().await;
                            self.end_paused().await;
                            let _ = done.send(());
                            return;
                        }
                        Some(cmd) => self.on_command(cmd).await,
                        None => {
                            self.shutdown(SessionEnd::Closed(EndedBy::BrokerShutdown)).await;
                            return;
                        }
                    }
                }
                k = from_kernel(&mut self.kernel) => self.on_kernel(k).await,
                _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                    self.on_deadline().await;
                }
            }
            self.checkpoint_if_due().await;
            self.start_next().await;
        }
    }

    async fn on_command(&mut self, cmd: Command) {
        let Some(cmd) = self.before_command(cmd).await else {
            return;
        };
        match cmd {
            Command::Execute(req) => {
                self.session.touch();
                if let Some(reason) = &self.dead_reason {
                    self.session.pending_dec();
                    let _ = req.done.send(failed(
                        ExecutionStatus::Dead,
                        "KernelDied",
                        format!("the session's kernel is dead ({reason}); restart the session to continue"),
                    ));
                } else {
                    self.queue.push_back((Instant::now(), req));
                }
            }
            Command::InputReply(value) => {
                self.session.touch();
                let Some(r) = self.running.as_mut() else {
                    return;
                };
                let Some(parent) = r.input_parent.take() else {
                    return;
                };
                if let Some(k) = &self.kernel {
                    let m = k.client.reply_to(
                        "input_reply",
                        &serde_json::json!({"value": value}),
                        &parent,
                    );
                    if let Err(e) = record_send(
                        &*self.recorder,
                        &self.session,
                        &k.client,
                        Channel::Stdin,
                        &m,
                    )
                    .await
                    {
                        tracing::warn!(session = %self.session.id, error = %e, "input_reply not sent");
                    }
                }
            }
            Command::Interrupt(done) => {
                self.session.touch();
                self.recorder
                    .event(&self.session, &LifecycleEvent::Interrupt);
                let result = self.interrupt_execution().await;
                if let Some(r) = self.running.as_mut() {
                    r.user_interrupted = true;
                }
                let _ = done.send(result);
            }
            Command::Restart(done) => {
                self.session.touch();
                let result = self
                    .restart(
                        ExecutionStatus::Interrupted,
                        "the kernel was restarted by request",
                    )
                    .await;
                let _ = done.send(result);
            }
            Command::Forward {
                channel,
                msg,
                route,
            } => {
                self.session.touch();
                if let Some(refusal) = guard::code_of(channel, &msg).and_then(|c| self.refusal(&c))
                {
                    return self.refuse_forward(&msg, &route, &refusal);
                }
                let Some(k) = &self.kernel else { return };
                if self.routes.len() > 10_000 {
                    // Requests whose replies never came; forget the oldest half at random.
                    let keys: Vec<String> = self.routes.keys().take(5_000).cloned().collect();
                    for key in keys {
                        self.routes.remove(&key);
                    }
                }
                self.routes.insert(msg.msg_id.clone(), route);
                if let Err(e) =
                    record_send(&*self.recorder, &self.session, &k.client, channel, &msg).await
                {
                    tracing::warn!(session = %self.session.id, error = %e, "forward to kernel failed");
                }
            }
            Command::Fork { spec, route, done } => {
                let _ = done.send(self.fork(spec, route).await);
            }
            Command::Checkpoint { done } => {
                self.session.touch();
                let _ = done.send(self.take_checkpoint().await);
            }
            Command::CheckpointPolicy {
                policy,
                book,
                set_mode,
            } => self.set_checkpoint_policy(policy, book, set_mode),
            Command::ListCheckpoints(done) => {
                let _ = done.send(self.list_checkpoints());
            }
            Command::DropCheckpoint { id, why, done } => {
                let dropped = self.drop_checkpoint(id, why).await;
                if let Some(done) = done {
                    let _ = done.send(dropped);
                }
            }
            Command::Rewind { checkpoint, done } => {
                self.session.touch();
                let _ = done.send(self.rewind(checkpoint).await);
            }
            Command::ForkCheckpoint {
                checkpoint,
                spec,
                done,
            } => {
                let _ = done.send(self.fork_checkpoint(checkpoint, spec).await);
            }
            Command::Pause { done } => {
                self.session.touch();
                let _ = done.send(self.pause().await);
            }
            Command::Snapshot { spec, done } => {
                self.session.touch();
                let _ = done.send(self.snapshot(spec).await);
            }
            Command::Resume { done } => {
                self.session.touch();
                let _ = done.send(self.resume().await);
            }
            Command::CarryPaused { done } => {
                if let (Some(image), None) = (self.paused.clone(), &self.carrying) {
                    self.carry(&image).await;
                }
                let _ = done.send(());
            }
            Command::Shutdown { .. } | Command::Detach { .. } | Command::TakenOver { .. } => {}
        }
    }

    async fn interrupt(&mut self) -> Result<(), SessionError> {
        let Some(k) = &self.kernel else {
            return Err(SessionError::KernelNotRunning);
        };
        let m = k
            .client
            .request("interrupt_request", &serde_json::json!({}));
        if record_send(
            &*self.recorder,
            &self.session,
            &k.client,
            Channel::Control,
            &m,
        )
        .await
        .is_err()
        {
            // The control channel is gone; fall back to the signal.
            k.process
                .interrupt()
                .await
                .map_err(|source| SessionError::InterruptFailed { source })?;
        }
        Ok(())
    }

    /// What the kernel said or did.
    async fn on_kernel(&mut self, k: FromKernel) {
        match k {
            FromKernel::Event(Some(ev)) => self.on_kernel_event(ev).await,
            FromKernel::Event(None) => {
                self.on_death("the connection to the kernel closed".into())
                    .await
            }
            FromKernel::Exited(reason) => self.on_death(reason.to_string()).await,
        }
    }

    async fn on_kernel_event(&mut self, ev: KernelEvent) {
        match ev {
            KernelEvent::Message(channel, m) => {
                for (channel, m) in self.masked(channel, m) {
                    self.recorder
                        .message(&self.session, Direction::FromKernel, channel, &m);
                    if channel == Channel::Iopub {
                        self.on_iopub(m);
                    } else {
                        self.on_reply(channel, m);
                        self.restore_env_if_due().await;
                    }
                }
                self.interrupt_if_due().await;
            }
            KernelEvent::OutputCut { message, bytes } => self.on_cut(message, bytes),
            KernelEvent::HeartbeatLost { misses } => {
                self.on_death(format!(
                    "the kernel stopped answering its heartbeat ({misses} misses)"
                ))
                .await
            }
            KernelEvent::ChannelFailed(ch, why) => {
                // A kernel that died (out of memory, say) also ends its connections, often
                // first: give the process a moment so the reason names the cause.
                let exited = match &self.kernel {
                    Some(k) => timeout(Duration::from_millis(500), k.process.wait())
                        .await
                        .ok(),
                    None => None,
                };
                let reason = match exited {
                    Some(exit) if exit != ExitReason::Terminated => exit.to_string(),
                    _ => format!("the kernel's {} channel failed: {why}", ch.as_str()),
                };
                self.on_death(reason).await
            }
        }
    }

    fn mark_dead(&mut self, reason: String) {
        tracing::warn!(session = %self.session.id, %reason, "session is dead");
        self.recorder.event(
            &self.session,
            &LifecycleEvent::KernelDied {
                reason: reason.clone(),
            },
        );
        self.dead_reason = Some(reason.clone());
        self.session.set_dead(reason.clone());
        for (_, req) in self.queue.drain(..) {
            self.session.pending_dec();
            let _ = req.done.send(failed(
                ExecutionStatus::Dead,
                "KernelDied",
                format!("the session's kernel is dead ({reason}); restart the session to continue"),
            ));
        }
    }

    async fn on_death(&mut self, reason: String) {
        let Some(k) = self.kernel.take() else { return };
        // A death's reason can quote the kernel's last stderr lines (the Docker sandbox's).
        let reason = self.session.secrets.masker().mask_str(&reason).into_owned();
        k.process.terminate().await;
        self.finish(
            ExecutionStatus::Dead,
            Some(ExecutionError {
                ename: "KernelDied".into(),
                evalue: format!("{reason}; the session is dead: restart it to continue"),
                traceback: Vec::new(),
            }),
        );
        self.mark_dead(reason);
    }

    /// The broker stops and keeps the session (`--keep-sessions`): the execution in flight
    /// and those queued get a clear answer now (the kernel goes on with the running one,
    /// unobserved), and the kernel is let go of, alive, for the next run to adopt.
    fn detach(&mut self) {
        self.finish(
            ExecutionStatus::Error,
            Some(ExecutionError {
                ename: "BrokerRestarted".into(),
                evalue: "the broker stopped while this code ran (it keeps sessions across \
                         restarts): the kernel goes on running it, but its output from now \
                         on is not returned; once the broker is back, look at the session's \
                         variables and files to see how it ended"
                    .into(),
                traceback: Vec::new(),
            }),
        );
        for (_, req) in self.queue.drain(..) {
            self.session.pending_dec();
            let _ = req.done.send(failed(
                ExecutionStatus::Error,
                "BrokerRestarted",
                "the broker stopped before this code ran (it keeps sessions across restarts); \
                 nothing of it ran: send it again once the broker is back"
                    .into(),
            ));
        }
        if let Some(k) = self.kernel.take() {
            k.process.release();
        }
        self.recorder
            .event(&self.session, &LifecycleEvent::SessionKept);
    }

    async fn shutdown(&mut self, end: SessionEnd) {
        let why = match end {
            SessionEnd::Expired => "the session expired",
            SessionEnd::Closed(_) => "the session was shut down",
        };
        let note = ExecutionError {
            ename: "SessionClosed".into(),
            evalue: why.into(),
            traceback: Vec::new(),
        };
        self.finish(ExecutionStatus::Dead, Some(note));
        for (_, req) in self.queue.drain(..) {
            self.session.pending_dec();
            let _ = req
                .done
                .send(failed(ExecutionStatus::Dead, "SessionClosed", why.into()));
        }
        if let Some(k) = self.kernel.take() {
            // Ask politely first so the kernel can clean up, then make sure.
            let m = k
                .client
                .request("shutdown_request", &serde_json::json!({"restart": false}));
            let _ = record_send(
                &*self.recorder,
                &self.session,
                &k.client,
                Channel::Control,
                &m,
            )
            .await;
            let _ = timeout(Duration::from_millis(500), k.process.wait()).await;
            k.process.terminate().await;
        }
        self.end_checkpoints().await;
        self.end_paused().await;
        self.session.set_state(end.state());
        let kind = match end {
            SessionEnd::Expired => LifecycleEvent::SessionExpired,
            SessionEnd::Closed(by) => LifecycleEvent::SessionClosed { by },
        };
        self.recorder.event(&self.session, &kind);
    }
}
