//! MCP (the Model Context Protocol) over Streamable HTTP at `/mcp`: the broker's sessions as
//! tools and resources for any agent host that speaks MCP (issue 14).
//!
//! The protocol itself (JSON-RPC, the initialize handshake, `Mcp-Session-Id`, SSE streams,
//! resumption with `Last-Event-ID`, progress notifications, argument validation against the
//! tools' schemas) is the official Rust SDK's (`rmcp`): its `StreamableHttpService` with the
//! in-memory `LocalSessionManager`, which keeps each MCP session's recent SSE events for
//! resumption. This module only puts it behind the broker's authentication and ownership:
//!
//! - every request needs the user's token (the `auth` middleware made it a [`Caller`]);
//! - an MCP session belongs to the user whose `initialize` created it: another user's
//!   `Mcp-Session-Id` is answered exactly as an unknown one (`404`, rmcp's own body, for
//!   every method), so its existence does not leak;
//! - every response stream ends when the broker stops ([`AppState::stopping`]), so an open
//!   SSE stream cannot hold up the listener's drain.
//!
//! Layout: `args` (the tools' arguments and schemas), `call` (a call's context, the session
//! an MCP session made, the internal failure), `server` (the per-MCP-session handler:
//! tools, resources), `tools` (each tool's work on the session layer), `content` (an execution as MCP content),
//! `resources` (workspace files and notebooks as resources). The stdio relay of
//! `kernel-broker mcp` is `crate::mcp_stdio`.

mod args;
mod call;
mod content;
mod resources;
mod run;
mod server;
mod tools;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::StreamExt;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tower::ServiceExt;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Caller;
use super::shapes::ErrorResponse;
use super::AppState;
use crate::sync::lock;
pub use server::McpServer;

/// The header that names an MCP session (Streamable HTTP transport).
const SESSION_HEADER: &str = "mcp-session-id";

/// The `/mcp` routes, each documented; the MCP service rides along as an extension.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(mcp_post, mcp_get, mcp_delete))
        // rmcp reads POST bodies itself, up to the limit `Endpoint::new` sets.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(Extension(EndpointCell::default()))
}

/// The router's [`Endpoint`], made at the first request (its limits come from the state).
#[derive(Clone, Default)]
pub struct EndpointCell(Arc<std::sync::OnceLock<Endpoint>>);

/// The MCP service of one router and who owns each of its sessions. Cheap to clone.
#[derive(Clone)]
pub struct Endpoint {
    service: StreamableHttpService<McpServer, LocalSessionManager>,
    manager: Arc<LocalSessionManager>,
    /// MCP session id → the user whose `initialize` created it.
    owners: Arc<Mutex<HashMap<String, String>>>,
}

/// A JSON-RPC request carries the code and file contents of tool calls: room for the
/// largest upload (base64 is 4/3 of the bytes, JSON escapes aside) and the envelope.
/// Past it rmcp answers `413`. The tools check their own limits on what they receive.
fn max_body_bytes(state: &AppState) -> usize {
    let l = &state.limits;
    (l.max_file_bytes / 3 * 4 + 64 * 1024).max(l.max_code_bytes * 2 + 64 * 1024)
}

impl Endpoint {
    fn new(state: &AppState) -> Self {
        let mut manager = LocalSessionManager::default();
        // An MCP session lives as long as its broker session would: an agent may think for
        // minutes between tool calls. The broker session expires on its own idle timeout;
        // this one after an hour without requests.
        manager.session_config.keep_alive = Some(Duration::from_secs(3600));
        let manager = Arc::new(manager);
        // Host/Origin checks guard servers without authentication against DNS rebinding;
        // here every request needs the user's token, and the broker is reached by whatever
        // name its operator gives it, so the loopback-only default does not fit.
        let config = StreamableHttpServerConfig::default()
            .disable_allowed_hosts()
            .with_max_request_body_bytes(max_body_bytes(state));
        let service = StreamableHttpService::new(|| Ok(McpServer::new()), manager.clone(), config);
        Self {
            service,
            manager,
            owners: Default::default(),
        }
    }

    /// Whether `user` may use the MCP session `id`: one this endpoint gave `user`. An id
    /// it never gave out, or gave another user, is answered here, the same way for both
    /// (rmcp alone would answer a DELETE of an unknown id with success).
    fn may_use(&self, user: &str, id: &str) -> bool {
        lock(&self.owners)
            .get(id)
            .is_some_and(|owner| owner == user)
    }

    /// Record the owner of a session `initialize` just created, and forget the owners of
    /// sessions that ended (closed, or idle past their keep-alive).
    async fn created(&self, user: &str, id: String) {
        let live: Vec<String> = self
            .manager
            .sessions
            .read()
            .await
            .keys()
            .map(|k| k.to_string())
            .collect();
        let mut owners = lock(&self.owners);
        owners.retain(|known, _| live.iter().any(|l| l == known));
        owners.insert(id, user.to_string());
    }
}

/// rmcp's answer to an unknown session id, given to another user's id too.
fn session_not_found() -> Response {
    (StatusCode::NOT_FOUND, "Not Found: Session not found").into_response()
}

/// A request to `/mcp`, whatever its method, with what [`forward`] needs: the caller
/// (authenticated first, as its own extractor would be) and the router's endpoint.
struct McpRequest {
    state: AppState,
    caller: Caller,
    cell: EndpointCell,
    req: Request,
}

impl FromRequest<AppState> for McpRequest {
    type Rejection = Response;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Response> {
        let (mut parts, body) = req.into_parts();
        let caller = Caller::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let Extension(cell) = Extension::<EndpointCell>::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self {
            state: state.clone(),
            caller,
            cell,
            req: Request::from_parts(parts, body),
        })
    }
}

/// Hand a request to the MCP service after authentication and the ownership check.
async fn forward(request: McpRequest) -> Response {
    let McpRequest {
        state,
        caller,
        cell,
        mut req,
    } = request;
    let endpoint = cell.0.get_or_init(|| Endpoint::new(&state)).clone();
    let user = caller.0.name.clone();
    // In cluster mode the id on the wire names this node (`<node>.<id>`, so that any node
    // can send the session's requests here); rmcp knows the id it made.
    let node = state.cluster.as_ref().map(|c| c.node_id().to_string());
    let session = req
        .headers()
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(|wire| match &node {
            Some(node) => crate::api::cluster::mcp_local_id(node, wire).to_string(),
            None => wire.to_string(),
        });
    if let (Some(id), Some(_)) = (&session, &node) {
        match HeaderValue::from_str(id) {
            Ok(v) => req.headers_mut().insert(SESSION_HEADER, v),
            Err(_) => return session_not_found(),
        };
    }
    if let Some(id) = &session {
        if !endpoint.may_use(&user, id) {
            return session_not_found();
        }
    }
    // The tools read the broker's state and the caller from the request's parts, which
    // rmcp hands to every request of the session.
    req.extensions_mut().insert(state.clone());
    let is_delete = req.method() == axum::http::Method::DELETE;
    let mut response = match endpoint.service.clone().oneshot(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    let created = response
        .headers()
        .get(SESSION_HEADER)
        .and_then(|v: &HeaderValue| v.to_str().ok())
        .map(str::to_string);
    match (&session, created) {
        (None, Some(id)) => {
            if let Some(node) = &node {
                let wire = crate::api::cluster::mcp_session_id(node, &id);
                match HeaderValue::from_str(&wire) {
                    Ok(v) => response.headers_mut().insert(SESSION_HEADER, v),
                    Err(_) => {
                        return crate::api::error::ApiError::internal(
                            "naming an MCP session",
                            "the node id makes no header value",
                        )
                        .into_response()
                    }
                };
            }
            endpoint.created(&user, id).await
        }
        (Some(id), _) if is_delete && response.status().is_success() => {
            lock(&endpoint.owners).remove(id);
            // rmcp answers 202; the Python SDK takes only 200 or 204 as "terminated" (and
            // logs a warning otherwise). Nothing follows a DELETE, so 204 says it exactly.
            *response.status_mut() = StatusCode::NO_CONTENT;
        }
        _ => {}
    }
    // An SSE stream may stay open for the life of the MCP session: it ends when the broker
    // stops, so the listener's drain does not wait for it.
    let (parts, body) = response.into_parts();
    let stopping = state.stopping.clone();
    let stream = Body::new(body)
        .into_data_stream()
        .take_until(async move { stopping.cancelled().await });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// MCP: send a JSON-RPC message
///
/// Model Context Protocol over Streamable HTTP (protocol revision 2025-11-25). The first
/// request is `initialize`; its answer carries `Mcp-Session-Id`, which every later request
/// sends. Answers are JSON or an SSE stream (progress notifications, then the result).
/// Tools, resources and errors: docs/API.md, section MCP.
#[utoipa::path(post, operation_id = "mcp_post", path = "/mcp", tag = "mcp",
    request_body(content = Object, description = "a JSON-RPC request, notification or response", content_type = "application/json"),
    responses((status = 200, description = "a JSON-RPC response, as JSON or as an SSE stream (text/event-stream)"),
        (status = 202, description = "accepted (a notification or a response)"),
        (status = 400, description = "not a valid MCP message, or a request other than initialize without a session"),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "no such MCP session of the caller's (closed, expired or never created): initialize again"),
        (status = 406, description = "the Accept header allows neither application/json nor text/event-stream"),
        (status = 413, description = "the message is larger than the limit")))]
async fn mcp_post(request: McpRequest) -> Response {
    forward(request).await
}

/// MCP: open the session's SSE stream
///
/// Server-to-client messages outside a request; with `Last-Event-ID`, resumes a stream
/// after that event.
#[utoipa::path(get, operation_id = "mcp_get", path = "/mcp", tag = "mcp",
    responses((status = 200, description = "an SSE stream (text/event-stream)"),
        (status = 400, description = "no Mcp-Session-Id"),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "no such MCP session of the caller's"),
        (status = 406, description = "the Accept header does not allow text/event-stream")))]
async fn mcp_get(request: McpRequest) -> Response {
    forward(request).await
}

/// MCP: end the session
///
/// Closes the MCP session and deletes the broker session it created for `run_python`
/// calls without `session_id` (its recording stays).
#[utoipa::path(delete, operation_id = "mcp_delete", path = "/mcp", tag = "mcp",
    responses((status = 204, description = "closed"),
        (status = 400, description = "no Mcp-Session-Id"),
        (status = 401, response = ErrorResponse),
        (status = 404, description = "no such MCP session of the caller's")))]
async fn mcp_delete(request: McpRequest) -> Response {
    forward(request).await
}
