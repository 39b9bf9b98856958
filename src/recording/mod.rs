//! Recording: every message of every session, and the broker's lifecycle events, kept in a
//! SQLite file (or, with `--database-url`, in PostgreSQL, shared by a cluster's brokers) so a session can be read back, exported as a notebook, replayed and browsed
//! after it has ended.
//!
//! The session layer reports through [`crate::session::Recorder`]; [`RecordingStore`]
//! implements it. Reporting never blocks the session: a report is queued (its bytes are
//! shared, not copied) to one writer thread that stores whole batches in one transaction.
//! `barrier()` resolves once everything queued before it is committed, and the session layer
//! acknowledges an execution only after it, so an acknowledged execution is in the file
//! (unless the writer is stuck for 30 s, on a failing disk say: then the acknowledgement goes
//! out anyway and the error is logged and counted, rather than every client hanging).
//!
//! Durability: the file is in WAL mode with `synchronous=NORMAL` by default. A commit then
//! writes the WAL but does not fsync it; the pages are in the operating system's cache, so a
//! killed broker (`kill -9`, a panic, OOM) loses nothing it committed. Only a crash of the
//! machine itself (power loss, kernel panic) can lose the last commits before a checkpoint.
//! `--record-synchronous full` fsyncs every commit and closes that gap too, at the price of
//! one fsync per batch.
//!
//! What is kept small: an execution is stored once, as its messages; its `execution_done`
//! keeps only what they do not say (status, count, duration...), and the execution is
//! rebuilt from them on read (`rebuild`; the whole execution is stored instead when the
//! writer could not record all of its messages, see `writer::in_flight`). Base64 images in
//! `display_data` / `execute_result` (and in a whole Execution) are stored once per distinct
//! image in `blobs` (by SHA-256) and put back on read ([`blobs`]). Memory is bounded: when more than
//! [`RecordingConfig::max_queue_bytes`] wait for the writer, reports are dropped and counted,
//! and the recording gets a `recording_gap` marker. The file is bounded per session: the
//! writer counts the bytes each session stores (every message type and broker event, each
//! distinct image once) against [`RecordingConfig::max_execution_bytes`] per execution and
//! [`RecordingConfig::max_session_bytes`] in all; past a cap, messages are not recorded and
//! one `recording_truncated` marker says how many and how many bytes were dropped (see
//! `writer::budget`).
//!
//! Architecture invariant: this layer knows sessions and Jupyter messages, not HTTP; the API
//! layer shapes what it returns as JSON. It does not drive sessions: replaying a recording
//! does, so replay sits above this layer (`crate::replay`).
//!
//! # Layout
//!
//! - `store`: the handle ([`RecordingStore`]): reports queued to the writer (bounded in
//!   bytes), the [`crate::session::Recorder`] implementation, reads on blocking threads.
//! - `writer`: the writer thread (batches, transactions, barriers); how a report becomes
//!   rows; the per-execution and per-session budgets; the executions in flight (what
//!   decides how an `execution_done` is stored); retention and deletion.
//! - `schema`: tables, indexes, the schema version and migrations; opening the file.
//! - `queries`: reads: a session's events (paged, filtered), info.
//! - `listing`: the recordings list, filtered and searched in the database; [`search`]: its
//!   filters, the escaping of a search's text and the snippets of its matches (pure).
//! - `rebuild`: an execution stored once, rebuilt from its messages and its outcome with
//!   the session layer's collector; whether one can be stored so (pure).
//! - [`blobs`]: images and buffers taken out of events and put back (pure).
//! - [`stored`]: the recording's own stored types ([`stored::StoredEvent`]), converted from
//!   what the session layer reports; their serde form is what is on disk, versioned.
//! - [`event`]: stored broker events read back typed (stored session events and the
//!   recording's own markers).
//! - [`notebook`]: the recording as cells and markers, and as an nbformat notebook (pure).

pub mod blobs;
mod db;
pub mod event;
mod listing;
pub mod notebook;
mod postgres;
mod queries;
mod rebuild;
mod schema;
pub mod search;
mod sqlite;
mod store;
pub mod stored;
mod writer;

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

pub use db::DbError;
pub use queries::{EventQuery, EventsPage, RecordedEvent, RecordedKind, RecordingInfo};
pub use search::{ListQuery, ListedRecording, MatchField, SearchMatch, StateFilter};
pub use store::{RecordingStats, RecordingStore};

/// How hard a commit tries to reach the disk (SQLite's `synchronous` pragma). Also the
/// `--record-synchronous` flag's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    /// Survives a killed process; a machine crash may lose the last commits.
    #[default]
    Normal,
    /// fsync on every commit: survives a machine crash too.
    Full,
}

/// Settings of the recording.
#[derive(Debug, Clone)]
pub struct RecordingConfig {
    /// The SQLite file (unless `database_url` is set).
    pub path: PathBuf,
    /// `postgres://...`: the recordings are in this PostgreSQL database instead of the file.
    pub database_url: Option<String>,
    /// This broker's node id: which open sessions in a shared database are its own (those
    /// a killed broker left open are closed when it starts again).
    pub node: String,
    /// Ended sessions older than this are deleted; `None` keeps them forever.
    pub retention: Option<Duration>,
    pub synchronous: Synchronous,
    /// Bytes allowed to wait for the writer before reports are dropped.
    pub max_queue_bytes: usize,
    /// Bytes recorded per execution (see `writer::budget`), every message type.
    pub max_execution_bytes: u64,
    /// Bytes recorded per session.
    pub max_session_bytes: u64,
    /// Base64 image strings at least this long are stored as blobs.
    pub blob_threshold: usize,
    /// Sessions an earlier run kept (`--keep-sessions`): their recordings stay open at
    /// start, to be continued, instead of being closed as left open by a crash.
    pub kept_sessions: std::collections::HashSet<uuid::Uuid>,
}

impl RecordingConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            database_url: None,
            node: "local".into(),
            retention: Some(Duration::from_secs(30 * 86_400)),
            synchronous: Synchronous::Normal,
            max_queue_bytes: 256 << 20,
            max_execution_bytes: 50 << 20,
            max_session_bytes: 1 << 30,
            blob_threshold: 1024,
            kept_sessions: Default::default(),
        }
    }
}

/// Errors of the recording layer.
#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("no recording of session {0}")]
    NotFound(Uuid),
    #[error("the recordings file {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("could not create the directory of the recordings file {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the recordings database {location}: {source}")]
    Connect {
        /// The URL without its password.
        location: String,
        #[source]
        source: DbError,
    },
    #[error(
        "the recordings in {location} have schema version {found}; this broker knows up to {known}"
    )]
    SchemaTooNew {
        location: String,
        found: i64,
        known: i64,
    },
    #[error("recording store, {context}: {source}")]
    Db {
        context: &'static str,
        #[source]
        source: DbError,
    },
    #[error("the recording writer has stopped")]
    WriterGone,
    #[error("a recording task failed")]
    Task(#[source] tokio::task::JoinError),
    #[error(transparent)]
    Session(#[from] crate::session::SessionError),
}

/// The recording's tables in PostgreSQL (the database layer applies them).
pub use postgres::MIGRATIONS as POSTGRES_MIGRATIONS;

/// Cluster mode: ends the open recordings of a lost node with a `node_lost` marker, but
/// those of sessions `kept` (paused, away until the node is back); how many.
pub async fn close_lost_node(
    client: &tokio_postgres::Client,
    node: &str,
    kept: &[String],
) -> Result<u64, RecordingError> {
    postgres::close_node(client, node, kept, micros(Utc::now()))
        .await
        .map_err(|source| RecordingError::Db {
            context: "close a lost node's sessions",
            source,
        })
}

/// Microseconds since the Unix epoch, as stored.
pub(crate) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

/// The inverse of [`micros`]; out-of-range values become the epoch.
pub(crate) fn from_micros(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}
