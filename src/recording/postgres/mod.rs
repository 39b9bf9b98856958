//! The recordings in PostgreSQL (`--database-url`): the same tables as the SQLite file, shared
//! by every broker of a cluster. Each broker has one writer connection (on its writer
//! thread, driven by a runtime of its own: the writer's calls block, see [`WriteDb`]) and a
//! pool of connections for reads (async, on the broker's runtime).
//!
//! Several brokers write at once, each only its own sessions' events, so sequence numbers
//! stay one writer's. What they share is the blobs: one row per SHA-256, referenced by the
//! sessions that store it. Deleting a recording collects the blobs nobody references any
//! more, which must not race a batch that is adding a reference to one of them: every batch
//! holds a shared advisory lock for its transaction and every deletion an exclusive one
//! (taken before it touches a row, in a transaction of its own, so no lock cycle can form).
//!
//! A kernel's bytes are untrusted here too: PostgreSQL's text cannot hold NUL, which JSON
//! escapes but a decoded `msg_id` may contain; text is stored with NUL replaced, so no
//! kernel can make a statement fail, and with it the batch (an error aborts a whole
//! transaction in PostgreSQL, every session's events with it).

mod listing;
mod queries;
mod schema;

use std::borrow::Cow;
use std::collections::HashMap;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};
use uuid::Uuid;

pub(super) use queries::Pool;
pub use schema::MIGRATIONS;
#[cfg(test)]
pub(in crate::recording) use schema::SCHEMA_VERSION;

use super::db::{BlobRow, DbError, EventRow, IndexText, SessionDelta, StaleMarker, WriteDb};
use super::RecordingError;

/// Held shared by every batch, exclusively by every deletion (see the module's doc).
const BLOB_LOCK: i64 = 0x6b62_626c_6f62; // "kbblob"

pub(in crate::recording) use crate::db::postgres::redact;

/// Text as PostgreSQL can store it: NUL replaced by U+FFFD.
fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{fffd}"))
    } else {
        Cow::Borrowed(s)
    }
}

fn opt_text(s: Option<&str>) -> Option<Cow<'_, str>> {
    s.map(text)
}

/// Connects (on the caller's runtime).
async fn connect(url: &str) -> Result<Client, DbError> {
    Ok(crate::db::postgres::connect(url, "recording").await?)
}

/// The writer's connection.
pub(super) struct PgDb {
    rt: tokio::runtime::Runtime,
    client: Client,
    url: String,
    node: String,
    statements: HashMap<&'static str, Statement>,
    /// Writes of the open batch whose answer nothing waits for (events, counters), sent
    /// together at the commit: pipelined on the connection, one round trip for all of them
    /// instead of one each.
    pending: Vec<(&'static str, Vec<Param>)>,
}

/// A parameter of a pending write.
type Param = Box<dyn ToSql + Sync + Send>;

impl PgDb {
    /// Connects, from the writer thread, and migrates the schema (once per cluster: under a
    /// lock, so brokers starting together do not race).
    pub fn open(url: &str, node: &str) -> Result<Self, RecordingError> {
        let location = redact(url);
        let err = |source| RecordingError::Connect {
            location: location.clone(),
            source,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| err(DbError::Runtime(e)))?;
        let client = rt.block_on(connect(url)).map_err(err)?;
        rt.block_on(schema::migrate(&client, &location))?;
        rt.block_on(schema::trigram_index(&client, &location));
        Ok(Self {
            rt,
            client,
            url: url.to_string(),
            node: node.to_string(),
            statements: HashMap::new(),
            pending: Vec::new(),
        })
    }

    /// Queues a write of the open batch (see `pending`).
    fn later(&mut self, sql: &'static str, params: Vec<Param>) {
        self.pending.push((sql, params));
    }

    /// Sends the pending writes, pipelined, and waits for every answer.
    fn flush(&mut self) -> Result<(), DbError> {
        let pending = std::mem::take(&mut self.pending);
        let mut statements = Vec::with_capacity(pending.len());
        for (sql, _) in &pending {
            statements.push(self.statement(sql)?);
        }
        let client = &self.client;
        let writes = pending.iter().zip(&statements).map(|((_, params), st)| {
            let params: Vec<&(dyn ToSql + Sync)> = params
                .iter()
                .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                .collect();
            async move { client.execute(st, &params).await }
        });
        self.rt.block_on(futures::future::try_join_all(writes))?;
        Ok(())
    }

    /// A prepared statement (prepared once per connection).
    fn statement(&mut self, sql: &'static str) -> Result<Statement, DbError> {
        if let Some(st) = self.statements.get(sql) {
            return Ok(st.clone());
        }
        let st = self.rt.block_on(self.client.prepare(sql))?;
        self.statements.insert(sql, st.clone());
        Ok(st)
    }

    fn execute(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, DbError> {
        let st = self.statement(sql)?;
        Ok(self.rt.block_on(self.client.execute(&st, params))?)
    }

    fn query(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, DbError> {
        let st = self.statement(sql)?;
        Ok(self.rt.block_on(self.client.query(&st, params))?)
    }

    fn batch(&mut self, sql: &str) -> Result<(), DbError> {
        Ok(self.rt.block_on(self.client.batch_execute(sql))?)
    }

    /// A connection that PostgreSQL (or the network) closed is opened again.
    fn reconnect_if_closed(&mut self) -> Result<(), DbError> {
        if !self.client.is_closed() {
            return Ok(());
        }
        tracing::warn!(db = %redact(&self.url), "recording: reconnecting to PostgreSQL");
        self.client = self.rt.block_on(connect(&self.url))?;
        self.statements.clear();
        Ok(())
    }

    /// Runs `f` in a transaction holding the blob lock exclusively.
    fn exclusive<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        self.transaction(
            &format!("BEGIN; SELECT pg_advisory_xact_lock({BLOB_LOCK});"),
            f,
        )
    }

    /// Runs `f` in a transaction of its own, begun with `begin`: committed if `f` succeeds,
    /// else rolled back.
    fn transaction<T>(
        &mut self,
        begin: &str,
        f: impl FnOnce(&mut Self) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        self.reconnect_if_closed()?;
        self.batch(begin)?;
        match f(self) {
            Ok(v) => {
                self.batch("COMMIT")?;
                Ok(v)
            }
            Err(e) => {
                let _ = self.batch("ROLLBACK");
                Err(e)
            }
        }
    }

    fn delete_sid(&mut self, sid: i64) -> Result<(), DbError> {
        self.execute("DELETE FROM events WHERE sid = $1", &[&sid])?;
        self.execute("DELETE FROM search_text WHERE sid = $1", &[&sid])?;
        let hashes: Vec<String> = self
            .query(
                "DELETE FROM blob_refs WHERE sid = $1 RETURNING sha256",
                &[&sid],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect();
        self.execute(
            "DELETE FROM blobs b WHERE b.sha256 = ANY($1)
               AND NOT EXISTS (SELECT 1 FROM blob_refs r WHERE r.sha256 = b.sha256)",
            &[&hashes],
        )?;
        self.execute("DELETE FROM sessions WHERE sid = $1", &[&sid])?;
        Ok(())
    }
}

impl WriteDb for PgDb {
    fn describe(&self) -> String {
        redact(&self.url)
    }

    fn begin(&mut self) -> Result<(), DbError> {
        self.pending.clear();
        self.reconnect_if_closed()?;
        self.batch(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock_shared({BLOB_LOCK});"
        ))
    }

    fn commit(&mut self) -> Result<(), DbError> {
        self.flush()?;
        self.batch("COMMIT")
    }

    fn rollback(&mut self) {
        self.pending.clear();
        let _ = self.batch("ROLLBACK");
    }

    fn session(
        &mut self,
        id: Uuid,
        user: &str,
        kernel: &str,
        created_at: i64,
    ) -> Result<(i64, i64), DbError> {
        let id = id.to_string();
        let node = self.node.clone();
        // A session this node took over from another (cluster mode, `--carry-paused`) is
        // its own from its first event here: the other's loss does not end its recording.
        self.execute(
            r#"INSERT INTO sessions (id, "user", kernel, node, created_at)
               VALUES ($1, $2, $3, $4, $5)
               ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node
               WHERE sessions.ended_at IS NULL AND sessions.node IS DISTINCT FROM EXCLUDED.node"#,
            &[&id, &text(user), &text(kernel), &node, &created_at],
        )?;
        let rows = self.query(
            "SELECT s.sid, coalesce((SELECT max(seq) FROM events e WHERE e.sid = s.sid), 0)
             FROM sessions s WHERE s.id = $1",
            &[&id],
        )?;
        let row = rows
            .first()
            .ok_or_else(|| DbError::SessionRowVanished { id: id.clone() })?;
        Ok((row.get(0), row.get(1)))
    }

    fn has_blob_ref(&mut self, sid: i64, sha: &str) -> Result<bool, DbError> {
        let rows = self.query(
            "SELECT 1 FROM blob_refs WHERE sha256 = $1 AND sid = $2",
            &[&sha, &sid],
        )?;
        Ok(!rows.is_empty())
    }

    fn put_blob(&mut self, sid: i64, blob: &BlobRow<'_>) -> Result<(), DbError> {
        let sha = blob.sha256;
        self.execute(
            "INSERT INTO blobs (sha256, base64, size, data) VALUES ($1, $2, $3, $4)
             ON CONFLICT (sha256) DO NOTHING",
            &[&sha, &blob.base64, &blob.size, &blob.data],
        )?;
        self.execute(
            "INSERT INTO blob_refs (sha256, sid) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&sha, &sid],
        )?;
        Ok(())
    }

    fn insert_event(&mut self, r: &EventRow<'_>) -> Result<(), DbError> {
        let owned = |s: Option<&str>| -> Param { Box::new(opt_text(s).map(Cow::into_owned)) };
        self.later(
            "INSERT INTO events (sid, seq, time, direction, channel, msg_type, msg_id,
               parent_msg_id, header, parent_header, parent_seq, metadata, content, kind,
               has_blobs, buffers)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
             ON CONFLICT (sid, seq) DO NOTHING",
            vec![
                Box::new(r.sid),
                Box::new(r.seq),
                Box::new(r.time),
                Box::new(r.direction.to_string()),
                owned(r.channel),
                owned(r.msg_type),
                owned(r.msg_id),
                owned(r.parent_msg_id),
                owned(r.header),
                owned(r.parent_header),
                Box::new(r.parent_seq),
                owned(r.metadata),
                Box::new(text(r.content).into_owned()),
                owned(r.kind),
                Box::new(r.has_blobs),
                owned(r.buffers),
            ],
        );
        Ok(())
    }

    fn set_event_content(&mut self, sid: i64, seq: i64, content: &str) -> Result<(), DbError> {
        self.later(
            "UPDATE events SET content = $3 WHERE sid = $1 AND seq = $2",
            vec![
                Box::new(sid),
                Box::new(seq),
                Box::new(text(content).into_owned()),
            ],
        );
        Ok(())
    }

    fn update_session(&mut self, sid: i64, t: &SessionDelta) -> Result<(), DbError> {
        let (ended_at, reason) = match t.ended {
            Some((at, reason)) => (Some(at), Some(reason)),
            None => (None, None),
        };
        self.later(
            "UPDATE sessions SET events = events + $2, cells = cells + $3,
               last_event_at = greatest(coalesce(last_event_at, 0), $4),
               ended_at = CASE WHEN end_reason = 'node_lost' THEN ended_at
                               ELSE coalesce($5, ended_at) END,
               end_reason = CASE WHEN end_reason = 'node_lost' THEN end_reason
                                 ELSE coalesce($6, end_reason) END,
               errors = errors + $7
             WHERE sid = $1",
            vec![
                Box::new(sid),
                Box::new(t.events),
                Box::new(t.cells),
                Box::new(t.last),
                Box::new(ended_at),
                Box::new(reason.map(str::to_string)),
                Box::new(t.errors),
            ],
        );
        Ok(())
    }

    fn index_text(&mut self, row: &IndexText) -> Result<(), DbError> {
        self.later(
            "INSERT INTO search_text (sid, seq, field, text) VALUES ($1, $2, $3, $4)",
            vec![
                Box::new(row.sid),
                Box::new(row.seq),
                Box::new(row.field.as_str().to_string()),
                Box::new(text(&row.text).into_owned()),
            ],
        );
        Ok(())
    }

    fn set_origin(
        &mut self,
        sid: i64,
        front_door: Option<&str>,
        metadata: &str,
    ) -> Result<(), DbError> {
        self.later(
            "UPDATE sessions SET front_door = $2, metadata = $3 WHERE sid = $1",
            vec![
                Box::new(sid),
                Box::new(opt_text(front_door).map(Cow::into_owned)),
                Box::new(text(metadata).into_owned()),
            ],
        );
        Ok(())
    }

    fn set_forked_from(
        &mut self,
        sid: i64,
        parent: &str,
        execution_count: i64,
        checkpoint: Option<&str>,
    ) -> Result<(), DbError> {
        self.later(
            "UPDATE sessions SET forked_from = $2, forked_at = $3, forked_checkpoint = $4
             WHERE sid = $1",
            vec![
                Box::new(sid),
                Box::new(text(parent).into_owned()),
                Box::new(execution_count),
                Box::new(opt_text(checkpoint).map(Cow::into_owned)),
            ],
        );
        Ok(())
    }

    fn set_ended_by(&mut self, sid: i64, by: &str) -> Result<(), DbError> {
        self.later(
            "UPDATE sessions SET ended_by = $2 WHERE sid = $1",
            vec![Box::new(sid), Box::new(text(by).into_owned())],
        );
        Ok(())
    }

    fn delete(&mut self, id: Uuid) -> Result<bool, DbError> {
        let id = id.to_string();
        self.exclusive(|db| {
            let rows = db.query("SELECT sid FROM sessions WHERE id = $1", &[&id])?;
            let Some(row) = rows.first() else {
                return Ok(false);
            };
            db.delete_sid(row.get(0))?;
            Ok(true)
        })
    }

    fn close_stale(&mut self, marker: &StaleMarker<'_>) -> Result<usize, DbError> {
        let kept = marker.kept;
        self.transaction("BEGIN", |db| {
            let node = db.node.clone();
            let rows = db.query(
                "SELECT sid, id FROM sessions WHERE ended_at IS NULL AND node = $1",
                &[&node],
            )?;
            let stale: Vec<i64> = rows
                .iter()
                .filter(|r| {
                    !Uuid::parse_str(r.get::<_, &str>(1)).is_ok_and(|id| kept.contains(&id))
                })
                .map(|r| r.get(0))
                .collect();
            for sid in &stale {
                db.execute(
                    "INSERT INTO events (sid, seq, time, direction, kind, content)
                     SELECT $1, coalesce(max(seq), 0) + 1, $2, 'broker', $3, $4
                     FROM events WHERE sid = $1",
                    &[sid, &marker.now, &marker.kind, &marker.detail],
                )?;
                db.execute(
                    "UPDATE sessions SET ended_at = $2, end_reason = 'broker_stopped',
                       events = events + 1
                     WHERE sid = $1",
                    &[sid, &marker.now],
                )?;
            }
            Ok(stale.len())
        })
    }

    fn retention(&mut self, cutoff: i64) -> Result<usize, DbError> {
        self.reconnect_if_closed()?;
        let old: Vec<i64> = self
            .query(
                "SELECT sid FROM sessions WHERE ended_at IS NOT NULL AND ended_at < $1",
                &[&cutoff],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for sid in &old {
            self.exclusive(|db| db.delete_sid(*sid))?;
        }
        Ok(old.len())
    }

    fn stop(&mut self) {}
}

/// Closes the open recordings of `node`, a lost node of the cluster, but those of sessions
/// `kept`: a `node_lost` marker ends each. In one transaction; how many. Several nodes may
/// notice the same loss: the caller has claimed it first (`nodes.lost_at`), so it is done
/// once.
pub(in crate::recording) async fn close_node(
    client: &Client,
    node: &str,
    kept: &[String],
    now: i64,
) -> Result<u64, DbError> {
    let marker = super::event::RecordingMarker::NodeLost {
        node: node.to_string(),
        reason: format!(
            "the node {node} that held this session stopped renewing its lease; its kernel is gone with it"
        ),
    };
    let detail = marker.detail().to_string();
    client.batch_execute("BEGIN").await?;
    let r = async {
        client
            .execute(
                "INSERT INTO events (sid, seq, time, direction, kind, content)
                 SELECT s.sid, coalesce((SELECT max(seq) FROM events e WHERE e.sid = s.sid), 0) + 1,
                        $2, 'broker', $3, $4
                 FROM sessions s WHERE s.node = $1 AND s.ended_at IS NULL AND NOT (s.id = ANY($5))",
                &[&node, &now, &marker.kind(), &detail, &kept],
            )
            .await?;
        client
            .execute(
                "UPDATE sessions SET ended_at = $2, end_reason = 'node_lost', events = events + 1
                 WHERE node = $1 AND ended_at IS NULL AND NOT (id = ANY($3))",
                &[&node, &now, &kept],
            )
            .await
    }
    .await;
    match r {
        Ok(n) => {
            client.batch_execute("COMMIT").await?;
            Ok(n)
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_never_reaches_postgres() {
        assert_eq!(text("a\0b"), "a\u{fffd}b");
        assert!(matches!(text("ab"), Cow::Borrowed("ab")));
    }
}
