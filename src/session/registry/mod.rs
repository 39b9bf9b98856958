//! The registry of sessions: creation (with per-user quotas: a number of sessions, and
//! memory admission through the [`Ledger`]), lookup with ownership, listing, deletion and
//! shutdown. Idle expiry and the tombstones of expired sessions are
//! in `expiry.rs`; forks of a live session in `fork.rs`; the [`Session`] handle is in
//! `handle.rs`.

mod carry;
mod checkpoint;
mod expiry;
mod fork;
mod keep;
mod own;
mod pause;
mod shape;
mod snapshot;
#[cfg(test)]
mod tests;

use crate::kernel::spec::resolve_name;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::actor::Actor;
use super::command::Command;
use super::config::SessionConfig;
use super::error::SessionError;
use super::front_door::{EndedBy, FrontDoor, SessionEnd};
use super::handle::{HandleParts, Restored, Session};
use super::launch::{start_kernel, Live};
use super::lifecycle::{ForkedFrom, LifecycleEvent};
use super::memory::{Ledger, MemoryUse, Reservation};
use super::pool::Pool;
use super::recorder::Recorder;
use super::state::SessionState;
use crate::sandbox::{KernelLimits, Sandbox, SandboxUser};
use crate::sync::lock;
use crate::wire::Signer;

use expiry::Tombstone;
pub use fork::{ForkRequest, MAX_FORKS};
pub use keep::Adopted;
pub use shape::CreateOptions;
use shape::Shape;

#[derive(Default)]
struct Table {
    sessions: HashMap<Uuid, Arc<Session>>,
    tombstones: HashMap<Uuid, Tombstone>,
    /// Sessions being created, per user (counted against the quota).
    creating: HashMap<String, usize>,
    /// Ids of sessions being created.
    creating_ids: std::collections::HashSet<Uuid>,
}

struct Inner {
    table: Mutex<Table>,
    sandbox: Arc<dyn Sandbox>,
    config: SessionConfig,
    kernels: Vec<String>,
    notify: Arc<Notify>,
    shutdown: CancellationToken,
    recorder: Arc<dyn Recorder>,
    pool: Arc<Pool>,
    ledger: Arc<Ledger>,
    checkpoints: Arc<super::checkpoint::CheckpointBook>,
    /// The sessions' records (`--keep-sessions`); `None`: sessions end with the broker.
    kept: Option<Arc<super::kept::KeptSessions>>,
    /// Paused sessions' records (`<data_dir>/paused-sessions`): they outlive the broker.
    paused_records: Option<Arc<super::kept::KeptSessions>>,
    /// Every user's snapshots (`registry/snapshot.rs`).
    snapshots: super::snapshot::Snapshots,
}

/// All sessions of the broker. Cheap to clone.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

/// What asking a front door to end a session did ([`Registry::end_or_detach`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closing {
    /// The front door made the session: it ended.
    Ended,
    /// Another front door made it: this one let go of it, and it goes on.
    Detached,
}

/// The smallest memory limit a session may ask for.
pub const MIN_SESSION_MEMORY: u64 = 16 << 20;

impl Registry {
    /// `kernels` lists the kernel spec names the sandbox can launch; the first is the default.
    pub fn new(
        sandbox: Arc<dyn Sandbox>,
        config: SessionConfig,
        kernels: Vec<String>,
        recorder: Arc<dyn Recorder>,
    ) -> Self {
        let ledger = Ledger::new();
        let (pool, kernel) = (config.pool.clone(), config.kernel);
        let pool = Pool::new(pool, sandbox.clone(), kernel, ledger.clone());
        let paused_records = config.paused_dir.as_deref().and_then(|dir| {
            super::kept::KeptSessions::open(dir)
                .inspect_err(|e| {
                    tracing::error!(dir = %dir.display(), error = %e, "cannot keep paused sessions' records: paused sessions will NOT survive a restart")
                })
                .ok()
        });
        let kept = config.keep_dir.as_deref().and_then(|dir| {
            super::kept::KeptSessions::open(dir)
                .inspect_err(|e| {
                    tracing::error!(dir = %dir.display(), error = %e, "cannot keep session records: sessions will NOT survive a restart")
                })
                .ok()
        });
        let snapshots = super::snapshot::Snapshots::open(config.snapshots_dir.as_deref());
        let inner = Arc::new(Inner {
            paused_records,
            snapshots,
            table: Mutex::new(Table::default()),
            sandbox,
            config,
            kernels,
            notify: Arc::new(Notify::new()),
            shutdown: CancellationToken::new(),
            recorder,
            pool,
            ledger,
            checkpoints: Default::default(),
            kept,
        });
        let registry = Registry { inner };
        tokio::spawn(registry.clone().expiry_task());
        if registry.inner.kept.is_some() {
            tokio::spawn(registry.clone().journal_task());
        }
        registry
    }

    pub fn config(&self) -> &SessionConfig {
        &self.inner.config
    }

    pub fn sandbox(&self) -> &Arc<dyn Sandbox> {
        &self.inner.sandbox
    }

    /// Kernels waiting in the warm pool.
    pub fn pooled(&self) -> usize {
        self.inner.pool.ready()
    }

    /// The memory `user`'s sessions and pooled kernels hold (their limits).
    pub fn memory_use(&self, user: &str) -> MemoryUse {
        self.inner.ledger.usage(user)
    }

    /// The memory all users' sessions and pooled kernels hold, together.
    pub fn memory_use_all(&self) -> MemoryUse {
        self.inner.ledger.usage_all()
    }

    pub fn kernel_names(&self) -> &[String] {
        &self.inner.kernels
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        lock(&self.inner.table)
    }

    /// Start a new session for `user` and wait until its kernel is ready.
    pub async fn create(
        &self,
        user: &SandboxUser,
        max_sessions: usize,
        mut opts: CreateOptions,
    ) -> Result<Arc<Session>, SessionError> {
        if self.inner.shutdown.is_cancelled() {
            return Err(SessionError::ShuttingDown);
        }
        let snapshot = self.snapshot_to_start(&user.name, &mut opts)?;
        let kernel_name = match opts.kernel {
            // A name or an alias of one (`ir`, `js`, `ts`: E2B's names).
            Some(k) => match resolve_name(&k, self.inner.kernels.iter().map(String::as_str)) {
                Some(name) => name.to_string(),
                None => return Err(SessionError::UnknownKernel(k)),
            },
            None => self
                .inner
                .kernels
                .first()
                .cloned()
                .unwrap_or_else(|| "python3".into()),
        };
        let cfg = &self.inner.config;
        let idle_timeout = match opts.idle_timeout_seconds {
            Some(0) => None,
            Some(s) => Some(Duration::from_secs(s).min(cfg.max_idle_timeout)),
            None if cfg.idle_timeout.is_zero() => None,
            None => Some(cfg.idle_timeout),
        };
        let limits = session_limits(user, opts.memory_limit_bytes)?;
        let id = opts.id.unwrap_or_else(Uuid::new_v4);
        let own_workspace = self.own_workspace_key(&user.name, id, opts.workspace)?;
        let proposed = opts.id;
        {
            let mut t = self.table();
            // The atomic check: under the table's lock, an id live, ended lately or being
            // created is taken, and this create reserves it (`creating_ids`) before the
            // lock is let go, so two creates proposing one id cannot both pass. A taken
            // id is refused, never swapped for a fresh one silently: the client asked for
            // this id and would otherwise talk to another session than it thinks.
            if t.sessions.contains_key(&id)
                || t.tombstones.contains_key(&id)
                || t.creating_ids.contains(&id)
            {
                return Err(SessionError::IdTaken { id });
            }
            let live = t
                .sessions
                .values()
                .filter(|s| s.user.name == user.name)
                .count();
            let creating = t.creating.get(&user.name).copied().unwrap_or(0);
            if live + creating >= max_sessions {
                return Err(SessionError::TooManySessions {
                    user: user.name.clone(),
                    live: live + creating,
                });
            }
            *t.creating.entry(user.name.clone()).or_default() += 1;
            t.creating_ids.insert(id);
        }
        let reserved = id;
        // A session that ended long ago (or on another node of a cluster) is only in the
        // recordings; asked after the reservation, so no create of this id can start
        // meanwhile. Random ids are not asked: a fresh v4 UUID names no session.
        if proposed.is_some() {
            let taken = match self.inner.recorder.is_recorded(id).await {
                Ok(false) => None,
                Ok(true) => Some(SessionError::IdTaken { id }),
                Err(source) => Some(SessionError::IdUnverified { id, source }),
            };
            if let Some(e) = taken {
                self.release(&user.name, reserved);
                return Err(e);
            }
        }
        // A ready kernel from the warm pool, unless the client chose the id or other
        // limits than the pool's.
        // Pooled kernels work in the shared workspace.
        let pooled = match proposed {
            // A pooled kernel was started without the session's secrets in its environment.
            None if limits == user.limits.kernel(None)
                && own_workspace.is_none()
                && opts.secrets.is_empty() =>
            {
                self.inner.pool.take(user, &kernel_name)
            }
            _ => {
                self.inner.pool.refill(user, &kernel_name);
                None
            }
        };
        let admitted = match pooled {
            Some((pooled_id, live, memory)) => Ok((pooled_id, Some(live), memory.into_session())),
            None => self
                .admit(user, &limits)
                .await
                .map(|memory| (id, None, memory)),
        };
        let result = match admitted {
            Ok((id, pooled, memory)) => {
                let shape = Shape {
                    kernel_name,
                    idle_timeout,
                    limits,
                    memory,
                    provenance: opts.provenance,
                    own_workspace,
                    secrets: Arc::new(opts.secrets),
                };
                self.launch(id, user, shape, pooled, snapshot).await
            }
            Err(e) => Err(e),
        };
        {
            let mut t = self.table();
            Self::unreserve(&mut t, &user.name, reserved);
            if let Ok(s) = &result {
                t.sessions.insert(s.id, s.clone());
            }
        }
        self.inner.notify.notify_one();
        result
    }

    /// Gives back what a create reserved (its place in the user's quota, its id).
    fn release(&self, user: &str, reserved: Uuid) {
        Self::unreserve(&mut self.table(), user, reserved);
        self.inner.notify.notify_one();
    }

    fn unreserve(t: &mut Table, user: &str, reserved: Uuid) {
        t.creating_ids.remove(&reserved);
        if let Some(n) = t.creating.get_mut(user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                t.creating.remove(user);
            }
        }
    }

    /// Reserves the memory of a new session of `user` ([`Pool::admit`]).
    async fn admit(
        &self,
        user: &SandboxUser,
        limits: &KernelLimits,
    ) -> Result<Reservation, SessionError> {
        self.inner.pool.admit(user, limits).await
    }

    async fn launch(
        &self,
        id: Uuid,
        user: &SandboxUser,
        shape: Shape,
        pooled: Option<Live>,
        snapshot: Option<Arc<super::snapshot::Snapshot>>,
    ) -> Result<Arc<Session>, SessionError> {
        let asked = Instant::now();
        let cfg = &self.inner.config;
        let (session, commands_rx) = self.new_session(id, user, shape, None);
        let from_pool = pooled.is_some();
        let live = match (pooled, &snapshot) {
            (Some(live), _) => live,
            (None, Some(snapshot)) => self.start_from_snapshot(&session, snapshot).await?,
            (None, None) => {
                start_kernel(
                    &self.inner.sandbox,
                    session.launch_spec(Signer::random_key()),
                    cfg.kernel,
                )
                .await?
            }
        };
        let from = snapshot.map(|s| s.lineage());
        self.start_session(&session, commands_rx, live, asked, from_pool, from)
            .await;
        tracing::info!(session = %id, user = %user.name, "session started");
        Ok(session)
    }

    /// Gives `session` its connected kernel and its actor, and reports it created.
    async fn start_session(
        &self,
        session: &Arc<Session>,
        commands_rx: mpsc::Receiver<Command>,
        live: Live,
        asked: Instant,
        from_pool: bool,
        forked_from: Option<ForkedFrom>,
    ) {
        let cfg = &self.inner.config;
        session.touch();
        session.set_kernel(live.process.clone(), &live.key).await;
        let actor = Actor::new(
            session.clone(),
            self.inner.sandbox.clone(),
            cfg.clone(),
            commands_rx,
            Some(live),
            self.inner.recorder.clone(),
            self.inner.pool.clone(),
        );
        self.inner.recorder.event(
            session,
            &LifecycleEvent::SessionCreated {
                kernel: session.kernel_name.clone(),
                idle_timeout_seconds: session.idle_timeout.map(|t| t.as_secs()),
                provenance: session.provenance.clone(),
                forked_from,
                own_workspace: session.own_workspace.is_some(),
            },
        );
        self.inner.recorder.event(
            session,
            &LifecycleEvent::KernelStarted {
                startup_seconds: asked.elapsed().as_secs_f64(),
                pooled: from_pool,
            },
        );
        session.set_state(SessionState::Idle);
        tokio::spawn(actor.run());
    }

    /// A session handle of this registry (state `starting`) and its actor's command queue.
    fn new_session(
        &self,
        id: Uuid,
        user: &SandboxUser,
        shape: Shape,
        restored: Option<Restored>,
    ) -> (Arc<Session>, mpsc::Receiver<Command>) {
        let cfg = &self.inner.config;
        let (commands_tx, commands_rx) = mpsc::channel(cfg.max_queue + 64);
        let session = Arc::new(Session::new(
            id,
            user.clone(),
            HandleParts {
                kernel_name: shape.kernel_name,
                idle_timeout: shape.idle_timeout,
                limits: shape.limits,
                provenance: shape.provenance,
                memory: shape.memory,
                commands: commands_tx,
                // Two of the largest messages a kernel may send.
                event_budget: usize::try_from(cfg.kernel.limits.max_message.saturating_mul(2))
                    .unwrap_or(usize::MAX),
                max_queue: cfg.max_queue,
                notify_registry: self.inner.notify.clone(),
                kept: self.inner.kept.clone(),
                restored,
                own_workspace: shape.own_workspace,
                paused_records: self.inner.paused_records.clone(),
                secrets: super::secrets::SessionSecrets::new(
                    cfg.secret_book.clone(),
                    cfg.sealer.clone(),
                    id,
                    shape.secrets,
                ),
            },
        ));
        (session, commands_rx)
    }

    /// Reports something that happened to `session` outside its actor (an egress request of
    /// its kernel, a workspace file changed or a command run through the API) to the
    /// recording, through the same [`Recorder`] as the actor's own events.
    pub fn report(&self, session: &Session, event: &LifecycleEvent) {
        self.inner.recorder.event(session, event);
    }

    /// The caller's session `id`. Another user's session answers as a missing one.
    pub fn get(&self, user: &str, id: Uuid) -> Result<Arc<Session>, SessionError> {
        let t = self.table();
        if let Some(s) = t.sessions.get(&id) {
            if s.user.name == user {
                return Ok(s.clone());
            }
            return Err(SessionError::NotFound(id));
        }
        match t.tombstones.get(&id) {
            // Past its time a tombstone is gone, even before the expiry task sweeps it.
            Some(ts) if ts.user == user && ts.forget_at > Instant::now() => {
                Err(SessionError::Expired {
                    id,
                    at: ts.expired_at,
                    idle_secs: ts.idle_secs,
                })
            }
            _ => Err(SessionError::NotFound(id)),
        }
    }

    /// The caller's live sessions, oldest first.
    pub fn list(&self, user: &str) -> Vec<Arc<Session>> {
        let mut v: Vec<_> = self
            .table()
            .sessions
            .values()
            .filter(|s| s.user.name == user)
            .cloned()
            .collect();
        v.sort_by_key(|s| s.created_at);
        v
    }

    /// Every live session (for metrics).
    pub fn all(&self) -> Vec<Arc<Session>> {
        self.table().sessions.values().cloned().collect()
    }

    /// Shut a session down and forget it; `by` is recorded as who ended it.
    pub async fn delete(&self, user: &str, id: Uuid, by: EndedBy) -> Result<(), SessionError> {
        let session = self.get(user, id)?;
        self.table().sessions.remove(&id);
        session.shutdown(SessionEnd::Closed(by)).await;
        self.after_removal(&session).await;
        tracing::info!(session = %id, user, by = by.as_str(), "session deleted");
        Ok(())
    }

    /// A client of `door` asks to end session `id`: the session ends if `door` made it;
    /// otherwise `door` only lets go of it (recorded as `session_detached`) and the session
    /// goes on, for the front door that owns it.
    pub async fn end_or_detach(
        &self,
        user: &str,
        id: Uuid,
        door: FrontDoor,
    ) -> Result<Closing, SessionError> {
        let session = self.get(user, id)?;
        if session.provenance.front_door == door {
            self.delete(user, id, EndedBy::Client(door)).await?;
            return Ok(Closing::Ended);
        }
        self.report(&session, &LifecycleEvent::SessionDetached { by: door });
        tracing::info!(session = %id, user, by = door.as_str(), owner = session.provenance.front_door.as_str(), "front door let go of a session it did not make");
        Ok(Closing::Detached)
    }

    async fn after_removal(&self, session: &Session) {
        // The kernel is gone (shutdown waited for it): its memory is free again.
        session.release_memory();
        session.forget_record().await;
        self.release_own_workspace(session).await;
        let user_has_more = self
            .table()
            .sessions
            .values()
            .any(|s| s.user.name == session.user.name);
        if !user_has_more {
            self.inner.sandbox.user_idle(&session.user).await;
        }
    }

    /// Shut every session down and release the sandbox; with `--keep-sessions`, let every
    /// session go with its kernel running instead, for the next run to adopt.
    pub async fn shutdown(&self) {
        if self.inner.kept.is_some() {
            self.detach_all().await;
            let sessions: Vec<_> = self.table().sessions.drain().map(|(_, s)| s).collect();
            sessions.iter().for_each(|s| s.release_memory());
            // Pooled kernels are no session's: they end.
            self.inner.pool.drain().await;
            self.inner.sandbox.shutdown().await;
            tracing::info!(
                sessions = sessions.len(),
                "sessions kept for the next start"
            );
            return;
        }
        self.inner.shutdown.cancel();
        let all: Vec<_> = self.table().sessions.drain().map(|(_, s)| s).collect();
        let n = all.len();
        let (sessions, ending) = self.let_paused_go(all).await;
        let end = SessionEnd::Closed(EndedBy::BrokerShutdown);
        futures::future::join_all(sessions.iter().map(|s| s.shutdown(end))).await;
        sessions.iter().for_each(|s| s.release_memory());
        self.remove_own_workspaces(&ending).await;
        self.inner.pool.drain().await;
        self.inner.sandbox.shutdown().await;
        tracing::info!(sessions = n, "all sessions shut down");
    }
}

/// The limits of a new session of `user` asking for `memory_limit_bytes`.
fn session_limits(
    user: &SandboxUser,
    memory_limit_bytes: Option<u64>,
) -> Result<KernelLimits, SessionError> {
    if let Some(asked) = memory_limit_bytes {
        let total = user.limits.memory_bytes;
        if asked < MIN_SESSION_MEMORY || (total > 0 && asked > total) {
            return Err(SessionError::InvalidMemoryLimit {
                user: user.name.clone(),
                asked,
                min: MIN_SESSION_MEMORY,
                total,
            });
        }
    }
    Ok(user.limits.kernel(memory_limit_bytes))
}
