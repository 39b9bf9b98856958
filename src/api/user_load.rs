//! What one authenticated user holds at once: requests in flight and open WebSockets, each
//! under its cap (`max_requests_per_user`, `max_websockets_per_user`).
//!
//! Why per user: the connection caps of `listener.rs` count addresses, and many users may
//! share one (a NAT, a proxy) while one user may come from many. A user who opens
//! WebSockets or parallel requests without end would otherwise take the broker's
//! descriptors, memory and blocking threads from everyone else (issue 18).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Which count a [`Held`] place is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Request,
    WebSocket,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    requests: usize,
    websockets: usize,
}

impl Counts {
    fn of(&mut self, kind: Kind) -> &mut usize {
        match kind {
            Kind::Request => &mut self.requests,
            Kind::WebSocket => &mut self.websockets,
        }
    }
}

/// The counts of every user with something open, and the caps (0: no cap).
#[derive(Debug)]
pub struct UserLoad {
    by_user: Arc<Mutex<HashMap<Arc<str>, Counts>>>,
    max_requests: usize,
    max_websockets: usize,
}

impl UserLoad {
    pub fn new(max_requests: usize, max_websockets: usize) -> Self {
        Self {
            by_user: Arc::default(),
            max_requests,
            max_websockets,
        }
    }

    /// A place for one more `kind` of `user`'s, held until dropped; `None` at the cap.
    pub fn try_hold(&self, user: &Arc<str>, kind: Kind) -> Option<Held> {
        let max = match kind {
            Kind::Request => self.max_requests,
            Kind::WebSocket => self.max_websockets,
        };
        let mut by_user = crate::sync::lock(&self.by_user);
        let counts = by_user.entry(user.clone()).or_default();
        let n = counts.of(kind);
        if max != 0 && *n >= max {
            if *counts == Counts::default() {
                by_user.remove(user);
            }
            return None;
        }
        *n += 1;
        Some(Held {
            by_user: self.by_user.clone(),
            user: user.clone(),
            kind,
        })
    }

    /// The cap on `kind` (for error messages).
    pub fn cap(&self, kind: Kind) -> usize {
        match kind {
            Kind::Request => self.max_requests,
            Kind::WebSocket => self.max_websockets,
        }
    }

    #[cfg(test)]
    fn count(&self, user: &str, kind: Kind) -> usize {
        crate::sync::lock(&self.by_user)
            .get(user)
            .map_or(0, |c| match kind {
                Kind::Request => c.requests,
                Kind::WebSocket => c.websockets,
            })
    }
}

/// One request or WebSocket of a user, counted until dropped.
#[derive(Debug)]
pub struct Held {
    by_user: Arc<Mutex<HashMap<Arc<str>, Counts>>>,
    user: Arc<str>,
    kind: Kind,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut by_user = crate::sync::lock(&self.by_user);
        if let Some(counts) = by_user.get_mut(&self.user) {
            let n = counts.of(self.kind);
            *n = n.saturating_sub(1);
            // Users with nothing open take no memory.
            if *counts == Counts::default() {
                by_user.remove(&self.user);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_capped_per_user_and_freed_on_drop() {
        let load = UserLoad::new(2, 1);
        let alice: Arc<str> = "alice".into();
        let bob: Arc<str> = "bob".into();
        let r1 = load.try_hold(&alice, Kind::Request).unwrap();
        let _r2 = load.try_hold(&alice, Kind::Request).unwrap();
        assert!(load.try_hold(&alice, Kind::Request).is_none());
        // Another kind and another user are counted apart.
        let w = load.try_hold(&alice, Kind::WebSocket).unwrap();
        assert!(load.try_hold(&alice, Kind::WebSocket).is_none());
        assert!(load.try_hold(&bob, Kind::Request).is_some());
        drop(r1);
        assert_eq!(load.count("alice", Kind::Request), 1);
        assert!(load.try_hold(&alice, Kind::Request).is_some());
        drop(w);
        assert_eq!(load.count("alice", Kind::WebSocket), 0);
    }

    #[test]
    fn users_with_nothing_open_are_forgotten_and_zero_is_no_cap() {
        let load = UserLoad::new(0, 0);
        let alice: Arc<str> = "alice".into();
        let held: Vec<_> = (0..1000)
            .map(|_| load.try_hold(&alice, Kind::WebSocket).unwrap())
            .collect();
        drop(held);
        assert!(crate::sync::lock(&load.by_user).is_empty());
        let capped = UserLoad::new(1, 1);
        let _one = capped.try_hold(&alice, Kind::Request).unwrap();
        assert!(capped.try_hold(&"bob".into(), Kind::Request).is_some());
        assert!(capped.try_hold(&alice, Kind::Request).is_none());
        assert_eq!(
            crate::sync::lock(&capped.by_user).len(),
            1,
            "bob's place was given back"
        );
    }
}
