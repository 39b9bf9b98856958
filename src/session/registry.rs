//! The registry of sessions: creation (with per-user quotas), lookup with ownership,
//! deletion, idle expiry and shutdown. Also the [`Session`] handle itself.
//!
//! Idle expiry follows mini-redis's purge task: one background task sleeps until the
//! earliest expiry deadline, or until woken by a change, and expires what is due.
//!
//! What counts as activity (and so postpones expiry): creating the session, an execute
//! request being received and an execution finishing, an `input_reply`, interrupt,
//! restart, a file read or written through the API, and any message a client sends to the
//! kernel over a WebSocket. What does not: reading the session (GET, list), opening or
//! closing a WebSocket, and output the kernel produces on its own. A busy session (an
//! execution running) is never expired unless it has been busy for longer than `max_busy`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::actor::{start_kernel, Actor};
use super::execution::Execution;
use super::pool::Pool;
use super::{
    Command, ExecRequest, LifecycleEvent, Recorder, ReplyRoute, SessionConfig, SessionError,
    SessionEvent, SessionInfo, SessionState,
};
use crate::sandbox::{LaunchSpec, Sandbox, SandboxUser};
use crate::sync::lock;
use crate::wire::{Channel, Message, Signer};

struct Status {
    state: SessionState,
    last_activity: DateTime<Utc>,
    last_activity_at: Instant,
    busy_since: Option<Instant>,
    kernel_busy: bool,
    execution_count: u64,
    dead_reason: Option<String>,
}

/// A handle to one session. Cheap to share; the kernel itself lives in the session's task.
pub struct Session {
    pub id: Uuid,
    pub user: SandboxUser,
    pub kernel_name: String,
    pub created_at: DateTime<Utc>,
    /// `None`: never expires.
    pub idle_timeout: Option<Duration>,
    status: Mutex<Status>,
    commands: mpsc::Sender<Command>,
    events: broadcast::Sender<SessionEvent>,
    /// Bytes of iopub messages in the event ring and its receivers.
    event_budget: EventBudget,
    /// Messages left out of the broadcast for the budget (for one summary log line each
    /// time the count doubles).
    events_dropped: AtomicUsize,
    pending: AtomicUsize,
    connections: AtomicUsize,
    max_queue: usize,
    notify_registry: Arc<Notify>,
}

/// Bytes a session's broadcast events may hold at once.
struct EventBudget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

impl EventBudget {
    fn new(limit: usize) -> Self {
        Self {
            used: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    /// Takes `bytes` of the budget, or nothing when they do not fit.
    fn charge(&self, bytes: usize) -> Option<Arc<EventBytes>> {
        let before = self.used.fetch_add(bytes, Ordering::AcqRel);
        let held = Arc::new(EventBytes {
            counter: self.used.clone(),
            bytes,
        });
        (before.saturating_add(bytes) <= self.limit).then_some(held)
    }
}

/// A message's share of its session's event budget, given back when the last copy of the
/// event is dropped (overwritten in the ring and seen by every receiver).
#[derive(Debug)]
pub struct EventBytes {
    counter: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for EventBytes {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl Session {
    fn status(&self) -> MutexGuard<'_, Status> {
        lock(&self.status)
    }

    pub fn info(&self) -> SessionInfo {
        let s = self.status();
        let expires_at = match (self.idle_timeout, s.state) {
            (
                Some(t),
                SessionState::Idle
                | SessionState::Busy
                | SessionState::Starting
                | SessionState::Dead,
            ) => chrono::Duration::from_std(t)
                .ok()
                .map(|t| s.last_activity + t),
            _ => None,
        };
        SessionInfo {
            id: self.id,
            user: self.user.name.clone(),
            kernel: self.kernel_name.clone(),
            state: s.state,
            created_at: self.created_at,
            last_activity: s.last_activity,
            expires_at,
            execution_count: s.execution_count,
            connections: self.connections.load(Ordering::Relaxed),
        }
    }

    pub fn state(&self) -> SessionState {
        self.status().state
    }

    /// Why the kernel died, when the session is dead.
    pub fn dead_reason(&self) -> Option<String> {
        self.status().dead_reason.clone()
    }

    /// Record activity now.
    pub fn touch(&self) {
        let mut s = self.status();
        s.last_activity = Utc::now();
        s.last_activity_at = Instant::now();
        drop(s);
        self.notify_registry.notify_one();
    }

    pub(crate) fn set_state(&self, state: SessionState) {
        let mut s = self.status();
        if s.state == state {
            return;
        }
        s.state = state;
        if state != SessionState::Dead {
            s.dead_reason = None;
        }
        drop(s);
        self.publish(SessionEvent::State(state));
    }

    pub(crate) fn set_busy(&self, busy: bool) {
        {
            let mut s = self.status();
            s.busy_since = if busy { Some(Instant::now()) } else { None };
        }
        self.refresh_state();
    }

    pub(crate) fn set_kernel_busy(&self, busy: bool) {
        self.status().kernel_busy = busy;
        self.refresh_state();
    }

    fn refresh_state(&self) {
        let next = {
            let s = self.status();
            if !matches!(s.state, SessionState::Idle | SessionState::Busy) {
                return;
            }
            if s.busy_since.is_some() || s.kernel_busy {
                SessionState::Busy
            } else {
                SessionState::Idle
            }
        };
        self.set_state(next);
    }

    pub(crate) fn set_dead(&self, reason: String) {
        {
            let mut s = self.status();
            s.busy_since = None;
            s.kernel_busy = false;
        }
        self.set_state(SessionState::Dead);
        self.status().dead_reason = Some(reason);
    }

    pub(crate) fn set_execution_count(&self, n: u64) {
        self.status().execution_count = n;
    }

    pub(crate) fn reset_execution_count(&self) {
        let mut s = self.status();
        s.execution_count = 0;
        s.kernel_busy = false;
        s.busy_since = None;
    }

    pub(crate) fn pending_dec(&self) {
        let _ = self
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    pub(crate) fn publish(&self, ev: SessionEvent) {
        // No receivers is fine: nobody is attached.
        let _ = self.events.send(ev);
    }

    /// Broadcasts an iopub message to the session's clients, within the byte budget: the
    /// ring keeps its last 1,024 events for lagging receivers, and a kernel may send
    /// messages up to the kernel message limit, so the count alone bounds nothing. Past
    /// the budget the message is left out (clients miss it, as a lagging client would;
    /// the execution's own result and the recording do not depend on the broadcast).
    pub(crate) fn publish_iopub(&self, msg: Arc<Message>, agent: bool) {
        if self.events.receiver_count() == 0 {
            return;
        }
        let size = msg.header.len()
            + msg.parent_header.len()
            + msg.metadata.len()
            + msg.content.len()
            + msg.buffers.iter().map(|b| b.len()).sum::<usize>();
        let Some(held) = self.event_budget.charge(size) else {
            let n = self.events_dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(session = %self.id, dropped = n, "iopub messages over the session's event budget were not broadcast");
            }
            return;
        };
        let _ = self.events.send(SessionEvent::Iopub { msg, agent, held });
    }

    pub(crate) fn launch_spec(&self, key: String) -> LaunchSpec {
        LaunchSpec {
            session_id: self.id,
            user: self.user.clone(),
            kernel_name: self.kernel_name.clone(),
            key,
            env: Vec::new(),
        }
    }

    /// Attach to the session's events (state changes, iopub).
    pub fn subscribe(&self) -> broadcast::Receiver<SessionEvent> {
        self.events.subscribe()
    }

    /// Count a WebSocket client while the guard lives.
    pub fn connect_client(self: &Arc<Self>) -> ConnectionGuard {
        self.connections.fetch_add(1, Ordering::Relaxed);
        ConnectionGuard(self.clone())
    }

    fn send(&self, cmd: Command) -> Result<(), SessionError> {
        self.commands.try_send(cmd).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SessionError::Quota(format!(
                "session {} has too many requests waiting; wait for some to finish",
                self.id
            )),
            mpsc::error::TrySendError::Closed(_) => SessionError::Closed(self.id),
        })
    }

    /// Queue an execution. Fails at once when the queue is full.
    pub fn execute(&self, req: ExecRequest) -> Result<(), SessionError> {
        let queued = self.pending.fetch_add(1, Ordering::AcqRel);
        if queued >= self.max_queue {
            self.pending_dec();
            return Err(SessionError::Quota(format!(
                "session {} already has {} executions waiting (the limit); wait for some to finish",
                self.id, queued
            )));
        }
        self.touch();
        self.send(Command::Execute(req))
            .inspect_err(|_| self.pending_dec())
    }

    /// Queue an execution and wait for its result.
    pub async fn execute_wait(
        &self,
        code: String,
        timeout: Duration,
    ) -> Result<Execution, SessionError> {
        let (done, rx) = oneshot::channel();
        self.execute(ExecRequest {
            code,
            timeout,
            allow_stdin: false,
            stream: None,
            done,
        })?;
        rx.await.map_err(|_| SessionError::Closed(self.id))
    }

    pub fn input_reply(&self, value: String) -> Result<(), SessionError> {
        self.send(Command::InputReply(value))
    }

    pub async fn interrupt(&self) -> Result<(), SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Interrupt(tx))?;
        rx.await.map_err(|_| SessionError::Closed(self.id))?
    }

    pub async fn restart(&self) -> Result<(), SessionError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Restart(tx))?;
        rx.await.map_err(|_| SessionError::Closed(self.id))?
    }

    /// Send a client's message to the kernel; replies to it go to `route`.
    pub fn forward(
        &self,
        channel: Channel,
        msg: Message,
        route: ReplyRoute,
    ) -> Result<(), SessionError> {
        self.send(Command::Forward {
            channel,
            msg,
            route,
        })
    }

    async fn shutdown(&self, state: SessionState) {
        let (tx, rx) = oneshot::channel();
        // Shutdown must get through even when the queue is full.
        if self
            .commands
            .send(Command::Shutdown { state, done: tx })
            .await
            .is_ok()
        {
            let _ = rx.await;
        }
        self.set_state(state);
    }

    /// When this session expires if nothing happens, or `None` if it cannot expire now.
    fn expiry_deadline(&self, max_busy: Duration) -> Option<Instant> {
        let t = self.idle_timeout?;
        let s = self.status();
        match s.state {
            SessionState::Expired | SessionState::Closed => None,
            SessionState::Busy => s.busy_since.map(|b| b + max_busy),
            _ => Some(s.last_activity_at + t),
        }
    }
}

/// Decrements the session's connection count when dropped.
pub struct ConnectionGuard(Arc<Session>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

struct Tombstone {
    user: String,
    expired_at: DateTime<Utc>,
    idle_secs: u64,
    forget_at: Instant,
}

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
}

/// All sessions of the broker. Cheap to clone.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

/// What a new session asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    pub kernel: Option<String>,
    /// Seconds; 0 means never (capped by the configured maximum).
    pub idle_timeout_seconds: Option<u64>,
    /// Use this id (the Jupyter API lets clients propose one).
    pub id: Option<Uuid>,
}

impl Registry {
    /// `kernels` lists the kernel spec names the sandbox can launch; the first is the default.
    pub fn new(
        sandbox: Arc<dyn Sandbox>,
        config: SessionConfig,
        kernels: Vec<String>,
        recorder: Arc<dyn Recorder>,
    ) -> Self {
        let pool = Pool::new(config.pool, sandbox.clone(), config.kernel);
        let inner = Arc::new(Inner {
            table: Mutex::new(Table::default()),
            sandbox,
            config,
            kernels,
            notify: Arc::new(Notify::new()),
            shutdown: CancellationToken::new(),
            recorder,
            pool,
        });
        let registry = Registry { inner };
        tokio::spawn(registry.clone().expiry_task());
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
        opts: CreateOptions,
    ) -> Result<Arc<Session>, SessionError> {
        if self.inner.shutdown.is_cancelled() {
            return Err(SessionError::KernelUnavailable(
                "the broker is shutting down".into(),
            ));
        }
        let kernel_name = match opts.kernel {
            Some(k) if !self.inner.kernels.contains(&k) => {
                return Err(SessionError::UnknownKernel(k))
            }
            Some(k) => k,
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
        let mut id = opts.id.unwrap_or_else(Uuid::new_v4);
        let mut proposed = opts.id;
        {
            let mut t = self.table();
            if t.sessions.contains_key(&id)
                || t.tombstones.contains_key(&id)
                || t.creating_ids.contains(&id)
            {
                // A proposed id that is taken (perhaps by another user: saying so would tell
                // that it exists) is ignored; the session gets a fresh one.
                id = Uuid::new_v4();
                proposed = None;
            }
            let live = t
                .sessions
                .values()
                .filter(|s| s.user.name == user.name)
                .count();
            let creating = t.creating.get(&user.name).copied().unwrap_or(0);
            if live + creating >= max_sessions {
                return Err(SessionError::Quota(format!(
                    "user {} already has {} sessions (the limit); delete one first",
                    user.name,
                    live + creating
                )));
            }
            *t.creating.entry(user.name.clone()).or_default() += 1;
            t.creating_ids.insert(id);
        }
        let reserved = id;
        // A ready kernel from the warm pool, unless the client chose the id.
        let pooled = match proposed {
            None => self.inner.pool.take(user, &kernel_name),
            Some(_) => {
                self.inner.pool.refill(user, &kernel_name);
                None
            }
        };
        let (id, pooled) = match pooled {
            Some((pooled_id, live)) => (pooled_id, Some(live)),
            None => (id, None),
        };
        let result = self
            .launch(id, user, kernel_name, idle_timeout, pooled)
            .await;
        {
            let mut t = self.table();
            t.creating_ids.remove(&reserved);
            if let Some(n) = t.creating.get_mut(&user.name) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    t.creating.remove(&user.name);
                }
            }
            if let Ok(s) = &result {
                t.sessions.insert(s.id, s.clone());
            }
        }
        self.inner.notify.notify_one();
        result
    }

    async fn launch(
        &self,
        id: Uuid,
        user: &SandboxUser,
        kernel_name: String,
        idle_timeout: Option<Duration>,
        pooled: Option<super::actor::Live>,
    ) -> Result<Arc<Session>, SessionError> {
        let asked = Instant::now();
        let cfg = &self.inner.config;
        let (commands_tx, commands_rx) = mpsc::channel(cfg.max_queue + 64);
        let (events, _) = broadcast::channel(1024);
        let now = Utc::now();
        let session = Arc::new(Session {
            id,
            user: user.clone(),
            kernel_name,
            created_at: now,
            idle_timeout,
            status: Mutex::new(Status {
                state: SessionState::Starting,
                last_activity: now,
                last_activity_at: Instant::now(),
                busy_since: None,
                kernel_busy: false,
                execution_count: 0,
                dead_reason: None,
            }),
            commands: commands_tx,
            events,
            // Two of the largest messages a kernel may send.
            event_budget: EventBudget::new(
                usize::try_from(cfg.kernel.limits.max_message.saturating_mul(2))
                    .unwrap_or(usize::MAX),
            ),
            events_dropped: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            max_queue: cfg.max_queue,
            notify_registry: self.inner.notify.clone(),
        });
        let from_pool = pooled.is_some();
        let live = match pooled {
            Some(live) => live,
            None => {
                start_kernel(
                    &self.inner.sandbox,
                    session.launch_spec(Signer::random_key()),
                    cfg.kernel,
                )
                .await?
            }
        };
        session.touch();
        let actor = Actor::new(
            session.clone(),
            self.inner.sandbox.clone(),
            cfg.clone(),
            commands_rx,
            live,
            self.inner.recorder.clone(),
            self.inner.pool.clone(),
        );
        self.inner.recorder.event(
            &session,
            &LifecycleEvent::SessionCreated {
                kernel: session.kernel_name.clone(),
                idle_timeout_seconds: idle_timeout.map(|t| t.as_secs()),
            },
        );
        self.inner.recorder.event(
            &session,
            &LifecycleEvent::KernelStarted {
                startup_seconds: asked.elapsed().as_secs_f64(),
                pooled: from_pool,
            },
        );
        session.set_state(SessionState::Idle);
        tokio::spawn(actor.run());
        tracing::info!(session = %id, user = %user.name, "session started");
        Ok(session)
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
            Some(ts) if ts.user == user => Err(SessionError::Expired {
                id,
                at: ts.expired_at,
                idle_secs: ts.idle_secs,
            }),
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

    /// Shut a session down and forget it.
    pub async fn delete(&self, user: &str, id: Uuid) -> Result<(), SessionError> {
        let session = self.get(user, id)?;
        self.table().sessions.remove(&id);
        session.shutdown(SessionState::Closed).await;
        self.after_removal(&session).await;
        tracing::info!(session = %id, user, "session deleted");
        Ok(())
    }

    async fn after_removal(&self, session: &Session) {
        let user_has_more = self
            .table()
            .sessions
            .values()
            .any(|s| s.user.name == session.user.name);
        if !user_has_more {
            self.inner.sandbox.user_idle(&session.user).await;
        }
    }

    async fn expire(&self, session: Arc<Session>) {
        let idle_secs = session.idle_timeout.map(|t| t.as_secs()).unwrap_or(0);
        {
            let mut t = self.table();
            if t.sessions.remove(&session.id).is_none() {
                return;
            }
            t.tombstones.insert(
                session.id,
                Tombstone {
                    user: session.user.name.clone(),
                    expired_at: Utc::now(),
                    idle_secs,
                    forget_at: Instant::now() + self.inner.config.tombstone_ttl,
                },
            );
        }
        tracing::info!(session = %session.id, user = %session.user.name, "session expired");
        session.shutdown(SessionState::Expired).await;
        self.after_removal(&session).await;
    }

    /// Sleep until the next expiry deadline (or a change), expire what is due.
    async fn expiry_task(self) {
        let max_busy = self.inner.config.max_busy;
        loop {
            let now = Instant::now();
            let (due, next) = {
                let mut t = self.table();
                t.tombstones.retain(|_, ts| ts.forget_at > now);
                let mut due = Vec::new();
                let mut next: Option<Instant> = None;
                for s in t.sessions.values() {
                    if let Some(d) = s.expiry_deadline(max_busy) {
                        if d <= now {
                            due.push(s.clone());
                        } else {
                            next = Some(next.map_or(d, |n: Instant| n.min(d)));
                        }
                    }
                }
                (due, next)
            };
            for s in due {
                let registry = self.clone();
                tokio::spawn(async move { registry.expire(s).await });
            }
            let wake = next.unwrap_or(now + Duration::from_secs(3600));
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = self.inner.notify.notified() => {}
                _ = self.inner.shutdown.cancelled() => return,
            }
        }
    }

    /// Shut every session down and release the sandbox.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        let sessions: Vec<_> = self.table().sessions.drain().map(|(_, s)| s).collect();
        let n = sessions.len();
        futures::future::join_all(sessions.iter().map(|s| s.shutdown(SessionState::Closed))).await;
        self.inner.pool.drain().await;
        self.inner.sandbox.shutdown().await;
        tracing::info!(sessions = n, "all sessions shut down");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_budget_refuses_what_does_not_fit_and_frees_on_drop() {
        let budget = EventBudget::new(100);
        let a = budget.charge(60).expect("60 of 100 fits");
        assert!(budget.charge(41).is_none(), "101 of 100 must not fit");
        // A refused charge leaves nothing behind.
        let b = budget.charge(40).expect("exactly 100 fits");
        assert!(budget.charge(1).is_none());
        // The bytes come back when the last copy of an event goes.
        let a2 = a.clone();
        drop(a);
        assert!(budget.charge(1).is_none(), "a copy still holds the bytes");
        drop(a2);
        let c = budget.charge(60).expect("freed room is usable again");
        drop((b, c));
        assert_eq!(budget.used.load(Ordering::Acquire), 0);
        // A single message larger than the whole budget is never broadcast.
        assert!(budget.charge(101).is_none());
        assert_eq!(budget.used.load(Ordering::Acquire), 0);
    }
}
