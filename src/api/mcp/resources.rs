//! Resources: the user's workspace files (`kernel-broker://workspace/<path>`) and each live
//! session's recording as a notebook (`kernel-broker://sessions/<id>/notebook.ipynb`, the
//! same export as `GET /v1/sessions/{id}/notebook`).
//!
//! Listing makes no kernel: the workspace is listed through a live session of the user's
//! (this connection's own first); with none, only notebooks of recordings are listed.
//! A URI of another user's session answers as one that does not exist.

use std::sync::Arc;

use rmcp::model::{ListResourcesResult, ReadResourceResult, Resource, ResourceContents};
use rmcp::ErrorData;
use uuid::Uuid;

use super::call::{internal, workspace, Call};
use super::content::{resource_contents, workspace_uri, WORKSPACE_PREFIX};
use super::server::McpServer;
use crate::recording::notebook;
use crate::session::{files, Session, SessionError};

const SESSIONS_PREFIX: &str = "kernel-broker://sessions/";
const NOTEBOOK_SUFFIX: &str = "/notebook.ipynb";
/// Workspace files listed as resources at most (the `list_files` tool has the same cap).
const MAX_LISTED: usize = 10_000;

fn not_found(uri: &str, why: impl std::fmt::Display) -> ErrorData {
    ErrorData::resource_not_found(
        format!("no resource {uri}: {why}"),
        Some(serde_json::json!({ "uri": uri })),
    )
}

impl McpServer {
    /// A live session of the caller's whose workspace to read: this connection's own when
    /// it has one, else any.
    async fn any_session(&self, call: &Call) -> Option<Arc<Session>> {
        let user = &call.caller.0.name;
        let own = self.own.slot().lock().await.as_ref().map(|m| m.id);
        own.and_then(|id| call.state.registry.get(user, id).ok())
            .or_else(|| call.state.registry.list(user).into_iter().next())
    }

    pub(super) async fn list_resources_call(
        &self,
        call: Call,
    ) -> Result<ListResourcesResult, ErrorData> {
        let mut resources = Vec::new();
        if let Some(session) = self.any_session(&call).await {
            let listing = workspace(&call, &session)?
                .list(MAX_LISTED)
                .await
                .map_err(|e| internal("list files", e))?;
            for f in listing.files {
                resources.push(
                    Resource::new(workspace_uri(&f.path), f.path.clone())
                        .with_description("a file of the workspace")
                        .with_size(f.size),
                );
            }
        }
        if call.state.recording.is_some() {
            for s in call.state.registry.list(&call.caller.0.name) {
                resources.push(
                    Resource::new(
                        format!("{SESSIONS_PREFIX}{}{NOTEBOOK_SUFFIX}", s.id),
                        format!("session-{}.ipynb", s.id),
                    )
                    .with_description("the session's recording as a Jupyter notebook")
                    .with_mime_type("application/x-ipynb+json"),
                );
            }
        }
        Ok(ListResourcesResult::with_all_items(resources))
    }

    pub(super) async fn read_resource_call(
        &self,
        call: Call,
        uri: &str,
    ) -> Result<ReadResourceResult, ErrorData> {
        if let Some(path) = uri.strip_prefix(WORKSPACE_PREFIX) {
            files::clean_relative(path).map_err(|e| not_found(uri, e))?;
            let session = self
                .any_session(&call)
                .await
                .ok_or_else(|| not_found(uri, "no live session yet (run_python makes one)"))?;
            let max = call.state.limits.max_file_bytes;
            let bytes = workspace(&call, &session)?
                .read(path, max)
                .await
                .map_err(|e| match e {
                    e @ SessionError::FileIo { .. } => internal("read file", e),
                    SessionError::TaskFailed { op, source } => internal(op, source),
                    other => not_found(uri, other),
                })?;
            return Ok(ReadResourceResult::new(vec![resource_contents(uri, bytes)]));
        }
        let id = uri
            .strip_prefix(SESSIONS_PREFIX)
            .and_then(|rest| rest.strip_suffix(NOTEBOOK_SUFFIX))
            .ok_or_else(|| {
                not_found(
                    uri,
                    format!("resources are {WORKSPACE_PREFIX}<path> and {SESSIONS_PREFIX}<id>{NOTEBOOK_SUFFIX}"),
                )
            })?;
        let id = Uuid::parse_str(id).map_err(|_| not_found(uri, "session ids are UUIDs"))?;
        let store = call
            .state
            .recording
            .clone()
            .ok_or_else(|| not_found(uri, "this broker does not record sessions"))?;
        let user = &call.caller.0.name;
        // Everything reported so far is in the notebook, a just-closed session's end too.
        store.flush().await;
        let info = store
            .info(id)
            .await
            .map_err(|e| internal("recording", e))?
            .filter(|i| &i.user == user)
            .ok_or_else(|| not_found(uri, format!("no session {id}")))?;
        let events = store
            .all_events(id)
            .await
            .map_err(|e| internal("recording", e))?;
        let body =
            tokio::task::spawn_blocking(move || notebook::notebook(&info, &events).to_string())
                .await
                .map_err(|e| internal("build a notebook", e))?;
        Ok(ReadResourceResult::new(vec![ResourceContents::text(
            body, uri,
        )
        .with_mime_type("application/x-ipynb+json")]))
    }
}
