//! The one way a front door makes a session: a [`CreateRequest`] (who it is for, their
//! session quota, and what the client asked: kernel, idle timeout, id, memory) given to
//! [`Registry::create_session`]. The agent REST API, the Jupyter kernels API, E2B's
//! sandboxes and contexts and MCP's tools each translate their protocol into one; the
//! checks (kernel spec, quotas, memory, a proposed id) are the registry's, done once.

use std::sync::Arc;

use super::checkpoint::CheckpointPolicy;
use super::error::SessionError;
use super::handle::Session;
use super::registry::{CreateOptions, Registry};
use crate::sandbox::SandboxUser;

/// A session to make.
pub struct CreateRequest {
    /// Whom it is for, as the sandbox knows them (name, uid slot, limits).
    pub user: SandboxUser,
    /// How many live sessions the user may have.
    pub max_sessions: usize,
    /// What the client asked for (all defaults: `CreateOptions::default()`).
    pub options: CreateOptions,
    /// The user's checkpoint bounds, and whether the session takes a checkpoint after
    /// every successful execution (the user's setting, or what the client asked).
    pub checkpoints: CheckpointPolicy,
    /// The user's pause policy (`--pause-after`, `--paused-ttl`).
    pub pause: super::pause::PausePolicy,
}

impl Registry {
    /// Makes the session `request` asks for and waits until its kernel is ready.
    pub async fn create_session(
        &self,
        request: CreateRequest,
    ) -> Result<Arc<Session>, SessionError> {
        let session = self
            .create(&request.user, request.max_sessions, request.options)
            .await?;
        self.set_checkpoint_policy(&session, request.checkpoints)?;
        session.set_pause_policy(request.pause);
        Ok(session)
    }
}
