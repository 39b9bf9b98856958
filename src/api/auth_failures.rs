//! Failed authentications by client address: after `max_auth_failures` within a minute an
//! address's tokens are not even checked for a minute (429), and the failures are logged in
//! summary (the first of a window, the block, and a count when the window closes), so a
//! token-guessing client costs neither CPU nor log volume.
//!
//! Behind a reverse proxy every client has the proxy's address: the block then applies to
//! all of them (documented in docs/SECURITY.md). Tokens are random and long, so the throttle
//! is about cost and noise, not about making guessing feasible.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The window failures are counted in, and how long an address is blocked.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Addresses tracked at once; past it, expired records are dropped first and new addresses
/// go uncounted (a flood from that many addresses is the connection caps' job).
const MAX_TRACKED: usize = 100_000;

#[derive(Debug, Clone, Copy)]
struct Record {
    since: Instant,
    failures: u32,
    blocked_until: Option<Instant>,
}

impl Record {
    fn expired(&self, now: Instant) -> bool {
        let window_over = now.duration_since(self.since) >= WINDOW;
        let block_over = self.blocked_until.is_none_or(|t| now >= t);
        window_over && block_over
    }
}

/// Failed authentications per address.
#[derive(Debug)]
pub struct AuthFailures {
    records: std::sync::Mutex<HashMap<IpAddr, Record>>,
    /// Failures within [`WINDOW`] that block the address; 0 turns blocking off.
    max: u32,
}

impl AuthFailures {
    pub fn new(max: u32) -> Self {
        Self {
            records: Default::default(),
            max,
        }
    }

    /// `Err(seconds left)` while `ip` is blocked.
    pub fn check(&self, ip: IpAddr, now: Instant) -> Result<(), Duration> {
        let records = crate::sync::lock(&self.records);
        match records.get(&ip).and_then(|r| r.blocked_until) {
            Some(until) if now < until => Err(until - now),
            _ => Ok(()),
        }
    }

    /// Count a failed authentication from `ip`.
    pub fn failed(&self, ip: IpAddr, now: Instant) {
        let mut records = crate::sync::lock(&self.records);
        if records.len() >= MAX_TRACKED && !records.contains_key(&ip) {
            sweep_locked(&mut records, now);
            if records.len() >= MAX_TRACKED {
                return;
            }
        }
        let record = records.entry(ip).or_insert(Record {
            since: now,
            failures: 0,
            blocked_until: None,
        });
        if record.expired(now) {
            summarise(ip, record);
            *record = Record {
                since: now,
                failures: 0,
                blocked_until: None,
            };
        }
        record.failures += 1;
        if record.failures == 1 {
            tracing::warn!(client = %ip, "failed authentication (further failures from this address are summarised)");
        }
        if self.max != 0 && record.failures == self.max && record.blocked_until.is_none() {
            record.blocked_until = Some(now + WINDOW);
            tracing::warn!(
                client = %ip,
                failures = record.failures,
                "too many failed authentications within {} s: this address's tokens are refused for {} s",
                WINDOW.as_secs(),
                WINDOW.as_secs()
            );
        }
    }

    /// Drop the records whose window and block are over, logging a summary of each that
    /// saw more than its first failure. Called every [`WINDOW`] by the server.
    pub fn sweep(&self, now: Instant) {
        sweep_locked(&mut crate::sync::lock(&self.records), now);
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        crate::sync::lock(&self.records).len()
    }
}

fn sweep_locked(records: &mut HashMap<IpAddr, Record>, now: Instant) {
    records.retain(|ip, r| {
        if r.expired(now) {
            summarise(*ip, r);
            false
        } else {
            true
        }
    });
}

/// The summary line of a window that is over: only the first failure was logged as it
/// happened.
fn summarise(ip: IpAddr, r: &Record) {
    if r.failures > 1 {
        tracing::warn!(
            client = %ip,
            failures = r.failures,
            blocked = r.blocked_until.is_some(),
            "failed authentications from one address in the last window"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn an_address_is_blocked_at_the_cap_for_a_window_then_free() {
        let f = AuthFailures::new(3);
        let t0 = Instant::now();
        f.failed(A, t0);
        f.failed(A, t0 + Duration::from_secs(1));
        assert!(f.check(A, t0 + Duration::from_secs(2)).is_ok());
        f.failed(A, t0 + Duration::from_secs(2));
        let left = f.check(A, t0 + Duration::from_secs(12)).unwrap_err();
        assert_eq!(left, Duration::from_secs(50));
        assert!(f.check(B, t0).is_ok(), "other addresses are not blocked");
        // Failures while blocked do not extend the block.
        f.failed(A, t0 + Duration::from_secs(30));
        assert!(f.check(A, t0 + Duration::from_secs(62)).is_ok());
        f.sweep(t0 + Duration::from_secs(62));
        assert_eq!(f.tracked(), 0);
    }

    #[test]
    fn failures_spread_over_windows_never_block() {
        let f = AuthFailures::new(3);
        let t0 = Instant::now();
        for i in 0..10 {
            // Two failures a window.
            let t = t0 + WINDOW * i + Duration::from_secs(1);
            f.failed(A, t);
            f.failed(A, t + Duration::from_secs(1));
            assert!(f.check(A, t + Duration::from_secs(2)).is_ok(), "window {i}");
        }
    }

    #[test]
    fn zero_never_blocks_and_the_table_is_bounded() {
        let f = AuthFailures::new(0);
        let t0 = Instant::now();
        for _ in 0..100 {
            f.failed(A, t0);
        }
        assert!(f.check(A, t0).is_ok());
        let f = AuthFailures::new(5);
        for i in 0..(MAX_TRACKED as u32 + 10) {
            f.failed(IpAddr::V4(i.into()), t0);
        }
        assert_eq!(f.tracked(), MAX_TRACKED);
        // Once their windows are over, new addresses are tracked again.
        f.failed(B, t0 + WINDOW);
        assert_eq!(f.tracked(), 1);
    }
}
