//! The [`Session`] handle: what the rest of the broker holds to talk to one session. It
//! keeps the session's observable status (state, activity, execution count, why it died),
//! its event broadcast with the iopub byte budget, its client count and the sending side of
//! the actor's command queue. The kernel itself lives in the session's actor task
//! (`actor/`); the handle never touches it, so it is cheap to share and never awaits one.
//!
//! Its mutable parts, after mini-redis's `Shared { state: Mutex<State>, .. }`:
//! - [`SessionStatus`] in a `tokio::sync::watch`: the actor publishes every change (state,
//!   busy, execution count, death) through the handle's setters; activity
//!   ([`Session::touch`]) and the fixed deadline ([`Session::set_deadline`]) are recorded
//!   there by whoever sees them. Readers take `borrow()`, waiters
//!   `changed()` ([`Session::wait_for`]): neither takes the state lock.
//! - `State`, under one std `Mutex`: what changes with the kernel (its process, key,
//!   memory reservation). Each critical section is a field update or a clone, never an
//!   await or a file read; only the memory reading takes it among the readers.
//! - The record file (`--keep-sessions`): `kept::RecordFile`, which orders its writes
//!   under the one lock held across awaits, on purpose (see there).
//! - Counters that change alone stay atomics (see the fields).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio::time::Instant;
use uuid::Uuid;

use super::command::{Command, ExecRequest, ReplyRoute};
use super::error::SessionError;
use super::event::{EventBudget, SessionEvent};
use super::execution::Execution;
use super::front_door::{Provenance, SessionEnd};
use super::kept::{KeptSessions, RecordFile, SessionRecord};
use super::memory::Reservation;
use super::pause::PauseState;
use super::state::{SessionInfo, SessionState, SessionStatus};
use crate::sandbox::{KernelLimits, KernelProcess, LaunchSpec, SandboxUser};
use crate::sync::lock;
use crate::wire::{Channel, Message};

/// What changes with the kernel: under one std `Mutex`, never held across an await.
struct State {
    /// The session's share of its user's memory, given back once its kernel is gone.
    memory: Option<Reservation>,
    /// The kernel process now (set at start and restart), to read its memory use.
    process: Option<Arc<dyn KernelProcess>>,
    /// The HMAC key of the kernel now (for the session's record, `--keep-sessions`).
    kernel_key: String,
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
    /// The front door that made it (which owns its life) and its client's metadata.
    pub provenance: Provenance,
    /// The own workspace its kernels and commands work in (the key of
    /// [`LaunchSpec::own_workspace`]); `None`: the user's shared workspace.
    pub own_workspace: Option<Uuid>,
    /// Its secrets and the masker of its kernel's output (`secrets.rs`).
    pub secrets: super::secrets::SessionSecrets,
    state: Mutex<State>,
    /// When it pauses by itself (`pause.rs`).
    pub(super) pause: Mutex<PauseState>,
    /// The status the actor publishes; read with `borrow()`, waited on with `changed()`.
    pub(super) status: watch::Sender<SessionStatus>,
    /// The session's record (`--keep-sessions`).
    record_file: Option<RecordFile>,
    /// Where its record goes while it is paused (`<data_dir>/paused-sessions`), so that a
    /// paused session outlives the broker.
    pub(super) paused_records: Option<Arc<KeptSessions>>,
    commands: mpsc::Sender<Command>,
    events: broadcast::Sender<SessionEvent>,
    /// Bytes of iopub messages in the event ring and its receivers.
    event_budget: EventBudget,
    // The three counters below stay atomics: each changes alone, nothing else is read or
    // written with it, and they are on hot paths (every iopub message, every execute,
    // every WebSocket client) where a lock would only add waiting.
    /// Messages left out of the broadcast for the budget (for one summary log line each
    /// time the count doubles).
    events_dropped: AtomicUsize,
    /// Executions queued and not yet started: taken and checked in one step, so two
    /// requests at once cannot both take the last place.
    pending: AtomicUsize,
    /// WebSocket clients attached (counted by `clients::ConnectionGuard`s).
    pub(super) connections: AtomicUsize,
    max_queue: usize,
    pub(super) notify_registry: Arc<Notify>,
}

/// What a session is made of besides its id and owner (see [`Session::new`]).
pub(super) struct HandleParts {
    pub kernel_name: String,
    pub idle_timeout: Option<Duration>,
    pub limits: KernelLimits,
    pub provenance: Provenance,
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
    /// See [`Session::own_workspace`].
    pub own_workspace: Option<Uuid>,
    /// Where its record goes while it is paused.
    pub paused_records: Option<Arc<KeptSessions>>,
    pub secrets: super::secrets::SessionSecrets,
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
            provenance: parts.provenance,
            own_workspace: parts.own_workspace,
            secrets: parts.secrets,
            state: Mutex::new(State {
                memory: Some(parts.memory),
                process: None,
                kernel_key: String::new(),
            }),
            pause: Mutex::default(),
            status: watch::Sender::new(SessionStatus::starting(
                last_activity,
                last_activity_at,
                execution_count,
            )),
            record_file: parts.kept.map(RecordFile::new),
            paused_records: parts.paused_records,
            commands: parts.commands,
            events,
            event_budget: EventBudget::new(parts.event_budget),
            events_dropped: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            max_queue: parts.max_queue,
            notify_registry: parts.notify_registry,
        }
    }

    fn locked(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The session's status now: a copy, read without the state lock.
    pub fn status(&self) -> SessionStatus {
        self.status.borrow().clone()
    }

    /// Waits until the session's status satisfies `done` (checked at once, then at each
    /// change the actor publishes) and returns it.
    pub async fn wait_for(&self, mut done: impl FnMut(&SessionStatus) -> bool) -> SessionStatus {
        let mut changes = self.status.subscribe();
        let seen = changes.wait_for(|s| done(s)).await.map(|s| s.clone());
        // The sender is this handle's own field, alive while `self` is: it cannot close.
        seen.unwrap_or_else(|_| self.status())
    }

    /// Waits until the session is over (shut down or expired).
    pub async fn ended(&self) {
        self.wait_for(SessionStatus::ended).await;
    }

    /// Changes the status in one step under the watch's own lock (so a reader never sees
    /// half a change), wakes its waiters, and broadcasts the new state if it changed: the
    /// WebSocket and Jupyter streams need every transition, in order with the iopub
    /// messages, where a watch keeps only the latest.
    fn update(&self, change: impl FnOnce(&mut SessionStatus)) {
        let mut moved = None;
        self.status.send_modify(|s| {
            let before = s.state;
            change(s);
            moved = (s.state != before).then_some(s.state);
        });
        if let Some(state) = moved {
            self.publish(SessionEvent::State(state));
        }
    }

    pub fn info(&self) -> SessionInfo {
        // Read before the status: a file read, not to be done under any lock.
        let memory_used = self.memory_used();
        let s = self.status.borrow();
        let expires_at = match (self.idle_timeout, s.state) {
            (
                Some(t),
                SessionState::Idle
                | SessionState::Busy
                | SessionState::Starting
                | SessionState::Paused
                | SessionState::Dead,
            ) => chrono::Duration::from_std(t)
                .ok()
                .map(|t| s.last_activity + t),
            _ => None,
        };
        let expires_at = match (s.deadline, expires_at) {
            (Some((_, fixed)), Some(idle)) => Some(fixed.min(idle)),
            (Some((_, fixed)), None) if !s.ended() => Some(fixed),
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
            provenance: self.provenance.clone(),
            secrets: self.secrets.names(),
        }
    }

    /// The kernel's memory use now, as its cgroup counts it (`None`: no kernel, or the
    /// backend cannot tell).
    pub fn memory_used(&self) -> Option<u64> {
        let process = self.locked().process.clone()?;
        process.memory_used()
    }

    /// CPU time the session's kernel has used, in nanoseconds, as its sandbox counts it;
    /// `None` when the sandbox cannot tell or there is no kernel.
    pub fn cpu_time_ns(&self) -> Option<u64> {
        let process = self.locked().process.clone()?;
        process.cpu_time_ns()
    }

    /// The kernel the session runs now (its process handle and key); with
    /// `--keep-sessions` the session's record is written before this returns.
    pub(crate) async fn set_kernel(&self, process: Arc<dyn KernelProcess>, key: &str) {
        {
            let mut state = self.locked();
            state.process = Some(process);
            state.kernel_key = key.to_string();
        }
        self.secrets.kernel_key(key);
        self.persist(false).await;
    }

    /// The session's record as of now (`--keep-sessions`); `stopped` when the broker is
    /// letting go of it.
    pub(crate) fn record(&self, stopped: bool) -> SessionRecord {
        let (key, kernel_id) = {
            let state = self.locked();
            let kernel = state.process.as_ref().and_then(|p| p.kernel_id());
            (state.kernel_key.clone(), kernel.filter(|k| *k != self.id))
        };
        let s = self.status.borrow();
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
            front_door: self.provenance.front_door,
            metadata: self.provenance.metadata.clone(),
            own_workspace: self.own_workspace,
            paused_kernel: None,
            kernel_id,
            secrets: self.secrets.sealed(),
        }
    }

    /// Writes the session's record if sessions are kept and anything in it changed since
    /// the last write (always when `stopped`).
    pub(crate) async fn persist(&self, stopped: bool) {
        if let Some(file) = &self.record_file {
            file.save(|| self.record(stopped)).await;
        }
    }

    /// Removes the session's record until its next save (it is paused: its paused record
    /// stands for it).
    pub(crate) async fn set_aside_record(&self) {
        if let Some(file) = &self.record_file {
            file.set_aside(self.id).await;
        }
    }

    /// Removes the session's record: it is gone for good.
    pub(crate) async fn forget_record(&self) {
        if let Some(file) = &self.record_file {
            file.remove(self.id).await;
        }
    }

    /// The session's share of its user's memory again (a paused session resuming).
    pub(crate) fn set_memory(&self, memory: Reservation) {
        let old = self.locked().memory.replace(memory);
        drop(old);
    }

    /// Gives the session's memory back to its user; call once the kernel is gone.
    pub(crate) fn release_memory(&self) {
        // Dropped outside the lock: the reservation goes back to the ledger's own.
        drop(self.take_memory());
    }

    /// The session's memory, taken from it to be given back to its user when the value is
    /// dropped: once a kernel ending in the background is gone.
    pub(crate) fn take_memory(&self) -> impl Send + 'static {
        let mut state = self.locked();
        (state.process.take(), state.memory.take())
    }

    pub fn state(&self) -> SessionState {
        self.status.borrow().state
    }

    /// Why the kernel died, when the session is dead.
    pub fn dead_reason(&self) -> Option<String> {
        self.status.borrow().dead_reason.clone()
    }

    /// Record activity now.
    pub fn touch(&self) {
        self.update(|s| {
            s.last_activity = Utc::now();
            s.last_activity_at = Instant::now();
        });
        self.notify_registry.notify_one();
    }

    pub(crate) fn set_state(&self, state: SessionState) {
        self.update(|s| s.set_state(state));
    }

    pub(crate) fn set_busy(&self, busy: bool) {
        self.update(|s| {
            s.busy_since = busy.then(Instant::now);
            s.refresh();
        });
    }

    pub(crate) fn set_kernel_busy(&self, busy: bool) {
        self.update(|s| {
            s.kernel_busy = busy;
            s.refresh();
        });
    }

    pub(crate) fn set_dead(&self, reason: String) {
        self.update(|s| s.set_dead(reason));
    }

    pub(crate) fn set_execution_count(&self, n: u64) {
        self.update(|s| s.execution_count = n);
    }

    pub(crate) fn reset_execution_count(&self) {
        self.update(|s| {
            s.execution_count = 0;
            s.kernel_busy = false;
            s.busy_since = None;
        });
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
            // Secrets reach the kernel as its environment, applied after the drop as every
            // tenant variable is (`sandbox/environ.rs`).
            env: self
                .secrets
                .values()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            limits: self.limits,
            own_workspace: self.own_workspace,
        }
    }

    /// Attach to the session's events (state changes, iopub).
    pub fn subscribe(&self) -> broadcast::Receiver<SessionEvent> {
        self.events.subscribe()
    }

    pub(super) fn send(&self, cmd: Command) -> Result<(), SessionError> {
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
            hooks: None,
            env_code: None,
            checked: false,
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

    /// Ask the actor to end the session as `end` says and wait until it has.
    pub(super) async fn shutdown(&self, end: SessionEnd) {
        let (tx, rx) = oneshot::channel();
        // Shutdown must get through even when the queue is full.
        if self
            .commands
            .send(Command::Shutdown { end, done: tx })
            .await
            .is_ok()
        {
            let _ = rx.await;
        }
        self.set_state(end.state());
    }

    /// Ask the actor to let go of the kernel, alive, and stop (`--keep-sessions`); waits
    /// until it has. The state stays as it is: the record keeps it for the next run.
    pub(super) async fn detach(&self) {
        self.tell_actor(|done| Command::Detach { done }).await;
    }

    /// Another node took this paused session over: its actor lets its paused state go.
    pub(super) async fn taken_over(&self) {
        self.tell_actor(|done| Command::TakenOver { done }).await;
    }

    /// Sends `cmd` to the actor and waits until it is done (at once if the actor is gone).
    pub(super) async fn tell_actor(&self, cmd: impl FnOnce(oneshot::Sender<()>) -> Command) {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(cmd(tx)).await.is_ok() {
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
        self.update(|s| s.deadline = wall);
        self.notify_registry.notify_one();
    }

    /// The fixed end set by [`Self::set_deadline`], if any.
    pub fn deadline(&self) -> Option<DateTime<Utc>> {
        self.status.borrow().deadline.map(|(_, wall)| wall)
    }
}
