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

use std::sync::Arc;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use futures::StreamExt;

use super::auth::{peer, Caller, User};
use super::e2b::{sandbox_headers, token_matches, E2bError};
use super::error::ApiError;
use super::shapes::{iso, SessionJson, SessionStateJson};
use super::AppState;
use crate::cluster::{Cluster, Directory, NODE_HEADER};
use crate::session::SessionError;

/// What a request is, for routing.
#[derive(Debug, PartialEq)]
enum Target {
    /// Served here.
    Here,
    /// About one session.
    Session(Uuid),
    /// An E2B in-sandbox request (code interpreter, envd): the sandbox is named by the
    /// `E2b-Sandbox-Id` header, the caller by the sandbox's access token.
    Sandbox,
    /// An MCP request; with an `Mcp-Session-Id`, served by the node that made that session.
    Mcp,
    /// A list gathered from every node.
    List,
    /// A new session: placed on the node with the most headroom, within the user's quota
    /// counted across the cluster.
    Create,
}

fn target(method: &Method, path: &str) -> Target {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let uuid = |id: &str| Uuid::parse_str(id).map_or(Target::Here, Target::Session);
    match parts.as_slice() {
        ["v1", "sessions"]
        | ["api", "kernels"]
        | ["e2b", "sandboxes"]
        | ["e2b", "v2", "sandboxes"]
            if method == Method::GET =>
        {
            Target::List
        }
        ["v1", "sessions"]
        | ["api", "kernels"]
        | ["e2b", "sandboxes"]
        | ["e2b", "v2", "sandboxes"]
            if method == Method::POST =>
        {
            Target::Create
        }
        ["v1", "sessions", id, rest @ ..]
            if !matches!(rest.first(), Some(&("events" | "notebook" | "replay"))) =>
        {
            uuid(id)
        }
        ["api", "kernels", id, ..]
        | ["e2b", "sandboxes", id, ..]
        | ["e2b", "v2", "sandboxes", id, ..] => uuid(id),
        ["e2b", "sandbox", ..] => Target::Sandbox,
        ["mcp"] => Target::Mcp,
        _ => Target::Here,
    }
}

/// The caller, as the cluster routes it: who it is, and whether its request speaks E2B
/// (whose errors have a shape of their own).
struct Routed {
    user: Arc<User>,
    e2b: bool,
}

/// Who is calling: the broker's token (the `auth` middleware made it a [`Caller`]); on the
/// E2B control plane the API key; on E2B's in-sandbox routes the sandbox's access token
/// (with the sandbox it names). `None`: served here, which answers the failure (and counts
/// it against the client's address) as without a cluster.
fn routed(state: &AppState, req: &Request, target: &Target) -> Option<(Routed, Option<Uuid>)> {
    if let Some(Caller(user)) = req.extensions().get::<Caller>() {
        let e2b = req.uri().path().starts_with("/e2b/");
        return Some((
            Routed {
                user: user.clone(),
                e2b,
            },
            None,
        ));
    }
    if !req.uri().path().starts_with("/e2b/") {
        return None;
    }
    if let Some(ip) = peer(req.extensions()) {
        if state
            .auth_failures
            .check(ip, std::time::Instant::now())
            .is_err()
        {
            return None;
        }
    }
    if *target == Target::Sandbox {
        let (id, user) = sandbox_owner(state, req.headers())?;
        return Some((Routed { user, e2b: true }, Some(id)));
    }
    let key = req.headers().get("x-api-key")?.to_str().ok()?.trim();
    let user = state.authenticate(key)?;
    Some((Routed { user, e2b: true }, None))
}

/// The middleware.
pub async fn route(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(cluster) = state.cluster.clone() else {
        return next.run(req).await;
    };
    let target = target(req.method(), req.uri().path());
    let from_node = match req.headers().get(NODE_HEADER) {
        Some(v) if cluster.is_node(v.as_bytes()) => true,
        Some(_) => {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                "bad_node_key",
                "this node-to-node request does not carry the cluster's key",
            )
            .into_response()
        }
        None => false,
    };
    if target != Target::Here && cluster.is_isolated() {
        return refuse(
            req.uri().path().starts_with("/e2b/"),
            StatusCode::SERVICE_UNAVAILABLE,
            "node_isolated",
            "this node cannot reach the cluster's database: it serves no session until it can (try another node)",
        );
    }
    if from_node
        || target == Target::Here
        || (target == Target::Sandbox && sandbox_is_here(&state, &req))
    {
        return next.run(req).await;
    }
    let Some((caller, sandbox)) = routed(&state, &req, &target) else {
        return next.run(req).await;
    };
    match target {
        Target::Here => next.run(req).await,
        Target::List => gather(&cluster, &caller, req, next).await,
        Target::Create => create(&state, &cluster, &caller, req, next).await,
        Target::Mcp => mcp(&state, &cluster, req, next).await,
        Target::Sandbox => match sandbox {
            Some(id) => session(&state, &cluster, &caller, id, req, next).await,
            None => next.run(req).await,
        },
        Target::Session(id) => session(&state, &cluster, &caller, id, req, next).await,
    }
}

/// A request about session `id` of the caller's: served here if it is here, else by the
/// node that holds it; a session of a lost node answers so.
async fn session(
    state: &AppState,
    cluster: &Cluster,
    caller: &Routed,
    id: Uuid,
    req: Request,
    next: Next,
) -> Response {
    if !matches!(
        state.registry.get(&caller.user.name, id),
        Err(SessionError::NotFound(_))
    ) {
        return next.run(req).await;
    }
    let cached = match cluster.owner_cached(id) {
        Some(url) if cluster.is_live(&url).await => Some(url),
        Some(_) => {
            cluster.forget_owner(id);
            None
        }
        None => None,
    };
    // The session directory first; the peers themselves for a session made since its
    // node last wrote the directory (or when the database does not answer).
    let listed = match cached {
        Some(url) => Directory::At(url),
        None => cluster
            .directory(id, &caller.user.name)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cluster: the session directory did not answer");
                Directory::Unknown
            }),
    };
    let owner = match &listed {
        Directory::At(url) => {
            cluster.remember_owner(id, url.clone());
            Some(url.clone())
        }
        Directory::Lost { .. } => None,
        Directory::Unknown => find_owner(cluster, id, &caller.user).await,
    };
    if let Some(url) = owner {
        return forward(state, cluster, Some(id), &url, caller.e2b, req).await;
    }
    if caller.e2b {
        // E2B has no dead sandboxes: one that is gone is not found (answered here).
        return next.run(req).await;
    }
    let get_whole = req.method() == Method::GET
        && req.uri().path().trim_end_matches('/') == format!("/v1/sessions/{id}");
    if let Some(answer) = lost_session(state, &caller.user.name, id, get_whole).await {
        return answer;
    }
    match listed {
        Directory::Lost {
            kernel,
            created_at,
            lost_at,
        } => lost_answer(
            id,
            &caller.user.name,
            kernel,
            micros(created_at),
            micros(lost_at),
            0,
            get_whole,
        ),
        _ => next.run(req).await,
    }
}

fn micros(t: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_micros(t).unwrap_or_default()
}

/// Whether the sandbox an E2B in-sandbox request names is held here (its handler then
/// checks the token).
fn sandbox_is_here(state: &AppState, req: &Request) -> bool {
    let id = sandbox_headers(req.headers())
        .0
        .and_then(|v| Uuid::parse_str(v).ok());
    id.is_some_and(|id| state.registry.all().iter().any(|s| s.id == id))
}

/// The sandbox an E2B in-sandbox request names and the user whose access token it carries:
/// the token is an HMAC of the sandbox id keyed by the owner's broker token, so it is
/// checked against each user's (never forwarded unchecked).
fn sandbox_owner(state: &AppState, headers: &axum::http::HeaderMap) -> Option<(Uuid, Arc<User>)> {
    let (id, token) = sandbox_headers(headers);
    let id = Uuid::parse_str(id?).ok()?;
    let (token, kind) = token?;
    let user = state
        .users
        .find(|u| token_matches(&u.token, id, kind, token))?;
    Some((id, user))
}

/// An MCP request. MCP sessions live in the memory of the node whose `initialize` made
/// them; in cluster mode their ids name that node (`<node>.<id>`, the node's id in
/// base64url, see [`crate::api::mcp`]), so a request of a session made elsewhere goes
/// there, with no lookup. A node that is not in the cluster any more: the session is gone
/// with it (`404`, as for any unknown MCP session: the client initializes again).
async fn mcp(state: &AppState, cluster: &Cluster, req: Request, next: Next) -> Response {
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

/// The reason a session of a lost node is dead.
pub const NODE_LOST: &str =
    "node lost: the node that held this session stopped renewing its lease; its kernel is gone with it (the recording stays readable)";

/// A session of the caller's that no live node holds, whose node was lost, as its recording
/// tells: see [`lost_answer`].
async fn lost_session(state: &AppState, user: &str, id: Uuid, get_whole: bool) -> Option<Response> {
    let info = state.recording.as_ref()?.info(id).await.ok()??;
    if info.user != user || info.end_reason.as_deref() != Some("node_lost") {
        return None;
    }
    let at = info.last_event_at.unwrap_or(info.created_at);
    Some(lost_answer(
        id,
        &info.user,
        info.kernel,
        info.created_at,
        at,
        info.cells,
        get_whole,
    ))
}

/// The answer about a session of a lost node: `GET` shows it `dead` with the reason;
/// anything else it is asked is answered `410 node_lost`.
fn lost_answer(
    id: Uuid,
    user: &str,
    kernel: String,
    created_at: chrono::DateTime<chrono::Utc>,
    last_activity: chrono::DateTime<chrono::Utc>,
    cells: u64,
    get_whole: bool,
) -> Response {
    if get_whole {
        let json = SessionJson {
            id,
            user: user.to_string(),
            kernel,
            state: SessionStateJson::Dead,
            created_at: iso(created_at),
            last_activity: iso(last_activity),
            expires_at: None,
            execution_count: cells,
            connections: 0,
            memory_limit_bytes: 0,
            memory_used_bytes: None,
            dead_reason: Some(NODE_LOST.into()),
        };
        return axum::Json(json).into_response();
    }
    ApiError::new(
        StatusCode::GONE,
        "node_lost",
        format!("session {id}: {NODE_LOST}"),
    )
    .into_response()
}

/// The caller's credentials on a request of this node's own to a peer: the broker's token,
/// as the broker's routes take it and as E2B's API key.
fn credentials(user: &User) -> Option<axum::http::HeaderMap> {
    let mut h = axum::http::HeaderMap::new();
    h.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {}", user.token)).ok()?,
    );
    h.insert("x-api-key", HeaderValue::from_str(&user.token).ok()?);
    Some(h)
}

/// Asks every peer whether it holds session `id` of the caller; the URL of the one that does.
async fn find_owner(cluster: &Cluster, id: Uuid, user: &User) -> Option<String> {
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
    cluster: &Cluster,
    id: Uuid,
    creds: &axum::http::HeaderMap,
    peers: &[crate::cluster::Peer],
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
async fn forward(
    state: &AppState,
    cluster: &Cluster,
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
        () = cluster.until_gone(url) => Err(crate::cluster::ClusterError::Other(
            "it stopped renewing its lease while the request waited".into(),
        )),
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

/// A list answered here and by every peer, as one JSON array. A peer that does not answer
/// is left out (and logged) rather than failing the list.
async fn gather(cluster: &Cluster, caller: &Routed, req: Request, next: Next) -> Response {
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
    let mut resp = Response::from_parts(
        lparts,
        Body::from(serde_json::Value::Array(all).to_string()),
    );
    resp.headers_mut().remove(header::CONTENT_LENGTH);
    resp
}

/// `GET path` of every peer with the caller's credentials: the JSON arrays they answer. A
/// peer that does not answer is left out (and logged).
async fn peer_arrays(cluster: &Cluster, user: &User, path: &str) -> Vec<Vec<serde_json::Value>> {
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

/// An error answered by the cluster layer: in E2B's shape on E2B's routes, else the
/// broker's.
fn refuse(
    e2b: bool,
    status: StatusCode,
    code: &'static str,
    message: impl Into<String>,
) -> Response {
    if e2b {
        return E2bError::new(status, message).into_response();
    }
    ApiError::new(status, code, message).into_response()
}

/// A new session: the user's sessions are counted on every node (one creation of a user at
/// a time in the cluster, under its lock), then it is made on the node with the most
/// headroom.
async fn create(
    state: &AppState,
    cluster: &Cluster,
    caller: &Routed,
    req: Request,
    next: Next,
) -> Response {
    let user = &caller.user;
    let lock = match cluster.lock_user(&user.name).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cluster: no creation lock");
            return refuse(
                caller.e2b,
                StatusCode::SERVICE_UNAVAILABLE,
                "cluster_unavailable",
                "the cluster's database does not answer; try again",
            );
        }
    };
    let elsewhere: usize = peer_arrays(cluster, user, "/v1/sessions")
        .await
        .iter()
        .map(Vec::len)
        .sum();
    let here = state.registry.list(&user.name).len();
    if here + elsewhere >= user.max_sessions {
        let e = SessionError::TooManySessionsInCluster {
            user: user.name.clone(),
            live: here + elsewhere,
        };
        return if caller.e2b {
            E2bError::from(e).into_response()
        } else {
            ApiError::from(e).into_response()
        };
    }
    let resp = match cluster.place(user.limits.session_memory_bytes).await {
        Some(peer) => forward(state, cluster, None, &peer.url, caller.e2b, req).await,
        None if cluster.is_draining() => refuse(
            caller.e2b,
            StatusCode::SERVICE_UNAVAILABLE,
            "node_draining",
            "this node is draining and no other node can take the session",
        ),
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
            (Method::GET, "/e2b/sandboxes".into(), Target::List),
            (Method::GET, "/e2b/v2/sandboxes".into(), Target::List),
            (Method::POST, "/e2b/v2/sandboxes".into(), Target::Create),
            (
                Method::POST,
                format!("/e2b/sandboxes/{id}/timeout"),
                Target::Session(id),
            ),
            (
                Method::POST,
                format!("/e2b/v2/sandboxes/{id}/connect"),
                Target::Session(id),
            ),
            (Method::POST, "/e2b/sandbox/execute".into(), Target::Sandbox),
            (
                Method::POST,
                "/e2b/sandbox/process.Process/Start".into(),
                Target::Sandbox,
            ),
            (Method::POST, "/mcp".into(), Target::Mcp),
            (Method::DELETE, "/mcp".into(), Target::Mcp),
        ];
        for (m, p, want) in cases {
            assert_eq!(target(&m, &p), want, "{m} {p}");
        }
    }

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
