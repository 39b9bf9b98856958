//! The other live nodes (leases not lapsed), read from `nodes` at most once a second.

use std::time::{Duration, Instant};

use super::{now_micros, Cluster, ClusterError};
use crate::sync::lock;

/// Another live node.
#[derive(Debug, Clone)]
pub struct Peer {
    pub id: String,
    pub url: String,
}

impl Cluster {
    /// Whether the node at `url` is a live peer.
    pub async fn is_live(&self, url: &str) -> bool {
        self.peers().await.iter().any(|p| p.url == url)
    }

    /// Resolves once the node at `url` is no longer a live peer (checked every third of the
    /// lease).
    pub async fn until_gone(&self, url: &str) {
        loop {
            tokio::time::sleep(self.config.lease / 3).await;
            if !self.is_live(url).await {
                return;
            }
        }
    }

    /// The other live nodes, read from the database now.
    pub async fn fresh_peers(&self) -> Vec<Peer> {
        lock(&self.peers).0 = Instant::now() - Duration::from_secs(60);
        self.peers().await
    }

    /// The other live nodes (leases not lapsed).
    pub async fn peers(&self) -> Vec<Peer> {
        {
            let p = lock(&self.peers);
            if p.0.elapsed() < Duration::from_secs(1) {
                return p.1.clone();
            }
        }
        match self.read_peers().await {
            Ok(peers) => {
                *lock(&self.peers) = (Instant::now(), peers.clone());
                peers
            }
            Err(e) => {
                tracing::warn!(error = %e, "cluster: could not read the nodes");
                lock(&self.peers).1.clone()
            }
        }
    }

    async fn read_peers(&self) -> Result<Vec<Peer>, ClusterError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT id, advertise_url FROM nodes
                 WHERE lease_until > $1 AND lost_at IS NULL AND id <> $2 ORDER BY id",
                &[&now_micros(), &self.config.node_id],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| Peer {
                id: r.get(0),
                url: r.get(1),
            })
            .collect())
    }
}
