//! What a session is, as others see it: its [`SessionState`], the [`SessionStatus`] its
//! actor publishes, and a [`SessionInfo`] snapshot.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::time::Instant;
use uuid::Uuid;

use super::front_door::{Provenance, SessionEnd};

/// The lifecycle state of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    Starting,
    Idle,
    Busy,
    /// Its kernel is on disk (issue 37): no process, no memory; any use resumes it.
    Paused,
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
            SessionState::Paused => "paused",
            SessionState::Dead => "dead",
            SessionState::Expired => "expired",
            SessionState::Closed => "closed",
        }
    }
}

/// A session's status: what its actor publishes (with activity and the fixed deadline,
/// which the front doors set) through a `tokio::sync::watch` (see `Session::status`), so
/// that readers (lists, metrics, the expiry task, WebSocket clients) take a copy with
/// `borrow()` and waiters use `changed()`, never a lock of the session's.
#[derive(Debug, Clone)]
pub struct SessionStatus {
    pub state: SessionState,
    pub last_activity: DateTime<Utc>,
    /// `last_activity` on the monotonic clock, for the idle deadline.
    pub last_activity_at: Instant,
    /// When the agent execution running now started.
    pub busy_since: Option<Instant>,
    /// The kernel is busy with an execution another client sent (a notebook's).
    pub kernel_busy: bool,
    pub execution_count: u64,
    /// Why the kernel died, while the session is dead.
    pub dead_reason: Option<String>,
    /// A fixed end besides the idle timeout, on both clocks: the session expires then
    /// whatever it does (E2B's sandbox timeout; `None`: none).
    pub deadline: Option<(Instant, DateTime<Utc>)>,
}

impl SessionStatus {
    /// A session in state `starting`, last active at `last_activity` (`last_activity_at` on
    /// the monotonic clock), with `execution_count` executions behind it.
    pub(crate) fn starting(
        last_activity: DateTime<Utc>,
        last_activity_at: Instant,
        execution_count: u64,
    ) -> Self {
        SessionStatus {
            state: SessionState::Starting,
            last_activity,
            last_activity_at,
            busy_since: None,
            kernel_busy: false,
            execution_count,
            dead_reason: None,
            deadline: None,
        }
    }

    /// Moves to `state`; only a dead session keeps a reason.
    pub(crate) fn set_state(&mut self, state: SessionState) {
        if self.state == state {
            return;
        }
        self.state = state;
        if state != SessionState::Dead {
            self.dead_reason = None;
        }
    }

    /// Busy or idle as the flags say, for a session that runs at all.
    pub(crate) fn refresh(&mut self) {
        if !matches!(self.state, SessionState::Idle | SessionState::Busy) {
            return;
        }
        if self.busy_since.is_some() || self.kernel_busy {
            self.set_state(SessionState::Busy);
        } else {
            self.set_state(SessionState::Idle);
        }
    }

    /// Dead for `reason`: nothing runs any more.
    pub(crate) fn set_dead(&mut self, reason: String) {
        self.busy_since = None;
        self.kernel_busy = false;
        self.set_state(SessionState::Dead);
        self.dead_reason = Some(reason);
    }

    /// Whether the session is over (shut down or expired): its status changes no more.
    pub fn ended(&self) -> bool {
        matches!(self.state, SessionState::Expired | SessionState::Closed)
    }
}

impl SessionEnd {
    /// The session's state once it has ended so.
    pub fn state(self) -> SessionState {
        match self {
            SessionEnd::Closed(_) => SessionState::Closed,
            SessionEnd::Expired => SessionState::Expired,
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
    /// The front door that made it, and what its client said about it.
    pub provenance: Provenance,
    /// The names of its secrets (never their values).
    pub secrets: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use SessionState::*;

    fn status(state: SessionState) -> SessionStatus {
        let mut s = SessionStatus::starting(Utc::now(), Instant::now(), 0);
        s.state = state;
        s
    }

    #[test]
    fn busy_or_idle_follows_the_flags_only_while_the_session_runs() {
        // (state before, an agent's execution runs, the kernel says busy, state after)
        let cases = [
            (Idle, true, false, Busy),
            (Idle, false, true, Busy),
            (Busy, false, false, Idle),
            (Busy, true, true, Busy),
            (Starting, true, false, Starting),
            (Dead, false, true, Dead),
            (Closed, true, true, Closed),
            (Expired, false, false, Expired),
        ];
        for (before, agent, kernel, after) in cases {
            let mut s = status(before);
            s.busy_since = agent.then(Instant::now);
            s.kernel_busy = kernel;
            s.refresh();
            assert_eq!(s.state, after, "{before:?} agent={agent} kernel={kernel}");
        }
    }

    #[test]
    fn only_a_dead_session_keeps_its_reason() {
        let mut s = status(Busy);
        s.busy_since = Some(Instant::now());
        s.kernel_busy = true;
        s.set_dead("out of memory".into());
        assert_eq!(s.state, Dead);
        assert_eq!(s.dead_reason.as_deref(), Some("out of memory"));
        assert!((s.busy_since, s.kernel_busy) == (None, false), "{s:?}");
        s.set_state(Dead);
        assert_eq!(s.dead_reason.as_deref(), Some("out of memory"));
        s.set_state(Starting);
        assert_eq!(s.dead_reason, None);
    }

    #[test]
    fn only_closed_and_expired_sessions_have_ended() {
        let ended: Vec<_> = [Starting, Idle, Busy, Dead, Expired, Closed]
            .into_iter()
            .filter(|&st| status(st).ended())
            .collect();
        assert_eq!(ended, [Expired, Closed]);
    }
}
