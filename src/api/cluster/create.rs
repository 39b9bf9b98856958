//! A new session in cluster mode: the user's quota counted across the nodes (under the
//! user's creation lock), then placed on the node with the most headroom, or made on the
//! node that has the snapshot it starts from.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::forward::forward;
use super::peer::Node;
use super::snapshots::Holder;
use super::{refuse, Routed};
use crate::api::e2b::E2bError;
use crate::api::error::ApiError;
use crate::api::AppState;
use crate::session::SessionError;

/// A new session: the user's sessions are counted on every node (one creation of a user at
/// a time in the cluster, under its lock), then it is made on the node with the most
/// headroom; one that starts from a snapshot of the user's, on the node that has it.
pub(super) async fn create(
    state: &AppState,
    cluster: &Node,
    caller: &Routed,
    req: Request,
    next: Next,
) -> Response {
    let user = &caller.user;
    let Ok(room) = super::quota::room_on(cluster, user).await else {
        return refuse(
            caller.e2b,
            StatusCode::SERVICE_UNAVAILABLE,
            "cluster_unavailable",
            "the cluster's database does not answer; try again",
        );
    };
    let here = state.registry.list(&user.name).len();
    if here >= room.max_sessions() {
        let e = SessionError::TooManySessionsInCluster {
            user: user.name.clone(),
            live: here + room.elsewhere(),
        };
        return if caller.e2b {
            E2bError::from(e).into_response()
        } else {
            ApiError::from(e).into_response()
        };
    }
    let (snapshot, req) = match super::snapshots::snapshot_of(caller, req).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    let holder = match snapshot {
        Some(name_or_id) => super::snapshots::holder(state, cluster, user, &name_or_id).await,
        None => Holder::Nowhere,
    };
    let resp = match holder {
        Holder::Peer(url) => forward(state, cluster, None, &url, caller.e2b, req).await,
        Holder::Here => next.run(req).await,
        Holder::Nowhere => match cluster.place(user.limits.session_memory_bytes).await {
            Some(peer) => forward(state, cluster, None, &peer.url, caller.e2b, req).await,
            None if cluster.is_draining() => refuse(
                caller.e2b,
                StatusCode::SERVICE_UNAVAILABLE,
                "node_draining",
                "this node is draining and no other node can take the session",
            ),
            None => next.run(req).await,
        },
    };
    drop(room);
    resp
}
