//! The node's lease: its row in `nodes`, renewed every third of the lease with its load; a
//! node that finds it was declared lost ends its sessions (but the paused ones the
//! directory kept) and joins again; a node whose renewals are healthy looks for the others'
//! lapsed leases and declares those nodes lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{now_micros, Cluster, ClusterConfig, ClusterError};
use crate::sync::lock;

/// How long a node's registration lasts without renewal, by default.
pub const LEASE: Duration = Duration::from_secs(15);

/// The directory keeps a lost node's sessions (answered dead) for a week, and its paused
/// sessions (away) a week before they are given up.
const KEEP_LOST: i64 = 7 * 24 * 3600 * 1_000_000;

/// When this node last renewed its lease, and since when without a failure.
pub(super) struct Health {
    renewed: Instant,
    /// Since when every renewal succeeded (`None` right after a failure).
    healthy_since: Option<Instant>,
}

impl Health {
    pub(super) fn new() -> Self {
        Self {
            renewed: Instant::now(),
            healthy_since: Some(Instant::now()),
        }
    }
}

/// Registers the node of `config` in `nodes`: live (a lease from now), not lost, not
/// draining.
pub(super) async fn register(
    client: &deadpool_postgres::Client,
    config: &ClusterConfig,
) -> Result<(), ClusterError> {
    client
        .execute(
            "INSERT INTO nodes (id, advertise_url, started_at, lease_until)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (id) DO UPDATE SET advertise_url = EXCLUDED.advertise_url,
               started_at = EXCLUDED.started_at, lease_until = EXCLUDED.lease_until,
               lost_at = NULL, draining = false",
            &[
                &config.node_id,
                &config.advertise_url,
                &now_micros(),
                &(now_micros() + config.lease.as_micros() as i64),
            ],
        )
        .await?;
    Ok(())
}

/// Renews `cluster`'s lease every third of it, for as long as the cluster exists.
pub(super) fn spawn_upkeep(cluster: &Arc<Cluster>) {
    let lease = cluster.config.lease;
    let renew = Arc::downgrade(cluster);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(lease / 3);
        loop {
            every.tick().await;
            let Some(c) = renew.upgrade() else { return };
            c.tend_lease().await;
        }
    });
}

impl Cluster {
    /// One turn of the lease's upkeep: renew it; if this node was declared lost meanwhile
    /// (it could not renew in time: paused, cut off from the database), end its sessions,
    /// which the cluster already counts as dead, and join again; look for lost nodes, but
    /// only after a whole lease of renewals without a failure, so that a node coming back
    /// from an outage of the database (when every lease lapsed) does not declare the others
    /// lost before they could renew.
    async fn tend_lease(&self) {
        match self.renew().await {
            Ok(true) => {
                let mut h = lock(&self.health);
                h.renewed = Instant::now();
                h.healthy_since.get_or_insert_with(Instant::now);
            }
            Ok(false) => {
                tracing::error!(node = %self.config.node_id, "cluster: this node was declared lost (its lease lapsed); its sessions are dead but the paused ones: ending them, then joining again");
                let kept = match self.client().await {
                    Ok(c) => self.paused_of(&c, &self.config.node_id).await,
                    Err(e) => Err(e),
                };
                let kept = kept
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "cluster: could not read which paused sessions the cluster kept: ending them all");
                        Vec::new()
                    })
                    .iter()
                    .filter_map(|id| uuid::Uuid::parse_str(id).ok())
                    .collect();
                let here: Vec<uuid::Uuid> = self
                    .listed
                    .get()
                    .map(|f| f().iter().map(|s| s.id).collect())
                    .unwrap_or_default();
                let taken = self.held_elsewhere(&here).await.unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "cluster: could not read which sessions others took over");
                    Vec::new()
                });
                if let Some(end) = self.on_lost.get() {
                    end(kept, taken).await;
                }
                lock(&self.owners).clear();
                match self.register().await {
                    Ok(()) => {
                        let mut h = lock(&self.health);
                        h.renewed = Instant::now();
                        h.healthy_since = Some(Instant::now());
                        tracing::info!(node = %self.config.node_id, "cluster: joined again");
                    }
                    Err(e) => {
                        lock(&self.health).healthy_since = None;
                        tracing::warn!(error = %e, "cluster: could not join again");
                    }
                }
                return;
            }
            Err(e) => {
                lock(&self.health).healthy_since = None;
                tracing::warn!(error = %e, "cluster: could not renew this node's lease");
                return;
            }
        }
        if let Err(e) = self.write_directory().await {
            tracing::warn!(error = %e, "cluster: could not write this node's sessions to the directory");
        }
        let settled = lock(&self.health)
            .healthy_since
            .is_some_and(|t| t.elapsed() >= self.config.lease);
        if settled {
            if let Err(e) = self.sweep_lost().await {
                tracing::warn!(error = %e, "cluster: could not look for lost nodes");
            }
        }
    }

    /// Registers this node (again): live, not lost, not draining.
    pub(super) async fn register(&self) -> Result<(), ClusterError> {
        register(&self.client().await?, &self.config).await
    }

    /// Whether this node could not renew its lease for longer than the lease: the others
    /// may have declared it lost and its sessions dead, so it serves none of them (`503`)
    /// until it renews again (and ends them if it was declared lost).
    pub fn is_isolated(&self) -> bool {
        lock(&self.health).renewed.elapsed() > self.config.lease
    }

    /// Renews this node's lease (and reports its load); `false` if it was declared lost.
    pub(super) async fn renew(&self) -> Result<bool, ClusterError> {
        let c = self.client().await?;
        let load = self.load_now();
        let n = c
            .execute(
                "UPDATE nodes SET lease_until = $2, advertise_url = $3, sessions = $4,
               memory_reserved = $5, memory_capacity = $6, session_capacity = $7, draining = $8
             WHERE id = $1 AND lost_at IS NULL",
                &[
                    &self.config.node_id,
                    &(now_micros() + self.config.lease.as_micros() as i64),
                    &self.config.advertise_url,
                    &(load.sessions as i64),
                    &(load.memory_reserved as i64),
                    &(self.memory_capacity as i64),
                    &(self.config.session_capacity as i64),
                    &self.is_draining(),
                ],
            )
            .await?;
        Ok(n == 1)
    }

    /// Nodes whose lease lapsed are lost: the first node to notice claims each (so it is
    /// done once) and ends its sessions' recordings with `node_lost` (through
    /// [`Cluster::on_node_lost`]), but for its paused sessions (on its disk, away until it
    /// is back); their kernels went with the node, their recordings stay readable. Paused
    /// sessions of a node lost a week ago are given up the same way.
    pub(super) async fn sweep_lost(&self) -> Result<(), ClusterError> {
        let c = self.client().await?;
        let now = now_micros();
        let lost = c
            .query(
                "UPDATE nodes SET lost_at = $1
                 WHERE lease_until < $1 AND lost_at IS NULL AND id <> $2 RETURNING id",
                &[&now, &self.config.node_id],
            )
            .await?;
        c.execute(
            "DELETE FROM cluster_sessions WHERE lost_at < $1",
            &[&(now - KEEP_LOST)],
        )
        .await?;
        let given_up = c
            .query(
                "UPDATE cluster_sessions s SET lost_at = $1 FROM nodes n
                 WHERE s.node = n.id AND s.paused AND s.lost_at IS NULL AND n.lost_at < $2
                 RETURNING s.node",
                &[&now, &(now - KEEP_LOST)],
            )
            .await?;
        let mut nodes: Vec<(String, Option<Vec<String>>)> = lost
            .iter()
            .map(|row| (row.get::<_, String>(0), None))
            .collect();
        for row in given_up {
            let node: String = row.get(0);
            if !nodes.iter().any(|(n, _)| *n == node) {
                nodes.push((node, Some(Vec::new())));
            }
        }
        for (node, kept) in nodes {
            let kept = match kept {
                Some(k) => k,
                None => match self.mark_lost(&c, &node, now).await {
                    Ok(paused) => paused,
                    Err(e) => {
                        // The loss is claimed (no other node will close them): closed all.
                        tracing::error!(node = %node, error = %e, "cluster: could not mark a lost node's sessions in the directory; its recordings are closed, its paused sessions' too");
                        Vec::new()
                    }
                },
            };
            let Some(close) = self.on_node_lost.get() else {
                tracing::warn!(node = %node, "cluster: a node was lost (its lease lapsed); its sessions are dead");
                continue;
            };
            match close(&c, &node, &kept).await {
                Ok(n) => {
                    tracing::warn!(node = %node, sessions = n, "cluster: a node was lost (its lease lapsed); its sessions are dead")
                }
                Err(e) => {
                    tracing::error!(node = %node, error = %e, "cluster: could not close a lost node's sessions")
                }
            }
        }
        Ok(())
    }
}
