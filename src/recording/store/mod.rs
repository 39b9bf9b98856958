//! The recording store: the handle the session layer reports to (it implements
//! [`Recorder`]) and the API reads from. Reports go to the writer thread ([`super::writer`])
//! through an unbounded channel whose memory is bounded by counting bytes. Reads
//! ([`super::queries`]) use a small pool of read-only connections to the SQLite file on
//! blocking threads (in WAL mode readers never wait for the writer, and see every committed
//! batch), or a pool of async PostgreSQL connections ([`super::postgres`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use chrono::Utc;
use futures::future::BoxFuture;
use rusqlite::Connection;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::db::WriteDb;
use super::event::{BrokerEvent, RecordingMarker};
use super::listing;
use super::postgres::{self, PgDb};
use super::queries::{self, EventQuery, EventsPage, Readers, RecordedEvent, RecordingInfo};
use super::search::{ListQuery, ListedRecording};
use super::sqlite::SqliteDb;
use super::writer::{self, Counters, Item, Op, SessionKey};
use super::{micros, schema, RecordingConfig, RecordingError};
use crate::session::{BoxError, Direction, LifecycleEvent, Recorder, Session};
use crate::sync::lock;
use crate::wire::{Channel, Message};

#[cfg(test)]
mod tests;

/// Counters of the recording, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordingStats {
    pub queued_bytes: usize,
    /// Reports dropped because the queue was over its bound.
    pub dropped: u64,
    /// Messages not recorded because an execution or session went over its cap.
    pub truncated: u64,
    /// Events that could not be stored.
    pub errors: u64,
    pub batches: u64,
    pub events: u64,
}

/// The recordings of the broker. Cheap to share behind an `Arc`.
pub struct RecordingStore {
    tx: mpsc::Sender<Op>,
    counters: Arc<Counters>,
    config: RecordingConfig,
    /// Reports dropped per session since its last `recording_gap` marker.
    gaps: Mutex<HashMap<Uuid, u64>>,
    gaps_pending: AtomicUsize,
    reads: Reads,
}

/// Where reads go. Cheap to clone (a lookup that outlives the borrow of the store).
#[derive(Clone)]
enum Reads {
    Sqlite(Arc<Readers>),
    Postgres(Arc<postgres::Pool>),
}

impl Reads {
    async fn info(&self, id: Uuid) -> Result<Option<RecordingInfo>, RecordingError> {
        match self {
            Reads::Sqlite(r) => RecordingStore::read(r, move |conn| queries::info(conn, id)).await,
            Reads::Postgres(p) => p.info(id).await,
        }
    }
}

impl RecordingStore {
    /// Open (or create) the recordings (the file, or the PostgreSQL schema) and start the
    /// writer thread.
    pub fn open(config: RecordingConfig) -> Result<Arc<Self>, RecordingError> {
        let counters = Arc::new(Counters::default());
        let (tx, rx) = mpsc::channel();
        let kept = config.kept_sessions.clone();
        let spawn_err = |source| RecordingError::Dir {
            path: config.path.clone(),
            source,
        };
        let reads = match &config.database_url {
            None => {
                let db = SqliteDb::new(schema::open(&config)?, config.path.clone());
                let w = writer::Writer::new(Box::new(db), &config, counters.clone());
                std::thread::Builder::new()
                    .name("recording-writer".into())
                    .spawn(move || w.run(rx, &kept))
                    .map_err(spawn_err)?;
                tracing::info!(path = %config.path.display(), "recording sessions");
                Reads::Sqlite(Arc::new(Readers::new(config.path.clone())))
            }
            Some(url) => {
                // The writer's connection lives on the writer thread, with a runtime of its
                // own; it connects and migrates there, and says how that went.
                let (opened_tx, opened) = mpsc::channel();
                let (url_w, node, cfg) = (url.clone(), config.node.clone(), config.clone());
                let c = counters.clone();
                std::thread::Builder::new()
                    .name("recording-writer".into())
                    .spawn(move || match PgDb::open(&url_w, &node) {
                        Ok(db) => {
                            let _ = opened_tx.send(Ok(()));
                            let db: Box<dyn WriteDb> = Box::new(db);
                            writer::Writer::new(db, &cfg, c).run(rx, &kept)
                        }
                        Err(e) => {
                            let _ = opened_tx.send(Err(e));
                        }
                    })
                    .map_err(spawn_err)?;
                opened.recv().map_err(|_| RecordingError::WriterGone)??;
                tracing::info!(db = %postgres::redact(url), node = %config.node, "recording sessions in PostgreSQL");
                Reads::Postgres(Arc::new(postgres::Pool::new(url, READ_CONNECTIONS)?))
            }
        };
        Ok(Arc::new(Self {
            tx,
            counters,
            reads,
            config,
            gaps: Mutex::new(HashMap::new()),
            gaps_pending: AtomicUsize::new(0),
        }))
    }

    pub fn config(&self) -> &RecordingConfig {
        &self.config
    }

    pub fn stats(&self) -> RecordingStats {
        let c = &self.counters;
        RecordingStats {
            queued_bytes: c.queued_bytes.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            truncated: c.truncated.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
            events: c.events.load(Ordering::Relaxed),
        }
    }

    /// Wait until everything reported so far is committed.
    pub async fn flush(&self) {
        self.barrier().await
    }

    /// Commit what is queued and stop the writer; later reports are ignored.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Stop(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    async fn read<T: Send + 'static>(
        readers: &Arc<Readers>,
        f: impl FnOnce(&Connection) -> Result<T, RecordingError> + Send + 'static,
    ) -> Result<T, RecordingError> {
        let readers = readers.clone();
        tokio::task::spawn_blocking(move || readers.with(f))
            .await
            .map_err(RecordingError::Task)?
    }

    /// The recorded session `id`, whoever owns it.
    pub async fn info(&self, id: Uuid) -> Result<Option<RecordingInfo>, RecordingError> {
        self.reads.info(id).await
    }

    /// `user`'s recorded sessions, newest first.
    pub async fn list(
        &self,
        user: &str,
        limit: usize,
    ) -> Result<Vec<RecordingInfo>, RecordingError> {
        match &self.reads {
            Reads::Sqlite(r) => {
                let user = user.to_string();
                Self::read(r, move |conn| queries::list(conn, &user, limit)).await
            }
            Reads::Postgres(p) => p.list(user, limit).await,
        }
    }

    /// The sessions `query` asks for (always of its user), filtered and searched in the
    /// database, newest first.
    pub async fn find(&self, query: ListQuery) -> Result<Vec<ListedRecording>, RecordingError> {
        self.find_capped(query, listing::CANDIDATES).await
    }

    /// [`RecordingStore::find`], text in more than `cap` rows counting as common (see
    /// `listing`): tests take both ways with few rows.
    async fn find_capped(
        &self,
        query: ListQuery,
        cap: usize,
    ) -> Result<Vec<ListedRecording>, RecordingError> {
        match &self.reads {
            Reads::Sqlite(r) => Self::read(r, move |conn| listing::list(conn, &query, cap)).await,
            Reads::Postgres(p) => p.list_filtered(&query, cap).await,
        }
    }

    /// A page of session `id`'s events.
    pub async fn events(&self, id: Uuid, query: EventQuery) -> Result<EventsPage, RecordingError> {
        match &self.reads {
            Reads::Sqlite(r) => {
                Self::read(r, move |conn| queries::read_events(conn, id, &query)).await
            }
            Reads::Postgres(p) => p.events(id, &query).await,
        }
    }

    /// Every event of session `id`, in order.
    pub async fn all_events(&self, id: Uuid) -> Result<Vec<RecordedEvent>, RecordingError> {
        match &self.reads {
            Reads::Sqlite(r) => Self::read(r, move |conn| queries::all_events(conn, id)).await,
            Reads::Postgres(p) => p.all_events(id).await,
        }
    }

    /// Delete session `id`'s recording; false when there was none.
    pub async fn delete(&self, id: Uuid) -> Result<bool, RecordingError> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Op::Delete { id, done })
            .map_err(|_| RecordingError::WriterGone)?;
        rx.await.map_err(|_| RecordingError::WriterGone)?
    }

    fn send(&self, op: Op) {
        // The writer has stopped (the broker is shutting down): nothing to count against.
        if let Err(mpsc::SendError(Op::Record { size, .. })) = self.tx.send(op) {
            self.counters.queued_bytes.fetch_sub(size, Ordering::AcqRel);
        }
    }

    /// Queue one report, unless the queue is over its bound.
    fn report(&self, key: SessionKey, item: Item) {
        let time = micros(Utc::now());
        let size = item_size(&item);
        let before = self.counters.queued_bytes.fetch_add(size, Ordering::AcqRel);
        if before + size > self.config.max_queue_bytes {
            self.counters.queued_bytes.fetch_sub(size, Ordering::AcqRel);
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            let mut gaps = lock(&self.gaps);
            let n = gaps.entry(key.id).or_insert(0);
            if *n == 0 {
                self.gaps_pending.fetch_add(1, Ordering::AcqRel);
                tracing::warn!(
                    session = %key.id,
                    queued_bytes = before,
                    limit = self.config.max_queue_bytes,
                    "recording: the writer is behind; dropping this session's reports until it catches up"
                );
            }
            *n += 1;
            return;
        }
        if self.gaps_pending.load(Ordering::Acquire) > 0 {
            // The marker is queued under the lock, and only then is it no longer pending:
            // a report that finds none pending comes after it, so the writer learns of the
            // gap before any later report of the session (its execution's end, say: see
            // `writer::in_flight`).
            let mut gaps = lock(&self.gaps);
            if let Some(n) = gaps.remove(&key.id) {
                self.marker(
                    &key,
                    time,
                    RecordingMarker::RecordingGap {
                        dropped: n,
                        reason: "the recording writer fell behind; these reports were not recorded"
                            .into(),
                    },
                );
                self.gaps_pending.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.send(Op::Record {
            key,
            time,
            item,
            size,
        });
    }

    /// Queue a small broker event of the recording itself (not counted against the bound).
    fn marker(&self, key: &SessionKey, time: i64, marker: RecordingMarker) {
        let item = Item::Event(BrokerEvent::Recording(marker));
        let size = item_size(&item);
        self.counters.queued_bytes.fetch_add(size, Ordering::AcqRel);
        self.send(Op::Record {
            key: key.clone(),
            time,
            item,
            size,
        });
    }

    fn report_message(
        &self,
        key: SessionKey,
        direction: Direction,
        channel: Channel,
        msg: &Message,
    ) {
        // Budgets per execution and session are kept by the writer, which knows what a
        // message costs once its images are stored.
        self.report(
            key,
            Item::Message {
                direction,
                channel,
                msg: msg.clone(),
            },
        );
    }

    fn report_event(&self, key: SessionKey, event: LifecycleEvent) {
        let item = match event {
            LifecycleEvent::ExecutionDone {
                output_limit,
                result_limit,
                ..
            } => Item::Done {
                event: BrokerEvent::Session(event.into()),
                limits: (output_limit, result_limit),
            },
            event => Item::Event(BrokerEvent::Session(event.into())),
        };
        self.report(key, item);
    }
}

fn key_of(session: &Session) -> SessionKey {
    SessionKey {
        id: session.id,
        user: session.user.name.clone(),
        kernel: session.kernel_name.clone(),
        created_at: micros(session.created_at),
    }
}

impl Recorder for RecordingStore {
    fn message(&self, session: &Session, direction: Direction, channel: Channel, msg: &Message) {
        self.report_message(key_of(session), direction, channel, msg);
    }

    fn event(&self, session: &Session, event: &LifecycleEvent) {
        // How long a kernel took to start is a metric, not part of the session's story:
        // replay and the notebook have no use for it, and the recording stays as it was.
        if let LifecycleEvent::KernelStarted { .. } = event {
            return;
        }
        self.report_event(key_of(session), event.clone());
    }

    /// After a barrier, so that every session this broker made before the call is in the
    /// store (its row is written with its first report, at its creation); in PostgreSQL
    /// the rows of every node of a cluster are there too.
    fn is_recorded(&self, id: Uuid) -> BoxFuture<'static, Result<bool, BoxError>> {
        let barrier = self.barrier();
        let reads = self.reads.clone();
        Box::pin(async move {
            barrier.await;
            Ok(reads.info(id).await?.is_some())
        })
    }

    fn barrier(&self) -> BoxFuture<'static, ()> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Barrier(tx)).is_err() {
            return Box::pin(std::future::ready(()));
        }
        let stalled = self.counters.clone();
        Box::pin(async move {
            // A writer stuck on a failing disk must not hold every acknowledgement forever:
            // past the limit the execution is acknowledged anyway, and that is logged.
            if tokio::time::timeout(BARRIER_LIMIT, rx).await.is_err() {
                stalled.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    limit = ?BARRIER_LIMIT,
                    "recording: the writer did not commit in time; acknowledging without it"
                );
            }
        })
    }
}

/// Connections the reads of the API may hold at once, in PostgreSQL.
const READ_CONNECTIONS: usize = 8;

/// The longest an acknowledgement waits for the recording.
const BARRIER_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
/// Approximate bytes a report holds in memory.
fn item_size(item: &Item) -> usize {
    match item {
        Item::Message { msg, .. } => {
            256 + msg.header.len()
                + msg.parent_header.len()
                + msg.metadata.len()
                + msg.content.len()
                + msg.buffers.iter().map(|b| b.len()).sum::<usize>()
        }
        Item::Event(event) | Item::Done { event, .. } => 128 + event.kind().len() + json_len(event),
    }
}

/// Bytes of a broker event as JSON (what its detail costs, within a few bytes of the tag).
fn json_len(event: &BrokerEvent) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    // Writing to a counter cannot fail; a failure would only undercount.
    let _ = match event {
        BrokerEvent::Session(e) => serde_json::to_writer(&mut n, e),
        BrokerEvent::Recording(m) => serde_json::to_writer(&mut n, m),
        BrokerEvent::Unreadable { kind, .. } => serde_json::to_writer(&mut n, kind),
    };
    n.0
}
