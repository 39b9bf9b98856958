//! A request forwarded, whole, to the node that serves it, and its answer back: bodies
//! stream, a WebSocket is spliced through, an event stream ends when this node stops.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use uuid::Uuid;

use super::peer::Node;
use super::peer::PeerError;
use crate::api::e2b::E2bError;
use crate::api::error::ApiError;
use crate::api::AppState;

/// Hop-by-hop headers: of one connection, not forwarded (but kept for a WebSocket's upgrade).
const HOP_BY_HOP: [&str; 6] = [
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Forwards `req` to the node at `url`, and its answer back (a WebSocket spliced through).
pub(super) async fn forward(
    state: &AppState,
    cluster: &Node,
    id: Option<Uuid>,
    url: &str,
    e2b: bool,
    mut req: Request,
) -> Response {
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"));
    let client_side = upgrade.then(|| hyper::upgrade::on(&mut req));
    for h in HOP_BY_HOP {
        req.headers_mut().remove(h);
    }
    if !upgrade {
        req.headers_mut().remove(header::CONNECTION);
    }
    // A node that stalls (paused, cut off) would hold the request for as long as it
    // stalls: once it is no longer a live node, the request is given up.
    let answered = tokio::select! {
        r = cluster.send(url, req) => r,
        () = cluster.until_gone(url) => Err(PeerError::Gone),
    };
    let mut resp = match answered {
        Ok(r) => r,
        Err(e) => {
            let what = match id {
                Some(id) => {
                    cluster.forget_owner(id);
                    format!("the node that holds session {id}")
                }
                None => "the node chosen for the new session".into(),
            };
            tracing::warn!(error = %e, "cluster: {what} did not answer");
            let message = format!("{what} did not answer: {e}");
            if e2b {
                return E2bError::new(StatusCode::BAD_GATEWAY, message).into_response();
            }
            return ApiError::new(StatusCode::BAD_GATEWAY, "node_unreachable", message)
                .into_response();
        }
    };
    if let (Some(id), StatusCode::NOT_FOUND) = (id, resp.status()) {
        // Gone from there (deleted, or the node restarted): ask again next time.
        cluster.forget_owner(id);
    }
    if let (Some(client_side), StatusCode::SWITCHING_PROTOCOLS) = (client_side, resp.status()) {
        let node_side = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            match tokio::try_join!(client_side, node_side) {
                Ok((a, b)) => {
                    let mut a = hyper_util::rt::TokioIo::new(a);
                    let mut b = hyper_util::rt::TokioIo::new(b);
                    let _ = tokio::io::copy_bidirectional(&mut a, &mut b).await;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cluster: a forwarded WebSocket did not open")
                }
            }
        });
    }
    let event_stream = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if event_stream {
        // An SSE stream (MCP's) may stay open for as long as its session: it ends when this
        // node stops, so the listener's drain does not wait for it (as on the node that
        // holds it).
        let stopping = state.stopping.clone();
        let (parts, body) = resp.into_parts();
        let stream = body
            .into_data_stream()
            .take_until(async move { stopping.cancelled().await });
        return Response::from_parts(parts, Body::from_stream(stream));
    }
    resp
}
