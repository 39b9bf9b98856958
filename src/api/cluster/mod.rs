//! Cluster mode's routing (see [`crate::cluster`]): a request for a session another node
//! holds is forwarded to it, whole; the lists of sessions and kernels are gathered from
//! every node. Runs after authentication: an unauthenticated request is answered here (401),
//! never forwarded, so no client can make this node knock on its peers for nothing.
//!
//! Recordings are read from the shared database by any node, so `/events`, `/notebook` and
//! `/replay` (a new session, here) stay local.

pub mod carry;
mod create;
mod forward;
mod lists;
mod lost;
mod mcp;
mod owner;
mod peer;
pub(super) mod quota;
mod session;
mod snapshots;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

use super::auth::{peer as client_address, Caller, User};
use super::e2b::E2bError;
use super::error::ApiError;
use super::AppState;

pub use mcp::{mcp_local_id, mcp_session_id};
pub use peer::NODE_HEADER;
use peer::{Node, PeerClient};

/// What a request is, for routing.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// A new session: placed on the node with the most headroom (or on the node that has
    /// the snapshot it starts from), within the user's quota counted across the cluster.
    Create,
    /// About one snapshot: served by the node that has it.
    Snapshot,
}

fn target(method: &Method, path: &str) -> Target {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let uuid = |id: &str| Uuid::parse_str(id).map_or(Target::Here, Target::Session);
    // The collections of sessions, in each protocol: listed with GET, added to with POST.
    let collection = matches!(
        parts.as_slice(),
        ["v1", "sessions"] | ["api", "kernels"] | ["e2b", "sandboxes"] | ["e2b", "v2", "sandboxes"]
    );
    match parts.as_slice() {
        _ if collection && method == Method::GET => Target::List,
        _ if collection && method == Method::POST => Target::Create,
        ["v1", "snapshots"] | ["e2b", "snapshots"] if method == Method::GET => Target::List,
        ["v1", "snapshots", _] => Target::Snapshot,
        ["e2b", "templates", _] if method == Method::DELETE => Target::Snapshot,
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
pub(super) struct Routed {
    pub user: Arc<User>,
    pub e2b: bool,
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
    if let Some(ip) = client_address(req.extensions()) {
        if state
            .auth_failures
            .check(ip, std::time::Instant::now())
            .is_err()
        {
            return None;
        }
    }
    if *target == Target::Sandbox {
        let (id, user) = session::sandbox_owner(state, req.headers())?;
        return Some((Routed { user, e2b: true }, Some(id)));
    }
    let key = req.headers().get("x-api-key")?.to_str().ok()?.trim();
    let user = state.authenticate(key)?;
    Some((Routed { user, e2b: true }, None))
}

/// The middleware's state: the app's, and the client of this node's requests to its peers.
#[derive(Clone)]
pub struct Routing {
    state: AppState,
    client: PeerClient,
}

impl Routing {
    pub fn new(state: AppState) -> Self {
        Self {
            state,
            client: PeerClient::new(),
        }
    }
}

/// The middleware.
pub async fn route(State(routing): State<Routing>, req: Request, next: Next) -> Response {
    let Routing { state, client } = routing;
    let Some(cluster) = state.cluster.clone() else {
        return next.run(req).await;
    };
    let cluster = Node::new(cluster, client);
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
        || (target == Target::Sandbox && session::sandbox_is_here(&state, &req))
    {
        return next.run(req).await;
    }
    let Some((caller, sandbox)) = routed(&state, &req, &target) else {
        return next.run(req).await;
    };
    match target {
        Target::Here => next.run(req).await,
        Target::List => lists::gather(&cluster, &caller, req, next).await,
        Target::Create => create::create(&state, &cluster, &caller, req, next).await,
        Target::Snapshot => snapshots::snapshot(&state, &cluster, &caller, req, next).await,
        Target::Mcp => mcp::mcp(&state, &cluster, req, next).await,
        Target::Sandbox => match sandbox {
            Some(id) => session::session(&state, &cluster, &caller, id, req, next).await,
            None => next.run(req).await,
        },
        Target::Session(id) => session::session(&state, &cluster, &caller, id, req, next).await,
    }
}

/// An error answered by the cluster layer: in E2B's shape on E2B's routes, else the
/// broker's.
pub(super) fn refuse(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_requests_are_routed() {
        let id = Uuid::new_v4();
        let session = Target::Session(id);
        // `ID` stands for the session's id.
        let cases = [
            (Method::GET, "/v1/sessions", Target::List),
            (Method::POST, "/v1/sessions", Target::Create),
            (Method::POST, "/api/kernels", Target::Create),
            (Method::GET, "/api/kernels", Target::List),
            (Method::DELETE, "/v1/sessions", Target::Here),
            (Method::GET, "/v1/sessions/ID", session),
            (Method::POST, "/v1/sessions/ID/execute", session),
            (Method::GET, "/v1/sessions/ID/stream", session),
            (Method::GET, "/v1/sessions/ID/events", Target::Here),
            (Method::GET, "/v1/sessions/ID/notebook", Target::Here),
            (Method::POST, "/v1/sessions/ID/replay", Target::Here),
            (Method::GET, "/api/kernels/ID/channels", session),
            (Method::DELETE, "/api/kernels/ID", session),
            (Method::GET, "/v1/sessions/not-a-uuid", Target::Here),
            (Method::GET, "/healthz", Target::Here),
            (Method::GET, "/v1/recordings", Target::Here),
            (Method::GET, "/e2b/sandboxes", Target::List),
            (Method::GET, "/e2b/v2/sandboxes", Target::List),
            (Method::POST, "/e2b/v2/sandboxes", Target::Create),
            (Method::POST, "/e2b/sandboxes/ID/timeout", session),
            (Method::POST, "/e2b/v2/sandboxes/ID/connect", session),
            (Method::POST, "/e2b/sandbox/execute", Target::Sandbox),
            (
                Method::POST,
                "/e2b/sandbox/process.Process/Start",
                Target::Sandbox,
            ),
            (Method::POST, "/mcp", Target::Mcp),
            (Method::GET, "/v1/snapshots", Target::List),
            (Method::GET, "/e2b/snapshots", Target::List),
            (Method::GET, "/v1/snapshots/ID", Target::Snapshot),
            (Method::DELETE, "/v1/snapshots/ID", Target::Snapshot),
            (Method::DELETE, "/e2b/templates/my-name", Target::Snapshot),
            (Method::GET, "/e2b/templates/base", Target::Here),
            (Method::POST, "/v1/sessions/ID/snapshots", session),
            (Method::DELETE, "/mcp", Target::Mcp),
        ];
        for (m, p, want) in cases {
            let p = p.replace("ID", &id.to_string());
            assert_eq!(target(&m, &p), want, "{m} {p}");
        }
    }
}
