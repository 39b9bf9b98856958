//! The session directory (`cluster_sessions`): which node holds each session. Each node
//! writes the sessions it holds at every renewal of its lease; a lost node's are marked
//! lost (and kept a week, answered dead), but for its paused sessions: their state is on
//! the node's disk, so they are away until the node is back (a week at most). Lost is
//! final: a node never lists a session of its again once the cluster declared it dead.
//! Answers are cached per session.

use uuid::Uuid;

use super::{now_micros, Cluster, ClusterError};
use crate::sync::lock;

/// Sessions whose owner is remembered.
const OWNERS: usize = 10_000;

/// A session of this node, as the session directory lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    /// Microseconds since the epoch.
    pub created_at: i64,
    /// Paused to disk: it outlives the loss of its node.
    pub paused: bool,
}

/// What the session directory says of a session of a user's.
#[derive(Debug, Clone, PartialEq)]
pub enum Directory {
    /// Held by the live peer at this URL.
    At(String),
    /// Paused on a node that is not live now (lost, stopped, cut off): its state is on
    /// that node's disk, and it resumes when that node is back; or, `carried` (its copy is
    /// in the database, `copies.rs`), on the node that takes it over.
    Away { node: String, carried: bool },
    /// Held by a node that was lost: dead.
    Lost {
        kernel: String,
        created_at: i64,
        lost_at: i64,
    },
    /// Not listed (not the user's, unknown, ended, or made since its node last wrote the
    /// directory; or held here).
    Unknown,
}

impl Cluster {
    /// Writes this node's sessions to the directory: the ones it holds now are listed
    /// (under this node), the ones that ended are removed, but one whose copy this node
    /// holds (`copies.rs`: being taken over here, its row the fence until it resumes; it
    /// stays paused, as its copy was stored, while the registry has not caught up). Nothing is written once this
    /// node was declared lost (its sessions stay listed as lost), and a session listed as
    /// lost stays so (the cluster answered it dead: its end is on its way here).
    pub(super) async fn write_directory(&self) -> Result<(), ClusterError> {
        let sessions = self.listed.get().map(|f| f()).unwrap_or_default();
        let ids: Vec<String> = sessions.iter().map(|s| s.id.to_string()).collect();
        let users: Vec<String> = sessions.iter().map(|s| s.user.clone()).collect();
        let kernels: Vec<String> = sessions.iter().map(|s| s.kernel.clone()).collect();
        let created: Vec<i64> = sessions.iter().map(|s| s.created_at).collect();
        let paused: Vec<bool> = sessions.iter().map(|s| s.paused).collect();
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        let live = tx
            .query_opt(
                "SELECT 1 FROM nodes WHERE id = $1 AND lost_at IS NULL FOR SHARE",
                &[&self.config.node_id],
            )
            .await?;
        if live.is_none() {
            return Ok(());
        }
        tx.execute(
            "DELETE FROM cluster_sessions
             WHERE node = $1 AND lost_at IS NULL AND NOT (id = ANY($2))
               AND NOT EXISTS (SELECT 1 FROM paused_copies c
                               WHERE c.session_id = cluster_sessions.id AND c.node = $1)",
            &[&self.config.node_id, &ids],
        )
        .await?;
        tx.execute(
            "INSERT INTO cluster_sessions (id, node, user_name, kernel, created_at, seen_at, paused)
             SELECT u.id, $1, u.user_name, u.kernel, u.created_at, $6, u.paused
             FROM unnest($2::text[], $3::text[], $4::text[], $5::int8[], $7::bool[])
               AS u(id, user_name, kernel, created_at, paused)
             ON CONFLICT (id) DO UPDATE SET seen_at = EXCLUDED.seen_at,
               paused = EXCLUDED.paused OR EXISTS (SELECT 1 FROM paused_copies c
                 WHERE c.session_id = cluster_sessions.id AND c.node = EXCLUDED.node)
             WHERE cluster_sessions.lost_at IS NULL AND cluster_sessions.node = EXCLUDED.node",
            &[
                &self.config.node_id,
                &ids,
                &users,
                &kernels,
                &created,
                &now_micros(),
                &paused,
            ],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Marks the sessions of `node`, found lost at `now`, lost in the directory, but for
    /// its paused ones (away until it is back); the ids of those.
    pub(super) async fn mark_lost(
        &self,
        c: &deadpool_postgres::Client,
        node: &str,
        now: i64,
    ) -> Result<Vec<String>, ClusterError> {
        c.execute(
            "UPDATE cluster_sessions SET lost_at = $2
             WHERE node = $1 AND lost_at IS NULL AND NOT paused",
            &[&node, &now],
        )
        .await?;
        self.paused_of(c, node).await
    }

    /// The sessions of `node` the directory holds paused (not lost), and those another
    /// node took over from it (`copies.rs`): neither ends with it.
    pub(super) async fn paused_of(
        &self,
        c: &deadpool_postgres::Client,
        node: &str,
    ) -> Result<Vec<String>, ClusterError> {
        Ok(c.query(
            "SELECT id FROM cluster_sessions
             WHERE (node = $1 AND paused OR taken_from = $1) AND lost_at IS NULL",
            &[&node],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
    }

    /// This node's sessions the cluster declared dead (while it was lost): whatever of
    /// them a restart brought back ends.
    pub async fn declared_dead_here(&self) -> Result<Vec<Uuid>, ClusterError> {
        let c = self.client().await?;
        Ok(c.query(
            "SELECT id FROM cluster_sessions WHERE node = $1 AND lost_at IS NOT NULL",
            &[&self.config.node_id],
        )
        .await?
        .iter()
        .filter_map(|r| Uuid::parse_str(r.get(0)).ok())
        .collect())
    }

    /// What the session directory says of session `id` of `user`.
    pub async fn directory(&self, id: Uuid, user: &str) -> Result<Directory, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT s.kernel, s.created_at, s.lost_at, n.advertise_url,
                   n.lease_until > $3 AND n.lost_at IS NULL AND n.id <> $4, s.paused, s.node,
                   EXISTS (SELECT 1 FROM paused_copies c WHERE c.session_id = s.id AND c.node = s.node)
                 FROM cluster_sessions s LEFT JOIN nodes n ON n.id = s.node
                 WHERE s.id = $1 AND s.user_name = $2",
                &[&id.to_string(), &user, &now_micros(), &self.config.node_id],
            )
            .await?;
        let Some(row) = row else {
            return Ok(Directory::Unknown);
        };
        let lost_at: Option<i64> = row.get(2);
        if let Some(lost_at) = lost_at {
            return Ok(Directory::Lost {
                kernel: row.get(0),
                created_at: row.get(1),
                lost_at,
            });
        }
        let url: Option<String> = row.get(3);
        let live: Option<bool> = row.get(4);
        let paused: bool = row.get(5);
        let node: String = row.get(6);
        let carried: bool = row.get(7);
        Ok(match (url, live) {
            (Some(url), Some(true)) => Directory::At(url),
            // This node's and carried, but not in its registry (asked there first): its
            // takeover here is under way; the request waits for it.
            _ if paused && (node != self.config.node_id || carried) => {
                Directory::Away { node, carried }
            }
            _ => Directory::Unknown,
        })
    }

    /// The peer that holds session `id`, as last found.
    pub fn owner_cached(&self, id: Uuid) -> Option<String> {
        lock(&self.owners).get(&id).cloned()
    }

    pub fn remember_owner(&self, id: Uuid, url: String) {
        let mut o = lock(&self.owners);
        if o.len() >= OWNERS {
            o.clear();
        }
        o.insert(id, url);
    }

    pub fn forget_owner(&self, id: Uuid) {
        lock(&self.owners).remove(&id);
    }
}
