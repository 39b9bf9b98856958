//! `GET /v1/recordings`: the caller's recorded sessions, newest first, filtered and searched
//! in the recording's database (never read whole into the broker), always of the caller
//! only. Every parameter is checked here, where it enters: a bad value answers 400 naming
//! the parameter; the search text goes on to the database only as a bound value.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::api::auth::{url_query, Caller};
use crate::api::error::{ApiError, ApiResult};
use crate::api::shapes::{iso, ErrorBody, ErrorResponse, SessionStateJson};
use crate::api::AppState;
use crate::recording::search::MAX_QUERY_CHARS;
use crate::recording::{ListQuery, ListedRecording, RecordingStore, StateFilter};

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list))
}

/// The recording store, or 404 `recording_disabled` when recording is off.
pub(super) fn store(state: &AppState) -> ApiResult<&Arc<RecordingStore>> {
    state.recording.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "recording_disabled",
            "this broker does not record sessions (it runs with --record false)",
        )
    })
}

const DEFAULT_LIMIT: usize = 200;
const MAX_LIMIT: usize = 10_000;
const FRONT_DOORS: [&str; 4] = ["rest", "jupyter", "e2b", "mcp"];

/// The session a fork was made from: its id, its execution count at the fork, and the
/// checkpoint of it the fork was made from (absent for a fork of the live kernel).
#[derive(Serialize, ToSchema)]
#[schema(as = RecordingForkedFrom)]
struct ForkedFromJson {
    session: Uuid,
    execution_count: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint: Option<Uuid>,
}

/// Where a search matched.
#[derive(Serialize, ToSchema)]
#[schema(as = RecordingMatch)]
struct MatchJson {
    /// The event that holds the text (`seq` in `/v1/sessions/{id}/events`).
    seq: i64,
    /// `code`, `output`, `error` or `metadata`.
    field: &'static str,
    /// About 160 characters around the match.
    snippet: String,
}

/// A recorded session, as `/v1/recordings` lists it.
#[derive(Serialize, ToSchema)]
#[schema(as = Recording)]
struct RecordingJson {
    id: Uuid,
    kernel: String,
    /// The live session's state, or `closed` / `expired` once it ended.
    state: SessionStateJson,
    live: bool,
    created_at: String,
    #[schema(required = true)]
    ended_at: Option<String>,
    #[schema(required = true)]
    end_reason: Option<String>,
    #[schema(required = true)]
    last_event_at: Option<String>,
    cells: u64,
    events: u64,
    /// `rest`, `jupyter`, `e2b` or `mcp`; null for a recording made before front doors
    /// were recorded.
    #[schema(required = true)]
    front_door: Option<String>,
    /// The session's metadata (E2B sandbox metadata, the MCP client, REST metadata).
    metadata: BTreeMap<String, String>,
    /// Executions that ended in an error, a timeout or with a dead kernel.
    errors: u64,
    /// Who or what ended it (`rest`, `jupyter`, `e2b`, `mcp`, `broker_shutdown`,
    /// `idle_expiry`, `broker_stopped`, `node_lost`, ...); null while live.
    #[schema(required = true)]
    ended_by: Option<String>,
    /// For a fork: the session it was made from and where; null for a session that is not
    /// a fork (or was recorded before forks were kept in the list).
    #[schema(required = true)]
    forked_from: Option<ForkedFromJson>,
    /// With `q` only: up to 3 places where the text matched.
    #[serde(skip_serializing_if = "Option::is_none")]
    matches: Option<Vec<MatchJson>>,
}

/// The parameters of the list, each checked (400 names the bad one).
fn parse(query: &str, user: &str) -> ApiResult<ListQuery> {
    let param = |name: &str| url_query(query, name).filter(|v| !v.is_empty());
    let bad = |name: &str, want: &str, got: &str| {
        let got: String = got.chars().take(40).collect();
        ApiError::bad_request(format!("{name} must be {want}, not {got:?}"))
    };
    let limit = match param("limit") {
        None => DEFAULT_LIMIT,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| bad("limit", "an integer from 1 to 10000", &v))?,
    };
    let q = match param("q") {
        Some(v) if v.chars().count() > MAX_QUERY_CHARS => {
            return Err(ApiError::bad_request(format!(
                "q must be 1 to {MAX_QUERY_CHARS} characters, not {}",
                v.chars().count()
            )))
        }
        other => other,
    };
    let state = match param("state").as_deref() {
        None => None,
        Some("live") => Some(StateFilter::Live),
        Some("ended") => Some(StateFilter::Ended),
        Some("closed") => Some(StateFilter::Closed),
        Some("expired") => Some(StateFilter::Expired),
        Some(v) => return Err(bad("state", "live, ended, closed or expired", v)),
    };
    let front_door = match param("front_door") {
        None => None,
        Some(v) if FRONT_DOORS.contains(&v.as_str()) => Some(v),
        Some(v) => return Err(bad("front_door", "rest, jupyter, e2b or mcp", &v)),
    };
    let has_errors = match param("has_errors").as_deref() {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(v) => return Err(bad("has_errors", "true or false", v)),
    };
    let instant = |name: &str| -> ApiResult<Option<DateTime<Utc>>> {
        match param(name) {
            None => Ok(None),
            Some(v) => DateTime::parse_from_rfc3339(&v)
                .map(|t| Some(t.with_timezone(&Utc)))
                .map_err(|_| bad(name, "an RFC 3339 instant (2026-01-31T12:00:00Z)", &v)),
        }
    };
    Ok(ListQuery {
        user: user.to_string(),
        limit,
        q,
        state,
        front_door,
        has_errors,
        since: instant("since")?,
        until: instant("until")?,
    })
}

/// The caller's recorded sessions
#[utoipa::path(get, operation_id = "list_recordings", path = "/v1/recordings", tag = "recordings",
    params(
        ("q" = Option<String>, Query, description = "case-insensitive text (1..=200 characters) in the executed code, the output, error names and values, metadata values; adds `matches`"),
        ("state" = Option<String>, Query, description = "`live` (its recording is open), `ended`, `closed` (ended other than by idle expiry) or `expired`"),
        ("front_door" = Option<String>, Query, description = "`rest`, `jupyter`, `e2b` or `mcp`"),
        ("has_errors" = Option<bool>, Query, description = "`true`: some execution ended in an error, timeout or dead kernel; `false`: none did"),
        ("since" = Option<String>, Query, description = "RFC 3339: created at or after"),
        ("until" = Option<String>, Query, description = "RFC 3339: created before"),
        ("limit" = Option<usize>, Query, description = "at most this many, newest first, 1..=10000 (default 200)")),
    responses((status = 200, description = "ok", body = Vec<RecordingJson>),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, description = "recording is off", body = ErrorBody)))]
async fn list(
    State(state): State<AppState>,
    caller: Caller,
    RawQuery(query): RawQuery,
) -> ApiResult<Json<Vec<RecordingJson>>> {
    let query = parse(&query.unwrap_or_default(), &caller.0.name)?;
    let searched = query.q.is_some();
    let store = store(&state)?.clone();
    // Sessions created a moment ago may still be queued for the writer.
    store.flush().await;
    let rows = store.find(query).await?;
    Ok(Json(
        rows.into_iter()
            .map(|r: ListedRecording| {
                let info = r.info;
                let session = state.registry.get(&caller.0.name, info.id).ok();
                let state = match (&session, info.end_reason.as_deref()) {
                    (Some(s), _) => s.state().into(),
                    (None, Some("expired")) => SessionStateJson::Expired,
                    (None, _) => SessionStateJson::Closed,
                };
                RecordingJson {
                    id: info.id,
                    kernel: info.kernel,
                    state,
                    live: session.is_some(),
                    created_at: iso(info.created_at),
                    ended_at: info.ended_at.map(iso),
                    end_reason: info.end_reason,
                    last_event_at: info.last_event_at.map(iso),
                    cells: info.cells,
                    events: info.events,
                    front_door: r.front_door,
                    metadata: r.metadata,
                    errors: r.errors,
                    ended_by: r.ended_by,
                    forked_from: r.forked_from.map(|f| ForkedFromJson {
                        session: f.session,
                        execution_count: f.execution_count,
                        checkpoint: f.checkpoint,
                    }),
                    matches: searched.then(|| {
                        r.matches
                            .into_iter()
                            .map(|m| MatchJson {
                                seq: m.seq,
                                field: m.field.as_str(),
                                snippet: m.snippet,
                            })
                            .collect()
                    }),
                }
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_is_checked() {
        let ok = parse(
            "q=a%25_%22&state=live&front_door=e2b&has_errors=false&since=2026-01-01T00:00:00Z&until=2026-02-01T00:00:00%2B01:00&limit=5",
            "alice",
        )
        .unwrap();
        assert_eq!(ok.q.as_deref(), Some("a%_\""));
        assert_eq!(ok.state, Some(StateFilter::Live));
        assert_eq!(ok.front_door.as_deref(), Some("e2b"));
        assert_eq!(ok.has_errors, Some(false));
        assert_eq!(ok.limit, 5);
        assert_eq!(ok.user, "alice");
        assert_eq!(
            ok.until.map(|t| t.to_rfc3339()),
            Some("2026-01-31T23:00:00+00:00".into())
        );
        let d = parse("", "bob").unwrap();
        assert_eq!((d.limit, d.q, d.state), (DEFAULT_LIMIT, None, None));
        let long = format!("q={}", "x".repeat(201));
        let bad = [
            ("limit=0", "limit"),
            ("limit=10001", "limit"),
            ("limit=-1", "limit"),
            ("limit=abc", "limit"),
            ("state=open", "state"),
            ("front_door=ws", "front_door"),
            ("has_errors=yes", "has_errors"),
            ("since=yesterday", "since"),
            ("until=2026-01-01", "until"),
            (long.as_str(), "q"),
        ];
        for (query, name) in bad {
            let e = parse(query, "alice").err().unwrap();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{query}");
            assert!(e.message.starts_with(name), "{query}: {}", e.message);
        }
        // 200 characters, multi-byte, are fine.
        assert!(parse(&format!("q={}", "é".repeat(200)), "alice").is_ok());
    }
}
