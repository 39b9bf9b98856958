//! The recording store: the handle the session layer reports to (it implements
//! [`Recorder`]) and the API reads from. Reports go to the writer thread ([`super::writer`])
//! through an unbounded channel whose memory is bounded by counting bytes; reads use a small
//! pool of read-only connections on blocking threads (in WAL mode readers never wait for the
//! writer, and see every committed batch).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::event::RecordingMarker;
use super::writer::{self, Counters, Item, Op, SessionKey};
use super::{blobs, from_micros, micros, RecordingConfig, RecordingError};
use crate::session::{Direction, LifecycleEvent, Recorder, Session};
use crate::sync::lock;
use crate::wire::{Channel, Message};

fn sqlite(context: &'static str) -> impl FnOnce(rusqlite::Error) -> RecordingError {
    move |source| RecordingError::Sqlite { context, source }
}

/// One recorded session, as listed.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordingInfo {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    pub created_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    /// `closed`, `expired` or `broker_stopped`.
    pub end_reason: Option<String>,
    /// Code cells run (non-silent `execute_request`s).
    pub cells: u64,
    pub events: u64,
    pub last_event_at: Option<DateTime<Utc>>,
}

/// One recorded event. JSON parts are JSON text, with blobs put back.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedEvent {
    pub seq: i64,
    pub time: DateTime<Utc>,
    pub kind: RecordedKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RecordedKind {
    Message {
        direction: Direction,
        channel: String,
        msg_type: String,
        msg_id: String,
        parent_msg_id: Option<String>,
        header: String,
        parent_header: String,
        metadata: String,
        content: String,
        buffers: Vec<Vec<u8>>,
    },
    Broker {
        kind: String,
        detail: String,
    },
}

impl RecordedEvent {
    /// `msg_type` of a message, the kind of a broker event.
    pub fn type_name(&self) -> &str {
        match &self.kind {
            RecordedKind::Message { msg_type, .. } => msg_type,
            RecordedKind::Broker { kind, .. } => kind,
        }
    }
}

/// Which events to read.
#[derive(Debug, Clone, Default)]
pub struct EventQuery {
    /// Only events with a larger sequence number.
    pub after: i64,
    pub limit: usize,
    /// `msg_type`s or broker event kinds; empty means all.
    pub types: Vec<String>,
    /// Channels (`shell`, `iopub`, `stdin`, `control`, and `broker` for broker events).
    pub channels: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct EventsPage {
    pub events: Vec<RecordedEvent>,
    /// Whether more events matched than the limit let through.
    pub more: bool,
}

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

struct Readers {
    path: std::path::PathBuf,
    pool: Mutex<Vec<Connection>>,
}

impl Readers {
    fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, RecordingError>,
    ) -> Result<T, RecordingError> {
        let pooled = lock(&self.pool).pop();
        let conn = match pooled {
            Some(c) => c,
            None => writer::open_reader(&self.path)?,
        };
        let r = f(&conn);
        let mut pool = lock(&self.pool);
        if pool.len() < 4 {
            pool.push(conn);
        }
        r
    }
}

/// The recordings of the broker. Cheap to share behind an `Arc`.
pub struct RecordingStore {
    tx: mpsc::Sender<Op>,
    counters: Arc<Counters>,
    config: RecordingConfig,
    /// Reports dropped per session since its last `recording_gap` marker.
    gaps: Mutex<HashMap<Uuid, u64>>,
    gaps_pending: AtomicUsize,
    readers: Arc<Readers>,
}

impl RecordingStore {
    /// Open (or create) the recordings file and start the writer thread.
    pub fn open(config: RecordingConfig) -> Result<Arc<Self>, RecordingError> {
        let conn = writer::open(&config)?;
        let counters = Arc::new(Counters::default());
        let (tx, rx) = mpsc::channel();
        let w = writer::Writer::new(conn, &config, counters.clone());
        std::thread::Builder::new()
            .name("recording-writer".into())
            .spawn(move || w.run(rx))
            .map_err(|source| RecordingError::Dir {
                path: config.path.clone(),
                source,
            })?;
        tracing::info!(path = %config.path.display(), "recording sessions");
        Ok(Arc::new(Self {
            tx,
            counters,
            readers: Arc::new(Readers {
                path: config.path.clone(),
                pool: Mutex::new(Vec::new()),
            }),
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
        &self,
        f: impl FnOnce(&Connection) -> Result<T, RecordingError> + Send + 'static,
    ) -> Result<T, RecordingError> {
        let readers = self.readers.clone();
        tokio::task::spawn_blocking(move || readers.with(f))
            .await
            .map_err(|e| RecordingError::Task(e.to_string()))?
    }

    /// The recorded session `id`, whoever owns it.
    pub async fn info(&self, id: Uuid) -> Result<Option<RecordingInfo>, RecordingError> {
        self.read(move |conn| {
            conn.prepare_cached(&format!("{INFO_SELECT} WHERE id = ?1"))
                .and_then(|mut st| st.query_row([id.to_string()], info_row).optional())
                .map_err(sqlite("read a session"))
        })
        .await
    }

    /// `user`'s recorded sessions, newest first.
    pub async fn list(
        &self,
        user: &str,
        limit: usize,
    ) -> Result<Vec<RecordingInfo>, RecordingError> {
        let user = user.to_string();
        self.read(move |conn| {
            let mut st = conn
                .prepare_cached(&format!(
                    "{INFO_SELECT} WHERE user = ?1 ORDER BY created_at DESC, sid DESC LIMIT ?2"
                ))
                .map_err(sqlite("list sessions"))?;
            let rows = st
                .query_map(params![user, limit as i64], info_row)
                .map_err(sqlite("list sessions"))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(sqlite("list sessions"))
        })
        .await
    }

    /// A page of session `id`'s events.
    pub async fn events(&self, id: Uuid, query: EventQuery) -> Result<EventsPage, RecordingError> {
        self.read(move |conn| read_events(conn, id, &query)).await
    }

    /// Every event of session `id`, in order.
    pub async fn all_events(&self, id: Uuid) -> Result<Vec<RecordedEvent>, RecordingError> {
        self.read(move |conn| {
            let mut all = Vec::new();
            let mut query = EventQuery {
                after: 0,
                limit: 10_000,
                ..Default::default()
            };
            loop {
                let page = read_events(conn, id, &query)?;
                if let Some(last) = page.events.last() {
                    query.after = last.seq;
                }
                all.extend(page.events);
                if !page.more {
                    return Ok(all);
                }
            }
        })
        .await
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
            let dropped = lock(&self.gaps).remove(&key.id);
            if let Some(n) = dropped {
                self.gaps_pending.fetch_sub(1, Ordering::AcqRel);
                self.marker(
                    &key,
                    time,
                    RecordingMarker::RecordingGap {
                        dropped: n,
                        reason: "the recording writer fell behind; these reports were not recorded"
                            .into(),
                    },
                );
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
        let item = Item::Event {
            kind: marker.kind().into(),
            detail: marker.detail(),
        };
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

    fn report_event(&self, key: SessionKey, kind: &str, detail: Value) {
        self.report(
            key,
            Item::Event {
                kind: kind.into(),
                detail,
            },
        );
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
        self.report_event(key_of(session), event.kind(), event.detail());
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
        Item::Event { kind, detail } => 128 + kind.len() + value_size(detail),
    }
}

fn value_size(v: &Value) -> usize {
    match v {
        Value::String(s) => 24 + s.len(),
        Value::Array(a) => 24 + a.iter().map(value_size).sum::<usize>(),
        Value::Object(m) => {
            24 + m
                .iter()
                .map(|(k, v)| 24 + k.len() + value_size(v))
                .sum::<usize>()
        }
        _ => 16,
    }
}

const INFO_SELECT: &str =
    "SELECT id, user, kernel, created_at, ended_at, end_reason, cells, events, last_event_at FROM sessions";

fn info_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RecordingInfo> {
    let id: String = r.get(0)?;
    Ok(RecordingInfo {
        id: Uuid::parse_str(&id).unwrap_or_default(),
        user: r.get(1)?,
        kernel: r.get(2)?,
        created_at: from_micros(r.get(3)?),
        ended_at: r.get::<_, Option<i64>>(4)?.map(from_micros),
        end_reason: r.get(5)?,
        cells: r.get::<_, i64>(6)?.max(0) as u64,
        events: r.get::<_, i64>(7)?.max(0) as u64,
        last_event_at: r.get::<_, Option<i64>>(8)?.map(from_micros),
    })
}

struct Row {
    seq: i64,
    time: i64,
    direction: String,
    channel: Option<String>,
    msg_type: Option<String>,
    msg_id: Option<String>,
    parent_msg_id: Option<String>,
    header: Option<String>,
    parent_header: Option<String>,
    parent_seq: Option<i64>,
    metadata: Option<String>,
    content: Option<String>,
    kind: Option<String>,
    has_blobs: bool,
    buffers: Option<String>,
}

fn read_events(conn: &Connection, id: Uuid, q: &EventQuery) -> Result<EventsPage, RecordingError> {
    use rusqlite::types::Value as Sql;
    let sid: Option<i64> = conn
        .prepare_cached("SELECT sid FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.query_row([id.to_string()], |r| r.get(0)).optional())
        .map_err(sqlite("find a session"))?;
    let Some(sid) = sid else {
        return Err(RecordingError::NotFound(id));
    };
    let mut sql = String::from(
        "SELECT seq, time, direction, channel, msg_type, msg_id, parent_msg_id, header, parent_header,
                metadata, content, kind, has_blobs, buffers, parent_seq
         FROM events WHERE sid = ? AND seq > ?",
    );
    let mut args: Vec<Sql> = vec![Sql::Integer(sid), Sql::Integer(q.after)];
    let marks = |n: usize| vec!["?"; n].join(", ");
    if !q.types.is_empty() {
        sql.push_str(&format!(
            " AND (msg_type IN ({0}) OR kind IN ({0}))",
            marks(q.types.len())
        ));
        args.extend(q.types.iter().map(|t| Sql::Text(t.clone())));
        args.extend(q.types.iter().map(|t| Sql::Text(t.clone())));
    }
    if !q.channels.is_empty() {
        let broker = q.channels.iter().any(|c| c == "broker");
        let kernel: Vec<&String> = q.channels.iter().filter(|c| *c != "broker").collect();
        sql.push_str(&format!(
            " AND (channel IN ({}) OR {})",
            if kernel.is_empty() {
                "NULL".to_string()
            } else {
                marks(kernel.len())
            },
            if broker { "direction = 'broker'" } else { "0" }
        ));
        args.extend(kernel.into_iter().map(|c| Sql::Text(c.clone())));
    }
    sql.push_str(" ORDER BY seq LIMIT ?");
    let limit = q.limit.max(1);
    args.push(Sql::Integer(limit as i64 + 1));
    let mut st = conn.prepare_cached(&sql).map_err(sqlite("read events"))?;
    let rows = st
        .query_map(rusqlite::params_from_iter(args), |r| {
            Ok(Row {
                seq: r.get(0)?,
                time: r.get(1)?,
                direction: r.get(2)?,
                channel: r.get(3)?,
                msg_type: r.get(4)?,
                msg_id: r.get(5)?,
                parent_msg_id: r.get(6)?,
                header: r.get(7)?,
                parent_header: r.get(8)?,
                metadata: r.get(9)?,
                content: r.get(10)?,
                kind: r.get(11)?,
                has_blobs: r.get(12)?,
                buffers: r.get(13)?,
                parent_seq: r.get(14)?,
            })
        })
        .map_err(sqlite("read events"))?;
    let mut rows: Vec<Row> = rows
        .collect::<Result<_, _>>()
        .map_err(sqlite("read events"))?;
    let more = rows.len() > limit;
    rows.truncate(limit);
    let mut events = Vec::with_capacity(rows.len());
    let mut parents = HashMap::new();
    for row in rows {
        events.push(to_event(conn, sid, row, &mut parents)?);
    }
    Ok(EventsPage { events, more })
}

/// The header of event `seq` (the request a parent header refers to), cached per page.
fn request_header(
    conn: &Connection,
    sid: i64,
    seq: i64,
    cache: &mut HashMap<i64, String>,
) -> Result<String, RecordingError> {
    if let Some(h) = cache.get(&seq) {
        return Ok(h.clone());
    }
    let h: Option<String> = conn
        .prepare_cached("SELECT header FROM events WHERE sid = ?1 AND seq = ?2")
        .and_then(|mut st| st.query_row(params![sid, seq], |r| r.get(0)).optional())
        .map_err(sqlite("read a parent header"))?
        .flatten();
    let h = h.unwrap_or_else(|| "{}".into());
    cache.insert(seq, h.clone());
    Ok(h)
}

fn to_event(
    conn: &Connection,
    sid: i64,
    row: Row,
    parents: &mut HashMap<i64, String>,
) -> Result<RecordedEvent, RecordingError> {
    let mut content = row.content.unwrap_or_else(|| "{}".into());
    if row.has_blobs {
        if let Ok(mut v) = serde_json::from_str::<Value>(&content) {
            let mut failed = None;
            blobs::reassemble(&mut v, &mut |sha| match writer::blob_text(conn, sha) {
                Ok(t) => t,
                Err(e) => {
                    failed = Some(e);
                    None
                }
            });
            if let Some(e) = failed {
                return Err(RecordingError::Sqlite {
                    context: "read a blob",
                    source: e,
                });
            }
            content = v.to_string();
        }
    }
    let time = from_micros(row.time);
    let kind = if row.direction == "broker" {
        RecordedKind::Broker {
            kind: row.kind.unwrap_or_default(),
            detail: content,
        }
    } else {
        let mut buffers = Vec::new();
        if let Some(list) = row.buffers {
            let hashes: Vec<String> = serde_json::from_str(&list).unwrap_or_default();
            for h in hashes {
                let b = writer::blob_bytes(conn, &h).map_err(sqlite("read a buffer"))?;
                buffers.push(b.unwrap_or_default());
            }
        }
        RecordedKind::Message {
            direction: if row.direction == "to_kernel" {
                Direction::ToKernel
            } else {
                Direction::FromKernel
            },
            channel: row.channel.unwrap_or_default(),
            msg_type: row.msg_type.unwrap_or_default(),
            msg_id: row.msg_id.unwrap_or_default(),
            parent_msg_id: row.parent_msg_id,
            header: row.header.unwrap_or_else(|| "{}".into()),
            parent_header: match (row.parent_header, row.parent_seq) {
                (Some(h), _) => h,
                (None, Some(seq)) => request_header(conn, sid, seq, parents)?,
                (None, None) => "{}".into(),
            },
            metadata: row.metadata.unwrap_or_else(|| "{}".into()),
            content,
            buffers,
        }
    };
    Ok(RecordedEvent {
        seq: row.seq,
        time,
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use bytes::Bytes;
    use serde_json::json;

    fn key(id: Uuid) -> SessionKey {
        SessionKey {
            id,
            user: "alice".into(),
            kernel: "python3".into(),
            created_at: micros(Utc::now()),
        }
    }

    fn msg(msg_type: &str, parent: &str, content: Value) -> Message {
        let parent_header = Bytes::from(json!({"msg_id": parent}).to_string());
        Message::new(msg_type, &content, Some(&parent_header), "k", "alice")
    }

    fn open_store(
        tweak: impl FnOnce(&mut RecordingConfig),
    ) -> (tempfile::TempDir, Arc<RecordingStore>) {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = RecordingConfig::new(dir.path().join("r.sqlite3"));
        tweak(&mut cfg);
        (dir, RecordingStore::open(cfg).unwrap())
    }

    #[tokio::test]
    async fn events_round_trip_in_order_with_blobs() {
        let (_dir, store) = open_store(|_| {});
        let id = Uuid::new_v4();
        let k = key(id);
        let req = msg(
            "execute_request",
            "",
            json!({"code": "plot()", "silent": false}),
        );
        store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
        store.report_event(
            k.clone(),
            "execution_started",
            json!({"msg_id": req.msg_id, "code": "plot()"}),
        );
        let png =
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, vec![7u8; 5000]);
        // As a kernel sends it: the request's header as its parent header (re-serialised).
        let parent: Value = serde_json::from_slice(&req.header).unwrap();
        let parent = Bytes::from(serde_json::to_string_pretty(&parent).unwrap());
        let disp = Message::new(
            "display_data",
            &json!({"data": {"image/png": png, "text/plain": "<Figure>"}, "metadata": {}}),
            Some(&parent),
            "k",
            "alice",
        );
        store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &disp);
        store.report_event(
            k.clone(),
            "execution_done",
            json!({"msg_id": req.msg_id, "execution": {"results": [{"data": {"image/png": png}}]}}),
        );
        store.report_event(k.clone(), "session_closed", json!({}));
        store.flush().await;

        let all = store.all_events(id).await.unwrap();
        let types: Vec<&str> = all.iter().map(|e| e.type_name()).collect();
        assert_eq!(
            types,
            [
                "execute_request",
                "execution_started",
                "display_data",
                "execution_done",
                "session_closed"
            ]
        );
        assert_eq!(
            all.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
        // The display's parent header is stored as a reference to the request, and put back.
        let RecordedKind::Message {
            header: req_header, ..
        } = &all[0].kind
        else {
            panic!()
        };
        let RecordedKind::Message { parent_header, .. } = &all[2].kind else {
            panic!()
        };
        assert_eq!(parent_header, req_header);
        let conn = writer::open_reader(&store.config.path).unwrap();
        let stored: (Option<String>, Option<i64>) = conn
            .query_row(
                "SELECT parent_header, parent_seq FROM events WHERE seq = 3",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(stored, (None, Some(1)));
        drop(conn);
        let RecordedKind::Message { content, .. } = &all[2].kind else {
            panic!()
        };
        let c: Value = serde_json::from_str(content).unwrap();
        assert_eq!(c["data"]["image/png"], png.as_str());
        let RecordedKind::Broker { detail, .. } = &all[3].kind else {
            panic!()
        };
        let d: Value = serde_json::from_str(detail).unwrap();
        assert_eq!(
            d["execution"]["results"][0]["data"]["image/png"],
            png.as_str()
        );

        let info = store.info(id).await.unwrap().unwrap();
        assert_eq!(info.cells, 1);
        assert_eq!(info.events, 5);
        assert_eq!(info.end_reason.as_deref(), Some("closed"));
        assert!(info.ended_at.is_some());

        // One image, stored once.
        let conn = writer::open_reader(&store.config.path).unwrap();
        let n: i64 = conn
            .query_row("SELECT count(*) FROM blobs", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 1);

        // Filters and paging.
        let page = store
            .events(
                id,
                EventQuery {
                    after: 1,
                    limit: 2,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(
            page.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [2, 3]
        );
        assert!(page.more);
        let page = store
            .events(
                id,
                EventQuery {
                    limit: 10,
                    channels: vec!["broker".into()],
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(page.events.len(), 3);
        assert!(!page.more);
        let page = store
            .events(
                id,
                EventQuery {
                    limit: 10,
                    types: vec!["display_data".into(), "session_closed".into()],
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(
            page.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [3, 5]
        );

        assert!(store.delete(id).await.unwrap());
        assert!(!store.delete(id).await.unwrap());
        assert!(matches!(
            store.events(id, EventQuery::default()).await,
            Err(RecordingError::NotFound(_))
        ));
        let n: i64 = conn
            .query_row("SELECT count(*) FROM blobs", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0, "the blob went with its last session");
        store.close().await;
    }

    fn types(all: &[RecordedEvent]) -> Vec<&str> {
        all.iter().map(|e| e.type_name()).collect()
    }

    fn detail(e: &RecordedEvent) -> Value {
        match &e.kind {
            RecordedKind::Broker { detail, .. } => serde_json::from_str(detail).unwrap(),
            RecordedKind::Message { .. } => panic!("not a broker event: {e:?}"),
        }
    }

    fn display(parent: &str, text: String) -> Message {
        msg(
            "display_data",
            parent,
            json!({"data": {"text/plain": text}, "metadata": {}, "transient": {}}),
        )
    }

    #[tokio::test]
    async fn every_message_type_is_capped_per_execution_with_one_marker() {
        let (_dir, store) = open_store(|c| c.max_execution_bytes = 5000);
        let id = Uuid::new_v4();
        let k = key(id);
        let mut requests = Vec::new();
        for (n, kinds) in [
            (10, ["stream", "display_data", "error"]),
            (1, ["stream"; 3]),
        ] {
            let req = msg("execute_request", "", json!({"code": "x", "silent": false}));
            store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
            for i in 0..n {
                for kind in kinds {
                    let m = match kind {
                        "display_data" => display(&req.msg_id, format!("{i}{}", "d".repeat(300))),
                        "error" => msg(
                            kind,
                            &req.msg_id,
                            json!({"ename": "E", "evalue": "e".repeat(300), "traceback": []}),
                        ),
                        _ => msg(
                            kind,
                            &req.msg_id,
                            json!({"name": "stdout", "text": "s".repeat(300)}),
                        ),
                    };
                    store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
                }
            }
            let execution = json!({"stdout": "s".repeat(3000 * n)});
            store.report_event(
                k.clone(),
                "execution_done",
                json!({"msg_id": req.msg_id, "execution": execution}),
            );
            requests.push(req.msg_id);
        }
        store.flush().await;
        let all = store.all_events(id).await.unwrap();
        let t = types(&all);
        let markers: Vec<_> = all
            .iter()
            .filter(|e| e.type_name() == "recording_truncated")
            .collect();
        assert_eq!(markers.len(), 1, "{t:?}");
        let m = detail(markers[0]);
        assert_eq!(m["scope"], "execution");
        assert_eq!(m["msg_id"], requests[0].as_str());
        let first = t.iter().position(|x| *x == "recording_truncated").unwrap();
        let kept = first - 1;
        assert!(kept > 3 && kept < 30, "{t:?}");
        assert_eq!(m["dropped_messages"], 30 - kept as u64 + 1, "{m}");
        assert!(
            m["dropped_bytes"].as_u64().unwrap() > 300 * (30 - kept as u64),
            "{m}"
        );
        // The capped execution's end is kept, cut; the next execution is recorded whole.
        assert_eq!(
            t[first + 1..],
            [
                "execution_done",
                "execute_request",
                "stream",
                "stream",
                "stream",
                "execution_done"
            ]
        );
        assert_eq!(
            detail(&all[first + 1]),
            json!({"msg_id": requests[0], "recording_truncated": true, "bytes": detail(&all[first + 1])["bytes"]})
        );
        assert!(detail(&all[first + 6])["execution"]["stdout"].is_string());
        assert_eq!(store.stats().truncated, 30 - kept as u64 + 1);
        store.close().await;
    }

    #[tokio::test]
    async fn an_image_shown_again_costs_only_its_reference() {
        let (_dir, store) = open_store(|c| c.max_execution_bytes = 20_000);
        let id = Uuid::new_v4();
        let k = key(id);
        let png = base64::engine::general_purpose::STANDARD.encode([7u8; 9000]);
        let req = msg("execute_request", "", json!({"code": "x", "silent": false}));
        store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
        for _ in 0..20 {
            let m = msg(
                "display_data",
                &req.msg_id,
                json!({"data": {"image/png": png}, "metadata": {}, "transient": {}}),
            );
            store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
        }
        // A second, different image does not fit any more.
        let other = base64::engine::general_purpose::STANDARD.encode([8u8; 9000]);
        let m = msg(
            "display_data",
            &req.msg_id,
            json!({"data": {"image/png": other}, "metadata": {}, "transient": {}}),
        );
        store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
        store.flush().await;
        let all = store.all_events(id).await.unwrap();
        let t = types(&all);
        assert_eq!(
            t.iter().filter(|x| **x == "display_data").count(),
            20,
            "{t:?}"
        );
        assert_eq!(t.last(), Some(&"recording_truncated"));
        store.close().await;
    }

    #[tokio::test]
    async fn the_session_cap_holds_across_executions() {
        let (_dir, store) = open_store(|c| c.max_session_bytes = 6000);
        let id = Uuid::new_v4();
        let k = key(id);
        for _ in 0..10 {
            let req = msg("execute_request", "", json!({"code": "x", "silent": false}));
            store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
            store.report_event(
                k.clone(),
                "execution_started",
                json!({"msg_id": req.msg_id, "code": "x"}),
            );
            let m = display(&req.msg_id, "d".repeat(1000));
            store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
            store.report_event(
                k.clone(),
                "execution_done",
                json!({"msg_id": req.msg_id, "execution": {}}),
            );
        }
        store.report_event(k.clone(), "session_closed", json!({}));
        store.flush().await;
        let all = store.all_events(id).await.unwrap();
        let t = types(&all);
        let markers: Vec<_> = all
            .iter()
            .filter(|e| e.type_name() == "recording_truncated")
            .collect();
        assert_eq!(markers.len(), 1, "{t:?}");
        assert_eq!(detail(markers[0])["scope"], "session");
        let first = t.iter().position(|x| *x == "recording_truncated").unwrap();
        assert!(first >= 4, "{t:?}");
        assert_eq!(t[first + 1..], ["session_closed"], "{t:?}");
        let info = store.info(id).await.unwrap().unwrap();
        assert_eq!(info.end_reason.as_deref(), Some("closed"));
        assert_eq!(info.events as usize, all.len());
        store.close().await;
    }

    #[tokio::test]
    async fn an_overfull_queue_drops_and_marks_the_gap() {
        let (_dir, store) = open_store(|c| c.max_queue_bytes = 0);
        let id = Uuid::new_v4();
        let k = key(id);
        for _ in 0..3 {
            store.report_event(k.clone(), "interrupt", json!({}));
        }
        assert_eq!(store.stats().dropped, 3);
        store.flush().await;
        assert!(matches!(
            store.events(id, EventQuery::default()).await,
            Err(RecordingError::NotFound(_))
        ));
        // Room again: the next report is preceded by the marker.
        drop(store);
        let (_dir, store) = open_store(|c| c.max_queue_bytes = 1 << 20);
        store.gaps.lock().unwrap().insert(id, 3);
        store.gaps_pending.store(1, Ordering::Release);
        store.report_event(k.clone(), "interrupt", json!({}));
        store.flush().await;
        let all = store.all_events(id).await.unwrap();
        assert_eq!(
            all.iter().map(|e| e.type_name()).collect::<Vec<_>>(),
            ["recording_gap", "interrupt"]
        );
        let RecordedKind::Broker { detail, .. } = &all[0].kind else {
            panic!()
        };
        assert_eq!(
            serde_json::from_str::<Value>(detail.as_str()).unwrap()["dropped"],
            3
        );
        assert_eq!(store.stats().queued_bytes, 0);
        store.close().await;
    }

    /// What recording costs an execution: the report calls on the session's task, and the
    /// barrier wait before the acknowledgement.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement: cargo test --release --lib recording_cost -- --ignored --nocapture"]
    async fn recording_cost() {
        for sync in [
            super::super::Synchronous::Normal,
            super::super::Synchronous::Full,
        ] {
            eprintln!("synchronous = {sync:?}");
            measure_recording_cost(sync).await;
        }
    }

    async fn measure_recording_cost(sync: super::super::Synchronous) {
        let (_dir, store) = open_store(|c| c.synchronous = sync);
        let k = key(Uuid::new_v4());
        let req = msg(
            "execute_request",
            "",
            json!({"code": "1+1", "silent": false}),
        );
        let reply = msg(
            "execute_result",
            &req.msg_id,
            json!({"data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1}),
        );
        let (mut report, mut barrier) = (Vec::new(), Vec::new());
        for _ in 0..3000 {
            let t = std::time::Instant::now();
            store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
            for _ in 0..6 {
                store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &reply);
            }
            store.report_event(
                k.clone(),
                "execution_done",
                json!({"msg_id": req.msg_id, "execution": {"stdout": ""}}),
            );
            report.push(t.elapsed());
            let t = std::time::Instant::now();
            store.flush().await;
            barrier.push(t.elapsed());
        }
        for (what, mut v) in [("8 reports", report), ("barrier", barrier)] {
            v.sort();
            let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
            eprintln!(
                "{what}: p50 {:?} p90 {:?} p99 {:?}",
                p(0.5),
                p(0.9),
                p(0.99)
            );
        }
        store.close().await;
    }

    #[tokio::test]
    async fn reopening_closes_stale_sessions_and_retention_deletes_old_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.sqlite3");
        let id = Uuid::new_v4();
        {
            let store = RecordingStore::open(RecordingConfig::new(&path)).unwrap();
            store.report_event(key(id), "session_created", json!({}));
            store.flush().await;
            // Not closed: as if the broker was killed.
        }
        let store = RecordingStore::open(RecordingConfig::new(&path)).unwrap();
        // The writer closes stale sessions before anything else it does.
        store.flush().await;
        let info = store.info(id).await.unwrap().unwrap();
        assert_eq!(info.end_reason.as_deref(), Some("broker_stopped"));
        let all = store.all_events(id).await.unwrap();
        assert_eq!(all.last().unwrap().type_name(), "broker_stopped");
        store.close().await;

        let mut conn = writer::open(&RecordingConfig::new(&path)).unwrap();
        assert_eq!(
            writer::retention(&mut conn, micros(Utc::now()) - 86_400_000_000).unwrap(),
            0
        );
        assert_eq!(
            writer::retention(&mut conn, micros(Utc::now()) + 1).unwrap(),
            1
        );
        let n: i64 = conn
            .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0);
    }
}
