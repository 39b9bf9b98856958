//! E2B's sandbox metrics (`GET /e2b/sandboxes/{id}/metrics?start=&end=`, what the SDKs'
//! `get_metrics` / `getMetrics` call, on the instance and as `Sandbox.get_metrics(id)`):
//! E2B's `SandboxMetric` list, measured from the sandbox's kernels (its own and its
//! contexts') as their cgroups count them.
//!
//! Computed on request, not sampled: the answer is one sample, taken now, when now lies in
//! `[start, end]` (else none: the broker keeps no history). E2B's values come from envd in
//! the VM (gopsutil); here: `cpuCount` the user's CPU limit (cores, rounded up),
//! `cpuUsedPct` the kernels' CPU time over [`CPU_WINDOW`] measured during the request, in
//! percent of `cpuCount` cores, rounded to 2 decimals as envd rounds it; `memUsed` the
//! kernels' memory as their cgroup leaves count it, `memTotal` their memory limits;
//! `memCache` 0 (not told apart); `diskUsed`/`diskTotal` the workspace's file system (its own
//! of the user's workspace quota when there is one), as envd's `statfs` of `/`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::{Extension, Json};
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{json, Value};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::ApiKeyUser;
use super::documented::ControlErrors;
use super::{E2bError, E2bResult, E2bState};
use crate::api::AppState;
use crate::session::Session;

/// How long a request measures the kernels' CPU use over.
pub const CPU_WINDOW: Duration = Duration::from_millis(200);

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(metrics))
}

/// A sandbox's metrics (E2B)
#[utoipa::path(get, operation_id = "e2b_metrics", path = "/e2b/sandboxes/{id}/metrics", tag = "e2b", security(()),
    params(("id" = String, Path), ("start" = Option<i64>, Query, description = "unix seconds; default the sandbox's start"),
        ("end" = Option<i64>, Query, description = "unix seconds; default now")),
    responses((status = 200, description = "E2B's `SandboxMetric` list: `[{timestamp, timestampUnix, cpuCount, cpuUsedPct, memUsed, memTotal, memCache, diskUsed, diskTotal}]`, one sample taken now when now is in the interval", body = serde_json::Value), ControlErrors))]
async fn metrics(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> E2bResult<Json<Value>> {
    // Another user's sandbox, or a session the E2B API did not make, is absent.
    let absent = || E2bError::not_found(format!("sandbox {id:?} not found"));
    let uuid = Uuid::parse_str(&id).map_err(|_| absent())?;
    let session = state
        .registry
        .get(&caller.0 .0.name, uuid)
        .map_err(|_| absent())?;
    let (started, contexts) = e2b
        .with(uuid, |m| (m.started_at, m.contexts.clone()))
        .ok_or_else(absent)?;
    let (start, end) = interval(query.as_deref().unwrap_or(""))?;
    let now = Utc::now();
    let start = start.unwrap_or(started.timestamp());
    let end = end.unwrap_or(now.timestamp());
    if start > end {
        return Err(E2bError::bad_request(format!(
            "invalid time range for metrics: start {start} is after end {end}"
        )));
    }
    if !(start..=end).contains(&now.timestamp()) {
        return Ok(Json(json!([])));
    }
    let mut kernels = vec![session.clone()];
    kernels.extend(
        contexts
            .iter()
            .filter_map(|c| state.registry.get(&caller.0 .0.name, *c).ok()),
    );
    let sample = sample(&state, &session, &kernels, now).await?;
    Ok(Json(json!([sample])))
}

/// `start` and `end` from the query (unix seconds; other parameters are ignored).
fn interval(query: &str) -> E2bResult<(Option<i64>, Option<i64>)> {
    let (mut start, mut end) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match name {
            "start" => &mut start,
            "end" => &mut end,
            _ => continue,
        };
        let secs: i64 = value.parse().map_err(|_| {
            E2bError::bad_request(format!(
                "{name} must be a unix time in seconds; got {:?}",
                value.chars().take(40).collect::<String>()
            ))
        })?;
        *slot = Some(secs);
    }
    Ok((start, end))
}

/// One `SandboxMetric` of `kernels` (the sandbox's and its contexts'), taken at `now`.
async fn sample(
    state: &AppState,
    sandbox: &Arc<Session>,
    kernels: &[Arc<Session>],
    now: DateTime<Utc>,
) -> E2bResult<Value> {
    let limits = &sandbox.user.limits;
    let cpu_count = if limits.cpus.is_finite() && limits.cpus >= 1.0 {
        limits.cpus.ceil().min(1024.0) as u64
    } else {
        1
    };
    let cpu = |ks: &[Arc<Session>]| -> u64 {
        ks.iter()
            .filter_map(|k| k.cpu_time_ns())
            .fold(0, u64::saturating_add)
    };
    let before = (cpu(kernels), tokio::time::Instant::now());
    tokio::time::sleep(CPU_WINDOW).await;
    let used = cpu(kernels).saturating_sub(before.0);
    let elapsed = before.1.elapsed().as_nanos().max(1) as f64;
    let pct = used as f64 / (elapsed * cpu_count as f64) * 100.0;
    let pct = (pct.clamp(0.0, 100.0) * 100.0).round() / 100.0;
    let mem_used = kernels
        .iter()
        .filter_map(|k| k.memory_used())
        .fold(0u64, u64::saturating_add);
    let mem_total = kernels
        .iter()
        .map(|k| k.limits.memory_bytes)
        .fold(0u64, u64::saturating_add);
    let disk = state.registry.workspace(sandbox)?.disk_usage().await?;
    Ok(json!({
        "timestamp": now.to_rfc3339_opts(SecondsFormat::Secs, true),
        "timestampUnix": now.timestamp(),
        "cpuCount": cpu_count,
        "cpuUsedPct": pct,
        "memUsed": mem_used,
        "memTotal": mem_total,
        "memCache": 0,
        "diskUsed": disk.used,
        "diskTotal": disk.total,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_read_from_the_query() {
        assert_eq!(interval("").unwrap(), (None, None));
        assert_eq!(interval("start=5&end=9").unwrap(), (Some(5), Some(9)));
        assert_eq!(interval("end=-1&other=x").unwrap(), (None, Some(-1)));
        for bad in [
            "start=",
            "start=1.5",
            "end=99999999999999999999",
            "start=%31",
        ] {
            let e = interval(bad).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
        // A long hostile value is quoted only in part.
        let e = interval(&format!("start={}", "9".repeat(10_000))).unwrap_err();
        assert!(e.message.len() < 200, "{}", e.message);
    }
}
