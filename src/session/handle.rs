//! The [`Session`] handle: what the rest of the broker holds to talk to one session. It
//! keeps the session's observable status (state, activity, execution count, why it died),
//! its event broadcast with the iopub byte budget, its client count and the sending side of
//! the actor's command queue. The kernel itself lives in the session's actor task
//! (`actor/`); the handle never touches it, so it is cheap to share and never awaits one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio::time::Instant;
use uuid::Uuid;

use super::command::{Command, ExecRequest, ReplyRoute};
use super::error::SessionError;
use super::event::{EventBudget, SessionEvent};
use super::execution::Execution;
use super::kept::{KeptSessions, SessionRecord};
use super::memory::Reservation;
use super::state::{SessionInfo, SessionState};
use crate::sandbox::{KernelLimits, KernelProcess, LaunchSpec, SandboxUser};
use crate::sync::lock;
use crate::wire::{Channel, Message};

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
    /// The kernel's own limits (every kernel of this session, across restarts).
    pub limits: KernelLimits,
    /// The session's share of its user's memory, given back once its kernel is gone.
    memory: Mutex<Option<Reservation>>,
    /// The kernel process now (set at start and restart), to read its memory use.
    process: Mutex<Option<Arc<dyn KernelProcess>>>,
    /// The HMAC key of the kernel now (for the session's record, `--keep-sessions`).
    kernel_key: Mutex<String>,
    /// Where the session's record is kept (`--keep-sessions`), and the last one written.
    kept: Option<Arc<KeptSessions>>,
    /// Held across each write or removal of the record, so they land in order; `true` once
    /// the record is removed for good (nothing is written after).
    record_io: tokio::sync::Mutex<bool>,
    last_saved: Mutex<Option<SessionRecord>>,
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
    /// A fixed end, besides the idle timeout: the session expires then whatever it does
    /// (E2B's sandbox timeout; `None`: none).
    deadline: Mutex<Option<(Instant, DateTime<Utc>)>>,
}

/// What a session is made of besides its id and owner (see [`Session::new`]).
pub(super) struct HandleParts {
    pub kernel_name: String,
    pub idle_timeout: Option<Duration>,
    pub limits: KernelLimits,
    pub memory: Reservation,
    pub commands: mpsc::Sender<Command>,
    /// Bytes of iopub messages the event broadcast may hold at once.
    pub event_budget: usize,
    pub max_queue: usize,
    /// Woken on activity, so the expiry task recomputes its deadline.
    pub notify_registry: Arc<Notify>,
    /// Where the session's record is kept (`--keep-sessions`).
    pub kept: Option<Arc<KeptSessions>>,
    /// What an adopted session brings from its record (`--keep-sessions`).
    pub restored: Option<Restored>,
}

/// The state an adopted session resumes with.
pub(super) struct Restored {
    pub created_at: DateTime<Utc>,
    pub last_activity: DateTime<Utc>,
    pub execution_count: u64,
}

impl Session {
    /// A new session in state `starting`.
    pub(super) fn new(id: Uuid, user: SandboxUser, parts: HandleParts) -> Self {
        let (events, _) = broadcast::channel(1024);
        let now = Utc::now();
        let (created_at, last_activity, execution_count) = match &parts.restored {
            Some(r) => (r.created_at, r.last_activity, r.execution_count),
            None => (now, now, 0),
        };
        // Time since the last activity counts against the idle deadline, also the time the
        // broker was down.
        let idle_for = (now - last_activity).to_std().unwrap_or_default();
        let last_activity_at = Instant::now()
            .checked_sub(idle_for)
            .unwrap_or_else(Instant::now);
        Session {
            id,
            user,
            kernel_name: parts.kernel_name,
            created_at,
            idle_timeout: parts.idle_timeout,
            limits: parts.limits,
            memory: Mutex::new(Some(parts.memory)),
            process: Mutex::new(None),
            kernel_key: Mutex::new(String::new()),
            kept: parts.kept,
            record_io: tokio::sync::Mutex::new(false),
            last_saved: Mutex::new(None),
            status: Mutex::new(Status {
                state: SessionState::Starting,
                last_activity,
                last_activity_at,
                busy_since: None,
                kernel_busy: false,
                execution_count,
                dead_reason: None,
            }),
            commands: parts.commands,
            events,
            event_budget: EventBudget::new(parts.event_budget),
            events_dropped: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            max_queue: parts.max_queue,
            notify_registry: parts.notify_registry,
            deadline: Mutex::new(None),
        }
    }

    fn status(&self) -> MutexGuard<'_, Status> {
        lock(&self.status)
    }

    pub fn info(&self) -> SessionInfo {
        // Read before the status lock: a file read, not to be done under it.
        let memory_used = self.memory_used();
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
        let expires_at = match (*lock(&self.deadline), expires_at) {
            (Some((_, fixed)), Some(idle)) => Some(fixed.min(idle)),
            (Some((_, fixed)), None)
                if !matches!(s.state, SessionState::Expired | SessionState::Closed) =>
            {
                Some(fixed)
            }
            (_, idle) => idle,
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
            memory_limit_bytes: self.limits.memory_bytes,
            memory_used_bytes: match s.state {
                SessionState::Idle | SessionState::Busy => memory_used,
                _ => None,
            },
            dead_reason: s.dead_reason.clone(),
        }
    }

    /// The kernel's memory use now, as its cgroup counts it (`None`: no kernel, or the
    /// backend cannot tell).
    pub fn memory_used(&self) -> Option<u64> {
        let process = lock(&self.process).clone()?;
        process.memory_used()
    }

    /// The kernel the session runs now (its process handle and key); with
    /// `--keep-sessions` the session's record is written before this returns.
    pub(crate) async fn set_kernel(&self, process: Arc<dyn KernelProcess>, key: &str) {
        *lock(&self.process) = Some(process);
        *lock(&self.kernel_key) = key.to_string();
        self.persist(false).await;
    }

    /// The session's record as of now (`--keep-sessions`); `stopped` when the broker is
    /// letting go of it.
    pub(crate) fn record(&self, stopped: bool) -> SessionRecord {
        let key = lock(&self.kernel_key).clone();
        let s = self.status();
        SessionRecord {
            id: self.id,
            user: self.user.name.clone(),
            kernel: self.kernel_name.clone(),
            created_at: self.created_at,
            idle_timeout_seconds: self.idle_timeout.map(|t| t.as_secs()),
            memory_limit_bytes: self.limits.memory_bytes,
            pids_limit: self.limits.pids,
            key,
            execution_count: s.execution_count,
            last_activity: s.last_activity,
            dead_reason: (s.state == SessionState::Dead)
                .then(|| s.dead_reason.clone())
                .flatten(),
            saved_at: Utc::now(),
            stopped,
        }
    }

    /// Writes the session's record if sessions are kept and anything in it changed since
    /// the last write (always when `stopped`).
    pub(crate) async fn persist(&self, stopped: bool) {
        let Some(kept) = &self.kept else { return };
        let forgotten = self.record_io.lock().await;
        if *forgotten {
            return;
        }
        let record = self.record(stopped);
        {
            let mut last = lock(&self.last_saved);
            let same = last.as_ref().is_some_and(|l| {
                SessionRecord {
                    saved_at: record.saved_at,
                    ..l.clone()
                } == record
            });
            if same {
                return;
            }
            *last = Some(record.clone());
        }
        kept.save(record).await;
        drop(forgotten);
    }

    /// Removes the session's record: it is gone for good.
    pub(crate) async fn forget_record(&self) {
        if let Some(kept) = &self.kept {
            let mut forgotten = self.record_io.lock().await;
            *forgotten = true;
            kept.remove(self.id).await;
        }
    }

    /// Gives the session's memory back to its user; call once the kernel is gone.
    pub(crate) fn release_memory(&self) {
        lock(&self.process).take();
        lock(&self.memory).take();
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
            limits: self.limits,
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

    /// Count a WebSocket client while the guard lives, unless `max` are connected already
    /// (0: no cap). Counted before the check, so two at once cannot both take the last place.
    pub fn try_connect_client(self: &Arc<Self>, max: usize) -> Option<ConnectionGuard> {
        let before = self.connections.fetch_add(1, Ordering::AcqRel);
        let guard = ConnectionGuard(self.clone());
        (max == 0 || before < max).then_some(guard)
    }

    fn send(&self, cmd: Command) -> Result<(), SessionError> {
        self.commands.try_send(cmd).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                SessionError::RequestsWaiting { session: self.id }
            }
            mpsc::error::TrySendError::Closed(_) => SessionError::Closed(self.id),
        })
    }

    /// Queue an execution. Fails at once when the queue is full.
    pub fn execute(&self, req: ExecRequest) -> Result<(), SessionError> {
        let queued = self.pending.fetch_add(1, Ordering::AcqRel);
        if queued >= self.max_queue {
            self.pending_dec();
            return Err(SessionError::ExecutionsWaiting {
                session: self.id,
                waiting: queued,
            });
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

    /// Ask the actor to shut down into `state` and wait until it has.
    pub(super) async fn shutdown(&self, state: SessionState) {
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

    /// Ask the actor to let go of the kernel, alive, and stop (`--keep-sessions`); waits
    /// until it has. The state stays as it is: the record keeps it for the next run.
    pub(super) async fn detach(&self) {
        let (tx, rx) = oneshot::channel();
        if self
            .commands
            .send(Command::Detach { done: tx })
            .await
            .is_ok()
        {
            let _ = rx.await;
        }
    }

    /// Sets (or clears) a fixed end: at `at` the session expires, busy or not, whatever
    /// its idle timeout says (E2B's sandbox timeout: the sandbox ends at its deadline
    /// unless extended). The expiry task is woken to plan with it.
    pub fn set_deadline(&self, at: Option<Instant>) {
        let wall = at.map(|at| {
            let left = at.saturating_duration_since(Instant::now());
            (
                at,
                Utc::now() + chrono::Duration::from_std(left).unwrap_or_default(),
            )
        });
        *lock(&self.deadline) = wall;
        self.notify_registry.notify_one();
    }

    /// The fixed end set by [`Self::set_deadline`], if any.
    pub fn deadline(&self) -> Option<DateTime<Utc>> {
        lock(&self.deadline).map(|(_, wall)| wall)
    }

    /// When this session expires if nothing happens, or `None` if it cannot expire now.
    pub(super) fn expiry_deadline(&self, max_busy: Duration) -> Option<Instant> {
        let fixed = lock(&self.deadline).map(|(at, _)| at);
        let s = self.status();
        let idle = match (self.idle_timeout, s.state) {
            (_, SessionState::Expired | SessionState::Closed) => return None,
            (None, _) => None,
            (Some(_), SessionState::Busy) => s.busy_since.map(|b| b + max_busy),
            (Some(t), _) => Some(s.last_activity_at + t),
        };
        match (idle, fixed) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
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
