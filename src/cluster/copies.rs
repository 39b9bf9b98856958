//! Paused sessions carried to the database (`--carry-paused`, issue 37): the one store every
//! node of a cluster reaches in the deployments the project ships. A node that pauses a
//! session stores a copy of its state (`paused_copies`, its files in `paused_chunks`) once
//! it has answered the pause; while that node is not live, any node asked about the session
//! claims the copy and resumes it.
//!
//! Who holds a paused session is its row in the session directory, and every change of
//! holder is a transaction that takes the session's advisory lock first, so two nodes
//! never both resume it:
//! - a store (after the pause is answered) is refused unless the row is this node's, and
//!   committed only if the session is still paused with those files then (it marks the
//!   row paused at once, not at the next renewal);
//! - a resume on the holding node ([`Cluster::fence_resume`]) drops the copy and marks the
//!   row running, or learns the session was taken over;
//! - a takeover ([`Cluster::claim_copy`]) moves the row and the copy to the taker only while
//!   the row is paused, the copy is its holder's, and that holder is not live.
//!
//! The copy's bytes are opaque here: what they hold is the session layer's and the
//! sandbox's, and each piece is sealed by the caller's [`StoredCopy::seal`] before it is
//! written. After a copy's files, one more row ([`MANIFEST`]) holds, sealed the same way,
//! how many pieces of each file were stored, so that a piece taken out is missed too.

use std::fs::File;

use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::{now_micros, Cluster, ClusterError};

/// The largest piece of a file stored in one row. A piece of zeros is not stored: the
/// taker's file has a hole there, which reads as zeros (a workspace image's journal).
const CHUNK: u64 = 1 << 20;

/// Pieces read from disk at once.
const BATCH: usize = 8;

/// The file name of a copy's manifest row (at offset 0): a JSON object of each file's
/// number of stored pieces, sealed. No file of a copy has an empty name.
pub const MANIFEST: &str = "";

/// Seals piece `at` of file `name` (its bytes) for the database, with the caller's key and
/// binding (`StoredCopy::seal`).
#[derive(Clone)]
#[allow(clippy::type_complexity)]
pub struct PieceSeal(pub std::sync::Arc<dyn Fn(&str, u64, &[u8]) -> Vec<u8> + Send + Sync>);

impl std::fmt::Debug for PieceSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PieceSeal")
    }
}

/// One file of a copy to store: its data is at `extents` (offset, length) of `file`.
#[derive(Debug)]
pub struct CopyFile {
    pub name: String,
    pub file: File,
    pub extents: Vec<(u64, u64)>,
}

/// A copy to store.
#[derive(Debug)]
pub struct StoredCopy {
    pub session: Uuid,
    pub user: String,
    pub kernel: String,
    /// Microseconds since the epoch.
    pub created_at: i64,
    /// The uid its kernel ran as.
    pub uid: u32,
    /// What the session layer needs to take it back (opaque here).
    pub head: Vec<u8>,
    pub files: Vec<CopyFile>,
    /// Seals each piece (and the manifest) before it is written.
    pub seal: PieceSeal,
    /// True while the session is paused with these files: checked under the session's
    /// lock before the copy is committed, so a resume (or an end) that came meanwhile
    /// leaves none.
    pub current: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The transaction-scoped advisory lock of session `id`: a copy's store, a resume's check and
/// a copy's drop of one session take it first, so they happen one after the other.
async fn lock_session(tx: &tokio_postgres::Transaction<'_>, id: &str) -> Result<(), ClusterError> {
    tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&id])
        .await?;
    Ok(())
}

fn is_current(copy: &std::sync::atomic::AtomicBool) -> bool {
    copy.load(std::sync::atomic::Ordering::SeqCst)
}

/// A copy found in the database.
#[derive(Debug, Clone)]
pub struct FoundCopy {
    /// The node that holds it.
    pub node: String,
    pub uid: u32,
    pub head: Vec<u8>,
}

impl Cluster {
    /// Stores a copy of a paused session of this node's, in place of any earlier one, and
    /// marks it paused in the session directory; the bytes stored. Refused (`Ok(None)`)
    /// when the directory says another node holds it or this node was declared lost.
    pub async fn store_copy(&self, copy: StoredCopy) -> Result<Option<u64>, ClusterError> {
        let me = &self.config.node_id;
        let id = copy.session.to_string();
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        lock_session(&tx, &id).await?;
        if !is_current(&copy.current) {
            return Ok(None);
        }
        let live = tx
            .query_opt(
                "SELECT 1 FROM nodes WHERE id = $1 AND lost_at IS NULL FOR SHARE",
                &[me],
            )
            .await?;
        let listed = tx
            .execute(
                "INSERT INTO cluster_sessions (id, node, user_name, kernel, created_at, seen_at, paused)
                 VALUES ($1, $2, $3, $4, $5, $6, true)
                 ON CONFLICT (id) DO UPDATE SET paused = true, seen_at = EXCLUDED.seen_at
                 WHERE cluster_sessions.node = EXCLUDED.node AND cluster_sessions.lost_at IS NULL",
                &[&id, me, &copy.user, &copy.kernel, &copy.created_at, &now_micros()],
            )
            .await?;
        if live.is_none() || listed == 0 {
            return Ok(None);
        }
        tx.execute("DELETE FROM paused_copies WHERE session_id = $1", &[&id])
            .await?;
        tx.execute(
            "INSERT INTO paused_copies (session_id, node, user_name, uid, head, bytes, made_at)
             VALUES ($1, $2, $3, $4, $5, 0, $6)",
            &[
                &id,
                me,
                &copy.user,
                &i64::from(copy.uid),
                &copy.head,
                &now_micros(),
            ],
        )
        .await?;
        // The rows go in by COPY (binary): one stream, no statement per row.
        let sink = tx
            .copy_in("COPY paused_chunks (session_id, file, at, data) FROM STDIN BINARY")
            .await?;
        let rows =
            BinaryCopyInWriter::new(sink, &[Type::TEXT, Type::TEXT, Type::INT8, Type::BYTEA]);
        futures::pin_mut!(rows);
        let mut bytes = 0u64;
        let mut pieces_of = std::collections::BTreeMap::new();
        for f in copy.files {
            let stored = pieces_of.entry(f.name.clone()).or_insert(0u64);
            let file = std::sync::Arc::new(f.file);
            let pieces: Vec<(u64, u64)> = f
                .extents
                .iter()
                .flat_map(|&(start, len)| {
                    (start..start + len)
                        .step_by(CHUNK as usize)
                        .map(move |at| (at, CHUNK.min(start + len - at)))
                })
                .collect();
            for batch in pieces.chunks(BATCH) {
                if !is_current(&copy.current) {
                    // Resumed or ended meanwhile: given up at once (the COPY is aborted
                    // with the transaction), so that its resume does not wait for it.
                    return Ok(None);
                }
                let sealed = read_pieces(file.clone(), &f.name, batch.to_vec(), &copy.seal).await?;
                for (at, len, data) in sealed {
                    bytes += len;
                    *stored += 1;
                    rows.as_mut()
                        .write(&[&id, &f.name, &(at as i64), &data])
                        .await?;
                }
            }
        }
        let manifest = serde_json::to_vec(&pieces_of)
            .map_err(|e| ClusterError::Copy(std::io::Error::other(e)))?;
        let manifest = (copy.seal.0)(MANIFEST, 0, &manifest);
        rows.as_mut()
            .write(&[&id, &MANIFEST, &0i64, &manifest])
            .await?;
        rows.finish().await?;
        tx.execute(
            "UPDATE paused_copies SET bytes = $2 WHERE session_id = $1",
            &[&id, &(bytes as i64)],
        )
        .await?;
        if !is_current(&copy.current) {
            return Ok(None);
        }
        tx.commit().await?;
        Ok(Some(bytes))
    }

    /// Before this node resumes its paused session `id`: whether it still holds it (then
    /// its copy goes and the directory says it runs, in one transaction), or another node
    /// took it over (`false`).
    pub async fn fence_resume(&self, id: Uuid) -> Result<bool, ClusterError> {
        let me = &self.config.node_id;
        let id = id.to_string();
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        lock_session(&tx, &id).await?;
        let row = tx
            .query_opt(
                "SELECT node FROM cluster_sessions WHERE id = $1 FOR UPDATE",
                &[&id],
            )
            .await?;
        if row.is_some_and(|r| r.get::<_, String>(0) != *me) {
            return Ok(false);
        }
        tx.execute(
            "DELETE FROM paused_copies WHERE session_id = $1 AND node = $2",
            &[&id, me],
        )
        .await?;
        tx.execute(
            "UPDATE cluster_sessions SET paused = false WHERE id = $1 AND node = $2",
            &[&id, me],
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The copy of `user`'s session `id`, if there is one.
    pub async fn find_copy(&self, id: Uuid, user: &str) -> Result<Option<FoundCopy>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT node, uid, head FROM paused_copies WHERE session_id = $1 AND user_name = $2",
                &[&id.to_string(), &user],
            )
            .await?;
        Ok(row.map(|r| FoundCopy {
            node: r.get(0),
            uid: u32::try_from(r.get::<_, i64>(1)).unwrap_or(u32::MAX),
            head: r.get(2),
        }))
    }

    /// Takes `user`'s paused session `id` over from `from`: the directory's row and the copy
    /// become this node's, if the row is still paused and `from`'s, the copy `from`'s, and
    /// `from` not live. Whether it did.
    pub async fn claim_copy(&self, id: Uuid, user: &str, from: &str) -> Result<bool, ClusterError> {
        let me = &self.config.node_id;
        let id = id.to_string();
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        lock_session(&tx, &id).await?;
        let row = tx
            .query_opt(
                "SELECT s.node FROM cluster_sessions s
                 WHERE s.id = $1 AND s.user_name = $2 AND s.paused AND s.lost_at IS NULL
                 FOR UPDATE",
                &[&id, &user],
            )
            .await?;
        if row.is_none_or(|r| r.get::<_, String>(0) != from) || from == me.as_str() {
            return Ok(false);
        }
        let live = tx
            .query_opt(
                "SELECT 1 FROM nodes WHERE id = $1 AND lease_until > $2 AND lost_at IS NULL",
                &[&from, &now_micros()],
            )
            .await?;
        if live.is_some() {
            return Ok(false);
        }
        let moved = tx
            .execute(
                "UPDATE paused_copies SET node = $3 WHERE session_id = $1 AND node = $2",
                &[&id, &from, me],
            )
            .await?;
        if moved != 1 {
            return Ok(false);
        }
        tx.execute(
            "UPDATE cluster_sessions SET node = $2, seen_at = $3, taken_from = $4 WHERE id = $1",
            &[&id, me, &now_micros(), &from],
        )
        .await?;
        tx.commit().await?;
        self.forget_owner(id.parse().unwrap_or_default());
        Ok(true)
    }

    /// Gives a claimed session back to `from` (its copy could not be taken in here), so
    /// that it is away again, as before the claim; it was taken from nowhere (a session of
    /// `from` that later runs there again must end with `from`'s loss).
    pub async fn unclaim_copy(&self, id: Uuid, from: &str) -> Result<(), ClusterError> {
        let me = &self.config.node_id;
        let id = id.to_string();
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        tx.execute(
            "UPDATE cluster_sessions SET node = $3, taken_from = NULL WHERE id = $1 AND node = $2",
            &[&id, me, &from],
        )
        .await?;
        tx.execute(
            "UPDATE paused_copies SET node = $3 WHERE session_id = $1 AND node = $2",
            &[&id, me, &from],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Up to `limit` pieces of file `name` of session `id`'s copy, from offset `from` on:
    /// (offset, bytes), in order.
    pub async fn copy_chunks(
        &self,
        id: Uuid,
        name: &str,
        from: u64,
        limit: i64,
    ) -> Result<Vec<(u64, Vec<u8>)>, ClusterError> {
        let c = self.client().await?;
        Ok(c.query(
            "SELECT at, data FROM paused_chunks WHERE session_id = $1 AND file = $2 AND at >= $3
             ORDER BY at LIMIT $4",
            &[&id.to_string(), &name, &(from as i64), &limit],
        )
        .await?
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get(1)))
        .collect())
    }

    /// The sessions whose copies this node holds, with their users and heads.
    pub async fn copies_here(&self) -> Result<Vec<(Uuid, String, Vec<u8>)>, ClusterError> {
        let c = self.client().await?;
        Ok(c.query(
            "SELECT session_id, user_name, head FROM paused_copies WHERE node = $1",
            &[&self.config.node_id],
        )
        .await?
        .iter()
        .filter_map(|r| Some((Uuid::parse_str(r.get(0)).ok()?, r.get(1), r.get(2))))
        .collect())
    }

    /// Which of `ids` the session directory says another node holds now.
    pub async fn held_elsewhere(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, ClusterError> {
        let ids: Vec<String> = ids.iter().map(Uuid::to_string).collect();
        let c = self.client().await?;
        Ok(c.query(
            "SELECT id FROM cluster_sessions WHERE id = ANY($1) AND node <> $2",
            &[&ids, &self.config.node_id],
        )
        .await?
        .iter()
        .filter_map(|r| Uuid::parse_str(r.get(0)).ok())
        .collect())
    }

    /// Drops this node's copy of session `id` (it ended).
    pub async fn drop_copy(&self, id: Uuid) -> Result<(), ClusterError> {
        let id = id.to_string();
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        lock_session(&tx, &id).await?;
        tx.execute(
            "DELETE FROM paused_copies WHERE session_id = $1 AND node = $2",
            &[&id, &self.config.node_id],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// The pieces (offset, length) of `file` (named `name`) that are not all zeros, read and
/// sealed on a blocking thread: (offset, length, sealed bytes).
async fn read_pieces(
    file: std::sync::Arc<File>,
    name: &str,
    pieces: Vec<(u64, u64)>,
    seal: &PieceSeal,
) -> Result<Vec<(u64, u64, Vec<u8>)>, ClusterError> {
    let (name, seal) = (name.to_string(), seal.clone());
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::with_capacity(pieces.len());
        for (at, n) in pieces {
            let mut buf = vec![0u8; n as usize];
            std::os::unix::fs::FileExt::read_exact_at(&*file, &mut buf, at)?;
            if buf.iter().all(|b| *b == 0) {
                continue;
            }
            out.push((at, n, (seal.0)(&name, at, &buf)));
        }
        Ok::<_, std::io::Error>(out)
    })
    .await
    .map_err(|e| ClusterError::Copy(std::io::Error::other(e)))?
    .map_err(ClusterError::Copy)
}
