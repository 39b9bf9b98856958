//! What a session is, as others see it: its [`SessionState`] and a [`SessionInfo`]
//! snapshot.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

/// The lifecycle state of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    Starting,
    Idle,
    Busy,
    Dead,
    Expired,
    Closed,
}

impl SessionState {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Starting => "starting",
            SessionState::Idle => "idle",
            SessionState::Busy => "busy",
            SessionState::Dead => "dead",
            SessionState::Expired => "expired",
            SessionState::Closed => "closed",
        }
    }
}

/// A snapshot of a session, as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SessionInfo {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    pub state: SessionState,
    pub created_at: DateTime<Utc>,
    pub last_activity: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub execution_count: u64,
    /// Clients attached over WebSocket right now (agent streams and Jupyter channels).
    pub connections: usize,
    /// The kernel's own memory limit.
    pub memory_limit_bytes: u64,
    /// The kernel's memory use now, when it runs and the sandbox can tell.
    pub memory_used_bytes: Option<u64>,
    /// Why the kernel died, while the session is dead.
    pub dead_reason: Option<String>,
}
