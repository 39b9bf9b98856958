//! The recordings list on PostgreSQL: what [`crate::recording::listing`] does on the SQLite
//! file, the same two ways, with `ILIKE` over `search_text` (through `pg_trgm`'s GIN index
//! when there is one, see [`super::schema::trigram_index`]).

use std::collections::HashMap;

use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::queries::Pool;
use crate::recording::db::DbError;
use crate::recording::queries::RecordingInfo;
use crate::recording::search::{
    ended_by, filter_sql, forked_from_of, like_pattern, metadata_of, snippet, ListQuery,
    ListedRecording, MatchField, SearchMatch, SqlArg, MATCHES_PER_SESSION,
};
use crate::recording::{from_micros, RecordingError};

fn db_err(context: &'static str) -> impl Fn(tokio_postgres::Error) -> RecordingError {
    move |source| RecordingError::Db {
        context,
        source: DbError::Postgres(source),
    }
}

/// A value bound to a statement.
type Param = Box<dyn ToSql + Sync + Send>;

fn refs(params: &[Param]) -> Vec<&(dyn ToSql + Sync)> {
    params
        .iter()
        .map(|p| p.as_ref() as &(dyn ToSql + Sync))
        .collect()
}

impl Pool {
    /// `q.user`'s recorded sessions that pass `q`'s filters and hold its search text,
    /// newest first, with where they matched; text in more than `cap` rows counts as common.
    pub async fn list_filtered(
        &self,
        q: &ListQuery,
        cap: usize,
    ) -> Result<Vec<ListedRecording>, RecordingError> {
        let mut params: Vec<Param> = Vec::new();
        let mut conditions = filter_sql(q, "\"user\"", |a| {
            params.push(match a {
                SqlArg::Int(i) => Box::new(i),
                SqlArg::Text(t) => Box::new(t.replace('\0', "\u{fffd}")),
            });
            format!("${}", params.len())
        });
        let c = self.client().await?;
        // The walk: a lateral probe of each session, newest first, which the page's limit
        // stops (an EXISTS let the planner scan every session's rows at once).
        let mut lateral = String::new();
        if let Some(text) = &q.q {
            // As on SQLite (see `crate::recording::listing`): the sessions of the matching
            // rows when they are few, else a walk through the caller's sessions, newest
            // first, looking in each one's rows. Where a session's own rows are meant (the
            // walk, the page's matches), `text || ''` keeps the planner from the trigram
            // index, which for common text would read every matching row of every session.
            let pattern = like_pattern(text);
            let rows = c
                .query(
                    "SELECT sid FROM search_text WHERE text ILIKE $1 LIMIT $2",
                    &[&pattern, &(cap as i64 + 1)],
                )
                .await
                .map_err(db_err("search"))?;
            if rows.len() <= cap {
                let mut sids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
                sids.sort_unstable();
                sids.dedup();
                params.push(Box::new(sids));
                conditions.push_str(&format!(" AND s.sid = ANY(${})", params.len()));
            } else {
                params.push(Box::new(pattern));
                lateral = format!(
                    " CROSS JOIN LATERAL (SELECT 1 FROM search_text t2
                        WHERE t2.sid = s.sid AND (t2.text || '') ILIKE ${} LIMIT 1) hit",
                    params.len()
                );
            }
        }
        params.push(Box::new(q.limit as i64));
        let sql = format!(
            r#"SELECT s.id, s."user", s.kernel, s.created_at, s.ended_at, s.end_reason, s.cells,
                      s.events, s.last_event_at, s.front_door, s.metadata, s.errors, s.ended_by,
                      s.sid, s.forked_from, s.forked_at, s.forked_checkpoint
               FROM sessions s{lateral} WHERE {conditions}
               ORDER BY s.created_at DESC, s.sid DESC LIMIT ${}"#,
            params.len()
        );
        let rows = c
            .query(&sql, &refs(&params))
            .await
            .map_err(db_err("list sessions"))?;
        let rows: Vec<(i64, ListedRecording)> = rows
            .iter()
            .map(|r| {
                let ended_at = r.get::<_, Option<i64>>(4);
                let end_reason: Option<String> = r.get(5);
                let listed = ListedRecording {
                    ended_by: ended_by(ended_at.is_some(), r.get(12), end_reason.as_deref()),
                    info: RecordingInfo {
                        id: Uuid::parse_str(r.get(0)).unwrap_or_default(),
                        user: r.get(1),
                        kernel: r.get(2),
                        created_at: from_micros(r.get(3)),
                        ended_at: ended_at.map(from_micros),
                        end_reason,
                        cells: r.get::<_, i64>(6).max(0) as u64,
                        events: r.get::<_, i64>(7).max(0) as u64,
                        last_event_at: r.get::<_, Option<i64>>(8).map(from_micros),
                    },
                    front_door: r.get(9),
                    metadata: metadata_of(r.get(10)),
                    errors: r.get::<_, i64>(11).max(0) as u64,
                    forked_from: forked_from_of(r.get(14), r.get(15), r.get(16)),
                    matches: Vec::new(),
                };
                (r.get::<_, i64>(13), listed)
            })
            .collect();
        let Some(text) = q.q.as_deref().filter(|_| !rows.is_empty()) else {
            return Ok(rows.into_iter().map(|(_, l)| l).collect());
        };
        let sids: Vec<i64> = rows.iter().map(|(sid, _)| *sid).collect();
        let found = c
            .query(
                &format!(
                    "SELECT p.sid, m.seq, m.field, m.text FROM unnest($2::BIGINT[]) AS p(sid)
                     CROSS JOIN LATERAL (
                         SELECT t.seq, t.field, t.text FROM search_text t
                         WHERE t.sid = p.sid AND (t.text || '') ILIKE $1
                         ORDER BY t.seq LIMIT {MATCHES_PER_SESSION}
                     ) m ORDER BY p.sid, m.seq"
                ),
                &[&like_pattern(text), &sids],
            )
            .await
            .map_err(db_err("find matches"))?;
        let mut by_sid: HashMap<i64, Vec<SearchMatch>> = HashMap::new();
        for r in &found {
            let Some(field) = MatchField::parse(r.get(2)) else {
                continue;
            };
            by_sid.entry(r.get(0)).or_default().push(SearchMatch {
                seq: r.get(1),
                field,
                snippet: snippet(r.get(3), text),
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
}
