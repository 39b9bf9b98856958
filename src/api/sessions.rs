//! The agent REST API: `/v1/sessions` and everything under it.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::auth::Caller;
use super::error::{ApiError, ApiResult};
use super::AppState;
use crate::sandbox::SandboxUser;
use crate::session::files;
use crate::session::CreateOptions;
use crate::session::{Session, SessionInfo};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sessions", post(create).get(list))
        .route("/v1/sessions/{id}", get(get_one).delete(delete))
        .route("/v1/sessions/{id}/execute", post(execute))
        .route("/v1/sessions/{id}/interrupt", post(interrupt))
        .route("/v1/sessions/{id}/restart", post(restart))
        .route("/v1/sessions/{id}/files", get(list_files))
        .route(
            "/v1/sessions/{id}/files/{*path}",
            get(get_file).put(put_file),
        )
        .layer(axum::extract::DefaultBodyLimit::disable())
}

/// The Session object of the API.
#[derive(Debug, Serialize)]
pub struct SessionJson {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    pub state: &'static str,
    pub created_at: String,
    pub last_activity: String,
    pub expires_at: Option<String>,
    pub execution_count: u64,
    pub connections: usize,
}

pub fn iso(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

impl From<SessionInfo> for SessionJson {
    fn from(i: SessionInfo) -> Self {
        Self {
            id: i.id,
            user: i.user,
            kernel: i.kernel,
            state: i.state.as_str(),
            created_at: iso(i.created_at),
            last_activity: iso(i.last_activity),
            expires_at: i.expires_at.map(iso),
            execution_count: i.execution_count,
            connections: i.connections,
        }
    }
}

/// Read a whole body, refusing more than `limit` bytes with 413.
pub async fn read_body(body: Body, limit: usize, what: &str) -> ApiResult<Bytes> {
    axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::too_large(format!(
            "the {what} is larger than the limit of {limit} bytes"
        ))
    })
}

/// Parse JSON, answering 400 with serde's explanation.
pub fn parse_json<T: for<'de> Deserialize<'de>>(bytes: &[u8], what: &str) -> ApiResult<T> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return serde_json::from_slice(b"{}")
            .map_err(|e| ApiError::bad_request(format!("{what}: {e}")));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON in the {what}: {e}")))
}

pub fn sandbox_user(caller: &Caller) -> SandboxUser {
    SandboxUser {
        name: caller.0.name.clone(),
        index: caller.0.index,
        limits: caller.0.limits.clone(),
    }
}

fn parse_id(id: &str) -> ApiResult<Uuid> {
    Uuid::parse_str(id).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "session_not_found",
            format!("no session {id:?} (session ids are UUIDs)"),
        )
    })
}

pub fn session_of(
    state: &AppState,
    caller: &Caller,
    id: &str,
) -> ApiResult<std::sync::Arc<Session>> {
    Ok(state.registry.get(&caller.0.name, parse_id(id)?)?)
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    kernel: Option<String>,
    idle_timeout_seconds: Option<u64>,
}

async fn create(State(state): State<AppState>, caller: Caller, body: Body) -> ApiResult<Response> {
    let bytes = read_body(body, 64 << 10, "request body").await?;
    let req: CreateBody = parse_json(&bytes, "request body")?;
    let session = state
        .registry
        .create(
            &sandbox_user(&caller),
            caller.0.max_sessions,
            CreateOptions {
                kernel: req.kernel,
                idle_timeout_seconds: req.idle_timeout_seconds,
                id: None,
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

async fn get_one(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<SessionJson>> {
    Ok(Json(session_of(&state, &caller, &id)?.info().into()))
}

async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    state
        .registry
        .delete(&caller.0.name, parse_id(&id)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecuteBody {
    code: String,
    timeout_seconds: Option<f64>,
}

async fn execute(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Response> {
    let session = session_of(&state, &caller, &id)?;
    // Room for the JSON around the code (escapes can double it).
    let limit = state.limits.max_code_bytes * 2 + 4096;
    let bytes = read_body(body, limit, "request body").await?;
    let req: ExecuteBody = parse_json(&bytes, "request body")?;
    check_code(&state, &req.code)?;
    let timeout = state.execution_timeout(req.timeout_seconds)?;
    let execution = session.execute_wait(req.code, timeout).await?;
    Ok(Json(execution).into_response())
}

pub fn check_code(state: &AppState, code: &str) -> ApiResult<()> {
    if code.len() > state.limits.max_code_bytes {
        return Err(ApiError::too_large(format!(
            "the code has {} bytes; the limit is {}",
            code.len(),
            state.limits.max_code_bytes
        )));
    }
    Ok(())
}

async fn interrupt(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    session_of(&state, &caller, &id)?.interrupt().await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn restart(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<SessionJson>> {
    let session = session_of(&state, &caller, &id)?;
    session.restart().await?;
    Ok(Json(session.info().into()))
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

async fn list_files(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let session = session_of(&state, &caller, &id)?;
    session.touch();
    let ws = workspace_of(&state, &session).await?;
    let listing = tokio::task::spawn_blocking(move || files::list(&ws, 10_000))
        .await
        .map_err(|e| ApiError::internal("list files", e))??;
    // The body stays a plain array (compatible); a cut-short listing says so in a header.
    let truncated = if listing.truncated { "true" } else { "false" };
    Ok(([(FILES_TRUNCATED, truncated)], Json(listing.files)).into_response())
}

async fn get_file(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
) -> ApiResult<Response> {
    let session = session_of(&state, &caller, &id)?;
    session.touch();
    let ws = workspace_of(&state, &session).await?;
    let max = state.limits.max_file_bytes;
    let data = tokio::task::spawn_blocking(move || files::read(&ws, &path, max))
        .await
        .map_err(|e| ApiError::internal("read file", e))??;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

async fn put_file(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
    body: Body,
) -> ApiResult<StatusCode> {
    let session = session_of(&state, &caller, &id)?;
    files::clean_relative(&path)?;
    let data = read_body(body, state.limits.max_file_bytes, "file").await?;
    session.touch();
    let ws = workspace_of(&state, &session).await?;
    let owner = state.registry.sandbox().workspace_owner(&session.user);
    tokio::task::spawn_blocking(move || files::write(&ws, &path, &data, owner))
        .await
        .map_err(|e| ApiError::internal("write file", e))??;
    Ok(StatusCode::CREATED)
}
