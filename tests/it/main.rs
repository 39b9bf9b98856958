//! The integration tests, one binary: each module is a suite against the real broker, real
//! kernels and real sandboxes (local, and Docker where it runs). One binary links the crate
//! and compiles the shared harness (`common`) once instead of once per suite.
//!
//! Run them with `cargo nextest run` (scripts/test): nextest runs every test in a process of
//! its own, which some suites need (`descriptors` lowers its process's descriptor limit).
//! Choose suites with a filter, e.g. `cargo nextest run -E 'test(/^sandbox_local::/)'`.

#[macro_use]
mod common;

// The session layer's scripted kernel (real ZeroMQ sockets), shared with the crate's unit
// tests; it names the crate `super::broker`.
use kernel_broker as broker;
#[allow(dead_code)] // what only the unit tests use
#[path = "../../src/session/testing/scripted_kernel.rs"]
mod scripted_kernel;

mod checkpoint;
mod cli;
mod client_caps;
mod clients;
mod cluster;
mod descriptors;
mod e2b;
mod e2b_fork;
mod egress;
mod fork;
mod fork_copy;
mod fork_server;
mod fork_server_docker;
mod front_doors;
mod hostile_kernel;
mod instances;
mod keep_docker;
mod keep_sessions;
mod kernel_client;
mod mcp;
mod memory;
mod network_note;
mod new_user;
mod pause;
mod recording;
mod recording_search;
mod sandbox_contract;
mod sandbox_docker;
mod sandbox_docker_own;
mod sandbox_docker_parent;
mod sandbox_local;
mod sandbox_pty;
mod sessions;
mod snapshot;
mod workspace_option;
