//! envd's routes (port 49983 behind `E2B_SANDBOX_URL`): `GET /health` and the Connect
//! filesystem service (`ListDir`, `Stat`, `MakeDir`, `Remove`, `Move`; watching is not
//! supported); file download and upload are `uploads.rs`. Paths are the sandbox's:
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
use super::{inside_path, workspace_relative, E2bError, E2bResult};
use crate::api::error::{file_error_kind, FileErrorKind};
use crate::api::extract::read_limited;
use crate::api::AppState;
use crate::session::files::{Entry, EntryKind};
use crate::session::{SessionError, Workspace};

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
        Ok(caller) => !super::process::sandbox_gone(&state.registry, &caller.e2b, &caller.session),
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

fn entry_json(e: &Entry) -> Value {
    let rel = e.rel.to_string_lossy();
    let name = e
        .rel
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let kind = match e.kind {
        EntryKind::File => "FILE_TYPE_FILE",
        EntryKind::Directory => "FILE_TYPE_DIRECTORY",
        EntryKind::Symlink => "FILE_TYPE_SYMLINK",
        EntryKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    json!({
        "name": name,
        "type": kind,
        "path": inside_path(&rel),
        "size": e.size.to_string(),
        "mode": e.mode & 0o7777,
        "permissions": permissions(e.mode),
        "owner": e.uid.to_string(),
        "group": e.gid.to_string(),
        "modifiedTime": e.modified.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true),
        "isSymlink": e.kind == EntryKind::Symlink,
        "symlinkTarget": e.link_target.as_deref().map(|t| link_target(&rel, &t.to_string_lossy())),
        "metadata": e.metadata,
    })
}

/// A symlink's target as the sandbox names it, as envd reports it (an absolute path): the
/// link's text made absolute against the link's directory and cleaned of `.` and `..`,
/// without looking at the host (the text is the kernel's to choose; nothing is followed).
/// A relative link's directory is named with the workspace's inside name
/// (`super::inside_path`). envd resolves every link of a chain; this does not (the host
/// is not the sandbox's view), see docs/API.md.
fn link_target(link_rel: &str, text: &str) -> String {
    let base = if text.starts_with('/') {
        String::new()
    } else {
        let dir = link_rel.rsplit_once('/').map_or("", |(d, _)| d);
        inside_path(dir)
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in base.split('/').chain(text.split('/')) {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

/// `-rw-r--r--`, as `ls` shows it.
fn permissions(mode: u32) -> String {
    let kind = match mode & libc::S_IFMT {
        libc::S_IFDIR => 'd',
        libc::S_IFLNK => 'l',
        _ => '-',
    };
    let mut s = String::from(kind);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn fs_error(e: SessionError) -> ConnectError {
    let message = e.to_string();
    match file_error_kind(&e) {
        Some(FileErrorKind::NotFound) => ConnectError::not_found(message),
        Some(FileErrorKind::Invalid) => ConnectError::invalid(message),
        Some(FileErrorKind::Conflict) => ConnectError::new("already_exists", message),
        Some(FileErrorKind::TooLarge) => ConnectError::new("resource_exhausted", message),
        _ => {
            let other = e;
            tracing::warn!(error = %other, "E2B filesystem call failed");
            ConnectError::new("internal", other.to_string())
        }
    }
}

/// `{"entry": ...}` for the entry at `rel`: what `Stat`, `MakeDir` and `Move` answer.
async fn entry_answer(ws: &Workspace, rel: &str) -> Result<Value, ConnectError> {
    let e = ws.stat(rel).await.map_err(fs_error)?;
    Ok(json!({"entry": entry_json(&e)}))
}

fn rel_of(path: &str) -> Result<String, ConnectError> {
    workspace_relative(path).map_err(|e| ConnectError::invalid(e.message))
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

/// envd's Connect filesystem service (JSON): `ListDir`, `Stat`, `MakeDir`, `Remove`, `Move`
#[utoipa::path(post, operation_id = "e2b_filesystem", path = "/e2b/sandbox/filesystem.Filesystem/{method}", tag = "e2b", security(()),
    params(("method" = String, Path)),
    responses((status = 200, description = "the method's response message", body = serde_json::Value), SandboxErrors))]
async fn filesystem(
    State(state): State<AppState>,
    axum::extract::Path(method): axum::extract::Path<String>,
    caller: SandboxCaller,
    body: Body,
) -> Response {
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
            Ok(json!({"entries": entries.iter().map(entry_json).collect::<Vec<_>>()}))
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
        other => Err(ConnectError::unimplemented(format!(
            "filesystem.Filesystem/{other} is not supported by kernel-broker (watching directories is not)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlink_targets_are_absolute_inside_the_sandbox() {
        for (link, text, want) in [
            ("a/link", "data.csv", "/workspace/a/data.csv"),
            ("link", "../etc/passwd", "/etc/passwd"),
            ("a/b/link", "../../x", "/workspace/x"),
            ("link", "/etc", "/etc"),
            ("link", "/home/user/./x/../y", "/home/user/y"),
            ("link", "../../../../..", "/"),
        ] {
            assert_eq!(link_target(link, text), want, "{link} -> {text}");
        }
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions(libc::S_IFDIR | 0o755), "drwxr-xr-x");
    }
}
