//! Memory admission: how a user's memory total is divided between the user's kernels.
//!
//! Every kernel of a user (a session's, or one waiting in the warm pool) holds a
//! [`Reservation`] of its own memory limit from before it is launched until after it is
//! gone, and the sum of a user's reservations never passes the user's total. So the user's
//! total is never a pool the kernels fight over: a kernel that allocates past its own
//! limit is killed alone (by its own cgroup), and a create that does not fit is refused
//! up front (429 `quota_exceeded`) instead of costing another session its life later.
//!
//! The [`Ledger`] is the one place that counts; it knows users by name and bytes, nothing
//! of kernels. Pooled reservations are told apart so that a create may evict the pool to
//! make room (the pool only ever uses room no session asked for).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// What a kernel's reservation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    Session,
    Pooled,
}

/// One user's reserved memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUse {
    /// Bytes reserved by the user's sessions (their limits), and how many sessions.
    pub session_bytes: u64,
    pub sessions: usize,
    /// Bytes reserved by the user's pooled kernels, and how many.
    pub pooled_bytes: u64,
    pub pooled: usize,
}

impl MemoryUse {
    pub fn total_bytes(&self) -> u64 {
        self.session_bytes + self.pooled_bytes
    }
}

/// Every user's reservations. Cheap critical sections: a map lookup and two additions.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    users: Mutex<HashMap<String, MemoryUse>>,
}

impl Ledger {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Reserves `bytes` for a kernel of `user` if the user's reservations stay within
    /// `total` (0: no total); otherwise answers what the user holds now.
    pub fn reserve(
        self: &Arc<Self>,
        user: &str,
        total: u64,
        bytes: u64,
        holder: Holder,
    ) -> Result<Reservation, MemoryUse> {
        let mut users = lock(&self.users);
        let used = users.entry(user.to_string()).or_default();
        if total > 0 && used.total_bytes().saturating_add(bytes) > total {
            return Err(*used);
        }
        add(used, holder, bytes, 1);
        Ok(Reservation {
            ledger: self.clone(),
            user: user.to_string(),
            bytes,
            holder,
        })
    }

    /// Reserves `bytes` for a session of `user` whatever its total: a session adopted after
    /// a broker restart (`--keep-sessions`) holds its memory already, even if the settings
    /// now allow less.
    pub fn reserve_adopted(self: &Arc<Self>, user: &str, bytes: u64) -> Reservation {
        let mut users = lock(&self.users);
        add(
            users.entry(user.to_string()).or_default(),
            Holder::Session,
            bytes,
            1,
        );
        Reservation {
            ledger: self.clone(),
            user: user.to_string(),
            bytes,
            holder: Holder::Session,
        }
    }

    /// What all users hold now, together.
    pub fn usage_all(&self) -> MemoryUse {
        lock(&self.users)
            .values()
            .fold(MemoryUse::default(), |mut all, u| {
                all.session_bytes += u.session_bytes;
                all.sessions += u.sessions;
                all.pooled_bytes += u.pooled_bytes;
                all.pooled += u.pooled;
                all
            })
    }

    /// What `user` holds now.
    pub fn usage(&self, user: &str) -> MemoryUse {
        lock(&self.users).get(user).copied().unwrap_or_default()
    }

    fn release(&self, user: &str, holder: Holder, bytes: u64) {
        let mut users = lock(&self.users);
        if let Some(used) = users.get_mut(user) {
            sub(used, holder, bytes);
            if *used == MemoryUse::default() {
                users.remove(user);
            }
        }
    }
}

fn add(used: &mut MemoryUse, holder: Holder, bytes: u64, n: usize) {
    match holder {
        Holder::Session => {
            used.session_bytes += bytes;
            used.sessions += n;
        }
        Holder::Pooled => {
            used.pooled_bytes += bytes;
            used.pooled += n;
        }
    }
}

fn sub(used: &mut MemoryUse, holder: Holder, bytes: u64) {
    match holder {
        Holder::Session => {
            used.session_bytes = used.session_bytes.saturating_sub(bytes);
            used.sessions = used.sessions.saturating_sub(1);
        }
        Holder::Pooled => {
            used.pooled_bytes = used.pooled_bytes.saturating_sub(bytes);
            used.pooled = used.pooled.saturating_sub(1);
        }
    }
}

/// A kernel's share of its user's memory; given back when dropped (which the holder does
/// only once the kernel is gone).
#[derive(Debug)]
pub(crate) struct Reservation {
    ledger: Arc<Ledger>,
    user: String,
    bytes: u64,
    holder: Holder,
}

impl Reservation {
    /// A pooled kernel's reservation, now a session's (the kernel was handed over).
    pub fn into_session(mut self) -> Reservation {
        if self.holder == Holder::Pooled {
            let mut users = lock(&self.ledger.users);
            let used = users.entry(self.user.clone()).or_default();
            sub(used, Holder::Pooled, self.bytes);
            add(used, Holder::Session, self.bytes, 1);
            self.holder = Holder::Session;
        }
        self
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.ledger.release(&self.user, self.holder, self.bytes);
    }
}

/// `bytes` as a person reads it: MiB below 10 GiB, else GiB with one decimal.
pub fn human_bytes(bytes: u64) -> String {
    if bytes >= 10 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn reservations_never_pass_the_total_and_are_given_back_on_drop() {
        let ledger = Ledger::new();
        let a = ledger.reserve("alice", 1024 * MIB, 512 * MIB, Holder::Session);
        let b = ledger.reserve("alice", 1024 * MIB, 256 * MIB, Holder::Session);
        let p = ledger
            .reserve("alice", 1024 * MIB, 256 * MIB, Holder::Pooled)
            .unwrap();
        let refused = ledger
            .reserve("alice", 1024 * MIB, MIB, Holder::Session)
            .unwrap_err();
        assert_eq!(
            refused,
            MemoryUse {
                session_bytes: 768 * MIB,
                sessions: 2,
                pooled_bytes: 256 * MIB,
                pooled: 1
            }
        );
        // Another user's total is its own.
        assert!(ledger
            .reserve("bob", 1024 * MIB, 1024 * MIB, Holder::Session)
            .is_ok());
        // A pooled kernel handed to a session stays counted, as a session's.
        let s = p.into_session();
        assert_eq!(ledger.usage("alice").sessions, 3);
        assert_eq!(ledger.usage("alice").pooled_bytes, 0);
        drop((a, s));
        assert_eq!(ledger.usage("alice").session_bytes, 256 * MIB);
        drop(b);
        assert_eq!(ledger.usage("alice"), MemoryUse::default());
        assert!(ledger.users.lock().unwrap().get("alice").is_none());
    }

    #[test]
    fn a_total_of_zero_admits_everything() {
        let ledger = Ledger::new();
        let _r = ledger
            .reserve("u", 0, u64::MAX / 2, Holder::Session)
            .unwrap();
        let _s = ledger
            .reserve("u", 0, u64::MAX / 2, Holder::Session)
            .unwrap();
        assert_eq!(ledger.usage("u").sessions, 2);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human_bytes(980 * MIB), "980 MiB");
        assert_eq!(human_bytes(5 << 30), "5120 MiB");
        assert_eq!(human_bytes(12 << 30), "12.0 GiB");
    }
}
