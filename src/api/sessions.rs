//! The agent REST API: `/v1/sessions` and everything under it (create, list, execute,
//! interrupt, restart, workspace files). Authentication, the session lookup and JSON
//! bodies come from the shared extractors (`extract.rs`); the JSON shapes from `shapes.rs`.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Caller;
use super::error::{ApiError, ApiResult};
use super::extract::{
    check_code, read_limited, sandbox_user, session_id, BodyLimit, JsonBody, OwnedSession,
};
use super::shapes::{ErrorBody, ErrorResponse, ExecutionJson, FileJson, SessionJson};
use super::AppState;
use crate::session::files;
use crate::session::{CreateOptions, Session};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create, list))
        .routes(routes!(get_one, delete))
        .routes(routes!(execute))
        .routes(routes!(interrupt))
        .routes(routes!(restart))
        .routes(routes!(list_files))
        .routes(routes!(get_file, put_file))
        .layer(axum::extract::DefaultBodyLimit::disable())
}

/// The body of `POST /v1/sessions` (empty means all defaults).
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// A kernel spec name; the default kernel when absent.
    kernel: Option<String>,
    /// Idle time before the session expires, capped by the broker's maximum.
    #[schema(minimum = 0)]
    idle_timeout_seconds: Option<u64>,
    /// The kernel's own memory limit in bytes: past it this kernel alone is killed. Counted
    /// against the user's memory total at creation (429 `quota_exceeded` when it does not
    /// fit). At least 16 MiB and at most the user's total; the user's default when absent.
    #[schema(minimum = 16777216)]
    memory_limit_bytes: Option<u64>,
}

impl BodyLimit for CreateBody {
    fn body_limit(_: &AppState) -> usize {
        64 << 10
    }
}

/// Create a session (waits until its kernel is ready)
#[utoipa::path(post, operation_id = "create_session", path = "/v1/sessions", tag = "sessions",
    request_body(content = Option<CreateBody>, description = "Optional; an empty body takes the defaults"),
    responses(
        (status = 201, description = "created; `Location` is the session's URL", body = SessionJson,
            headers(("Location" = String, description = "/v1/sessions/{id}"))),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 413, response = ErrorResponse),
        (status = 429, description = "the user's session quota is used, or the user's memory total has no room for this session's limit (the message says how much is in use and by how many sessions)", body = ErrorBody),
        (status = 503, description = "the kernel could not start", body = ErrorBody),
    ))]
async fn create(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(req): JsonBody<CreateBody>,
) -> ApiResult<Response> {
    let session = state
        .registry
        .create(
            &sandbox_user(&caller),
            caller.0.max_sessions,
            CreateOptions {
                kernel: req.kernel,
                idle_timeout_seconds: req.idle_timeout_seconds,
                id: None,
                memory_limit_bytes: req.memory_limit_bytes,
            },
        )
        .await?;
    let location = format!("/v1/sessions/{}", session.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(SessionJson::from(session.info())),
    )
        .into_response())
}

/// The caller's sessions
#[utoipa::path(get, operation_id = "list_sessions", path = "/v1/sessions", tag = "sessions",
    responses((status = 200, description = "ok", body = Vec<SessionJson>), (status = 401, response = ErrorResponse)))]
async fn list(State(state): State<AppState>, caller: Caller) -> Json<Vec<SessionJson>> {
    Json(
        state
            .registry
            .list(&caller.0.name)
            .iter()
            .map(|s| SessionJson::from(s.info()))
            .collect(),
    )
}

/// One session
#[utoipa::path(get, operation_id = "get_session", path = "/v1/sessions/{id}", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = SessionJson),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "no such session of the caller's", body = ErrorBody),
        (status = 410, description = "the session expired", body = ErrorBody)))]
async fn get_one(owned: OwnedSession) -> Json<SessionJson> {
    Json(owned.session.info().into())
}

/// Shut a session down
#[utoipa::path(delete, operation_id = "delete_session", path = "/v1/sessions/{id}", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    responses((status = 204, description = "deleted"), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse)))]
async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    // Not through `OwnedSession`: the registry's delete does its own lookup (and answers a
    // session deleted meanwhile), so the id is only parsed here.
    state
        .registry
        .delete(&caller.0.name, session_id(&id)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The body of `POST /v1/sessions/{id}/execute`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteBody {
    /// Python code, at most the broker's code limit in bytes.
    code: String,
    /// Seconds before the execution is interrupted, capped by the broker's maximum.
    #[schema(exclusive_minimum = 0)]
    timeout_seconds: Option<f64>,
}

impl BodyLimit for ExecuteBody {
    /// Room for the JSON around the code (escapes can double it).
    fn body_limit(state: &AppState) -> usize {
        state.limits.max_code_bytes * 2 + 4096
    }
}

/// Run code; answers when it is done
///
/// Executions of a session run one at a time, in arrival order. The answer comes once the
/// execution is recorded.
#[utoipa::path(post, operation_id = "execute", path = "/v1/sessions/{id}/execute", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    request_body = ExecuteBody,
    responses((status = 200, description = "ok", body = ExecutionJson),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 413, description = "the code or the body is over the limit", body = ErrorBody),
        (status = 429, description = "the session's queue is full", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn execute(
    State(state): State<AppState>,
    owned: OwnedSession,
    JsonBody(req): JsonBody<ExecuteBody>,
) -> ApiResult<Json<ExecutionJson>> {
    check_code(&state, &req.code)?;
    let timeout = state.execution_timeout(req.timeout_seconds)?;
    let execution = owned.session.execute_wait(req.code, timeout).await?;
    Ok(Json(execution.into()))
}

/// Interrupt the running execution
#[utoipa::path(post, operation_id = "interrupt_session", path = "/v1/sessions/{id}/interrupt", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    responses((status = 204, description = "interrupted"), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 503, response = ErrorResponse)))]
async fn interrupt(owned: OwnedSession) -> ApiResult<StatusCode> {
    owned.session.interrupt().await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Restart the kernel (state cleared)
#[utoipa::path(post, operation_id = "restart_session", path = "/v1/sessions/{id}/restart", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = SessionJson), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 503, response = ErrorResponse)))]
async fn restart(owned: OwnedSession) -> ApiResult<Json<SessionJson>> {
    owned.session.restart().await?;
    Ok(Json(owned.session.info().into()))
}

async fn workspace_of(state: &AppState, session: &Session) -> ApiResult<std::path::PathBuf> {
    state
        .registry
        .sandbox()
        .workspace(&session.user)
        .map_err(|e| ApiError::internal("workspace", e))
}

/// Response header of `GET /v1/sessions/{id}/files`: `true` when the listing was cut short.
const FILES_TRUNCATED: &str = "x-files-truncated";

/// Files in the user's workspace
///
/// At most 10,000 files; a listing cut short says so in the `x-files-truncated` header.
#[utoipa::path(get, operation_id = "list_files", path = "/v1/sessions/{id}/files", tag = "files", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = Vec<FileJson>,
            headers(("x-files-truncated" = String, description = "`true` when the listing was cut short"))),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse),
        (status = 410, response = ErrorResponse)))]
async fn list_files(State(state): State<AppState>, owned: OwnedSession) -> ApiResult<Response> {
    let session = owned.session;
    session.touch();
    let ws = workspace_of(&state, &session).await?;
    let listing = tokio::task::spawn_blocking(move || files::list(&ws, 10_000))
        .await
        .map_err(|e| ApiError::internal("list files", e))??;
    // The body stays a plain array (compatible); a cut-short listing says so in a header.
    let truncated = if listing.truncated { "true" } else { "false" };
    let body: Vec<FileJson> = listing.files.into_iter().map(FileJson::from).collect();
    Ok(([(FILES_TRUNCATED, truncated)], Json(body)).into_response())
}

/// Download a workspace file
#[utoipa::path(get, operation_id = "get_file", path = "/v1/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = uuid::Uuid, Path), ("path" = String, Path, description = "relative to the workspace; no `..`, no symlinks")),
    responses((status = 200, description = "raw bytes", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 413, response = ErrorResponse)))]
async fn get_file(
    State(state): State<AppState>,
    owned: OwnedSession,
    Path((_, path)): Path<(String, String)>,
) -> ApiResult<Response> {
    let session = owned.session;
    session.touch();
    let ws = workspace_of(&state, &session).await?;
    let max = state.limits.max_file_bytes;
    let (file, size) = tokio::task::spawn_blocking(move || files::open_for_read(&ws, &path, max))
        .await
        .map_err(|e| ApiError::internal("read file", e))??;
    // Streamed from the file as the client reads: a slow reader holds a chunk of memory,
    // not the whole file. The size read at opening is all that is sent, whatever the kernel
    // appends meanwhile.
    let chunks = tokio_util::io::ReaderStream::new(tokio::io::AsyncReadExt::take(
        tokio::fs::File::from_std(file),
        size,
    ));
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        Body::from_stream(chunks),
    )
        .into_response())
}

/// Upload a workspace file
#[utoipa::path(put, operation_id = "put_file", path = "/v1/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = uuid::Uuid, Path), ("path" = String, Path, description = "relative to the workspace; directories are created")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, description = "written"),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 413, response = ErrorResponse)))]
async fn put_file(
    State(state): State<AppState>,
    owned: OwnedSession,
    Path((_, path)): Path<(String, String)>,
    body: Body,
) -> ApiResult<StatusCode> {
    let session = owned.session;
    files::clean_relative(&path)?;
    let data = read_limited(body, state.limits.max_file_bytes, "file").await?;
    session.touch();
    let ws = workspace_of(&state, &session).await?;
    let owner = state.registry.sandbox().workspace_owner(&session.user);
    tokio::task::spawn_blocking(move || files::write(&ws, &path, &data, owner))
        .await
        .map_err(|e| ApiError::internal("write file", e))??;
    Ok(StatusCode::CREATED)
}
