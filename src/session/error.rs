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
}
