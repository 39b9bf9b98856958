//! Pausing a session to disk and resuming it (issue 37; `session/actor/pause.rs`): what
//! the front doors ask the registry, checked once here (another user's session answers as
//! a missing one), then done by the session's actor.

use uuid::Uuid;

use super::Registry;
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::pause::PauseInfo;

impl Registry {
    /// Pauses the caller's session `id` to disk (a paused one stays as it is).
    pub async fn pause(&self, user: &str, id: Uuid) -> Result<PauseInfo, SessionError> {
        let session = self.get(user, id)?;
        Self::ask(&session, |done| Command::Pause { done }).await?
    }

    /// Resumes the caller's paused session `id` (one that is not paused stays as it is).
    pub async fn resume(&self, user: &str, id: Uuid) -> Result<(), SessionError> {
        let session = self.get(user, id)?;
        Self::ask(&session, |done| Command::Resume { done }).await?
    }
}
