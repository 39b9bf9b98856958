//! Budgets. Every session's recording is bounded, whatever the kernel sends: the writer
//! counts what each stored event costs (its JSON text, plus an image or buffer the first
//! time this session stores it: a chart shown again costs its reference only) against
//! `max_execution_bytes` per execution and `max_session_bytes` in all. An execution is a
//! client's `execute_request` (a kernel cannot make one); what the kernel sends counts to
//! the execution its parent id names among the session's last [`MAX_EXECUTIONS`] requests,
//! and to the latest one otherwise: the late output of a flood counts to its own execution,
//! not to the next, and a kernel that forges parent ids gains at most the unused budgets of
//! recent executions, never more than the session cap. Past a cap,
//! kernel and client messages are not recorded; one `recording_truncated` event, written
//! where the first one was dropped, says which cap (`scope`: `execution` or `session`),
//! which request, and counts what was dropped (`dropped_messages`, `dropped_bytes`, kept
//! up to date at each commit). Broker events are kept (they end sessions and cells), but
//! past a cap `execution_*` details are cut to `{msg_id, recording_truncated, bytes}`,
//! others over [`KEPT_DETAIL_BYTES`] likewise; past the session cap `execution_*` events
//! are dropped too. What a user or kernel can make as often as it likes (file changes,
//! commands, egress, interrupts, cut outputs: `StoredEvent::is_repeatable`) is no lifecycle
//! event: it counts against the session's cap only and is dropped past it, counted by the
//! session's marker. A new execution has a fresh budget; the session cap stays in force. So
//! a session stores at most `max_session_bytes` plus ~200 bytes per later lifecycle event.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use serde_json::Value;

use super::{SessionKey, Writer};
use crate::recording::db::{DbError, EventRow, WriteDb};
use crate::recording::event::RecordingMarker;

/// Broker event details up to this size are kept past a cap.
pub(super) const KEPT_DETAIL_BYTES: usize = 1024;

/// Executions whose budgets a session keeps (output of older ones counts to the latest).
const MAX_EXECUTIONS: usize = 64;

/// What a session may still record (see the module documentation).
#[derive(Default)]
pub(super) struct Budget {
    /// Bytes stored in all.
    session: u64,
    /// The session cap's marker, once it is in force.
    session_open: Option<Truncation>,
    /// The session's recent executions, oldest first.
    executions: VecDeque<ExecutionBudget>,
}

struct ExecutionBudget {
    /// The `execute_request`'s msg_id.
    msg_id: String,
    /// Bytes stored for this execution.
    bytes: u64,
    /// Its marker, once its cap is in force.
    open: Option<Truncation>,
}

impl Budget {
    /// The execution a report belongs to: the recent request it names as parent, else the
    /// latest (there is always one: output before any request counts to an unnamed one).
    fn execution(&mut self, parent: Option<&str>) -> &mut ExecutionBudget {
        let found = parent.and_then(|p| self.executions.iter().rposition(|e| e.msg_id == p));
        if self.executions.is_empty() {
            self.executions.push_back(ExecutionBudget {
                msg_id: String::new(),
                bytes: 0,
                open: None,
            });
        }
        let i = found.unwrap_or(self.executions.len() - 1);
        &mut self.executions[i]
    }

    /// The marker counting what is dropped for a report of `parent`, if a cap is in force.
    fn open_marker(&mut self, parent: Option<&str>) -> Option<&mut Truncation> {
        if self.session_open.is_some() {
            return self.session_open.as_mut();
        }
        self.execution(parent).open.as_mut()
    }

    /// Forgets the open markers (their rows were lost with a failed commit); the byte
    /// counts stay (an overestimate).
    pub(super) fn forget_markers(&mut self) {
        self.session_open = None;
        for e in self.executions.iter_mut() {
            e.open = None;
        }
    }

    fn markers(&mut self) -> impl Iterator<Item = &mut Truncation> {
        self.session_open
            .iter_mut()
            .chain(self.executions.iter_mut().filter_map(|e| e.open.as_mut()))
    }
}

/// What became of a repeatable broker event ([`Writer::charge_repeatable`]).
pub(super) enum Repeatable {
    Stored,
    /// Over the session's cap: counted by its marker.
    Dropped,
    /// Over the session's cap just now: its marker was stored, counting this event.
    DroppedAtNewMarker,
}

/// A `recording_truncated` marker being counted.
struct Truncation {
    seq: i64,
    scope: &'static str,
    msg_id: String,
    limit: u64,
    dropped: u64,
    bytes: u64,
    /// Counts changed since the row was last written.
    dirty: bool,
}

impl Truncation {
    /// One more report of `raw` bytes dropped under this marker.
    fn count(&mut self, raw: u64) {
        self.dropped += 1;
        self.bytes += raw;
        self.dirty = true;
    }

    fn marker(&self) -> RecordingMarker {
        let reason = match self.scope {
            "execution" => "this execution's recording went over its cap; later messages of it are not recorded",
            _ => "this session's recording went over its cap; later messages are not recorded",
        };
        RecordingMarker::RecordingTruncated {
            scope: self.scope.to_string(),
            msg_id: self.msg_id.clone(),
            limit_bytes: self.limit,
            dropped_messages: self.dropped,
            dropped_bytes: self.bytes,
            reason: reason.to_string(),
        }
    }

    fn kind(&self) -> &'static str {
        self.marker().kind()
    }

    fn detail(&self) -> Value {
        self.marker().detail()
    }
}

impl Writer {
    /// A client's `execute_request`: a fresh execution budget. The oldest one is forgotten
    /// (its marker written a last time).
    pub(super) fn new_execution(&mut self, sid: i64, msg_id: &str) -> Result<(), DbError> {
        let b = self.budgets.entry(sid).or_default();
        b.executions.push_back(ExecutionBudget {
            msg_id: msg_id.to_string(),
            bytes: 0,
            open: None,
        });
        if b.executions.len() > MAX_EXECUTIONS {
            if let Some(t) = b.executions.pop_front().and_then(|e| e.open) {
                if t.dirty {
                    write_marker(self.db.as_mut(), sid, &t)?;
                }
            }
        }
        Ok(())
    }

    /// Whether a cap is in force for a report of `parent`: then it is dropped, counted.
    pub(super) fn dropping(&mut self, sid: i64, parent: Option<&str>, raw: u64) -> bool {
        let Some(t) = self
            .budgets
            .get_mut(&sid)
            .and_then(|b| b.open_marker(parent))
        else {
            return false;
        };
        t.count(raw);
        self.counters.truncated.fetch_add(1, Ordering::Relaxed);
        self.executions.dropped(sid, parent);
        true
    }

    /// A repeatable broker event (`StoredEvent::is_repeatable`: file changes, commands,
    /// egress, interrupts): charged to the session's cap only, never to an execution's, and
    /// past the session's cap dropped and counted by its marker.
    pub(super) fn charge_repeatable(
        &mut self,
        key: &SessionKey,
        sid: i64,
        time: i64,
        cost: u64,
        raw: u64,
    ) -> Result<Repeatable, DbError> {
        let max_session = self.max_session_bytes;
        let b = self.budgets.entry(sid).or_default();
        if let Some(t) = b.session_open.as_mut() {
            t.count(raw);
            self.counters.truncated.fetch_add(1, Ordering::Relaxed);
            return Ok(Repeatable::Dropped);
        }
        if b.session + cost <= max_session {
            b.session += cost;
            return Ok(Repeatable::Stored);
        }
        // The marker names the latest execution, as a session marker does.
        let latest = b
            .executions
            .back()
            .map(|e| e.msg_id.clone())
            .unwrap_or_default();
        let t = self.store_marker(key, sid, time, ("session", max_session), latest, raw)?;
        self.budgets.entry(sid).or_default().session_open = Some(t);
        Ok(Repeatable::DroppedAtNewMarker)
    }

    /// Charges `cost` to session `sid` and the execution of `parent` if it fits both caps.
    /// If not, opens the cap's marker (stored now, at this place in the session), counts
    /// this report as its first drop, and returns false.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn charge(
        &mut self,
        key: &SessionKey,
        sid: i64,
        parent: Option<&str>,
        time: i64,
        cost: u64,
        raw: u64,
    ) -> Result<bool, DbError> {
        let (max_exec, max_session) = (self.max_execution_bytes, self.max_session_bytes);
        let b = self.budgets.entry(sid).or_default();
        let session = b.session;
        let e = b.execution(parent);
        let (scope, limit) = if e.bytes + cost > max_exec {
            ("execution", max_exec)
        } else if session + cost > max_session {
            ("session", max_session)
        } else {
            e.bytes += cost;
            b.session += cost;
            return Ok(true);
        };
        let msg_id = e.msg_id.clone();
        let t = self.store_marker(key, sid, time, (scope, limit), msg_id, raw)?;
        let b = self.budgets.entry(sid).or_default();
        if scope == "session" {
            b.session_open = Some(t);
        } else {
            b.execution(parent).open = Some(t);
        }
        self.executions.dropped(sid, parent);
        Ok(false)
    }

    /// Stores a new `recording_truncated` marker of `scope` (at this place in the session),
    /// counting the report of `raw` bytes that reached the cap as its first drop.
    fn store_marker(
        &mut self,
        key: &SessionKey,
        sid: i64,
        time: i64,
        (scope, limit): (&'static str, u64),
        msg_id: String,
        raw: u64,
    ) -> Result<Truncation, DbError> {
        let (_, seq) = self.next_seq(key)?;
        let t = Truncation {
            seq,
            scope,
            msg_id,
            limit,
            dropped: 1,
            bytes: raw,
            dirty: false,
        };
        let detail = t.detail().to_string();
        self.db
            .insert_event(&EventRow::broker(sid, seq, time, t.kind(), &detail))?;
        tracing::info!(session = %key.id, scope, limit, msg_id = %t.msg_id, "recording: over the cap; not recording more");
        self.counters.truncated.fetch_add(1, Ordering::Relaxed);
        Ok(t)
    }

    /// Brings the open markers' counts up to date (inside the batch's transaction).
    pub(super) fn write_markers(&mut self) {
        for (sid, b) in self.budgets.iter_mut() {
            for t in b.markers().filter(|t| t.dirty) {
                t.dirty = false;
                if let Err(e) = write_marker(self.db.as_mut(), *sid, t) {
                    tracing::error!(error = %e, "recording: a truncation marker was not updated");
                }
            }
        }
    }

    /// The scope (`execution` or `session`) of the cap in force for a report of `parent`.
    pub(super) fn open_scope(&mut self, sid: i64, parent: Option<&str>) -> Option<&'static str> {
        self.budgets
            .get_mut(&sid)
            .and_then(|b| b.open_marker(parent))
            .map(|t| t.scope)
    }

    /// Takes back one drop a marker counted for a report that was stored after all.
    pub(super) fn undrop(&mut self, sid: i64, parent: Option<&str>, raw: u64) {
        if let Some(t) = self
            .budgets
            .get_mut(&sid)
            .and_then(|b| b.open_marker(parent))
        {
            t.dropped -= 1;
            t.bytes -= raw;
        }
    }
}

/// Rewrites a marker's row with its current counts.
fn write_marker(db: &mut dyn WriteDb, sid: i64, t: &Truncation) -> Result<(), DbError> {
    db.set_event_content(sid, t.seq, &t.detail().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(requests: &[&str]) -> Budget {
        let mut b = Budget::default();
        for r in requests {
            b.executions.push_back(ExecutionBudget {
                msg_id: r.to_string(),
                bytes: 0,
                open: None,
            });
        }
        b
    }

    #[test]
    fn output_counts_to_the_execution_it_names_else_the_latest() {
        // (recent requests, the report's parent, the execution charged)
        let cases: [(&[&str], Option<&str>, &str); 6] = [
            (&[], None, ""),
            (&[], Some("a"), ""),
            (&["a", "b"], Some("a"), "a"),
            (&["a", "b"], Some("b"), "b"),
            (&["a", "b"], Some("forged"), "b"),
            (&["a", "b"], None, "b"),
        ];
        for (requests, parent, want) in cases {
            let mut b = budget(requests);
            assert_eq!(b.execution(parent).msg_id, want, "{requests:?} {parent:?}");
            // Output before any request makes one unnamed execution, once.
            assert_eq!(b.executions.len(), requests.len().max(1));
        }
    }

    #[test]
    fn the_session_cap_covers_every_execution_and_an_execution_cap_only_its_own() {
        let marker = |scope| Truncation {
            seq: 1,
            scope,
            msg_id: "a".into(),
            limit: 10,
            dropped: 1,
            bytes: 5,
            dirty: false,
        };
        let mut b = budget(&["a", "b"]);
        assert!(b.open_marker(Some("a")).is_none());
        b.execution(Some("a")).open = Some(marker("execution"));
        assert_eq!(b.open_marker(Some("a")).map(|t| t.scope), Some("execution"));
        assert!(b.open_marker(Some("b")).is_none(), "b has its own budget");
        b.session_open = Some(marker("session"));
        assert_eq!(b.open_marker(Some("b")).map(|t| t.scope), Some("session"));
        assert_eq!(b.markers().count(), 2);
        b.forget_markers();
        assert_eq!(b.markers().count(), 0);
    }
}
