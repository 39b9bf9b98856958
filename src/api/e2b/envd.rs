//! envd's routes (port 49983 behind `E2B_SANDBOX_URL`): `GET /health` and the Connect
//! filesystem service (`ListDir`, `Stat`, `MakeDir`, `Remove`, `Move`; watching, `WatchDir`
//! and the watcher calls, is `watching.rs`); file download and upload are `uploads.rs`. Paths are the sandbox's:
//! `/home/user/...`, `/workspace/...` or relative to the workspace
//! (`super::workspace_relative`), and go through the session's `Workspace` (beneath the
//! workspace, no symlink followed; what is created belongs to the kernel's uid).
//!
//! `Remove` and `Move` are envd's (Go's `os.RemoveAll`, `os.Rename`): removing a missing
//! path is no error, a directory goes with its contents; a move replaces what `rename(2)`
//! replaces. An entry carries envd's `symlinkTarget` for a symlink and its `metadata`.

use axum::body::Body;
use axum::extract::{FromRequestParts, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::SandboxCaller;
use super::connect::{unary_request, ConnectError};
use super::documented::SandboxErrors;
use super::entry::{entry_json, fs_error, rel_of};
use super::{inside_path, E2bError, E2bResult};
use crate::api::extract::read_limited;
use crate::api::AppState;
use crate::session::Workspace;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(health))
        .routes(routes!(filesystem))
}

/// envd's health check: 204 while the sandbox the request names is running; otherwise
/// the 502 E2B's proxy answers for a sandbox it does not know (`{"sandboxId", "message":
/// "The sandbox was not found", "code": 502}`), the one status the SDKs' `is_running` reads
/// as "not running" and the answer that makes them report a dropped stream as the sandbox's
/// end. A killed or expired sandbox, one that never was, and another user's (or a token that
/// is not the sandbox's) all get the same answer: nothing tells them apart.
#[utoipa::path(get, operation_id = "e2b_health", path = "/e2b/sandbox/health", tag = "e2b", security(()),
    responses((status = 204, description = "the sandbox is running"),
        (status = 502, description = "no running sandbox of this id and token: `{sandboxId, message, code: 502}`", body = serde_json::Value),
        (status = 400, description = "no E2b-Sandbox-Id header", body = serde_json::Value)))]
async fn health(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    let (id, _) = super::sandbox_headers(request.headers());
    let Some(id) = id.map(str::to_string) else {
        return E2bError::bad_request(
            "the E2b-Sandbox-Id header is missing (set E2B_SANDBOX_URL=BASE/e2b/sandbox)",
        )
        .into_response();
    };
    let (mut parts, _) = request.into_parts();
    let running = match SandboxCaller::from_request_parts(&mut parts, &state).await {
        // A paused sandbox is not running, as E2B's `is_running()` says of one (its
        // commands and files stay reachable: using them resumes it).
        Ok(caller) => {
            caller.session.state() != crate::session::SessionState::Paused
                && !super::process::sandbox_gone(&state.registry, &caller.e2b, &caller.session)
        }
        Err(_) => false,
    };
    if running {
        return StatusCode::NO_CONTENT.into_response();
    }
    (
        StatusCode::BAD_GATEWAY,
        Json(json!({"sandboxId": id, "message": "The sandbox was not found", "code": 502})),
    )
        .into_response()
}

async fn workspace(state: &AppState, caller: &SandboxCaller) -> E2bResult<Workspace> {
    Ok(state.registry.workspace(&caller.session)?)
}

/// `{"entry": ...}` for the entry at `rel`: what `Stat`, `MakeDir` and `Move` answer.
async fn entry_answer(ws: &Workspace, rel: &str) -> Result<Value, ConnectError> {
    let e = ws.stat(rel).await.map_err(fs_error)?;
    Ok(json!({"entry": entry_json(&e, ws)}))
}

#[derive(Deserialize)]
struct PathReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u64>,
}

#[derive(Deserialize)]
struct MoveReq {
    source: String,
    destination: String,
}

/// envd's Connect filesystem service (JSON): `ListDir`, `Stat`, `MakeDir`, `Remove`, `Move`,
/// `WatchDir` (a server stream), `CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`
#[utoipa::path(post, operation_id = "e2b_filesystem", path = "/e2b/sandbox/filesystem.Filesystem/{method}", tag = "e2b", security(()),
    params(("method" = String, Path)),
    responses((status = 200, description = "the method's response message", body = serde_json::Value), SandboxErrors))]
async fn filesystem(
    State(state): State<AppState>,
    axum::extract::Path(method): axum::extract::Path<String>,
    caller: SandboxCaller,
    body: Body,
) -> Response {
    if method == "WatchDir" {
        return match read_limited(body, super::connect::MAX_MESSAGE, "request").await {
            Ok(bytes) => {
                caller.session.touch();
                super::watching::watch_dir(&state, &caller, &bytes).await
            }
            Err(e) => ConnectError::new("resource_exhausted", e.message).into_response(),
        };
    }
    match filesystem_call(&state, &caller, &method, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn filesystem_call(
    state: &AppState,
    caller: &SandboxCaller,
    method: &str,
    body: Body,
) -> Result<Value, ConnectError> {
    let bytes = read_limited(body, super::connect::MAX_MESSAGE, "request")
        .await
        .map_err(|e| ConnectError::new("resource_exhausted", e.message))?;
    let ws = workspace(state, caller)
        .await
        .map_err(|e| ConnectError::new("internal", e.message))?;
    caller.session.touch();
    match method {
        "ListDir" => {
            let req: PathReq = unary_request(&bytes)?;
            let rel = rel_of(&req.path)?;
            let depth = req.depth.unwrap_or(1).clamp(1, 64) as usize;
            let (entries, _) = ws.list_dir(&rel, depth).await.map_err(fs_error)?;
            Ok(json!({"entries": entries.iter().map(|e| entry_json(e, &ws)).collect::<Vec<_>>()}))
        }
        "Stat" => {
            let req: PathReq = unary_request(&bytes)?;
            let rel = rel_of(&req.path)?;
            entry_answer(&ws, &rel).await
        }
        "MakeDir" => {
            let req: PathReq = unary_request(&bytes)?;
            let rel = rel_of(&req.path)?;
            if !ws.make_dir(&rel).await.map_err(fs_error)? {
                return Err(ConnectError::new(
                    "already_exists",
                    format!("directory {} already exists", inside_path(&rel)),
                ));
            }
            entry_answer(&ws, &rel).await
        }
        "Remove" => {
            let req: PathReq = unary_request(&bytes)?;
            let rel = rel_of(&req.path)?;
            // envd: os.RemoveAll, a missing path is nothing to do.
            ws.remove_all(&rel).await.map_err(fs_error)?;
            Ok(json!({}))
        }
        "Move" => {
            let req: MoveReq = unary_request(&bytes)?;
            let (from, to) = (rel_of(&req.source)?, rel_of(&req.destination)?);
            ws.rename_over(&from, &to).await.map_err(fs_error)?;
            entry_answer(&ws, &to).await
        }
        "CreateWatcher" => super::watching::create_watcher(state, caller, &bytes).await,
        "GetWatcherEvents" => super::watching::get_watcher_events(caller, &bytes),
        "RemoveWatcher" => super::watching::remove_watcher(caller, &bytes),
        other => Err(ConnectError::unimplemented(format!(
            "filesystem.Filesystem/{other} is not supported by kernel-broker"
        ))),
    }
}
