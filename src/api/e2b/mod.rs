//! E2B compatibility: E2B's own SDKs (Python `e2b` / `e2b-code-interpreter`, JavaScript
//! `@e2b/code-interpreter`) work unmodified with `E2B_API_URL=BASE/e2b`,
//! `E2B_SANDBOX_URL=BASE/e2b/sandbox` and `E2B_API_KEY=<broker token>`.
//!
//! An E2B sandbox is a session of the key's user (same id: it shows in `/v1/sessions`,
//! `/api/kernels` and the UI, and is recorded); its contexts are more sessions of that
//! user; its home and working directory is its own workspace (`/home/user`, also at
//! `/workspace`: `WorkspaceChoice::Own`, removed with it); its commands run
//! in the user's sandbox through `Registry::run_command` (the sandbox's `run_command`). E2B's
//! timeout is the session's fixed deadline (`Session::set_deadline`): the sandbox ends
//! then unless extended.
//!
//! Layout: `control.rs` the control plane (`/e2b/sandboxes`, `X-API-KEY`), `listing.rs`
//! its listing's query, filters and pages; `fork.rs` its fork (`Registry::fork`, answered
//! per fork as E2B does); `metrics.rs` a sandbox's metrics;
//! `interpreter.rs` the code interpreter (`/execute`, `/contexts`); `envd.rs` envd's
//! HTTP route `/health` and its Connect filesystem service, `uploads.rs` its `/files`
//! route (and the signed URLs' `/files`, checked by `signing.rs`), `watching.rs` its
//! directory watches, `entry.rs` the entries they describe; `process.rs` the
//! Connect process service (commands), `pty.rs` its pseudo-terminals, `stream.rs` its
//! server streams, `command.rs` a running command and its output's
//! fan-out to clients (held by `state.rs`); `connect.rs` the Connect framing; `documented.rs` what the routes' documentation
//! shares (error answers, the `/v2` aliases); `auth.rs` keys
//! and the sandbox's access tokens; `state.rs` what the broker knows of each sandbox
//! beyond its session (template, metadata, contexts, commands).

mod auth;
mod command;
mod connect;
mod context_cwd;
mod contexts;
mod control;
mod documented;
mod entry;
mod envd;
mod fork;
mod interpreter;
mod listing;
mod metrics;
mod pause;
mod process;
mod pty;
mod signing;
mod snapshots;
mod state;
mod stream;
mod uploads;
mod watching;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use utoipa_axum::router::OpenApiRouter;

use super::AppState;
use crate::session::SessionError;

pub use auth::{sandbox_headers, token_matches};
pub use state::E2bState;

/// The E2B routes, with their state.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .merge(control::routes())
        .merge(fork::routes())
        .merge(pause::routes())
        .merge(snapshots::routes())
        .merge(interpreter::routes())
        .merge(contexts::routes())
        .merge(envd::routes())
        .merge(uploads::routes())
        .merge(process::routes())
        .merge(metrics::routes())
        .layer(axum::Extension(std::sync::Arc::new(E2bState::default())))
        .layer(axum::extract::DefaultBodyLimit::disable())
}

/// What answers a path under `/e2b` that no route serves (templates, pause, snapshots,
/// ...): E2B's error shape (Connect's for RPC paths behind the sandbox URL) and
/// a sentence, never the broker's own error body.
pub fn fallback(method: &axum::http::Method, path: &str) -> Response {
    let rpc = path
        .strip_prefix("/e2b/sandbox/")
        .is_some_and(|p| p.contains('.') && p.contains('/'));
    if rpc {
        return connect::ConnectError::unimplemented(format!(
            "{} is not supported by kernel-broker",
            path.trim_start_matches("/e2b/sandbox/")
        ))
        .into_response();
    }
    E2bError::unsupported(format!("{method} {path}")).into_response()
}

/// An error in E2B's shape: `{"code": <HTTP status>, "message": "..."}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// What kernel-broker does not do, said so.
    pub fn unsupported(what: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "{what} is not supported by kernel-broker's E2B compatibility (see docs/API.md)"
            ),
        )
    }

    pub fn internal(context: &str, err: impl std::fmt::Display) -> Self {
        tracing::error!(%context, error = %err, "internal error (E2B API)");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the broker hit an internal error; it is logged",
        )
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, Json(body)).into_response()
    }
}

impl From<SessionError> for E2bError {
    fn from(e: SessionError) -> Self {
        let api = super::error::ApiError::from(e);
        Self::new(api.status, api.message)
    }
}

impl From<super::error::ApiError> for E2bError {
    fn from(e: super::error::ApiError) -> Self {
        Self::new(e.status, e.message)
    }
}

pub type E2bResult<T> = Result<T, E2bError>;

/// The sandbox's working directory and home, as its processes see it (E2B's).
pub const WORKDIR: &str = "/home/user";
/// The same directory under the broker's own name for it, which keeps working.
pub const WORKSPACE_ALIAS: &str = "/workspace";

/// The absolute paths inside the sandbox that name its workspace.
pub const WORKSPACE_NAMES: [&str; 2] = [WORKDIR, WORKSPACE_ALIAS];

/// `path` below one of [`WORKSPACE_NAMES`], as a path relative to the workspace ("" for
/// the workspace itself); `None` when it is not below either.
pub fn under_workspace(path: &str) -> Option<&str> {
    WORKSPACE_NAMES.iter().find_map(|name| {
        let rest = path.strip_prefix(name)?;
        match rest.strip_prefix('/') {
            Some(r) => Some(r),
            None if rest.is_empty() => Some(""),
            None => None,
        }
    })
}

/// A path a client gave (absolute inside the sandbox, or relative to the working
/// directory) as a path relative to the workspace; "" is the workspace itself. Only the
/// workspace is reachable through the files API, under either of its names
/// (`/workspace`, `/home/user`).
pub fn workspace_relative(path: &str) -> E2bResult<String> {
    let p = path.trim();
    let rel = if let Some(rest) = under_workspace(p) {
        rest
    } else if let Some(rest) = p.strip_prefix("~/") {
        rest
    } else if p.starts_with('/') {
        return Err(outside(path));
    } else {
        p
    };
    Ok(rel.trim_end_matches('/').to_string())
}

fn outside(path: &str) -> E2bError {
    E2bError::bad_request(format!(
        "{path:?} is outside the sandbox's working directory {WORKDIR}: only files there (or relative paths) are reachable through the files API"
    ))
}

/// The inside path of a workspace-relative one.
pub fn inside_path(rel: &str) -> String {
    if rel.is_empty() {
        WORKDIR.to_string()
    } else {
        format!("{WORKDIR}/{rel}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_onto_the_workspace() {
        for (given, want) in [
            ("data.csv", "data.csv"),
            ("/workspace/a/b.csv", "a/b.csv"),
            ("/workspace", ""),
            ("/workspace/", ""),
            ("~/x", "x"),
            ("", ""),
            ("/home/user/data.csv", "data.csv"),
            ("/home/user", ""),
            ("/home/user/a/", "a"),
        ] {
            assert_eq!(workspace_relative(given).unwrap(), want, "{given}");
        }
        for bad in [
            "/etc/passwd",
            "/workspaces/x",
            "/home/users/x",
            "/home/x",
            "/home",
            "/tmp/x",
        ] {
            let e = workspace_relative(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.contains("outside"), "{}", e.message);
        }
        assert_eq!(inside_path("a/b"), "/home/user/a/b");
        assert_eq!(inside_path(""), "/home/user");
    }
}
