//! Snapshots in cluster mode: a snapshot is on the disk of the node that took it (the node
//! holding its session then), so what is asked of one (read it, delete it, start a session
//! from it) is served by that node, found by asking the peers; the lists gather every
//! node's (`lists.rs`).

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use chrono::{DateTime, Utc};

use super::forward::forward;
use super::peer::peer_lists;
use super::peer::Node;
use super::{refuse, Routed};
use crate::api::auth::User;
use crate::api::AppState;

/// The most a new session's body may be when the routing reads it for a snapshot.
const MAX_CREATE_BODY: usize = 1 << 20;

/// Which node has a snapshot of the caller's.
pub(super) enum Holder {
    Here,
    /// The peer at this URL.
    Peer(String),
    /// None (a request about it is answered here, which finds it missing).
    Nowhere,
}

/// Which node has the caller's snapshot `name_or_id`. A name is the newest snapshot of
/// that name on any node, as on one node.
pub(super) async fn holder(
    state: &AppState,
    cluster: &Node,
    user: &User,
    name_or_id: &str,
) -> Holder {
    let here = state.registry.find_snapshot(&user.name, name_or_id);
    let want = uuid::Uuid::parse_str(name_or_id).ok();
    if here.is_some() && want.is_some() {
        return Holder::Here;
    }
    let mut best: Option<(DateTime<Utc>, Option<String>)> = here.map(|s| (s.created_at, None));
    for (url, list) in peer_lists(cluster, user, "/v1/snapshots").await {
        for s in list {
            let matches = match want {
                Some(want) => {
                    s["snapshot_id"]
                        .as_str()
                        .and_then(|i| uuid::Uuid::parse_str(i).ok())
                        == Some(want)
                }
                None => s["name"].as_str() == Some(name_or_id),
            };
            if !matches {
                continue;
            }
            let Some(at) = s["created_at"].as_str().and_then(parse_time) else {
                continue;
            };
            if best.as_ref().is_none_or(|(b, _)| at > *b) {
                best = Some((at, Some(url.clone())));
            }
        }
    }
    match best {
        Some((_, Some(url))) => Holder::Peer(url),
        Some((_, None)) => Holder::Here,
        None => Holder::Nowhere,
    }
}

fn parse_time(t: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(t)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// A request about one snapshot of the caller's (`/v1/snapshots/{id}`, E2B's
/// `/e2b/templates/{name or id}`): served by the node that has it.
pub(super) async fn snapshot(
    state: &AppState,
    cluster: &Node,
    caller: &Routed,
    req: Request,
    next: Next,
) -> Response {
    let name_or_id = req
        .uri()
        .path()
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string();
    match holder(state, cluster, &caller.user, &name_or_id).await {
        Holder::Peer(url) => forward(state, cluster, None, &url, caller.e2b, req).await,
        Holder::Here | Holder::Nowhere => next.run(req).await,
    }
}

/// The snapshot a new session's request starts from, if any: `"snapshot"` of `POST
/// /v1/sessions`, `templateID` of E2B's (a template that may be one of the caller's
/// snapshots, by name or id). The body is read here (at most [`MAX_CREATE_BODY`]) and put
/// back.
pub(super) async fn snapshot_of(
    caller: &Routed,
    req: Request,
) -> Result<(Option<String>, Request), Response> {
    let field = match req.uri().path().trim_end_matches('/') {
        "/v1/sessions" => "snapshot",
        "/e2b/sandboxes" | "/e2b/v2/sandboxes" => "templateID",
        _ => return Ok((None, req)),
    };
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_CREATE_BODY).await else {
        return Err(refuse(
            caller.e2b,
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("a new session's request body is at most {MAX_CREATE_BODY} bytes"),
        ));
    };
    let named = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v[field].as_str().map(str::to_string));
    Ok((named, Request::from_parts(parts, Body::from(bytes))))
}
