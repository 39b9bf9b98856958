//! E2B's sandbox metrics (`GET /e2b/sandboxes/{id}/metrics?start=&end=`, what the SDKs'
//! `get_metrics` / `getMetrics` call, on the instance and as `Sandbox.get_metrics(id)`):
//! E2B's `SandboxMetric` list, measured from the sandbox's kernels (its own and its
//! contexts') as their cgroups count them.
//!
//! A series, as E2B's: the first request for a sandbox starts a sampler that measures it
//! every [`INTERVAL`] until the sandbox (or the broker) ends, keeping the last [`KEPT`]
//! samples (an hour); every answer is the kept samples in `[start, end]` and one taken
//! during the request, when now lies in the interval. E2B samples from the sandbox's start;
//! here the series starts at the first request. E2B's values come from envd in the VM
//! (gopsutil); here: `cpuCount` the user's CPU limit (cores, rounded up), `cpuUsedPct` the
//! kernels' CPU time since the sample before (a request's own over [`CPU_WINDOW`]), in
//! percent of `cpuCount` cores, rounded to 2 decimals as envd rounds it; `memUsed` the
//! kernels' memory as their cgroup leaves count it, `memTotal` their memory limits;
//! `memCache` 0 (not told apart); `diskUsed`/`diskTotal` the workspace's file system (its own
//! of the user's workspace quota when there is one), as envd's `statfs` of `/`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
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
use crate::session::{Registry, Session};
use crate::sync::lock;

/// How long a request measures the kernels' CPU use over.
pub const CPU_WINDOW: Duration = Duration::from_millis(200);
/// How often a sandbox's sampler measures it (E2B's API shows about one sample each 5 s).
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Samples kept per sandbox (an hour of them); the oldest go first.
pub const KEPT: usize = 720;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(metrics))
        .layer(Extension(Arc::new(History::default())))
}

/// The samples of the sandboxes whose metrics were asked for, while they run.
#[derive(Default)]
struct History {
    sandboxes: Mutex<HashMap<Uuid, VecDeque<Sample>>>,
}

/// One measurement: when, and the `SandboxMetric` it answers as.
#[derive(Clone)]
struct Sample {
    unix: i64,
    metric: Value,
}

impl History {
    /// The kept samples of `id` in `[start, end]`; starts its sampler if none runs.
    fn samples(
        self: &Arc<Self>,
        state: &AppState,
        e2b: &Arc<E2bState>,
        session: &Arc<Session>,
        (start, end): (i64, i64),
    ) -> Vec<Value> {
        let mut sandboxes = lock(&self.sandboxes);
        match sandboxes.get(&session.id) {
            Some(kept) => kept
                .iter()
                .filter(|s| (start..=end).contains(&s.unix))
                .map(|s| s.metric.clone())
                .collect(),
            None => {
                sandboxes.insert(session.id, VecDeque::new());
                tokio::spawn(self.clone().sample_every_interval(
                    state.clone(),
                    e2b.clone(),
                    session.clone(),
                ));
                Vec::new()
            }
        }
    }

    /// Measures `sandbox` every [`INTERVAL`] until it or the broker ends, then forgets it.
    async fn sample_every_interval(
        self: Arc<Self>,
        state: AppState,
        e2b: Arc<E2bState>,
        sandbox: Arc<Session>,
    ) {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + INTERVAL, INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut before: Option<(u64, tokio::time::Instant)> = None;
        loop {
            tokio::select! {
                _ = sandbox.ended() => break,
                _ = state.stopping.cancelled() => break,
                _ = ticks.tick() => {}
            }
            let Some(kernels) = kernels_of(&state.registry, &e2b, &sandbox) else {
                break;
            };
            let now = (cpu_time(&kernels), tokio::time::Instant::now());
            let used = before.map(|(cpu, at)| (now.0.saturating_sub(cpu), now.1 - at));
            before = Some(now);
            let Ok(metric) = measure(&state, &sandbox, &kernels, used, Utc::now()).await else {
                continue;
            };
            let sample = Sample {
                unix: Utc::now().timestamp(),
                metric,
            };
            let mut sandboxes = lock(&self.sandboxes);
            let Some(kept) = sandboxes.get_mut(&sandbox.id) else {
                return;
            };
            if kept.len() == KEPT {
                kept.pop_front();
            }
            kept.push_back(sample);
        }
        lock(&self.sandboxes).remove(&sandbox.id);
    }
}

/// The sandbox's kernels (its own and its contexts'); `None` once it is not an E2B sandbox
/// any more (killed).
fn kernels_of(
    registry: &Registry,
    e2b: &E2bState,
    sandbox: &Arc<Session>,
) -> Option<Vec<Arc<Session>>> {
    let contexts = e2b.with(sandbox.id, |m| m.contexts.clone())?;
    let mut kernels = vec![sandbox.clone()];
    kernels.extend(
        contexts
            .iter()
            .filter_map(|c| registry.get(&sandbox.user.name, *c).ok()),
    );
    Some(kernels)
}

/// CPU time of `kernels` together, in nanoseconds.
fn cpu_time(kernels: &[Arc<Session>]) -> u64 {
    kernels
        .iter()
        .filter_map(|k| k.cpu_time_ns())
        .fold(0, u64::saturating_add)
}

/// A sandbox's metrics (E2B)
#[utoipa::path(get, operation_id = "e2b_metrics", path = "/e2b/sandboxes/{id}/metrics", tag = "e2b", security(()),
    params(("id" = String, Path), ("start" = Option<i64>, Query, description = "unix seconds; default the sandbox's start"),
        ("end" = Option<i64>, Query, description = "unix seconds; default now")),
    responses((status = 200, description = "E2B's `SandboxMetric` list: `[{timestamp, timestampUnix, cpuCount, cpuUsedPct, memUsed, memTotal, memCache, diskUsed, diskTotal}]`, the samples kept since the first request (every 5 s) in the interval, then one taken now", body = serde_json::Value), ControlErrors))]
async fn metrics(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    Extension(history): Extension<Arc<History>>,
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
    let started = e2b.with(uuid, |m| m.started_at).ok_or_else(absent)?;
    let (start, end) = interval(query.as_deref().unwrap_or(""))?;
    let now = Utc::now();
    let start = start.unwrap_or(started.timestamp());
    let end = end.unwrap_or(now.timestamp());
    if start > end {
        return Err(E2bError::bad_request(format!(
            "invalid time range for metrics: start {start} is after end {end}"
        )));
    }
    let mut series = history.samples(&state, &e2b, &session, (start, end));
    if (start..=end).contains(&now.timestamp()) {
        let kernels = kernels_of(&state.registry, &e2b, &session).ok_or_else(absent)?;
        let before = (cpu_time(&kernels), tokio::time::Instant::now());
        tokio::time::sleep(CPU_WINDOW).await;
        let used = cpu_time(&kernels).saturating_sub(before.0);
        let metric = measure(
            &state,
            &session,
            &kernels,
            Some((used, before.1.elapsed())),
            now,
        )
        .await?;
        series.push(metric);
    }
    Ok(Json(Value::Array(series)))
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

/// One `SandboxMetric` of `kernels` (the sandbox's and its contexts') at `now`, with the CPU
/// time they `used` over an interval (none: 0 %).
async fn measure(
    state: &AppState,
    sandbox: &Arc<Session>,
    kernels: &[Arc<Session>],
    used: Option<(u64, Duration)>,
    now: DateTime<Utc>,
) -> E2bResult<Value> {
    let limits = &sandbox.user.limits;
    let cpu_count = if limits.cpus.is_finite() && limits.cpus >= 1.0 {
        limits.cpus.ceil().min(1024.0) as u64
    } else {
        1
    };
    let pct = match used {
        Some((ns, over)) => {
            let elapsed = over.as_nanos().max(1) as f64;
            let pct = ns as f64 / (elapsed * cpu_count as f64) * 100.0;
            (pct.clamp(0.0, 100.0) * 100.0).round() / 100.0
        }
        None => 0.0,
    };
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
