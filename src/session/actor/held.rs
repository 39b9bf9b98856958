//! Held checkpoints in the actor (`sandbox/held.rs` says what they are): taking one (the
//! live kernel forks a held child and goes on as it was), forking one (its control
//! socket is sent the new kernel's connection; the child it forks is adopted and
//! connected as any fork is), and the *spare*: after a rewind to a held checkpoint, a
//! kernel forked from it in the background, which the next rewind to it makes the live
//! kernel at once (an agent trying fixes from the same point rewinds there again and
//! again). One a session; ended with its checkpoint, with the session, at a pause, and
//! when a rewind goes to another checkpoint.

use std::sync::Arc;

use futures::FutureExt;
use tokio::sync::Mutex;
use tokio::task::{JoinHandle, JoinSet};
use uuid::Uuid;

use super::blocking::run_blocking;
use super::Actor;
use crate::kernel::ConnectOptions;
use crate::sandbox::held::{HeldControl, HeldError};
use crate::sandbox::{KernelProcess, LaunchSpec, Sandbox};
use crate::session::checkpoint::CheckpointInfo;
use crate::session::error::SessionError;
use crate::session::forking::{
    adopt_connected, checkpoint_failed as failed, fork_error, requested_pid, FORK_REPLY_GRACE,
};
use crate::session::forking::{continue_beside, CONTINUE_EVERY};
use crate::session::launch::Live;
use crate::wire::Message;

/// A checkpoint's kernel.
pub(super) enum HeldKernel {
    /// The live kernel's child, held (`sandbox/held.rs`): it forks a kernel for each
    /// connection sent on its control socket, and ends when the socket is dropped.
    Waiting {
        process: Arc<dyn KernelProcess>,
        /// Shared with the task making a spare (one exchange at a time).
        control: Arc<Mutex<HeldControl>>,
    },
    /// A whole kernel, frozen, with the connection the broker keeps to it (a copy into a
    /// sandbox of its own, or a backend without held checkpoints).
    Frozen(Box<Live>),
}

impl HeldKernel {
    pub(super) fn process(&self) -> &Arc<dyn KernelProcess> {
        match self {
            Self::Waiting { process, .. } => process,
            Self::Frozen(live) => &live.process,
        }
    }

    pub(super) fn exited(&mut self) -> bool {
        match self {
            Self::Waiting { process, .. } => process.wait().now_or_never().is_some(),
            Self::Frozen(live) => live.exited(),
        }
    }

    /// Whether its process has ended, or ends within `wait` (a fork that failed because it
    /// died may be told before the process's watcher is).
    pub(super) async fn ended_within(&mut self, wait: std::time::Duration) -> bool {
        let process = match self {
            Self::Waiting { process, .. } => process.clone(),
            Self::Frozen(live) => live.process.clone(),
        };
        tokio::time::timeout(wait, process.wait()).await.is_ok()
    }
}

/// Why a checkpoint whose kernel ended is dropped.
pub(super) const CHECKPOINT_ENDED: &str = "its kernel ended (the OOM killer takes checkpoints \
    first; a kernel of its session can kill it)";
/// How long a failed fork of a checkpoint waits to see whether the checkpoint ended (its
/// watcher may learn it a moment after the fork did).
pub(super) const ENDED_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

impl Actor {
    /// A held checkpoint (`sandbox/held.rs`): the live kernel forks a held child and goes
    /// on as it was; only the request and the adoption are on this path.
    pub(super) async fn take_held_checkpoint(
        &mut self,
        prepared: crate::sandbox::fork::PreparedFork,
    ) -> Result<CheckpointInfo, SessionError> {
        let session = self.session.id;
        let started = std::time::Instant::now();
        let Some(live) = self.kernel.as_mut() else {
            self.sandbox.discard_fork(prepared).await;
            return Err(SessionError::KernelNotRunning);
        };
        let (prepared, pid) = requested_pid(&self.sandbox, session, live, prepared)
            .await
            .map_err(|e| failed("checkpoint", e))?;
        let replied = started.elapsed();
        let held = self
            .sandbox
            .adopt_checkpoint(prepared, pid)
            .await
            .map_err(|e| failed("checkpoint", fork_error(session, e)))?;
        let adopted = started.elapsed();
        let kernel = HeldKernel::Waiting {
            process: Arc::from(held.process),
            control: Arc::new(Mutex::new(held.control)),
        };
        let info = self.keep_checkpoint(Uuid::new_v4(), kernel, None).await;
        tracing::debug!(
            %session,
            replied_us = replied.as_micros() as u64,
            adopted_us = adopted.as_micros() as u64,
            kept_us = started.elapsed().as_micros() as u64,
            "held checkpoint taken"
        );
        Ok(info)
    }

    /// Forks held checkpoint `i` into a connected kernel for `spec`; with the execution
    /// count it starts from.
    pub(super) async fn fork_held(
        &mut self,
        i: usize,
        spec: LaunchSpec,
        action: &'static str,
    ) -> Result<(Live, u64), SessionError> {
        let count = self.checkpoints.held[i].info.execution_count;
        let HeldKernel::Waiting { process, control } = &self.checkpoints.held[i].kernel else {
            unreachable!("fork_held is asked for held checkpoints");
        };
        let child = self
            .held_forks()
            .fork(process.clone(), control.clone(), spec, action)
            .await?;
        self.make_live_score(&child).await;
        Ok((child, count))
    }

    fn held_forks(&self) -> HeldForks {
        HeldForks {
            sandbox: self.sandbox.clone(),
            options: self.config.kernel,
            session: self.session.id,
        }
    }

    /// A kernel forked from a checkpoint is the OOM killer's first choice as the
    /// checkpoint is, until it is made live (here).
    pub(super) async fn make_live_score(&self, child: &Live) {
        let c = child.process.clone();
        if let Err(e) = run_blocking(move || c.set_live_oom_score()).await {
            tracing::warn!(session = %self.session.id, error = %e, "a kernel forked from a checkpoint keeps the checkpoint's oom_score_adj");
        }
    }

    /// Starts making a spare for held checkpoint `id` in the background, and ends any
    /// other checkpoint's: one a session.
    pub(super) fn spare_for(&mut self, id: Uuid) {
        let spec = self.child_spec();
        let forks = self.held_forks();
        let checkpoints = &mut self.checkpoints;
        for held in checkpoints.held.iter_mut().filter(|h| h.info.id != id) {
            if let Some(spare) = held.spare.take() {
                end_spare(&mut checkpoints.ending, spare);
            }
        }
        let Some(held) = checkpoints.held.iter_mut().find(|h| h.info.id == id) else {
            return;
        };
        let HeldKernel::Waiting { process, control } = &held.kernel else {
            return;
        };
        if held.spare.is_some() {
            return;
        }
        let fork = forks.fork(process.clone(), control.clone(), spec, "spare");
        held.spare = Some(Spare::Making(tokio::spawn(fork)));
    }

    /// Checkpoint `i`'s spare, made live (waited for if still being made), if it is alive;
    /// `None` otherwise (and a rewind forks the checkpoint as without one).
    pub(super) async fn take_spare(&mut self, i: usize) -> Option<Live> {
        let session = self.session.id;
        let mut live = match self.checkpoints.held[i].spare.take()? {
            Spare::Ready(live) => *live,
            Spare::Making(task) => match task.await {
                Ok(Ok(live)) => live,
                Ok(Err(e)) => {
                    tracing::info!(%session, error = %e, "the rewind's spare kernel was not made; forking the checkpoint");
                    return None;
                }
                Err(e) => {
                    tracing::warn!(%session, error = %e, "the rewind's spare kernel was not made; forking the checkpoint");
                    return None;
                }
            },
        };
        if live.exited() {
            tracing::info!(%session, "the rewind's spare kernel ended; forking the checkpoint");
            end_spare(&mut self.checkpoints.ending, Spare::Ready(Box::new(live)));
            return None;
        }
        // A kernel of the session may have stopped it (SIGSTOP) while it waited: as the
        // live kernel it would take no execution (which waits in its socket meanwhile; the
        // rewind does not wait for the blocking thread this takes).
        continue_beside(&live.process);
        self.make_live_score(&live).await;
        Some(live)
    }

    /// Ends every spare (a pause gives the session's memory back).
    pub(super) fn end_spares(&mut self) {
        let checkpoints = &mut self.checkpoints;
        for held in checkpoints.held.iter_mut() {
            if let Some(spare) = held.spare.take() {
                end_spare(&mut checkpoints.ending, spare);
            }
        }
    }
}

/// A kernel forked from a held checkpoint ahead of the next rewind to it.
pub(super) enum Spare {
    Making(JoinHandle<Result<Live, SessionError>>),
    Ready(Box<Live>),
}

impl Spare {
    /// The memory its kernel's leaf is charged, once made.
    pub(super) fn memory_used(&mut self) -> Option<u64> {
        if let Spare::Making(task) = self {
            if !task.is_finished() {
                return None;
            }
            match task.now_or_never() {
                Some(Ok(Ok(live))) => *self = Spare::Ready(Box::new(live)),
                _ => return None,
            }
        }
        match self {
            Spare::Ready(live) => live.process.memory_used(),
            Spare::Making(_) => None,
        }
    }
}

/// Ends `spare` in the background (in `ending`, which the session's end awaits): once
/// made, if it is being made.
pub(super) fn end_spare(ending: &mut JoinSet<()>, spare: Spare) {
    ending.spawn(async move {
        let live = match spare {
            Spare::Ready(live) => *live,
            Spare::Making(task) => match task.await {
                Ok(Ok(live)) => live,
                _ => return,
            },
        };
        live.process.terminate().await;
    });
}

/// What forking a session's held checkpoints needs of its actor (owned: a spare's fork
/// runs in a task of its own).
pub(super) struct HeldForks {
    sandbox: Arc<dyn Sandbox>,
    options: ConnectOptions,
    session: Uuid,
}

impl HeldForks {
    /// Forks a held checkpoint (`process`, reached on `control`) into a kernel for `spec`,
    /// adopted and connected as any fork is.
    async fn fork(
        self,
        process: Arc<dyn KernelProcess>,
        control: Arc<Mutex<HeldControl>>,
        spec: LaunchSpec,
        action: &'static str,
    ) -> Result<Live, SessionError> {
        let Self {
            sandbox,
            options,
            session,
        } = self;
        let (key, user) = (spec.key.clone(), spec.user.name.clone());
        let prepared = sandbox
            .prepare_fork(&*process, spec)
            .await
            .map_err(|e| failed(action, fork_error(session, e)))?;
        let request = prepared.request.clone();
        let limit = sandbox.launch_timeout() + FORK_REPLY_GRACE;
        let reply = async move {
            let mut control = control.lock().await;
            let wake = control.wake(&request, limit);
            tokio::pin!(wake);
            // Continued at once, and again until it answers: a kernel of the session may
            // have stopped it (SIGSTOP), or stop it again meanwhile (it is that kernel's
            // child, or parent, of the same uid). A stopped checkpoint would leave the wake
            // to wait out its bound. Beside the wake, never before it: each is a hop to a
            // blocking thread, which the request does not wait for.
            continue_beside(&process);
            let start = tokio::time::Instant::now() + CONTINUE_EVERY;
            let mut again = tokio::time::interval_at(start, CONTINUE_EVERY);
            let answer = loop {
                tokio::select! {
                    biased;
                    answer = &mut wake => break answer,
                    _ = again.tick() => continue_beside(&process),
                }
            };
            Some(wake_reply(answer))
        };
        let ended = "the checkpoint ended before it answered";
        adopt_connected(
            &sandbox, options, session, prepared, key, &user, reply, ended,
        )
        .await
        .map_err(|e| failed(action, e))
    }
}

/// A held checkpoint's answer to a wake as a `kb_fork_reply` (its content the answer, or an
/// error saying why there was none), checked as any kernel's reply is.
fn wake_reply(answer: Result<Vec<u8>, HeldError>) -> Message {
    let mut m = Message::new("kb_fork_reply", &serde_json::json!({}), None, "", "");
    m.content = match answer {
        Ok(content) => content.into(),
        Err(why) => serde_json::to_vec(
            &serde_json::json!({"status": "error", "ename": "HeldCheckpoint", "evalue": why.to_string()}),
        )
        .unwrap_or_default()
        .into(),
    };
    m
}
