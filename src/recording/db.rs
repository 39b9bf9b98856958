//! What the writer asks of a database, whichever it is: the embedded SQLite file
//! ([`super::sqlite`]) or a PostgreSQL server shared by several brokers ([`super::postgres`]).
//! The writer decides what becomes rows (budgets, blobs, parent references, sequence
//! numbers); a [`WriteDb`] only stores and finds them. Each call is one statement or a few,
//! inside the batch's transaction unless it says otherwise.

use std::collections::HashSet;

use uuid::Uuid;

use super::search::MatchField;

/// An error of either database.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    /// No pool could be made of the URL.
    #[error(transparent)]
    CreatePool(#[from] crate::db::postgres::PoolError),
    /// The pool gave no connection (the server did not answer in time, or refused).
    #[error(transparent)]
    Checkout(#[from] deadpool_postgres::PoolError),
    /// The writer thread's runtime could not be built.
    #[error("cannot start the database runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A session's row, just inserted or found, was not there when read back in the same
    /// transaction (another broker deleted it in between).
    #[error("the row of session {id} vanished")]
    SessionRowVanished { id: String },
}

/// One row of `events`, as the writer stores it.
#[derive(Debug, Default)]
pub(super) struct EventRow<'a> {
    pub sid: i64,
    pub seq: i64,
    pub time: i64,
    /// `to_kernel`, `from_kernel` or `broker`.
    pub direction: &'a str,
    pub channel: Option<&'a str>,
    pub msg_type: Option<&'a str>,
    pub msg_id: Option<&'a str>,
    pub parent_msg_id: Option<&'a str>,
    pub header: Option<&'a str>,
    pub parent_header: Option<&'a str>,
    pub parent_seq: Option<i64>,
    pub metadata: Option<&'a str>,
    pub content: &'a str,
    /// A broker event's kind.
    pub kind: Option<&'a str>,
    pub has_blobs: bool,
    pub buffers: Option<&'a str>,
}

impl<'a> EventRow<'a> {
    /// A broker event (a lifecycle event or a marker of the recording).
    pub fn broker(sid: i64, seq: i64, time: i64, kind: &'a str, content: &'a str) -> Self {
        Self {
            sid,
            seq,
            time,
            direction: "broker",
            kind: Some(kind),
            content,
            ..Default::default()
        }
    }
}

/// One row of `search_text` (the search index), as the writer stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct IndexText {
    pub sid: i64,
    /// The event that holds the text (an execution's output: its first output message).
    pub seq: i64,
    pub field: MatchField,
    pub text: String,
}

/// One row of `blobs`, as the writer stores it.
pub(super) struct BlobRow<'a> {
    pub sha256: &'a str,
    /// Whether `data` is the decoded bytes of a base64 string (put back encoded).
    pub base64: bool,
    pub data: &'a [u8],
    /// The bytes it stands for in the recording (the base64 text's length).
    pub size: i64,
}

/// What a batch changed of one session's row.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct SessionDelta {
    pub events: i64,
    pub cells: i64,
    /// Executions that failed (see `writer::search`).
    pub errors: i64,
    pub last: i64,
    pub ended: Option<(i64, &'static str)>,
}

/// The `broker_stopped` marker written into sessions a killed broker left open, and the
/// sessions it kept (`--keep-sessions`), which stay open.
pub(super) struct StaleMarker<'a> {
    pub kept: &'a HashSet<Uuid>,
    pub now: i64,
    pub kind: &'a str,
    pub detail: &'a str,
}

/// The writer's database. Blocking: called on the writer thread only.
pub(super) trait WriteDb: Send {
    /// Where the recordings are, for logs (never a password).
    fn describe(&self) -> String;
    /// Begins the transaction of a batch.
    fn begin(&mut self) -> Result<(), DbError>;
    fn commit(&mut self) -> Result<(), DbError>;
    fn rollback(&mut self);
    /// The row of a session (created if it has none) and its largest sequence number.
    fn session(
        &mut self,
        id: Uuid,
        user: &str,
        kernel: &str,
        created_at: i64,
    ) -> Result<(i64, i64), DbError>;
    /// Whether session row `sid` already stores blob `sha`.
    fn has_blob_ref(&mut self, sid: i64, sha: &str) -> Result<bool, DbError>;
    /// Stores a blob (once per SHA-256) and session row `sid`'s reference to it.
    fn put_blob(&mut self, sid: i64, blob: &BlobRow<'_>) -> Result<(), DbError>;
    fn insert_event(&mut self, row: &EventRow<'_>) -> Result<(), DbError>;
    /// Rewrites the content of event `seq` (a truncation marker's counts).
    fn set_event_content(&mut self, sid: i64, seq: i64, content: &str) -> Result<(), DbError>;
    fn update_session(&mut self, sid: i64, delta: &SessionDelta) -> Result<(), DbError>;
    /// Adds a row to the search index (`search_text`).
    fn index_text(&mut self, row: &IndexText) -> Result<(), DbError>;
    /// Sets which front door made session row `sid` and its metadata (a JSON object).
    fn set_origin(
        &mut self,
        sid: i64,
        front_door: Option<&str>,
        metadata: &str,
    ) -> Result<(), DbError>;
    /// Sets the session a fork (row `sid`) was made from: its id, its execution count at the
    /// fork, and the checkpoint of it the fork was made from, if it was.
    fn set_forked_from(
        &mut self,
        sid: i64,
        parent: &str,
        execution_count: i64,
        checkpoint: Option<&str>,
    ) -> Result<(), DbError>;
    /// Sets who or what ended session row `sid`.
    fn set_ended_by(&mut self, sid: i64, by: &str) -> Result<(), DbError>;
    /// Deletes session `id`'s recording, in a transaction of its own (never inside a
    /// batch's); whether there was one.
    fn delete(&mut self, id: Uuid) -> Result<bool, DbError>;
    /// Closes the sessions this broker left open (all but `marker.kept`) with `marker`, in a
    /// transaction of its own; how many.
    fn close_stale(&mut self, marker: &StaleMarker<'_>) -> Result<usize, DbError>;
    /// Deletes every session that ended before `cutoff`; how many.
    fn retention(&mut self, cutoff: i64) -> Result<usize, DbError>;
    /// The writer stops: last housekeeping.
    fn stop(&mut self);
}
