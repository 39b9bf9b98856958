//! Operations: `/healthz` (no token), `/metrics` (Prometheus, see `metrics.rs`),
//! `/openapi.json` (generated from the handlers, see `openapi.rs`).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Caller;
use super::metrics::{RecordingSnapshot, Snapshot, CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE};
use super::shapes::{ErrorResponse, SessionStateJson};
use super::AppState;
use crate::session::SessionState;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(metrics))
        .routes(routes!(openapi))
}

/// What `/healthz` answers. Fields in alphabetical order: the body was a `json!` map
/// before, and clients may compare it as text.
#[derive(Serialize, ToSchema)]
#[schema(as = Health)]
struct HealthJson {
    pooled_kernels: usize,
    /// The sandbox backend (`local` or `docker`).
    sandbox: String,
    sessions: usize,
    /// `ok`; in cluster mode `draining` (this node takes no new sessions; 503) or
    /// `isolated` (it cannot reach the cluster's database and serves no session; 503).
    status: &'static str,
}

/// Liveness (no token)
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses((status = 200, description = "ok", body = HealthJson),
        (status = 503, description = "cluster mode: draining (no new sessions here) or isolated (cannot reach the cluster's database)", body = HealthJson)))]
async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    let sessions = state.registry.all().len();
    let status = match &state.cluster {
        Some(c) if c.is_isolated() => "isolated",
        Some(c) if c.is_draining() => "draining",
        _ => "ok",
    };
    (
        if status == "ok" {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        Json(HealthJson {
            pooled_kernels: state.registry.pooled(),
            sandbox: state.registry.sandbox().name().to_string(),
            sessions,
            status,
        }),
    )
}

/// Prometheus metrics
///
/// Prometheus text (OpenMetrics text when the scraper's `Accept` asks for it; the body is
/// the same and both parsers read it): sessions by state, WebSocket connections, the warm pool,
/// memory reserved and used (all users together; per session for the caller's own), the
/// recording writer, uptime; histograms of execution duration, queue wait and kernel start, and
/// counters of executions by status, timeouts, restarts, deaths and expiries, each with a
/// `backend` label.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format (or OpenMetrics, by Accept)", content_type = "text/plain", body = String),
        (status = 401, response = ErrorResponse)))]
async fn metrics(
    State(state): State<AppState>,
    caller: Caller,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let sessions = state.registry.all();
    let count = |st: SessionState| sessions.iter().filter(|s| s.state() == st).count() as u64;
    let infos: Vec<_> = sessions.iter().map(|s| s.info()).collect();
    let memory = state.registry.memory_use_all();
    let snapshot = Snapshot {
        sessions: [
            SessionState::Starting,
            SessionState::Idle,
            SessionState::Busy,
            SessionState::Paused,
            SessionState::Dead,
        ]
        .into_iter()
        .map(|st| (SessionStateJson::from(st).as_str(), count(st)))
        .collect(),
        connections: infos.iter().map(|i| i.connections as u64).sum(),
        pooled_kernels: state.registry.pooled() as u64,
        memory_reserved_sessions: memory.session_bytes,
        memory_reserved_pool: memory.pooled_bytes,
        memory_used: infos.iter().filter_map(|i| i.memory_used_bytes).sum(),
        own_sessions: infos
            .iter()
            .filter(|i| i.user == caller.0.name)
            .map(|i| (i.id.to_string(), i.memory_limit_bytes, i.memory_used_bytes))
            .collect(),
        recording: state.recording.as_ref().map(|r| {
            let s = r.stats();
            RecordingSnapshot {
                queued_bytes: s.queued_bytes as u64,
                dropped: s.dropped,
                truncated: s.truncated,
                errors: s.errors,
                events: s.events,
            }
        }),
        uptime: state.started.elapsed(),
        egress: state.egress.as_ref().map(|e| e.usage()).unwrap_or_default(),
        caller: caller.0.name.clone(),
    };
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let content_type = if openmetrics {
        CONTENT_TYPE
    } else {
        PROMETHEUS_CONTENT_TYPE
    };
    (
        [(header::CONTENT_TYPE, content_type)],
        state.metrics.render(&snapshot),
    )
}

/// This API as OpenAPI 3.1
#[utoipa::path(get, path = "/openapi.json", tag = "operations", security(()),
    responses((status = 200, description = "the document (docs/openapi.json)", body = Object)))]
async fn openapi(Extension(doc): Extension<OpenApiJson>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], doc.0)
}

/// The document `/openapi.json` serves, handed in by `api::router` (the document lists this
/// file's routes, so this file does not build it: no import circle).
#[derive(Clone, Copy)]
pub struct OpenApiJson(pub &'static str);
