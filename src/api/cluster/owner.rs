//! Which peer holds a session the directory does not list yet (made since its node last
//! wrote the directory): every peer is asked at once.

use axum::body::Body;
use axum::http::StatusCode;
use futures::StreamExt;
use uuid::Uuid;

use super::peer::credentials;
use super::peer::Node;
use crate::api::auth::User;
use crate::cluster::Peer;

/// Asks every peer whether it holds session `id` of the caller; the URL of the one that does.
pub(super) async fn find_owner(cluster: &Node, id: Uuid, user: &User) -> Option<String> {
    let creds = credentials(user)?;
    let mut peers = cluster.peers().await;
    loop {
        if let Some(url) = ask_peers(cluster, id, &creds, &peers).await {
            cluster.remember_owner(id, url.clone());
            return Some(url);
        }
        // The list of peers may be a moment old: a node that joined since is asked too.
        let fresh = cluster.fresh_peers().await;
        if fresh.iter().all(|p| peers.iter().any(|q| q.url == p.url)) {
            return None;
        }
        peers = fresh
            .into_iter()
            .filter(|p| !peers.iter().any(|q| q.url == p.url))
            .collect();
    }
}

/// How long a peer has to say whether it holds a session.
const PROBE_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// The first of `peers` to say it holds session `id` (each asked at once; one that does
/// not answer within [`PROBE_TIME`] does not hold up the answer longer).
async fn ask_peers(
    cluster: &Node,
    id: Uuid,
    creds: &axum::http::HeaderMap,
    peers: &[Peer],
) -> Option<String> {
    let mut asks: futures::stream::FuturesUnordered<_> = peers
        .iter()
        .map(|peer| async move {
            let mut probe = axum::http::Request::get(format!("/v1/sessions/{id}"))
                .body(Body::empty())
                .ok()?;
            *probe.headers_mut() = creds.clone();
            let resp = tokio::time::timeout(PROBE_TIME, cluster.send(&peer.url, probe))
                .await
                .ok()?
                .ok()?;
            // 410: it held the session, which expired there; it says so best.
            matches!(resp.status(), StatusCode::OK | StatusCode::GONE).then(|| peer.url.clone())
        })
        .collect();
    while let Some(answer) = asks.next().await {
        if answer.is_some() {
            return answer;
        }
    }
    None
}
