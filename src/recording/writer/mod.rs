//! The writer thread: the one connection that writes the recordings (the SQLite file, or
//! this broker's connection to PostgreSQL). It takes the queued reports in batches (as many
//! as are waiting, up to a bound) and stores each batch in one transaction, then answers the
//! barriers of the batch. Its database calls block ([`WriteDb`]), so this is a plain thread,
//! not a task; it also runs the retention once at start and then daily.
//!
//! Layout: this file is the thread (batches, transactions, barriers, session rows);
//! [`insert`] stores one report as rows (messages, broker events, blobs);
//! [`budget`] bounds what each session and execution stores; [`in_flight`] holds the
//! messages of agent executions in flight, so that an execution is stored once;
//! [`search`] says what goes into the search index and the session's counts of failures;
//! [`retention`] deletes recordings (on request, past the retention) and closes those a
//! killed broker left open.
//! The tables are in [`super::schema`].

mod budget;
mod in_flight;
mod insert;
mod retention;
mod search;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::db::{DbError, SessionDelta, WriteDb};
use super::event::BrokerEvent;
use super::{RecordingConfig, RecordingError};
use crate::session::Direction;
use crate::wire::{Channel, Message};

use budget::Budget;

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
    /// A lifecycle event of the session or a marker of the recording (never
    /// [`BrokerEvent::Unreadable`]: that is only read back).
    Event(BrokerEvent),
    /// An agent execution's end (an `execution_done`), with the output and result limits
    /// its output was gathered under.
    Done {
        event: BrokerEvent,
        limits: (usize, usize),
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

/// A session the writer has seen: its row and the next sequence number.
struct Known {
    sid: i64,
    next_seq: i64,
}

/// Per-session changes of one batch, applied to `sessions` once per batch. From one
/// insert: what it stored (`events` is 0, 1 or 2 with a marker).
type Touched = SessionDelta;

pub(super) struct Writer {
    db: Box<dyn WriteDb>,
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
    /// Agent executions in flight (see [`in_flight`]).
    executions: in_flight::Executions,
    /// Output being gathered for the search index (see [`search`]).
    search: search::SearchIndex,
}

const DAY: Duration = Duration::from_secs(86_400);
const BATCH_OPS: usize = 4096;
const BATCH_BYTES: usize = 64 << 20;
const MAX_REQUESTS: usize = 20_000;

impl Writer {
    pub fn new(db: Box<dyn WriteDb>, config: &RecordingConfig, counters: Arc<Counters>) -> Self {
        Self {
            db,
            known: HashMap::new(),
            requests: HashMap::new(),
            requests_len: 0,
            retention: config.retention,
            blob_threshold: config.blob_threshold,
            counters,
            budgets: HashMap::new(),
            max_execution_bytes: config.max_execution_bytes,
            max_session_bytes: config.max_session_bytes,
            executions: Default::default(),
            search: Default::default(),
        }
    }

    /// Run until a `Stop` arrives or every sender is gone.
    pub fn run(mut self, rx: mpsc::Receiver<Op>, kept: &std::collections::HashSet<Uuid>) {
        self.close_stale_sessions(kept);
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
        tracing::debug!(db = %self.db.describe(), "recording writer stopped");
    }

    /// Store one batch in one transaction; false once told to stop.
    fn apply(&mut self, batch: Vec<Op>) -> bool {
        let mut bytes = 0;
        let mut events = 0;
        let mut barriers = Vec::new();
        let mut deletions = Vec::new();
        let mut stop = None;
        let mut touched: HashMap<i64, Touched> = HashMap::new();
        let began = self.db.begin();
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
                            e.errors += t.errors;
                            e.last = e.last.max(time);
                            if t.ended.is_some() {
                                e.ended = t.ended;
                            }
                        }
                        Err(e) => {
                            // What it held may be part of an execution in flight.
                            if let Some(k) = self.known.get(&key.id) {
                                self.executions.lost(k.sid);
                            }
                            self.counters.errors.fetch_add(1, Ordering::Relaxed);
                            tracing::error!(session = %key.id, error = %e, "recording: an event was not stored");
                        }
                    }
                }
                Op::Barrier(tx) => barriers.push(tx),
                // After the commit, each in a transaction of its own: in PostgreSQL a
                // deletion takes a lock that batches (of every broker) take shared.
                Op::Delete { id, done } => deletions.push((done, id)),
                Op::Stop(tx) => {
                    stop = Some(tx);
                    break;
                }
            }
        }
        self.write_markers();
        let mut ended = Vec::new();
        for (sid, t) in &touched {
            if let Err(e) = self.db.update_session(*sid, t) {
                tracing::error!(error = %e, "recording: session counters not updated");
            }
            if t.ended.is_some() {
                ended.push(*sid);
            }
        }
        if began.is_ok() {
            if let Err(e) = self.db.commit() {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "recording: a batch could not be committed; its events are lost");
                self.db.rollback();
                // Sequence numbers handed out in the lost batch are free again, and the
                // requests it recorded are gone.
                self.known.clear();
                self.forget_requests();
                // Their markers may be gone too; the byte counts stay (an overestimate).
                for b in self.budgets.values_mut() {
                    b.forget_markers();
                }
                // And the messages of executions in flight with them.
                self.executions.all_lost();
                self.search.clear();
            }
        }
        // Ended sessions get no more events; forget them (a late one re-reads the row).
        self.known.retain(|_, k| !ended.contains(&k.sid));
        for sid in &ended {
            self.budgets.remove(sid);
            self.executions.forget(*sid);
            self.search.end(*sid);
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
        for (done, id) in deletions {
            let r = self.delete(id);
            let _ = done.send(r);
        }
        match stop {
            Some(tx) => {
                self.db.stop();
                let _ = tx.send(());
                false
            }
            None => true,
        }
    }

    /// The writer's entry of `key`'s session, creating the row if needed.
    fn known(&mut self, key: &SessionKey) -> Result<&mut Known, DbError> {
        use std::collections::hash_map::Entry;
        match self.known.entry(key.id) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => {
                let (sid, last) =
                    self.db
                        .session(key.id, &key.user, &key.kernel, key.created_at)?;
                Ok(e.insert(Known {
                    sid,
                    next_seq: last + 1,
                }))
            }
        }
    }

    /// The row and next sequence number of `key`'s session, creating the row if needed.
    fn next_seq(&mut self, key: &SessionKey) -> Result<(i64, i64), DbError> {
        let k = self.known(key)?;
        let seq = k.next_seq;
        k.next_seq += 1;
        Ok((k.sid, seq))
    }
}
