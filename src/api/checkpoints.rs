//! Checkpoints and rewind of a session (issue 36) on the agent REST API: take, list,
//! delete, rewind to, fork from. The session layer checks and does everything
//! (`session/registry/checkpoint.rs`); this file parses and renders.

use axum::extract::{Path, State};
use axum::http::StatusCode;
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
use super::sessions::ForkedJson;
use super::shapes::{iso, ErrorBody, ErrorResponse, SessionJson};
use super::AppState;
use crate::session::{
    CheckpointInfo, CheckpointList, CheckpointPolicy, CheckpointUse, CreateOptions,
    DroppedCheckpoint, ForkRequest, FrontDoor, Provenance,
};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(take, list))
        .routes(routes!(delete))
        .routes(routes!(rewind))
        .routes(routes!(fork))
}

/// A checkpoint: a frozen copy of the session's kernel at `execution_count`.
#[derive(Serialize, ToSchema)]
#[schema(as = Checkpoint)]
pub struct CheckpointJson {
    id: Uuid,
    session: Uuid,
    /// The session's execution count when it was taken; a rewind goes back to it.
    execution_count: u64,
    #[schema(format = DateTime)]
    created_at: String,
    /// What its cgroup leaf is charged now, in bytes (the pages the live kernel has not
    /// rewritten since are shared and charged here); `null` where the sandbox cannot tell.
    #[schema(required = true)]
    memory_bytes: Option<u64>,
}

impl From<CheckpointInfo> for CheckpointJson {
    fn from(c: CheckpointInfo) -> Self {
        Self {
            id: c.id,
            session: c.session,
            execution_count: c.execution_count,
            created_at: iso(c.created_at),
            memory_bytes: c.memory_bytes,
        }
    }
}

/// A checkpoint that ended before its session, and why.
#[derive(Serialize, ToSchema)]
pub struct DroppedJson {
    id: Uuid,
    execution_count: u64,
    #[schema(format = DateTime)]
    dropped_at: String,
    /// Deleted by request, over the user's count or memory budget, or its kernel ended.
    reason: String,
}

impl From<DroppedCheckpoint> for DroppedJson {
    fn from(d: DroppedCheckpoint) -> Self {
        Self {
            id: d.id,
            execution_count: d.execution_count,
            dropped_at: iso(d.dropped_at),
            reason: d.why,
        }
    }
}

/// The caller's bounds on checkpoints, over all her sessions.
#[derive(Serialize, ToSchema)]
pub struct CheckpointBudgetJson {
    /// The most checkpoints she holds at once; past it her oldest is dropped.
    max_count: usize,
    /// The most memory her checkpoints are charged together; past it her oldest are dropped.
    memory_budget_bytes: u64,
    /// Her checkpoints now, over all her sessions.
    count: usize,
    memory_used_bytes: u64,
    /// Whether her sessions take a checkpoint after every successful execution by default
    /// (a session's own mode is the list's `every_execution`).
    every_execution: bool,
}

/// A session's checkpoints, the caller's budget, and the checkpoints it lost.
#[derive(Serialize, ToSchema)]
pub struct CheckpointsJson {
    /// Oldest first.
    checkpoints: Vec<CheckpointJson>,
    budget: CheckpointBudgetJson,
    /// The session's checkpoints dropped before it ended (the last 64), oldest first.
    dropped: Vec<DroppedJson>,
    /// Whether this session takes a checkpoint after every successful execution (its own
    /// mode: `checkpoint_every_execution` at its creation, else its user's default, which
    /// `budget.every_execution` gives).
    every_execution: bool,
}

impl CheckpointsJson {
    /// What `GET .../checkpoints` answers (and MCP's `list_checkpoints`).
    pub(super) fn new(
        list: CheckpointList,
        usage: CheckpointUse,
        policy: CheckpointPolicy,
    ) -> Self {
        Self {
            checkpoints: list.checkpoints.into_iter().map(Into::into).collect(),
            budget: CheckpointBudgetJson {
                max_count: policy.max_count,
                memory_budget_bytes: policy.memory_budget_bytes,
                count: usage.count,
                memory_used_bytes: usage.memory_bytes,
                every_execution: policy.every_execution,
            },
            dropped: list.dropped.into_iter().map(Into::into).collect(),
            every_execution: list.every_execution,
        }
    }
}

fn checkpoint_id(cp: &str) -> ApiResult<Uuid> {
    Uuid::parse_str(cp).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "checkpoint_not_found",
            format!("no checkpoint {cp:?} (checkpoint ids are UUIDs)"),
        )
    })
}

/// Take a checkpoint
///
/// Freezes a copy of the session's kernel as it is now (its variables, modules, random
/// state, execution count); the session goes on at once. Over the caller's count or
/// memory budget her oldest checkpoint is dropped. The session must be idle (409 while
/// code runs); only sessions whose kernels can be forked have checkpoints (409 otherwise).
#[utoipa::path(post, operation_id = "take_checkpoint", path = "/v1/sessions/{id}/checkpoints", tag = "checkpoints", params(("id" = uuid::Uuid, Path)),
    responses((status = 201, description = "taken", body = CheckpointJson),
        (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 409, description = "the session runs code, has a workspace of its own, or its kernel cannot be forked here", body = ErrorBody),
        (status = 502, description = "the kernel did not fork as asked (the session goes on as it was)", body = ErrorBody),
        (status = 504, description = "the kernel did not answer in time", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn take(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let info = state
        .registry
        .take_checkpoint(&caller.0.name, session_id(&id)?, caller.0.checkpoints)
        .await?;
    Ok((StatusCode::CREATED, Json(CheckpointJson::from(info))).into_response())
}

/// List a session's checkpoints
#[utoipa::path(get, operation_id = "list_checkpoints", path = "/v1/sessions/{id}/checkpoints", tag = "checkpoints", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = CheckpointsJson),
        (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse)))]
async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<CheckpointsJson>> {
    let (list, usage) = state
        .registry
        .checkpoints(&caller.0.name, session_id(&id)?)
        .await?;
    Ok(Json(CheckpointsJson::new(
        list,
        usage,
        caller.0.checkpoints,
    )))
}

/// Delete a checkpoint
#[utoipa::path(delete, operation_id = "delete_checkpoint", path = "/v1/sessions/{id}/checkpoints/{cp}", tag = "checkpoints",
    params(("id" = uuid::Uuid, Path), ("cp" = uuid::Uuid, Path)),
    responses((status = 204, description = "deleted: its kernel ended"),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "no such session of the caller's, or no such checkpoint of it", body = ErrorBody),
        (status = 410, response = ErrorResponse)))]
async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, cp)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    state
        .registry
        .delete_checkpoint(&caller.0.name, session_id(&id)?, checkpoint_id(&cp)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The body of `POST /v1/sessions/{id}/rewind`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RewindBody {
    /// The checkpoint to go back to.
    checkpoint: Uuid,
}

impl BodyLimit for RewindBody {
    fn body_limit(_: &AppState) -> usize {
        4096
    }
}

/// Rewind a session to a checkpoint
///
/// Replaces the session's kernel by a fork of the checkpoint: its variables, modules and
/// random state are the checkpoint's again, and so is the execution count; the session
/// keeps its id and recording. The checkpoint stays (rewind to it again at will). The
/// workspace's files are not rewound. The session must be idle (409 while code runs).
#[utoipa::path(post, operation_id = "rewind_session", path = "/v1/sessions/{id}/rewind", tag = "checkpoints", params(("id" = uuid::Uuid, Path)),
    request_body = RewindBody,
    responses((status = 200, description = "rewound", body = SessionJson),
        (status = 400, description = "a bad body", body = ErrorBody),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "no such session of the caller's, or no such checkpoint of it", body = ErrorBody),
        (status = 410, response = ErrorResponse),
        (status = 409, description = "the session runs code, or cannot have checkpoints", body = ErrorBody),
        (status = 502, description = "the checkpoint's kernel did not fork as asked (the session keeps its kernel)", body = ErrorBody),
        (status = 504, description = "the checkpoint's kernel did not answer in time", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn rewind(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<RewindBody>,
) -> ApiResult<Json<SessionJson>> {
    let session = state
        .registry
        .rewind(&caller.0.name, session_id(&id)?, req.checkpoint)
        .await?;
    Ok(Json(session.info().into()))
}

/// Fork a session from a checkpoint
///
/// Makes a new session of the caller whose kernel is a copy of the checkpoint's, as
/// `POST /v1/sessions/{id}/fork` does from the live kernel (the session quota and memory
/// total count it the same way); the session and the checkpoint are untouched.
#[utoipa::path(post, operation_id = "fork_checkpoint", path = "/v1/sessions/{id}/checkpoints/{cp}/fork", tag = "checkpoints",
    params(("id" = uuid::Uuid, Path), ("cp" = uuid::Uuid, Path)),
    responses((status = 201, description = "forked", body = ForkedJson),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "no such session of the caller's, or no such checkpoint of it", body = ErrorBody),
        (status = 410, response = ErrorResponse),
        (status = 409, description = "the session cannot be forked here", body = ErrorBody),
        (status = 429, description = "the fork does not fit the user's session quota or memory total", body = ErrorBody),
        (status = 502, description = "the checkpoint's kernel did not fork as asked", body = ErrorBody),
        (status = 504, description = "the checkpoint's kernel did not answer in time", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn fork(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, cp)): Path<(String, String)>,
) -> ApiResult<Response> {
    let session = session_id(&id)?;
    let checkpoint = checkpoint_id(&cp)?;
    let base = caller.0.create_request(CreateOptions::default());
    let room = super::cluster::quota::room(&state, &caller.0).await?;
    let forks = state
        .registry
        .fork(ForkRequest {
            checkpoint: Some(checkpoint),
            user: base.user,
            max_sessions: room.max_sessions(),
            session,
            count: 1,
            provenance: Provenance::new(FrontDoor::Rest),
        })
        .await
        .map_err(|e| room.explain(e))?;
    let sessions = forks.iter().map(|s| SessionJson::from(s.info())).collect();
    Ok((StatusCode::CREATED, Json(ForkedJson { sessions })).into_response())
}
