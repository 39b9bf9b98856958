//! Checkpoints and rewind of a session (issue 36; `session/checkpoint.rs` says what they
//! are): what the front doors ask the registry, checked once here (ownership: another
//! user's session answers as a missing one), then done by the session's actor, which owns
//! the kernels (and refuses a session with a workspace of its own, as a fork is refused).

use std::sync::Arc;

use tokio::sync::oneshot;
use uuid::Uuid;

use super::Registry;
use crate::session::checkpoint::{CheckpointInfo, CheckpointList, CheckpointPolicy, CheckpointUse};
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::handle::Session;

impl Registry {
    pub(super) async fn ask<T>(
        session: &Session,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, SessionError> {
        let (done, answer) = oneshot::channel();
        session.send(make(done))?;
        answer.await.map_err(|_| SessionError::Closed(session.id))
    }

    /// Sets the bounds (and every-execution mode) the session's checkpoints keep to.
    pub fn set_checkpoint_policy(
        &self,
        session: &Session,
        policy: CheckpointPolicy,
    ) -> Result<(), SessionError> {
        session.send(Command::CheckpointPolicy {
            policy,
            book: self.inner.checkpoints.clone(),
            set_mode: true,
        })
    }

    /// Takes a checkpoint of the caller's session `id` now, within `policy`'s bounds.
    pub async fn take_checkpoint(
        &self,
        user: &str,
        id: Uuid,
        policy: CheckpointPolicy,
    ) -> Result<CheckpointInfo, SessionError> {
        let session = self.get(user, id)?;
        if let Some(why) = self.config().copy_refusal(&session.kernel_name) {
            return Err(SessionError::ForkRefused { session: id, why });
        }
        // The bounds only: the session keeps its every-execution mode.
        session.send(Command::CheckpointPolicy {
            policy,
            book: self.inner.checkpoints.clone(),
            set_mode: false,
        })?;
        Self::ask(&session, |done| Command::Checkpoint { done }).await?
    }

    /// The caller's session's checkpoints, and what all the user's checkpoints hold.
    pub async fn checkpoints(
        &self,
        user: &str,
        id: Uuid,
    ) -> Result<(CheckpointList, CheckpointUse), SessionError> {
        let session = self.get(user, id)?;
        let list = Self::ask(&session, Command::ListCheckpoints).await?;
        Ok((list, self.inner.checkpoints.usage(user)))
    }

    /// Ends checkpoint `cp` of the caller's session `id`.
    pub async fn delete_checkpoint(
        &self,
        user: &str,
        id: Uuid,
        cp: Uuid,
    ) -> Result<(), SessionError> {
        let session = self.get(user, id)?;
        let dropped = Self::ask(&session, |done| Command::DropCheckpoint {
            id: cp,
            why: "deleted by request".into(),
            done: Some(done),
        })
        .await?;
        if dropped {
            Ok(())
        } else {
            Err(SessionError::CheckpointNotFound {
                session: id,
                checkpoint: cp,
            })
        }
    }

    /// Puts the caller's session `id` back to checkpoint `cp`: its kernel is replaced by a
    /// fork of the checkpoint, which stays.
    pub async fn rewind(
        &self,
        user: &str,
        id: Uuid,
        cp: Uuid,
    ) -> Result<Arc<Session>, SessionError> {
        let session = self.get(user, id)?;
        Self::ask(&session, |done| Command::Rewind {
            checkpoint: cp,
            done,
        })
        .await??;
        Ok(session)
    }
}
