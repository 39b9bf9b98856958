//! The Jupyter Server / Kernel Gateway kernels API, so `jupyter server --gateway-url`,
//! JupyterLab and any Jupyter client can use the broker. A kernel here is a session (same
//! id, same owner): an agent's session can be opened in a notebook while the agent uses it.
//!
//! - `rest.rs`: `/api`, kernel specs and the kernels REST handlers.
//! - `channels.rs`: `/api/kernels/{id}/channels`, the WebSocket pump and the table of
//!   parked clients for reconnects ([`JupyterClients`]).
//! - `framing.rs`: the legacy JSON and v1 binary framings, as bytes.

mod channels;
pub mod framing;
mod rest;

use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use channels::{JupyterClients, PARK_FOR};
pub use framing::V1_PROTOCOL;
pub use rest::KernelJson;

use super::AppState;
use channels::*;
use rest::*;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(api_version))
        .routes(routes!(kernelspecs))
        .routes(routes!(kernelspec))
        .routes(routes!(kernelspec_resource))
        .routes(routes!(list_kernels, start_kernel))
        .routes(routes!(get_kernel, delete_kernel))
        .routes(routes!(interrupt_kernel))
        .routes(routes!(restart_kernel))
        .routes(routes!(channels))
}
