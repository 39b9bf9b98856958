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
