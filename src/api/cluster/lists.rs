//! The lists of sessions, kernels and sandboxes, gathered from every node: this node's
//! answer and each peer's, as one JSON array.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::peer::{json_array, peer_arrays, Node};
use super::{refuse, Routed};

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
