//! The HTTP client of node-to-node requests: a request sent to a peer carries the
//! cluster's key in [`NODE_HEADER`] (a request with it is served where it lands, never
//! forwarded again) and, for a request of this node's own, the caller's credentials.

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, Request, Response, Uri};
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

/// The client every request to a peer goes through. One per process (a broker is one per
/// process): it is only a pool of connections to the peers, made on first use.
fn client() -> &'static Client<HttpConnector, Body> {
    static CLIENT: OnceLock<Client<HttpConnector, Body>> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        connector.set_nodelay(true);
        Client::builder(TokioExecutor::new()).build(connector)
    })
}

/// Sends `req` to `base` (a peer's URL) as a node-to-node request of `cluster` and returns
/// its answer, body streaming.
pub(super) async fn send(
    cluster: &Cluster,
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
        HeaderValue::from_str(cluster.key()).map_err(PeerError::Header)?,
    );
    let resp = client()
        .request(req)
        .await
        .map_err(|source| PeerError::Request {
            base: base.to_string(),
            source,
        })?;
    Ok(resp.map(|b| Body::new(b.map_err(axum::Error::new))))
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
