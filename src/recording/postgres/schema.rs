//! The recording's tables in PostgreSQL, as migrations the database layer applies
//! ([`crate::db::postgres::migrate`], which keeps the versions in `schema_migrations`; the
//! recording has version 1 of the sequence every owner shares).
//!
//! The tables are those of the SQLite file ([`crate::recording::schema`]) in PostgreSQL's
//! types, plus `sessions.node`: the broker that records the session (a broker that starts
//! again closes the sessions it left open, never another's). Version 4 adds what version 3
//! of the file does (the session's front door, metadata, failures and closer; `search_text`)
//! and fills it from the events as that migration does; version 5 adds what version 4 of
//! the file does (a fork's parent: `forked_from`, `forked_at`, `forked_checkpoint`), filled
//! from the `session_created` events that name one. The search index over
//! `search_text.text` is `pg_trgm`'s GIN index (for `ILIKE`), made after the migrations
//! ([`trigram_index`]) and outside them: a server without the `pg_trgm` extension (or a
//! role that may not create it) still records, and searches by scanning.

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
    // Who made and ended a session, its failures, the search index's text.
    Migration {
        version: 4,
        sql: r#"
ALTER TABLE sessions ADD COLUMN front_door TEXT;
ALTER TABLE sessions ADD COLUMN metadata TEXT;
ALTER TABLE sessions ADD COLUMN errors BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN ended_by TEXT;
CREATE TABLE search_text (
    sid BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    field TEXT NOT NULL,
    text TEXT NOT NULL
);
CREATE INDEX search_text_by_session ON search_text (sid, seq);
CREATE FUNCTION pg_temp.kb_json(t TEXT) RETURNS JSONB LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN t::jsonb;
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$;
INSERT INTO search_text (sid, seq, field, text)
  SELECT sid, seq, 'code', pg_temp.kb_json(content)->>'code' FROM events
  WHERE direction = 'to_kernel' AND msg_type = 'execute_request'
    AND trim(coalesce(pg_temp.kb_json(content)->>'code', '')) <> '';
INSERT INTO search_text (sid, seq, field, text)
  SELECT sid, seq, 'error',
         coalesce(pg_temp.kb_json(content)->>'ename', '') || ': '
         || coalesce(pg_temp.kb_json(content)->>'evalue', '')
  FROM events WHERE direction = 'from_kernel' AND msg_type = 'error';
INSERT INTO search_text (sid, seq, field, text)
  SELECT sid, seq, 'output', left(pg_temp.kb_json(content)->>'text', 4096) FROM events
  WHERE direction = 'from_kernel' AND msg_type = 'stream'
    AND trim(coalesce(pg_temp.kb_json(content)->>'text', '')) <> '';
UPDATE sessions s SET errors = (
    SELECT count(*) FROM events e
    WHERE e.sid = s.sid AND e.kind = 'execution_done'
      AND coalesce(pg_temp.kb_json(e.content)#>>'{outcome,status}',
                   pg_temp.kb_json(e.content)#>>'{execution,status}')
          IN ('error', 'timeout', 'dead'));
UPDATE sessions s SET
    front_door = (SELECT pg_temp.kb_json(e.content)->>'front_door' FROM events e
                  WHERE e.sid = s.sid AND e.kind = 'session_created' ORDER BY e.seq LIMIT 1),
    metadata = (SELECT (pg_temp.kb_json(e.content)->'metadata')::text FROM events e
                WHERE e.sid = s.sid AND e.kind = 'session_created'
                  AND jsonb_typeof(pg_temp.kb_json(e.content)->'metadata') = 'object'
                ORDER BY e.seq LIMIT 1),
    ended_by = (SELECT pg_temp.kb_json(e.content)->>'by' FROM events e
                WHERE e.sid = s.sid AND e.kind = 'session_closed' ORDER BY e.seq DESC LIMIT 1);
DROP FUNCTION pg_temp.kb_json(TEXT);
"#,
    },
    // The session a fork was made from, and where.
    Migration {
        version: 5,
        sql: r#"
ALTER TABLE sessions ADD COLUMN forked_from TEXT;
ALTER TABLE sessions ADD COLUMN forked_at BIGINT;
ALTER TABLE sessions ADD COLUMN forked_checkpoint TEXT;
CREATE FUNCTION pg_temp.kb_json(t TEXT) RETURNS JSONB LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN t::jsonb;
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$;
UPDATE sessions s SET
    forked_from = f.parent->>'session',
    forked_at = CASE WHEN jsonb_typeof(f.parent->'execution_count') = 'number'
                     THEN (f.parent->>'execution_count')::numeric::bigint END,
    forked_checkpoint = f.parent->>'checkpoint'
FROM (SELECT DISTINCT ON (e.sid) e.sid, pg_temp.kb_json(e.content)->'forked_from' AS parent
      FROM events e WHERE e.kind = 'session_created' ORDER BY e.sid, e.seq) f
WHERE f.sid = s.sid AND jsonb_typeof(f.parent) = 'object'
  AND jsonb_typeof(f.parent->'session') = 'string';
DROP FUNCTION pg_temp.kb_json(TEXT);
"#,
    },
];

/// How many versions of the schema are the recording's (all applied once a store opened).
#[cfg(test)]
pub(in crate::recording) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Makes `pg_trgm`'s GIN index over the search text, if the server lets this role (without
/// it a search scans `search_text`, which is correct but slower; said once, here, when the
/// broker starts).
pub(in crate::recording) async fn trigram_index(client: &Client, location: &str) {
    let r = client
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS pg_trgm;
             CREATE INDEX IF NOT EXISTS search_text_trigrams
               ON search_text USING gin (text gin_trgm_ops);",
        )
        .await;
    if let Err(e) = r {
        tracing::warn!(db = %location, error = %e,
            "recording: no pg_trgm index for the session search; searches scan the search text");
    }
}

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
