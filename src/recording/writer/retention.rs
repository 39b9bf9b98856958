//! Deleting recordings: one on request, every one past the retention (once at start, then
//! daily), and closing the sessions a broker that was killed left open (at start: they
//! cannot be live any more).

use rusqlite::{params, Connection, OptionalExtension};
use uuid::Uuid;

use super::Writer;
use crate::recording::event::RecordingMarker;
use crate::recording::schema::sqlite;
use crate::recording::{micros, RecordingError};

impl Writer {
    /// Delete the recording of session `id` (inside the caller's transaction).
    pub(super) fn delete(&mut self, id: Uuid) -> Result<bool, RecordingError> {
        self.known.remove(&id);
        let sid: Option<i64> = self
            .conn
            .prepare_cached("SELECT sid FROM sessions WHERE id = ?1")
            .and_then(|mut st| st.query_row([id.to_string()], |r| r.get(0)).optional())
            .map_err(sqlite("find a session to delete"))?;
        let Some(sid) = sid else { return Ok(false) };
        self.budgets.remove(&sid);
        delete_sid(&self.conn, sid).map_err(sqlite("delete a recording"))?;
        Ok(true)
    }

    /// Sessions left open by a broker that did not stop cleanly cannot be live any more,
    /// unless it kept them (`kept`, `--keep-sessions`): those are continued.
    pub(super) fn close_stale_sessions(&mut self, kept: &std::collections::HashSet<Uuid>) {
        let now = micros(chrono::Utc::now());
        let r = (|| -> rusqlite::Result<usize> {
            let tx = self.conn.transaction()?;
            let stale: Vec<i64> = {
                let mut st = tx.prepare("SELECT sid, id FROM sessions WHERE ended_at IS NULL")?;
                let rows =
                    st.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
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
                let marker = RecordingMarker::BrokerStopped {
                    reason: "the broker stopped without closing this session (it was killed or crashed); the session ended with it".into(),
                };
                tx.execute(
                    "INSERT INTO events (sid, seq, time, direction, kind, content)
                     VALUES (?1, ?2, ?3, 'broker', ?4, ?5)",
                    params![sid, seq, now, marker.kind(), marker.detail().to_string()],
                )?;
                tx.execute(
                    "UPDATE sessions SET ended_at = ?2, end_reason = 'broker_stopped', events = events + 1
                     WHERE sid = ?1",
                    params![sid, now],
                )?;
            }
            tx.commit()?;
            Ok(stale.len())
        })();
        match r {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                sessions = n,
                "recording: closed sessions left open by the previous run"
            ),
            Err(e) => tracing::error!(error = %e, "recording: could not close stale sessions"),
        }
    }

    /// Delete sessions that ended longer ago than the retention.
    pub(super) fn retention_pass(&mut self) {
        let Some(keep) = self.retention else { return };
        let Ok(keep) = chrono::Duration::from_std(keep) else {
            return;
        };
        let cutoff = micros(chrono::Utc::now() - keep);
        let r = retention(&mut self.conn, cutoff);
        match r {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                sessions = n,
                "recording: deleted recordings past the retention"
            ),
            Err(e) => tracing::error!(error = %e, "recording: the retention pass failed"),
        }
        self.known.clear();
        self.forget_requests();
    }
}

/// Delete every session that ended before `cutoff` (microseconds); one transaction each.
pub(in crate::recording) fn retention(
    conn: &mut Connection,
    cutoff: i64,
) -> rusqlite::Result<usize> {
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
