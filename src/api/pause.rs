//! Pausing a session to disk and resuming it (issue 37) on the agent REST API. The
//! session layer checks and does everything (`session/registry/pause.rs`); this file
//! parses and renders. Any other use of a paused session (an execution, a fork, a
//! Jupyter message) resumes it first.

use axum::extract::{Path, State};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Caller;
use super::error::ApiResult;
use super::extract::session_id;
use super::shapes::{ErrorBody, ErrorResponse, SessionJson, SessionStateJson};
use super::AppState;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(pause))
        .routes(routes!(resume))
}

/// A paused session: its kernel's state is on disk, its memory given back.
#[derive(Serialize, ToSchema)]
#[schema(as = Paused)]
pub struct PausedJson {
    id: Uuid,
    /// `paused`.
    state: SessionStateJson,
    /// The execution count it resumes at.
    execution_count: u64,
    /// What its kernel's images take on disk, in bytes.
    image_bytes: u64,
    /// How long the pause took, in milliseconds (0: it was paused already).
    pause_ms: u64,
}

impl PausedJson {
    /// What a pause of session `id` answers (and MCP's `pause_session`).
    pub(super) fn new(id: Uuid, info: crate::session::PauseInfo) -> Self {
        Self {
            id,
            state: SessionStateJson::Paused,
            execution_count: info.execution_count,
            image_bytes: info.image_bytes,
            pause_ms: info.took.as_millis() as u64,
        }
    }
}

/// Pause a session to disk
///
/// Writes the session's kernel (its memory: variables, modules, open files with their
/// positions, generators, random state, the execution count) to the broker's data
/// directory and ends the kernel, giving its memory back to the caller's total. The
/// session keeps its id, workspace, checkpoints and recording, and is listed as `paused`.
/// Any use of it (an execution, `POST .../resume`, a fork, a Jupyter message) resumes it
/// with the same state. Pausing a paused session answers as the first pause did. The
/// session must be idle (409 while code runs). On the local sandbox a paused session
/// outlives the broker (a stop, a restart, an upgrade); on Docker it ends with the broker.
#[utoipa::path(post, operation_id = "pause_session", path = "/v1/sessions/{id}/pause", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "paused", body = PausedJson),
        (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 409, description = "the session runs code, or cannot be paused here (the text says why)", body = ErrorBody),
        (status = 502, description = "the kernel could not be written to disk (the session goes on running as it was)", body = ErrorBody),
        (status = 507, description = "the broker's data file system has too little room for the kernel's images (the session goes on running)", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn pause(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<PausedJson>> {
    let id = session_id(&id)?;
    let info = state.registry.pause(&caller.0.name, id).await?;
    Ok(Json(PausedJson::new(id, info)))
}

/// Resume a paused session
///
/// Brings the session's kernel back from disk with the state it was paused with, under
/// the same id; a session that is not paused is answered as it is. The resumed kernel
/// takes its memory from the caller's total again (429 if it no longer fits: the session
/// stays paused). A resume that fails (a damaged image) leaves the session `dead`, saying
/// why.
#[utoipa::path(post, operation_id = "resume_session", path = "/v1/sessions/{id}/resume", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "running", body = SessionJson),
        (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 429, description = "the kernel's memory does not fit the caller's total now (the session stays paused)", body = ErrorBody),
        (status = 502, description = "the kernel could not be restored: the session is dead, `dead_reason` says why", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn resume(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<SessionJson>> {
    let id = session_id(&id)?;
    state.registry.resume(&caller.0.name, id).await?;
    let session = state.registry.get(&caller.0.name, id)?;
    Ok(Json(session.info().into()))
}
