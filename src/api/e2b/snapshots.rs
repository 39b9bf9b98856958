//! E2B's snapshots (issue 37): `sbx.create_snapshot(name)`, `Sandbox.list_snapshots`,
//! `Sandbox.delete_snapshot` and `Sandbox.create(snapshot_id)` (`control.rs` takes a
//! `templateID` that names one of the caller's snapshots). A snapshot is the session's
//! (`session/registry/snapshot.rs`): the sandbox's kernel memory and a copy of its files;
//! the sandbox goes on running, as E2B's does. `snapshotID` is the snapshot's id; `names`
//! holds the name it was given, which `Sandbox.create(name)` also finds (the newest).

use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::ApiKeyUser;
use super::control::owned;
use super::documented::ControlErrors;
use super::{E2bError, E2bResult, E2bState};
use crate::api::extract::{parse_json, read_limited};
use crate::api::AppState;
use crate::session::snapshot::SnapshotInfo;
use crate::session::SessionError;

/// The most snapshots one page lists (E2B's default page).
const MAX_PAGE: usize = 100;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_snapshot))
        .routes(routes!(list_snapshots))
        .routes(routes!(delete_snapshot))
}

/// What `POST /sandboxes/{id}/snapshots` takes.
#[derive(serde::Deserialize, Default)]
struct SnapshotBody {
    name: Option<String>,
    /// `false`: E2B's filesystem-only snapshot, which is not built here.
    memory: Option<bool>,
}

/// E2B's `SnapshotInfo`.
fn snapshot_json(info: &SnapshotInfo) -> Value {
    json!({
        "snapshotID": info.snapshot_id.to_string(),
        "names": info.name.iter().collect::<Vec<_>>(),
    })
}

/// Snapshot a sandbox (E2B): its memory and files kept, the sandbox running on
#[utoipa::path(post, operation_id = "e2b_create_snapshot", path = "/e2b/sandboxes/{id}/snapshots", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 201, description = "E2B's `SnapshotInfo`", body = serde_json::Value),
        (status = 400, description = "a bad name, or a filesystem-only snapshot (not built)", body = serde_json::Value),
        (status = 409, description = "this sandbox cannot be snapshotted here (the message says why)", body = serde_json::Value),
        (status = 429, description = "the caller keeps as many snapshots as allowed", body = serde_json::Value),
        (status = 503, description = "it runs code now: retry once it ends", body = serde_json::Value),
        ControlErrors))]
async fn create_snapshot(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> E2bResult<Response> {
    let req: SnapshotBody = parse_json(
        &read_limited(body, 64 << 10, "request body").await?,
        "request body",
    )?;
    let session = owned(&state, &e2b, &caller, &id)?;
    if req.memory == Some(false) {
        return Err(E2bError::bad_request(
            "a filesystem-only snapshot is not built here: take a full one (memory and files)",
        ));
    }
    let user = &caller.0 .0.name;
    let info = state
        .registry
        .snapshot(user, session.id, req.name)
        .await
        .map_err(|e| match e {
            // It runs code now: ServiceBusyException, "please retry".
            SessionError::SnapshotBusy { .. } => {
                E2bError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            e => e.into(),
        })?;
    Ok((StatusCode::CREATED, Json(snapshot_json(&info))).into_response())
}

/// The caller's snapshots (E2B): of one sandbox or by name if asked, oldest first, paged
#[utoipa::path(get, operation_id = "e2b_list_snapshots", path = "/e2b/snapshots", tag = "e2b", security(()),
    params(
        ("sandboxID" = Option<String>, Query, description = "only the snapshots of this sandbox"),
        ("name" = Option<String>, Query, description = "only the snapshots of this name or id"),
        ("limit" = Option<usize>, Query, description = "at most this many (1..=100, default 100)"),
        ("nextToken" = Option<String>, Query, description = "from `x-next-token` of the page before")),
    responses((status = 200, description = "E2B's `SnapshotInfo`s; `x-next-token` when more follow", body = serde_json::Value), ControlErrors))]
async fn list_snapshots(
    State(state): State<AppState>,
    caller: ApiKeyUser,
    RawQuery(query): RawQuery,
) -> E2bResult<Response> {
    let (mut sandbox, mut name, mut limit, mut after) = (None, None, MAX_PAGE, None);
    for (key, value) in super::listing::pairs(query.as_deref().unwrap_or("")) {
        match key {
            "sandboxID" => {
                // Another user's sandbox, or none: nothing of the caller's matches.
                sandbox = Some(Uuid::parse_str(&value).unwrap_or(Uuid::nil()))
            }
            "name" => name = Some(value),
            "limit" => {
                limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=MAX_PAGE).contains(l))
                    .ok_or_else(|| {
                        E2bError::bad_request(format!("limit must be 1 to {MAX_PAGE}"))
                    })?
            }
            "nextToken" => {
                after = Some(
                    Uuid::parse_str(&value)
                        .map_err(|_| E2bError::bad_request("nextToken is not one of this API's"))?,
                )
            }
            _ => {}
        }
    }
    let user = &caller.0 .0.name;
    let mut all: Vec<SnapshotInfo> = state.registry.snapshots(user, sandbox);
    if let Some(name) = &name {
        all.retain(|s| s.name.as_deref() == Some(name) || s.snapshot_id.to_string() == *name);
    }
    let start = after
        .and_then(|a| all.iter().position(|s| s.snapshot_id == a))
        .map_or(0, |i| i + 1);
    let page: Vec<&SnapshotInfo> = all.iter().skip(start).take(limit).collect();
    let mut headers = HeaderMap::new();
    if start + page.len() < all.len() {
        if let Some(last) = page.last() {
            if let Ok(v) = HeaderValue::from_str(&last.snapshot_id.to_string()) {
                headers.insert("x-next-token", v);
            }
        }
    }
    let body: Vec<Value> = page.into_iter().map(snapshot_json).collect();
    Ok((headers, Json(body)).into_response())
}

/// Delete a snapshot (E2B's `delete_snapshot`: a snapshot is a template there)
#[utoipa::path(delete, operation_id = "e2b_delete_snapshot", path = "/e2b/templates/{id}", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 204, description = "deleted"), ControlErrors))]
async fn delete_snapshot(
    State(state): State<AppState>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let user = &caller.0 .0.name;
    let absent = || E2bError::not_found(format!("template {id:?} not found"));
    let info = state.registry.find_snapshot(user, &id).ok_or_else(absent)?;
    match state.registry.delete_snapshot(user, info.snapshot_id).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        Err(SessionError::SnapshotNotFound(_)) => Err(absent()),
        Err(e) => Err(e.into()),
    }
}
