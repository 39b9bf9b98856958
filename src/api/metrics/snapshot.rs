//! What is true at scrape time ([`Snapshot`]: sessions by state, connections, the warm
//! pool, memory, the recording writer's counters, uptime), rendered beside the families.

use super::*;

/// What the recording writer reports, as `/metrics` shows it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordingSnapshot {
    pub queued_bytes: u64,
    pub dropped: u64,
    pub truncated: u64,
    pub errors: u64,
    pub events: u64,
}

/// The values read at scrape time.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Live sessions by state name (`starting`, `idle`, `busy`, `dead`).
    pub sessions: Vec<(&'static str, u64)>,
    /// WebSocket clients attached (agent streams and Jupyter channels).
    pub connections: u64,
    pub pooled_kernels: u64,
    /// Memory reserved by all users' sessions and pooled kernels (their limits), and the
    /// sum of what the sessions' kernels use now (where the sandbox can tell).
    pub memory_reserved_sessions: u64,
    pub memory_reserved_pool: u64,
    pub memory_used: u64,
    /// The scraping user's sessions: id, memory limit, memory use now.
    pub own_sessions: Vec<(String, u64, Option<u64>)>,
    /// `None` when recording is off (its families are left out).
    pub recording: Option<RecordingSnapshot>,
    pub uptime: Duration,
    /// The egress proxy's counters of every user with a network policy, and the scraping
    /// user's name (only its own are shown by name).
    pub egress: Vec<crate::egress::UserUsage>,
    pub caller: String,
}

impl Snapshot {
    pub(super) fn registry(&self) -> Registry {
        let mut r = Registry::with_prefix(PREFIX);
        let sessions = Family::<StateLabel, Gauge>::default();
        for (state, n) in &self.sessions {
            sessions
                .get_or_create(&StateLabel {
                    state: state.to_string(),
                })
                .set(saturating_i64(*n));
        }
        r.register("sessions", "Live sessions by state.", sessions);
        r.register(
            "connections",
            "WebSocket clients attached.",
            Gauge::<i64>::default_with(saturating_i64(self.connections)),
        );
        r.register(
            "pooled_kernels",
            "Ready kernels in the warm pool.",
            Gauge::<i64>::default_with(saturating_i64(self.pooled_kernels)),
        );
        self.register_memory(&mut r);
        egress::register(&mut r, &self.egress, &self.caller);
        if let Some(s) = self.recording {
            r.register(
                "recording_queued_bytes",
                "Bytes waiting for the recording writer.",
                Gauge::<i64>::default_with(saturating_i64(s.queued_bytes)),
            );
            r.register(
                "recording_dropped",
                "Reports dropped because the writer was behind.",
                ConstCounter::new(s.dropped),
            );
            r.register(
                "recording_truncated",
                "Stream messages not kept past the per-execution cap.",
                ConstCounter::new(s.truncated),
            );
            r.register(
                "recording_errors",
                "Events that could not be stored.",
                ConstCounter::new(s.errors),
            );
            r.register(
                "recording_events",
                "Events stored.",
                ConstCounter::new(s.events),
            );
        }
        let uptime = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        uptime.set(self.uptime.as_secs_f64());
        r.register_with_unit("uptime", "Seconds since start.", Unit::Seconds, uptime);
        r
    }
}

impl Snapshot {
    fn register_memory(&self, r: &mut Registry) {
        let reserved = Family::<HolderLabel, Gauge>::default();
        for (holder, bytes) in [
            ("sessions", self.memory_reserved_sessions),
            ("pool", self.memory_reserved_pool),
        ] {
            reserved
                .get_or_create(&HolderLabel { holder })
                .set(saturating_i64(bytes));
        }
        r.register_with_unit(
            "memory_reserved",
            "Memory limits of all kernels (sessions', pooled), counted against their users' totals.",
            Unit::Bytes,
            reserved,
        );
        r.register_with_unit(
            "memory_used",
            "Memory the sessions' kernels use now, all users together.",
            Unit::Bytes,
            Gauge::<i64>::default_with(saturating_i64(self.memory_used)),
        );
        let limit = Family::<SessionLabel, Gauge>::default();
        let used = Family::<SessionLabel, Gauge>::default();
        for (session, l, u) in &self.own_sessions {
            let label = SessionLabel {
                session: session.clone(),
            };
            limit.get_or_create(&label).set(saturating_i64(*l));
            if let Some(u) = u {
                used.get_or_create(&label).set(saturating_i64(*u));
            }
        }
        r.register_with_unit(
            "session_memory_limit",
            "Each of the scraping user's sessions: its kernel's memory limit.",
            Unit::Bytes,
            limit,
        );
        r.register_with_unit(
            "session_memory_used",
            "Each of the scraping user's sessions: its kernel's memory use now.",
            Unit::Bytes,
            used,
        );
    }
}
