//! The egress proxy's families in `/metrics`, read at scrape time from the counters the
//! proxy keeps with its limits (`crate::egress`): requests allowed and refused, bytes each
//! way, connections open. Across all users as totals without names; per user (a `user`
//! label) for the scraping user only, as memory per session is (a user sees only its own).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use super::saturating_i64;
use crate::egress::UserUsage;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserOutcomeLabel {
    user: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserDirectionLabel {
    user: String,
    direction: &'static str,
}

/// Registers the egress families: `all` is every user with a policy, `caller` the scraping
/// user (its own counters are shown by name if it has a policy). Nothing when no user has
/// a policy.
pub(super) fn register(r: &mut Registry, all: &[UserUsage], caller: &str) {
    if all.is_empty() {
        return;
    }
    let own = all.iter().find(|u| u.user == caller);
    let sum = |f: fn(&UserUsage) -> u64| all.iter().map(f).sum::<u64>();
    let requests_by = [
        ("allowed", sum(|u| u.allowed)),
        ("refused", sum(|u| u.refused)),
    ];
    let requests = counters(requests_by.map(|(outcome, n)| (OutcomeLabel { outcome }, n)));
    r.register(
        "egress_requests",
        "Requests through the egress proxy, all users, by outcome (refused: before any connection).",
        requests,
    );
    let bytes = counters(
        [
            ("sent", sum(|u| u.bytes_sent)),
            ("received", sum(|u| u.bytes_received)),
        ]
        .map(|(direction, n)| (DirectionLabel { direction }, n)),
    );
    r.register_with_unit(
        "egress",
        "Bytes through the egress proxy, all users, by direction.",
        Unit::Bytes,
        bytes,
    );
    let open = Gauge::<i64>::default();
    open.set(saturating_i64(sum(|u| u.open_connections)));
    r.register(
        "egress_open_connections",
        "Connections open to the egress proxy, all users.",
        open,
    );
    let Some(own) = own else {
        return;
    };
    let user = || own.user.clone();
    r.register(
        "egress_user_requests",
        "The scraping user's requests through the egress proxy, by outcome.",
        counters([
            (
                UserOutcomeLabel {
                    user: user(),
                    outcome: "allowed",
                },
                own.allowed,
            ),
            (
                UserOutcomeLabel {
                    user: user(),
                    outcome: "refused",
                },
                own.refused,
            ),
        ]),
    );
    r.register_with_unit(
        "egress_user",
        "The scraping user's bytes through the egress proxy, by direction.",
        Unit::Bytes,
        counters([
            (
                UserDirectionLabel {
                    user: user(),
                    direction: "sent",
                },
                own.bytes_sent,
            ),
            (
                UserDirectionLabel {
                    user: user(),
                    direction: "received",
                },
                own.bytes_received,
            ),
        ]),
    );
    let open = Family::<UserLabel, Gauge>::default();
    open.get_or_create(&UserLabel { user: user() })
        .set(saturating_i64(own.open_connections));
    r.register(
        "egress_user_open_connections",
        "The scraping user's connections open to the egress proxy.",
        open,
    );
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserLabel {
    user: String,
}

/// A family of counters holding the given values (read at scrape time from the proxy's
/// atomics, into fresh counters).
fn counters<L, const N: usize>(values: [(L, u64); N]) -> Family<L, Counter>
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, Counter>::default();
    for (label, n) in values {
        family.get_or_create(&label).inc_by(n);
    }
    family
}
