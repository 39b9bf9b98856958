//! The HTTP client of node-to-node requests: a request sent to a peer carries the
//! cluster's key in [`NODE_HEADER`] (a request with it is served where it lands, never
//! forwarded again) and, for a request of this node's own, the caller's credentials; and
//! the JSON lists every peer answers to one (sessions, snapshots), which the gathered
//! lists, the quota counts and the search for a snapshot's node read.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use crate::api::auth::User;
use crate::cluster::Cluster;

/// The header of node-to-node requests: the cluster's key.
pub const NODE_HEADER: &str = "x-kernel-broker-node";

/// Why a peer gave no answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum PeerError {
    #[error("cluster: peer URL {base}: {source}")]
    Url {
        base: String,
        #[source]
        source: axum::http::uri::InvalidUri,
    },
    #[error("cluster: {0}")]
    Header(#[source] axum::http::header::InvalidHeaderValue),
    #[error("cluster: {base}: {source}")]
    Request {
        base: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("cluster: it stopped renewing its lease while the request waited")]
    Gone,
}

/// The client of node-to-node requests: a pool of connections to the peers.
#[derive(Clone)]
pub struct PeerClient(Client<HttpConnector, Body>);

impl PeerClient {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        connector.set_nodelay(true);
        Self(Client::builder(TokioExecutor::new()).build(connector))
    }
}

impl Default for PeerClient {
    fn default() -> Self {
        Self::new()
    }
}

/// This node of the cluster as its routing sees it: the cluster, and the client its
/// requests to the peers go through.
pub(super) struct Node {
    cluster: Arc<Cluster>,
    client: PeerClient,
}

impl std::ops::Deref for Node {
    type Target = Cluster;

    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

impl Node {
    pub(super) fn new(cluster: Arc<Cluster>, client: PeerClient) -> Self {
        Self { cluster, client }
    }

    /// Sends `req` to `base` (a peer's URL) as a node-to-node request and returns its
    /// answer, body streaming.
    pub(super) async fn send(
        &self,
        base: &str,
        mut req: Request<Body>,
    ) -> Result<Response<Body>, PeerError> {
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        let uri: Uri = format!("{}{path}", base.trim_end_matches('/'))
            .parse()
            .map_err(|source| PeerError::Url {
                base: base.to_string(),
                source,
            })?;
        if let Some(authority) = uri.authority() {
            let host = HeaderValue::from_str(authority.as_str()).map_err(PeerError::Header)?;
            req.headers_mut().insert(header::HOST, host);
        }
        *req.uri_mut() = uri;
        req.headers_mut().insert(
            NODE_HEADER,
            HeaderValue::from_str(self.cluster.key()).map_err(PeerError::Header)?,
        );
        let resp = self
            .client
            .0
            .request(req)
            .await
            .map_err(|source| PeerError::Request {
                base: base.to_string(),
                source,
            })?;
        Ok(resp.map(|b| Body::new(b.map_err(axum::Error::new))))
    }
}

/// The caller's credentials on a request of this node's own to a peer: the broker's token,
/// as the broker's routes take it and as E2B's API key.
pub(super) fn credentials(user: &User) -> Option<HeaderMap> {
    let mut h = HeaderMap::new();
    h.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {}", user.token)).ok()?,
    );
    h.insert("x-api-key", HeaderValue::from_str(&user.token).ok()?);
    Some(h)
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

pub(super) async fn json_array(body: Body) -> Option<Vec<serde_json::Value>> {
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
