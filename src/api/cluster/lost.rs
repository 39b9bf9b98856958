//! The answers about a session of a lost node: it is dead (its kernel went with the node),
//! its recording stays readable.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

use crate::api::error::ApiError;
use crate::api::shapes::{iso, SessionJson, SessionStateJson};
use crate::api::AppState;

/// The reason a session of a lost node is dead.
pub const NODE_LOST: &str =
    "node lost: the node that held this session stopped renewing its lease; its kernel is gone with it (the recording stays readable)";

/// A session of the caller's that no live node holds, whose node was lost, as its recording
/// tells: see [`lost_answer`].
pub(super) async fn lost_session(
    state: &AppState,
    user: &str,
    id: Uuid,
    get_whole: bool,
) -> Option<Response> {
    let info = state.recording.as_ref()?.info(id).await.ok()??;
    if info.user != user || info.end_reason.as_deref() != Some("node_lost") {
        return None;
    }
    let at = info.last_event_at.unwrap_or(info.created_at);
    Some(lost_answer(
        id,
        &info.user,
        info.kernel,
        info.created_at,
        at,
        info.cells,
        get_whole,
    ))
}

/// The answer about a session of a lost node: `GET` shows it `dead` with the reason;
/// anything else it is asked is answered `410 node_lost`.
pub(super) fn lost_answer(
    id: Uuid,
    user: &str,
    kernel: String,
    created_at: chrono::DateTime<chrono::Utc>,
    last_activity: chrono::DateTime<chrono::Utc>,
    cells: u64,
    get_whole: bool,
) -> Response {
    if get_whole {
        let json = SessionJson {
            id,
            user: user.to_string(),
            kernel,
            state: SessionStateJson::Dead,
            created_at: iso(created_at),
            last_activity: iso(last_activity),
            expires_at: None,
            execution_count: cells,
            connections: 0,
            memory_limit_bytes: 0,
            memory_used_bytes: None,
            dead_reason: Some(NODE_LOST.into()),
            front_door: None,
            metadata: Default::default(),
            secrets: Vec::new(),
        };
        return axum::Json(json).into_response();
    }
    ApiError::new(
        StatusCode::GONE,
        "node_lost",
        format!("session {id}: {NODE_LOST}"),
    )
    .into_response()
}

/// A time of the session directory (microseconds since the epoch).
pub(super) fn micros(t: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_micros(t).unwrap_or_default()
}
