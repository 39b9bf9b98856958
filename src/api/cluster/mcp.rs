//! MCP requests in cluster mode: an MCP session's id names the node that made it, so a
//! request of a session made elsewhere goes there.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

use super::forward::forward;
use super::peer::Node;
use crate::api::AppState;

/// An MCP request. MCP sessions live in the memory of the node whose `initialize` made
/// them; in cluster mode their ids name that node (`<node>.<id>`, the node's id in
/// base64url, see [`crate::api::mcp`]), so a request of a session made elsewhere goes
/// there, with no lookup. A node that is not in the cluster any more: the session is gone
/// with it (`404`, as for any unknown MCP session: the client initializes again).
pub(super) async fn mcp(state: &AppState, cluster: &Node, req: Request, next: Next) -> Response {
    let node = req
        .headers()
        .get(MCP_SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(mcp_session_node);
    let Some(node) = node.filter(|n| n != cluster.node_id()) else {
        return next.run(req).await;
    };
    match cluster.peers().await.into_iter().find(|p| p.id == node) {
        Some(peer) => forward(state, cluster, None, &peer.url, false, req).await,
        None => (StatusCode::NOT_FOUND, "Not Found: Session not found").into_response(),
    }
}

/// The header that names an MCP session.
const MCP_SESSION_HEADER: &str = "mcp-session-id";

/// An MCP session id as this node hands it out in cluster mode: `<node>.<id>`.
pub fn mcp_session_id(node: &str, id: &str) -> String {
    format!("{}.{id}", URL_SAFE_NO_PAD.encode(node))
}

/// The node named in an MCP session id of cluster mode, if any.
pub fn mcp_session_node(wire: &str) -> Option<String> {
    let (node, _) = wire.split_once('.')?;
    String::from_utf8(URL_SAFE_NO_PAD.decode(node).ok()?).ok()
}

/// The id rmcp gave an MCP session, from the id on the wire: `<node>.<id>` of this node's,
/// else the id as it is (it then matches no session here).
pub fn mcp_local_id<'a>(node: &str, wire: &'a str) -> &'a str {
    match wire.split_once('.') {
        Some((n, id))
            if URL_SAFE_NO_PAD
                .decode(n)
                .is_ok_and(|n| n == node.as_bytes()) =>
        {
            id
        }
        _ => wire,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcp_session_ids_name_their_node() {
        let wire = mcp_session_id("kernel-broker-1", "3f0c");
        assert_eq!(mcp_session_node(&wire).as_deref(), Some("kernel-broker-1"));
        assert_eq!(mcp_local_id("kernel-broker-1", &wire), "3f0c");
        // Another node's id, or one of no node, is not this node's: it stays as it is.
        assert_eq!(mcp_local_id("kernel-broker-2", &wire), wire);
        assert_eq!(mcp_local_id("kernel-broker-1", "3f0c"), "3f0c");
        assert_eq!(mcp_session_node("3f0c"), None);
        assert_eq!(mcp_session_node("%%%.3f0c"), None);
    }
}
