//! Per-user byte budgets for output the broker holds on a client's behalf until the client
//! reads it (an E2B command's stdout and stderr). The same design as the kernel's iopub
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

use tokio::sync::Semaphore;

use crate::sync::lock;

/// The budgets of every user with output in flight. A budget lives while something holds
/// it (a running command's readers), so idle users cost nothing.
pub struct OutputBudgets {
    bytes: usize,
    by_user: Mutex<HashMap<String, Weak<Semaphore>>>,
}

impl OutputBudgets {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_user_has_one_budget_while_it_is_held() {
        let budgets = OutputBudgets::new(100);
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
}
