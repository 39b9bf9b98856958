//! Reading recordings back: the recorded sessions (one, or a user's list), a page of a
//! session's events with filters, every event in order. Rows become [`RecordedEvent`]s with
//! what the writer took out put back: images and buffers from `blobs`, a parent header
//! stored as a reference from the request's row, the execution of an `execution_done`
//! stored once rebuilt from its messages (read from the page, or read for it when the page
//! does not hold them: [`complete_executions`]). Plain functions over a read-only
//! connection; [`Readers`] keeps a few of those for the store's blocking reads (in WAL mode
//! a reader never waits for the writer and sees every committed batch).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value;
use uuid::Uuid;

use super::blobs::{self, Blob};
use super::rebuild::{rebuild, Part};
use super::schema::{open_reader, sqlite};
use super::stored::{StoredDone, StoredEvent};
use super::{from_micros, RecordingError};
use crate::session::Direction;
use crate::sync::lock;

/// One recorded session, as listed.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordingInfo {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    pub created_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    /// `closed`, `expired`, `broker_stopped` or `node_lost`.
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

impl EventQuery {
    /// The first of the pages that read a whole session, in order ([`EventQuery::next_page`]).
    pub(crate) fn whole_session() -> Self {
        EventQuery {
            after: 0,
            limit: 10_000,
            ..Default::default()
        }
    }

    /// Moves this query past `page`; whether there is more to read.
    pub(crate) fn next_page(&mut self, page: &EventsPage) -> bool {
        if let Some(last) = page.events.last() {
            self.after = last.seq;
        }
        page.more
    }
}

#[derive(Debug, Clone)]
pub struct EventsPage {
    pub events: Vec<RecordedEvent>,
    /// Whether more events matched than the limit let through.
    pub more: bool,
}

/// A small pool of read-only connections.
pub(super) struct Readers {
    path: PathBuf,
    pool: Mutex<Vec<Connection>>,
}

impl Readers {
    pub(super) fn new(path: PathBuf) -> Self {
        Self {
            path,
            pool: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` on a pooled connection (blocking: call it on a blocking thread).
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, RecordingError>,
    ) -> Result<T, RecordingError> {
        let pooled = lock(&self.pool).pop();
        let conn = match pooled {
            Some(c) => c,
            None => open_reader(&self.path)?,
        };
        let r = f(&conn);
        let mut pool = lock(&self.pool);
        if pool.len() < 4 {
            pool.push(conn);
        }
        r
    }
}

/// The recorded session `id`, whoever owns it.
pub(super) fn info(conn: &Connection, id: Uuid) -> Result<Option<RecordingInfo>, RecordingError> {
    conn.prepare_cached(&format!("{INFO_SELECT} WHERE id = ?1"))
        .and_then(|mut st| st.query_row([id.to_string()], info_row).optional())
        .map_err(sqlite("read a session"))
}

/// `user`'s recorded sessions, newest first.
pub(super) fn list(
    conn: &Connection,
    user: &str,
    limit: usize,
) -> Result<Vec<RecordingInfo>, RecordingError> {
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
}

/// Every event of session `id`, in order (read in pages).
pub(super) fn all_events(
    conn: &Connection,
    id: Uuid,
) -> Result<Vec<RecordedEvent>, RecordingError> {
    let mut all = Vec::new();
    let mut query = EventQuery::whole_session();
    loop {
        let page = read_events(conn, id, &query)?;
        let more = query.next_page(&page);
        all.extend(page.events);
        if !more {
            return Ok(all);
        }
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

pub(super) struct Row {
    pub seq: i64,
    pub time: i64,
    pub direction: String,
    pub channel: Option<String>,
    pub msg_type: Option<String>,
    pub msg_id: Option<String>,
    pub parent_msg_id: Option<String>,
    pub header: Option<String>,
    pub parent_header: Option<String>,
    pub parent_seq: Option<i64>,
    pub metadata: Option<String>,
    pub content: Option<String>,
    pub kind: Option<String>,
    pub has_blobs: bool,
    pub buffers: Option<String>,
}

/// A page of session `id`'s events.
pub(super) fn read_events(
    conn: &Connection,
    id: Uuid,
    q: &EventQuery,
) -> Result<EventsPage, RecordingError> {
    use rusqlite::types::Value as Sql;
    let sid: Option<i64> = conn
        .prepare_cached("SELECT sid FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.query_row([id.to_string()], |r| r.get(0)).optional())
        .map_err(sqlite("find a session"))?;
    let Some(sid) = sid else {
        return Err(RecordingError::NotFound(id));
    };
    let mut sql = String::from(concat!(
        "SELECT ",
        row_columns!(),
        " FROM events WHERE sid = ? AND seq > ?"
    ));
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
    let mut rows = select_rows(conn, &sql, args)?;
    let more = rows.len() > limit;
    rows.truncate(limit);
    let mut lookup = SqliteLookup {
        conn,
        sid,
        headers: HashMap::new(),
    };
    let mut events = Vec::with_capacity(rows.len());
    for row in rows {
        events.push(to_event(row, &mut lookup)?);
    }
    let mut fetched = HashMap::new();
    for w in executions_to_fetch(&events, q) {
        let args = vec![
            Sql::Integer(sid),
            Sql::Integer(w.after),
            Sql::Integer(w.before),
            Sql::Text(w.msg_id),
        ];
        let mut messages = Vec::new();
        for row in select_rows(conn, EXECUTION_SELECT, args)? {
            messages.push(to_event(row, &mut lookup)?);
        }
        fetched.insert(w.before, messages);
    }
    complete_executions(&mut events, &fetched);
    Ok(EventsPage { events, more })
}

/// The columns of [`Row`], in its order.
macro_rules! row_columns {
    () => {
        "seq, time, direction, channel, msg_type, msg_id, parent_msg_id, header, parent_header,
         metadata, content, kind, has_blobs, buffers, parent_seq"
    };
}
pub(super) use row_columns;

/// The messages of an execution stored once (see [`ExecutionWindow`]): `?1` the session
/// row, `?2` and `?3` the window, `?4` the request's msg_id.
const EXECUTION_SELECT: &str = concat!(
    "SELECT ",
    row_columns!(),
    " FROM events WHERE sid = ?1 AND seq > ?2 AND seq < ?3 AND parent_msg_id = ?4
       AND direction = 'from_kernel' ORDER BY seq"
);

fn select_rows(
    conn: &Connection,
    sql: &str,
    args: Vec<rusqlite::types::Value>,
) -> Result<Vec<Row>, RecordingError> {
    let mut st = conn.prepare_cached(sql).map_err(sqlite("read events"))?;
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
    rows.collect::<Result<_, _>>()
        .map_err(sqlite("read events"))
}

/// Where [`to_event`] finds what the writer took out of a row: blobs by SHA-256 and the
/// headers of requests by sequence number (looked up one by one in SQLite, fetched for a
/// whole page at once from PostgreSQL).
pub(super) trait Lookup {
    /// A blob as stored: whether it was base64 text, and its bytes.
    fn blob(&mut self, sha: &str) -> Result<Option<(bool, Vec<u8>)>, RecordingError>;
    /// The header of the session's event `seq`.
    fn header(&mut self, seq: i64) -> Result<Option<String>, RecordingError>;
}

/// Lookups on a SQLite connection; headers cached per page.
struct SqliteLookup<'c> {
    conn: &'c Connection,
    sid: i64,
    headers: HashMap<i64, Option<String>>,
}

impl Lookup for SqliteLookup<'_> {
    fn blob(&mut self, sha: &str) -> Result<Option<(bool, Vec<u8>)>, RecordingError> {
        self.conn
            .prepare_cached("SELECT base64, data FROM blobs WHERE sha256 = ?1")
            .and_then(|mut st| {
                st.query_row([sha], |r| Ok((r.get(0)?, r.get(1)?)))
                    .optional()
            })
            .map_err(sqlite("read a blob"))
    }

    fn header(&mut self, seq: i64) -> Result<Option<String>, RecordingError> {
        if let Some(h) = self.headers.get(&seq) {
            return Ok(h.clone());
        }
        let h: Option<String> = self
            .conn
            .prepare_cached("SELECT header FROM events WHERE sid = ?1 AND seq = ?2")
            .and_then(|mut st| {
                st.query_row(params![self.sid, seq], |r| r.get(0))
                    .optional()
            })
            .map_err(sqlite("read a parent header"))?
            .flatten();
        self.headers.insert(seq, h.clone());
        Ok(h)
    }
}

/// A stored row as an event, with what the writer took out put back.
pub(super) fn to_event(row: Row, lookup: &mut dyn Lookup) -> Result<RecordedEvent, RecordingError> {
    let mut content = row.content.unwrap_or_else(|| "{}".into());
    if row.has_blobs {
        if let Ok(mut v) = serde_json::from_str::<Value>(&content) {
            let mut failed = None;
            blobs::reassemble(&mut v, &mut |sha| match lookup.blob(sha) {
                Ok(b) => b.map(|(b64, data)| Blob::text_of(&data, b64)),
                Err(e) => {
                    failed = Some(e);
                    None
                }
            });
            if let Some(e) = failed {
                return Err(e);
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
        if let Some(list) = &row.buffers {
            for h in buffer_hashes(list) {
                let b = lookup.blob(&h)?;
                buffers.push(b.map(|(_, data)| data).unwrap_or_default());
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
                (None, Some(seq)) => lookup.header(seq)?.unwrap_or_else(|| "{}".into()),
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

/// The SHA-256s of a message's binary buffers, as stored.
pub(super) fn buffer_hashes(list: &str) -> Vec<String> {
    serde_json::from_str(list).unwrap_or_default()
}

/// Where the messages of an execution stored once are (see [`super::rebuild`]): the
/// session's events between `after` (its `execution_started`) and `before` (its
/// `execution_done`) from the kernel whose parent is `msg_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ExecutionWindow {
    pub msg_id: String,
    pub after: i64,
    pub before: i64,
}

/// The execution stored once of a broker event, if it is one: its detail and where its
/// messages are.
fn stored_once(e: &RecordedEvent) -> Option<(StoredDone, ExecutionWindow)> {
    let RecordedKind::Broker { kind, detail } = &e.kind else {
        return None;
    };
    // A version-1 detail (the whole execution) is not parsed only to be refused, unless its
    // output happens to say `"outcome"`.
    if kind != "execution_done" || !detail.contains("\"outcome\"") {
        return None;
    }
    let done: StoredDone = serde_json::from_str(detail).ok()?;
    let window = ExecutionWindow {
        msg_id: done.msg_id.clone(),
        after: done.outcome.started_seq,
        before: e.seq,
    };
    Some((done, window))
}

/// The executions stored once in `page` (read with `q`) whose messages the page does not
/// hold: it holds them all when it is unfiltered and starts before the execution (a page
/// is every event in a range of sequence numbers).
pub(super) fn executions_to_fetch(page: &[RecordedEvent], q: &EventQuery) -> Vec<ExecutionWindow> {
    let unfiltered = q.types.is_empty() && q.channels.is_empty();
    page.iter()
        .filter_map(stored_once)
        .map(|(_, w)| w)
        .filter(|w| !(unfiltered && q.after <= w.after))
        .collect()
}

/// Puts the whole execution back into every `execution_done` of `page` stored once (version
/// 2), so that it reads as version 1 did: rebuilt from the messages `fetched` for it (by
/// its sequence number; see [`executions_to_fetch`]), or else from the page's own.
pub(super) fn complete_executions(
    page: &mut [RecordedEvent],
    fetched: &HashMap<i64, Vec<RecordedEvent>>,
) {
    for i in 0..page.len() {
        let Some((done, w)) = stored_once(&page[i]) else {
            continue;
        };
        let messages: Vec<&RecordedEvent> = match fetched.get(&w.before) {
            Some(messages) => messages.iter().collect(),
            None => page[..i].iter().filter(|e| e.seq > w.after).collect(),
        };
        let parts = messages.into_iter().filter_map(|e| match &e.kind {
            RecordedKind::Message {
                direction: Direction::FromKernel,
                channel,
                msg_type,
                parent_msg_id: Some(parent),
                content,
                ..
            } if *parent == w.msg_id => Some(Part {
                channel,
                msg_type,
                content: content.as_bytes(),
            }),
            _ => None,
        });
        let execution = rebuild(&done.outcome, parts);
        let whole = StoredEvent::ExecutionDone {
            msg_id: done.msg_id,
            execution,
        };
        if let RecordedKind::Broker { detail, .. } = &mut page[i].kind {
            *detail = whole.detail().to_string();
        }
    }
}
