//! Per-user byte budgets for output the broker holds on a client's behalf until the client
//! reads it (an E2B command's stdout and stderr, an E2B execution's NDJSON lines), and
//! [`CutQueue`], a client's queue that cuts with a marker what does not fit. The same design as the kernel's iopub
//! budget (`kernel::KernelEvents`): every piece of output holds permits of its user's
//! [`Semaphore`] for its size from the moment it is read from its source until the client's
//! connection has taken it; a producer whose user's budget is spent waits.
//!
//! Why per user: a bound per stream still lets one user open streams without end (each
//! command, each connection its own share) and grow the broker for everyone; a user's
//! budget makes what all of her unread output costs the broker a constant, and what is
//! over it waits in her own processes, never in another user's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::sync::lock;

/// The budgets of every user with output in flight. A budget lives while something holds
/// it (a running command's readers), so idle users cost nothing.
pub struct ByteBudgets {
    bytes: usize,
    by_user: Mutex<HashMap<String, Weak<Semaphore>>>,
}

impl ByteBudgets {
    /// Budgets of `bytes` each.
    pub fn new(bytes: usize) -> Self {
        Self {
            bytes: bytes.min(Semaphore::MAX_PERMITS),
            by_user: Mutex::default(),
        }
    }

    /// `user`'s budget, shared by all of her streams.
    pub fn of(&self, user: &str) -> Arc<Semaphore> {
        let mut by_user = lock(&self.by_user);
        if let Some(budget) = by_user.get(user).and_then(Weak::upgrade) {
            return budget;
        }
        // Forget the users whose streams all ended.
        by_user.retain(|_, b| b.strong_count() > 0);
        let budget = Arc::new(Semaphore::new(self.bytes));
        by_user.insert(user.to_string(), Arc::downgrade(&budget));
        budget
    }
}

/// Permits `len` bytes take of a budget of `capacity`: a piece larger than the whole budget
/// takes all of it (it is bounded by the kernel's message limit), so it can still be sent
/// once nothing else is held.
fn permits(len: usize, capacity: usize) -> u32 {
    u32::try_from(len.min(capacity).max(1)).unwrap_or(u32::MAX)
}

/// A piece of output on its way to one client, with the budget it holds until the
/// connection takes it.
pub struct Held(pub Bytes, pub Option<OwnedSemaphorePermit>);

/// One client's queue of output under its user's budget, for output that must not wait
/// (an execution's: the session actor never waits on a client, so waiting here would only
/// move the loss to the actor's queue, unmarked). A piece that does not fit is left out,
/// and the next one that fits is preceded by a marker saying how many were: cut, never
/// lost silently.
pub struct CutQueue {
    tx: mpsc::UnboundedSender<Held>,
    budget: Arc<Semaphore>,
    capacity: usize,
    left_out: u64,
}

impl CutQueue {
    /// A queue under `budget` (of `capacity` bytes) and the receiver its client reads.
    pub fn new(budget: Arc<Semaphore>, capacity: usize) -> (Self, mpsc::UnboundedReceiver<Held>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = Self {
            tx,
            budget,
            capacity,
            left_out: 0,
        };
        (queue, rx)
    }

    /// Queues `piece` if the budget has room, else leaves it out; `marker(n)` is the piece
    /// that says `n` pieces were left out.
    pub fn push(&mut self, piece: Bytes, marker: impl Fn(u64) -> Bytes) {
        if self.left_out > 0 {
            let m = marker(self.left_out);
            match self.take(m.len()) {
                Some(p) => {
                    let _ = self.tx.send(Held(m, Some(p)));
                    self.left_out = 0;
                }
                None => {
                    self.left_out += 1;
                    return;
                }
            }
        }
        match self.take(piece.len()) {
            Some(p) => {
                let _ = self.tx.send(Held(piece, Some(p)));
            }
            None => self.left_out += 1,
        }
    }

    /// Queues the last pieces of a stream whatever the budget (a few small lines the client
    /// needs to see the end), after the marker of what was left out, if anything was.
    pub fn finish(&mut self, last: impl IntoIterator<Item = Bytes>, marker: impl Fn(u64) -> Bytes) {
        if self.left_out > 0 {
            let _ = self.tx.send(Held(marker(self.left_out), None));
            self.left_out = 0;
        }
        for piece in last {
            let _ = self.tx.send(Held(piece, None));
        }
    }

    /// Resolves when the client is gone.
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    fn take(&self, len: usize) -> Option<OwnedSemaphorePermit> {
        self.budget
            .clone()
            .try_acquire_many_owned(permits(len, self.capacity))
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_user_has_one_budget_while_it_is_held() {
        let budgets = ByteBudgets::new(100);
        let a = budgets.of("alice");
        let a2 = budgets.of("alice");
        assert!(Arc::ptr_eq(&a, &a2));
        let b = budgets.of("bob");
        assert!(!Arc::ptr_eq(&a, &b));
        let spent = a.clone().try_acquire_many_owned(100).unwrap();
        assert!(
            a2.try_acquire_many(1).is_err(),
            "alice's streams share hers"
        );
        assert!(b.try_acquire_many(100).is_ok(), "bob's is his own");
        drop((a, a2, spent));
        let fresh = budgets.of("alice");
        assert_eq!(fresh.available_permits(), 100);
        assert_eq!(lock(&budgets.by_user).len(), 2);
    }

    #[test]
    fn a_queue_over_budget_cuts_and_says_so() {
        let budget = Arc::new(Semaphore::new(10));
        let (mut q, mut rx) = CutQueue::new(budget.clone(), 10);
        let marker = |n: u64| Bytes::from(format!("[{n}]"));
        q.push(Bytes::from_static(b"12345678"), marker);
        q.push(Bytes::from_static(b"abcd"), marker);
        q.push(Bytes::from_static(b"efgh"), marker);
        let first = rx.try_recv().unwrap();
        assert_eq!(&first.0[..], b"12345678");
        assert!(rx.try_recv().is_err(), "two pieces left out");
        drop(first);
        q.push(Bytes::from_static(b"ij"), marker);
        assert_eq!(&rx.try_recv().unwrap().0[..], b"[2]");
        assert_eq!(&rx.try_recv().unwrap().0[..], b"ij");
        // A piece larger than the whole budget takes all of it, once it is free.
        q.push(Bytes::from(vec![b'x'; 50]), marker);
        let big = rx.try_recv().unwrap();
        assert_eq!(big.0.len(), 50);
        q.push(Bytes::from_static(b"y"), marker);
        // The end is sent whatever the budget.
        q.finish([Bytes::from_static(b"end")], marker);
        drop(big);
        assert_eq!(&rx.try_recv().unwrap().0[..], b"[1]");
        assert_eq!(&rx.try_recv().unwrap().0[..], b"end");
        assert_eq!(budget.available_permits(), 10, "every permit back");
    }
}
