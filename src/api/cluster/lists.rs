//! The lists of sessions, kernels and sandboxes, gathered from every node: this node's
//! answer and each peer's, as one JSON array.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;

use super::peer::credentials;
use super::peer::Node;
use super::{refuse, Routed};
use crate::api::auth::User;

/// A list answered here and by every peer, as one JSON array. A peer that does not answer
/// is left out (and logged) rather than failing the list.
pub(super) async fn gather(cluster: &Node, caller: &Routed, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let local = next.run(Request::from_parts(parts.clone(), body)).await;
    if local.status() != StatusCode::OK {
        return local;
    }
    let (lparts, lbody) = local.into_parts();
    let Some(mut all) = json_array(lbody).await else {
        return refuse(
            caller.e2b,
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "gathering the list: this node's list is not a JSON array",
        );
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    for list in peer_arrays(cluster, &caller.user, path).await {
        all.extend(list);
    }
    if parts.uri.path() == "/v1/snapshots" {
        // Oldest first, as each node lists its own (the times are all RFC 3339 in UTC).
        all.sort_by(|a, b| a["created_at"].as_str().cmp(&b["created_at"].as_str()));
    }
    let mut resp = Response::from_parts(
        lparts,
        Body::from(serde_json::Value::Array(all).to_string()),
    );
    resp.headers_mut().remove(header::CONTENT_LENGTH);
    resp
}

/// `GET path` of every peer with the caller's credentials: the JSON arrays they answer. A
/// peer that does not answer is left out (and logged).
pub(super) async fn peer_arrays(
    cluster: &Node,
    user: &User,
    path: &str,
) -> Vec<Vec<serde_json::Value>> {
    peer_lists(cluster, user, path)
        .await
        .into_iter()
        .map(|(_, list)| list)
        .collect()
}

/// `GET path` of every peer with the caller's credentials: each peer's URL with the JSON
/// array it answers. A peer that does not answer is left out (and logged).
pub(super) async fn peer_lists(
    cluster: &Node,
    user: &User,
    path: &str,
) -> Vec<(String, Vec<serde_json::Value>)> {
    let Some(creds) = credentials(user) else {
        return Vec::new();
    };
    let peers = cluster.peers().await;
    let asks = peers.iter().map(|peer| {
        let mut r = axum::http::Request::get(path)
            .body(Body::empty())
            .unwrap_or_default();
        *r.headers_mut() = creds.clone();
        async move {
            match cluster.send(&peer.url, r).await {
                Ok(resp) if resp.status() == StatusCode::OK => json_array(resp.into_body())
                    .await
                    .map(|list| (peer.url.clone(), list)),
                Ok(resp) => {
                    tracing::warn!(node = %peer.id, status = %resp.status(), "cluster: a node's list failed");
                    None
                }
                Err(e) => {
                    tracing::warn!(node = %peer.id, error = %e, "cluster: a node's list failed");
                    None
                }
            }
        }
    });
    futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The most a node's list may hold.
const MAX_LIST_BYTES: usize = 64 << 20;

async fn json_array(body: Body) -> Option<Vec<serde_json::Value>> {
    let bytes = http_body_util::Limited::new(body, MAX_LIST_BYTES)
        .collect()
        .await
        .ok()?
        .to_bytes();
    match serde_json::from_slice(&bytes).ok()? {
        serde_json::Value::Array(v) => Some(v),
        _ => None,
    }
}
