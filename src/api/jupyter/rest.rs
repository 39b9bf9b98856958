//! The Jupyter Server / Kernel Gateway REST API: `/api`, `/api/kernelspecs`,
//! `/kernelspecs/{name}/{resource}` and `/api/kernels`. A kernel here is a session (same
//! id, same owner), so its handlers are the agent API's in Jupyter's shapes; errors carry
//! Jupyter's body too ([`JupyterError`]). Kernel specs are the ones read at start-up
//! (`crate::kernel::spec::KernelSpecs`).

use std::collections::HashMap;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::api::auth::Caller;
use crate::api::error::{ApiError, JupyterError};
use crate::api::extract::{BodyLimit, JsonBody, OwnedKernel};
use crate::api::shapes::{iso, ErrorBody, ErrorResponse};
use crate::api::AppState;
use crate::kernel::spec::KernelSpec;
use crate::session::{CreateOptions, FrontDoor, Provenance, SessionInfo, SessionState};

type JResult<T> = Result<T, JupyterError>;

/// The kernel model as Jupyter clients parse it. Fields in alphabetical order: the body was
/// a `json!` map before, and stays the same text.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Kernel)]
pub struct KernelJson {
    pub connections: usize,
    /// Jupyter's states: `starting`, `idle`, `busy`, `dead` (an ended session is `dead`).
    pub execution_state: &'static str,
    pub id: Uuid,
    #[schema(format = DateTime)]
    pub last_activity: String,
    /// The kernel spec name.
    pub name: String,
}

impl From<&SessionInfo> for KernelJson {
    fn from(info: &SessionInfo) -> Self {
        let execution_state = match info.state {
            SessionState::Starting => "starting",
            SessionState::Idle => "idle",
            SessionState::Busy => "busy",
            // On disk; a client connecting to its channels resumes it.
            SessionState::Paused => "idle",
            SessionState::Dead => "dead",
            SessionState::Expired | SessionState::Closed => "dead",
        };
        Self {
            connections: info.connections,
            execution_state,
            id: info.id,
            last_activity: iso(info.last_activity),
            name: info.kernel.clone(),
        }
    }
}

/// A kernel spec as the Jupyter API shows it: `{name, spec, resources}`.
fn spec_model(spec: &KernelSpec) -> Value {
    let resources: serde_json::Map<String, Value> = spec
        .logos
        .iter()
        .map(|file| {
            let key = file.rsplit_once('.').map(|(k, _)| k).unwrap_or(file);
            (
                key.to_string(),
                json!(format!("/kernelspecs/{}/{file}", spec.name)),
            )
        })
        .collect();
    json!({"name": spec.name, "spec": spec.raw, "resources": resources})
}

/// Jupyter: the server's version
#[utoipa::path(get, path = "/api", tag = "jupyter", security(()),
    responses((status = 200, description = "`{version, kernel_broker: true}`", body = Object)))]
pub(super) async fn api_version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "kernel_broker": true}))
}

/// Jupyter: kernel specs
#[utoipa::path(get, path = "/api/kernelspecs", tag = "jupyter",
    responses((status = 200, description = "`{default, kernelspecs: {name: {name, spec, resources}}}`", body = Object),
        (status = 401, response = ErrorResponse)))]
pub(super) async fn kernelspecs(State(state): State<AppState>, _caller: Caller) -> Json<Value> {
    let ks = &state.kernelspecs;
    let all: serde_json::Map<String, Value> =
        ks.iter().map(|s| (s.name.clone(), spec_model(s))).collect();
    Json(json!({"default": ks.default_name(), "kernelspecs": all}))
}

/// Jupyter: one kernel spec
#[utoipa::path(get, path = "/api/kernelspecs/{name}", tag = "jupyter", params(("name" = String, Path)),
    responses((status = 200, description = "`{name, spec, resources}`", body = Object),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse)))]
pub(super) async fn kernelspec(
    State(state): State<AppState>,
    _caller: Caller,
    Path(name): Path<String>,
) -> JResult<Json<Value>> {
    state
        .kernelspecs
        .get(&name)
        .map(|s| Json(spec_model(s)))
        .ok_or_else(|| ApiError::not_found(format!("no kernel spec {name:?}")).into())
}

/// Jupyter: a kernel spec's logo
#[utoipa::path(get, path = "/kernelspecs/{name}/{*resource}", tag = "jupyter",
    params(("name" = String, Path), ("resource" = String, Path, description = "a logo file found at start-up")),
    responses((status = 200, description = "the image", content_type = "image/png", body = Vec<u8>),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse)))]
pub(super) async fn kernelspec_resource(
    State(state): State<AppState>,
    _caller: Caller,
    Path((name, resource)): Path<(String, String)>,
) -> JResult<Response> {
    // Only the logos found at start-up are served: no path from the URL reaches the disk.
    let logo = state
        .kernelspecs
        .get(&name)
        .filter(|s| s.logos.contains(&resource));
    if let Some(spec) = logo {
        if let Ok(bytes) = tokio::fs::read(spec.resource_dir.join(&resource)).await {
            return Ok(([(header::CONTENT_TYPE, "image/png")], bytes).into_response());
        }
    }
    Err(ApiError::not_found(format!("no resource {resource:?} for kernel spec {name:?}")).into())
}

/// Jupyter: the caller's kernels
#[utoipa::path(get, path = "/api/kernels", tag = "jupyter",
    responses((status = 200, description = "ok", body = Vec<KernelJson>), (status = 401, response = ErrorResponse)))]
pub(super) async fn list_kernels(
    State(state): State<AppState>,
    caller: Caller,
) -> Json<Vec<KernelJson>> {
    Json(
        state
            .registry
            .list(&caller.0.name)
            .iter()
            .map(|s| KernelJson::from(&s.info()))
            .collect(),
    )
}

/// The body of `POST /api/kernels` (unknown fields are ignored, as Jupyter Server does).
#[derive(Deserialize, Default, ToSchema)]
pub struct StartBody {
    /// A kernel spec name; the default when absent or empty.
    #[serde(default)]
    name: Option<String>,
    /// Only `KERNEL_ID` is read: a client may propose the kernel's id (Enterprise
    /// Gateway's convention); an id any session had (live or ended, of any user) is
    /// refused with 409 `session_exists`.
    #[serde(default)]
    #[schema(value_type = Object)]
    env: HashMap<String, Value>,
    /// Accepted and ignored (a path on the client's host).
    #[serde(default)]
    #[allow(dead_code)]
    path: Option<String>,
}

impl BodyLimit for StartBody {
    fn body_limit(_: &AppState) -> usize {
        256 << 10
    }
}

/// Jupyter: start a kernel
#[utoipa::path(post, path = "/api/kernels", tag = "jupyter",
    request_body(content = Option<StartBody>, description = "Optional; an empty body takes the defaults"),
    responses((status = 201, description = "created; `Location` is the kernel's URL", body = KernelJson),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, description = "no such kernel spec", body = ErrorBody),
        (status = 409, description = "`session_exists`: the proposed `KERNEL_ID` is a session's, live or ended, of any user (ids are never reused)", body = ErrorBody),
        (status = 413, response = ErrorResponse), (status = 429, response = ErrorResponse),
        (status = 503, response = ErrorResponse)))]
pub(super) async fn start_kernel(
    State(state): State<AppState>,
    caller: Caller,
    body: Result<JsonBody<StartBody>, ApiError>,
) -> JResult<Response> {
    let JsonBody(req) = body?;
    // Enterprise Gateway's convention: a client may propose the kernel id.
    let id = req
        .env
        .get("KERNEL_ID")
        .and_then(|v| v.as_str())
        .and_then(|s| Uuid::parse_str(s).ok());
    let kernel = req.name.filter(|n| !n.is_empty());
    if let Some(k) = &kernel {
        if !state.registry.kernel_names().contains(k) {
            return Err(
                ApiError::not_found(format!("no kernel spec {k:?}; see /api/kernelspecs")).into(),
            );
        }
    }
    let session = state
        .registry
        .create_session(caller.0.create_request(CreateOptions {
            kernel,
            id,
            provenance: Provenance::new(FrontDoor::Jupyter),
            ..CreateOptions::default()
        }))
        .await
        .map_err(ApiError::from)?;
    let location = format!("/api/kernels/{}", session.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(KernelJson::from(&session.info())),
    )
        .into_response())
}

/// Jupyter: one kernel
#[utoipa::path(get, path = "/api/kernels/{id}", tag = "jupyter", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = KernelJson), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse)))]
pub(super) async fn get_kernel(kernel: OwnedKernel) -> Json<KernelJson> {
    Json(KernelJson::from(&kernel.session.info()))
}

/// Jupyter: shut down (a kernel another front door made is only let go of)
///
/// The front door that made a session owns its life: a kernel made through this API ends;
/// an agent's session (made through the agent API, E2B or MCP) that JupyterLab attached is
/// detached instead, and goes on (recorded as `session_detached {by: "jupyter"}`).
#[utoipa::path(delete, path = "/api/kernels/{id}", tag = "jupyter", params(("id" = uuid::Uuid, Path)),
    responses((status = 204, description = "deleted, or detached when another front door made it"), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse)))]
pub(super) async fn delete_kernel(
    State(state): State<AppState>,
    kernel: OwnedKernel,
) -> JResult<StatusCode> {
    let id = kernel.session.id;
    state
        .registry
        .end_or_detach(&kernel.caller.0.name, id, FrontDoor::Jupyter)
        .await
        .map_err(ApiError::from)?;
    state.jupyter_clients.forget_kernel(id);
    Ok(StatusCode::NO_CONTENT)
}

/// Jupyter: interrupt
#[utoipa::path(post, path = "/api/kernels/{id}/interrupt", tag = "jupyter", params(("id" = uuid::Uuid, Path)),
    responses((status = 204, description = "interrupted"), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 503, response = ErrorResponse)))]
pub(super) async fn interrupt_kernel(kernel: OwnedKernel) -> JResult<StatusCode> {
    kernel.session.interrupt().await.map_err(ApiError::from)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Jupyter: restart
#[utoipa::path(post, path = "/api/kernels/{id}/restart", tag = "jupyter", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = KernelJson), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 410, response = ErrorResponse),
        (status = 503, response = ErrorResponse)))]
pub(super) async fn restart_kernel(kernel: OwnedKernel) -> JResult<Json<KernelJson>> {
    kernel.session.restart().await.map_err(ApiError::from)?;
    Ok(Json(KernelJson::from(&kernel.session.info())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel model is the same text as the `json!` map it replaced.
    #[test]
    fn kernel_json_is_the_jupyter_model() {
        let t: chrono::DateTime<chrono::Utc> = "2024-05-01T12:00:00Z".parse().unwrap();
        for (state, name) in [
            (SessionState::Starting, "starting"),
            (SessionState::Idle, "idle"),
            (SessionState::Busy, "busy"),
            (SessionState::Dead, "dead"),
            (SessionState::Expired, "dead"),
            (SessionState::Closed, "dead"),
        ] {
            let info = SessionInfo {
                id: Uuid::new_v4(),
                user: "u".into(),
                kernel: "python3".into(),
                state,
                created_at: t,
                last_activity: t,
                expires_at: None,
                execution_count: 0,
                connections: 2,
                memory_limit_bytes: 1 << 28,
                memory_used_bytes: None,
                dead_reason: None,
                provenance: Default::default(),
                secrets: vec![],
            };
            let before = json!({
                "id": info.id,
                "name": info.kernel,
                "last_activity": iso(info.last_activity),
                "execution_state": name,
                "connections": info.connections,
            });
            assert_eq!(
                serde_json::to_string(&KernelJson::from(&info)).unwrap(),
                before.to_string()
            );
        }
    }
}
