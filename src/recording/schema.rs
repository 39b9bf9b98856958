//! The recordings file's schema: its tables and indexes, its version, the migrations from
//! older versions, and opening the file (the writer's connection and the readers').
//!
//! The schema (version 2, [`SCHEMA_VERSION`], kept in SQLite's `user_version`):
//! - `sessions`: one row per recorded session: `id`, `user`, `kernel`, `created_at`,
//!   `ended_at`, `end_reason` (`closed`, `expired`, `broker_stopped`), counters.
//! - `events`: one row per message or broker event, `(sid, seq)` in order; `time` in
//!   microseconds since the epoch; the four JSON parts of a message as text (for a broker
//!   event, `content` holds its detail and `kind` its name). A kernel message whose
//!   `parent_header` is the header of a request recorded in the same session stores
//!   `parent_seq` (that request's `seq`) instead of a copy: a third of the file, put back on
//!   read.
//! - `blobs`: images taken out of events (see [`super::blobs`]) and binary buffers, once
//!   per SHA-256; `blob_refs` says which sessions use which, so deletion can collect them.
//!
//! Versions: 1 had no `events.parent_seq` (every parent header stored as text); 2 added it.
//! A file of an older version is migrated when opened for writing; a file of a newer
//! version is refused ([`RecordingError::SchemaTooNew`]) rather than written wrongly.

use std::path::Path;
use std::time::Duration;

use rusqlite::Connection;

use super::{RecordingConfig, RecordingError, Synchronous};

/// The version this broker writes.
pub(super) const SCHEMA_VERSION: i64 = 2;

/// The current schema, for a new file.
const SCHEMA: &str = "
CREATE TABLE sessions (
    sid INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    user TEXT NOT NULL,
    kernel TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    ended_at INTEGER,
    end_reason TEXT,
    cells INTEGER NOT NULL DEFAULT 0,
    events INTEGER NOT NULL DEFAULT 0,
    last_event_at INTEGER
);
CREATE INDEX sessions_by_user ON sessions(user, created_at);
CREATE INDEX sessions_by_end ON sessions(ended_at) WHERE ended_at IS NOT NULL;
CREATE TABLE events (
    sid INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    time INTEGER NOT NULL,
    direction TEXT NOT NULL,
    channel TEXT,
    msg_type TEXT,
    msg_id TEXT,
    parent_msg_id TEXT,
    header TEXT,
    parent_header TEXT,
    parent_seq INTEGER,
    metadata TEXT,
    content TEXT,
    kind TEXT,
    has_blobs INTEGER NOT NULL DEFAULT 0,
    buffers TEXT,
    PRIMARY KEY (sid, seq)
);
CREATE TABLE blobs (
    sha256 TEXT PRIMARY KEY,
    base64 INTEGER NOT NULL,
    size INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE TABLE blob_refs (
    sha256 TEXT NOT NULL,
    sid INTEGER NOT NULL,
    PRIMARY KEY (sha256, sid)
) WITHOUT ROWID;
CREATE INDEX blob_refs_by_session ON blob_refs(sid);
";

/// Migrations: `MIGRATIONS[i]` takes a file from version `i + 1` to `i + 2`.
const MIGRATIONS: &[&str] = &[
    // 1 -> 2: parent headers stored as a reference to the request's row.
    "ALTER TABLE events ADD COLUMN parent_seq INTEGER;",
];

pub(super) fn sqlite(context: &'static str) -> impl FnOnce(rusqlite::Error) -> RecordingError {
    move |source| RecordingError::Db {
        context,
        source: source.into(),
    }
}

/// Open (creating if needed) the recordings file for writing and bring its schema up to date.
pub(super) fn open(config: &RecordingConfig) -> Result<Connection, RecordingError> {
    let path = &config.path;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| RecordingError::Dir {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let open_err = |source| RecordingError::Open {
        path: path.clone(),
        source,
    };
    let conn = Connection::open(path).map_err(open_err)?;
    conn.busy_timeout(Duration::from_secs(10))
        .map_err(open_err)?;
    // auto_vacuum must be chosen before the first table exists; a no-op afterwards.
    conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL;")
        .map_err(open_err)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(open_err)?;
    if !mode.eq_ignore_ascii_case("wal") {
        tracing::warn!(path = %path.display(), %mode, "the recordings file is not in WAL mode");
    }
    let sync = match config.synchronous {
        Synchronous::Normal => "NORMAL",
        Synchronous::Full => "FULL",
    };
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {sync}; PRAGMA temp_store = MEMORY;"
    ))
    .map_err(open_err)?;
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(open_err)?;
    if version > SCHEMA_VERSION {
        return Err(RecordingError::SchemaTooNew {
            location: path.display().to_string(),
            found: version,
            known: SCHEMA_VERSION,
        });
    }
    // A negative version is no file of ours: left as it is (its writes will fail and be
    // counted) rather than altered.
    if version < 0 {
        return Ok(conn);
    }
    if version == 0 {
        conn.execute_batch(&format!(
            "BEGIN; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
        ))
        .map_err(open_err)?;
        return Ok(conn);
    }
    // Each step in its own transaction, so a failed step leaves a file of the version before.
    for (i, step) in MIGRATIONS.iter().enumerate() {
        let from = i as i64 + 1;
        if from < version {
            continue;
        }
        conn.execute_batch(&format!(
            "BEGIN; {step} PRAGMA user_version = {}; COMMIT;",
            from + 1
        ))
        .map_err(open_err)?;
    }
    Ok(conn)
}

/// Open a read-only connection to the recordings file.
pub(super) fn open_reader(path: &Path) -> Result<Connection, RecordingError> {
    use rusqlite::OpenFlags;
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(|source| RecordingError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    conn.busy_timeout(Duration::from_secs(10))
        .map_err(sqlite("set the busy timeout"))?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Version 1 as it was released: no `events.parent_seq`.
    fn version_1() -> String {
        format!(
            "{} PRAGMA user_version = 1;",
            SCHEMA.replace("    parent_seq INTEGER,\n", "")
        )
    }

    #[test]
    fn every_version_has_its_migration() {
        assert_eq!(MIGRATIONS.len() as i64, SCHEMA_VERSION - 1);
        assert!(!version_1().contains("parent_seq"));
    }

    #[test]
    fn a_version_1_file_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = RecordingConfig::new(dir.path().join("r.sqlite3"));
        let conn = open(&cfg).unwrap();
        conn.execute_batch("ALTER TABLE events DROP COLUMN parent_seq; PRAGMA user_version = 1;")
            .unwrap();
        drop(conn);
        let conn = open(&cfg).unwrap();
        let v: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        conn.execute(
            "INSERT INTO events (sid, seq, time, direction, parent_seq) VALUES (1, 1, 0, 'x', 7)",
            [],
        )
        .unwrap();
        conn.execute_batch("PRAGMA user_version = 99").unwrap();
        drop(conn);
        assert!(matches!(
            open(&cfg),
            Err(RecordingError::SchemaTooNew { found: 99, .. })
        ));
    }

    #[test]
    fn a_version_1_file_keeps_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = RecordingConfig::new(dir.path().join("r.sqlite3"));
        {
            let conn = Connection::open(&cfg.path).unwrap();
            conn.execute_batch(&version_1()).unwrap();
            conn.execute_batch(
                "INSERT INTO sessions (sid, id, user, kernel, created_at) VALUES (1, 's', 'alice', 'python3', 5);
                 INSERT INTO events (sid, seq, time, direction, parent_header, content)
                   VALUES (1, 1, 6, 'from_kernel', '{\"msg_id\": \"r\"}', '{}');",
            )
            .unwrap();
        }
        let conn = open(&cfg).unwrap();
        let v: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        let row: (String, Option<i64>) = conn
            .query_row(
                "SELECT parent_header, parent_seq FROM events WHERE sid = 1 AND seq = 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(row, (r#"{"msg_id": "r"}"#.to_string(), None));
        let user: String = conn
            .query_row("SELECT user FROM sessions WHERE sid = 1", [], |r| r.get(0))
            .unwrap();
        assert_eq!(user, "alice");
        // Opening again is a no-op.
        drop(conn);
        open(&cfg).unwrap();
    }
}
