//! The actor's side of pausing a session to disk and resuming it (issue 37;
//! `sandbox/pause.rs` says what the sandbox does). A pause runs between executions, like a
//! checkpoint: the live kernel holds a child, the sandbox dumps that child's images, and
//! only then does the live kernel end and its memory go back to its user. A resume
//! reserves the memory again, has the sandbox restore the images into a new sandbox of the
//! session's, connects to the kernel built there, and makes it the live kernel; the images
//! go once it is ready. Any use of a paused session resumes it first (`Actor::on_command`).

use std::time::{Duration, Instant};

use super::Actor;
use crate::sandbox::fork::PreparedFork;
use crate::sandbox::pause::PausedImage;
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::execution::{failed, ExecutionStatus};
use crate::session::forking::{fork_error, requested_pid};
use crate::session::launch::connect_kernel;
use crate::session::lifecycle::LifecycleEvent;
use crate::session::pause::PauseInfo;
use crate::session::state::SessionState;

impl Actor {
    /// Pauses the session to disk; a paused one stays as it is.
    pub(super) async fn pause(&mut self) -> Result<PauseInfo, SessionError> {
        let session = self.session.id;
        let execution_count = self.session.status().execution_count;
        if let Some(image) = &self.paused {
            return Ok(PauseInfo {
                image_bytes: image.bytes,
                execution_count,
                took: Duration::ZERO,
            });
        }
        if self.running.is_some() || !self.queue.is_empty() {
            return Err(SessionError::PauseBusy { session });
        }
        let started = Instant::now();
        let spec = self.child_spec();
        if self.kernel.is_none() {
            return Err(SessionError::KernelNotRunning);
        }
        // A paused session holds no kernel: a rewind's spare goes too.
        self.end_spares();
        let Some(live) = self.kernel.as_ref() else {
            return Err(SessionError::KernelNotRunning);
        };
        live.process.settle().await;
        let prepared = self
            .sandbox
            .prepare_pause(&*live.process, spec)
            .await
            .map_err(|e| as_pause_error(fork_error(session, e)))?;
        let image = self.dump_held(prepared).await.map_err(as_pause_error)?;
        // Recorded before the kernel ends: a broker killed from here on finds the session
        // paused at its next start (its kept kernel, if any, is then let go); killed before
        // it, the session's kernel (kept with --keep-sessions) runs on as it was.
        let kernel_id = image.kernel_id;
        self.session.save_paused(kernel_id).await;
        // The state is on disk: the kernel, its memory and its reservation go. Where the
        // sandbox allows, after the answer (its end, SIGKILL and its sandbox emptied, is
        // 15-35 ms); a carry and the session's end wait for it, a resume only when its
        // memory needs that kernel's share back.
        let (old, memory) = (self.kernel.take(), self.session.take_memory());
        let (sandbox, user, own) = (
            self.sandbox.clone(),
            self.session.user.clone(),
            self.session.own_workspace,
        );
        let end = async move {
            if let Some(old) = old {
                old.process.terminate().await;
            }
            if let Some(key) = own {
                sandbox.release_paused(&user, key).await;
            }
            drop(memory);
        };
        if self.sandbox.paused_kernel_ends_after_answer() {
            while self.checkpoints.ending.try_join_next().is_some() {}
            self.checkpoints.ending.spawn(end);
        } else {
            end.await;
        }
        self.routes.clear();
        self.carry(&image).await;
        let info = PauseInfo {
            image_bytes: image.bytes,
            execution_count,
            took: started.elapsed(),
        };
        tracing::info!(%session, image_bytes = image.bytes, dump_ms = image.dump_time.as_millis() as u64, ms = info.took.as_millis() as u64, "session paused");
        self.paused = Some(image);
        self.session.set_state(SessionState::Paused);
        self.recorder.event(
            &self.session,
            &LifecycleEvent::SessionPaused {
                execution_count,
                image_bytes: info.image_bytes,
            },
        );
        Ok(info)
    }

    /// Takes a snapshot of the session's kernel for `spec` (the snapshot's id and own
    /// workspace): the kernel's held child dumped, the kernel going on as it was.
    pub(super) async fn snapshot(
        &mut self,
        spec: crate::sandbox::LaunchSpec,
    ) -> Result<(PausedImage, u64), SessionError> {
        let session = self.session.id;
        if self.running.is_some() || !self.queue.is_empty() {
            return Err(SessionError::SnapshotBusy { session });
        }
        let Some(live) = self.kernel.as_ref() else {
            return Err(SessionError::KernelNotRunning);
        };
        let execution_count = self.session.status().execution_count;
        live.process.settle().await;
        let prepared = self
            .sandbox
            .prepare_snapshot(&*live.process, spec)
            .await
            .map_err(|e| as_snapshot_error(fork_error(session, e)))?;
        let image = self.dump_held(prepared).await.map_err(as_snapshot_error)?;
        Ok((image, execution_count))
    }

    /// Has the live kernel hold a child for `prepared` and the sandbox dump it; the kernel
    /// goes on. A fork's errors.
    async fn dump_held(&mut self, prepared: PreparedFork) -> Result<PausedImage, SessionError> {
        let session = self.session.id;
        let Some(live) = self.kernel.as_mut() else {
            self.sandbox.discard_fork(prepared).await;
            return Err(SessionError::KernelNotRunning);
        };
        let (prepared, pid) = requested_pid(&self.sandbox, session, live, prepared).await?;
        self.sandbox
            .dump_paused(prepared, pid)
            .await
            .map_err(|e| fork_error(session, e))
    }

    /// Resumes a paused session (one that is not paused is left as it is). A resume that
    /// fails leaves the session dead, saying why; its images go.
    pub(super) async fn resume(&mut self) -> Result<(), SessionError> {
        let Some(image) = self.paused.take() else {
            return Ok(());
        };
        let session = self.session.id;
        let started = Instant::now();
        self.stop_carrying();
        if let Some(carrier) = self.config.carrier.get() {
            // Carried: resumed here only while this node holds it, and then its copy goes.
            let why = match carrier.before_resume(session).await {
                Ok(true) => None,
                Ok(false) => Some("another node took it over while this one was not live".into()),
                Err(e) => Some(format!("the cluster's database does not answer ({e})")),
            };
            if let Some(why) = why {
                self.paused = Some(image);
                return Err(SessionError::ResumeElsewhere { session, why });
            }
        }
        let mut admitted = self
            .pool
            .admit(&self.session.user, &self.session.limits)
            .await;
        if admitted.is_err() && !self.checkpoints.ending.is_empty() {
            // The kernel it was paused from may still hold its reservation: asked again
            // once it has ended (SIGKILLed as the pause was answered: milliseconds).
            self.kernel_ended().await;
            admitted = self
                .pool
                .admit(&self.session.user, &self.session.limits)
                .await;
        }
        let memory = match admitted {
            Ok(memory) => memory,
            Err(e) => {
                // Still paused: the user may end another session and ask again.
                self.paused = Some(image);
                return Err(e);
            }
        };
        self.session.set_state(SessionState::Starting);
        let mut spec = self.child_spec();
        spec.session_id = image.kernel_id;
        let (key, user) = (spec.key.clone(), spec.user.name.clone());
        let limit = self.sandbox.launch_timeout();
        let live = match self.sandbox.resume_paused(&image, spec).await {
            Ok(launched) => connect_kernel(launched, key, &user, self.config.kernel, limit)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let live = match live {
            Ok(live) => live,
            Err(why) => {
                drop(memory);
                self.sandbox.discard_paused(image).await;
                self.session.forget_paused().await;
                let reason = format!("its paused state could not be resumed: {why}");
                self.dead_reason = Some(reason.clone());
                self.session.set_dead(reason.clone());
                self.recorder.event(
                    &self.session,
                    &LifecycleEvent::KernelDied {
                        reason: reason.clone(),
                    },
                );
                return Err(SessionError::PauseFailed {
                    session,
                    action: "resume",
                    why: format!("{why}; the session is dead"),
                    source: None,
                });
            }
        };
        self.session.set_memory(memory);
        // The running kernel recorded (`--keep-sessions`) before the paused record goes,
        // and that before the images: a broker killed at any point here finds the session
        // kept, or paused with its images, at its next start.
        let _ = self.swap_live(live).await;
        self.session.forget_paused().await;
        self.sandbox.discard_paused(image).await;
        self.session.set_state(SessionState::Idle);
        let execution_count = self.session.status().execution_count;
        tracing::info!(%session, ms = started.elapsed().as_millis() as u64, "session resumed");
        self.recorder.event(
            &self.session,
            &LifecycleEvent::SessionResumed { execution_count },
        );
        Ok(())
    }

    /// The session ends: so do its paused images and record, and its copy if it was
    /// carried (still this node's).
    pub(super) async fn end_paused(&mut self) {
        self.stop_carrying();
        if let Some(image) = self.paused.take() {
            self.sandbox.discard_paused(image).await;
            self.session.forget_paused().await;
            if let Some(carrier) = self.config.carrier.get() {
                carrier.forget(self.session.id).await;
            }
        }
    }

    /// Cluster mode with `--carry-paused`: a copy of the session just paused, for the
    /// other nodes: its files handed out (its workspace unmounted) before the pause is
    /// answered, stored in the background after. One that cannot be made (a
    /// workspace shared with the user's other sessions, still in use, the database) leaves
    /// the session paused on this node only, as without the option.
    pub(super) async fn carry(&mut self, image: &PausedImage) {
        let session = self.session.id;
        let Some(carrier) = self.config.carrier.get().cloned() else {
            return;
        };
        if self.session.own_workspace != Some(session) {
            tracing::info!(%session, "paused session not carried to the other nodes: it has no workspace of its own (it shares its user's, or it is a code context of an E2B sandbox)");
            return;
        }
        // Its files go as they are once the kernel is gone.
        self.kernel_ended().await;
        let Some(sandbox) = self.sandbox.carry() else {
            tracing::info!(%session, "paused session not carried to the other nodes: this sandbox cannot carry its kernels");
            return;
        };
        let carried = match sandbox.carry_out(image, &self.session.user).await {
            Ok(carried) => carried,
            Err(e) => {
                tracing::info!(%session, error = %e, "paused session not carried to the other nodes");
                return;
            }
        };
        let mut record = self.session.record(true);
        record.paused_kernel = Some(image.kernel_id);
        let current = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        self.carrying = Some(current.clone());
        let copy = crate::session::carry::CopyOut::new(record, image.clone(), carried, current);
        // Stored after the pause is answered: until it is, the session is paused on this
        // node only (as without the option); a resume or an end meanwhile has it dropped.
        let carrier = carrier.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            match carrier.store(copy).await {
                Ok(bytes) => {
                    tracing::info!(%session, bytes, ms = started.elapsed().as_millis() as u64, "paused session carried to the cluster's database")
                }
                Err(e) => {
                    tracing::warn!(%session, error = %e, "paused session not carried to the other nodes")
                }
            }
        });
    }

    /// The session resumes or ends: a copy of it still being stored is not.
    /// Waits until the kernels ending in the background (a paused one, spares, those a
    /// rewind replaced) are gone.
    async fn kernel_ended(&mut self) {
        while self.checkpoints.ending.join_next().await.is_some() {}
    }

    fn stop_carrying(&mut self) {
        if let Some(current) = self.carrying.take() {
            current.store(false, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// The broker stops: a paused session's images and record stay for the next run
    /// (where its sandbox keeps them), else they go.
    pub(super) async fn detach_paused(&mut self) {
        if self.session.keeps_paused() && self.sandbox.keeps_paused() {
            self.paused.take();
            return;
        }
        self.end_paused().await;
    }

    /// A paused session taken back from an earlier run (`registry/pause.rs`).
    pub(crate) fn set_paused(&mut self, image: crate::sandbox::pause::PausedImage) {
        self.paused = Some(image);
        // Paused from now on, for whoever asks before the actor runs (a request right after
        // a takeover: E2B's `connect` resumes only a paused sandbox).
        self.session.set_state(SessionState::Paused);
    }

    /// Whether the session is paused.
    fn is_paused(&self) -> bool {
        self.paused.is_some()
    }

    /// `cmd`, to be done: any use of a paused session's kernel resumes it first. `None`
    /// when it could not be resumed and stays paused (no memory left): `cmd` is answered
    /// with that error. A session that died resuming gets `cmd` back, answered as a dead
    /// session answers.
    pub(super) async fn resumed_for(&mut self, cmd: Command) -> Option<Command> {
        if !self.is_paused() || !cmd.uses_kernel() {
            return Some(cmd);
        }
        match self.resume().await {
            Err(e) if self.is_paused() => {
                self.refuse(cmd, e);
                None
            }
            _ => Some(cmd),
        }
    }

    /// Answers `cmd` with `e` without doing it.
    fn refuse(&mut self, cmd: Command, e: SessionError) {
        match cmd {
            Command::Execute(req) => {
                self.session.pending_dec();
                let _ = req.done.send(failed(
                    ExecutionStatus::Error,
                    "SessionPaused",
                    format!("the session is paused and could not be resumed: {e}"),
                ));
            }
            Command::Interrupt(done) | Command::Restart(done) | Command::Rewind { done, .. } => {
                let _ = done.send(Err(e));
            }
            Command::Fork { done, .. } => {
                let _ = done.send(Err(e));
            }
            Command::Checkpoint { done } => {
                let _ = done.send(Err(e));
            }
            Command::Snapshot { done, .. } => {
                let _ = done.send(Err(e));
            }
            other => {
                tracing::debug!(session = %self.session.id, error = %e, command = other.name(), "not resumed");
            }
        }
    }
}

/// A fork's error as the pause's (a refusal stays a refusal: 409).
fn as_pause_error(e: SessionError) -> SessionError {
    match e {
        SessionError::ForkRefused { session, why } => SessionError::PauseRefused { session, why },
        SessionError::NoRoomForCopy { session, why } => {
            SessionError::NoRoomToPause { session, why }
        }
        SessionError::ForkFailed {
            session,
            why,
            source,
        } => SessionError::PauseFailed {
            session,
            action: "pause",
            why,
            source,
        },
        SessionError::ForkTimedOut { session, limit } => SessionError::PauseFailed {
            session,
            action: "pause",
            why: format!("its kernel did not answer within {limit:?}"),
            source: None,
        },
        e => e,
    }
}

/// A fork's error as the snapshot's (a refusal stays a refusal: 409).
fn as_snapshot_error(e: SessionError) -> SessionError {
    match e {
        SessionError::ForkRefused { session, why } => {
            SessionError::SnapshotRefused { session, why }
        }
        SessionError::NoRoomForCopy { session, why } => {
            SessionError::NoRoomForSnapshot { session, why }
        }
        SessionError::ForkFailed {
            session,
            why,
            source,
        } => SessionError::SnapshotFailed {
            what: format!("a snapshot of session {session}"),
            why,
            source,
        },
        SessionError::ForkTimedOut { session, limit } => SessionError::SnapshotFailed {
            what: format!("a snapshot of session {session}"),
            why: format!("its kernel did not answer within {limit:?}"),
            source: None,
        },
        e => e,
    }
}
