//! The writer's statements on the embedded SQLite file (the default). The tables are in
//! [`super::schema`]; one broker writes the file, so "this broker's sessions" are all of them.

use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension};
use uuid::Uuid;

use super::db::{BlobRow, DbError, EventRow, IndexText, SessionDelta, StaleMarker, WriteDb};
use super::search::without_nul;

pub(super) struct SqliteDb {
    conn: Connection,
    path: PathBuf,
}

impl SqliteDb {
    pub fn new(conn: Connection, path: PathBuf) -> Self {
        Self { conn, path }
    }
}

impl WriteDb for SqliteDb {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn begin(&mut self) -> Result<(), DbError> {
        Ok(self.conn.execute_batch("BEGIN IMMEDIATE")?)
    }

    fn commit(&mut self) -> Result<(), DbError> {
        Ok(self.conn.execute_batch("COMMIT")?)
    }

    fn rollback(&mut self) {
        let _ = self.conn.execute_batch("ROLLBACK");
    }

    fn session(
        &mut self,
        id: Uuid,
        user: &str,
        kernel: &str,
        created_at: i64,
    ) -> Result<(i64, i64), DbError> {
        let id = id.to_string();
        self.conn
            .prepare_cached(
                "INSERT INTO sessions (id, user, kernel, created_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (id) DO NOTHING",
            )?
            .execute(params![id, user, kernel, created_at])?;
        let sid: i64 = self
            .conn
            .prepare_cached("SELECT sid FROM sessions WHERE id = ?1")?
            .query_row([&id], |r| r.get(0))?;
        let last: i64 = self
            .conn
            .prepare_cached("SELECT coalesce(max(seq), 0) FROM events WHERE sid = ?1")?
            .query_row([sid], |r| r.get(0))?;
        Ok((sid, last))
    }

    fn has_blob_ref(&mut self, sid: i64, sha: &str) -> Result<bool, DbError> {
        let found: Option<i64> = self
            .conn
            .prepare_cached("SELECT 1 FROM blob_refs WHERE sha256 = ?1 AND sid = ?2")?
            .query_row(params![sha, sid], |r| r.get(0))
            .optional()?;
        Ok(found.is_some())
    }

    fn put_blob(&mut self, sid: i64, blob: &BlobRow<'_>) -> Result<(), DbError> {
        let sha = blob.sha256;
        self.conn
            .prepare_cached(
                "INSERT INTO blobs (sha256, base64, size, data) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (sha256) DO NOTHING",
            )?
            .execute(params![sha, blob.base64, blob.size, blob.data])?;
        self.conn
            .prepare_cached(
                "INSERT INTO blob_refs (sha256, sid) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
            )?
            .execute(params![sha, sid])?;
        Ok(())
    }

    fn insert_event(&mut self, r: &EventRow<'_>) -> Result<(), DbError> {
        self.conn
            .prepare_cached(
                "INSERT INTO events (sid, seq, time, direction, channel, msg_type, msg_id,
                   parent_msg_id, header, parent_header, parent_seq, metadata, content, kind,
                   has_blobs, buffers)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
            )?
            .execute(params![
                r.sid,
                r.seq,
                r.time,
                r.direction,
                r.channel,
                r.msg_type,
                r.msg_id,
                r.parent_msg_id,
                r.header,
                r.parent_header,
                r.parent_seq,
                r.metadata,
                r.content,
                r.kind,
                r.has_blobs,
                r.buffers,
            ])?;
        Ok(())
    }

    fn set_event_content(&mut self, sid: i64, seq: i64, content: &str) -> Result<(), DbError> {
        self.conn
            .prepare_cached("UPDATE events SET content = ?3 WHERE sid = ?1 AND seq = ?2")?
            .execute(params![sid, seq, content])?;
        Ok(())
    }

    fn update_session(&mut self, sid: i64, t: &SessionDelta) -> Result<(), DbError> {
        self.conn
            .prepare_cached(
                "UPDATE sessions SET events = events + ?2, cells = cells + ?3,
                   last_event_at = max(coalesce(last_event_at, 0), ?4),
                   ended_at = coalesce(?5, ended_at), end_reason = coalesce(?6, end_reason),
                   errors = errors + ?7
                 WHERE sid = ?1",
            )?
            .execute(params![
                sid,
                t.events,
                t.cells,
                t.last,
                t.ended.map(|e| e.0),
                t.ended.map(|e| e.1),
                t.errors,
            ])?;
        Ok(())
    }

    fn index_text(&mut self, row: &IndexText) -> Result<(), DbError> {
        self.conn
            .prepare_cached(
                "INSERT INTO search_text (sid, seq, field, text) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![
                row.sid,
                row.seq,
                row.field.as_str(),
                without_nul(&row.text)
            ])?;
        Ok(())
    }

    fn set_origin(
        &mut self,
        sid: i64,
        front_door: Option<&str>,
        metadata: &str,
    ) -> Result<(), DbError> {
        self.conn
            .prepare_cached("UPDATE sessions SET front_door = ?2, metadata = ?3 WHERE sid = ?1")?
            .execute(params![sid, front_door, metadata])?;
        Ok(())
    }

    fn set_forked_from(
        &mut self,
        sid: i64,
        parent: &str,
        execution_count: i64,
        checkpoint: Option<&str>,
    ) -> Result<(), DbError> {
        self.conn
            .prepare_cached(
                "UPDATE sessions SET forked_from = ?2, forked_at = ?3, forked_checkpoint = ?4
                 WHERE sid = ?1",
            )?
            .execute(params![sid, parent, execution_count, checkpoint])?;
        Ok(())
    }

    fn set_ended_by(&mut self, sid: i64, by: &str) -> Result<(), DbError> {
        self.conn
            .prepare_cached("UPDATE sessions SET ended_by = ?2 WHERE sid = ?1")?
            .execute(params![sid, by])?;
        Ok(())
    }

    fn delete(&mut self, id: Uuid) -> Result<bool, DbError> {
        let tx = self.conn.transaction()?;
        let sid: Option<i64> = tx
            .prepare_cached("SELECT sid FROM sessions WHERE id = ?1")?
            .query_row([id.to_string()], |r| r.get(0))
            .optional()?;
        let Some(sid) = sid else { return Ok(false) };
        delete_sid(&tx, sid)?;
        tx.commit()?;
        Ok(true)
    }

    fn close_stale(&mut self, marker: &StaleMarker<'_>) -> Result<usize, DbError> {
        let kept = marker.kept;
        let tx = self.conn.transaction()?;
        let stale: Vec<i64> = {
            let mut st = tx.prepare("SELECT sid, id FROM sessions WHERE ended_at IS NULL")?;
            let rows = st.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
            rows.filter(|row| {
                !row.as_ref()
                    .is_ok_and(|(_, id)| Uuid::parse_str(id).is_ok_and(|id| kept.contains(&id)))
            })
            .map(|row| row.map(|(sid, _)| sid))
            .collect::<Result<_, _>>()?
        };
        for sid in &stale {
            let seq: i64 = tx.query_row(
                "SELECT coalesce(max(seq), 0) + 1 FROM events WHERE sid = ?1",
                [sid],
                |r| r.get(0),
            )?;
            tx.execute(
                "INSERT INTO events (sid, seq, time, direction, kind, content)
                 VALUES (?1, ?2, ?3, 'broker', ?4, ?5)",
                params![sid, seq, marker.now, marker.kind, marker.detail],
            )?;
            tx.execute(
                "UPDATE sessions SET ended_at = ?2, end_reason = 'broker_stopped', events = events + 1
                 WHERE sid = ?1",
                params![sid, marker.now],
            )?;
        }
        tx.commit()?;
        Ok(stale.len())
    }

    fn retention(&mut self, cutoff: i64) -> Result<usize, DbError> {
        Ok(retention(&mut self.conn, cutoff)?)
    }

    fn stop(&mut self) {
        let _ = self.conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)");
    }
}

/// Delete every session that ended before `cutoff` (microseconds); one transaction each.
pub(super) fn retention(conn: &mut Connection, cutoff: i64) -> rusqlite::Result<usize> {
    let old: Vec<i64> = {
        let mut st =
            conn.prepare("SELECT sid FROM sessions WHERE ended_at IS NOT NULL AND ended_at < ?1")?;
        let rows = st.query_map([cutoff], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for sid in &old {
        let tx = conn.transaction()?;
        delete_sid(&tx, *sid)?;
        tx.commit()?;
    }
    if !old.is_empty() {
        conn.execute_batch("PRAGMA incremental_vacuum")?;
    }
    Ok(old.len())
}

fn delete_sid(conn: &Connection, sid: i64) -> rusqlite::Result<()> {
    let hashes: Vec<String> = {
        let mut st = conn.prepare_cached("SELECT sha256 FROM blob_refs WHERE sid = ?1")?;
        let rows = st.query_map([sid], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    conn.prepare_cached("DELETE FROM events WHERE sid = ?1")?
        .execute([sid])?;
    conn.prepare_cached("DELETE FROM blob_refs WHERE sid = ?1")?
        .execute([sid])?;
    conn.prepare_cached("DELETE FROM search_text WHERE sid = ?1")?
        .execute([sid])?;
    for h in &hashes {
        conn.prepare_cached(
            "DELETE FROM blobs WHERE sha256 = ?1 AND NOT EXISTS (SELECT 1 FROM blob_refs WHERE sha256 = ?1)",
        )?
        .execute([h])?;
    }
    conn.prepare_cached("DELETE FROM sessions WHERE sid = ?1")?
        .execute([sid])?;
    Ok(())
}
