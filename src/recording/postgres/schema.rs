//! The broker's tables in PostgreSQL (the recordings, and cluster mode's) and their versions. `schema_migrations` holds one
//! row per version applied; a broker applies what is missing at start, all of it in one
//! transaction under an advisory lock (brokers of a cluster start together; the first
//! migrates, the others wait and find nothing to do), and refuses a database whose version
//! is newer than it knows rather than writing it wrongly.
//!
//! The tables are those of the SQLite file ([`crate::recording::schema`]) in PostgreSQL's
//! types, plus `sessions.node`: the broker that records the session (a broker that starts
//! again closes the sessions it left open, never another's).

use tokio_postgres::Client;

use crate::recording::db::DbError;
use crate::recording::RecordingError;

/// Held while migrating.
const MIGRATION_LOCK: i64 = 0x6b62_6d69_6772; // "kbmigr"

/// `MIGRATIONS[i]` brings the database to version `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 1: the recordings.
    r#"
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
    // 2: cluster mode (`crate::cluster`): the nodes and their leases, the cluster's key.
    r#"
CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    advertise_url TEXT NOT NULL,
    started_at BIGINT NOT NULL,
    lease_until BIGINT NOT NULL,
    -- Set by the node that noticed the lease lapse (and closed the node's recordings);
    -- cleared when the node joins again.
    lost_at BIGINT,
    -- Load and capacity, as of the last renewal (placement).
    sessions BIGINT NOT NULL DEFAULT 0,
    memory_reserved BIGINT NOT NULL DEFAULT 0,
    memory_capacity BIGINT NOT NULL DEFAULT 0,
    session_capacity BIGINT NOT NULL DEFAULT 0,
    draining BOOLEAN NOT NULL DEFAULT false
);
CREATE TABLE cluster_key (
    id INT PRIMARY KEY CHECK (id = 1),
    key TEXT NOT NULL
);
"#,
    // 3: cluster mode's session directory: which node holds each session, written by the
    // node (at every lease renewal); the sessions of a lost node are marked so.
    r#"
CREATE TABLE cluster_sessions (
    id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    user_name TEXT NOT NULL,
    kernel TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    seen_at BIGINT NOT NULL,
    lost_at BIGINT
);
CREATE INDEX cluster_sessions_by_node ON cluster_sessions (node);
"#,
];

/// The version this broker writes.
pub(in crate::recording) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Brings the database up to [`SCHEMA_VERSION`].
pub(in crate::recording) async fn migrate(
    client: &Client,
    location: &str,
) -> Result<(), RecordingError> {
    let err = |source: tokio_postgres::Error| RecordingError::Connect {
        location: location.to_string(),
        source: DbError::Postgres(source),
    };
    client
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({MIGRATION_LOCK});
             CREATE TABLE IF NOT EXISTS schema_migrations (
                 version BIGINT PRIMARY KEY,
                 applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
             );"
        ))
        .await
        .map_err(err)?;
    let r = async {
        let found: i64 = client
            .query_one(
                "SELECT coalesce(max(version), 0) FROM schema_migrations",
                &[],
            )
            .await
            .map_err(err)?
            .get(0);
        if found > SCHEMA_VERSION {
            return Err(RecordingError::SchemaTooNew {
                location: location.to_string(),
                found,
                known: SCHEMA_VERSION,
            });
        }
        for (i, step) in MIGRATIONS.iter().enumerate().skip(found.max(0) as usize) {
            let version = i as i64 + 1;
            client.batch_execute(step).await.map_err(err)?;
            client
                .execute(
                    "INSERT INTO schema_migrations (version) VALUES ($1)",
                    &[&version],
                )
                .await
                .map_err(err)?;
            tracing::info!(db = %location, version, "recording: PostgreSQL schema migrated");
        }
        Ok(())
    }
    .await;
    match r {
        Ok(()) => client.batch_execute("COMMIT").await.map_err(err),
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}
