//! One tool or resource call's context ([`Call`]: the caller, the broker's state, the
//! request's handles), the broker session an MCP session made ([`OwnSession`]), and the
//! failures both the tools and the resources answer alike (the broker's own fault is a
//! JSON-RPC internal error, logged).

use std::sync::Arc;

use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use uuid::Uuid;

use crate::api::auth::Caller;
use crate::api::AppState;
use crate::session::{EndedBy, FrontDoor, Metadata, Provenance, Session, SessionError, Workspace};

/// The caller, the broker's state, and the request's cancellation and progress handles.
pub struct Call {
    pub state: AppState,
    pub caller: Caller,
    pub context: RequestContext<RoleServer>,
}

impl Call {
    /// What a session this call makes is: MCP's, with the client's name and version from
    /// its `initialize` (as the client gave them: cut to the metadata's bounds).
    pub fn provenance(&self) -> Provenance {
        let client = self.context.peer.peer_info();
        let metadata = client.map(|info| {
            Metadata::lenient([
                ("client".to_string(), info.client_info.name.clone()),
                (
                    "client_version".to_string(),
                    info.client_info.version.clone(),
                ),
            ])
        });
        Provenance::new(FrontDoor::Mcp).with_metadata(metadata.unwrap_or_default())
    }

    pub fn of(context: RequestContext<RoleServer>) -> Result<Self, ErrorData> {
        // `forward` (mod.rs) put both into every request before rmcp saw it, and rmcp hands
        // the request's HTTP parts to the handler; their absence is a wiring bug.
        let parts = context.extensions.get::<axum::http::request::Parts>();
        let state = parts.and_then(|p| p.extensions.get::<AppState>()).cloned();
        let caller = parts.and_then(|p| p.extensions.get::<Caller>()).cloned();
        match (state, caller) {
            (Some(state), Some(caller)) => Ok(Self {
                state,
                caller,
                context,
            }),
            _ => Err(ErrorData::internal_error(
                "the request reached the MCP handler without the broker's context",
                None,
            )),
        }
    }
}

/// The broker session of an MCP session (for calls without `session_id`), and its sessions
/// of other languages (`run_code`), which share its workspace.
#[derive(Default)]
pub struct OwnSession(
    tokio::sync::Mutex<Option<Made>>,
    tokio::sync::Mutex<std::collections::HashMap<String, Made>>,
);

/// A session this MCP session made, and what deleting it needs.
pub struct Made {
    pub id: Uuid,
    pub user: String,
    pub state: AppState,
}

impl OwnSession {
    /// The async mutex is held across the create on purpose: two first calls at once make
    /// one session, the second waits for it. Nothing else takes this lock.
    pub fn slot(&self) -> &tokio::sync::Mutex<Option<Made>> {
        &self.0
    }

    /// This MCP session's sessions of other languages, by kernel name (the same rule: the
    /// lock is held across a create).
    pub fn languages(&self) -> &tokio::sync::Mutex<std::collections::HashMap<String, Made>> {
        &self.1
    }
}

impl Drop for OwnSession {
    /// The MCP session ended (DELETE /mcp, or idle past its keep-alive): its broker
    /// sessions go too, so they stop holding the user's quota; those of other languages
    /// first, then the one whose workspace they share. The recordings stay.
    fn drop(&mut self) {
        let mut all: Vec<Made> = self.1.get_mut().drain().map(|(_, m)| m).collect();
        all.extend(self.0.get_mut().take());
        if all.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    for made in all {
                        if let Err(e) = made
                            .state
                            .registry
                            .delete(&made.user, made.id, EndedBy::McpSessionEnded)
                            .await
                        {
                            tracing::debug!(session = %made.id, error = %e, "MCP session's own session already gone");
                        }
                    }
                });
            }
            // Only at process exit, when the registry's shutdown ends every session anyway.
            Err(_) => {
                tracing::debug!(
                    sessions = all.len(),
                    "no runtime to delete the MCP session's own sessions"
                )
            }
        }
    }
}

/// A failure of the broker itself: logged, and a JSON-RPC internal error.
pub fn internal(context: &str, e: impl std::fmt::Display) -> ErrorData {
    tracing::error!(%context, error = %e, "MCP: internal error");
    ErrorData::internal_error("the broker hit an internal error; it is logged", None)
}

/// The workspace of `session`; not reaching it is the broker's fault, a protocol error.
pub fn workspace(call: &Call, session: &Arc<Session>) -> Result<Workspace, ErrorData> {
    call.state.registry.workspace(session).map_err(|e| match e {
        SessionError::WorkspaceUnavailable { source, .. } => internal("workspace", source),
        other => internal("workspace", other),
    })
}

/// A file operation's result with a task that did not finish as a protocol error (the
/// broker's fault); what the caller can fix stays for the tool's answer.
pub fn internal_or<T>(r: Result<T, SessionError>) -> Result<Result<T, SessionError>, ErrorData> {
    match r {
        Err(SessionError::TaskFailed { op, source }) => Err(internal(op, source)),
        other => Ok(other),
    }
}
