//! Finding recorded sessions: the filters and the search text of `GET /v1/recordings`, as
//! both databases take them (pure: no SQL runs here).
//!
//! What is searched is the `search_text` table the writer fills as it goes
//! (`writer::search`): per execution its code, what it printed and returned (capped, the
//! start and the end) and its error; per session its metadata values. A search is a
//! case-insensitive substring: SQLite finds it with FTS5's `trigram` tokenizer (three
//! characters or more) or a `LIKE` scan of the caller's sessions' rows (shorter),
//! PostgreSQL with `ILIKE` (over `pg_trgm`'s GIN index when the extension could be
//! created). The query is a user's text: it only ever reaches SQL as a bound parameter,
//! quoted as one FTS5 string ([`fts_phrase`]) or with the `LIKE` wildcards escaped
//! ([`like_pattern`]); it is never an operator.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use super::queries::RecordingInfo;
use super::stored::StoredForkedFrom;

/// The longest search text, in characters.
pub const MAX_QUERY_CHARS: usize = 200;
/// Matches returned per session.
pub const MATCHES_PER_SESSION: usize = 3;
/// A snippet is about this many characters around the match.
pub const SNIPPET_CHARS: usize = 160;

/// Which sessions by where their recording is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateFilter {
    /// The recording is open (`ended_at` unset): the session is live.
    Live,
    /// The recording ended, however.
    Ended,
    /// Ended other than by idle expiry (closed, the broker stopped, its node was lost).
    Closed,
    /// Ended by idle expiry.
    Expired,
}

/// What `GET /v1/recordings` asks for; always of one user.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub user: String,
    pub limit: usize,
    /// Search text (1..=[`MAX_QUERY_CHARS`] characters).
    pub q: Option<String>,
    pub state: Option<StateFilter>,
    pub front_door: Option<String>,
    pub has_errors: Option<bool>,
    /// `created_at >= since`.
    pub since: Option<DateTime<Utc>>,
    /// `created_at < until`.
    pub until: Option<DateTime<Utc>>,
}

impl ListQuery {
    /// The newest `limit` of `user`'s sessions, unfiltered.
    pub fn of(user: &str, limit: usize) -> Self {
        Self {
            user: user.to_string(),
            limit,
            ..Default::default()
        }
    }
}

/// Where a search matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchField {
    Code,
    Output,
    Error,
    Metadata,
}

impl MatchField {
    /// As stored in `search_text.field` and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            MatchField::Code => "code",
            MatchField::Output => "output",
            MatchField::Error => "error",
            MatchField::Metadata => "metadata",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "code" => MatchField::Code,
            "output" => MatchField::Output,
            "error" => MatchField::Error,
            "metadata" => MatchField::Metadata,
            _ => return None,
        })
    }
}

/// One place a search matched: the event that holds the text, and the text around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchMatch {
    pub seq: i64,
    pub field: MatchField,
    pub snippet: String,
}

/// One recorded session as `GET /v1/recordings` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct ListedRecording {
    pub info: RecordingInfo,
    /// `rest`, `jupyter`, `e2b`, `mcp`; none for a recording made before it was recorded.
    pub front_door: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// Executions that ended in an error, a timeout or with a dead kernel.
    pub errors: u64,
    /// Who or what ended it; none while it is open.
    pub ended_by: Option<String>,
    /// For a fork: the session it was made from, at which execution count, from which
    /// checkpoint if any; none for a session that is not a fork (or recorded before forks
    /// were).
    pub forked_from: Option<StoredForkedFrom>,
    /// With a search: up to [`MATCHES_PER_SESSION`] places it matched.
    pub matches: Vec<SearchMatch>,
}

/// A value bound to a statement of the list.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum SqlArg {
    Int(i64),
    Text(String),
}

/// The conditions on `sessions s` of a list, without the search: `arg` binds a value and
/// answers its placeholder (`?N`, `$N`). `user` is the user column's name as the database
/// spells it.
pub(super) fn filter_sql(
    q: &ListQuery,
    user: &str,
    mut arg: impl FnMut(SqlArg) -> String,
) -> String {
    let mut conditions = vec![format!("s.{user} = {}", arg(SqlArg::Text(q.user.clone())))];
    if let Some(state) = q.state {
        conditions.push(
            match state {
                StateFilter::Live => "s.ended_at IS NULL",
                StateFilter::Ended => "s.ended_at IS NOT NULL",
                StateFilter::Closed => {
                    "s.ended_at IS NOT NULL AND coalesce(s.end_reason, '') <> 'expired'"
                }
                StateFilter::Expired => "s.ended_at IS NOT NULL AND s.end_reason = 'expired'",
            }
            .to_string(),
        );
    }
    if let Some(door) = &q.front_door {
        conditions.push(format!(
            "s.front_door = {}",
            arg(SqlArg::Text(door.clone()))
        ));
    }
    match q.has_errors {
        Some(true) => conditions.push("s.errors > 0".into()),
        Some(false) => conditions.push("s.errors = 0".into()),
        None => {}
    }
    if let Some(t) = q.since {
        conditions.push(format!(
            "s.created_at >= {}",
            arg(SqlArg::Int(super::micros(t)))
        ));
    }
    if let Some(t) = q.until {
        conditions.push(format!(
            "s.created_at < {}",
            arg(SqlArg::Int(super::micros(t)))
        ));
    }
    conditions.join(" AND ")
}

/// `sessions.ended_by` as shown: who closed it (`session_closed`'s `by`), `idle_expiry`,
/// else its end reason (`broker_stopped`, `node_lost`, or `closed` for a recording from
/// before closes said who); none while open.
pub fn ended_by(ended: bool, stored: Option<String>, end_reason: Option<&str>) -> Option<String> {
    if !ended {
        return None;
    }
    stored.or_else(|| match end_reason {
        Some("expired") => Some("idle_expiry".to_string()),
        other => other.map(str::to_string),
    })
}

/// `sessions.forked_from`, `forked_at` and `forked_checkpoint` read back: a parent whose id
/// is not a UUID (written by no broker) is none, a checkpoint that is not one is left out.
pub fn forked_from_of(
    parent: Option<&str>,
    execution_count: Option<i64>,
    checkpoint: Option<&str>,
) -> Option<StoredForkedFrom> {
    Some(StoredForkedFrom {
        session: uuid::Uuid::parse_str(parent?).ok()?,
        execution_count: execution_count.unwrap_or(0).max(0) as u64,
        checkpoint: checkpoint.and_then(|c| uuid::Uuid::parse_str(c).ok()),
    })
}

/// `sessions.metadata` (a JSON object of strings) read back; anything else is empty.
pub fn metadata_of(stored: Option<&str>) -> BTreeMap<String, String> {
    stored
        .and_then(|s| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(s).ok())
        .map(|m| {
            m.into_iter()
                .filter_map(|(k, v)| match v {
                    serde_json::Value::String(s) => Some((k, s)),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Text as both databases store and compare it: NUL (which PostgreSQL cannot store and
/// SQLite's `LIKE` stops at) as U+FFFD.
pub fn without_nul(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains('\0') {
        std::borrow::Cow::Owned(s.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// The query as one FTS5 string: every character literal (a `"` doubled), so operators,
/// column filters, `NEAR(`, `*` and the like are searched for, never obeyed.
pub fn fts_phrase(q: &str) -> String {
    format!("\"{}\"", without_nul(q).replace('"', "\"\""))
}

/// Whether the trigram index can answer `q` (three characters or more).
pub fn trigram_ok(q: &str) -> bool {
    q.chars().count() >= 3
}

/// `%q%` for `LIKE ... ESCAPE '\'`, with `\`, `%` and `_` of the query escaped.
pub fn like_pattern(q: &str) -> String {
    let mut p = String::with_capacity(q.len() + 2);
    p.push('%');
    for c in without_nul(q).chars() {
        if matches!(c, '\\' | '%' | '_') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('%');
    p
}

/// Where `needle` first occurs in `text`, case-insensitively: the byte range in `text`.
pub fn find_ci(text: &str, needle: &str) -> Option<(usize, usize)> {
    let needle: String = needle.chars().flat_map(char::to_lowercase).collect();
    if needle.is_empty() {
        return None;
    }
    // The lowered text, and for each of its bytes the byte in `text` it came from.
    let mut lower = String::with_capacity(text.len());
    let mut from = Vec::with_capacity(text.len() + 1);
    for (i, c) in text.char_indices() {
        for l in c.to_lowercase() {
            let before = lower.len();
            lower.push(l);
            from.extend(std::iter::repeat_n(i, lower.len() - before));
        }
    }
    from.push(text.len());
    let at = lower.find(&needle)?;
    let start = from[at];
    let end_lower = at + needle.len();
    // The end is the start of the first original char not lowered into the match.
    let end = from[end_lower..]
        .iter()
        .copied()
        .find(|&b| b > from[end_lower - 1])
        .unwrap_or(text.len());
    Some((start, end))
}

/// About [`SNIPPET_CHARS`] characters of `text` around its first match of `q` (the start
/// of the text when it holds none: a match the database found that this comparison does
/// not, such as a case folding SQLite does differently).
pub fn snippet(text: &str, q: &str) -> String {
    let (start, end) = find_ci(text, q).unwrap_or((0, 0));
    let matched = text[start..end].chars().count();
    let before = SNIPPET_CHARS.saturating_sub(matched) / 3;
    let from = text[..start]
        .char_indices()
        .rev()
        .nth(before.saturating_sub(1))
        .map_or(0, |(i, _)| i);
    let from = if before == 0 { start } else { from };
    let body: String = text[from..].chars().take(SNIPPET_CHARS).collect();
    let more = from + body.len() < text.len();
    let mut out = String::with_capacity(body.len() + 6);
    if from > 0 {
        out.push('…');
    }
    out.push_str(&body);
    if more {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_queries_are_one_literal_phrase() {
        let cases = [
            ("abc", "\"abc\""),
            ("a\"b", "\"a\"\"b\""),
            ("NEAR(a b)", "\"NEAR(a b)\""),
            ("x*", "\"x*\""),
            ("code: x OR y", "\"code: x OR y\""),
            ("\"", "\"\"\"\""),
        ];
        for (q, want) in cases {
            assert_eq!(fts_phrase(q), want, "{q:?}");
        }
    }

    #[test]
    fn like_wildcards_are_escaped() {
        let cases = [
            ("ab", "%ab%"),
            ("%", "%\\%%"),
            ("_", "%\\_%"),
            ("a\\b", "%a\\\\b%"),
            ("'--", "%'--%"),
        ];
        for (q, want) in cases {
            assert_eq!(like_pattern(q), want, "{q:?}");
        }
    }

    #[test]
    fn matches_are_found_whatever_the_case() {
        let cases = [
            ("Hello World", "world", Some((6, 11))),
            ("Hello World", "WORLD", Some((6, 11))),
            ("ÉCOLE école", "école", Some((0, 6))),
            ("straße", "SSE", None),
            ("abc", "", None),
            ("abc", "abcd", None),
            ("x İy", "y", Some((4, 5))),
        ];
        for (text, q, want) in cases {
            assert_eq!(find_ci(text, q), want, "{text:?} {q:?}");
        }
    }

    #[test]
    fn snippets_are_bounded_and_hold_the_match() {
        let long = format!("{}NEEDLE{}", "a".repeat(1000), "b".repeat(1000));
        let s = snippet(&long, "needle");
        assert!(s.contains("NEEDLE"), "{s}");
        assert!(s.starts_with('…') && s.ends_with('…'), "{s}");
        assert!(
            s.chars().count() <= SNIPPET_CHARS + 2,
            "{}",
            s.chars().count()
        );
        assert_eq!(snippet("short text", "text"), "short text");
        assert_eq!(
            snippet("NEEDLE at the start", "needle"),
            "NEEDLE at the start"
        );
        // Multi-byte characters are never cut.
        let wide = "é".repeat(500) + "x" + &"é".repeat(500);
        assert!(snippet(&wide, "x").contains('x'));
        // No match: the start of the text.
        assert!(snippet(&"z".repeat(400), "q").starts_with("zzz"));
    }

    #[test]
    fn filters_bind_every_value() {
        let q = ListQuery {
            user: "alice' OR 1=1 --".into(),
            limit: 5,
            q: None,
            state: Some(StateFilter::Closed),
            front_door: Some("e2b".into()),
            has_errors: Some(true),
            since: DateTime::from_timestamp(10, 0),
            until: DateTime::from_timestamp(20, 0),
        };
        let mut args = Vec::new();
        let sql = filter_sql(&q, "user", |a| {
            args.push(a);
            format!("?{}", args.len())
        });
        assert_eq!(
            sql,
            "s.user = ?1 AND s.ended_at IS NOT NULL AND coalesce(s.end_reason, '') <> 'expired' \
             AND s.front_door = ?2 AND s.errors > 0 AND s.created_at >= ?3 AND s.created_at < ?4"
        );
        assert_eq!(
            args,
            vec![
                SqlArg::Text("alice' OR 1=1 --".into()),
                SqlArg::Text("e2b".into()),
                SqlArg::Int(10_000_000),
                SqlArg::Int(20_000_000),
            ]
        );
        let plain = filter_sql(&ListQuery::of("bob", 1), "\"user\"", |_| "$1".into());
        assert_eq!(plain, "s.\"user\" = $1");
    }

    #[test]
    fn ended_by_names_who_or_what() {
        let cases = [
            (false, None, None, None),
            (true, Some("rest"), Some("closed"), Some("rest")),
            (true, None, Some("expired"), Some("idle_expiry")),
            (true, None, Some("broker_stopped"), Some("broker_stopped")),
            (true, None, Some("closed"), Some("closed")),
        ];
        for (ended, stored, reason, want) in cases {
            assert_eq!(
                ended_by(ended, stored.map(str::to_string), reason).as_deref(),
                want
            );
        }
    }

    #[test]
    fn metadata_keeps_string_values_only() {
        let m = metadata_of(Some(r#"{"a": "1", "b": 2, "c": "x"}"#));
        assert_eq!(m.len(), 2);
        assert!(metadata_of(Some("not json")).is_empty());
        assert!(metadata_of(None).is_empty());
    }
}
