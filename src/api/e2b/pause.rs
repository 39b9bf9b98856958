//! Pausing and resuming a sandbox (E2B's `pause`, `connect`, the deprecated `resume`;
//! issue 37). A sandbox is a session with a workspace of its own (`control.rs`); its
//! pause is the session's (`session/actor/pause.rs`): the kernel's memory to disk, its
//! memory given back. As on E2B, a paused sandbox's timeout stops (its deadline is
//! cleared; the idle backstop stays) and `/health` answers that it is not running
//! (`is_running()` is false); `connect` resumes it with a new timeout. Its code contexts
//! are paused with it and resume on their first use.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::ApiKeyUser;
use super::control::{extend, owned, sandbox_json, timeout_secs, DEFAULT_TIMEOUT};
use super::documented::{v2, ControlErrors};
use super::{E2bError, E2bResult, E2bState};
use crate::api::extract::{parse_json, read_limited};
use crate::api::AppState;
use crate::session::{Session, SessionError, SessionState};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(pause))
        .routes(routes!(resume))
        .routes(routes!(connect))
        .routes(v2(routes!(connect)))
}

/// Pause a sandbox (E2B): its memory and files kept, its processes ended
#[utoipa::path(post, operation_id = "e2b_pause", path = "/e2b/sandboxes/{id}/pause", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 204, description = "paused"),
        (status = 409, description = "already paused", body = serde_json::Value),
        (status = 501, description = "this sandbox cannot be paused here (the message says why)", body = serde_json::Value),
        (status = 503, description = "it runs code now: retry once it ends", body = serde_json::Value),
        ControlErrors))]
async fn pause(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let session = owned(&state, &e2b, &caller, &id)?;
    if session.state() == SessionState::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id:?} is already paused"),
        ));
    }
    let user = caller.0 .0.name.clone();
    // E2B's SDK reads 409 as "already paused": a refusal gets another status.
    state
        .registry
        .pause(&user, session.id)
        .await
        .map_err(|e| match e {
            // It runs code now: ServiceBusyException, "please retry".
            SessionError::PauseBusy { .. } => {
                E2bError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            SessionError::PauseRefused { .. } => {
                E2bError::new(StatusCode::NOT_IMPLEMENTED, e.to_string())
            }
            e => e.into(),
        })?;
    // Paused, its timeout stops: the idle backstop (`control::session_options`) stays.
    session.set_deadline(None);
    let contexts = e2b
        .with(session.id, |m| m.contexts.clone())
        .unwrap_or_default();
    for ctx in contexts {
        let Ok(c) = state.registry.get(&user, ctx) else {
            continue;
        };
        // A context that cannot be paused now (running code) stays as it is.
        if let Err(e) = state.registry.pause(&user, ctx).await {
            tracing::info!(sandbox = %session.id, context = %ctx, error = %e, "a context of a paused sandbox was not paused");
        }
        c.set_deadline(None);
    }
    Ok(StatusCode::NO_CONTENT)
}

/// What `resume` and `connect` take (other fields ignored: E2B's `autoPause`, `memory`).
#[derive(serde::Deserialize, Default)]
struct ResumeBody {
    timeout: Option<u64>,
}

/// Resumes `session` if it is paused (its contexts resume on their first use) with a
/// timeout of `timeout` seconds (E2B's default if none); whether it was paused.
pub(super) async fn resume_if_paused(
    state: &AppState,
    e2b: &E2bState,
    session: &Session,
    timeout: Option<u64>,
) -> E2bResult<bool> {
    if session.state() != SessionState::Paused {
        return Ok(false);
    }
    state
        .registry
        .resume(&session.user.name, session.id)
        .await?;
    extend(state, e2b, session, timeout.unwrap_or(DEFAULT_TIMEOUT))?;
    Ok(true)
}

/// Resume a paused sandbox (E2B, deprecated: `connect` resumes too)
#[utoipa::path(post, operation_id = "e2b_resume", path = "/e2b/sandboxes/{id}/resume", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 201, description = "E2B's `Sandbox`, resumed", body = serde_json::Value),
        (status = 409, description = "it is running, not paused", body = serde_json::Value),
        ControlErrors))]
async fn resume(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> E2bResult<Response> {
    let session = owned(&state, &e2b, &caller, &id)?;
    let req: ResumeBody = parse_json(
        &read_limited(body, 64 << 10, "request body").await?,
        "request body",
    )?;
    if !resume_if_paused(&state, &e2b, &session, req.timeout).await? {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id:?} is running, not paused"),
        ));
    }
    Ok(answer(StatusCode::CREATED, &e2b, &caller, &session))
}

/// Connect to a sandbox (E2B): a paused one is resumed
#[utoipa::path(post, operation_id = "e2b_connect", path = "/e2b/sandboxes/{id}/connect", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 200, description = "E2B's `Sandbox`, running", body = serde_json::Value),
        (status = 201, description = "E2B's `Sandbox`, resumed from paused", body = serde_json::Value), ControlErrors))]
async fn connect(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> E2bResult<Response> {
    let session = owned(&state, &e2b, &caller, &id)?;
    let req: ResumeBody = parse_json(
        &read_limited(body, 64 << 10, "request body").await?,
        "request body",
    )?;
    // A paused sandbox is resumed (201, as E2B answers a resume).
    if resume_if_paused(&state, &e2b, &session, req.timeout).await? {
        return Ok(answer(StatusCode::CREATED, &e2b, &caller, &session));
    }
    if let Some(t) = req.timeout {
        // E2B's connect keeps a sandbox alive *for* `timeout`: it moves a deadline that
        // comes sooner, never one that comes later (set_timeout is the call that shortens).
        let secs = timeout_secs(&state, Some(t))?;
        let wanted = chrono::Utc::now() + chrono::Duration::seconds(secs as i64);
        if session.deadline().is_none_or(|d| d < wanted) {
            extend(&state, &e2b, &session, secs)?;
        } else {
            session.touch();
        }
    }
    Ok(answer(StatusCode::OK, &e2b, &caller, &session))
}

/// The create answer (E2B's `Sandbox`, tokens included) for `session`, with `status`.
fn answer(status: StatusCode, e2b: &E2bState, caller: &ApiKeyUser, session: &Session) -> Response {
    let template = e2b
        .with(session.id, |m| m.template.clone())
        .unwrap_or_default();
    (
        status,
        Json(sandbox_json(&caller.0 .0.token, session, &template)),
    )
        .into_response()
}
