//! Where a new session goes: the live node with the most headroom (the smaller of its free
//! shares of memory and of sessions), and the per-user creation lock that keeps a user's
//! quota, counted across the nodes, whole.

use super::{now_micros, Cluster, ClusterError, Peer};

/// A node's load, as placement weighs it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    pub sessions: u64,
    /// The memory limits of its sessions and pooled kernels.
    pub memory_reserved: u64,
}

/// How much room a node has: the smaller of its free shares of memory and of sessions.
pub fn headroom(load: Load, memory_capacity: u64, session_capacity: u64) -> f64 {
    let share = |used: u64, cap: u64| {
        if cap == 0 {
            0.0
        } else {
            1.0 - (used as f64 / cap as f64).min(1.0)
        }
    };
    share(load.memory_reserved, memory_capacity).min(share(load.sessions, session_capacity))
}

/// The machine's memory (`MemTotal`).
pub(super) fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// A column of `nodes` that cannot be negative, as written.
fn count(r: &tokio_postgres::Row, i: usize) -> u64 {
    r.get::<_, i64>(i).max(0) as u64
}

impl Cluster {
    /// The node a new session goes to: the live node with the most headroom (this one's
    /// load counted now, the others' as of their last renewal); `None` when it is this one
    /// (a draining node places every session elsewhere, or nowhere: `None` then too).
    pub async fn place(&self, memory: u64) -> Option<Peer> {
        let c = match self.client().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cluster: placement without the nodes table; here");
                return None;
            }
        };
        let rows = c
            .query(
                "SELECT id, advertise_url, sessions, memory_reserved, memory_capacity,
                        session_capacity
                 FROM nodes WHERE lease_until > $1 AND lost_at IS NULL AND NOT draining
                   AND id <> $2",
                &[&now_micros(), &self.config.node_id],
            )
            .await
            .map_err(|e| tracing::warn!(error = %e, "cluster: placement failed; here"))
            .ok()?;
        let mut best: Option<(f64, Peer)> = None;
        let here = headroom(
            self.load_now(),
            self.memory_capacity,
            self.config.session_capacity,
        );
        for r in rows {
            let load = Load {
                sessions: count(&r, 2),
                memory_reserved: count(&r, 3),
            };
            let h = headroom(load, count(&r, 4), count(&r, 5));
            if best.as_ref().is_none_or(|(b, _)| h > *b) {
                best = Some((
                    h,
                    Peer {
                        id: r.get(0),
                        url: r.get(1),
                    },
                ));
            }
        }
        let chosen = if self.is_draining() {
            best.map(|(_, p)| p)
        } else {
            // Ties stay here: no hop for nothing.
            best.filter(|(h, _)| *h > here).map(|(_, p)| p)
        };
        // The chosen node's row counts the session at once, so that the next placements,
        // here and on every node, see it before that node's next renewal reports its load
        // (a burst of creations would otherwise all go to the node that looked emptiest).
        let id = chosen.as_ref().map_or(&self.config.node_id, |p| &p.id);
        if let Err(e) = c
            .execute(
                "UPDATE nodes SET sessions = sessions + 1, memory_reserved = memory_reserved + $2
                 WHERE id = $1",
                &[id, &(memory.min(i64::MAX as u64) as i64)],
            )
            .await
        {
            tracing::warn!(error = %e, "cluster: the placement was not counted in the nodes table");
        }
        chosen
    }

    /// Holds `user`'s creation lock for the cluster until the guard is dropped: one
    /// session creation of a user at a time, cluster-wide, so the quota counted across nodes
    /// holds. On a connection of the locks' own pool (never the one the lease is renewed
    /// on), which goes back to it only once the lock is let go (see [`UserLock`]).
    pub async fn lock_user(&self, user: &str) -> Result<UserLock, ClusterError> {
        let client = self.lock_pool.get().await.map_err(ClusterError::Connect)?;
        // The guard first: a request dropped while it waits for the lock still lets it go.
        let lock = UserLock {
            client: Some(client),
        };
        if let Some(c) = &lock.client {
            c.execute(
                "SELECT pg_advisory_lock(hashtext('kernel-broker user ' || $1))",
                &[&user],
            )
            .await?;
        }
        Ok(lock)
    }
}

/// A user's creation lock (see [`Cluster::lock_user`]); released when dropped.
pub struct UserLock {
    client: Option<deadpool_postgres::Object>,
}

impl Drop for UserLock {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        // Let go of every advisory lock of the connection, then give it back to the pool.
        // Queued behind a lock query still waiting on this connection (a request dropped
        // half-way), so that one is let go too once granted. If the unlock fails, or there
        // is no runtime to run it on, the connection is closed instead: PostgreSQL lets go
        // of a closed session's locks.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            drop(deadpool_postgres::Object::take(client));
            return;
        };
        runtime.spawn(async move {
            if client
                .execute("SELECT pg_advisory_unlock_all()", &[])
                .await
                .is_err()
            {
                drop(deadpool_postgres::Object::take(client));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_is_the_scarcer_resource() {
        let load = |sessions, memory_reserved| Load {
            sessions,
            memory_reserved,
        };
        assert_eq!(headroom(load(0, 0), 100, 10), 1.0);
        assert_eq!(headroom(load(5, 10), 100, 10), 0.5);
        assert_eq!(headroom(load(1, 90), 100, 10), 0.09999999999999998);
        assert_eq!(headroom(load(20, 0), 100, 10), 0.0, "over capacity is none");
        assert_eq!(
            headroom(load(0, 0), 0, 10),
            0.0,
            "no capacity known is none"
        );
    }
}
