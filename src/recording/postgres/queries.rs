//! Reading recordings back from PostgreSQL: what [`crate::recording::queries`] does on the
//! SQLite file, async on a pool. A page's blobs and parent headers are fetched in two
//! queries for the whole page, then put back by the same code as SQLite's; so are the
//! executions stored once.

use serde_json::Value;
use std::collections::HashMap;
use uuid::Uuid;

use super::redact;
use crate::recording::blobs;
use crate::recording::db::DbError;
use crate::recording::queries::{
    buffer_hashes, complete_executions, executions_to_fetch, row_columns, to_event, EventQuery,
    EventsPage, Lookup, RecordedEvent, RecordingInfo, Row,
};
use crate::recording::{from_micros, RecordingError};

/// A pool of up to `size` connections to `url`; none is opened before it is first asked
/// for one. A database that does not answer fails the caller after 10 s, rather than
/// holding it.
fn pool(url: &str, size: usize) -> Result<deadpool_postgres::Pool, RecordingError> {
    crate::db::postgres::pool(url, size).map_err(|e| RecordingError::Connect {
        location: redact(url),
        source: DbError::CreatePool(e),
    })
}

/// The readers' connections.
pub(in crate::recording) struct Pool {
    pool: deadpool_postgres::Pool,
}

fn db_err(context: &'static str) -> impl Fn(tokio_postgres::Error) -> RecordingError {
    move |source| RecordingError::Db {
        context,
        source: DbError::Postgres(source),
    }
}

impl Pool {
    /// A pool of up to `size` connections to `url`; none is opened before the first read.
    pub fn new(url: &str, size: usize) -> Result<Self, RecordingError> {
        Ok(Self {
            pool: pool(url, size)?,
        })
    }

    pub(super) async fn client(&self) -> Result<deadpool_postgres::Client, RecordingError> {
        self.pool.get().await.map_err(|e| RecordingError::Db {
            context: "connect for a read",
            source: DbError::Checkout(e),
        })
    }

    /// The recorded session `id`, whoever owns it.
    pub async fn info(&self, id: Uuid) -> Result<Option<RecordingInfo>, RecordingError> {
        let c = self.client().await?;
        let st = c
            .prepare_cached(&format!("{INFO_SELECT} WHERE id = $1"))
            .await
            .map_err(db_err("read a session"))?;
        let row = c
            .query_opt(&st, &[&id.to_string()])
            .await
            .map_err(db_err("read a session"))?;
        Ok(row.as_ref().map(info_row))
    }

    /// `user`'s recorded sessions, newest first.
    pub async fn list(
        &self,
        user: &str,
        limit: usize,
    ) -> Result<Vec<RecordingInfo>, RecordingError> {
        let c = self.client().await?;
        let st = c
            .prepare_cached(&format!(
                r#"{INFO_SELECT} WHERE "user" = $1 ORDER BY created_at DESC, sid DESC LIMIT $2"#
            ))
            .await
            .map_err(db_err("list sessions"))?;
        let rows = c
            .query(&st, &[&user, &(limit as i64)])
            .await
            .map_err(db_err("list sessions"))?;
        Ok(rows.iter().map(info_row).collect())
    }

    /// Every event of session `id`, in order (read in pages).
    pub async fn all_events(&self, id: Uuid) -> Result<Vec<RecordedEvent>, RecordingError> {
        let mut all = Vec::new();
        let mut query = EventQuery::whole_session();
        loop {
            let page = self.events(id, &query).await?;
            let more = query.next_page(&page);
            all.extend(page.events);
            if !more {
                return Ok(all);
            }
        }
    }

    /// A page of session `id`'s events.
    pub async fn events(&self, id: Uuid, q: &EventQuery) -> Result<EventsPage, RecordingError> {
        let c = self.client().await?;
        let sid: i64 = c
            .query_opt("SELECT sid FROM sessions WHERE id = $1", &[&id.to_string()])
            .await
            .map_err(db_err("find a session"))?
            .ok_or(RecordingError::NotFound(id))?
            .get(0);
        let limit = q.limit.max(1);
        let fetch = limit as i64 + 1;
        let types: Vec<&str> = q.types.iter().map(String::as_str).collect();
        let kernel_channels: Vec<&str> = q
            .channels
            .iter()
            .map(String::as_str)
            .filter(|c| *c != "broker")
            .collect();
        let by_channel = !q.channels.is_empty();
        let broker = q.channels.iter().any(|c| c == "broker");
        let st = c
            .prepare_cached(EVENTS_SELECT)
            .await
            .map_err(db_err("read events"))?;
        let rows = c
            .query(
                &st,
                &[
                    &sid,
                    &q.after,
                    &fetch,
                    &types,
                    &by_channel,
                    &kernel_channels,
                    &broker,
                ],
            )
            .await
            .map_err(db_err("read events"))?;
        let mut rows: Vec<Row> = rows.iter().map(event_row).collect();
        let more = rows.len() > limit;
        rows.truncate(limit);
        let mut events = to_events(&c, sid, rows).await?;
        let mut fetched = HashMap::new();
        for w in executions_to_fetch(&events, q) {
            let rows = c
                .query(EXECUTION_SELECT, &[&sid, &w.after, &w.before, &w.msg_id])
                .await
                .map_err(db_err("read an execution's messages"))?;
            let rows = rows.iter().map(event_row).collect();
            fetched.insert(w.before, to_events(&c, sid, rows).await?);
        }
        complete_executions(&mut events, &fetched);
        Ok(EventsPage { events, more })
    }
}

/// Rows of session row `sid` as events, what they refer to fetched at once.
async fn to_events(
    c: &deadpool_postgres::Client,
    sid: i64,
    rows: Vec<Row>,
) -> Result<Vec<RecordedEvent>, RecordingError> {
    // What the rows refer to, fetched at once.
    let mut shas = Vec::new();
    let mut seqs = Vec::new();
    for r in &rows {
        if r.has_blobs {
            if let Some(v) = r
                .content
                .as_deref()
                .and_then(|c| serde_json::from_str::<Value>(c).ok())
            {
                shas.extend(blobs::references(&v));
            }
        }
        if let Some(list) = &r.buffers {
            shas.extend(buffer_hashes(list));
        }
        if let (None, Some(seq)) = (&r.parent_header, r.parent_seq) {
            seqs.push(seq);
        }
    }
    let mut found = Prefetched::default();
    if !shas.is_empty() {
        shas.sort();
        shas.dedup();
        for r in c
            .query(
                "SELECT sha256, base64, data FROM blobs WHERE sha256 = ANY($1)",
                &[&shas],
            )
            .await
            .map_err(db_err("read blobs"))?
        {
            found.blobs.insert(r.get(0), (r.get(1), r.get(2)));
        }
    }
    if !seqs.is_empty() {
        for r in c
            .query(
                "SELECT seq, header FROM events WHERE sid = $1 AND seq = ANY($2)",
                &[&sid, &seqs],
            )
            .await
            .map_err(db_err("read parent headers"))?
        {
            found.headers.insert(r.get(0), r.get(1));
        }
    }
    rows.into_iter()
        .map(|row| to_event(row, &mut found))
        .collect()
}

/// A page's blobs and parent headers.
#[derive(Default)]
struct Prefetched {
    blobs: HashMap<String, (bool, Vec<u8>)>,
    headers: HashMap<i64, Option<String>>,
}

impl Lookup for Prefetched {
    fn blob(&mut self, sha: &str) -> Result<Option<(bool, Vec<u8>)>, RecordingError> {
        Ok(self.blobs.get(sha).cloned())
    }

    fn header(&mut self, seq: i64) -> Result<Option<String>, RecordingError> {
        Ok(self.headers.get(&seq).cloned().flatten())
    }
}

/// A page of events: `$4` the types (none: all), `$5` whether to filter by channel, `$6` the
/// kernel channels and `$7` whether broker events are among them.
const EVENTS_SELECT: &str = concat!(
    "SELECT ",
    row_columns!(),
    " FROM events
     WHERE sid = $1 AND seq > $2
       AND (cardinality($4::text[]) = 0 OR msg_type = ANY($4) OR kind = ANY($4))
       AND (NOT $5 OR channel = ANY($6) OR ($7 AND direction = 'broker'))
     ORDER BY seq LIMIT $3"
);

/// The messages of an execution stored once: `$1` the session row, `$2` and `$3` the
/// window, `$4` the request's msg_id (see `ExecutionWindow`).
const EXECUTION_SELECT: &str = concat!(
    "SELECT ",
    row_columns!(),
    " FROM events WHERE sid = $1 AND seq > $2 AND seq < $3 AND parent_msg_id = $4
       AND direction = 'from_kernel' ORDER BY seq"
);

const INFO_SELECT: &str = r#"SELECT id, "user", kernel, created_at, ended_at, end_reason, cells, events, last_event_at FROM sessions"#;

fn info_row(r: &tokio_postgres::Row) -> RecordingInfo {
    RecordingInfo {
        id: Uuid::parse_str(r.get(0)).unwrap_or_default(),
        user: r.get(1),
        kernel: r.get(2),
        created_at: from_micros(r.get(3)),
        ended_at: r.get::<_, Option<i64>>(4).map(from_micros),
        end_reason: r.get(5),
        cells: r.get::<_, i64>(6).max(0) as u64,
        events: r.get::<_, i64>(7).max(0) as u64,
        last_event_at: r.get::<_, Option<i64>>(8).map(from_micros),
    }
}

fn event_row(r: &tokio_postgres::Row) -> Row {
    Row {
        seq: r.get(0),
        time: r.get(1),
        direction: r.get(2),
        channel: r.get(3),
        msg_type: r.get(4),
        msg_id: r.get(5),
        parent_msg_id: r.get(6),
        header: r.get(7),
        parent_header: r.get(8),
        metadata: r.get(9),
        content: r.get(10),
        kind: r.get(11),
        has_blobs: r.get(12),
        buffers: r.get(13),
        parent_seq: r.get(14),
    }
}
