//! [`SessionError`]: the session layer's one error type; each message says what the caller
//! can do, and the api layer maps each variant to a status code.

use chrono::{DateTime, Utc};
use uuid::Uuid;

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
    /// A file operation that would replace or discard something: a move onto an existing
    /// path, the delete of a directory that is not empty.
    #[error("{0}")]
    FileConflict(String),
    #[error("{0}")]
    Io(String),
    /// A proposed session id that a session has (live or ended, of any user, here or in
    /// the recordings): ids are never reused, so one recording never holds two sessions.
    #[error("session id {id} is taken (a session id is never reused); propose another id or none")]
    IdTaken { id: Uuid },
    /// Code over the broker's limit for one execution.
    #[error("the code has {bytes} bytes; the limit is {limit}")]
    CodeTooLarge { bytes: usize, limit: usize },
    /// A timeout that is not a positive number of seconds.
    #[error("timeout_seconds must be a positive number")]
    InvalidTimeout { seconds: f64 },
    /// The user's workspace could not be found or made (the sandbox's answer).
    #[error("could not reach the workspace of user {user}")]
    WorkspaceUnavailable {
        user: String,
        #[source]
        source: crate::sandbox::SandboxError,
    },
    /// A command could not be started in the session's sandbox (its message is the
    /// sandbox's, as the client reads it).
    #[error("{source}")]
    CommandNotStarted {
        session: Uuid,
        #[source]
        source: crate::sandbox::SandboxError,
    },
    /// Work handed to the blocking pool did not finish (it panicked).
    #[error("could not {op}: the task did not finish")]
    TaskFailed {
        op: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
    /// Whether a proposed id is taken could not be told (the recordings could not be read):
    /// refused rather than risk a reuse.
    #[error("could not check whether session id {id} was used before")]
    IdUnverified {
        id: Uuid,
        #[source]
        source: super::recorder::BoxError,
    },
}
