//! Deleting recordings: one on request, every one past the retention (once at start, then
//! daily), and closing the sessions a broker that was killed left open (at start: they
//! cannot be live any more).

use uuid::Uuid;

use super::Writer;
use crate::recording::db::StaleMarker;
use crate::recording::event::RecordingMarker;
use crate::recording::{micros, RecordingError};

impl Writer {
    /// Delete the recording of session `id` (after the batch's commit, in a transaction of
    /// its own).
    pub(super) fn delete(&mut self, id: Uuid) -> Result<bool, RecordingError> {
        if let Some(k) = self.known.remove(&id) {
            self.budgets.remove(&k.sid);
            self.executions.forget(k.sid);
            if let Some(m) = self.requests.remove(&k.sid) {
                self.requests_len -= m.len();
            }
        }
        self.db.delete(id).map_err(|source| RecordingError::Db {
            context: "delete a recording",
            source,
        })
    }

    /// Sessions left open by a broker that did not stop cleanly cannot be live any more,
    /// unless it kept them (`kept`, `--keep-sessions`): those are continued.
    pub(super) fn close_stale_sessions(&mut self, kept: &std::collections::HashSet<Uuid>) {
        let marker = RecordingMarker::BrokerStopped {
            reason: "the broker stopped without closing this session (it was killed or crashed); the session ended with it".into(),
        };
        let detail = marker.detail().to_string();
        let stale = StaleMarker {
            kept,
            now: micros(chrono::Utc::now()),
            kind: marker.kind(),
            detail: &detail,
        };
        match self.db.close_stale(&stale) {
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
        match self.db.retention(cutoff) {
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
