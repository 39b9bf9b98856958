//! Sessions made on this node by a request that is not a new session's own (`POST` of a
//! collection, which the routing counts: `create.rs`): a fork, a checkpoint's fork, a
//! replay, an E2B context, the sessions MCP makes. In cluster mode the user's session quota
//! holds across the nodes for these too: her sessions on the other nodes are counted under
//! her creation lock, held by the [`Room`] until the new sessions are made.

use super::peer::{peer_arrays, Node, PeerClient};
use crate::api::auth::User;
use crate::api::AppState;
use crate::session::{Room, SessionError};

/// The room `user` has for new sessions made here: her whole quota without a cluster; in
/// cluster mode, what her sessions on every other node leave, counted and held under her
/// creation lock until the returned [`Room`] is dropped. A node that does not answer is
/// not counted (as for a new session's placement).
pub async fn room(state: &AppState, user: &User) -> Result<Room, SessionError> {
    let Some(cluster) = state.cluster.clone() else {
        return Ok(Room::alone(user.max_sessions));
    };
    let lock = cluster.lock_user(&user.name).await.map_err(|e| {
        tracing::error!(error = %e, "cluster: no creation lock");
        SessionError::ClusterUnavailable
    })?;
    let node = Node::new(cluster, PeerClient::new());
    let elsewhere: usize = peer_arrays(&node, user, "/v1/sessions")
        .await
        .iter()
        .map(Vec::len)
        .sum();
    Ok(Room::shared(user.max_sessions, elsewhere, Box::new(lock)))
}
