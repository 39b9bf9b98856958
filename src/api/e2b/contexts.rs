//! E2B's code interpreter's contexts (`/contexts`): more sessions of the sandbox's user in
//! the sandbox's workspace, each with a kernel of its language. The sandbox's own session is
//! its default context (Python); each other language has a default context of its own, made
//! at the first `run_code(language=...)` without a context, as E2B's code interpreter has
//! one per language; `create_code_context(language=...)` makes more.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::SandboxCaller;
use super::documented::SandboxErrors;
use super::{E2bError, E2bResult, WORKDIR};
use crate::api::extract::{parse_json, read_limited};
use crate::api::AppState;
use crate::kernel::spec::KernelSpecs;
use crate::session::{EndedBy, FrontDoor, Metadata, Session, WorkspaceChoice};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_context, list_contexts))
        .routes(routes!(delete_context))
        .routes(routes!(restart_context))
}

/// The kernel a `language` names (E2B's names and aliases: `python`, `r`, `js`/`javascript`,
/// `ts`/`typescript`, `bash`, `java`; and this broker's `sql`); `None` for none given.
pub(super) fn kernel_for(specs: &KernelSpecs, language: Option<&str>) -> E2bResult<Option<String>> {
    let Some(language) = language.filter(|l| !l.is_empty()) else {
        return Ok(None);
    };
    match specs.resolve(language) {
        Some(spec) => Ok(Some(spec.name.clone())),
        None => Err(E2bError::bad_request(format!(
            "language {:?} is not available: this broker's kernels are {}",
            language.chars().take(64).collect::<String>(),
            specs.names().join(", ")
        ))),
    }
}

/// The language of a session's kernel, as its spec names it.
pub(super) fn language_of(specs: &KernelSpecs, session: &Session) -> String {
    specs
        .get(&session.kernel_name)
        .map_or_else(|| "python".into(), |s| s.language.clone())
}

/// E2B's name for the language of a kernel (`python`, `r`, `javascript`, ...).
fn e2b_language(specs: &KernelSpecs, kernel: &str) -> String {
    match specs.get(kernel).map(|s| s.language.to_ascii_lowercase()) {
        Some(l) if l == "typescript" => "javascript".into(),
        Some(l) => l,
        None => kernel.to_string(),
    }
}

/// The session a context id names in this sandbox (none: the sandbox's own).
pub(super) fn context_session(
    state: &AppState,
    caller: &SandboxCaller,
    id: Option<&str>,
) -> E2bResult<Arc<Session>> {
    let Some(id) = id.filter(|s| !s.is_empty()) else {
        return Ok(caller.session.clone());
    };
    let absent = || E2bError::not_found(format!("context {id:?} not found"));
    let uuid = Uuid::parse_str(id).map_err(|_| absent())?;
    if uuid == caller.session.id {
        return Ok(caller.session.clone());
    }
    let ours = caller
        .e2b
        .with(caller.session.id, |m| m.contains_context(uuid))
        .unwrap_or(false);
    if !ours {
        return Err(absent());
    }
    state
        .registry
        .get(&caller.user.name, uuid)
        .map_err(|_| absent())
}

#[derive(Deserialize, Default)]
struct ContextBody {
    language: Option<String>,
    cwd: Option<String>,
}

fn context_json(id: Uuid, language: &str, cwd: Option<&str>) -> Value {
    json!({"id": id.to_string(), "language": language, "cwd": cwd.unwrap_or(WORKDIR)})
}

/// The sandbox's default context for `kernel`, made at its first use.
pub(super) async fn default_context(
    state: &AppState,
    caller: &SandboxCaller,
    kernel: &str,
) -> E2bResult<Arc<Session>> {
    let known = caller
        .e2b
        .with(caller.session.id, |m| {
            m.default_contexts.get(kernel).copied()
        })
        .flatten();
    if let Some(id) = known {
        if let Ok(s) = state.registry.get(&caller.user.name, id) {
            return Ok(s);
        }
        // Gone (expired, deleted through another front door): a new one takes its place.
        caller.e2b.with(caller.session.id, |m| {
            if m.default_contexts.get(kernel) == Some(&id) {
                m.default_contexts.remove(kernel);
                m.contexts.retain(|c| *c != id);
            }
        });
    }
    let session = make_context(state, caller, Some(kernel), None, true).await?;
    // Two first uses at once: the first one recorded is the default, the other goes.
    let chosen = caller
        .e2b
        .with(caller.session.id, |m| {
            let id = *m
                .default_contexts
                .entry(kernel.to_string())
                .or_insert(session.id);
            if id != session.id {
                m.contexts.retain(|c| *c != session.id);
            }
            id
        })
        .unwrap_or(session.id);
    if chosen != session.id {
        let _ = state
            .registry
            .delete(&caller.user.name, session.id, EndedBy::SandboxEnded)
            .await;
        return state
            .registry
            .get(&caller.user.name, chosen)
            .map_err(|_| E2bError::not_found("the sandbox has ended"));
    }
    Ok(session)
}

/// A new context session of the sandbox: its kernel (`None`: the default), in the
/// sandbox's workspace, at `cwd` if given; `language_default`: a language's default
/// context, marked so in its metadata ([`super::state::DEFAULT_CONTEXT_KEY`]).
async fn make_context(
    state: &AppState,
    caller: &SandboxCaller,
    kernel: Option<&str>,
    cwd: Option<String>,
    language_default: bool,
) -> E2bResult<Arc<Session>> {
    let mut entries = vec![("sandbox".to_string(), caller.session.id.to_string())];
    if let Some(k) = kernel.filter(|_| language_default) {
        entries.push((super::state::DEFAULT_CONTEXT_KEY.to_string(), k.to_string()));
    }
    let sandbox = Metadata::lenient(entries);
    let mut options =
        super::control::session_options(state, sandbox, WorkspaceChoice::OwnOf(caller.session.id));
    options.kernel = kernel.map(str::to_string);
    // A context is the sandbox's: its kernel gets the sandbox's secrets.
    options.secrets = (*caller.session.secrets.values()).clone();
    let room = crate::api::cluster::quota::room(state, &caller.user).await?;
    let session = state
        .registry
        .create_session(room.request(caller.user.create_request(options)))
        .await
        .map_err(|e| room.explain(e))?;
    drop(room);
    let deadline_left = caller
        .session
        .deadline()
        .and_then(|d| (d - chrono::Utc::now()).to_std().ok());
    if let Some(left) = deadline_left {
        session.set_deadline(Some(tokio::time::Instant::now() + left));
    }
    session.set_pause_at_deadline(caller.session.pauses_at_deadline());
    if let Some(dir) = &cwd {
        if let Err(e) = super::context_cwd::apply(state, &session, dir).await {
            let _ = state
                .registry
                .delete(&caller.user.name, session.id, EndedBy::SetupFailed)
                .await;
            return Err(e);
        }
    }
    let known = caller
        .e2b
        .with(caller.session.id, |m| {
            m.contexts.push(session.id);
            if let Some(dir) = &cwd {
                m.context_cwds.insert(session.id, dir.clone());
            }
        })
        .is_some();
    if !known {
        let _ = state
            .registry
            .delete(&caller.user.name, session.id, EndedBy::SandboxEnded)
            .await;
        return Err(E2bError::not_found("the sandbox has ended"));
    }
    Ok(session)
}

/// Create a context: another kernel in the same sandbox
#[utoipa::path(post, operation_id = "e2b_create_context", path = "/e2b/sandbox/contexts", tag = "e2b", security(()),
    responses((status = 200, description = "`{id, language, cwd}`", body = serde_json::Value), SandboxErrors))]
async fn create_context(
    State(state): State<AppState>,
    caller: SandboxCaller,
    body: Body,
) -> E2bResult<Json<Value>> {
    let bytes = read_limited(body, 64 << 10, "request body").await?;
    let req: ContextBody = parse_json(&bytes, "request body")?;
    let kernel = kernel_for(&state.kernelspecs, req.language.as_deref())?;
    let cwd = super::context_cwd::asked(req.cwd.as_deref())?;
    let session = make_context(&state, &caller, kernel.as_deref(), cwd.clone(), false).await?;
    Ok(Json(context_json(
        session.id,
        &e2b_language(&state.kernelspecs, &session.kernel_name),
        cwd.as_deref(),
    )))
}

/// The sandbox's contexts
#[utoipa::path(get, operation_id = "e2b_list_contexts", path = "/e2b/sandbox/contexts", tag = "e2b", security(()),
    responses((status = 200, description = "`[{id, language, cwd}]`", body = serde_json::Value), SandboxErrors))]
async fn list_contexts(State(state): State<AppState>, caller: SandboxCaller) -> Json<Vec<Value>> {
    let specs = &state.kernelspecs;
    let mut list = vec![context_json(
        caller.session.id,
        &e2b_language(specs, &caller.session.kernel_name),
        None,
    )];
    let contexts = caller
        .e2b
        .with(caller.session.id, |m| {
            m.contexts
                .iter()
                .map(|id| (*id, m.context_cwds.get(id).cloned()))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for (id, cwd) in contexts {
        let kernel = state
            .registry
            .get(&caller.user.name, id)
            .map(|s| s.kernel_name.clone())
            .unwrap_or_default();
        list.push(context_json(
            id,
            &e2b_language(specs, &kernel),
            cwd.as_deref(),
        ));
    }
    Json(list)
}

/// Remove a context (its kernel ends)
#[utoipa::path(delete, operation_id = "e2b_delete_context", path = "/e2b/sandbox/contexts/{id}", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 204, description = "removed"), SandboxErrors))]
async fn delete_context(
    State(state): State<AppState>,
    caller: SandboxCaller,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let session = context_session(&state, &caller, Some(&id))?;
    if session.id == caller.session.id {
        return Err(E2bError::bad_request(
            "the sandbox's default context cannot be removed; kill the sandbox instead",
        ));
    }
    caller.e2b.with(caller.session.id, |m| {
        m.contexts.retain(|c| *c != session.id);
        m.context_cwds.remove(&session.id);
        m.default_contexts.retain(|_, c| *c != session.id);
    });
    state
        .registry
        .delete(
            &caller.user.name,
            session.id,
            EndedBy::Client(FrontDoor::E2b),
        )
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Restart a context's kernel (its state is cleared)
#[utoipa::path(post, operation_id = "e2b_restart_context", path = "/e2b/sandbox/contexts/{id}/restart", tag = "e2b", security(()), params(("id" = String, Path)),
    responses((status = 204, description = "restarted"), SandboxErrors))]
async fn restart_context(
    State(state): State<AppState>,
    caller: SandboxCaller,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let session = context_session(&state, &caller, Some(&id))?;
    session.touch();
    session.restart().await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn languages_name_kernels_by_e2bs_names() {
        let specs = KernelSpecs::load(std::path::Path::new("kernels")).unwrap();
        assert_eq!(
            kernel_for(&specs, Some("js")).unwrap().as_deref(),
            Some("javascript")
        );
        assert_eq!(
            kernel_for(&specs, Some("python")).unwrap().as_deref(),
            Some("python3")
        );
        assert_eq!(kernel_for(&specs, None).unwrap(), None);
        assert_eq!(kernel_for(&specs, Some("")).unwrap(), None);
        assert!(kernel_for(&specs, Some("cobol")).is_err());
        assert_eq!(e2b_language(&specs, "javascript"), "javascript");
        assert_eq!(e2b_language(&specs, "r"), "r");
        assert_eq!(e2b_language(&specs, "python3"), "python");
    }
}
