//! Snapshots (issue 37) on the agent REST API: taken of a session, listed, read and deleted
//! by their user; a session starts from one with `"snapshot"` in `POST /v1/sessions`. The
//! session layer checks and does everything (`session/registry/snapshot.rs`); this file
//! parses and renders.

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Caller;
use super::error::{ApiError, ApiResult};
use super::extract::{session_id, BodyLimit, JsonBody};
use super::shapes::{ErrorBody, ErrorResponse};
use super::AppState;
use crate::session::snapshot::SnapshotInfo;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(take))
        .routes(routes!(list))
        .routes(routes!(get_one, delete))
}

/// A snapshot, as the API shows it.
#[derive(Serialize, ToSchema)]
#[schema(as = Snapshot)]
pub struct SnapshotJson {
    /// The snapshot's id: a session starts from it (`"snapshot"` of a create).
    snapshot_id: Uuid,
    /// The name it was given (several snapshots may share one; the newest answers to it).
    name: Option<String>,
    /// The session it was taken of (which may have ended since).
    session_id: Uuid,
    /// The kernel spec its sessions run.
    kernel: String,
    /// The execution count it was taken at: its sessions go on from it.
    execution_count: u64,
    /// RFC 3339.
    created_at: String,
    /// The memory limit of the session it was taken of: its sessions' default.
    memory_limit_bytes: u64,
    /// What its kernel's images take on disk, in bytes (its copy of the workspace not
    /// counted).
    image_bytes: u64,
}

impl From<SnapshotInfo> for SnapshotJson {
    fn from(i: SnapshotInfo) -> Self {
        Self {
            snapshot_id: i.snapshot_id,
            name: i.name,
            session_id: i.session_id,
            kernel: i.kernel,
            execution_count: i.execution_count,
            created_at: i.created_at.to_rfc3339(),
            memory_limit_bytes: i.memory_limit_bytes,
            image_bytes: i.image_bytes,
        }
    }
}

/// The body of `POST /v1/sessions/{id}/snapshots` (empty: no name).
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotBody {
    /// A name to find it by: 1 to 128 letters, digits and `-_.:/`. Names need not be
    /// unique; E2B's `Sandbox.create(name)` takes the newest of a name.
    name: Option<String>,
}

impl BodyLimit for SnapshotBody {
    fn body_limit(_: &AppState) -> usize {
        64 << 10
    }
}

/// A snapshot id from the path: a UUID, else 404 as a missing snapshot.
fn snapshot_id(id: &str) -> ApiResult<Uuid> {
    Uuid::parse_str(id).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "snapshot_not_found",
            format!("no snapshot {id:?} (snapshot ids are UUIDs)"),
        )
    })
}

/// Take a snapshot of a session
///
/// A named, persistent copy of the session's state: its kernel's memory (variables,
/// modules, open files with their positions, generators, random state, the execution
/// count) and a copy of its workspace, written to the broker's data directory. The session
/// goes on as it was. Any number of new sessions of the caller's start from it
/// (`"snapshot"` in `POST /v1/sessions`), each with its own copy; it outlives the session
/// and the broker's restarts until deleted. The session must be idle (409 while code runs)
/// and have a workspace of its own (`"workspace": "own"`; every E2B sandbox). A user keeps
/// at most 32 snapshots (429). Local sandbox, as root with CRIU 4.
#[utoipa::path(post, operation_id = "snapshot_session", path = "/v1/sessions/{id}/snapshots", tag = "snapshots", params(("id" = uuid::Uuid, Path)),
    request_body(content = Option<SnapshotBody>, description = "Optional"),
    responses((status = 201, description = "taken; `Location` is the snapshot's URL", body = SnapshotJson),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 409, description = "`snapshot_refused`: the session runs code, shares its user's workspace, or cannot be snapshotted here (the text says why)", body = ErrorBody),
        (status = 413, response = ErrorResponse),
        (status = 429, description = "the caller keeps as many snapshots as allowed", body = ErrorBody),
        (status = 502, description = "`snapshot_failed`: the kernel could not be written (the session goes on as it was)", body = ErrorBody),
        (status = 507, description = "the data file system has too little room for the snapshot (the session goes on)", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn take(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<SnapshotBody>,
) -> ApiResult<Response> {
    let id = session_id(&id)?;
    let info = state
        .registry
        .snapshot(&caller.0.name, id, body.name)
        .await?;
    let location = format!("/v1/snapshots/{}", info.snapshot_id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(SnapshotJson::from(info)),
    )
        .into_response())
}

/// The caller's snapshots
///
/// Oldest first; another user's are never listed.
#[utoipa::path(get, operation_id = "list_snapshots", path = "/v1/snapshots", tag = "snapshots",
    responses((status = 200, description = "ok", body = Vec<SnapshotJson>), (status = 401, response = ErrorResponse)))]
async fn list(State(state): State<AppState>, caller: Caller) -> Json<Vec<SnapshotJson>> {
    Json(
        state
            .registry
            .snapshots(&caller.0.name, None)
            .into_iter()
            .map(SnapshotJson::from)
            .collect(),
    )
}

/// One of the caller's snapshots
#[utoipa::path(get, operation_id = "get_snapshot", path = "/v1/snapshots/{snapshot_id}", tag = "snapshots", params(("snapshot_id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = SnapshotJson),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "`snapshot_not_found` (another user's answers so too)", body = ErrorBody)))]
async fn get_one(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<SnapshotJson>> {
    let id = snapshot_id(&id)?;
    Ok(Json(
        state.registry.snapshot_info(&caller.0.name, id)?.into(),
    ))
}

/// Delete a snapshot
///
/// Its images and its copy of the workspace go, once the sessions starting from it have
/// their copies; sessions started from it go on.
#[utoipa::path(delete, operation_id = "delete_snapshot", path = "/v1/snapshots/{snapshot_id}", tag = "snapshots", params(("snapshot_id" = uuid::Uuid, Path)),
    responses((status = 204, description = "deleted"),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "`snapshot_not_found` (another user's answers so too)", body = ErrorBody)))]
async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let id = snapshot_id(&id)?;
    state.registry.delete_snapshot(&caller.0.name, id).await?;
    Ok(StatusCode::NO_CONTENT)
}
