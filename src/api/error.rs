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
            | SessionError::BadRequest(_) => Self::bad_request(message),
            SessionError::NotFoundFile(_) => {
                Self::new(StatusCode::NOT_FOUND, "file_not_found", message)
            }
            SessionError::TooLarge(_) => Self::too_large(message),
            SessionError::FileConflict(_) => {
                Self::new(StatusCode::CONFLICT, "file_conflict", message)
            }
            SessionError::Io(_) => Self::internal("file access", message),
            SessionError::IdTaken { .. } => {
                Self::new(StatusCode::CONFLICT, "session_exists", message)
            }
            SessionError::CodeTooLarge { .. } => Self::too_large(message),
            SessionError::InvalidTimeout { .. } => Self::bad_request(message),
            SessionError::WorkspaceUnavailable { source, .. } => {
                Self::internal("workspace", source)
            }
            SessionError::TaskFailed { op, source } => Self::internal(op, source),
            SessionError::CommandNotStarted { source, .. } => {
                Self::internal("start a command", source)
            }
            SessionError::IdUnverified { source, .. } => {
                Self::internal("check a proposed session id", source)
            }
        }
    }
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
