//! Operations: `/healthz` (no token), `/metrics` (Prometheus text), `/openapi.json`.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use super::auth::Caller;
use super::AppState;
use crate::session::SessionState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    let sessions = state.registry.all().len();
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({
            "status": "ok",
            "sandbox": state.registry.sandbox().name(),
            "sessions": sessions,
            "pooled_kernels": state.registry.pooled(),
        })),
    )
}

async fn metrics(State(state): State<AppState>, _caller: Caller) -> impl IntoResponse {
    let sessions = state.registry.all();
    let count = |st: SessionState| sessions.iter().filter(|s| s.state() == st).count();
    let mut out = String::new();
    out.push_str("# HELP kernel_broker_sessions Live sessions by state.\n# TYPE kernel_broker_sessions gauge\n");
    for st in [
        SessionState::Starting,
        SessionState::Idle,
        SessionState::Busy,
        SessionState::Dead,
    ] {
        out.push_str(&format!(
            "kernel_broker_sessions{{state=\"{}\"}} {}\n",
            st.as_str(),
            count(st)
        ));
    }
    let conns: usize = sessions.iter().map(|s| s.info().connections).sum();
    out.push_str("# HELP kernel_broker_connections WebSocket clients attached.\n# TYPE kernel_broker_connections gauge\n");
    out.push_str(&format!("kernel_broker_connections {conns}\n"));
    out.push_str("# HELP kernel_broker_pooled_kernels Ready kernels in the warm pool.\n# TYPE kernel_broker_pooled_kernels gauge\n");
    out.push_str(&format!(
        "kernel_broker_pooled_kernels {}\n",
        state.registry.pooled()
    ));
    if let Some(r) = &state.recording {
        let s = r.stats();
        for (name, help, kind, v) in [
            (
                "recording_queued_bytes",
                "Bytes waiting for the recording writer.",
                "gauge",
                s.queued_bytes as u64,
            ),
            (
                "recording_dropped_total",
                "Reports dropped because the writer was behind.",
                "counter",
                s.dropped,
            ),
            (
                "recording_truncated_total",
                "Stream messages not kept past the per-execution cap.",
                "counter",
                s.truncated,
            ),
            (
                "recording_errors_total",
                "Events that could not be stored.",
                "counter",
                s.errors,
            ),
            (
                "recording_events_total",
                "Events stored.",
                "counter",
                s.events,
            ),
        ] {
            out.push_str(&format!(
                "# HELP kernel_broker_{name} {help}\n# TYPE kernel_broker_{name} {kind}\nkernel_broker_{name} {v}\n"
            ));
        }
    }
    out.push_str("# HELP kernel_broker_uptime_seconds Seconds since start.\n# TYPE kernel_broker_uptime_seconds counter\n");
    out.push_str(&format!(
        "kernel_broker_uptime_seconds {:.3}\n",
        state.started.elapsed().as_secs_f64()
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

async fn openapi() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        include_str!("../../docs/openapi.json"),
    )
}
