//! The actor's side of checkpoints (`session/checkpoint.rs` says what they are): taking one
//! (held: the live kernel forks a held child and goes on, `take_held_checkpoint`; frozen,
//! where the sandbox keeps no held ones: the live kernel forks, its child becomes the live
//! kernel, the parent is frozen and kept; a session with a workspace of its own: a frozen
//! copy of the kernel and the workspace, `take_copy_checkpoint`), rewinding (a checkpoint
//! forks; its child becomes the live kernel, the previous one ends), forking a checkpoint into a new session's kernel, dropping one, and ending
//! them all with the session. Each runs between executions, in the actor, so nothing else
//! touches the kernels meanwhile; a failure leaves the session's live kernel as it was.

use std::collections::VecDeque;
use std::sync::Arc;

use chrono::Utc;
use uuid::Uuid;

use super::blocking::run_blocking;
use super::held::{end_spare, HeldKernel, Spare, CHECKPOINT_ENDED, ENDED_WAIT};
use super::pending::PendingCheckpoint;
use super::Actor;
use crate::sandbox::fork::{ForkError, PreparedFork};
use crate::sandbox::LaunchSpec;
use crate::session::checkpoint::{
    CheckpointBook, CheckpointInfo, CheckpointList, CheckpointPolicy, DroppedCheckpoint, Dropper,
};
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::forking::{checkpoint_failed as failed, fork_connected, fork_error};
use crate::session::launch::Live;
use crate::session::lifecycle::LifecycleEvent;
use crate::session::state::SessionState;
use crate::wire::Signer;

/// How many dropped checkpoints a session remembers for its list.
const DROPPED_KEPT: usize = 64;

/// A checkpoint: its kernel, and what it is.
pub(super) struct Held {
    pub(super) info: CheckpointInfo,
    pub(super) kernel: HeldKernel,
    /// The checkpoint's copy of the session's own workspace (named by the checkpoint's
    /// id), for a session with one; removed with the checkpoint.
    workspace: Option<Uuid>,
    /// A kernel forked from it ahead of the next rewind to it (`held.rs`).
    pub(super) spare: Option<Spare>,
}

/// The checkpoints an actor holds.
#[derive(Default)]
pub(crate) struct Checkpoints {
    pub(super) held: Vec<Held>,
    dropped: VecDeque<DroppedCheckpoint>,
    /// The user's bounds and book, once a front door set them.
    pub(super) policy: Option<(CheckpointPolicy, Arc<CheckpointBook>)>,
    /// An execution ended ok in every-execution mode: take one before the next request.
    pub(super) due: bool,
    /// The one asked for after the last execution, being adopted (`pending.rs`).
    pub(super) pending: Option<PendingCheckpoint>,
    /// Kernels a rewind replaced, ending in the background (the rewound session does not
    /// wait for them); awaited when the session ends.
    pub(super) ending: tokio::task::JoinSet<()>,
}

impl Checkpoints {
    /// Whether any checkpoint is held: each keeps the sandbox's key of the kernel it was
    /// (the session's id, for the first), so a new kernel of the session needs its own.
    pub(super) fn any_held(&self) -> bool {
        !self.held.is_empty()
    }
}

impl Actor {
    /// Sets the bounds the session's checkpoints are kept within, and with `set_mode`
    /// whether one is taken after every successful execution (else that stays as it was).
    pub(super) fn set_checkpoint_policy(
        &mut self,
        mut policy: CheckpointPolicy,
        book: Arc<CheckpointBook>,
        set_mode: bool,
    ) {
        if !set_mode {
            policy.every_execution = self
                .checkpoints
                .policy
                .as_ref()
                .is_some_and(|(p, _)| p.every_execution);
        }
        self.checkpoints.policy = Some((policy, book));
    }

    /// An execution ended with `ok`: in every-execution mode a checkpoint is due.
    pub(super) fn execution_ok(&mut self) {
        if self
            .checkpoints
            .policy
            .as_ref()
            .is_some_and(|(p, _)| p.every_execution)
        {
            self.checkpoints.due = true;
        }
    }

    /// Nothing runs or waits (a dead session, with no kernel, is idle too).
    fn idle(&self) -> Result<(), SessionError> {
        if self.running.is_some() || !self.queue.is_empty() {
            return Err(SessionError::CheckpointBusy {
                session: self.session.id,
            });
        }
        Ok(())
    }

    /// A launch spec for a new kernel of this session: under an id of its own (its leaf's
    /// name and the sandbox's key), since the kernel it is forked from keeps the old one.
    pub(super) fn child_spec(&self) -> LaunchSpec {
        let mut spec = self.session.launch_spec(Signer::random_key());
        spec.session_id = Uuid::new_v4();
        spec
    }

    /// Makes `child` the live kernel; returns the one it replaces.
    pub(super) async fn swap_live(&mut self, child: Live) -> Option<Live> {
        child.process.serves(self.session.id);
        let (process, key) = (child.process.clone(), child.key.clone());
        let old = self.kernel.replace(child);
        self.routes.clear();
        self.session.set_kernel(process, &key).await;
        old
    }

    pub(super) async fn take_checkpoint(&mut self) -> Result<CheckpointInfo, SessionError> {
        self.idle()?;
        self.checkpoint_now().await
    }

    /// Takes a checkpoint of the live kernel, which is between executions (those queued
    /// in the broker wait for it).
    pub(super) async fn checkpoint_now(&mut self) -> Result<CheckpointInfo, SessionError> {
        match self.prepare_held().await? {
            Some(prepared) => self.take_held_checkpoint(prepared).await,
            None => self.checkpoint_unheld().await,
        }
    }

    /// A held checkpoint of the live kernel prepared with the sandbox, or `None` where the
    /// sandbox holds none for it (`checkpoint_unheld` takes one).
    pub(super) async fn prepare_held(&mut self) -> Result<Option<PreparedFork>, SessionError> {
        if self.session.own_workspace.is_some() {
            return Ok(None);
        }
        let spec = self.child_spec();
        let session = self.session.id;
        let Some(live) = self.kernel.as_mut() else {
            return Err(SessionError::KernelNotRunning);
        };
        let settling = std::time::Instant::now();
        live.process.settle().await;
        tracing::debug!(%session, settled_us = settling.elapsed().as_micros() as u64, "the last checkpoint's leaf move awaited");
        match self.sandbox.prepare_checkpoint(&*live.process, spec).await {
            Ok(prepared) => Ok(Some(prepared)),
            Err(ForkError::Unsupported(_)) => Ok(None),
            Err(e) => Err(failed("checkpoint", fork_error(session, e))),
        }
    }

    /// A checkpoint where the sandbox holds none for the live kernel: a copy with the
    /// workspace for a session with its own, else the live kernel's frozen former self.
    pub(super) async fn checkpoint_unheld(&mut self) -> Result<CheckpointInfo, SessionError> {
        if self.session.own_workspace.is_some() {
            return self.take_copy_checkpoint().await;
        }
        let spec = self.child_spec();
        let session = self.session.id;
        let Some(live) = self.kernel.as_mut() else {
            return Err(SessionError::KernelNotRunning);
        };
        if !live.process.can_hold_as_checkpoint() {
            // Asked first: forked, the session would have gone on with the copy and lost
            // the kernel it had, for a checkpoint that could not be kept.
            return Err(SessionError::ForkRefused {
                session,
                why: format!(
                    "its kernel's copy could not be frozen: the {} sandbox has no freezer for \
                     this kernel (checkpoints need a kernel forked from its user's template, in \
                     a cgroup leaf of its own: the local sandbox with cgroups, or Docker with \
                     the broker as root)",
                    self.sandbox.name()
                ),
            });
        }
        let child = fork_connected(&self.sandbox, self.config.kernel, session, live, spec)
            .await
            .map_err(|e| failed("checkpoint", e))?;
        let Some(parent) = self.swap_live(child).await else {
            return Err(SessionError::KernelNotRunning);
        };
        let process = parent.process.clone();
        let held = run_blocking(move || process.hold_as_checkpoint(true)).await;
        if let Err(why) = held {
            // The child has everything: the session goes on with it; the parent goes.
            parent.process.terminate().await;
            return Err(SessionError::CheckpointFailed {
                session,
                action: "checkpoint",
                why: format!("its copy could not be frozen: {why}"),
                source: None,
            });
        }
        Ok(self
            .keep_checkpoint(Uuid::new_v4(), HeldKernel::Frozen(Box::new(parent)), None)
            .await)
    }

    /// A checkpoint of a session with a workspace of its own: the live kernel copied into
    /// a sandbox of its own (`sandbox/local/copy.rs`) with a copy of the workspace named by
    /// the checkpoint's id, and frozen there; the live kernel goes on as it was. A rewind
    /// copies both back (the session's workspace replaced by the checkpoint's), a fork of
    /// the checkpoint copies both into the new session. A copy holds its own memory, not
    /// pages shared with the live kernel: the user's checkpoint memory bound counts it.
    async fn take_copy_checkpoint(&mut self) -> Result<CheckpointInfo, SessionError> {
        let id = Uuid::new_v4();
        let mut spec = self.child_spec();
        spec.session_id = id;
        spec.own_workspace = Some(id);
        let session = self.session.id;
        let Some(live) = self.kernel.as_mut() else {
            return Err(SessionError::KernelNotRunning);
        };
        let copy = fork_connected(&self.sandbox, self.config.kernel, session, live, spec)
            .await
            .map_err(|e| failed("checkpoint", e))?;
        let process = copy.process.clone();
        let held = match process.can_hold_as_checkpoint() {
            true => run_blocking(move || process.hold_as_checkpoint(true))
                .await
                .map_err(|e| e.to_string()),
            false => Err(format!(
                "the {} sandbox has no freezer for this kernel (a cgroup leaf of its own)",
                self.sandbox.name()
            )),
        };
        if let Err(why) = held {
            copy.process.terminate().await;
            self.sandbox
                .remove_own_workspace(&self.session.user, id)
                .await;
            return Err(SessionError::CheckpointFailed {
                session,
                action: "checkpoint",
                why: format!("its copy could not be frozen: {why}"),
                source: None,
            });
        }
        Ok(self
            .keep_checkpoint(id, HeldKernel::Frozen(Box::new(copy)), Some(id))
            .await)
    }

    /// Keeps `kernel` (frozen) as checkpoint `id` of the session's state now, within the
    /// user's bounds (the oldest dropped first).
    pub(super) async fn keep_checkpoint(
        &mut self,
        id: Uuid,
        kernel: HeldKernel,
        workspace: Option<Uuid>,
    ) -> CheckpointInfo {
        let count = self.session.status().execution_count;
        self.keep_checkpoint_of(id, kernel, workspace, count).await
    }

    /// Keeps `kernel` as checkpoint `id` of the state after execution `execution_count`.
    pub(super) async fn keep_checkpoint_of(
        &mut self,
        id: Uuid,
        kernel: HeldKernel,
        workspace: Option<Uuid>,
        execution_count: u64,
    ) -> CheckpointInfo {
        let session = self.session.id;
        let info = CheckpointInfo {
            id,
            session,
            execution_count,
            created_at: Utc::now(),
            memory_bytes: kernel.process().memory_used(),
        };
        self.recorder.event(
            &self.session,
            &LifecycleEvent::CheckpointTaken {
                checkpoint: info.id,
                execution_count: info.execution_count,
            },
        );
        let process = kernel.process().clone();
        self.checkpoints.held.push(Held {
            info: info.clone(),
            kernel,
            workspace,
            spare: None,
        });
        if let Some((policy, book)) = self.checkpoints.policy.clone() {
            let owner = std::sync::Arc::downgrade(&self.session);
            let dropper: Dropper = Arc::new(move |id, why| {
                if let Some(owner) = owner.upgrade() {
                    let done = None;
                    let _ = owner.send(Command::DropCheckpoint { id, why, done });
                }
            });
            let user = self.session.user.name.clone();
            book.add((&user, session), info.id, process, dropper);
            for victim in book.over_budget(&user, &policy, info.id) {
                if victim.session == session {
                    self.drop_checkpoint(victim.id, victim.why).await;
                } else {
                    (victim.dropper)(victim.id, victim.why);
                }
            }
        }
        info
    }

    /// Forks checkpoint `id` into a connected kernel for `spec`; the checkpoint is thawed
    /// only meanwhile. A checkpoint whose kernel ended is dropped, found before the fork or
    /// by it: one a kernel of its session killed (its child, or parent, of the same uid)
    /// fails the fork at once, and is then dropped as one the OOM killer took is.
    async fn fork_checkpoint_kernel(
        &mut self,
        id: Uuid,
        spec: LaunchSpec,
        action: &'static str,
    ) -> Result<(Live, u64), SessionError> {
        let forked = self.fork_checkpoint_kernel_once(id, spec, action).await;
        // Only a failure of the checkpoint's own (not a refusal before it was asked, such
        // as the user's memory) may be its death.
        if let Err(
            SessionError::ForkFailed { .. }
            | SessionError::CheckpointFailed { .. }
            | SessionError::ForkTimedOut { .. },
        ) = &forked
        {
            let i = self.checkpoints.held.iter().position(|h| h.info.id == id);
            if let Some(i) = i {
                if self.checkpoints.held[i]
                    .kernel
                    .ended_within(ENDED_WAIT)
                    .await
                {
                    self.drop_checkpoint(id, CHECKPOINT_ENDED.into()).await;
                    return Err(SessionError::CheckpointNotFound {
                        session: self.session.id,
                        checkpoint: id,
                    });
                }
            }
        }
        forked
    }

    async fn fork_checkpoint_kernel_once(
        &mut self,
        id: Uuid,
        spec: LaunchSpec,
        action: &'static str,
    ) -> Result<(Live, u64), SessionError> {
        let session = self.session.id;
        let i = self
            .checkpoints
            .held
            .iter()
            .position(|h| h.info.id == id)
            .ok_or(SessionError::CheckpointNotFound {
                session,
                checkpoint: id,
            })?;
        if self.checkpoints.held[i].kernel.exited() {
            self.drop_checkpoint(id, CHECKPOINT_ENDED.into()).await;
            return Err(SessionError::CheckpointNotFound {
                session,
                checkpoint: id,
            });
        }
        if let HeldKernel::Waiting { .. } = self.checkpoints.held[i].kernel {
            return self.fork_held(i, spec, action).await;
        }
        let HeldKernel::Frozen(frozen) = &mut self.checkpoints.held[i].kernel else {
            unreachable!("a checkpoint is held or frozen");
        };
        let process = frozen.process.clone();
        let p = process.clone();
        // Thawed, then continued: a stop its live kernel sent it (its child on this
        // sandbox, of the same uid) was pending while it was frozen.
        run_blocking(move || {
            p.hold_as_checkpoint(false)?;
            p.continue_stopped();
            Ok(())
        })
        .await
        .map_err(|why| SessionError::CheckpointFailed {
            session,
            action,
            why: format!("the checkpoint could not be thawed: {why}"),
            source: None,
        })?;
        let held = &mut self.checkpoints.held[i];
        let count = held.info.execution_count;
        let HeldKernel::Frozen(frozen) = &mut held.kernel else {
            unreachable!("a checkpoint is held or frozen");
        };
        let child = fork_connected(&self.sandbox, self.config.kernel, session, frozen, spec).await;
        let p = process.clone();
        let refrozen = run_blocking(move || p.hold_as_checkpoint(true)).await;
        if let Err(why) = refrozen {
            self.drop_checkpoint(id, format!("it could not be frozen again: {why}"))
                .await;
        }
        let child = child.map_err(|e| failed(action, e))?;
        self.make_live_score(&child).await;
        Ok((child, count))
    }

    /// Makes a fork of checkpoint `id` the live kernel; a dead session lives again.
    pub(super) async fn rewind(&mut self, id: Uuid) -> Result<(), SessionError> {
        self.idle()?;
        let i = self.checkpoints.held.iter().position(|h| h.info.id == id);
        let spare = match i {
            Some(i) => self
                .take_spare(i)
                .await
                .map(|live| (live, self.checkpoints.held[i].info.execution_count)),
            None => None,
        };
        let (child, count) = match spare {
            Some(spare) => spare,
            None => {
                let spec = self.child_spec();
                self.fork_checkpoint_kernel(id, spec, "rewind").await?
            }
        };
        self.session.set_state(SessionState::Starting);
        if let Some(old) = self.swap_live(child).await {
            // Its end (SIGTERM, its leaf emptied and removed: ~12 ms) is not the rewound
            // session's business; nothing reads it any more.
            while self.checkpoints.ending.try_join_next().is_some() {}
            self.checkpoints.ending.spawn(async move {
                old.process.terminate().await;
            });
        }
        self.dead_reason = None;
        self.session.set_execution_count(count);
        self.session.set_state(SessionState::Idle);
        self.recorder.event(
            &self.session,
            &LifecycleEvent::SessionRewound {
                checkpoint: id,
                execution_count: count,
            },
        );
        // The next rewind here starts from a kernel made meanwhile.
        self.spare_for(id);
        Ok(())
    }

    /// A kernel for a new session (`spec`'s), forked from checkpoint `id`; with the
    /// execution count it starts from.
    pub(super) async fn fork_checkpoint(
        &mut self,
        id: Uuid,
        spec: LaunchSpec,
    ) -> Result<(Live, u64), SessionError> {
        self.fork_checkpoint_kernel(id, spec, "fork").await
    }

    pub(super) fn list_checkpoints(&mut self) -> CheckpointList {
        CheckpointList {
            checkpoints: self
                .checkpoints
                .held
                .iter_mut()
                .map(|h| CheckpointInfo {
                    // Its spare's kernel, if it has one, is its memory too.
                    memory_bytes: match h.spare.as_mut().and_then(Spare::memory_used) {
                        Some(spare) => h.kernel.process().memory_used().map(|m| m + spare),
                        None => h.kernel.process().memory_used(),
                    },
                    ..h.info.clone()
                })
                .collect(),
            dropped: self.checkpoints.dropped.iter().cloned().collect(),
            every_execution: self
                .checkpoints
                .policy
                .as_ref()
                .is_some_and(|(p, _)| p.every_execution),
        }
    }

    /// Ends checkpoint `id` (thawed first: a frozen process may not die), recording why.
    /// Whether there was one.
    pub(super) async fn drop_checkpoint(&mut self, id: Uuid, why: String) -> bool {
        let Some(i) = self.checkpoints.held.iter().position(|h| h.info.id == id) else {
            return false;
        };
        let mut held = self.checkpoints.held.remove(i);
        if let Some(spare) = held.spare.take() {
            end_spare(&mut self.checkpoints.ending, spare);
        }
        self.end_checkpoint(&held).await;
        self.recorder.event(
            &self.session,
            &LifecycleEvent::CheckpointDropped {
                checkpoint: id,
                execution_count: held.info.execution_count,
                reason: why.clone(),
            },
        );
        if self.checkpoints.dropped.len() >= DROPPED_KEPT {
            self.checkpoints.dropped.pop_front();
        }
        self.checkpoints.dropped.push_back(DroppedCheckpoint {
            id,
            execution_count: held.info.execution_count,
            dropped_at: Utc::now(),
            why,
        });
        true
    }

    async fn end_checkpoint(&self, held: &Held) {
        if let Some((_, book)) = &self.checkpoints.policy {
            book.remove(&self.session.user.name, held.info.id);
        }
        let p = held.kernel.process().clone();
        if let HeldKernel::Frozen(_) = held.kernel {
            if let Err(e) = run_blocking(move || p.hold_as_checkpoint(false)).await {
                tracing::warn!(session = %self.session.id, error = %e, "a checkpoint could not be thawed before its end");
            }
        }
        held.kernel.process().terminate().await;
        if let Some(key) = held.workspace {
            self.sandbox
                .remove_own_workspace(&self.session.user, key)
                .await;
        }
    }

    /// The session ends: so do its checkpoints (never kept across broker restarts).
    pub(super) async fn end_checkpoints(&mut self) {
        self.keep_pending().await;
        self.end_spares();
        for held in std::mem::take(&mut self.checkpoints.held) {
            self.end_checkpoint(&held).await;
        }
        while self.checkpoints.ending.join_next().await.is_some() {}
    }
}
