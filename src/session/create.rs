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

/// The room a user has on this broker for new sessions, while it is held: her session
/// quota, less what other nodes of a cluster hold of hers, counted under a lock that this
/// holds until the new sessions are made (so two nodes cannot both fill the last place).
/// Without a cluster, the whole quota and no lock.
pub struct Room {
    max_sessions: usize,
    /// The user's sessions on the other nodes.
    elsewhere: usize,
    _held: Option<Box<dyn Send + Sync>>,
}

impl Room {
    /// The whole quota, for a broker alone.
    pub fn alone(max_sessions: usize) -> Self {
        Self {
            max_sessions,
            elsewhere: 0,
            _held: None,
        }
    }

    /// `max_sessions` less the `elsewhere` sessions other nodes hold, while `held` is.
    pub fn shared(max_sessions: usize, elsewhere: usize, held: Box<dyn Send + Sync>) -> Self {
        Self {
            max_sessions: max_sessions.saturating_sub(elsewhere),
            elsewhere,
            _held: Some(held),
        }
    }

    /// The quota the local check applies.
    pub fn max_sessions(&self) -> usize {
        self.max_sessions
    }

    /// The user's sessions on the other nodes, as counted.
    pub fn elsewhere(&self) -> usize {
        self.elsewhere
    }

    /// `request` held to this room.
    pub fn request(&self, mut request: CreateRequest) -> CreateRequest {
        request.max_sessions = request.max_sessions.min(self.max_sessions);
        request
    }

    /// A refusal of the local check, said in the cluster's terms when other nodes hold some
    /// of the user's sessions.
    pub fn explain(&self, e: SessionError) -> SessionError {
        match e {
            SessionError::TooManySessions { user, live } if self.elsewhere > 0 => {
                SessionError::TooManySessionsInCluster {
                    user,
                    live: live + self.elsewhere,
                }
            }
            e => e,
        }
    }
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
        if self.config().copy_refusal(&session.kernel_name).is_some() {
            session.never_pauses();
        }
        Ok(session)
    }
}
