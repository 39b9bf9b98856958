//! E2B's fork (`POST /e2b/sandboxes/{id}/fork`, what `Sandbox.fork` / `sbx.fork()` send):
//! `count` new sandboxes whose kernel is a copy of the sandbox's, through the session
//! layer's `Registry::fork` (one front door: its checks, quotas and errors are the REST
//! fork's). Each fork is a sandbox as create makes it: its own id and access tokens, the
//! template, metadata and `envVars` of the sandbox it came from, E2B's `timeout` as its
//! deadline (E2B's fork default, 15 s), ended with its contexts like any other.
//!
//! E2B's answer is one entry per requested fork, `{"sandbox": ...}` or `{"error": {code,
//! message}}`, and a status other than 201 only when nothing was attempted. The session
//! layer makes all the forks or none, so the entries are all sandboxes, or all the same
//! error when making them failed (the kernel refused or did not answer, a fork's kernel
//! did not come up: [`failed_while_forking`]); what refuses the request before any fork
//! is tried (no such sandbox, busy, cannot be forked here, a quota, a bad body) is the
//! whole answer's error, in E2B's shape.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::ApiKeyUser;
use super::control::{metadata_of, owned, sandbox_json, timeout_secs};
use super::documented::ControlErrors;
use super::state::SandboxMeta;
use super::{E2bError, E2bResult, E2bState};
use crate::api::extract::{parse_json, read_limited};
use crate::api::AppState;
use crate::session::{ForkRequest, FrontDoor, Provenance, SessionError, MAX_FORKS};

/// E2B's default timeout of a fork (`SandboxForkRequest.timeout`), in seconds.
const DEFAULT_FORK_TIMEOUT: u64 = 15;

/// E2B's fork routes. No `/v2` alias: E2B's API has none for fork.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(fork))
}

/// What `POST /sandboxes/{id}/fork` takes (unknown fields are ignored, as E2B's API does).
#[derive(Deserialize, Default)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u64>,
}

/// Errors of the session layer's fork that come after forks were attempted: E2B reports
/// them in each fork's entry, not as the request's status.
fn failed_while_forking(e: &SessionError) -> bool {
    matches!(
        e,
        SessionError::ForkFailed { .. }
            | SessionError::ForkTimedOut { .. }
            | SessionError::LaunchFailed { .. }
            | SessionError::LaunchTimedOut { .. }
            | SessionError::DiedBeforeReady { .. }
            | SessionError::ConnectFailed { .. }
    )
}

/// Fork a sandbox (E2B): `count` new sandboxes from its kernel
///
/// Body `{"timeout"?: seconds (default 15), "count"?: 1 to 8 (default 1)}`. The answer is
/// one entry per fork: `{"sandbox": <create's answer>}`, or `{"error": {"code",
/// "message"}}` when making the forks failed (then every entry has that error: forks are
/// made all or none). A count above 8 (E2B allows 20) is a 400; a sandbox that runs code
/// or cannot be forked here is a 409.
#[utoipa::path(post, operation_id = "e2b_fork", path = "/e2b/sandboxes/{id}/fork", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 201, description = "E2B's `[SandboxForkResult]`: `[{\"sandbox\": Sandbox} | {\"error\": {code, message}}]`, one per requested fork", body = serde_json::Value),
        (status = 409, description = "E2B error `{code, message}`: the sandbox runs code, or cannot be forked here (nothing was made)", body = serde_json::Value),
        ControlErrors))]
async fn fork(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> E2bResult<Response> {
    let parent = owned(&state, &e2b, &caller, &id)?;
    let bytes = read_limited(body, 64 << 10, "request body").await?;
    let req: ForkBody = parse_json(&bytes, "request body")?;
    let timeout = timeout_secs(&state, Some(req.timeout.unwrap_or(DEFAULT_FORK_TIMEOUT)))?;
    let count = req.count.unwrap_or(1);
    let Some((template, metadata, env)) = e2b.with(parent.id, |m| {
        (m.template.clone(), m.metadata.clone(), m.env.clone())
    }) else {
        // Ended between the lookup and here.
        return Err(E2bError::not_found(format!("sandbox {id:?} not found")));
    };
    let user = caller.0 .0.clone();
    let base = user.create_request(Default::default());
    let room = crate::api::cluster::quota::room(&state, &user).await?;
    let forked = state
        .registry
        .fork(ForkRequest {
            user: base.user,
            max_sessions: room.max_sessions(),
            session: parent.id,
            count,
            checkpoint: None,
            provenance: Provenance::new(FrontDoor::E2b)
                .with_metadata(metadata_of(Some(&metadata))?),
        })
        .await
        .map_err(|e| room.explain(e));
    drop(room);
    let forks = match forked {
        Ok(forks) => forks,
        Err(e) if failed_while_forking(&e) => {
            let e = E2bError::from(e);
            let entry = json!({"error": {"code": e.status.as_u16(), "message": e.message}});
            return Ok(answer(vec![entry; count as usize]));
        }
        Err(e @ SessionError::InvalidForkCount { .. }) => {
            return Err(E2bError::bad_request(format!(
                "{e} (kernel-broker makes at most {MAX_FORKS} forks a request, E2B 20: fork \
                 again for more)"
            )))
        }
        Err(e) => return Err(e.into()),
    };
    let deadline = Instant::now() + Duration::from_secs(timeout);
    let mut entries = Vec::with_capacity(forks.len());
    for fork in forks {
        fork.set_deadline(Some(deadline));
        e2b.insert(
            fork.id,
            SandboxMeta {
                template: template.clone(),
                metadata: metadata.clone(),
                env: env.clone(),
                started_at: fork.created_at,
                contexts: Vec::new(),
                context_cwds: Default::default(),
                default_contexts: Default::default(),
                commands: Default::default(),
            },
        );
        e2b.watch(state.registry.clone(), fork.clone());
        entries.push(json!({"sandbox": sandbox_json(&user.token, &fork, &template)}));
    }
    Ok(answer(entries))
}

/// E2B's fork answer: 201 and the entries.
fn answer(entries: Vec<Value>) -> Response {
    (StatusCode::CREATED, Json(Value::Array(entries))).into_response()
}
