//! Forking a live session (issue 36): new sessions of the same user whose kernels are
//! copies of the session's live kernel, made by the kernel itself (`kb_fork_request`,
//! `kernels/kernel_broker_fork.py`) and adopted by the sandbox (`sandbox/fork.rs`).
//!
//! A fork is a session like a created one: it takes a place in the user's session quota and
//! its memory limit (the original's) from the user's total, both for all `count` forks
//! before anything is made (refused whole, with the errors a create gets). The forks are
//! made one after another (the kernel handles one request at a time); if one fails, those
//! made before it are ended and the whole request fails: nothing is half-made.
//!
//! The original must be idle: the fork copies the kernel between executions, and a request
//! sent while code runs would wait behind it in the kernel (and behind the queue in the
//! actor), so a busy session is refused at once (409) rather than holding the request for
//! as long as the code runs. The kernel's answer is untrusted: bounded (its size, the time
//! it takes: the launch timeout and `FORK_REPLY_GRACE`), parsed for one integer, and that pid is the sandbox's
//! to check.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use uuid::Uuid;

use super::{Registry, Shape};
use crate::sandbox::SandboxUser;
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::forking::adopt_connected;
use crate::session::front_door::{EndedBy, Provenance, SessionEnd};
use crate::session::handle::Session;
use crate::session::lifecycle::{ForkedFrom, LifecycleEvent};
use crate::session::memory::Reservation;
use crate::session::state::SessionState;
use crate::wire::{Channel, Signer};

/// The most forks one request may make.
pub const MAX_FORKS: u64 = 8;

/// A fork to make.
pub struct ForkRequest {
    /// Whose session it is (the forks are theirs too), and their session quota.
    pub user: SandboxUser,
    pub max_sessions: usize,
    /// The session to fork.
    pub session: Uuid,
    /// How many forks (1 ..= [`MAX_FORKS`]).
    pub count: u64,
    /// Fork this checkpoint of the session rather than its live kernel (which may then
    /// be busy).
    pub checkpoint: Option<Uuid>,
    /// The front door asking.
    pub provenance: Provenance,
}

impl Registry {
    /// Forks the caller's session `request.session` into `request.count` new sessions and
    /// waits until their kernels are ready. Another user's session answers as a missing one.
    pub async fn fork(&self, request: ForkRequest) -> Result<Vec<Arc<Session>>, SessionError> {
        if self.inner.shutdown.is_cancelled() {
            return Err(SessionError::ShuttingDown);
        }
        if !(1..=MAX_FORKS).contains(&request.count) {
            return Err(SessionError::InvalidForkCount {
                asked: request.count,
                max: MAX_FORKS,
            });
        }
        let user = &request.user;
        let parent = self.get(&user.name, request.session)?;
        if let Some(why) = self.config().copy_refusal(&parent.kernel_name) {
            return Err(SessionError::ForkRefused {
                session: parent.id,
                why,
            });
        }
        match parent.state() {
            _ if request.checkpoint.is_some() => {}
            SessionState::Idle => {}
            SessionState::Busy => return Err(SessionError::ForkBusy { session: parent.id }),
            state => {
                return Err(SessionError::ForkRefused {
                    session: parent.id,
                    why: format!("its kernel is {}, not idle", state.as_str()),
                })
            }
        }
        let ids: Vec<Uuid> = (0..request.count).map(|_| Uuid::new_v4()).collect();
        {
            let mut t = self.table();
            let live = t
                .sessions
                .values()
                .filter(|s| s.user.name == user.name)
                .count();
            let creating = t.creating.get(&user.name).copied().unwrap_or(0);
            if live + creating + ids.len() > request.max_sessions {
                return Err(SessionError::TooManySessions {
                    user: user.name.clone(),
                    live: live + creating,
                });
            }
            *t.creating.entry(user.name.clone()).or_default() += ids.len();
            t.creating_ids.extend(ids.iter().copied());
        }
        let result = self
            .make_forks(&parent, &ids, &request.provenance, request.checkpoint)
            .await;
        {
            let mut t = self.table();
            for id in &ids {
                Self::unreserve(&mut t, &user.name, *id);
            }
            if let Ok(forks) = &result {
                for s in forks {
                    // A fork pauses by itself as its parent does.
                    s.set_pause_policy(parent.pause_policy());
                    t.sessions.insert(s.id, s.clone());
                }
            }
        }
        self.inner.notify.notify_one();
        if let Ok(forks) = &result {
            self.inner.recorder.event(
                &parent,
                &LifecycleEvent::SessionForked {
                    sessions: forks.iter().map(|s| s.id).collect(),
                    execution_count: forks
                        .first()
                        .map(|s| s.status().execution_count)
                        .unwrap_or_default(),
                },
            );
            tracing::info!(session = %parent.id, user = %user.name, forks = forks.len(), "session forked");
        }
        result
    }

    /// All the forks or none: memory for all first, then one after another; a failure ends
    /// those made before it.
    async fn make_forks(
        &self,
        parent: &Arc<Session>,
        ids: &[Uuid],
        provenance: &Provenance,
        checkpoint: Option<Uuid>,
    ) -> Result<Vec<Arc<Session>>, SessionError> {
        let mut memory = Vec::with_capacity(ids.len());
        for _ in ids {
            // A refusal drops (gives back) the reservations made before it.
            memory.push(self.admit(&parent.user, &parent.limits).await?);
        }
        let mut made: Vec<Arc<Session>> = Vec::with_capacity(ids.len());
        for (id, memory) in ids.iter().zip(memory) {
            let forked = match checkpoint {
                None => self.fork_one(parent, *id, memory, provenance.clone()).await,
                Some(cp) => {
                    self.fork_checkpoint(parent, cp, *id, memory, provenance.clone())
                        .await
                }
            };
            match forked {
                Ok(fork) => made.push(fork),
                Err(e) => {
                    for fork in made {
                        fork.shutdown(SessionEnd::Closed(EndedBy::SetupFailed))
                            .await;
                        fork.release_memory();
                        // Never in the table: its workspace (a copy) goes here.
                        self.release_own_workspace(&fork).await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(made)
    }

    /// One fork of `parent`'s checkpoint `cp` as session `id` (the parent's actor forks it).
    async fn fork_checkpoint(
        &self,
        parent: &Arc<Session>,
        cp: Uuid,
        id: Uuid,
        memory: Reservation,
        provenance: Provenance,
    ) -> Result<Arc<Session>, SessionError> {
        let asked = Instant::now();
        let shape = fork_shape(parent, memory, provenance, id);
        let (session, commands_rx) = self.new_session(id, &parent.user, shape, None);
        let (done, forked) = oneshot::channel();
        parent.send(Command::ForkCheckpoint {
            checkpoint: cp,
            spec: session.launch_spec(Signer::random_key()),
            done,
        })?;
        let (live, execution_count) = forked
            .await
            .map_err(|_| SessionError::Closed(parent.id))??;
        session.set_execution_count(execution_count);
        let from = ForkedFrom {
            session: parent.id,
            execution_count,
            checkpoint: Some(cp),
        };
        self.start_session(&session, commands_rx, live, asked, false, Some(from))
            .await;
        Ok(session)
    }

    /// One fork of `parent`'s kernel as session `id`.
    async fn fork_one(
        &self,
        parent: &Arc<Session>,
        id: Uuid,
        memory: Reservation,
        provenance: Provenance,
    ) -> Result<Arc<Session>, SessionError> {
        let asked = Instant::now();
        let shape = fork_shape(parent, memory, provenance, id);
        let (session, commands_rx) = self.new_session(id, &parent.user, shape, None);
        let key = Signer::random_key();
        let sandbox = &self.inner.sandbox;
        let (route, mut replies) = mpsc::channel(4);
        let (done, sent) = oneshot::channel();
        parent.send(Command::Fork {
            spec: session.launch_spec(key.clone()),
            route,
            done,
        })?;
        let (prepared, execution_count) =
            sent.await.map_err(|_| SessionError::Closed(parent.id))??;
        let reply = async {
            while let Some((channel, m)) = replies.recv().await {
                if channel == Channel::Shell {
                    return Some(m);
                }
            }
            None
        };
        let cfg = &self.inner.config;
        let live = match adopt_connected(
            sandbox,
            cfg.kernel,
            parent.id,
            prepared,
            key,
            &parent.user.name,
            reply,
            "the kernel ended or was restarted before it answered",
        )
        .await
        {
            Ok(live) => live,
            Err(e) => {
                // A copy that never became a session: its workspace goes with it.
                self.release_own_workspace(&session).await;
                return Err(e);
            }
        };
        session.set_execution_count(execution_count);
        let from = ForkedFrom {
            session: parent.id,
            execution_count,
            checkpoint: None,
        };
        self.start_session(&session, commands_rx, live, asked, false, Some(from))
            .await;
        tracing::info!(session = %id, from = %parent.id, user = %parent.user.name, ms = asked.elapsed().as_millis() as u64, "forked session started");
        Ok(session)
    }
}

/// What a fork of `parent` is made as: its kernel spec, idle timeout and limits, the
/// memory reserved for it; the shared workspace, or (the parent has a workspace of its
/// own) a workspace of its own too, named by the fork's id `id`, which the sandbox fills
/// with a copy of the parent's.
fn fork_shape(parent: &Session, memory: Reservation, provenance: Provenance, id: Uuid) -> Shape {
    Shape {
        kernel_name: parent.kernel_name.clone(),
        idle_timeout: parent.idle_timeout,
        limits: parent.limits,
        memory,
        provenance,
        own_workspace: parent.own_workspace.map(|_| id),
        // A fork's kernel is a copy of the parent's, environment and all.
        secrets: parent.secrets.values(),
    }
}
