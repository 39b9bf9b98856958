//! Pausing a session to disk and resuming it (issue 37; `session/actor/pause.rs`): what
//! the front doors ask the registry, checked once here (another user's session answers as
//! a missing one), then done by the session's actor; and taking back, at start-up, the
//! sessions an earlier run left paused.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::Utc;
use uuid::Uuid;

use super::keep::Outcome;
use super::Registry;
use crate::sandbox::SandboxUser;
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::handle::Session;
use crate::session::lifecycle::LifecycleEvent;
use crate::session::pause::PauseInfo;
use crate::session::state::SessionState;

impl Registry {
    /// Pauses the caller's session `id` to disk (a paused one stays as it is).
    pub async fn pause(&self, user: &str, id: Uuid) -> Result<PauseInfo, SessionError> {
        let session = self.get(user, id)?;
        if let Some(why) = self.config().copy_refusal(&session.kernel_name) {
            return Err(SessionError::PauseRefused { session: id, why });
        }
        Self::ask(&session, |done| Command::Pause { done }).await?
    }

    /// Resumes the caller's paused session `id` (one that is not paused stays as it is).
    pub async fn resume(&self, user: &str, id: Uuid) -> Result<(), SessionError> {
        let session = self.get(user, id)?;
        Self::ask(&session, |done| Command::Resume { done }).await?
    }
}

impl Registry {
    /// Takes back the sessions an earlier run paused (`<data_dir>/paused-sessions`), each
    /// with its sandbox's images, as paused sessions of the same ids; their next use resumes
    /// them. A record whose images are gone, or whose user is no longer configured, goes
    /// (and so do those images); images without a record are discarded. Returns how many
    /// came back.
    pub async fn adopt_paused(&self, users: &[SandboxUser]) -> usize {
        let Some(store) = self.inner.paused_records.clone() else {
            return 0;
        };
        let records = {
            let store = store.clone();
            tokio::task::spawn_blocking(move || store.load_all())
                .await
                .unwrap_or_default()
        };
        let mut images = self.inner.sandbox.paused_images().await;
        let mut adopted = 0;
        for mut record in records {
            let image = record
                .paused_kernel
                .and_then(|k| images.iter().position(|i| i.kernel_id == k))
                .map(|i| images.swap_remove(i));
            let user = users.iter().find(|u| u.name == record.user);
            let (Some(image), Some(user)) = (image, user) else {
                tracing::warn!(session = %record.id, user = %record.user, "a paused session's images or user are gone: it is not taken back");
                store.remove(record.id).await;
                continue;
            };
            let down_seconds = (Utc::now() - record.saved_at)
                .to_std()
                .unwrap_or_default()
                .as_secs_f64();
            record.dead_reason = None;
            let session = self.restore(record, user, Outcome::Paused(image)).await;
            self.report(
                &session,
                &LifecycleEvent::BrokerRestarted {
                    down_seconds,
                    kernel_alive: false,
                },
            );
            adopted += 1;
            tracing::info!(session = %session.id, user = %user.name, "paused session taken back");
        }
        for image in images {
            self.inner.sandbox.discard_paused(image).await;
        }
        adopted
    }
}

impl Registry {
    /// At a stop without `--keep-sessions`: the paused sessions among `all` are let go
    /// (their records and images stay for the next run, where the sandbox keeps them).
    /// Returns the sessions to end, and those of them whose own workspace may go (not one a
    /// paused session works in: an E2B context shares its sandbox's).
    pub(super) async fn let_paused_go(
        &self,
        all: Vec<Arc<Session>>,
    ) -> (Vec<Arc<Session>>, Vec<Arc<Session>>) {
        let keeps = self.inner.sandbox.keeps_paused();
        let (paused, sessions): (Vec<_>, Vec<_>) = all
            .into_iter()
            .partition(|s| keeps && s.state() == SessionState::Paused && s.keeps_paused());
        futures::future::join_all(paused.iter().map(|s| s.detach())).await;
        let kept: HashSet<Uuid> = paused.iter().filter_map(|s| s.own_workspace).collect();
        let ending = sessions
            .iter()
            .filter(|s| s.own_workspace.is_none_or(|k| !kept.contains(&k)))
            .cloned()
            .collect();
        if !paused.is_empty() {
            tracing::info!(
                sessions = paused.len(),
                "paused sessions kept for the next start"
            );
        }
        (sessions, ending)
    }
}
