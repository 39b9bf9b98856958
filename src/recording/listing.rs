//! The recordings list on the SQLite file: a user's sessions, filtered and searched in the
//! database (see [`super::search`] for what is searched and how the text is escaped). Two
//! statements: the page of sessions, then for the page's sessions up to
//! [`MATCHES_PER_SESSION`] matching rows each, whose snippets are cut here.

use std::collections::HashMap;

use rusqlite::types::Value as Sql;
use rusqlite::{params_from_iter, Connection};
use uuid::Uuid;

use super::queries::RecordingInfo;
use super::schema::sqlite;
use super::search::{
    ended_by, filter_sql, fts_phrase, like_pattern, metadata_of, snippet, trigram_ok, ListQuery,
    ListedRecording, MatchField, SearchMatch, SqlArg, MATCHES_PER_SESSION,
};
use super::{from_micros, RecordingError};

/// Search rows that hold `q`, as a subquery of `search_text t2` (with `?{n}` its pattern):
/// the trigram index for three characters or more, else a `LIKE` over the rows it is
/// joined to.
fn matching_rows(q: &str, n: usize) -> (String, Sql) {
    if trigram_ok(q) {
        (
            format!(
                "search_fts f JOIN search_text t2 ON t2.rowid = f.rowid WHERE search_fts MATCH ?{n}"
            ),
            Sql::Text(fts_phrase(q)),
        )
    } else {
        (
            format!("search_text t2 WHERE t2.text LIKE ?{n} ESCAPE '\\'"),
            Sql::Text(like_pattern(q)),
        )
    }
}

/// `q.user`'s recorded sessions that pass `q`'s filters and hold its search text, newest
/// first, with where they matched.
pub(super) fn list(
    conn: &Connection,
    q: &ListQuery,
) -> Result<Vec<ListedRecording>, RecordingError> {
    let mut args: Vec<Sql> = Vec::new();
    let mut conditions = filter_sql(q, "user", |a| {
        args.push(match a {
            SqlArg::Int(i) => Sql::Integer(i),
            SqlArg::Text(t) => Sql::Text(t),
        });
        format!("?{}", args.len())
    });
    if let Some(text) = &q.q {
        let (rows, pattern) = matching_rows(text, args.len() + 1);
        args.push(pattern);
        conditions.push_str(&format!(" AND s.sid IN (SELECT t2.sid FROM {rows})"));
    }
    args.push(Sql::Integer(q.limit as i64));
    let sql = format!(
        "SELECT s.id, s.user, s.kernel, s.created_at, s.ended_at, s.end_reason, s.cells,
                s.events, s.last_event_at, s.front_door, s.metadata, s.errors, s.ended_by, s.sid
         FROM sessions s WHERE {conditions}
         ORDER BY s.created_at DESC, s.sid DESC LIMIT ?{}",
        args.len()
    );
    let mut st = conn.prepare(&sql).map_err(sqlite("list sessions"))?;
    let rows = st
        .query_map(params_from_iter(args), |r| {
            let id: String = r.get(0)?;
            let ended_at = r.get::<_, Option<i64>>(4)?;
            let end_reason: Option<String> = r.get(5)?;
            let metadata: Option<String> = r.get(10)?;
            let listed = ListedRecording {
                ended_by: ended_by(ended_at.is_some(), r.get(12)?, end_reason.as_deref()),
                info: RecordingInfo {
                    id: Uuid::parse_str(&id).unwrap_or_default(),
                    user: r.get(1)?,
                    kernel: r.get(2)?,
                    created_at: from_micros(r.get(3)?),
                    ended_at: ended_at.map(from_micros),
                    end_reason,
                    cells: r.get::<_, i64>(6)?.max(0) as u64,
                    events: r.get::<_, i64>(7)?.max(0) as u64,
                    last_event_at: r.get::<_, Option<i64>>(8)?.map(from_micros),
                },
                front_door: r.get(9)?,
                metadata: metadata_of(metadata.as_deref()),
                errors: r.get::<_, i64>(11)?.max(0) as u64,
                matches: Vec::new(),
            };
            Ok((r.get::<_, i64>(13)?, listed))
        })
        .map_err(sqlite("list sessions"))?;
    let rows = rows
        .collect::<Result<Vec<_>, _>>()
        .map_err(sqlite("list sessions"))?;
    match &q.q {
        Some(text) if !rows.is_empty() => with_matches(conn, text, rows),
        _ => Ok(rows.into_iter().map(|(_, l)| l).collect()),
    }
}

/// The sessions of `rows` (session row, listed) with up to [`MATCHES_PER_SESSION`] places
/// each where `q` matched, in the order of their events.
fn with_matches(
    conn: &Connection,
    q: &str,
    rows: Vec<(i64, ListedRecording)>,
) -> Result<Vec<ListedRecording>, RecordingError> {
    let sids: Vec<i64> = rows.iter().map(|(sid, _)| *sid).collect();
    let sids = serde_json::to_string(&sids).unwrap_or_else(|_| "[]".into());
    let (matching, pattern) = matching_rows(q, 1);
    let sql = format!(
        "SELECT t.sid, t.seq, t.field, t.text FROM search_text t WHERE t.rowid IN (
             SELECT r FROM (
                 SELECT t2.rowid AS r,
                        row_number() OVER (PARTITION BY t2.sid ORDER BY t2.seq, t2.rowid) AS n
                 FROM {matching} AND t2.sid IN (SELECT value FROM json_each(?2))
             ) WHERE n <= {MATCHES_PER_SESSION})
         ORDER BY t.sid, t.seq, t.rowid"
    );
    let mut st = conn.prepare(&sql).map_err(sqlite("find matches"))?;
    let found = st
        .query_map(rusqlite::params![pattern, sids], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
            ))
        })
        .map_err(sqlite("find matches"))?;
    let mut by_sid: HashMap<i64, Vec<SearchMatch>> = HashMap::new();
    for row in found {
        let (sid, seq, field, text) = row.map_err(sqlite("find matches"))?;
        let Some(field) = MatchField::parse(&field) else {
            continue;
        };
        by_sid.entry(sid).or_default().push(SearchMatch {
            seq,
            field,
            snippet: snippet(&text, q),
        });
    }
    Ok(rows
        .into_iter()
        .map(|(sid, mut l)| {
            l.matches = by_sid.remove(&sid).unwrap_or_default();
            l
        })
        .collect())
}
