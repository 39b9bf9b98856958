//! The recording's tables in PostgreSQL, as migrations the database layer applies
//! ([`crate::db::postgres::migrate`], which keeps the versions in `schema_migrations`; the
//! recording has version 1 of the sequence every owner shares).
//!
//! The tables are those of the SQLite file ([`crate::recording::schema`]) in PostgreSQL's
//! types, plus `sessions.node`: the broker that records the session (a broker that starts
//! again closes the sessions it left open, never another's).

use tokio_postgres::Client;

use crate::db::postgres::{self as pg, MigrateError, Migration};
use crate::recording::db::DbError;
use crate::recording::RecordingError;

/// The recording's migrations.
pub const MIGRATIONS: &[Migration] = &[
    // The recordings.
    Migration {
        version: 1,
        sql: r#"
CREATE TABLE sessions (
    sid BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    "user" TEXT NOT NULL,
    kernel TEXT NOT NULL,
    node TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    ended_at BIGINT,
    end_reason TEXT,
    cells BIGINT NOT NULL DEFAULT 0,
    events BIGINT NOT NULL DEFAULT 0,
    last_event_at BIGINT
);
CREATE INDEX sessions_by_user ON sessions ("user", created_at);
CREATE INDEX sessions_by_end ON sessions (ended_at) WHERE ended_at IS NOT NULL;
CREATE INDEX sessions_open_by_node ON sessions (node) WHERE ended_at IS NULL;
CREATE TABLE events (
    sid BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    time BIGINT NOT NULL,
    direction TEXT NOT NULL,
    channel TEXT,
    msg_type TEXT,
    msg_id TEXT,
    parent_msg_id TEXT,
    header TEXT,
    parent_header TEXT,
    parent_seq BIGINT,
    metadata TEXT,
    content TEXT,
    kind TEXT,
    has_blobs BOOLEAN NOT NULL DEFAULT false,
    buffers TEXT,
    PRIMARY KEY (sid, seq)
);
CREATE TABLE blobs (
    sha256 TEXT PRIMARY KEY,
    base64 BOOLEAN NOT NULL,
    size BIGINT NOT NULL,
    data BYTEA NOT NULL
);
CREATE TABLE blob_refs (
    sha256 TEXT NOT NULL,
    sid BIGINT NOT NULL,
    PRIMARY KEY (sha256, sid)
);
CREATE INDEX blob_refs_by_session ON blob_refs (sid);
"#,
    },
];

/// How many versions of the schema are the recording's (all applied once a store opened).
#[cfg(test)]
pub(in crate::recording) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Brings the recording's tables up to date.
pub(in crate::recording) async fn migrate(
    client: &Client,
    location: &str,
) -> Result<(), RecordingError> {
    pg::migrate(client, location, "recording", MIGRATIONS)
        .await
        .map_err(|e| match e {
            MigrateError::TooNew {
                location,
                found,
                known,
            } => RecordingError::SchemaTooNew {
                location,
                found,
                known,
            },
            MigrateError::Query { location, source } => RecordingError::Connect {
                location,
                source: DbError::Postgres(source),
            },
        })
}
