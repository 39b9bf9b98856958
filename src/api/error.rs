//! The one error type of the HTTP surface. Every error is JSON:
//! `{"error": {"code": "...", "message": "..."}}` with a fitting status. User errors pass
//! through with their message; internal ones become a plain 500 and are logged.
//! [`JupyterError`] is the same error in the Jupyter API's body.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::session::SessionError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid token is needed: send 'Authorization: Bearer TOKEN', 'Authorization: token TOKEN' or ?token=TOKEN",
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    pub fn internal(context: &str, err: impl std::fmt::Display) -> Self {
        tracing::error!(%context, error = %err, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the broker hit an internal error; it is logged",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"error": {"code": self.code, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> Self {
        let message = e.to_string();
        match e {
            SessionError::NotFound(_) => {
                Self::new(StatusCode::NOT_FOUND, "session_not_found", message)
            }
            SessionError::Expired { .. } => Self::new(StatusCode::GONE, "session_expired", message),
            SessionError::TooManySessions { .. }
            | SessionError::TooManySessionsInCluster { .. }
            | SessionError::NoMemoryLeft { .. }
            | SessionError::ExecutionsWaiting { .. }
            | SessionError::RequestsWaiting { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", message)
            }
            SessionError::ClusterUnavailable => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "cluster_unavailable",
                message,
            ),
            SessionError::ShuttingDown
            | SessionError::LaunchTimedOut { .. }
            | SessionError::LaunchFailed { .. }
            | SessionError::DiedBeforeReady { .. }
            | SessionError::ConnectFailed { .. }
            | SessionError::KernelNotRunning
            | SessionError::InterruptFailed { .. }
            | SessionError::Closed(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "kernel_unavailable",
                message,
            ),
            SessionError::UnknownKernel(_)
            | SessionError::InvalidMemoryLimit { .. }
            | SessionError::InvalidMetadata(_) => Self::bad_request(message),
            SessionError::IdTaken { .. } => {
                Self::new(StatusCode::CONFLICT, "session_exists", message)
            }
            SessionError::CodeTooLarge { .. } => Self::too_large(message),
            SessionError::InvalidTimeout { .. } | SessionError::InvalidEnv { .. } => {
                Self::bad_request(message)
            }
            SessionError::WorkspaceUnavailable { source, .. } => {
                Self::internal("workspace", source)
            }
            SessionError::TaskFailed { op, source } => Self::internal(op, source),
            SessionError::CommandNotStarted { source, .. } => {
                Self::internal("start a command", source)
            }
            SessionError::InvalidForkCount { .. } => Self::bad_request(message),
            SessionError::ForkRefused { .. } | SessionError::ForkBusy { .. } => {
                Self::new(StatusCode::CONFLICT, "fork_refused", message)
            }
            SessionError::CheckpointNotFound { .. } => {
                Self::new(StatusCode::NOT_FOUND, "checkpoint_not_found", message)
            }
            SessionError::CheckpointBusy { .. } => {
                Self::new(StatusCode::CONFLICT, "checkpoint_refused", message)
            }
            SessionError::CheckpointFailed { .. } => {
                Self::new(StatusCode::BAD_GATEWAY, "checkpoint_failed", message)
            }
            SessionError::ForkFailed { .. } => {
                Self::new(StatusCode::BAD_GATEWAY, "fork_failed", message)
            }
            SessionError::ForkTimedOut { .. } => {
                Self::new(StatusCode::GATEWAY_TIMEOUT, "fork_failed", message)
            }
            SessionError::NoRoomForCopy { .. } => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                message,
            ),
            SessionError::PauseRefused { .. } | SessionError::PauseBusy { .. } => {
                Self::new(StatusCode::CONFLICT, "pause_refused", message)
            }
            SessionError::PauseFailed { action, .. } => Self::new(
                StatusCode::BAD_GATEWAY,
                if action == "resume" {
                    "resume_failed"
                } else {
                    "pause_failed"
                },
                message,
            ),
            SessionError::ResumeElsewhere { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "session_away", message)
            }
            SessionError::NoRoomToPause { .. } => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                message,
            ),
            SessionError::SnapshotNotFound(_) => {
                Self::new(StatusCode::NOT_FOUND, "snapshot_not_found", message)
            }
            SessionError::TooManySnapshots { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", message)
            }
            SessionError::SnapshotRefused { .. } | SessionError::SnapshotBusy { .. } => {
                Self::new(StatusCode::CONFLICT, "snapshot_refused", message)
            }
            SessionError::NoRoomForSnapshot { .. } => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                message,
            ),
            SessionError::SnapshotFailed { .. } => {
                Self::new(StatusCode::BAD_GATEWAY, "snapshot_failed", message)
            }
            SessionError::SnapshotMismatch(_) => Self::bad_request(message),
            SessionError::IdUnverified { source, .. } => {
                Self::internal("check a proposed session id", source)
            }
            // The workspace file errors (`file_error_kind` names them all).
            e => match file_error_kind(&e) {
                Some(FileErrorKind::NotFound) => {
                    Self::new(StatusCode::NOT_FOUND, "file_not_found", message)
                }
                Some(FileErrorKind::Invalid) => Self::bad_request(message),
                Some(FileErrorKind::TooLarge) => Self::too_large(message),
                Some(FileErrorKind::Conflict) => {
                    Self::new(StatusCode::CONFLICT, "file_conflict", message)
                }
                Some(FileErrorKind::Failed) | None => Self::internal("file access", message),
            },
        }
    }
}

/// What a workspace file error means to a client (each front door answers it in its own
/// protocol: REST statuses here, Connect codes in E2B's envd).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileErrorKind {
    /// Nothing there.
    NotFound,
    /// A path or a target the files API refuses.
    Invalid,
    /// Over a size limit or the workspace's quota.
    TooLarge,
    /// It would replace or discard something.
    Conflict,
    /// The broker's own failure.
    Failed,
}

/// The kind of a workspace file error; `None` for the other session errors.
pub fn file_error_kind(e: &SessionError) -> Option<FileErrorKind> {
    use SessionError as E;
    Some(match e {
        E::NoSuchFile { .. } => FileErrorKind::NotFound,
        E::InvalidPath { .. }
        | E::ThroughSymlink { .. }
        | E::IsDirectory { .. }
        | E::NotRegularFile { .. }
        | E::NotDirectory { .. }
        | E::NamesNoFile { .. }
        | E::MoveIntoItself { .. } => FileErrorKind::Invalid,
        E::WorkspaceFull { .. } | E::FileTooLarge { .. } => FileErrorKind::TooLarge,
        E::DirectoryNotEmpty { .. } | E::DestinationExists { .. } => FileErrorKind::Conflict,
        E::FileIo { .. } => FileErrorKind::Failed,
        _ => return None,
    })
}

pub type ApiResult<T> = Result<T, ApiError>;

/// An error answered with Jupyter's body (`message`, `reason`) alongside ours (`error`).
pub struct JupyterError(pub ApiError);

impl IntoResponse for JupyterError {
    fn into_response(self) -> Response {
        let e = self.0;
        let body = serde_json::json!({
            "error": {"code": e.code, "message": e.message},
            "message": e.message,
            "reason": e.status.canonical_reason(),
        });
        (e.status, Json(body)).into_response()
    }
}

impl From<ApiError> for JupyterError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}
