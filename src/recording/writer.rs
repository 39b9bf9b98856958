//! The writer thread: the one connection that writes the recordings file. It takes the
//! queued reports in batches (as many as are waiting, up to a bound) and stores each batch in
//! one transaction, then answers the barriers of the batch. rusqlite is blocking, so this is
//! a plain thread, not a task; it also runs the retention once at start and then daily.
//!
//! The schema (version 1):
//! - `sessions`: one row per recorded session: `id`, `user`, `kernel`, `created_at`,
//!   `ended_at`, `end_reason` (`closed`, `expired`, `broker_stopped`), counters.
//! - `events`: one row per message or broker event, `(sid, seq)` in order; `time` in
//!   microseconds since the epoch; the four JSON parts of a message as text (for a broker
//!   event, `content` holds its detail and `kind` its name). A kernel message whose
//!   `parent_header` is the header of a request recorded in the same session stores
//!   `parent_seq` (that request's `seq`) instead of a copy: a third of the file, put back on
//!   read.
//! - `blobs`: images taken out of events (see [`super::blobs`]) and binary buffers, once
//!   per SHA-256; `blob_refs` says which sessions use which, so deletion can collect them.
//!
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
//! are dropped too. A new execution has a fresh budget; the session cap stays in force. So
//! a session stores at most `max_session_bytes` plus ~200 bytes per later lifecycle event.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OptionalExtension};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::blobs::{self, Blob};
use super::event::RecordingMarker;
use super::{micros, RecordingConfig, RecordingError, Synchronous};
use crate::session::Direction;
use crate::wire::{Channel, Message};

pub(super) const SCHEMA_VERSION: i64 = 2;

const SCHEMA: &str = "
CREATE TABLE sessions (
    sid INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    user TEXT NOT NULL,
    kernel TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    ended_at INTEGER,
    end_reason TEXT,
    cells INTEGER NOT NULL DEFAULT 0,
    events INTEGER NOT NULL DEFAULT 0,
    last_event_at INTEGER
);
CREATE INDEX sessions_by_user ON sessions(user, created_at);
CREATE INDEX sessions_by_end ON sessions(ended_at) WHERE ended_at IS NOT NULL;
CREATE TABLE events (
    sid INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    time INTEGER NOT NULL,
    direction TEXT NOT NULL,
    channel TEXT,
    msg_type TEXT,
    msg_id TEXT,
    parent_msg_id TEXT,
    header TEXT,
    parent_header TEXT,
    parent_seq INTEGER,
    metadata TEXT,
    content TEXT,
    kind TEXT,
    has_blobs INTEGER NOT NULL DEFAULT 0,
    buffers TEXT,
    PRIMARY KEY (sid, seq)
);
CREATE TABLE blobs (
    sha256 TEXT PRIMARY KEY,
    base64 INTEGER NOT NULL,
    size INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE TABLE blob_refs (
    sha256 TEXT NOT NULL,
    sid INTEGER NOT NULL,
    PRIMARY KEY (sha256, sid)
) WITHOUT ROWID;
CREATE INDEX blob_refs_by_session ON blob_refs(sid);
";

/// Who a report belongs to (enough to create the session's row on first sight).
#[derive(Debug, Clone)]
pub(super) struct SessionKey {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    pub created_at: i64,
}

#[derive(Debug)]
pub(super) enum Item {
    Message {
        direction: Direction,
        channel: Channel,
        msg: Message,
    },
    Event {
        kind: String,
        detail: Value,
    },
}

// Records are nearly every op: boxing them would cost an allocation each.
#[allow(clippy::large_enum_variant)]
pub(super) enum Op {
    Record {
        key: SessionKey,
        time: i64,
        item: Item,
        /// What this report counts against the queue bound.
        size: usize,
    },
    Barrier(oneshot::Sender<()>),
    Delete {
        id: Uuid,
        done: oneshot::Sender<Result<bool, RecordingError>>,
    },
    Stop(oneshot::Sender<()>),
}

/// Counters shared with the store handle (and shown as metrics).
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub queued_bytes: AtomicUsize,
    pub dropped: AtomicU64,
    pub truncated: AtomicU64,
    pub errors: AtomicU64,
    pub batches: AtomicU64,
    pub events: AtomicU64,
}

fn sqlite(context: &'static str) -> impl FnOnce(rusqlite::Error) -> RecordingError {
    move |source| RecordingError::Sqlite { context, source }
}

/// Open (creating if needed) the recordings file for writing and bring its schema up to date.
pub(super) fn open(config: &RecordingConfig) -> Result<Connection, RecordingError> {
    let path = &config.path;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| RecordingError::Dir {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let open_err = |source| RecordingError::Open {
        path: path.clone(),
        source,
    };
    let conn = Connection::open(path).map_err(open_err)?;
    conn.busy_timeout(Duration::from_secs(10))
        .map_err(open_err)?;
    // auto_vacuum must be chosen before the first table exists; a no-op afterwards.
    conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL;")
        .map_err(open_err)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(open_err)?;
    if !mode.eq_ignore_ascii_case("wal") {
        tracing::warn!(path = %path.display(), %mode, "the recordings file is not in WAL mode");
    }
    let sync = match config.synchronous {
        Synchronous::Normal => "NORMAL",
        Synchronous::Full => "FULL",
    };
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {sync}; PRAGMA temp_store = MEMORY;"
    ))
    .map_err(open_err)?;
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(open_err)?;
    if version > SCHEMA_VERSION {
        return Err(RecordingError::SchemaTooNew {
            path: path.clone(),
            found: version,
            known: SCHEMA_VERSION,
        });
    }
    if version == 0 {
        conn.execute_batch(&format!(
            "BEGIN; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
        ))
        .map_err(open_err)?;
    }
    if version == 1 {
        conn.execute_batch(
            "BEGIN; ALTER TABLE events ADD COLUMN parent_seq INTEGER; PRAGMA user_version = 2; COMMIT;",
        )
        .map_err(open_err)?;
    }
    Ok(conn)
}

/// A session the writer has seen: its row and the next sequence number.
struct Known {
    sid: i64,
    next_seq: i64,
}

/// Broker event details up to this size are kept past a cap.
const KEPT_DETAIL_BYTES: usize = 1024;

/// Executions whose budgets a session keeps (output of older ones counts to the latest).
const MAX_EXECUTIONS: usize = 64;

/// What a session may still record (see "Budgets" above).
#[derive(Default)]
struct Budget {
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

    fn markers(&mut self) -> impl Iterator<Item = &mut Truncation> {
        self.session_open
            .iter_mut()
            .chain(self.executions.iter_mut().filter_map(|e| e.open.as_mut()))
    }
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
    fn detail(&self) -> Value {
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
        .detail()
    }
}

/// Per-session changes of one batch, applied to `sessions` once per batch. From one
/// insert: what it stored (`events` is 0, 1 or 2 with a marker).
#[derive(Default)]
struct Touched {
    events: i64,
    cells: i64,
    last: i64,
    ended: Option<(i64, &'static str)>,
}

pub(super) struct Writer {
    conn: Connection,
    path: PathBuf,
    known: HashMap<Uuid, Known>,
    /// Headers of recent requests to kernels, per session row and msg_id: (seq, header).
    requests: HashMap<i64, HashMap<String, (i64, Value)>>,
    requests_len: usize,
    retention: Option<Duration>,
    blob_threshold: usize,
    counters: Arc<Counters>,
    /// Per session row.
    budgets: HashMap<i64, Budget>,
    max_execution_bytes: u64,
    max_session_bytes: u64,
}

const DAY: Duration = Duration::from_secs(86_400);
const BATCH_OPS: usize = 4096;
const BATCH_BYTES: usize = 64 << 20;
const MAX_REQUESTS: usize = 20_000;

impl Writer {
    pub fn new(conn: Connection, config: &RecordingConfig, counters: Arc<Counters>) -> Self {
        Self {
            conn,
            path: config.path.clone(),
            known: HashMap::new(),
            requests: HashMap::new(),
            requests_len: 0,
            retention: config.retention,
            blob_threshold: config.blob_threshold,
            counters,
            budgets: HashMap::new(),
            max_execution_bytes: config.max_execution_bytes,
            max_session_bytes: config.max_session_bytes,
        }
    }

    /// Run until a `Stop` arrives or every sender is gone.
    pub fn run(mut self, rx: mpsc::Receiver<Op>) {
        self.close_stale_sessions();
        self.retention_pass();
        let mut next_retention = Instant::now() + DAY;
        loop {
            let wait = next_retention.saturating_duration_since(Instant::now());
            let first = match rx.recv_timeout(wait) {
                Ok(op) => op,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.retention_pass();
                    next_retention = Instant::now() + DAY;
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            let mut batch = vec![first];
            let mut bytes = 0;
            while batch.len() < BATCH_OPS && bytes < BATCH_BYTES {
                match rx.try_recv() {
                    Ok(op) => {
                        if let Op::Record { size, .. } = &op {
                            bytes += size;
                        }
                        batch.push(op)
                    }
                    Err(_) => break,
                }
            }
            if !self.apply(batch) {
                break;
            }
        }
        tracing::debug!(path = %self.path.display(), "recording writer stopped");
    }

    /// Store one batch in one transaction; false once told to stop.
    fn apply(&mut self, batch: Vec<Op>) -> bool {
        let mut bytes = 0;
        let mut events = 0;
        let mut barriers = Vec::new();
        let mut deletions = Vec::new();
        let mut stop = None;
        let mut touched: HashMap<i64, Touched> = HashMap::new();
        let began = self.conn.execute_batch("BEGIN IMMEDIATE");
        if let Err(e) = &began {
            tracing::error!(error = %e, "recording: could not begin a transaction");
        }
        for op in batch {
            match op {
                Op::Record {
                    key,
                    time,
                    item,
                    size,
                } => {
                    bytes += size;
                    match self.insert(&key, time, item) {
                        Ok((sid, t)) => {
                            events += t.events as u64;
                            let e = touched.entry(sid).or_default();
                            e.events += t.events;
                            e.cells += t.cells;
                            e.last = e.last.max(time);
                            if t.ended.is_some() {
                                e.ended = t.ended;
                            }
                        }
                        Err(e) => {
                            self.counters.errors.fetch_add(1, Ordering::Relaxed);
                            tracing::error!(session = %key.id, error = %e, "recording: an event was not stored");
                        }
                    }
                }
                Op::Barrier(tx) => barriers.push(tx),
                Op::Delete { id, done } => {
                    let r = self.delete(id);
                    deletions.push((done, r));
                }
                Op::Stop(tx) => {
                    stop = Some(tx);
                    break;
                }
            }
        }
        self.write_markers();
        let mut ended = Vec::new();
        for (sid, t) in &touched {
            let r = self.conn.prepare_cached(
                "UPDATE sessions SET events = events + ?2, cells = cells + ?3,
                   last_event_at = max(coalesce(last_event_at, 0), ?4),
                   ended_at = coalesce(?5, ended_at), end_reason = coalesce(?6, end_reason)
                 WHERE sid = ?1",
            );
            let r = r.and_then(|mut st| {
                st.execute(params![
                    sid,
                    t.events,
                    t.cells,
                    t.last,
                    t.ended.map(|e| e.0),
                    t.ended.map(|e| e.1)
                ])
            });
            if let Err(e) = r {
                tracing::error!(error = %e, "recording: session counters not updated");
            }
            if t.ended.is_some() {
                ended.push(*sid);
            }
        }
        if began.is_ok() {
            if let Err(e) = self.conn.execute_batch("COMMIT") {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "recording: a batch could not be committed; its events are lost");
                let _ = self.conn.execute_batch("ROLLBACK");
                // Sequence numbers handed out in the lost batch are free again, and the
                // requests it recorded are gone.
                self.known.clear();
                self.forget_requests();
                // Their markers may be gone too; the byte counts stay (an overestimate).
                for b in self.budgets.values_mut() {
                    b.session_open = None;
                    for e in b.executions.iter_mut() {
                        e.open = None;
                    }
                }
            }
        }
        // Ended sessions get no more events; forget them (a late one re-reads the row).
        self.known.retain(|_, k| !ended.contains(&k.sid));
        for sid in &ended {
            self.budgets.remove(sid);
            if let Some(m) = self.requests.remove(sid) {
                self.requests_len -= m.len();
            }
        }
        self.counters
            .queued_bytes
            .fetch_sub(bytes, Ordering::AcqRel);
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.events.fetch_add(events, Ordering::Relaxed);
        for tx in barriers {
            let _ = tx.send(());
        }
        for (done, r) in deletions {
            let _ = done.send(r);
        }
        match stop {
            Some(tx) => {
                let _ = self.conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)");
                let _ = tx.send(());
                false
            }
            None => true,
        }
    }

    /// The writer's entry of `key`'s session, creating the row if needed.
    fn known(&mut self, key: &SessionKey) -> rusqlite::Result<&mut Known> {
        use std::collections::hash_map::Entry;
        match self.known.entry(key.id) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => {
                let id = key.id.to_string();
                self.conn
                    .prepare_cached(
                        "INSERT INTO sessions (id, user, kernel, created_at) VALUES (?1, ?2, ?3, ?4)
                         ON CONFLICT (id) DO NOTHING",
                    )?
                    .execute(params![id, key.user, key.kernel, key.created_at])?;
                let sid: i64 = self
                    .conn
                    .prepare_cached("SELECT sid FROM sessions WHERE id = ?1")?
                    .query_row([&id], |r| r.get(0))?;
                let last: i64 = self
                    .conn
                    .prepare_cached("SELECT coalesce(max(seq), 0) FROM events WHERE sid = ?1")?
                    .query_row([sid], |r| r.get(0))?;
                Ok(e.insert(Known {
                    sid,
                    next_seq: last + 1,
                }))
            }
        }
    }

    /// The row and next sequence number of `key`'s session, creating the row if needed.
    fn next_seq(&mut self, key: &SessionKey) -> rusqlite::Result<(i64, i64)> {
        let k = self.known(key)?;
        let seq = k.next_seq;
        k.next_seq += 1;
        Ok((k.sid, seq))
    }

    /// Whether session `sid` stores no image or buffer `sha` yet (it would cost its bytes).
    fn blob_is_new(&self, sid: i64, sha: &str) -> rusqlite::Result<bool> {
        let found: Option<i64> = self
            .conn
            .prepare_cached("SELECT 1 FROM blob_refs WHERE sha256 = ?1 AND sid = ?2")?
            .query_row(params![sha, sid], |r| r.get(0))
            .optional()?;
        Ok(found.is_none())
    }

    /// A client's `execute_request`: a fresh execution budget. The oldest one is forgotten
    /// (its marker written a last time).
    fn new_execution(&mut self, sid: i64, msg_id: &str) -> rusqlite::Result<()> {
        let b = self.budgets.entry(sid).or_default();
        b.executions.push_back(ExecutionBudget {
            msg_id: msg_id.to_string(),
            bytes: 0,
            open: None,
        });
        if b.executions.len() > MAX_EXECUTIONS {
            if let Some(t) = b.executions.pop_front().and_then(|e| e.open) {
                if t.dirty {
                    write_marker(&self.conn, sid, &t)?;
                }
            }
        }
        Ok(())
    }

    /// Whether a cap is in force for a report of `parent`: then it is dropped, counted.
    fn dropping(&mut self, sid: i64, parent: Option<&str>, raw: u64) -> bool {
        let Some(t) = self
            .budgets
            .get_mut(&sid)
            .and_then(|b| b.open_marker(parent))
        else {
            return false;
        };
        t.dropped += 1;
        t.bytes += raw;
        t.dirty = true;
        self.counters.truncated.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Charges `cost` to session `sid` and the execution of `parent` if it fits both caps.
    /// If not, opens the cap's marker (stored now, at this place in the session), counts
    /// this report as its first drop, and returns false.
    #[allow(clippy::too_many_arguments)]
    fn charge(
        &mut self,
        key: &SessionKey,
        sid: i64,
        parent: Option<&str>,
        time: i64,
        cost: u64,
        raw: u64,
    ) -> rusqlite::Result<bool> {
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
        self.conn
            .prepare_cached(
                "INSERT INTO events (sid, seq, time, direction, kind, content)
                 VALUES (?1, ?2, ?3, 'broker', 'recording_truncated', ?4)",
            )?
            .execute(params![sid, seq, time, t.detail().to_string()])?;
        tracing::info!(session = %key.id, scope, limit, msg_id = %t.msg_id, "recording: over the cap; not recording more");
        self.counters.truncated.fetch_add(1, Ordering::Relaxed);
        let b = self.budgets.entry(sid).or_default();
        if scope == "session" {
            b.session_open = Some(t);
        } else {
            b.execution(parent).open = Some(t);
        }
        Ok(false)
    }

    /// Brings the open markers' counts up to date (inside the batch's transaction).
    fn write_markers(&mut self) {
        for (sid, b) in self.budgets.iter_mut() {
            for t in b.markers().filter(|t| t.dirty) {
                t.dirty = false;
                if let Err(e) = write_marker(&self.conn, *sid, t) {
                    tracing::error!(error = %e, "recording: a truncation marker was not updated");
                }
            }
        }
    }

    /// Stores one report within the session's budget (see "Budgets").
    fn insert(
        &mut self,
        key: &SessionKey,
        time: i64,
        item: Item,
    ) -> rusqlite::Result<(i64, Touched)> {
        let sid = self.known(key)?.sid;
        let mut touched = Touched::default();
        match item {
            Item::Message {
                direction,
                channel,
                msg,
            } => {
                if direction == Direction::ToKernel
                    && channel == Channel::Shell
                    && msg.msg_type == "execute_request"
                {
                    self.new_execution(sid, &msg.msg_id)?;
                }
                let raw = (msg.header.len()
                    + msg.parent_header.len()
                    + msg.metadata.len()
                    + msg.content.len()
                    + msg.buffers.iter().map(|b| b.len()).sum::<usize>())
                    as u64;
                let parent = msg.parent_msg_id.clone();
                let parent = match direction {
                    Direction::ToKernel => Some(msg.msg_id.as_str()),
                    Direction::FromKernel => parent.as_deref(),
                };
                if self.dropping(sid, parent, raw) {
                    return Ok((sid, touched));
                }
                let mut content = json_text(&msg.content);
                let mut images = Vec::new();
                if direction == Direction::FromKernel
                    && channel == Channel::Iopub
                    && matches!(
                        msg.msg_type.as_str(),
                        "display_data" | "execute_result" | "update_display_data"
                    )
                    && content.len() >= self.blob_threshold
                {
                    if let Some((text, found)) = self.extract_blobs(&content) {
                        content = text;
                        images = found;
                    }
                }
                let header = json_text(&msg.header);
                let (parent_header, parent_seq) = self.parent_of(sid, direction, &msg);
                let metadata = json_text(&msg.metadata);
                let buffer_shas: Vec<String> = msg
                    .buffers
                    .iter()
                    .map(|b| hex::encode(Sha256::digest(b)))
                    .collect();
                let mut cost = header.len()
                    + parent_header.as_ref().map_or(0, String::len)
                    + metadata.len()
                    + content.len();
                for b in &images {
                    if self.blob_is_new(sid, &b.sha256)? {
                        cost += b.data.len();
                    }
                }
                for (sha, b) in buffer_shas.iter().zip(&msg.buffers) {
                    if self.blob_is_new(sid, sha)? {
                        cost += b.len();
                    }
                }
                if !self.charge(key, sid, parent, time, cost as u64, raw)? {
                    touched.events = 1;
                    return Ok((sid, touched));
                }
                for b in &images {
                    let size = b.text().len();
                    self.put_blob(sid, &b.sha256, b.base64, &b.data, size)?;
                }
                let buffers = if msg.buffers.is_empty() {
                    None
                } else {
                    for (sha, b) in buffer_shas.iter().zip(&msg.buffers) {
                        self.put_blob(sid, sha, false, b, b.len())?;
                    }
                    let hashes = buffer_shas.into_iter().map(Value::String).collect();
                    Some(Value::Array(hashes).to_string())
                };
                let (_, seq) = self.next_seq(key)?;
                if direction == Direction::ToKernel
                    && channel == Channel::Shell
                    && msg.msg_type == "execute_request"
                    && !is_silent(&msg.content)
                {
                    touched.cells = 1;
                }
                if direction == Direction::ToKernel {
                    if let Ok(v) = serde_json::from_str::<Value>(&header) {
                        self.remember_request(sid, &msg.msg_id, seq, v);
                    }
                }
                let direction = match direction {
                    Direction::ToKernel => "to_kernel",
                    Direction::FromKernel => "from_kernel",
                };
                self.conn
                    .prepare_cached(
                        "INSERT INTO events (sid, seq, time, direction, channel, msg_type, msg_id,
                           parent_msg_id, header, parent_header, parent_seq, metadata, content,
                           has_blobs, buffers)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
                    )?
                    .execute(params![
                        sid,
                        seq,
                        time,
                        direction,
                        channel.as_str(),
                        msg.msg_type,
                        msg.msg_id,
                        msg.parent_msg_id,
                        header,
                        parent_header,
                        parent_seq,
                        metadata,
                        content,
                        !images.is_empty(),
                        buffers,
                    ])?;
                touched.events = 1;
            }
            Item::Event { kind, mut detail } => {
                let raw = value_len(&detail);
                let execution = kind.starts_with("execution_");
                let mut found = blobs::extract(&mut detail, self.blob_threshold);
                let mut text = detail.to_string();
                let mut cost = text.len();
                for b in &found {
                    if self.blob_is_new(sid, &b.sha256)? {
                        cost += b.data.len();
                    }
                }
                let parent = detail
                    .get("msg_id")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                let parent = parent.as_deref();
                let open = self
                    .budgets
                    .get_mut(&sid)
                    .and_then(|b| b.open_marker(parent))
                    .map(|t| t.scope);
                let kept = match open {
                    Some(_) => false,
                    None if self.charge(key, sid, parent, time, cost as u64, raw)? => true,
                    None => {
                        // Over a cap now: the marker is stored and counts this event.
                        touched.events += 1;
                        false
                    }
                };
                if !kept {
                    let scope = self
                        .budgets
                        .get_mut(&sid)
                        .and_then(|b| b.open_marker(parent))
                        .map(|t| t.scope);
                    let drop = execution && scope == Some("session");
                    let cut = !drop && (execution || text.len() > KEPT_DETAIL_BYTES);
                    if open.is_some() && (drop || cut) {
                        self.dropping(sid, parent, raw);
                    } else if open.is_none() && !drop && !cut {
                        // The marker counted this event, but it is stored whole after all.
                        if let Some(t) = self
                            .budgets
                            .get_mut(&sid)
                            .and_then(|b| b.open_marker(parent))
                        {
                            t.dropped -= 1;
                            t.bytes -= raw;
                        }
                    }
                    if drop {
                        return Ok((sid, touched));
                    }
                    if cut {
                        let mut short = json!({"recording_truncated": true, "bytes": raw});
                        if let Some(id) = detail.get("msg_id") {
                            short["msg_id"] = id.clone();
                        }
                        text = short.to_string();
                        found.clear();
                    }
                }
                for b in &found {
                    let size = b.text().len();
                    self.put_blob(sid, &b.sha256, b.base64, &b.data, size)?;
                }
                touched.ended = match kind.as_str() {
                    "session_closed" => Some((time, "closed")),
                    "session_expired" => Some((time, "expired")),
                    _ => None,
                };
                let (_, seq) = self.next_seq(key)?;
                self.conn
                    .prepare_cached(
                        "INSERT INTO events (sid, seq, time, direction, kind, content, has_blobs)
                         VALUES (?1, ?2, ?3, 'broker', ?4, ?5, ?6)",
                    )?
                    .execute(params![sid, seq, time, kind, text, !found.is_empty()])?;
                touched.events += 1;
            }
        }
        Ok((sid, touched))
    }

    /// How to store a message's parent header: a reference to the recorded request it
    /// equals (as JSON), or the text itself.
    fn parent_of(
        &self,
        sid: i64,
        direction: Direction,
        msg: &Message,
    ) -> (Option<String>, Option<i64>) {
        if direction == Direction::FromKernel {
            let request = msg
                .parent_msg_id
                .as_deref()
                .and_then(|p| self.requests.get(&sid)?.get(p));
            if let Some((seq, header)) = request {
                if serde_json::from_slice::<Value>(&msg.parent_header)
                    .ok()
                    .as_ref()
                    == Some(header)
                {
                    return (None, Some(*seq));
                }
            }
        }
        (Some(json_text(&msg.parent_header)), None)
    }

    fn remember_request(&mut self, sid: i64, msg_id: &str, seq: i64, header: Value) {
        // Replies come within seconds; a bound keeps a flood of requests from piling up.
        if self.requests_len >= MAX_REQUESTS {
            self.forget_requests();
        }
        let m = self.requests.entry(sid).or_default();
        if m.insert(msg_id.to_string(), (seq, header)).is_none() {
            self.requests_len += 1;
        }
    }

    fn forget_requests(&mut self) {
        self.requests.clear();
        self.requests_len = 0;
    }

    /// The images of a message's content, taken out (the text with references, and the
    /// blobs); `None` when it is not JSON or holds no image.
    fn extract_blobs(&self, content: &str) -> Option<(String, Vec<Blob>)> {
        let mut v = serde_json::from_str::<Value>(content).ok()?;
        let found = blobs::extract(&mut v, self.blob_threshold);
        if found.is_empty() {
            return None;
        }
        Some((v.to_string(), found))
    }

    fn put_blob(
        &mut self,
        sid: i64,
        sha: &str,
        base64: bool,
        data: &[u8],
        size: usize,
    ) -> rusqlite::Result<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO blobs (sha256, base64, size, data) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (sha256) DO NOTHING",
            )?
            .execute(params![sha, base64, size as i64, data])?;
        self.conn
            .prepare_cached(
                "INSERT INTO blob_refs (sha256, sid) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
            )?
            .execute(params![sha, sid])?;
        Ok(())
    }

    /// Delete the recording of session `id` (inside the caller's transaction).
    fn delete(&mut self, id: Uuid) -> Result<bool, RecordingError> {
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

    /// Sessions left open by a broker that did not stop cleanly cannot be live any more.
    fn close_stale_sessions(&mut self) {
        let now = micros(chrono::Utc::now());
        let r = (|| -> rusqlite::Result<usize> {
            let tx = self.conn.transaction()?;
            let stale: Vec<i64> = {
                let mut st = tx.prepare("SELECT sid FROM sessions WHERE ended_at IS NULL")?;
                let rows = st.query_map([], |r| r.get(0))?;
                rows.collect::<Result<_, _>>()?
            };
            for sid in &stale {
                let seq: i64 = tx.query_row(
                    "SELECT coalesce(max(seq), 0) + 1 FROM events WHERE sid = ?1",
                    [sid],
                    |r| r.get(0),
                )?;
                let detail = RecordingMarker::BrokerStopped {
                    reason: "the broker stopped without closing this session (it was killed or crashed); the session ended with it".into(),
                }
                .detail();
                tx.execute(
                    "INSERT INTO events (sid, seq, time, direction, kind, content)
                     VALUES (?1, ?2, ?3, 'broker', 'broker_stopped', ?4)",
                    params![sid, seq, now, detail.to_string()],
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
    fn retention_pass(&mut self) {
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

/// A message part as JSON text: as received when it is JSON, else as a JSON string.
/// Bytes of a broker event's detail as JSON text.
fn value_len(v: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    // Writing to a counter cannot fail; a failure would only undercount.
    let _ = serde_json::to_writer(&mut n, v);
    n.0
}

/// Rewrites a marker's row with its current counts.
fn write_marker(conn: &Connection, sid: i64, t: &Truncation) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE events SET content = ?3 WHERE sid = ?1 AND seq = ?2")?
        .execute(params![sid, t.seq, t.detail().to_string()])?;
    Ok(())
}

fn json_text(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "{}".into();
    }
    match std::str::from_utf8(bytes) {
        Ok(s) if serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok() => s.to_string(),
        _ => Value::String(String::from_utf8_lossy(bytes).into_owned()).to_string(),
    }
}

fn is_silent(content: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Req {
        #[serde(default)]
        silent: bool,
    }
    serde_json::from_slice::<Req>(content)
        .map(|r| r.silent)
        .unwrap_or(false)
}

/// A blob's original string by SHA-256 (for readers).
pub(super) fn blob_text(conn: &Connection, sha: &str) -> rusqlite::Result<Option<String>> {
    conn.prepare_cached("SELECT base64, data FROM blobs WHERE sha256 = ?1")?
        .query_row([sha], |r| {
            let b64: bool = r.get(0)?;
            let data: Vec<u8> = r.get(1)?;
            Ok(Blob::text_of(&data, b64))
        })
        .optional()
}

/// A blob's raw bytes (binary buffers).
pub(super) fn blob_bytes(conn: &Connection, sha: &str) -> rusqlite::Result<Option<Vec<u8>>> {
    conn.prepare_cached("SELECT data FROM blobs WHERE sha256 = ?1")?
        .query_row([sha], |r| r.get(0))
        .optional()
}

/// Open a read-only connection to the recordings file.
pub(super) fn open_reader(path: &Path) -> Result<Connection, RecordingError> {
    use rusqlite::OpenFlags;
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(|source| RecordingError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    conn.busy_timeout(Duration::from_secs(10))
        .map_err(sqlite("set the busy timeout"))?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_parts_are_kept_or_quoted() {
        let cases: [(&[u8], &str); 4] = [
            (b"", "{}"),
            (br#"{"a": 1}"#, r#"{"a": 1}"#),
            (b"not json", r#""not json""#),
            (b"\xff{", "\"\u{fffd}{\""),
        ];
        for (input, want) in cases {
            assert_eq!(json_text(input), want);
        }
    }

    #[test]
    fn a_version_1_file_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = RecordingConfig::new(dir.path().join("r.sqlite3"));
        let conn = open(&cfg).unwrap();
        conn.execute_batch("ALTER TABLE events DROP COLUMN parent_seq; PRAGMA user_version = 1;")
            .unwrap();
        drop(conn);
        let conn = open(&cfg).unwrap();
        let v: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        conn.execute(
            "INSERT INTO events (sid, seq, time, direction, parent_seq) VALUES (1, 1, 0, 'x', 7)",
            [],
        )
        .unwrap();
        conn.execute_batch("PRAGMA user_version = 99").unwrap();
        drop(conn);
        assert!(matches!(
            open(&cfg),
            Err(RecordingError::SchemaTooNew { found: 99, .. })
        ));
    }

    #[test]
    fn silent_requests_are_no_cells() {
        assert!(is_silent(br#"{"code": "x", "silent": true}"#));
        assert!(!is_silent(br#"{"code": "x"}"#));
        assert!(!is_silent(b"garbage"));
    }
}
