//! [`SessionEvent`]: what a session broadcasts to every attached client, and the byte
//! budget that bounds the iopub messages its broadcast ring may hold.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::state::SessionState;
use crate::wire::Message;

/// Something that happened in a session, for every attached client.
#[derive(Debug, Clone)]
pub enum SessionEvent {
    /// The session's state changed.
    State(SessionState),
    /// A message the kernel published on iopub, as received. `agent` is true when it
    /// belongs to an execution of the agent API (whose clients get it as their own frames).
    Iopub {
        msg: Arc<Message>,
        agent: bool,
        /// Counts the message against the session's event budget while any copy lives.
        held: Arc<EventBytes>,
    },
    /// The kernel was restarted (by request or after a timeout).
    Restarted,
}

/// Bytes a session's broadcast events may hold at once.
pub(super) struct EventBudget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

impl EventBudget {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            used: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    /// Takes `bytes` of the budget, or nothing when they do not fit.
    pub(super) fn charge(&self, bytes: usize) -> Option<Arc<EventBytes>> {
        let before = self.used.fetch_add(bytes, Ordering::AcqRel);
        let held = Arc::new(EventBytes {
            counter: self.used.clone(),
            bytes,
        });
        (before.saturating_add(bytes) <= self.limit).then_some(held)
    }
}

/// A message's share of its session's event budget, given back when the last copy of the
/// event is dropped (overwritten in the ring and seen by every receiver).
#[derive(Debug)]
pub struct EventBytes {
    counter: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for EventBytes {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_budget_refuses_what_does_not_fit_and_frees_on_drop() {
        let budget = EventBudget::new(100);
        let a = budget.charge(60).expect("60 of 100 fits");
        assert!(budget.charge(41).is_none(), "101 of 100 must not fit");
        // A refused charge leaves nothing behind.
        let b = budget.charge(40).expect("exactly 100 fits");
        assert!(budget.charge(1).is_none());
        // The bytes come back when the last copy of an event goes.
        let a2 = a.clone();
        drop(a);
        assert!(budget.charge(1).is_none(), "a copy still holds the bytes");
        drop(a2);
        let c = budget.charge(60).expect("freed room is usable again");
        drop((b, c));
        assert_eq!(budget.used.load(Ordering::Acquire), 0);
        // A single message larger than the whole budget is never broadcast.
        assert!(budget.charge(101).is_none());
        assert_eq!(budget.used.load(Ordering::Acquire), 0);
    }
}
