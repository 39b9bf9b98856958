//! The session directory (`cluster_sessions`): which node holds each session. Each node
//! writes the sessions it holds at every renewal of its lease; a lost node's are marked
//! lost (and kept a week, answered dead). Answers are cached per session.

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
}

/// What the session directory says of a session of a user's.
#[derive(Debug, Clone, PartialEq)]
pub enum Directory {
    /// Held by the live peer at this URL.
    At(String),
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
    /// (under this node), the ones that ended are removed. Nothing is written once this
    /// node was declared lost (its sessions stay listed as lost).
    pub(super) async fn write_directory(&self) -> Result<(), ClusterError> {
        let sessions = self.listed.get().map(|f| f()).unwrap_or_default();
        let ids: Vec<String> = sessions.iter().map(|s| s.id.to_string()).collect();
        let users: Vec<String> = sessions.iter().map(|s| s.user.clone()).collect();
        let kernels: Vec<String> = sessions.iter().map(|s| s.kernel.clone()).collect();
        let created: Vec<i64> = sessions.iter().map(|s| s.created_at).collect();
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
             WHERE node = $1 AND lost_at IS NULL AND NOT (id = ANY($2))",
            &[&self.config.node_id, &ids],
        )
        .await?;
        tx.execute(
            "INSERT INTO cluster_sessions (id, node, user_name, kernel, created_at, seen_at)
             SELECT u.id, $1, u.user_name, u.kernel, u.created_at, $6
             FROM unnest($2::text[], $3::text[], $4::text[], $5::int8[])
               AS u(id, user_name, kernel, created_at)
             ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node, seen_at = EXCLUDED.seen_at,
               lost_at = NULL",
            &[
                &self.config.node_id,
                &ids,
                &users,
                &kernels,
                &created,
                &now_micros(),
            ],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Marks the sessions of `node`, found lost at `now`, lost in the directory.
    pub(super) async fn mark_lost(
        &self,
        c: &deadpool_postgres::Client,
        node: &str,
        now: i64,
    ) -> Result<(), ClusterError> {
        c.execute(
            "UPDATE cluster_sessions SET lost_at = $2 WHERE node = $1 AND lost_at IS NULL",
            &[&node, &now],
        )
        .await?;
        Ok(())
    }

    /// What the session directory says of session `id` of `user`.
    pub async fn directory(&self, id: Uuid, user: &str) -> Result<Directory, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT s.kernel, s.created_at, s.lost_at, n.advertise_url,
                   n.lease_until > $3 AND n.lost_at IS NULL AND n.id <> $4
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
        Ok(match (url, live) {
            (Some(url), Some(true)) => Directory::At(url),
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
