//! E2B's control plane under `/e2b` (`E2B_API_URL`): create (`POST /sandboxes`,
//! `/v2/sandboxes`), list, get, kill, set the timeout (fork: `fork.rs`; pause, resume
//! and connect: `pause.rs`). A
//! sandbox is a session of the key's user with a fixed deadline: E2B's `timeout` (default
//! 300 s, at most the broker's maximum idle timeout, a day by default), and that maximum as
//! its idle timeout, a backstop only (see [`session_options`]). Anything else under `/e2b`
//! answers E2B's error shape with a sentence.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::{access_token, ApiKeyUser, TokenKind};
use super::documented::{v2, ControlErrors};
use super::listing::{listed_time, ListQuery, Listed};
use super::state::SandboxMeta;
use super::{E2bError, E2bResult, E2bState};
use crate::api::extract::{parse_json, read_limited};
use crate::api::AppState;
use crate::session::check_user_env;
use crate::session::{
    CreateOptions, EndedBy, FrontDoor, Metadata, Provenance, Session, WorkspaceChoice,
};

/// The envd version the broker presents: the highest whose gated features all work here.
/// The SDKs' gates (Python `e2b/envd/versions.py`, the JavaScript SDK's `compareVersions`
/// calls): recursive watching 0.1.4, disk metrics 0.2.4, stdin 0.3.0, no `username`
/// parameter 0.4.0, closing stdin 0.5.2, octet-stream (and gzip) uploads 0.5.7, file
/// metadata 0.6.2, watch events with their entry 0.6.3, `allow_network_mounts` for watches
/// 0.6.4 (accepted: a workspace is never a network mount, so it changes nothing).
pub const ENVD_VERSION: &str = "0.6.4";
/// E2B's default sandbox timeout.
pub(super) const DEFAULT_TIMEOUT: u64 = 300;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create, list))
        .routes(v2(routes!(create, list)))
        .routes(routes!(get_one, kill))
        .routes(routes!(set_timeout))
}

/// What `POST /sandboxes` takes (unknown fields are ignored, as E2B's API does: the
/// SDKs send many that have no meaning here).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct CreateBody {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    metadata: Option<serde_json::Map<String, Value>>,
    env_vars: Option<std::collections::BTreeMap<String, String>>,
    auto_pause: Option<bool>,
}

/// The longest timeout: the broker's maximum idle timeout (a day unless configured).
pub(super) fn max_timeout(state: &AppState) -> u64 {
    match state.registry.config().max_idle_timeout.as_secs() {
        0 => 86_400,
        max => max,
    }
}

/// What E2B sessions are created with: no idle expiry of their own before their deadline,
/// but the longest idle timeout as a backstop. The fixed deadline is not in the session's
/// record, so after a restart with `--keep-sessions` a sandbox would otherwise live
/// forever; every move of the deadline is activity, so the backstop never comes first.
///
/// `workspace` is the sandbox's own (E2B's sandbox is a machine of its own: `/home/user`, `/tmp`);
/// its contexts work in their sandbox's.
pub(super) fn session_options(
    state: &AppState,
    metadata: Metadata,
    workspace: WorkspaceChoice,
) -> CreateOptions {
    CreateOptions {
        idle_timeout_seconds: Some(state.registry.config().max_idle_timeout.as_secs()),
        provenance: Provenance::new(FrontDoor::E2b).with_metadata(metadata),
        workspace,
        ..Default::default()
    }
}

/// The metadata key naming the envVars (and later `envs`) that are secrets, comma- or
/// space-separated: E2B's SDKs have no way to mark a variable secret, and metadata passes
/// through every SDK unchanged.
pub(super) const SECRETS_KEY: &str = "kernel_broker_secrets";

/// The names the sandbox metadata declares secret.
pub(super) fn declared_secrets(
    metadata: Option<&serde_json::Map<String, Value>>,
) -> std::collections::BTreeSet<String> {
    metadata
        .and_then(|m| m.get(SECRETS_KEY))
        .and_then(Value::as_str)
        .map(|s| {
            s.split([',', ' '])
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// E2B's sandbox metadata as the session's: values as text (a string as it is, anything
/// else as its JSON), within the session metadata's bounds (a 400 beyond them).
pub(super) fn metadata_of(given: Option<&serde_json::Map<String, Value>>) -> E2bResult<Metadata> {
    let entries = given
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (k.clone(), text)
        })
        .collect();
    Metadata::new(entries).map_err(|e| E2bError::bad_request(e.to_string()))
}

pub(super) fn timeout_secs(state: &AppState, t: Option<u64>) -> E2bResult<u64> {
    let t = t.unwrap_or(DEFAULT_TIMEOUT);
    let max = max_timeout(state);
    if t == 0 || t > max {
        return Err(E2bError::bad_request(format!(
            "timeout must be between 1 and {max} seconds; got {t}"
        )));
    }
    Ok(t)
}

/// The create response (E2B's `Sandbox`).
pub(super) fn sandbox_json(key: &str, session: &Session, template: &str) -> Value {
    json!({
        "templateID": template,
        "sandboxID": session.id.to_string(),
        "clientID": "kernel-broker",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access_token(key, session.id, TokenKind::Envd),
        "trafficAccessToken": access_token(key, session.id, TokenKind::Traffic),
        "domain": null,
    })
}

/// E2B's `SandboxDetail` / `ListedSandbox`.
fn detail_json(session: &Session, meta: Option<&SandboxMeta>) -> Value {
    let info = session.info();
    let limits = &session.user.limits;
    json!({
        "templateID": meta.map_or("code-interpreter-v1", |m| m.template.as_str()),
        "sandboxID": session.id.to_string(),
        "clientID": "kernel-broker",
        "alias": meta.map(|m| m.template.clone()),
        "startedAt": listed_time(meta.map_or(info.created_at, |m| m.started_at))
            .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        "endAt": session.deadline().or(info.expires_at).map(|t| t.to_rfc3339()),
        "envdVersion": ENVD_VERSION,
        "cpuCount": limits.cpus.ceil().max(1.0) as u64,
        "memoryMB": session.limits.memory_bytes >> 20,
        "diskSizeMB": limits.workspace_quota_bytes >> 20,
        "state": if info.state == crate::session::SessionState::Paused { "paused" } else { "running" },
        "metadata": meta.map_or(Value::Object(Default::default()), |m| Value::Object(m.metadata.clone())),
    })
}

/// Create a sandbox (E2B)
#[utoipa::path(post, operation_id = "e2b_create", path = "/e2b/sandboxes", tag = "e2b", security(()),
    responses((status = 201, description = "E2B's `Sandbox`", body = serde_json::Value), ControlErrors))]
async fn create(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    body: axum::body::Body,
) -> E2bResult<Response> {
    let bytes = read_limited(body, 1 << 20, "request body").await?;
    let req: CreateBody = parse_json(&bytes, "request body")?;
    let timeout = timeout_secs(&state, req.timeout)?;
    let env: Vec<(String, String)> = req.env_vars.unwrap_or_default().into_iter().collect();
    // Refused here as a 400; and applied, like every tenant variable, only inside the
    // sandbox after the drop (sandbox/environ.rs).
    check_user_env(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map_err(|e| E2bError::bad_request(format!("envVars: {e}")))?;
    // The envVars the metadata declares secret are the session's secrets: its kernels'
    // environment from their start, masked everywhere, and not shown back.
    let declared = declared_secrets(req.metadata.as_ref());
    let (secrets, env): (Vec<_>, Vec<_>) = env.into_iter().partition(|(k, _)| declared.contains(k));
    let secrets: std::collections::BTreeMap<String, String> = secrets.into_iter().collect();
    crate::secrets::check(&secrets).map_err(|e| E2bError::bad_request(format!("envVars: {e}")))?;
    let metadata = metadata_of(req.metadata.as_ref())?;
    let user = caller.0 .0.clone();
    let mut options = session_options(&state, metadata, WorkspaceChoice::Own);
    options.secrets = secrets;
    // `Sandbox.create(snapshot_id)`: a template that is one of the caller's snapshots.
    options.snapshot = req
        .template_id
        .as_deref()
        .and_then(|t| state.registry.find_snapshot(&user.name, t))
        .map(|s| s.snapshot_id);
    let session = state
        .registry
        .create_session(user.create_request(options))
        .await?;
    session.set_deadline(Some(Instant::now() + Duration::from_secs(timeout)));
    // E2B's `autoPause` (the SDKs' `lifecycle={"on_timeout": "pause"}`): paused at its
    // timeout instead of ended (`session/registry/expiry.rs`); resumed by `connect`.
    session.set_pause_at_deadline(req.auto_pause == Some(true));
    if !env.is_empty() {
        // The kernel's environment: set once, as E2B's sandbox-wide envVars are.
        let code = format!(
            "import os as _kb_os\n_kb_os.environ.update({})\ndel _kb_os",
            serde_json::to_string(
                &env.iter()
                    .cloned()
                    .collect::<std::collections::BTreeMap<_, _>>()
            )
            .map_err(|e| E2bError::internal("envVars", e))?
        );
        let run = session
            .execute_wait(code, state.limits.execution_timeout)
            .await?;
        if run.error.is_some() {
            let _ = state
                .registry
                .delete(&user.name, session.id, EndedBy::SetupFailed)
                .await;
            return Err(E2bError::internal("envVars", "setting envVars failed"));
        }
    }
    let template = req
        .template_id
        .unwrap_or_else(|| "code-interpreter-v1".to_string());
    e2b.insert(
        session.id,
        SandboxMeta {
            template: template.clone(),
            metadata: req.metadata.unwrap_or_default(),
            env,
            started_at: session.created_at,
            contexts: Vec::new(),
            context_cwds: std::collections::HashMap::new(),
            default_contexts: Default::default(),
            commands: Default::default(),
        },
    );
    e2b.watch(state.registry.clone(), session.clone());
    Ok((
        StatusCode::CREATED,
        Json(sandbox_json(&user.token, &session, &template)),
    )
        .into_response())
}

/// The caller's sandboxes (E2B): filtered, ordered and paged as E2B's API does
#[utoipa::path(get, operation_id = "e2b_list", path = "/e2b/sandboxes", tag = "e2b", security(()),
    params(
        ("metadata" = Option<String>, Query, description = "`k=v&...`, URL-encoded; every pair must match"),
        ("state" = Option<String>, Query, description = "`running`, `paused`, comma-separated or repeated (both by default)"),
        ("limit" = Option<u32>, Query, description = "1 to 100 (default 100)"),
        ("nextToken" = Option<String>, Query, description = "the `x-next-token` of the previous page"),
        ("order" = Option<String>, Query, description = "`desc` (newest first, the default) or `asc`, by start time"),
        ("startedAfter" = Option<String>, Query, description = "RFC 3339: sandboxes started at or after it"),
        ("template" = Option<String>, Query, description = "a template id"),
    ),
    responses((status = 200, description = "E2B's `[ListedSandbox]`; `x-next-token` names the next page when there is one", body = serde_json::Value), ControlErrors))]
async fn list(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let query =
        ListQuery::parse(raw.as_deref()).map_err(|e| E2bError::bad_request(e.to_string()))?;
    let sandboxes = state
        .registry
        .list(&caller.0 .0.name)
        .iter()
        .filter_map(|s| {
            e2b.with(s.id, |meta| Listed {
                started_at: meta.started_at,
                id: s.id.to_string(),
                template: meta.template.clone(),
                metadata: meta.metadata.clone(),
                paused: s.state() == crate::session::SessionState::Paused,
                item: detail_json(s, Some(meta)),
            })
        })
        .collect();
    let page = query.page(sandboxes);
    let mut response = Json(page.items).into_response();
    if let Some(token) = page.next_token {
        if let Ok(value) = HeaderValue::from_str(&token) {
            response.headers_mut().insert("x-next-token", value);
        }
    }
    Ok(response)
}

/// The caller's sandbox `id`: another user's, or a session the E2B API did not make,
/// answers as absent.
pub(super) fn owned(
    state: &AppState,
    e2b: &E2bState,
    caller: &ApiKeyUser,
    id: &str,
) -> E2bResult<Arc<Session>> {
    let absent = || E2bError::not_found(format!("sandbox {id:?} not found"));
    let uuid = Uuid::parse_str(id).map_err(|_| absent())?;
    let session = state
        .registry
        .get(&caller.0 .0.name, uuid)
        .map_err(|_| absent())?;
    e2b.with(uuid, |_| ()).ok_or_else(absent)?;
    Ok(session)
}

/// One sandbox (E2B)
#[utoipa::path(get, operation_id = "e2b_get_one", path = "/e2b/sandboxes/{id}", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 200, description = "E2B's `SandboxDetail`", body = serde_json::Value), ControlErrors))]
async fn get_one(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
) -> E2bResult<Json<Value>> {
    let session = owned(&state, &e2b, &caller, &id)?;
    let detail = e2b
        .with(session.id, |meta| detail_json(&session, Some(meta)))
        .unwrap_or_else(|| detail_json(&session, None));
    Ok(Json(detail))
}

/// Kill a sandbox (E2B): its session, contexts and commands end
#[utoipa::path(delete, operation_id = "e2b_kill", path = "/e2b/sandboxes/{id}", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 204, description = "killed"), ControlErrors))]
async fn kill(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let session = owned(&state, &e2b, &caller, &id)?;
    let user = caller.0 .0.name.clone();
    e2b.end(&state.registry, &user, session.id).await;
    state
        .registry
        .delete(&user, session.id, EndedBy::Client(FrontDoor::E2b))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

pub(super) fn extend(
    state: &AppState,
    e2b: &E2bState,
    session: &Session,
    secs: u64,
) -> E2bResult<()> {
    let secs = timeout_secs(state, Some(secs))?;
    let at = Instant::now() + Duration::from_secs(secs);
    // Activity: the idle backstop (see `session_options`) moves past the new deadline.
    session.touch();
    session.set_deadline(Some(at));
    let contexts = e2b
        .with(session.id, |m| m.contexts.clone())
        .unwrap_or_default();
    for ctx in contexts {
        if let Ok(c) = state.registry.get(&session.user.name, ctx) {
            c.touch();
            c.set_deadline(Some(at));
        }
    }
    Ok(())
}

/// Set a sandbox's timeout (E2B): it now ends `timeout` seconds from now
#[utoipa::path(post, operation_id = "e2b_set_timeout", path = "/e2b/sandboxes/{id}/timeout", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 204, description = "set"), ControlErrors))]
async fn set_timeout(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2bState>>,
    caller: ApiKeyUser,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> E2bResult<StatusCode> {
    let session = owned(&state, &e2b, &caller, &id)?;
    let bytes = read_limited(body, 64 << 10, "request body").await?;
    let req: TimeoutBody = parse_json(&bytes, "request body")?;
    extend(&state, &e2b, &session, req.timeout)?;
    Ok(StatusCode::NO_CONTENT)
}
