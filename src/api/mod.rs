//! The HTTP surface: the agent REST and WebSocket API (`/v1`), the recordings
//! (`/v1/sessions/{id}/events`, `/notebook`, `/replay`, `/v1/recordings`), the Jupyter
//! kernels API (`/api`), the session browser (`/ui/`), operations endpoints (`/healthz`,
//! `/metrics`), and the API document (`/openapi.json`).
//!
//! Each front door is a thin translation of its protocol to the session layer's requests
//! (`session::{CreateRequest, ExecuteRequest, Workspace, CommandRequest}`) and back.
//!
//! Layout: one file per group of routes (`sessions`, `files`, `stream`, `recording`,
//! `jupyter/` (kernels API, the WebSocket pump, the framings), `e2b/` (E2B's control plane,
//! `/execute`, envd's files and the Connect process service), `mcp/` (the official SDK's
//! service: tools, resources, content), `cluster/` (forwarding to the node that holds a
//! session; `peer.rs` the node-to-node client), `ui`, `ops`); the plumbing they share: `auth` (tokens), `extract` (the owned-session and
//! JSON-body extractors), `shapes` (the JSON the API answers with), `error`, `metrics`,
//! `openapi` (the document generated from the handlers); and the connections themselves:
//! `listener` (the accept loop and its caps), `clients` (client time limits, the body
//! deadline, WebSocket places), `ws_liveness` (WebSocket ping/pong), `user_load` (each
//! user's requests and WebSockets under their caps), `auth_failures` (the throttle on
//! failed authentications), `output_budget` (each user's bytes of output held for clients
//! that have not read it).
//!
//! Architecture invariant: only this layer knows HTTP, status codes and the external JSON
//! shapes; it holds the session [`Registry`] and never names a sandbox backend.

pub mod auth;
pub mod auth_failures;
mod checkpoints;
pub mod clients;
mod cluster;
pub use cluster::carry::start as start_carrying_paused;
/// E2B compatibility (`/e2b`): E2B's SDKs work unmodified against the broker.
mod e2b;
pub mod error;
pub mod extract;
mod files;
pub mod jupyter;
pub(crate) mod kernels;
pub mod listener;
/// MCP over Streamable HTTP at `/mcp` (issue 14).
pub mod mcp;
pub mod metrics;
pub mod openapi;
mod ops;
pub mod output_budget;
pub(crate) mod pause;
mod recording;
mod sessions;
pub mod shapes;
pub(crate) mod snapshots;
mod stream;
mod ui;
pub mod user_load;
mod ws_liveness;

#[cfg(test)]
mod router_tests;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use utoipa_axum::router::OpenApiRouter;

use crate::session::{ExecutionLimits, Registry};

/// Limits the API enforces on requests.
#[derive(Debug, Clone)]
pub struct ApiLimits {
    pub max_code_bytes: usize,
    pub max_file_bytes: usize,
    pub execution_timeout: Duration,
    pub max_execution_timeout: Duration,
    /// Time limits and caps on client connections.
    pub clients: clients::ClientLimits,
}

/// Shared state of every handler. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub registry: Registry,
    pub users: Arc<auth::Users>,
    pub limits: Arc<ApiLimits>,
    pub started: std::time::Instant,
    pub kernelspecs: Arc<crate::kernel::spec::KernelSpecs>,
    pub jupyter_clients: Arc<jupyter::JupyterClients>,
    /// The recordings; `None` when recording is off.
    pub recording: Option<Arc<crate::recording::RecordingStore>>,
    /// What `/metrics` exposes besides the scrape-time values.
    pub metrics: Arc<metrics::Metrics>,
    /// Each user's requests in progress and open WebSockets, under their caps.
    pub user_load: Arc<user_load::UserLoad>,
    /// Failed authentications by client address.
    pub auth_failures: Arc<auth_failures::AuthFailures>,
    /// Cancelled when the broker begins to stop: long-lived response streams (MCP's SSE)
    /// end, so the listener's drain does not wait for them.
    pub stopping: tokio_util::sync::CancellationToken,
    /// The egress proxy, when some user has a network policy (its counters are in
    /// `/metrics`).
    pub egress: Option<Arc<crate::egress::Egress>>,
    /// Cluster mode: the other nodes, for requests about sessions they hold.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// What each user's uploads in progress may hold of the broker's memory
    /// ([`extract::upload_budgets`]).
    pub uploads: Arc<output_budget::ByteBudgets>,
}

impl AppState {
    /// The bounds every execution is checked against (`session::ExecuteRequest::new`).
    pub fn execution_limits(&self) -> ExecutionLimits {
        ExecutionLimits {
            max_code_bytes: self.limits.max_code_bytes,
            default_timeout: self.limits.execution_timeout,
            max_timeout: self.limits.max_execution_timeout,
        }
    }
}

/// Every route, each registered with its documentation (`openapi.rs` adds the rest of the
/// document). This is the one list of routes.
fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .merge(sessions::routes())
        .merge(checkpoints::routes())
        .merge(pause::routes())
        .merge(snapshots::routes())
        .merge(kernels::routes())
        .merge(files::routes())
        .merge(stream::routes())
        .merge(ops::routes())
        .merge(jupyter::routes())
        .merge(recording::routes())
        .merge(ui::routes())
        .merge(e2b::routes())
        .merge(mcp::routes())
}

/// The whole router (tests call it without a socket).
pub fn router(state: AppState) -> Router {
    let (router, _document) = routes().split_for_parts();
    router
        .fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                use axum::response::IntoResponse;
                if uri.path().starts_with("/e2b/") {
                    return e2b::fallback(&method, uri.path());
                }
                error::ApiError::not_found("no such endpoint; see /openapi.json").into_response()
            },
        )
        .layer(axum::Extension(ops::OpenApiJson(openapi::document_json())))
        // After authentication: only a known caller's request is forwarded.
        .layer(axum::middleware::from_fn_with_state(
            cluster::Routing::new(state.clone()),
            cluster::route,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            clients::body_deadline,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ))
        .with_state(state)
}
