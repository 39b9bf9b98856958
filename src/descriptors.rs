//! The broker's own file descriptors: raising the soft `RLIMIT_NOFILE` at start, dividing
//! the limit between the sessions' kernels and the clients, and telling "the broker ran out"
//! apart from "the peer failed" when a socket cannot be opened.
//!
//! Why: with a common default of 1,024 descriptors, one anonymous client that opened
//! connections until `accept` failed left the broker unable to rebuild a kernel's heartbeat
//! socket, and the idle session was declared dead (issue 18). The broker now reserves what
//! its sessions need before it admits clients, and a kernel is never blamed for a descriptor
//! the broker did not have.

use std::io;

/// Descriptors one session holds while its kernel runs, with room to spare: measured 7 on
/// the local backend (five channel sockets, the process's pidfd, its log pipe); starting a
/// kernel briefly needs a few more (the connection file, seccomp filter, pipes), and the
/// Docker backend holds its exec streams.
pub const PER_SESSION: u64 = 16;

/// Descriptors the broker needs for itself whatever its load: listener, recording database,
/// logs, epoll and the file work of requests on blocking threads (a workspace walk holds a
/// directory chain open).
pub const BASE: u64 = 256;

/// Client connections allowed even when the limit is too low for the sessions it should
/// carry: a broker that cannot be reached at all helps no one.
pub const MIN_CLIENTS: usize = 16;

/// Raise the soft `RLIMIT_NOFILE` to the hard limit (capped at 2^20: an "infinite" hard
/// limit is not a count worth reserving against). Returns the soft limit now in force.
pub fn raise_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass; no other memory is touched.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let want = lim.rlim_max.min(1 << 20);
    if lim.rlim_cur >= want {
        return Ok(lim.rlim_cur);
    }
    let raised = libc::rlimit {
        rlim_cur: want,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        // Raising the soft limit up to the hard one is always allowed; should it still
        // fail (a seccomp policy), the old limit is what we have.
        tracing::warn!(error = %io::Error::last_os_error(), "could not raise the descriptor limit");
        return Ok(lim.rlim_cur);
    }
    Ok(want)
}

/// How the descriptor limit is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The soft `RLIMIT_NOFILE`.
    pub limit: u64,
    /// Kept for sessions: their number at most (every user's sessions and pooled kernels)
    /// times [`PER_SESSION`].
    pub for_sessions: u64,
    /// Client connections that fit in what is left (at least [`MIN_CLIENTS`]).
    pub for_clients: usize,
}

impl Budget {
    /// The budget for at most `sessions` sessions under `limit` descriptors.
    pub fn new(limit: u64, sessions: u64) -> Self {
        let for_sessions = sessions.saturating_mul(PER_SESSION);
        let left = limit.saturating_sub(BASE).saturating_sub(for_sessions);
        Self {
            limit,
            for_sessions,
            for_clients: usize::try_from(left).unwrap_or(usize::MAX).max(MIN_CLIENTS),
        }
    }

    /// Whether the limit covers the sessions and the base reserve with at least
    /// [`MIN_CLIENTS`] clients; when not, the broker still runs but warns.
    pub fn is_enough(&self) -> bool {
        self.limit >= BASE + self.for_sessions + MIN_CLIENTS as u64
    }

    /// `configured` client connections (0: no cap) within the budget.
    pub fn cap_clients(&self, configured: usize) -> usize {
        if configured == 0 {
            self.for_clients
        } else {
            configured.min(self.for_clients)
        }
    }
}

/// Whether opening a socket or file failed because this process (or the host) ran out of
/// descriptors or kernel memory: the broker's shortage, not a fault of what it connects to.
pub fn is_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_reserved_before_clients() {
        // 1,024 descriptors, 20 sessions: 1024 - 256 - 320 = 448 for clients.
        let b = Budget::new(1024, 20);
        assert_eq!(b.for_sessions, 320);
        assert_eq!(b.for_clients, 448);
        assert!(b.is_enough());
        assert_eq!(b.cap_clients(1024), 448, "the configured cap is lowered");
        assert_eq!(b.cap_clients(100), 100, "a lower cap is kept");
        assert_eq!(b.cap_clients(0), 448, "no cap becomes the budget");
    }

    #[test]
    fn a_limit_too_low_still_admits_a_few_clients() {
        let b = Budget::new(256, 100);
        assert!(!b.is_enough());
        assert_eq!(b.for_clients, MIN_CLIENTS);
        let huge = Budget::new(1 << 20, u64::MAX);
        assert_eq!(huge.for_sessions, u64::MAX);
        assert_eq!(huge.for_clients, MIN_CLIENTS);
    }

    #[test]
    fn exhaustion_is_told_apart_from_peer_failures() {
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert!(is_exhaustion(&io::Error::from_raw_os_error(errno)));
        }
        for errno in [
            libc::ECONNREFUSED,
            libc::ENOENT,
            libc::ECONNRESET,
            libc::EPIPE,
        ] {
            assert!(!is_exhaustion(&io::Error::from_raw_os_error(errno)));
        }
        assert!(!is_exhaustion(&io::Error::other("no errno")));
    }

    #[test]
    fn raising_keeps_the_limit_at_or_above_what_it_was() {
        let mut before = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in raise_limit.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut before) },
            0
        );
        let now = raise_limit().unwrap();
        assert!(now >= before.rlim_cur);
        assert!(now <= before.rlim_max);
    }
}
