//! kernel-broker: long-lived, sandboxed IPython sessions for AI agents and notebook frontends.
//!
//! # Layout
//!
//! Layers, bottom up; a module uses only those below it (see `ARCHITECTURE.md`; the
//! table is checked by `architecture_tests`):
//!
//! - [`sync`]: the poison-tolerant `lock` every layer uses; [`descriptors`]: the process's
//!   descriptor limit, its budget, and telling its exhaustion apart from a peer's failure.
//! - [`wire`]: Jupyter messages as data; the multipart codec, HMAC signing, connection files. No I/O.
//! - [`kernel`]: a client for one kernel over ZeroMQ (our own bounded ZMTP): the five
//!   channels, heartbeat, replies matched to requests; kernel specs (`kernel::spec`).
//! - [`egress`]: the HTTP(S) forward proxy kernels of users with a network policy reach
//!   their allowed hosts through (policy, address filter, limits); knows no sandbox.
//! - [`sandbox`]: where kernels run: `trait Sandbox` and its backends (local namespaces +
//!   cgroups, Docker).
//! - [`secrets`]: a session's secrets, and the masking of them, the broker's credentials
//!   and credential patterns in whatever a kernel sends ([`policy`]: the operator's
//!   pre-execution rules over Python's syntax tree; neither names a layer above).
//! - [`session`]: sessions, their registry, ownership, the execute queue, timeouts, expiry;
//!   it reports a typed `LifecycleEvent` to whoever listens (the recording, the metrics).
//! - [`recording`]: every message and lifecycle event of every session, in SQLite (WAL) or
//!   PostgreSQL (`--database-url`), in types of its own; notebook export. It hears the
//!   session layer through its `Recorder` trait.
//! - [`db`]: the PostgreSQL database the recording and cluster mode share: connections,
//!   pools, the schema's versions (each owner's tables are its own; this layer applies them).
//! - [`cluster`]: cluster mode: this node's lease, its peers, the session directory,
//!   placement (PostgreSQL only; the requests to peers are the api layer's).
//! - [`replay`]: a recording's cells run again in a new session and compared with what was
//!   recorded. It drives sessions and reads recordings, so it sits above both.
//! - [`api`]: the HTTP surface (agent REST + WebSocket, the Jupyter API, E2B's protocol,
//!   MCP), each a thin translation to the session layer's requests. Only this layer serves
//!   HTTP and knows the external JSON shapes (the egress proxy and the Docker client speak
//!   HTTP as clients of their own protocols).
//! - [`config`]: settings from flags, environment, TOML; [`server`]: wires the layers together
//!   and drains them on shutdown; [`instance_lock`]: one broker per data directory;
//!   [`mcp_stdio`]: `kernel-broker mcp`, MCP over stdio relayed to a broker's `/mcp`;
//!   [`cli`]: the command line client (`sessions`, `exec`, `files`, `kill`) of a running
//!   broker's agent API; [`kept_token`]: the generated token kept in the data directory.

pub mod api;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod db;
pub mod descriptors;
pub mod egress;
pub mod instance_lock;
pub mod kept_token;
pub mod kernel;
pub mod mcp_stdio;
pub mod policy;
pub mod private_file;
pub mod recording;
pub mod replay;
pub mod sandbox;
pub mod secrets;
pub mod server;
pub mod session;
pub mod sync;
pub mod wire;

#[cfg(test)]
mod architecture_tests;
