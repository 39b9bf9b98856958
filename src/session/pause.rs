//! Pausing a session to disk and resuming it (issue 37): what the front doors are told.
//! The actor's side is `actor/pause.rs`, the sandbox's `sandbox/pause.rs`.

use std::time::Duration;

/// What a pause made, as the front doors report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PauseInfo {
    /// What the images take on disk, in bytes.
    pub image_bytes: u64,
    /// The execution count the session resumes at.
    pub execution_count: u64,
    /// How long the pause took, from the request to the kernel's end.
    pub took: Duration,
}

/// When a user's idle sessions are paused, and how long paused state is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PausePolicy {
    /// Pause a session idle this long instead of expiring it at its idle timeout
    /// (`--pause-after`); `None`: idle sessions expire as they always did.
    pub after: Option<Duration>,
    /// A paused session expires this long after its pause (`--paused-ttl`).
    pub ttl: Duration,
}

/// How long paused state is kept unless the operator says (`--paused-ttl`): a week.
pub const DEFAULT_PAUSED_TTL: Duration = Duration::from_secs(7 * 86_400);

impl Default for PausePolicy {
    fn default() -> Self {
        Self {
            after: None,
            ttl: DEFAULT_PAUSED_TTL,
        }
    }
}

/// What the expiry task does with a session at its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    Expire,
    Pause,
}

/// A session's pause settings and the expiry task's marks on it; read by that task, so
/// kept on the handle. Critical sections are a field read or write.
#[derive(Debug, Default)]
pub(crate) struct PauseState {
    pub policy: PausePolicy,
    /// Pause instead of ending at its fixed deadline (E2B's `autoPause`).
    pub at_deadline: bool,
    /// An automatic pause was refused or failed: the session expires as it would without.
    pub cannot: bool,
    /// An automatic pause is under way.
    pub pausing: bool,
}
