//! Sessions' own workspaces ([`WorkspaceChoice::Own`]): which one a new session works in,
//! and their removal when the last session working in one ends (the sandbox removes it:
//! `sandbox/own_workspace.rs`). A broker shutdown that does not keep its sessions removes
//! them all; one that keeps them (`--keep-sessions`) keeps them too, and adoption finds
//! them again by the same key.

use std::collections::HashSet;
use std::sync::Arc;

use uuid::Uuid;

use super::Registry;
use crate::session::config::WorkspaceChoice;
use crate::session::error::SessionError;
use crate::session::handle::Session;

impl Registry {
    /// The own workspace a new session `id` of `user` works in (`None`: the shared one).
    /// Another user's session, or one that is not live, is not found.
    pub(super) fn own_workspace_key(
        &self,
        user: &str,
        id: Uuid,
        choice: WorkspaceChoice,
    ) -> Result<Option<Uuid>, SessionError> {
        match choice {
            WorkspaceChoice::Shared => Ok(None),
            WorkspaceChoice::Own => Ok(Some(id)),
            WorkspaceChoice::OwnOf(of) => match self.table().sessions.get(&of) {
                Some(s) if s.user.name == user => Ok(s.own_workspace),
                _ => Err(SessionError::NotFound(of)),
            },
        }
    }

    /// Removes `session`'s own workspace if no live session works in it any more.
    pub(super) async fn release_own_workspace(&self, session: &Session) {
        let Some(key) = session.own_workspace else {
            return;
        };
        let in_use = self
            .table()
            .sessions
            .values()
            .any(|s| s.own_workspace == Some(key));
        if !in_use {
            self.sandbox()
                .remove_own_workspace(&session.user, key)
                .await;
        }
    }

    /// Removes the own workspaces of `sessions`, which all ended.
    pub(super) async fn remove_own_workspaces(&self, sessions: &[Arc<Session>]) {
        let mut seen = HashSet::new();
        for s in sessions {
            if let Some(key) = s.own_workspace.filter(|k| seen.insert(*k)) {
                self.sandbox().remove_own_workspace(&s.user, key).await;
            }
        }
    }
}
