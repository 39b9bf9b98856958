//! Sessions across broker restarts (`--keep-sessions`): adopting what an earlier run kept,
//! the journal that keeps each session's record fresh, and letting go at the stop.
//!
//! At start, every record in `<data_dir>/sessions` is offered, oldest first:
//! - its user is gone from the users file: not adopted (the sandbox ends its kernel);
//! - its idle deadline passed while the broker was down (time down counts): expired at
//!   once, with a tombstone (410) as any expiry, and everything it held reclaimed;
//! - it was dead at the stop, or its kernel ended while the broker was down, or cannot be
//!   reached: the session comes back `dead` with the reason, and a restart revives it;
//! - otherwise the sandbox hands back the running kernel, the broker reconnects (probing
//!   on control: the kernel may still be busy with code sent before the stop), and the
//!   session resumes with its id, owner, kernel, execution count and idle deadline.
//!
//! Each adopted session's recording gets a `broker_restarted` event. Then the sandbox ends
//! the kept kernels no record claimed.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use tokio::time::timeout;

use super::{Registry, Shape};
use crate::kernel::{ConnectOptions, KernelClient, Readiness};
use crate::sandbox::{AdoptError, AdoptSpec, KernelLimits, KernelProcess, SandboxUser};
use crate::session::actor::Actor;
use crate::session::front_door::Provenance;
use crate::session::handle::{Restored, Session};
use crate::session::kept::SessionRecord;
use crate::session::launch::Live;
use crate::session::lifecycle::LifecycleEvent;

/// How often the journal refreshes the records of sessions that changed.
const JOURNAL_EVERY: Duration = Duration::from_secs(2);

/// What the adoption at start found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Adopted {
    /// Sessions back with their kernel running.
    pub alive: usize,
    /// Sessions back dead (their kernel ended meanwhile, or was dead already).
    pub dead: usize,
    /// Sessions whose idle deadline passed while the broker was down.
    pub expired: usize,
    /// Records not adopted (their user is gone).
    pub dropped: usize,
}

/// How a kept session comes back.
pub(super) enum Outcome {
    Alive(Box<Live>),
    Dead(String),
    /// Paused by an earlier run (issue 37): back with its images, no kernel, no memory.
    Paused(crate::sandbox::pause::PausedImage),
    /// Its idle deadline passed while the broker was down: back only to be expired.
    Expired,
}

impl Registry {
    /// Adopts every session an earlier run kept (see the module comment). `users` are the
    /// users of the settings now.
    pub async fn adopt_kept(&self, users: &[SandboxUser]) -> Adopted {
        let mut found = Adopted::default();
        let Some(kept) = self.inner.kept.clone() else {
            return found;
        };
        let records = {
            let kept = kept.clone();
            tokio::task::spawn_blocking(move || kept.load_all())
                .await
                .unwrap_or_default()
        };
        // A paused session is taken back from its own record (`pause.rs`), not as a kept
        // kernel's: its kept record goes.
        let paused: std::collections::HashSet<uuid::Uuid> = match &self.inner.paused_records {
            Some(store) => {
                let store = store.clone();
                tokio::task::spawn_blocking(move || store.load_all())
                    .await
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.id)
                    .collect()
            }
            None => Default::default(),
        };
        for record in records {
            if paused.contains(&record.id) {
                kept.remove(record.id).await;
                continue;
            }
            let Some(user) = users.iter().find(|u| u.name == record.user) else {
                tracing::warn!(session = %record.id, user = %record.user, "a kept session's user is no longer configured; its kernel is ended");
                kept.remove(record.id).await;
                found.dropped += 1;
                continue;
            };
            let idle_timeout = record.idle_timeout_seconds.map(Duration::from_secs);
            let idle_for = (Utc::now() - record.last_activity)
                .to_std()
                .unwrap_or_default();
            let expired = idle_timeout.is_some_and(|t| idle_for >= t);
            let down_seconds = (Utc::now() - record.saved_at)
                .to_std()
                .unwrap_or_default()
                .as_secs_f64();
            let outcome = if expired {
                Outcome::Expired
            } else if let Some(reason) = &record.dead_reason {
                Outcome::Dead(reason.clone())
            } else {
                self.reconnect(&record, user).await
            };
            let alive = matches!(outcome, Outcome::Alive(_));
            let session = self.restore(record, user, outcome).await;
            self.inner.recorder.event(
                &session,
                &LifecycleEvent::BrokerRestarted {
                    down_seconds,
                    kernel_alive: alive,
                },
            );
            if expired {
                found.expired += 1;
                self.expire(session).await;
                continue;
            }
            if alive {
                found.alive += 1;
            } else {
                found.dead += 1;
            }
            tracing::info!(session = %session.id, user = %user.name, alive, down_seconds, "kept session adopted");
        }
        self.inner.sandbox.discard_unadopted().await;
        if found != Adopted::default() {
            tracing::info!(
                alive = found.alive,
                dead = found.dead,
                expired = found.expired,
                dropped = found.dropped,
                "sessions kept by the previous run adopted"
            );
        }
        found
    }

    /// The kept kernel of `record`, adopted and connected again, or why not.
    async fn reconnect(&self, record: &SessionRecord, user: &SandboxUser) -> Outcome {
        let spec = AdoptSpec {
            // Kept under its own id when a resume or a rewind made it.
            session_id: record.kernel_id.unwrap_or(record.id),
            user: user.clone(),
            limits: limits_of(record),
            own_workspace: record.own_workspace,
        };
        let launched = match self.inner.sandbox.adopt(spec).await {
            Ok(l) => l,
            Err(AdoptError::Ended(reason)) => {
                return Outcome::Dead(format!("{reason} while the broker was stopped"))
            }
            Err(AdoptError::Missing) => {
                return Outcome::Dead(
                    "the kernel was not found after the broker restarted (it ended while the \
                     broker was stopped)"
                        .into(),
                )
            }
            Err(AdoptError::Failed(e)) => {
                return Outcome::Dead(format!("the kernel could not be adopted: {e}"))
            }
        };
        let process: Arc<dyn KernelProcess> = Arc::from(launched.process);
        let limit = self.inner.sandbox.launch_timeout();
        let options = ConnectOptions {
            readiness: Readiness::Running,
            ..self.inner.config.kernel
        };
        // Raced against the kernel's end: a kernel that dies while it is being reached
        // (it was ending as the broker came back) is told by its exit, not by a timeout.
        let connecting = timeout(
            limit,
            KernelClient::connect(&launched.endpoints, &record.key, &user.name, options, limit),
        );
        let connected = tokio::select! {
            connected = connecting => connected,
            reason = process.wait() => {
                return Outcome::Dead(format!("{reason} as the broker restarted"));
            }
        };
        match connected {
            Ok(Ok((client, events, _info))) => {
                let (tx, exit) = tokio::sync::oneshot::channel();
                let p = process.clone();
                tokio::spawn(async move {
                    let _ = tx.send(p.wait().await);
                });
                Outcome::Alive(Box::new(Live {
                    client,
                    events,
                    process,
                    key: record.key.clone(),
                    exit,
                }))
            }
            Ok(Err(e)) => {
                process.terminate().await;
                Outcome::Dead(format!(
                    "the kernel could not be reached after the broker restarted: {e}"
                ))
            }
            Err(_) => {
                process.terminate().await;
                Outcome::Dead(format!(
                    "the kernel did not answer within {limit:?} after the broker restarted"
                ))
            }
        }
    }

    /// The session of `record`, in the table with its actor running.
    pub(super) async fn restore(
        &self,
        record: SessionRecord,
        user: &SandboxUser,
        outcome: Outcome,
    ) -> Arc<Session> {
        let cfg = &self.inner.config;
        let limits = limits_of(&record);
        let memory = self
            .inner
            .ledger
            .reserve_adopted(&user.name, limits.memory_bytes);
        let idle_timeout = record.idle_timeout_seconds.map(Duration::from_secs);
        let (session, commands_rx) = self.new_session(
            record.id,
            user,
            Shape {
                kernel_name: record.kernel.clone(),
                idle_timeout,
                limits,
                memory,
                provenance: Provenance {
                    front_door: record.front_door,
                    metadata: record.metadata.clone(),
                },
                own_workspace: record.own_workspace,
                secrets: Arc::new(super::super::secrets::SessionSecrets::unseal(
                    cfg.sealer.as_ref(),
                    record.id,
                    record.secrets.as_deref(),
                )),
            },
            Some(Restored {
                created_at: record.created_at,
                last_activity: record.last_activity,
                execution_count: record.execution_count,
            }),
        );
        let parts = (self.inner.recorder.clone(), self.inner.pool.clone());
        let actor = match outcome {
            Outcome::Alive(live) => {
                let live = *live;
                session.set_kernel(live.process.clone(), &live.key).await;
                Actor::new(
                    session.clone(),
                    self.inner.sandbox.clone(),
                    cfg.clone(),
                    commands_rx,
                    Some(live),
                    parts.0,
                    parts.1,
                )
            }
            Outcome::Paused(image) => {
                // Paused: it holds no memory until it resumes.
                session.release_memory();
                let mut actor = Actor::new(
                    session.clone(),
                    self.inner.sandbox.clone(),
                    cfg.clone(),
                    commands_rx,
                    None,
                    parts.0,
                    parts.1,
                );
                actor.set_paused(image);
                actor
            }
            Outcome::Expired => Actor::without_kernel(
                session.clone(),
                self.inner.sandbox.clone(),
                cfg.clone(),
                commands_rx,
                "its idle timeout passed while the broker was stopped".into(),
                parts,
            ),
            Outcome::Dead(reason) => {
                self.inner.recorder.event(
                    &session,
                    &LifecycleEvent::KernelDied {
                        reason: reason.clone(),
                    },
                );
                let actor = Actor::without_kernel(
                    session.clone(),
                    self.inner.sandbox.clone(),
                    cfg.clone(),
                    commands_rx,
                    reason,
                    parts,
                );
                session.persist(false).await;
                actor
            }
        };
        tokio::spawn(actor.run());
        self.table().sessions.insert(session.id, session.clone());
        session
    }

    /// Refreshes the records of sessions that changed, every [`JOURNAL_EVERY`], so that
    /// after a crash the adopted state is at most that old.
    pub(super) async fn journal_task(self) {
        let mut every = tokio::time::interval(JOURNAL_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                () = self.inner.shutdown.cancelled() => return,
            }
            for session in self.all() {
                session.persist(false).await;
            }
        }
    }

    /// The broker is stopping and keeps its sessions: every actor answers what waits and
    /// lets go of its kernel, alive; then every record is written as of now. Idempotent.
    pub async fn detach_all(&self) {
        if self.inner.kept.is_none() {
            return;
        }
        self.inner.shutdown.cancel();
        let sessions = self.all();
        futures::future::join_all(sessions.iter().map(|s| s.detach())).await;
        futures::future::join_all(sessions.iter().map(|s| s.persist(true))).await;
    }
}

fn limits_of(record: &SessionRecord) -> KernelLimits {
    KernelLimits {
        memory_bytes: record.memory_limit_bytes,
        pids: record.pids_limit,
    }
}
