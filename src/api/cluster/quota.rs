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
    match state.cluster.clone() {
        None => Ok(Room::alone(user.max_sessions)),
        Some(cluster) => room_on(&Node::new(cluster, PeerClient::new()), user).await,
    }
}

/// The room `user` has on node `cluster` (a new session's placement counts with it too).
pub(super) async fn room_on(cluster: &Node, user: &User) -> Result<Room, SessionError> {
    let lock = cluster.lock_user(&user.name).await.map_err(|e| {
        tracing::error!(error = %e, "cluster: no creation lock");
        SessionError::ClusterUnavailable
    })?;
    let elsewhere: usize = peer_arrays(cluster, user, "/v1/sessions")
        .await
        .iter()
        .map(Vec::len)
        .sum();
    Ok(Room::shared(user.max_sessions, elsewhere, Box::new(lock)))
}
