//! The agent REST API: `/v1/sessions` and everything under it (create, list, execute,
//! interrupt, restart; workspace files are `files.rs`). Authentication, the session lookup and JSON
//! bodies come from the shared extractors (`extract.rs`); the JSON shapes from `shapes.rs`.

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
use super::extract::{session_id, BodyLimit, JsonBody, OwnedSession};
use super::shapes::{ErrorBody, ErrorResponse, ExecutionJson, SessionJson};
use super::AppState;
use std::collections::BTreeMap;
use uuid::Uuid;

use crate::session::{
    CreateOptions, EndedBy, ExecuteRequest, ForkRequest, FrontDoor, Metadata, Origin, Provenance,
    Timeout, WorkspaceChoice,
};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create, list))
        .routes(routes!(get_one, delete))
        .routes(routes!(execute))
        .routes(routes!(interrupt))
        .routes(routes!(restart))
        .routes(routes!(fork))
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
    /// What the client says about the session (an agent's name, a run id): text shown in
    /// the session browser and searched there, never interpreted. At most 32 entries, keys
    /// of 1 to 64 bytes, values of at most 1024 bytes.
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    /// `shared` (the default): the user's workspace at `/workspace`, shared by all her
    /// sessions and kept after them. `own`: an empty workspace of the session's own at
    /// `/home/user` (its home and working directory) and `/workspace`, with a `/tmp` its
    /// kernel and commands share, removed when the session ends (as an E2B sandbox's).
    workspace: Option<WorkspaceOption>,
    /// Take a checkpoint after every execution that ends ok (`GET .../checkpoints`), within
    /// the user's checkpoint bounds; the user's setting when absent.
    checkpoint_every_execution: Option<bool>,
    /// Start from this snapshot of the caller's (`POST /v1/sessions/{id}/snapshots`): its
    /// kernel with its state, at its execution count, and a workspace of the session's own
    /// holding a copy of the snapshot's. `workspace` is then `own` (or absent) and `kernel`
    /// the snapshot's (or absent); the memory limit is the snapshot's session's unless
    /// another is asked. 404 `snapshot_not_found` for another user's.
    snapshot: Option<Uuid>,
    /// Secret values, by environment variable name: the kernel gets them as environment
    /// variables; no answer, stream, recording, log or export holds a value verbatim, nor
    /// its base64, hex, URL- or HTML-encoded forms: `[secret:NAME]` stands in their place.
    /// Names as environment variables (not the loader's); values of 4 to 4,096 bytes, at
    /// most 8,192 together; at most 32. Not with `snapshot` (its kernel's environment is the
    /// snapshot's).
    #[serde(default)]
    secrets: BTreeMap<String, String>,
}

/// The `workspace` of `POST /v1/sessions`.
#[derive(Deserialize, Clone, Copy, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceOption {
    Shared,
    Own,
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
        (status = 404, description = "`snapshot_not_found`: no such snapshot of the caller's", body = ErrorBody),
        (status = 429, description = "the user's session quota is used, or the user's memory total has no room for this session's limit (the message says how much is in use and by how many sessions)", body = ErrorBody),
        (status = 502, description = "`snapshot_failed`: the snapshot could not be restored (the message says why)", body = ErrorBody),
        (status = 503, description = "the kernel could not start", body = ErrorBody),
        (status = 507, description = "`insufficient_storage`: the data file system has no room for the copy of the snapshot's workspace", body = ErrorBody),
    ))]
async fn create(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(req): JsonBody<CreateBody>,
) -> ApiResult<Response> {
    if req.snapshot.is_some() && matches!(req.workspace, Some(WorkspaceOption::Shared)) {
        return Err(ApiError::bad_request(
            "a session from a snapshot has a workspace of its own: leave `workspace` out or \
             set it to \"own\"",
        ));
    }
    crate::secrets::check(&req.secrets).map_err(|e| ApiError::bad_request(e.to_string()))?;
    if req.snapshot.is_some() && !req.secrets.is_empty() {
        return Err(ApiError::bad_request(
            "a session from a snapshot runs the snapshot's kernel, whose environment cannot \
             take new secrets: leave `secrets` out",
        ));
    }
    let mut request = caller.0.create_request(CreateOptions {
        kernel: req.kernel,
        idle_timeout_seconds: req.idle_timeout_seconds,
        id: None,
        memory_limit_bytes: req.memory_limit_bytes,
        provenance: Provenance::new(FrontDoor::Rest).with_metadata(Metadata::new(req.metadata)?),
        workspace: match req.workspace {
            None | Some(WorkspaceOption::Shared) => WorkspaceChoice::Shared,
            Some(WorkspaceOption::Own) => WorkspaceChoice::Own,
        },
        snapshot: req.snapshot,
        secrets: req.secrets,
    });
    if let Some(every) = req.checkpoint_every_execution {
        request.checkpoints.every_execution = every;
    }
    let session = state.registry.create_session(request).await?;
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
        .delete(
            &caller.0.name,
            session_id(&id)?,
            EndedBy::Client(FrontDoor::Rest),
        )
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
    let timeout = Timeout::Asked(req.timeout_seconds);
    let request = ExecuteRequest::new(req.code, timeout, Origin::Rest, &state.execution_limits())?;
    let execution = owned.session.run(request).await?;
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

/// The body of `POST /v1/sessions/{id}/fork` (empty means one fork).
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// How many forks to make, 1 to 8 (default 1).
    #[schema(minimum = 1, maximum = 8)]
    count: Option<u64>,
}

impl BodyLimit for ForkBody {
    fn body_limit(_: &AppState) -> usize {
        4096
    }
}

/// The sessions a fork made.
#[derive(serde::Serialize, ToSchema)]
pub struct ForkedJson {
    /// The new sessions, as `GET /v1/sessions/{id}` shows them.
    pub(super) sessions: Vec<SessionJson>,
}

/// Fork a live session
///
/// Makes `count` new sessions of the caller whose kernels are copies of this session's
/// live kernel: variables, functions, classes, imported modules, open files and their
/// positions, generators, random state, `In`/`Out` and the execution count, the working
/// directory and the environment. The original goes on untouched. The session must be idle
/// (409 while code runs). Each fork counts against the session quota and the memory total
/// like a new session; a request that does not fit is refused whole.
#[utoipa::path(post, operation_id = "fork_session", path = "/v1/sessions/{id}/fork", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    request_body(content = Option<ForkBody>, description = "Optional; an empty body makes one fork"),
    responses((status = 201, description = "forked", body = ForkedJson),
        (status = 400, description = "a bad body or a count outside 1 to 8", body = ErrorBody),
        (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 409, description = "the session cannot be forked now or here (it runs code, has a workspace of its own, its kernel was not started from a template, the sandbox cannot fork)", body = ErrorBody),
        (status = 429, description = "the forks do not fit the user's session quota or memory total (nothing was made)", body = ErrorBody),
        (status = 502, description = "the kernel refused the fork or answered something not accepted (nothing was made)", body = ErrorBody),
        (status = 504, description = "the kernel did not answer in time (nothing was made)", body = ErrorBody),
        (status = 503, response = ErrorResponse)))]
async fn fork(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ForkBody>,
) -> ApiResult<Response> {
    let session = session_id(&id)?;
    let count = req.count.unwrap_or(1);
    let base = caller.0.create_request(CreateOptions::default());
    let room = super::cluster::quota::room(&state, &caller.0).await?;
    let forks = state
        .registry
        .fork(ForkRequest {
            checkpoint: None,
            user: base.user,
            max_sessions: room.max_sessions(),
            session,
            count,
            provenance: Provenance::new(FrontDoor::Rest),
        })
        .await
        .map_err(|e| room.explain(e))?;
    let sessions = forks.iter().map(|s| SessionJson::from(s.info())).collect();
    Ok((StatusCode::CREATED, Json(ForkedJson { sessions })).into_response())
}
