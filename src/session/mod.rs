//! Sessions: one kernel in a user's sandbox whose state persists between executions.
//!
//! The [`Registry`] owns every live session, enforces ownership (a user sees only its own
//! sessions; another user's session is indistinguishable from a missing one), per-user
//! quotas, and idle expiry. Each [`Session`] is a cheap handle to a task (the session
//! *actor*) that owns the kernel connection and runs executions one at a time, in the order
//! received, with a hard timeout each.
//!
//! Layout (each file uses only those listed before it, so there is no import circle):
//! - `execution`: gathering one execution's output under the limits; `lifecycle`: the typed
//!   events reported to the [`Recorder`]; `files`: workspace files beneath a descriptor.
//! - `handle`: the [`Session`] handle (status, activity, event broadcast and its budget).
//! - `launch`: a kernel launched in the sandbox and connected (`Live`, `start_kernel`).
//! - `pool`: the warm pool of pre-started kernels (uses `launch`).
//! - `actor/`: the task that owns a kernel: commands, restart and death in `mod.rs`, the
//!   execution in flight (deadlines, completion) in `running.rs`.
//! - `registry/`: create (quotas), get (ownership), delete, shutdown; idle expiry and
//!   tombstones in `expiry.rs`.
//!
//! Architecture invariant: this layer never names a sandbox backend (it holds an
//! `Arc<dyn Sandbox>`) and knows nothing of HTTP; the API layer maps [`SessionError`] to
//! status codes.

mod actor;
pub mod execution;
pub mod files;
mod handle;
mod launch;
pub mod lifecycle;
mod pool;
mod registry;
#[cfg(test)]
mod testing;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

pub use execution::{Execution, ExecutionStatus, OutputEvent};
pub use lifecycle::LifecycleEvent;

use crate::wire::{Channel, Message};

/// The lifecycle state of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    Starting,
    Idle,
    Busy,
    Dead,
    Expired,
    Closed,
}

impl SessionState {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Starting => "starting",
            SessionState::Idle => "idle",
            SessionState::Busy => "busy",
            SessionState::Dead => "dead",
            SessionState::Expired => "expired",
            SessionState::Closed => "closed",
        }
    }
}

/// Settings of the session layer.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub idle_timeout: Duration,
    pub max_idle_timeout: Duration,
    pub max_busy: Duration,
    pub execution_timeout: Duration,
    pub max_execution_timeout: Duration,
    pub interrupt_grace: Duration,
    pub output_limit: usize,
    pub result_limit: usize,
    pub max_queue: usize,
    /// Heartbeat and message limits of the broker's kernel connections.
    pub kernel: crate::kernel::ConnectOptions,
    /// How long an expired session still answers 410 before it is forgotten (404).
    pub tombstone_ttl: Duration,
    pub pool: PoolConfig,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(600),
            max_idle_timeout: Duration::from_secs(86_400),
            max_busy: Duration::from_secs(3600),
            execution_timeout: Duration::from_secs(60),
            max_execution_timeout: Duration::from_secs(600),
            interrupt_grace: Duration::from_secs(5),
            output_limit: 10_000,
            result_limit: 16 << 20,
            max_queue: 64,
            kernel: Default::default(),
            tombstone_ttl: Duration::from_secs(86_400),
            pool: PoolConfig::default(),
        }
    }
}

/// Errors of the session layer, each with what the caller can do.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no session {0}")]
    NotFound(Uuid),
    #[error(
        "session {id} expired at {at} after {idle_secs} s without activity; create a new session"
    )]
    Expired {
        id: Uuid,
        at: DateTime<Utc>,
        idle_secs: u64,
    },
    #[error("{0}")]
    Quota(String),
    #[error("could not start a kernel: {0}")]
    KernelUnavailable(String),
    #[error("unknown kernel {0:?}; see /api/kernelspecs")]
    UnknownKernel(String),
    #[error("session {0} is shutting down")]
    Closed(Uuid),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFoundFile(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Io(String),
}

/// A snapshot of a session, as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SessionInfo {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    pub state: SessionState,
    pub created_at: DateTime<Utc>,
    pub last_activity: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub execution_count: u64,
    /// Clients attached over WebSocket right now (agent streams and Jupyter channels).
    pub connections: usize,
}

/// Something that happened in a session, for every attached client.
#[derive(Debug, Clone)]
pub enum SessionEvent {
    /// The session's state changed.
    State(SessionState),
    /// A message the kernel published on iopub, as received. `agent` is true when it
    /// belongs to an execution of the agent API (whose clients get it as their own frames).
    Iopub {
        msg: Arc<Message>,
        agent: bool,
        /// Counts the message against the session's event budget while any copy lives.
        held: Arc<handle::EventBytes>,
    },
    /// The kernel was restarted (by request or after a timeout).
    Restarted,
}

/// A request to run code.
pub struct ExecRequest {
    pub code: String,
    /// Already capped by the configured maximum.
    pub timeout: Duration,
    /// Whether `input()` may ask the client (only streaming clients can answer).
    pub allow_stdin: bool,
    /// Output as it happens; dropped (not awaited) when the client falls behind.
    pub stream: Option<mpsc::Sender<OutputEvent>>,
    pub done: oneshot::Sender<Execution>,
}

/// Where replies to a forwarded message go (a Jupyter client's channel).
pub type ReplyRoute = mpsc::Sender<(Channel, Arc<Message>)>;

pub(crate) enum Command {
    Execute(ExecRequest),
    InputReply(String),
    Interrupt(oneshot::Sender<Result<(), SessionError>>),
    Restart(oneshot::Sender<Result<(), SessionError>>),
    /// Send a client's message to the kernel as is; replies to it go to `route`.
    Forward {
        channel: Channel,
        msg: Message,
        route: ReplyRoute,
    },
    Shutdown {
        state: SessionState,
        done: oneshot::Sender<()>,
    },
}

pub use handle::{ConnectionGuard, Session};
pub use pool::PoolConfig;
pub use registry::{CreateOptions, Registry};

/// Which way a recorded message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// From a client (or the broker on a client's behalf) to the kernel.
    ToKernel,
    /// From the kernel.
    FromKernel,
}

/// Where the session layer reports every message and lifecycle event, for the recording.
/// Implementations must not block: they queue and return.
pub trait Recorder: Send + Sync + 'static {
    /// A message on a kernel channel.
    fn message(&self, session: &Session, direction: Direction, channel: Channel, msg: &Message);
    /// Something that happened to the session.
    fn event(&self, session: &Session, event: &LifecycleEvent);
    /// Resolves once everything reported before the call is stored durably. Results are
    /// acknowledged to clients only after it.
    fn barrier(&self) -> futures::future::BoxFuture<'static, ()>;
}

/// Records nothing.
pub struct NoRecorder;

impl Recorder for NoRecorder {
    fn message(&self, _: &Session, _: Direction, _: Channel, _: &Message) {}
    fn event(&self, _: &Session, _: &LifecycleEvent) {}
    fn barrier(&self) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
}
