//! When a session pauses by itself (issue 37): its pause settings on the handle, and the
//! deadline the expiry task (`registry/expiry.rs`) acts on, to pause or to expire it.

use std::time::Duration;

use tokio::time::Instant;

use super::handle::Session;
use super::pause::{Due, PausePolicy};
use super::state::SessionState;
use crate::sync::lock;

/// The expiry task's side of a session's pause settings.
impl Session {
    /// When this session expires if nothing happens, or `None` if it cannot expire now.
    pub(super) fn expiry_deadline(&self, max_busy: Duration) -> Option<(Instant, Due)> {
        let (pause, ttl) = {
            let p = lock(&self.pause);
            if p.pausing {
                // The pause under way decides: paused, or left to expire as without.
                return None;
            }
            (
                (!p.cannot).then_some((p.policy, p.at_deadline)),
                p.policy.ttl,
            )
        };
        let auto_after = pause.and_then(|(p, _)| p.after);
        let s = self.status.borrow();
        let fixed = s.deadline.map(|(at, _)| at);
        let idle = match (self.idle_timeout, s.state) {
            (_, SessionState::Expired | SessionState::Closed) => return None,
            // Paused: kept for its policy's time from the pause (its last activity).
            (_, SessionState::Paused) => {
                let kept = (s.last_activity_at + ttl, Due::Expire);
                return Some(match fixed {
                    Some(at) if at < kept.0 => (at, Due::Expire),
                    _ => kept,
                });
            }
            // Idle long enough, a session that can pause does so instead of expiring.
            (_, SessionState::Idle) if auto_after.is_some() => Some((
                s.last_activity_at + auto_after.unwrap_or_default(),
                Due::Pause,
            )),
            (None, _) => None,
            (Some(_), SessionState::Busy) => s.busy_since.map(|b| (b + max_busy, Due::Expire)),
            (Some(t), _) => Some((s.last_activity_at + t, Due::Expire)),
        };
        let at_deadline = match s.state {
            SessionState::Idle if pause.is_some_and(|(_, d)| d) => Due::Pause,
            _ => Due::Expire,
        };
        let fixed = fixed.map(|at| (at, at_deadline));
        match (idle, fixed) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// When it pauses by itself, and how long it stays paused.
    pub(crate) fn set_pause_policy(&self, policy: PausePolicy) {
        lock(&self.pause).policy = policy;
        self.notify_registry.notify_one();
    }

    pub(crate) fn pause_policy(&self) -> PausePolicy {
        lock(&self.pause).policy
    }

    /// Pause instead of ending at its fixed deadline (E2B's `autoPause`).
    pub fn set_pause_at_deadline(&self, on: bool) {
        lock(&self.pause).at_deadline = on;
        self.notify_registry.notify_one();
    }

    pub fn pauses_at_deadline(&self) -> bool {
        lock(&self.pause).at_deadline
    }

    /// A session whose kernel cannot be paused (not Python's): never paused by itself, it
    /// expires as it would without `--pause-after`.
    pub(super) fn never_pauses(&self) {
        lock(&self.pause).cannot = true;
    }

    /// Marks an automatic pause under way; `false` if one already is.
    pub(super) fn begin_auto_pause(&self) -> bool {
        !std::mem::replace(&mut lock(&self.pause).pausing, true)
    }

    /// An automatic pause ended; `failed`: the session is not paused by itself again and
    /// expires as it would without.
    pub(super) fn end_auto_pause(&self, failed: bool) {
        {
            let mut p = lock(&self.pause);
            p.pausing = false;
            p.cannot |= failed;
        }
        self.notify_registry.notify_one();
    }
}

/// A paused session's record, which lets it outlive the broker.
impl Session {
    /// Records the session as paused with the images of kernel `kernel` (the next run
    /// resumes it from them); its record of a kept kernel goes (there is none to adopt)
    /// until a resume gives it a kernel again.
    pub(crate) async fn save_paused(&self, kernel: uuid::Uuid) {
        if let Some(store) = &self.paused_records {
            let mut record = self.record(true);
            record.paused_kernel = Some(kernel);
            store.save(record).await;
        }
        self.set_aside_record().await;
    }

    /// Removes the session's paused record: it runs again, or it is gone.
    pub(crate) async fn forget_paused(&self) {
        if let Some(store) = &self.paused_records {
            store.remove(self.id).await;
        }
    }

    /// Whether a paused session outlives the broker.
    pub(crate) fn keeps_paused(&self) -> bool {
        self.paused_records.is_some()
    }
}
