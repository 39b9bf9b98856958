//! Cluster mode's routing (see [`crate::cluster`]): a request for a session another node
//! holds is forwarded to it, whole; the lists of sessions and kernels are gathered from
//! every node. Runs after authentication: an unauthenticated request is answered here (401),
//! never forwarded, so no client can make this node knock on its peers for nothing.
//!
//! Recordings are read from the shared database by any node, so `/events`, `/notebook` and
//! `/replay` (a new session, here) stay local.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use uuid::Uuid;

use super::auth::{token_in, Caller};
use super::error::ApiError;
use super::shapes::{iso, SessionJson, SessionStateJson};
use super::AppState;
use crate::cluster::{Cluster, NODE_HEADER};
use crate::session::SessionError;

/// What a request is, for routing.
#[derive(Debug, PartialEq)]
enum Target {
    /// Served here.
    Here,
    /// About one session.
    Session(Uuid),
    /// A list gathered from every node.
    List,
    /// A new session: placed on the node with the most headroom, within the user's quota
    /// counted across the cluster.
    Create,
}

fn target(method: &Method, path: &str) -> Target {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["v1", "sessions"] | ["api", "kernels"] if method == Method::GET => Target::List,
        ["v1", "sessions"] | ["api", "kernels"] if method == Method::POST => Target::Create,
        ["v1", "sessions", id, rest @ ..]
            if !matches!(rest.first(), Some(&("events" | "notebook" | "replay"))) =>
        {
            Uuid::parse_str(id).map_or(Target::Here, Target::Session)
        }
        ["api", "kernels", id, ..] => Uuid::parse_str(id).map_or(Target::Here, Target::Session),
        _ => Target::Here,
    }
}

/// The middleware.
pub async fn route(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(cluster) = state.cluster.clone() else {
        return next.run(req).await;
    };
    if let Some(v) = req.headers().get(NODE_HEADER) {
        if cluster.is_node(v.as_bytes()) {
            return next.run(req).await;
        }
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "bad_node_key",
            "this node-to-node request does not carry the cluster's key",
        )
        .into_response();
    }
    let Some(Caller(user)) = req.extensions().get::<Caller>().cloned() else {
        return next.run(req).await;
    };
    match target(req.method(), req.uri().path()) {
        Target::Here => next.run(req).await,
        Target::List => gather(&cluster, req, next).await,
        Target::Create => create(&state, &cluster, &user, req, next).await,
        Target::Session(id) => {
            if !matches!(
                state.registry.get(&user.name, id),
                Err(SessionError::NotFound(_))
            ) {
                return next.run(req).await;
            }
            let owner = match cluster.owner_cached(id) {
                Some(url) => Some(url),
                None => {
                    let auth = authorization(req.headers(), req.uri());
                    find_owner(&cluster, id, auth).await
                }
            };
            match owner {
                Some(url) => forward(&cluster, Some(id), &url, req).await,
                None => match lost_session(
                    &state,
                    &user.name,
                    id,
                    req.method() == Method::GET
                        && req.uri().path().trim_end_matches('/') == format!("/v1/sessions/{id}"),
                )
                .await
                {
                    Some(answer) => answer,
                    None => next.run(req).await,
                },
            }
        }
    }
}

/// The reason a session of a lost node is dead.
pub const NODE_LOST: &str =
    "node lost: the node that held this session stopped renewing its lease; its kernel is gone with it (the recording stays readable)";

/// A session of the caller's that no live node holds, whose node was lost: `GET` shows it
/// `dead` with the reason; anything else it is asked is answered `410 node_lost`.
async fn lost_session(state: &AppState, user: &str, id: Uuid, get_whole: bool) -> Option<Response> {
    let info = state.recording.as_ref()?.info(id).await.ok()??;
    if info.user != user || info.end_reason.as_deref() != Some("node_lost") {
        return None;
    }
    if get_whole {
        let at = info.last_event_at.unwrap_or(info.created_at);
        let json = SessionJson {
            id,
            user: info.user,
            kernel: info.kernel,
            state: SessionStateJson::Dead,
            created_at: iso(info.created_at),
            last_activity: iso(at),
            expires_at: None,
            execution_count: info.cells,
            connections: 0,
            memory_limit_bytes: 0,
            memory_used_bytes: None,
            dead_reason: Some(NODE_LOST.into()),
        };
        return Some(axum::Json(json).into_response());
    }
    Some(
        ApiError::new(
            StatusCode::GONE,
            "node_lost",
            format!("session {id}: {NODE_LOST}"),
        )
        .into_response(),
    )
}

/// The caller's credentials, as a header for a request of this node's own.
fn authorization(headers: &axum::http::HeaderMap, uri: &axum::http::Uri) -> Option<HeaderValue> {
    let token = token_in(headers, uri)?;
    HeaderValue::from_str(&format!("Bearer {token}")).ok()
}

/// Asks every peer whether it holds session `id` of the caller; the URL of the one that does.
async fn find_owner(cluster: &Cluster, id: Uuid, auth: Option<HeaderValue>) -> Option<String> {
    let auth = auth?;
    let peers = cluster.peers().await;
    let asks = peers.into_iter().map(|peer| {
        let auth = auth.clone();
        async move {
            let probe = axum::http::Request::get(format!("/v1/sessions/{id}"))
                .header(header::AUTHORIZATION, auth)
                .body(Body::empty())
                .ok()?;
            let resp = cluster.send(&peer.url, probe).await.ok()?;
            // 410: it held the session, which expired there; it says so best.
            matches!(resp.status(), StatusCode::OK | StatusCode::GONE).then_some(peer.url)
        }
    });
    let found = futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .next();
    if let Some(url) = &found {
        cluster.remember_owner(id, url.clone());
    }
    found
}

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
async fn forward(cluster: &Cluster, id: Option<Uuid>, url: &str, mut req: Request) -> Response {
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
    let mut resp = match cluster.send(url, req).await {
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
            return ApiError::new(
                StatusCode::BAD_GATEWAY,
                "node_unreachable",
                format!("{what} did not answer: {e}"),
            )
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
    resp
}

/// A list answered here and by every peer, as one JSON array. A peer that does not answer
/// is left out (and logged) rather than failing the list.
async fn gather(cluster: &Cluster, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let auth = authorization(&parts.headers, &parts.uri);
    let local = next.run(Request::from_parts(parts.clone(), body)).await;
    if local.status() != StatusCode::OK {
        return local;
    }
    let Some(auth) = auth else { return local };
    let (lparts, lbody) = local.into_parts();
    let Some(mut all) = json_array(lbody).await else {
        return ApiError::internal("gathering the list", "this node's list is not a JSON array")
            .into_response();
    };
    for list in peer_arrays(cluster, &auth, parts.uri.path()).await {
        all.extend(list);
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
async fn peer_arrays(
    cluster: &Cluster,
    auth: &HeaderValue,
    path: &str,
) -> Vec<Vec<serde_json::Value>> {
    let peers = cluster.peers().await;
    let asks = peers.iter().map(|peer| {
        let mut r = axum::http::Request::get(path)
            .body(Body::empty())
            .unwrap_or_default();
        r.headers_mut().insert(header::AUTHORIZATION, auth.clone());
        async move {
            match cluster.send(&peer.url, r).await {
                Ok(resp) if resp.status() == StatusCode::OK => json_array(resp.into_body()).await,
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

/// A new session: the user's sessions are counted on every node (one creation of a user at
/// a time in the cluster, under its lock), then it is made on the node with the most
/// headroom.
async fn create(
    state: &AppState,
    cluster: &Cluster,
    user: &crate::api::auth::User,
    req: Request,
    next: Next,
) -> Response {
    let lock = match cluster.lock_user(&user.name).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cluster: no creation lock");
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "cluster_unavailable",
                "the cluster's database does not answer; try again",
            )
            .into_response();
        }
    };
    let Some(auth) = authorization(req.headers(), req.uri()) else {
        return next.run(req).await;
    };
    let elsewhere: usize = peer_arrays(cluster, &auth, "/v1/sessions")
        .await
        .iter()
        .map(Vec::len)
        .sum();
    let here = state.registry.list(&user.name).len();
    if here + elsewhere >= user.max_sessions {
        return ApiError::from(SessionError::Quota(format!(
            "user {} already has {} sessions across the cluster (the limit); delete one first",
            user.name,
            here + elsewhere
        )))
        .into_response();
    }
    let resp = match cluster.place().await {
        Some(peer) => forward(cluster, None, &peer.url, req).await,
        None if cluster.is_draining() => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "node_draining",
            "this node is draining and no other node can take the session",
        )
        .into_response(),
        None => next.run(req).await,
    };
    drop(lock);
    resp
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_requests_are_routed() {
        let id = Uuid::new_v4();
        let cases = [
            (Method::GET, "/v1/sessions".to_string(), Target::List),
            (Method::POST, "/v1/sessions".into(), Target::Create),
            (Method::POST, "/api/kernels".into(), Target::Create),
            (Method::GET, "/api/kernels".into(), Target::List),
            (
                Method::GET,
                format!("/v1/sessions/{id}"),
                Target::Session(id),
            ),
            (
                Method::POST,
                format!("/v1/sessions/{id}/execute"),
                Target::Session(id),
            ),
            (
                Method::GET,
                format!("/v1/sessions/{id}/stream"),
                Target::Session(id),
            ),
            (
                Method::GET,
                format!("/v1/sessions/{id}/events"),
                Target::Here,
            ),
            (
                Method::GET,
                format!("/v1/sessions/{id}/notebook"),
                Target::Here,
            ),
            (
                Method::POST,
                format!("/v1/sessions/{id}/replay"),
                Target::Here,
            ),
            (
                Method::GET,
                format!("/api/kernels/{id}/channels"),
                Target::Session(id),
            ),
            (
                Method::DELETE,
                format!("/api/kernels/{id}"),
                Target::Session(id),
            ),
            (Method::GET, "/v1/sessions/not-a-uuid".into(), Target::Here),
            (Method::GET, "/healthz".into(), Target::Here),
            (Method::GET, "/v1/recordings".into(), Target::Here),
        ];
        for (m, p, want) in cases {
            assert_eq!(target(&m, &p), want, "{m} {p}");
        }
    }
}
