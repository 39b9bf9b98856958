//! What a create asks for ([`CreateOptions`]) and what a new session is made as
//! ([`Shape`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::sandbox::KernelLimits;
use crate::session::config::WorkspaceChoice;
use crate::session::front_door::Provenance;
use crate::session::memory::Reservation;

/// What a new session asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    pub kernel: Option<String>,
    /// Seconds; 0 means never (capped by the configured maximum).
    pub idle_timeout_seconds: Option<u64>,
    /// Use this id (the Jupyter API lets clients propose one).
    pub id: Option<Uuid>,
    /// The kernel's memory limit in bytes (`None`: the user's default session limit); at
    /// least 16 MiB and at most the user's total.
    pub memory_limit_bytes: Option<u64>,
    /// The front door asking (it owns the session's life) and its client's metadata.
    pub provenance: Provenance,
    /// The user's shared workspace, or one of the session's own.
    pub workspace: WorkspaceChoice,
    /// Start from this snapshot of the user's (its kernel, state and a copy of its
    /// workspace; the session has a workspace of its own).
    pub snapshot: Option<Uuid>,
    /// Its secrets (checked by the front door: `secrets::check`): its kernels'
    /// environment, masked in everything the broker returns or keeps.
    pub secrets: BTreeMap<String, String>,
}

/// What a new session is: its kernel spec, idle timeout, limits, memory reservation and
/// provenance.
pub(super) struct Shape {
    pub(super) kernel_name: String,
    pub(super) idle_timeout: Option<Duration>,
    pub(super) limits: KernelLimits,
    pub(super) memory: Reservation,
    pub(super) provenance: Provenance,
    /// The key of the own workspace its kernels work in (`None`: the shared one).
    pub(super) own_workspace: Option<Uuid>,
    pub(super) secrets: Arc<BTreeMap<String, String>>,
}
