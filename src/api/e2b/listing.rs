//! E2B's sandbox listing (`GET /sandboxes`, `/v2/sandboxes`, what `Sandbox.list` calls) as a
//! pure step: the query read and checked at the edge ([`ListQuery::parse`]), then the
//! caller's sandboxes filtered, ordered and cut into a page ([`ListQuery::page`]) with E2B's
//! cursor, so the handler only gathers the caller's sandboxes and renders the page.
//!
//! As E2B's API (its `sandboxes_list.go` and `pagination.go`, and the OpenAPI spec's
//! `paginationLimit`): `limit` 1..=100 (default 100); newest first unless `order=asc`,
//! ties by id; `nextToken` is URL-safe base64 of `<RFC 3339 start>__<id>` (`__asc` appended
//! for ascending order) naming the last sandbox of the previous page, and is sent back in the
//! `x-next-token` header only when more follow; `metadata` is `k=v&...` (URL-encoded, every
//! pair must match); `state` `running` and/or `paused` (comma-separated or repeated);
//! `startedAfter` keeps sandboxes started at or after it; `template` a template id. A token
//! is only a position: it selects among the caller's own sandboxes, so a forged or another
//! user's token shows nothing of anyone else's.

use base64::Engine;
use chrono::{DateTime, SecondsFormat, Utc};

/// URL-safe base64, written padded as E2B's tokens are, read with or without padding.
const B64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);
/// E2B's `paginationLimit`: default and maximum.
pub const MAX_LIMIT: usize = 100;
/// Longest `nextToken` read: a timestamp, an id and a suffix are far below it.
const MAX_TOKEN: usize = 512;

/// Why a listing query is refused (E2B answers each with a 400).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ListQueryError {
    #[error("limit must be a whole number from 1 to {MAX_LIMIT}; got {0:?}")]
    Limit(String),
    #[error("Invalid next token")]
    NextToken,
    #[error("order must be asc or desc; got {0:?}")]
    Order(String),
    #[error("startedAfter must be an RFC 3339 date-time; got {0:?}")]
    StartedAfter(String),
    #[error("state must be running or paused; got {0:?}")]
    State(String),
    #[error("Error parsing metadata: each filter must be key=value (URL-encoded); got {0:?}")]
    Metadata(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Order {
    #[default]
    Desc,
    Asc,
}

/// A listing query, read and checked.
#[derive(Debug, PartialEq)]
pub struct ListQuery {
    pub metadata: Vec<(String, String)>,
    /// Whether running sandboxes are asked for, and paused ones.
    pub running: bool,
    pub paused: bool,
    pub limit: usize,
    pub order: Order,
    /// The last sandbox of the previous page: its start and id.
    pub after: Option<(DateTime<Utc>, String)>,
    pub started_after: Option<DateTime<Utc>>,
    pub template: Option<String>,
}

/// One of the caller's sandboxes as the listing sees it.
pub struct Listed<T> {
    pub started_at: DateTime<Utc>,
    pub id: String,
    pub template: String,
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Paused (else running).
    pub paused: bool,
    pub item: T,
}

/// A page: its sandboxes and, when more follow, the token of the next.
pub struct Page<T> {
    pub items: Vec<T>,
    pub next_token: Option<String>,
}

/// A start time as the listing orders, shows and names it: microseconds, as E2B keeps them
/// (a nanosecond in a token would sort before the sandbox that minted it).
pub fn listed_time(t: DateTime<Utc>) -> DateTime<Utc> {
    let micros = t.timestamp_micros();
    DateTime::from_timestamp_micros(micros).unwrap_or(t)
}

fn token(at: DateTime<Utc>, id: &str, order: Order) -> String {
    let mut text = format!(
        "{}__{id}",
        listed_time(at).to_rfc3339_opts(SecondsFormat::AutoSi, true)
    );
    if order == Order::Asc {
        text.push_str("__asc");
    }
    B64.encode(text)
}

fn read_token(given: &str, order: Order) -> Result<(DateTime<Utc>, String), ListQueryError> {
    if given.len() > MAX_TOKEN {
        return Err(ListQueryError::NextToken);
    }
    let bytes = B64.decode(given).map_err(|_| ListQueryError::NextToken)?;
    let text = String::from_utf8(bytes).map_err(|_| ListQueryError::NextToken)?;
    let parts: Vec<&str> = text.split("__").collect();
    let (at, id, token_order) = match parts.as_slice() {
        [at, id] => (*at, *id, Order::Desc),
        [at, id, "asc"] => (*at, *id, Order::Asc),
        _ => return Err(ListQueryError::NextToken),
    };
    // A token replayed under the other order would serve again what was seen.
    if token_order != order {
        return Err(ListQueryError::NextToken);
    }
    let at = DateTime::parse_from_rfc3339(at)
        .map_err(|_| ListQueryError::NextToken)?
        .with_timezone(&Utc);
    Ok((listed_time(at), id.to_string()))
}

/// `key=value` pairs of a query string, decoded (repeated keys kept in order).
pub(super) fn pairs(raw: &str) -> impl Iterator<Item = (&str, String)> {
    raw.split('&').filter(|p| !p.is_empty()).map(|pair| {
        let key = pair.split_once('=').map_or(pair, |(k, _)| k);
        let value = crate::api::auth::url_query(pair, key).unwrap_or_default();
        (key, value)
    })
}

impl ListQuery {
    /// Reads the query string of a listing request.
    pub fn parse(raw: Option<&str>) -> Result<Self, ListQueryError> {
        let mut q = ListQuery {
            metadata: Vec::new(),
            running: true,
            paused: true,
            limit: MAX_LIMIT,
            order: Order::Desc,
            after: None,
            started_after: None,
            template: None,
        };
        let mut states: Option<Vec<String>> = None;
        let mut token = None;
        for (key, value) in pairs(raw.unwrap_or("")) {
            match key {
                "limit" => {
                    q.limit = value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_LIMIT).contains(n))
                        .ok_or(ListQueryError::Limit(value))?;
                }
                "nextToken" if !value.is_empty() => token = Some(value),
                "order" => {
                    q.order = match value.as_str() {
                        "asc" => Order::Asc,
                        "desc" => Order::Desc,
                        _ => return Err(ListQueryError::Order(value)),
                    }
                }
                "startedAfter" => {
                    // A `+` of an offset sent unencoded arrives as a space.
                    let text = value.replace(' ', "+");
                    let at = DateTime::parse_from_rfc3339(&text)
                        .map_err(|_| ListQueryError::StartedAfter(value))?;
                    q.started_after = Some(listed_time(at.with_timezone(&Utc)));
                }
                "template" if !value.is_empty() => q.template = Some(value),
                "state" => {
                    for s in value.split(',') {
                        if !matches!(s, "running" | "paused") {
                            return Err(ListQueryError::State(s.to_string()));
                        }
                        states.get_or_insert_with(Vec::new).push(s.to_string());
                    }
                }
                "metadata" if !value.is_empty() => {
                    for filter in value.split('&') {
                        let mut parts = filter.split('=');
                        let (Some(k), Some(v), None) = (parts.next(), parts.next(), parts.next())
                        else {
                            return Err(ListQueryError::Metadata(filter.to_string()));
                        };
                        let k = crate::api::auth::url_query(&format!("k={k}"), "k");
                        let v = crate::api::auth::url_query(&format!("v={v}"), "v");
                        q.metadata
                            .push((k.unwrap_or_default(), v.unwrap_or_default()));
                    }
                }
                _ => {}
            }
        }
        if let Some(states) = states {
            q.running = states.iter().any(|s| s == "running");
            q.paused = states.iter().any(|s| s == "paused");
        }
        if let Some(t) = token {
            q.after = Some(read_token(&t, q.order)?);
        }
        Ok(q)
    }

    /// The page of `sandboxes` (the caller's) this query asks for.
    pub fn page<T>(&self, sandboxes: Vec<Listed<T>>) -> Page<T> {
        let mut kept: Vec<Listed<T>> = sandboxes
            .into_iter()
            .map(|mut s| {
                s.started_at = listed_time(s.started_at);
                s
            })
            .filter(|s| {
                (if s.paused { self.paused } else { self.running })
                    && self.metadata.iter().all(|(k, v)| {
                        s.metadata.get(k).and_then(serde_json::Value::as_str) == Some(v.as_str())
                    })
                    && self.started_after.is_none_or(|t| s.started_at >= t)
                    && self.template.as_ref().is_none_or(|t| &s.template == t)
                    && self.after.as_ref().is_none_or(|(at, id)| match self.order {
                        Order::Desc => s.started_at < *at || (s.started_at == *at && s.id > *id),
                        Order::Asc => s.started_at > *at || (s.started_at == *at && s.id > *id),
                    })
            })
            .collect();
        kept.sort_by(|a, b| {
            let by_time = match self.order {
                Order::Desc => b.started_at.cmp(&a.started_at),
                Order::Asc => a.started_at.cmp(&b.started_at),
            };
            by_time.then_with(|| a.id.cmp(&b.id))
        });
        let next_token = (kept.len() > self.limit).then(|| {
            let last = &kept[self.limit - 1];
            token(last.started_at, &last.id, self.order)
        });
        kept.truncate(self.limit);
        Page {
            items: kept.into_iter().map(|s| s.item).collect(),
            next_token,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 123_456_789).unwrap()
    }

    fn sandboxes() -> Vec<Listed<&'static str>> {
        [
            ("a", 1, "t1", "x"),
            ("b", 2, "t1", "x"),
            ("c", 3, "t2", "y"),
            ("d", 3, "t1", "x"),
        ]
        .into_iter()
        .map(|(id, s, template, m)| Listed {
            started_at: at(s),
            id: id.to_string(),
            template: template.to_string(),
            metadata: serde_json::json!({"m": m}).as_object().unwrap().clone(),
            paused: id == "b",
            item: id,
        })
        .collect()
    }

    fn pages(query: &str) -> Vec<Vec<&'static str>> {
        let mut out = Vec::new();
        let mut q = query.to_string();
        loop {
            let page = ListQuery::parse(Some(&q)).unwrap().page(sandboxes());
            out.push(page.items);
            match page.next_token {
                Some(t) => q = format!("{query}&nextToken={t}"),
                None => return out,
            }
        }
    }

    #[test]
    fn pages_follow_the_order_and_the_token() {
        assert_eq!(pages("limit=2"), vec![vec!["c", "d"], vec!["b", "a"]]);
        assert_eq!(
            pages("limit=3&order=asc"),
            vec![vec!["a", "b", "c"], vec!["d"]]
        );
        assert_eq!(pages(""), vec![vec!["c", "d", "b", "a"]]);
        assert_eq!(pages("limit=4"), vec![vec!["c", "d", "b", "a"]]);
        assert_eq!(
            pages("limit=1&metadata=m%3Dx"),
            vec![vec!["d"], vec!["b"], vec!["a"]]
        );
    }

    #[test]
    fn filters_select() {
        let one = |q: &str| ListQuery::parse(Some(q)).unwrap().page(sandboxes()).items;
        assert_eq!(one("template=t2"), vec!["c"]);
        assert_eq!(one("state=paused"), vec!["b"]);
        assert_eq!(one("state=running"), vec!["c", "d", "a"]);
        assert_eq!(one("state=paused&state=running&limit=1"), vec!["c"]);
        assert_eq!(one("state=running,paused&limit=1"), vec!["c"]);
        let after = at(2).to_rfc3339().replace('+', "%2B");
        assert_eq!(one(&format!("startedAfter={after}")), vec!["c", "d", "b"]);
        assert_eq!(one("metadata=m%3Dy"), vec!["c"]);
        assert_eq!(one("metadata=m%3Dz"), Vec::<&str>::new());
    }

    #[test]
    fn hostile_queries_are_refused() {
        let err = |q: &str| ListQuery::parse(Some(q)).unwrap_err();
        for bad in [
            "limit=0",
            "limit=-1",
            "limit=1000000000",
            "limit=101",
            "limit=x",
            "limit=",
        ] {
            assert!(matches!(err(bad), ListQueryError::Limit(_)), "{bad}");
        }
        let desc = token(at(1), "a", Order::Desc);
        for bad in [
            "nextToken=%%%".to_string(),
            format!("nextToken={}", B64.encode("no-separator")),
            format!("nextToken={}", B64.encode("yesterday__a")),
            format!(
                "nextToken={}",
                B64.encode("2020-01-01T00:00:00Z__a__sideways")
            ),
            format!("nextToken={desc}&order=asc"),
            format!("nextToken={}", "A".repeat(4096)),
        ] {
            assert_eq!(err(&bad), ListQueryError::NextToken, "{bad}");
        }
        assert!(matches!(err("order=up"), ListQueryError::Order(_)));
        assert!(matches!(
            err("startedAfter=soon"),
            ListQueryError::StartedAfter(_)
        ));
        assert!(matches!(err("state=sleeping"), ListQueryError::State(_)));
        assert!(matches!(
            err("metadata=novalue"),
            ListQueryError::Metadata(_)
        ));
        assert!(matches!(
            err("metadata=a%3Db%3Dc"),
            ListQueryError::Metadata(_)
        ));
        // A token from anywhere is a position among the caller's own sandboxes only.
        let far = B64.encode("2999-01-01T00:00:00Z__zzz");
        let q = ListQuery::parse(Some(&format!("nextToken={far}"))).unwrap();
        assert_eq!(q.page(sandboxes()).items, vec!["c", "d", "b", "a"]);
    }
}
