//! Cluster mode's tables in PostgreSQL, as migrations the database layer applies
//! ([`crate::db::postgres::migrate`]): the nodes and their leases, the cluster's key, the
//! session directory. Their versions are 2, 3, 6 and 7 of the sequence every owner shares.

use crate::db::postgres::Migration;

/// Cluster mode's migrations.
pub const MIGRATIONS: &[Migration] = &[
    // The nodes and their leases, the cluster's key.
    Migration {
        version: 2,
        sql: r#"
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
    },
    // The session directory: which node holds each session, written by the node (at every
    // lease renewal); the sessions of a lost node are marked so.
    Migration {
        version: 3,
        sql: r#"
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
    },
    // Paused sessions: their state is on their node's disk, so the loss of the node does not
    // end them; they are away until it is back.
    Migration {
        version: 6,
        sql: r#"
ALTER TABLE cluster_sessions ADD COLUMN paused BOOLEAN NOT NULL DEFAULT false;
"#,
    },
    // Paused sessions carried to the database (`--carry-paused`): any node takes one over
    // once its node is not live. A copy is the node's (`node`) until a resume (which drops
    // it) or a takeover (which makes it the taker's, until its resume).
    Migration {
        version: 7,
        sql: r#"
CREATE TABLE paused_copies (
    session_id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    user_name TEXT NOT NULL,
    uid BIGINT NOT NULL,
    head BYTEA NOT NULL,
    bytes BIGINT NOT NULL,
    made_at BIGINT NOT NULL
);
CREATE TABLE paused_chunks (
    session_id TEXT NOT NULL REFERENCES paused_copies (session_id) ON DELETE CASCADE,
    file TEXT NOT NULL,
    at BIGINT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (session_id, file, at)
);
-- Images are stored as they are: compressing them (PostgreSQL's default for large values)
-- cost more time than it saved room.
ALTER TABLE paused_chunks ALTER COLUMN data SET STORAGE EXTERNAL;
-- The node a session was taken over from: the loss of that node does not end it.
ALTER TABLE cluster_sessions ADD COLUMN taken_from TEXT;
"#,
    },
];
