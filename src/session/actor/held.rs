//! Held checkpoints in the actor (`sandbox/held.rs` says what they are): taking one (the
//! live kernel forks a held child and goes on as it was) and forking one (its control
//! socket is sent the new kernel's connection; the child it forks is adopted and
//! connected as any fork is).

use std::sync::Arc;

use futures::FutureExt;
use uuid::Uuid;

use super::Actor;
use crate::sandbox::held::{HeldControl, HeldError};
use crate::sandbox::{KernelProcess, LaunchSpec};
use crate::session::checkpoint::CheckpointInfo;
use crate::session::error::SessionError;
use crate::session::forking::{
    adopt_connected, checkpoint_failed as failed, fork_error, requested_pid, FORK_REPLY_GRACE,
};
use crate::session::launch::Live;
use crate::wire::Message;

/// A checkpoint's kernel.
pub(super) enum HeldKernel {
    /// The live kernel's child, held (`sandbox/held.rs`): it forks a kernel for each
    /// connection sent on its control socket, and ends when the socket is dropped.
    Waiting {
        process: Arc<dyn KernelProcess>,
        control: HeldControl,
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
}

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
            control: held.control,
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
        let session = self.session.id;
        let count = self.checkpoints.held[i].info.execution_count;
        let HeldKernel::Waiting { process, control } = &mut self.checkpoints.held[i].kernel else {
            unreachable!("fork_held is asked for held checkpoints");
        };
        let (key, user) = (spec.key.clone(), spec.user.name.clone());
        let prepared = self
            .sandbox
            .prepare_fork(&**process, spec)
            .await
            .map_err(|e| failed(action, fork_error(session, e)))?;
        let request = prepared.request.clone();
        let limit = self.sandbox.launch_timeout() + FORK_REPLY_GRACE;
        let reply = async move { Some(wake_reply(control.wake(&request, limit).await)) };
        let ended = "the checkpoint ended before it answered";
        let child = adopt_connected(
            &self.sandbox,
            self.config.kernel,
            session,
            prepared,
            key,
            &user,
            reply,
            ended,
        )
        .await
        .map_err(|e| failed(action, e))?;
        let c = child.process.clone();
        match tokio::task::spawn_blocking(move || c.set_live_oom_score()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(%session, error = %e, "a kernel forked from a checkpoint keeps the checkpoint's oom_score_adj");
            }
            Err(e) => {
                tracing::warn!(%session, error = %e, "a kernel forked from a checkpoint keeps the checkpoint's oom_score_adj");
            }
        }
        Ok((child, count))
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
