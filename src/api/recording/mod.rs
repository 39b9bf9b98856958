//! The recording endpoints: a session's events (`GET`, `DELETE /v1/sessions/{id}/events`),
//! its notebook (`/notebook`), its replay (`POST /replay`), and the caller's recordings
//! (`GET /v1/recordings`). They read the recording store, not the registry, so they keep
//! answering after a session expired or was deleted. A recording of another user answers
//! exactly as a missing one (404 `session_not_found`).
//!
//! Layout: this file is a session's recording; [`list`] is the caller's recordings, filtered
//! and searched.

mod list;

use list::store;

use std::sync::Arc;

use axum::extract::{FromRequestParts, RawQuery, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde::Serialize;
use serde_json::value::RawValue;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::{url_query, Caller};
use super::error::{ApiError, ApiResult};
use super::extract::{path_id, session_id};
use super::shapes::{iso, ErrorBody, ErrorResponse, ExecutionStatusJson, SessionJson};
use super::AppState;
use crate::recording::{
    notebook, EventQuery, RecordedEvent, RecordedKind, RecordingError, RecordingInfo,
    RecordingStore,
};
use crate::replay;
use crate::session::Direction;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(events, delete_events))
        .routes(routes!(notebook_of))
        .routes(routes!(replay_of))
        .merge(list::routes())
}

impl From<RecordingError> for ApiError {
    fn from(e: RecordingError) -> Self {
        match e {
            RecordingError::NotFound(id) => not_found(id),
            RecordingError::Session(e) => e.into(),
            other => ApiError::internal("recording", other),
        }
    }
}

fn not_found(id: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "session_not_found",
        format!("no session {id}"),
    )
}

/// The caller's recording `{id}`, as an extractor: another user's, a missing one, or any
/// while recording is off answers 404.
struct OwnedRecording {
    caller: Caller,
    store: Arc<RecordingStore>,
    info: RecordingInfo,
}

impl FromRequestParts<AppState> for OwnedRecording {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        let caller = Caller::from_request_parts(parts, state).await?;
        let id = session_id(&path_id(parts, state).await?)?;
        let store = store(state)?.clone();
        let live = state.registry.get(&caller.0.name, id).is_ok();
        let mine =
            |info: &Option<RecordingInfo>| info.as_ref().is_some_and(|i| i.user == caller.0.name);
        let mut info = store.info(id).await?;
        if !mine(&info) && live {
            // Created a moment ago: its first rows may still be queued for the writer.
            store.flush().await;
            info = store.info(id).await?;
        }
        match info {
            Some(info) if info.user == caller.0.name => Ok(Self {
                caller,
                store,
                info,
            }),
            _ => Err(not_found(id)),
        }
    }
}

impl OwnedRecording {
    /// Waits until everything reported so far is written, so a read that wants all of it
    /// (an events page, a notebook, a replay) sees all of it. A session closed a moment ago
    /// counts too: its last events (`session_closed`, the `shutdown_request`) may still be
    /// queued for the writer when the delete has been answered.
    async fn settled(self) -> Self {
        self.store.flush().await;
        self
    }
}

fn list_param(query: &str, name: &str) -> Vec<String> {
    url_query(query, name)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

fn number_param<T: std::str::FromStr>(query: &str, name: &str) -> ApiResult<Option<T>> {
    match url_query(query, name) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| {
            ApiError::bad_request(format!("{name} must be a non-negative integer, not {v:?}"))
        }),
    }
}

/// One recorded event: a Jupyter message either way, or a broker event (`direction:
/// "broker"`: created, restarted, interrupted, expired, ...).
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[schema(as = Event)]
enum EventJson {
    Message {
        seq: i64,
        time: String,
        /// `to_kernel` or `from_kernel`.
        #[schema(value_type = String)]
        direction: &'static str,
        channel: String,
        msg_type: String,
        msg_id: String,
        #[schema(required = true)]
        parent_msg_id: Option<String>,
        #[schema(value_type = Object)]
        header: Box<RawValue>,
        #[schema(value_type = Object)]
        parent_header: Box<RawValue>,
        #[schema(value_type = Object)]
        metadata: Box<RawValue>,
        #[schema(value_type = Object)]
        content: Box<RawValue>,
        /// Binary buffers, base64; absent when there are none.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        buffers: Vec<String>,
    },
    Broker {
        seq: i64,
        time: String,
        /// Always `broker`.
        #[schema(value_type = String)]
        direction: &'static str,
        kind: String,
        #[schema(value_type = Object)]
        detail: Box<RawValue>,
    },
}

/// Stored JSON text as a raw JSON value (it is valid JSON; anything else becomes a string).
fn raw(text: String) -> Box<RawValue> {
    RawValue::from_string(text).unwrap_or_else(|e| {
        serde_json::value::to_raw_value(&format!("[unreadable: {e}]")).unwrap_or_default()
    })
}

impl From<RecordedEvent> for EventJson {
    fn from(e: RecordedEvent) -> Self {
        let time = iso(e.time);
        match e.kind {
            RecordedKind::Message {
                direction,
                channel,
                msg_type,
                msg_id,
                parent_msg_id,
                header,
                parent_header,
                metadata,
                content,
                buffers,
            } => EventJson::Message {
                seq: e.seq,
                time,
                direction: match direction {
                    Direction::ToKernel => "to_kernel",
                    Direction::FromKernel => "from_kernel",
                },
                channel,
                msg_type,
                msg_id,
                parent_msg_id,
                header: raw(header),
                parent_header: raw(parent_header),
                metadata: raw(metadata),
                content: raw(content),
                buffers: buffers
                    .iter()
                    .map(|b| base64::engine::general_purpose::STANDARD.encode(b))
                    .collect(),
            },
            RecordedKind::Broker { kind, detail } => EventJson::Broker {
                seq: e.seq,
                time,
                direction: "broker",
                kind,
                detail: raw(detail),
            },
        }
    }
}

/// A page of a recording.
#[derive(Serialize, ToSchema)]
#[schema(as = Events)]
struct EventsJson {
    events: Vec<EventJson>,
    /// Pass as `after` for the next page; `null` on the last one.
    #[schema(required = true)]
    next_after: Option<i64>,
}

const DEFAULT_LIMIT: usize = 1000;
const MAX_LIMIT: usize = 10_000;

/// The session's recording, paged
#[utoipa::path(get, operation_id = "get_events", path = "/v1/sessions/{id}/events", tag = "recordings",
    params(("id" = uuid::Uuid, Path),
        ("after" = Option<u64>, Query, description = "only events after this seq"),
        ("limit" = Option<usize>, Query, description = "page size, 1..10000 (default 1000)"),
        ("type" = Option<String>, Query, description = "comma-separated msg_types or broker kinds"),
        ("channel" = Option<String>, Query, description = "comma-separated channels")),
    responses((status = 200, description = "ok", body = EventsJson),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, description = "no such recording of the caller's, or recording is off", body = ErrorBody)))]
async fn events(
    recording: OwnedRecording,
    RawQuery(query): RawQuery,
) -> ApiResult<Json<EventsJson>> {
    // What the API has answered is in the page: an event reported before this read (a
    // fork's `session_forked`, an execution's output) may still be queued for the writer.
    let OwnedRecording { store, info, .. } = recording.settled().await;
    let query = query.unwrap_or_default();
    let q = EventQuery {
        after: number_param::<u64>(&query, "after")?
            .unwrap_or(0)
            .min(i64::MAX as u64) as i64,
        limit: number_param::<usize>(&query, "limit")?
            .unwrap_or(DEFAULT_LIMIT)
            .clamp(1, MAX_LIMIT),
        types: list_param(&query, "type"),
        channels: list_param(&query, "channel"),
    };
    let page = store.events(info.id, q).await?;
    let next_after = if page.more {
        page.events.last().map(|e| e.seq)
    } else {
        None
    };
    Ok(Json(EventsJson {
        events: page.events.into_iter().map(EventJson::from).collect(),
        next_after,
    }))
}

/// Delete the recording
#[utoipa::path(delete, operation_id = "delete_events", path = "/v1/sessions/{id}/events", tag = "recordings", params(("id" = uuid::Uuid, Path)),
    responses((status = 204, description = "deleted"), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse)))]
async fn delete_events(
    OwnedRecording { store, info, .. }: OwnedRecording,
) -> ApiResult<StatusCode> {
    store.delete(info.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The session as an nbformat 4 notebook
#[utoipa::path(get, operation_id = "get_notebook", path = "/v1/sessions/{id}/notebook", tag = "recordings", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", content_type = "application/x-ipynb+json", body = Object),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse)))]
async fn notebook_of(recording: OwnedRecording) -> ApiResult<Response> {
    let OwnedRecording { store, info, .. } = recording.settled().await;
    let events = store.all_events(info.id).await?;
    let filename = format!("session-{}.ipynb", info.id);
    let body = tokio::task::spawn_blocking(move || notebook::notebook(&info, &events).to_string())
        .await
        .map_err(|e| ApiError::internal("build a notebook", e))?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-ipynb+json".to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("inline; filename=\"{filename}\""),
            ),
        ],
        body,
    )
        .into_response())
}

/// One replayed cell, compared with its recording.
#[derive(Serialize, ToSchema)]
#[schema(as = ReplayCell)]
struct ReplayCellJson {
    index: usize,
    status: ExecutionStatusJson,
    #[schema(required = true)]
    recorded_status: Option<ExecutionStatusJson>,
    same_output: bool,
    diff: String,
    code: String,
}

/// The outcome of a replay: the new session and each cell compared.
#[derive(Serialize, ToSchema)]
#[schema(as = Replay)]
struct ReplayJson {
    session: SessionJson,
    /// The recorded session that was replayed.
    source: Uuid,
    cells: Vec<ReplayCellJson>,
    /// A session with a workspace of its own: the files its API wrote that could not be
    /// written again before the cells that followed (their content was not recorded:
    /// larger than 2 MiB, or past the recording's bounds). Empty otherwise.
    files_not_replayed: Vec<String>,
}

/// Replay the recorded code in a new session
#[utoipa::path(post, operation_id = "replay", path = "/v1/sessions/{id}/replay", tag = "recordings", params(("id" = uuid::Uuid, Path)),
    responses((status = 201, description = "ok; `Location` is the new session's URL", body = ReplayJson),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse),
        (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)))]
async fn replay_of(
    State(state): State<AppState>,
    recording: OwnedRecording,
) -> ApiResult<Response> {
    let OwnedRecording {
        caller,
        store,
        info,
        ..
    } = recording.settled().await;
    let room = crate::api::cluster::quota::room(&state, &caller.0).await?;
    let outcome = replay::replay(
        &store,
        &state.registry,
        &caller.0.sandbox_user(),
        room,
        info.id,
    )
    .await?;
    let location = format!("/v1/sessions/{}", outcome.session.id);
    let body = ReplayJson {
        session: outcome.session.info().into(),
        source: info.id,
        cells: outcome
            .cells
            .into_iter()
            .map(|c| ReplayCellJson {
                index: c.index,
                status: c.status.into(),
                recorded_status: c.recorded_status.map(Into::into),
                same_output: c.same_output,
                diff: c.diff,
                code: c.code,
            })
            .collect(),
        files_not_replayed: outcome.files_not_replayed,
    };
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(body),
    )
        .into_response())
}
