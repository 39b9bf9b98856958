//! envd's routes (port 49983 behind `E2B_SANDBOX_URL`): `GET /health`, file download and
//! upload (`/files`, multipart or octet-stream), and the Connect filesystem service
//! (`ListDir`, `Stat`, `MakeDir`, `Remove`, `Move`; watching is not supported). Paths are
//! the sandbox's: `/workspace/...` or relative to it (`super::workspace_relative`), and go
//! through the session's `Workspace` (beneath the workspace, no symlink followed; what is created
//! belongs to the kernel's uid).

use axum::body::Body;
use axum::extract::multipart::MultipartError;
use axum::extract::{FromRequest, FromRequestParts, Multipart, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
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
use crate::api::error::{file_error_kind, ApiError, FileErrorKind};
use crate::api::extract::{collect_upload, read_limited, read_upload, UploadBudget};
use crate::api::AppState;
use crate::session::files::{Entry, EntryKind};
use crate::session::{SessionError, Workspace};
use futures::TryStreamExt;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(health))
        .routes(routes!(download, upload))
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

/// Bytes of a multipart upload beyond its files' own: boundaries, part headers, preamble.
const MULTIPART_OVERHEAD: usize = 1 << 20;

/// Files in one multipart upload at most (each costs a write and a line of the answer).
const MAX_PARTS: usize = 1000;

#[derive(Deserialize)]
struct FileQuery {
    path: Option<String>,
}

async fn workspace(state: &AppState, caller: &SandboxCaller) -> E2bResult<Workspace> {
    Ok(state.registry.workspace(&caller.session)?)
}

/// Download a file (envd)
#[utoipa::path(get, operation_id = "e2b_download", path = "/e2b/sandbox/files", tag = "e2b", security(()),
    params(("path" = String, Query, description = "`/workspace/...` or relative to it")),
    responses((status = 200, description = "raw bytes", content_type = "application/octet-stream", body = Vec<u8>), SandboxErrors))]
async fn download(
    State(state): State<AppState>,
    caller: SandboxCaller,
    Query(q): Query<FileQuery>,
) -> E2bResult<Response> {
    let path = q
        .path
        .ok_or_else(|| E2bError::bad_request("the path parameter is missing"))?;
    let rel = workspace_relative(&path)?;
    let ws = workspace(&state, &caller).await?;
    let max = state.limits.max_file_bytes;
    caller.session.touch();
    let data = ws.read(&rel, max).await.map_err(|e| file_error(e, &path))?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

fn file_error(e: SessionError, path: &str) -> E2bError {
    match e {
        SessionError::NoSuchFile { .. } => E2bError::not_found(format!("path {path:?} not found")),
        other => other.into(),
    }
}

/// Upload files (envd): multipart field `file` (its file name is the path without
/// `?path=`) or one octet-stream body
///
/// Each file is refused past `--max-file-bytes` (413) as its bytes arrive; a multipart body
/// is also refused (413) past `--max-file-bytes` plus 1 MiB in all (several files of one
/// request together) or past 1000 files; 429 while the user's uploads in progress hold twice
/// `--max-file-bytes`. A refused upload writes nothing.
#[utoipa::path(post, operation_id = "e2b_upload", path = "/e2b/sandbox/files", tag = "e2b", security(()),
    params(("path" = Option<String>, Query, description = "`/workspace/...` or relative to it")),
    responses((status = 200, description = "`[{path, name, type}]`", body = serde_json::Value), SandboxErrors))]
async fn upload(
    State(state): State<AppState>,
    caller: SandboxCaller,
    Query(q): Query<FileQuery>,
    headers: HeaderMap,
    request: Request,
) -> E2bResult<Json<Vec<Value>>> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if headers.contains_key(header::CONTENT_ENCODING) {
        return Err(E2bError::unsupported(
            "compressed uploads (Content-Encoding)",
        ));
    }
    let max = state.limits.max_file_bytes;
    // Held until the files are written.
    let mut budget = UploadBudget::of(&state, &caller.session.user.name);
    let mut uploads: Vec<(String, axum::body::Bytes)> = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        // Every part is held until the last has arrived (nothing is written unless the
        // whole upload is good), so the whole body is bounded, not only each part: part
        // headers, boundaries and preamble are buffered by the parser, and many parts
        // each within the limit would add up.
        let total = max.saturating_add(MULTIPART_OVERHEAD);
        let (parts, body) = request.into_parts();
        let limited =
            Request::from_parts(parts, Body::new(http_body_util::Limited::new(body, total)));
        let mut form = Multipart::from_request(limited, &state)
            .await
            .map_err(|e| E2bError::bad_request(format!("invalid multipart body: {e}")))?;
        let multipart_error = move |e: MultipartError| -> ApiError {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(format!(
                    "the upload is larger than the limit of {total} bytes (the files of one \
                     request together, headers included); send large files one per request"
                ))
            } else {
                ApiError::bad_request(format!("invalid multipart body: {}", e.body_text()))
            }
        };
        while let Some(field) = form.next_field().await.map_err(multipart_error)? {
            if uploads.len() == MAX_PARTS {
                return Err(E2bError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("an upload holds at most {MAX_PARTS} files"),
                ));
            }
            let name = field.file_name().map(str::to_string);
            let path = match (&q.path, name) {
                (Some(p), _) => p.clone(),
                (None, Some(n)) => n,
                (None, None) => {
                    return Err(E2bError::bad_request(
                        "a file part has no file name and no ?path=",
                    ))
                }
            };
            // Read as it arrives, refused at the first byte past the limit: a part far
            // larger than the limit costs the limit, not its size.
            let data = collect_upload(field.map_err(multipart_error), max, &mut budget).await?;
            uploads.push((path, data));
        }
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| E2bError::bad_request("the path parameter is missing"))?;
        let data = read_upload(request.into_body(), max, &mut budget).await?;
        uploads.push((path, data));
    }
    let ws = workspace(&state, &caller).await?;
    caller.session.touch();
    let mut out = Vec::new();
    for (path, data) in uploads {
        let rel = workspace_relative(&path)?;
        ws.write(&rel, data).await?;
        let name = rel.rsplit('/').next().unwrap_or(&rel).to_string();
        out.push(json!({"path": inside_path(&rel), "name": name, "type": "file"}));
    }
    Ok(Json(out))
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
    })
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
            ws.remove(&rel).await.map_err(fs_error)?;
            Ok(json!({}))
        }
        "Move" => {
            let req: MoveReq = unary_request(&bytes)?;
            let (from, to) = (rel_of(&req.source)?, rel_of(&req.destination)?);
            ws.rename(&from, &to).await.map_err(fs_error)?;
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
    fn permissions_read_like_ls() {
        assert_eq!(permissions(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions(libc::S_IFDIR | 0o755), "drwxr-xr-x");
    }
}
