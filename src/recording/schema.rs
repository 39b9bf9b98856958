//! The recordings file's schema: its tables and indexes, its version, the migrations from
//! older versions, and opening the file (the writer's connection and the readers').
//!
//! The schema (version 4, [`SCHEMA_VERSION`], kept in SQLite's `user_version`):
//! - `sessions`: one row per recorded session: `id`, `user`, `kernel`, `created_at`,
//!   `ended_at`, `end_reason` (`closed`, `expired`, `broker_stopped`), counters; and, kept as
//!   the writer goes: `front_door` (`rest`, `jupyter`, `e2b`, `mcp`; from `session_created`),
//!   `metadata` (a JSON object of strings, from `session_created`), `errors` (executions
//!   that ended in an error, a timeout or with a dead kernel), `ended_by` (`session_closed`'s
//!   `by`, or `idle_expiry`); for a fork, `forked_from` (the parent session's id),
//!   `forked_at` (the parent's execution count at the fork) and `forked_checkpoint` (the
//!   parent's checkpoint it was forked from, if it was), from `session_created`'s
//!   `forked_from`.
//! - `events`: one row per message or broker event, `(sid, seq)` in order; `time` in
//!   microseconds since the epoch; the four JSON parts of a message as text (for a broker
//!   event, `content` holds its detail and `kind` its name). A kernel message whose
//!   `parent_header` is the header of a request recorded in the same session stores
//!   `parent_seq` (that request's `seq`) instead of a copy: a third of the file, put back on
//!   read.
//! - `blobs`: images taken out of events (see [`super::blobs`]) and binary buffers, once
//!   per SHA-256; `blob_refs` says which sessions use which, so deletion can collect them.
//! - `search_text`: the search index's text (`sid`, `seq` of the event that holds it,
//!   `field`: `code`, `output`, `error` or `metadata`; see `writer::search`), and
//!   `search_fts`, an FTS5 table over it with the `trigram` tokenizer (case-insensitive
//!   substrings of three characters or more), kept in step by triggers.
//!
//! Versions: 1 had no `events.parent_seq` (every parent header stored as text); 2 added it;
//! 3 added the session's front door, metadata, failures and who ended it, and the search
//! index. Migrating to 3 fills what the events say: the code of every `execute_request`, the
//! name and value of every `error` message (not its traceback), the text of `stream`
//! messages (the first 4096 characters of each, a row per message), the count of failed
//! agent executions, and the front door, metadata and closer when the events carry them; not
//! the `text/plain` of results and displays, the metadata values as search text, nor the
//! failures of executions run through Jupyter, which only sessions recorded from then on
//! have. 4 added the fork's parent (`forked_from`, `forked_at`, `forked_checkpoint`);
//! migrating to 4 fills them from the `session_created` events that name one.
//! A new file is made at version 2 and brought to the current version by the same
//! migrations, so a new file and a migrated one are alike. A file of an older version is
//! migrated when opened for writing; a file of a newer version is refused
//! ([`RecordingError::SchemaTooNew`]) rather than written wrongly.

use std::path::Path;
use std::time::Duration;

use rusqlite::Connection;

use super::{RecordingConfig, RecordingError, Synchronous};

/// The version this broker writes.
pub(super) const SCHEMA_VERSION: i64 = 4;

/// The schema of version 2, from which a new file is migrated.
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
    // 2 -> 3: who made and ended a session, its failures, the search index.
    "ALTER TABLE sessions ADD COLUMN front_door TEXT;
     ALTER TABLE sessions ADD COLUMN metadata TEXT;
     ALTER TABLE sessions ADD COLUMN errors INTEGER NOT NULL DEFAULT 0;
     ALTER TABLE sessions ADD COLUMN ended_by TEXT;
     CREATE TABLE search_text (
         sid INTEGER NOT NULL,
         seq INTEGER NOT NULL,
         field TEXT NOT NULL,
         text TEXT NOT NULL
     );
     CREATE INDEX search_text_by_session ON search_text(sid, seq);
     CREATE VIRTUAL TABLE search_fts USING fts5(
         text, content = 'search_text', content_rowid = 'rowid', tokenize = 'trigram'
     );
     CREATE TRIGGER search_text_added AFTER INSERT ON search_text BEGIN
         INSERT INTO search_fts (rowid, text) VALUES (new.rowid, new.text);
     END;
     CREATE TRIGGER search_text_removed AFTER DELETE ON search_text BEGIN
         INSERT INTO search_fts (search_fts, rowid, text) VALUES ('delete', old.rowid, old.text);
     END;
     INSERT INTO search_text (sid, seq, field, text)
       SELECT sid, seq, 'code', json_extract(content, '$.code') FROM events
       WHERE direction = 'to_kernel' AND msg_type = 'execute_request' AND json_valid(content)
         AND trim(coalesce(json_extract(content, '$.code'), '')) <> '';
     INSERT INTO search_text (sid, seq, field, text)
       SELECT sid, seq, 'error',
              coalesce(json_extract(content, '$.ename'), '') || ': '
              || coalesce(json_extract(content, '$.evalue'), '')
       FROM events
       WHERE direction = 'from_kernel' AND msg_type = 'error' AND json_valid(content);
     INSERT INTO search_text (sid, seq, field, text)
       SELECT sid, seq, 'output', substr(json_extract(content, '$.text'), 1, 4096) FROM events
       WHERE direction = 'from_kernel' AND msg_type = 'stream' AND json_valid(content)
         AND trim(coalesce(json_extract(content, '$.text'), '')) <> '';
     UPDATE sessions SET errors = (
         SELECT count(*) FROM events e
         WHERE e.sid = sessions.sid AND e.kind = 'execution_done' AND json_valid(e.content)
           AND coalesce(json_extract(e.content, '$.outcome.status'),
                        json_extract(e.content, '$.execution.status'))
               IN ('error', 'timeout', 'dead'));
     UPDATE sessions SET
         front_door = (SELECT json_extract(e.content, '$.front_door') FROM events e
                       WHERE e.sid = sessions.sid AND e.kind = 'session_created'
                         AND json_valid(e.content) ORDER BY e.seq LIMIT 1),
         metadata = (SELECT json_extract(e.content, '$.metadata') FROM events e
                     WHERE e.sid = sessions.sid AND e.kind = 'session_created'
                       AND json_valid(e.content)
                       AND json_type(e.content, '$.metadata') = 'object'
                     ORDER BY e.seq LIMIT 1),
         ended_by = (SELECT json_extract(e.content, '$.by') FROM events e
                     WHERE e.sid = sessions.sid AND e.kind = 'session_closed'
                       AND json_valid(e.content) ORDER BY e.seq DESC LIMIT 1);",
    // 3 -> 4: the session a fork was made from, and where.
    "ALTER TABLE sessions ADD COLUMN forked_from TEXT;
     ALTER TABLE sessions ADD COLUMN forked_at INTEGER;
     ALTER TABLE sessions ADD COLUMN forked_checkpoint TEXT;
     UPDATE sessions SET
         forked_from = (SELECT json_extract(e.content, '$.forked_from.session') FROM events e
                        WHERE e.sid = sessions.sid AND e.kind = 'session_created'
                          AND json_valid(e.content)
                          AND json_type(e.content, '$.forked_from.session') = 'text'
                        ORDER BY e.seq LIMIT 1),
         forked_at = (SELECT json_extract(e.content, '$.forked_from.execution_count') FROM events e
                      WHERE e.sid = sessions.sid AND e.kind = 'session_created'
                        AND json_valid(e.content)
                        AND json_type(e.content, '$.forked_from.execution_count') = 'integer'
                      ORDER BY e.seq LIMIT 1),
         forked_checkpoint = (SELECT json_extract(e.content, '$.forked_from.checkpoint') FROM events e
                              WHERE e.sid = sessions.sid AND e.kind = 'session_created'
                                AND json_valid(e.content)
                                AND json_type(e.content, '$.forked_from.checkpoint') = 'text'
                              ORDER BY e.seq LIMIT 1)
     WHERE EXISTS (SELECT 1 FROM events e WHERE e.sid = sessions.sid
                     AND e.kind = 'session_created' AND json_valid(e.content)
                     AND json_type(e.content, '$.forked_from') = 'object');",
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
    let version = if version == 0 {
        conn.execute_batch(&format!("BEGIN; {SCHEMA} PRAGMA user_version = 2; COMMIT;"))
            .map_err(open_err)?;
        2
    } else {
        version
    };
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
        let conn = Connection::open(&cfg.path).unwrap();
        conn.execute_batch(&version_1()).unwrap();
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

    /// A version-2 file: its sessions get their failures, front door and closer, and their
    /// code, errors and printed text become searchable.
    #[test]
    fn a_version_2_file_is_migrated_and_indexed() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = RecordingConfig::new(dir.path().join("r.sqlite3"));
        {
            let conn = Connection::open(&cfg.path).unwrap();
            conn.execute_batch(&format!("{SCHEMA} PRAGMA user_version = 2;"))
                .unwrap();
            conn.execute_batch(
                r#"INSERT INTO sessions (sid, id, user, kernel, created_at, ended_at, end_reason)
                     VALUES (1, 's1', 'alice', 'python3', 5, 9, 'closed'),
                            (2, 's2', 'alice', 'python3', 6, NULL, NULL);
                   INSERT INTO events (sid, seq, time, direction, msg_type, kind, content) VALUES
                     (1, 1, 5, 'broker', NULL, 'session_created',
                      '{"kernel": "python3", "front_door": "e2b", "metadata": {"team": "Blue"}}'),
                     (1, 2, 6, 'to_kernel', 'execute_request', NULL, '{"code": "import pandas"}'),
                     (1, 3, 6, 'from_kernel', 'stream', NULL, '{"name": "stdout", "text": "Hello Output"}'),
                     (1, 4, 6, 'from_kernel', 'error', NULL,
                      '{"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": []}'),
                     (1, 5, 7, 'broker', NULL, 'execution_done',
                      '{"msg_id": "m", "outcome": {"status": "error", "started_seq": 1}}'),
                     (1, 6, 7, 'broker', NULL, 'execution_done',
                      '{"msg_id": "n", "execution": {"status": "timeout"}}'),
                     (1, 7, 8, 'broker', NULL, 'execution_done',
                      '{"msg_id": "o", "outcome": {"status": "ok"}}'),
                     (1, 8, 9, 'broker', NULL, 'session_closed', '{"by": "rest"}'),
                     (2, 1, 6, 'to_kernel', 'execute_request', NULL, 'not json'),
                     (2, 2, 6, 'broker', NULL, 'session_created', '{"kernel": "python3"}');"#,
            )
            .unwrap();
        }
        let conn = open(&cfg).unwrap();
        let v: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        let row = |sid: i64| -> (i64, Option<String>, Option<String>, Option<String>) {
            conn.query_row(
                "SELECT errors, front_door, metadata, ended_by FROM sessions WHERE sid = ?1",
                [sid],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap()
        };
        assert_eq!(
            row(1),
            (
                2,
                Some("e2b".into()),
                Some(r#"{"team":"Blue"}"#.into()),
                Some("rest".into())
            )
        );
        assert_eq!(row(2), (0, None, None, None));
        let found = |q: &str| -> Vec<(i64, i64, String)> {
            let mut st = conn
                .prepare(
                    "SELECT t.sid, t.seq, t.field FROM search_fts f
                     JOIN search_text t ON t.rowid = f.rowid
                     WHERE search_fts MATCH ?1 ORDER BY t.sid, t.seq",
                )
                .unwrap();
            let rows = st
                .query_map([crate::recording::search::fts_phrase(q)], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })
                .unwrap();
            rows.map(Result::unwrap).collect()
        };
        // Case-insensitive substrings, through the trigram index.
        assert_eq!(found("PANDA"), vec![(1, 2, "code".to_string())]);
        assert_eq!(found("o outp"), vec![(1, 3, "output".to_string())]);
        assert_eq!(found("zerodivision"), vec![(1, 4, "error".to_string())]);
        assert!(found("NEAR(a b)").is_empty());
        // Deleting the rows takes them out of the index.
        conn.execute("DELETE FROM search_text WHERE sid = 1", [])
            .unwrap();
        assert!(found("pandas").is_empty());
        drop(conn);
        open(&cfg).unwrap();
    }

    /// A version-3 file (made before forks were kept in the list): its forks get their
    /// parent, execution count and checkpoint from their `session_created`; other
    /// sessions, and events that are not what a broker writes, get none.
    #[test]
    fn a_version_3_file_gets_its_forks_parents() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = RecordingConfig::new(dir.path().join("r.sqlite3"));
        {
            let conn = Connection::open(&cfg.path).unwrap();
            conn.execute_batch(&format!(
                "{SCHEMA} {} PRAGMA user_version = 3;",
                MIGRATIONS[1]
            ))
            .unwrap();
            conn.execute_batch(
                r#"INSERT INTO sessions (sid, id, user, kernel, created_at)
                     VALUES (1, 'p', 'alice', 'python3', 5), (2, 'f', 'alice', 'python3', 6),
                            (3, 'g', 'alice', 'python3', 7), (4, 'h', 'alice', 'python3', 8),
                            (5, 'i', 'alice', 'python3', 9);
                   INSERT INTO events (sid, seq, time, direction, kind, content) VALUES
                     (1, 1, 5, 'broker', 'session_created', '{"kernel": "python3"}'),
                     (1, 2, 6, 'broker', 'session_forked',
                      '{"sessions": ["f"], "execution_count": 2}'),
                     (2, 1, 6, 'broker', 'session_created',
                      '{"kernel": "python3", "forked_from": {"session": "p", "execution_count": 2,
                        "checkpoint": "c"}}'),
                     (3, 1, 7, 'broker', 'session_created',
                      '{"kernel": "python3", "forked_from": {"session": "p", "execution_count": 3}}'),
                     (4, 1, 8, 'broker', 'session_created', '{"forked_from": "p"}'),
                     (5, 1, 9, 'broker', 'session_created', 'not json');"#,
            )
            .unwrap();
        }
        let conn = open(&cfg).unwrap();
        let v: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        let row = |sid: i64| -> (Option<String>, Option<i64>, Option<String>) {
            conn.query_row(
                "SELECT forked_from, forked_at, forked_checkpoint FROM sessions WHERE sid = ?1",
                [sid],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap()
        };
        assert_eq!(row(1), (None, None, None));
        assert_eq!(row(2), (Some("p".into()), Some(2), Some("c".into())));
        assert_eq!(row(3), (Some("p".into()), Some(3), None));
        assert_eq!(row(4), (None, None, None));
        assert_eq!(row(5), (None, None, None));
        drop(conn);
        open(&cfg).unwrap();
    }
}
