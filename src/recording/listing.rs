//! The recordings list on the SQLite file: a user's sessions, filtered and searched in the
//! database (see [`super::search`] for what is searched and how the text is escaped).
//!
//! A search takes one of two ways, chosen by how common its text is. Text of three
//! characters or more is first looked up in the trigram index, reading at most
//! [`CANDIDATES`] matching rows: when that is all of them, the sessions are those rows'
//! (one more statement, over the caller's sessions) and the matches are among them. Text
//! found in more rows than that, or shorter than three characters, is looked for session
//! by session, newest first, in each session's own rows (`LIKE`), which stops as soon as
//! the page is full: common text is found in the first sessions looked at. Either way the
//! cost is bounded by the page, not by the number of sessions recorded.

use std::collections::HashMap;

use rusqlite::types::Value as Sql;
use rusqlite::{params, params_from_iter, Connection};
use uuid::Uuid;

use super::queries::RecordingInfo;
use super::schema::sqlite;
use super::search::{
    ended_by, filter_sql, forked_from_of, fts_phrase, like_pattern, metadata_of, snippet,
    trigram_ok, ListQuery, ListedRecording, MatchField, SearchMatch, SqlArg, MATCHES_PER_SESSION,
};
use super::{from_micros, RecordingError};

/// Matching rows read from the trigram index before the text counts as common.
pub(super) const CANDIDATES: usize = 10_000;

/// A row of `search_text` the trigram index matched: rowid, session row, seq.
type Candidate = (i64, i64, i64);

/// The rows that hold `q` (at most `cap`), or `None` when there are more or the trigram
/// index cannot answer it.
fn candidates(
    conn: &Connection,
    q: &str,
    cap: usize,
) -> Result<Option<Vec<Candidate>>, RecordingError> {
    if !trigram_ok(q) {
        return Ok(None);
    }
    let mut st = conn
        .prepare_cached(
            "SELECT t.rowid, t.sid, t.seq FROM search_fts f JOIN search_text t ON t.rowid = f.rowid
             WHERE search_fts MATCH ?1 LIMIT ?2",
        )
        .map_err(sqlite("search"))?;
    let rows = st
        .query_map(params![fts_phrase(q), cap as i64 + 1], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .map_err(sqlite("search"))?;
    let rows = rows
        .collect::<Result<Vec<Candidate>, _>>()
        .map_err(sqlite("search"))?;
    Ok((rows.len() <= cap).then_some(rows))
}

/// `q.user`'s recorded sessions that pass `q`'s filters and hold its search text, newest
/// first, with where they matched; text in more than `cap` rows counts as common.
pub(super) fn list(
    conn: &Connection,
    q: &ListQuery,
    cap: usize,
) -> Result<Vec<ListedRecording>, RecordingError> {
    let mut args: Vec<Sql> = Vec::new();
    let mut conditions = filter_sql(q, "user", |a| {
        args.push(match a {
            SqlArg::Int(i) => Sql::Integer(i),
            SqlArg::Text(t) => Sql::Text(t),
        });
        format!("?{}", args.len())
    });
    let found = match &q.q {
        None => None,
        Some(text) => Some((text, candidates(conn, text, cap)?)),
    };
    match &found {
        None => {}
        Some((_, Some(rows))) => {
            let mut sids: Vec<i64> = rows.iter().map(|c| c.1).collect();
            sids.sort_unstable();
            sids.dedup();
            args.push(Sql::Text(serde_json::to_string(&sids).unwrap_or_default()));
            conditions.push_str(&format!(
                " AND s.sid IN (SELECT value FROM json_each(?{}))",
                args.len()
            ));
        }
        Some((text, None)) => {
            args.push(Sql::Text(like_pattern(text)));
            conditions.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM search_text t2
                              WHERE t2.sid = s.sid AND t2.text LIKE ?{} ESCAPE '\\')",
                args.len()
            ));
        }
    }
    args.push(Sql::Integer(q.limit as i64));
    let sql = format!(
        "SELECT s.id, s.user, s.kernel, s.created_at, s.ended_at, s.end_reason, s.cells,
                s.events, s.last_event_at, s.front_door, s.metadata, s.errors, s.ended_by, s.sid,
                s.forked_from, s.forked_at, s.forked_checkpoint
         FROM sessions s WHERE {conditions}
         ORDER BY s.created_at DESC, s.sid DESC LIMIT ?{}",
        args.len()
    );
    let mut st = conn.prepare(&sql).map_err(sqlite("list sessions"))?;
    let rows = st
        .query_map(params_from_iter(args), listed_row)
        .map_err(sqlite("list sessions"))?;
    let mut rows = rows
        .collect::<Result<Vec<_>, _>>()
        .map_err(sqlite("list sessions"))?;
    match found {
        None => {}
        Some((text, Some(candidates))) => {
            matches_of_candidates(conn, text, &candidates, &mut rows)?
        }
        Some((text, None)) => matches_by_session(conn, text, &mut rows)?,
    }
    Ok(rows.into_iter().map(|(_, l)| l).collect())
}

fn listed_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(i64, ListedRecording)> {
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
        forked_from: forked_from_of(
            r.get::<_, Option<String>>(14)?.as_deref(),
            r.get(15)?,
            r.get::<_, Option<String>>(16)?.as_deref(),
        ),
        matches: Vec::new(),
    };
    Ok((r.get::<_, i64>(13)?, listed))
}

fn search_match(seq: i64, field: &str, text: &str, q: &str) -> Option<SearchMatch> {
    Some(SearchMatch {
        seq,
        field: MatchField::parse(field)?,
        snippet: snippet(text, q),
    })
}

/// The matches of the listed sessions, from the index's rows: the first
/// [`MATCHES_PER_SESSION`] of each session, in the order of its events.
fn matches_of_candidates(
    conn: &Connection,
    q: &str,
    candidates: &[Candidate],
    rows: &mut [(i64, ListedRecording)],
) -> Result<(), RecordingError> {
    let mut by_sid: HashMap<i64, Vec<(i64, i64)>> = HashMap::new();
    for &(rowid, sid, seq) in candidates {
        by_sid.entry(sid).or_default().push((seq, rowid));
    }
    let mut wanted = Vec::new();
    for (sid, _) in rows.iter() {
        if let Some(found) = by_sid.get_mut(sid) {
            found.sort_unstable();
            wanted.extend(
                found
                    .iter()
                    .take(MATCHES_PER_SESSION)
                    .map(|&(_, rowid)| rowid),
            );
        }
    }
    let mut st = conn
        .prepare_cached(
            "SELECT sid, seq, field, text FROM search_text
             WHERE rowid IN (SELECT value FROM json_each(?1)) ORDER BY sid, seq, rowid",
        )
        .map_err(sqlite("find matches"))?;
    let texts = st
        .query_map([serde_json::to_string(&wanted).unwrap_or_default()], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
            ))
        })
        .map_err(sqlite("find matches"))?;
    let mut found: HashMap<i64, Vec<SearchMatch>> = HashMap::new();
    for t in texts {
        let (sid, seq, field, text) = t.map_err(sqlite("find matches"))?;
        found
            .entry(sid)
            .or_default()
            .extend(search_match(seq, &field, &text, q));
    }
    for (sid, l) in rows.iter_mut() {
        l.matches = found.remove(sid).unwrap_or_default();
    }
    Ok(())
}

/// The matches of the listed sessions, looked for in each session's rows.
fn matches_by_session(
    conn: &Connection,
    q: &str,
    rows: &mut [(i64, ListedRecording)],
) -> Result<(), RecordingError> {
    let pattern = like_pattern(q);
    let mut st = conn
        .prepare_cached(&format!(
            "SELECT seq, field, text FROM search_text
             WHERE sid = ?1 AND text LIKE ?2 ESCAPE '\\' ORDER BY seq LIMIT {MATCHES_PER_SESSION}"
        ))
        .map_err(sqlite("find matches"))?;
    for (sid, l) in rows.iter_mut() {
        let found = st
            .query_map(params![*sid, pattern], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(sqlite("find matches"))?;
        for f in found {
            let (seq, field, text) = f.map_err(sqlite("find matches"))?;
            l.matches.extend(search_match(seq, &field, &text, q));
        }
    }
    Ok(())
}
