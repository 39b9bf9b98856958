//! The WebSocket clients attached to a session, counted while their guard lives.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::handle::Session;

impl Session {
    /// Count a WebSocket client while the guard lives.
    pub fn connect_client(self: &Arc<Self>) -> ConnectionGuard {
        self.connections.fetch_add(1, Ordering::Relaxed);
        ConnectionGuard(self.clone())
    }

    /// Count a WebSocket client while the guard lives, unless `max` are connected already
    /// (0: no cap). Counted before the check, so two at once cannot both take the last place.
    pub fn try_connect_client(self: &Arc<Self>, max: usize) -> Option<ConnectionGuard> {
        let before = self.connections.fetch_add(1, Ordering::AcqRel);
        let guard = ConnectionGuard(self.clone());
        (max == 0 || before < max).then_some(guard)
    }
}

/// Decrements the session's connection count when dropped.
pub struct ConnectionGuard(Arc<Session>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}
