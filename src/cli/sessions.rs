//! `kernel-broker sessions` (the caller's live sessions), `kernel-broker fork SESSION` and
//! `kernel-broker kill SESSION`.

use serde_json::Value;

use super::{resolve_session, CliError, Client, ClientArgs};

/// Prints the caller's live sessions, a line each (or the API's JSON with `json`).
pub async fn sessions(args: &ClientArgs, json: bool) -> Result<(), CliError> {
    let client = Client::new(args)?;
    let list = client
        .json(reqwest::Method::GET, "/v1/sessions", None)
        .await?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&list).unwrap_or_default()
        );
        return Ok(());
    }
    let rows = list.as_array().cloned().unwrap_or_default();
    if rows.is_empty() {
        println!("no live sessions");
        return Ok(());
    }
    println!(
        "{:<36}  {:<8}  {:<7}  {:<8}  {:>5}  {:>9}  {:<20}  LAST ACTIVITY",
        "ID", "STATE", "MADE BY", "KERNEL", "CELLS", "MEMORY", "CREATED"
    );
    for s in &rows {
        println!("{}", row(s));
    }
    Ok(())
}

fn row(s: &Value) -> String {
    let text = |k: &str| s[k].as_str().unwrap_or("-").to_string();
    let time = |k: &str| {
        s[k].as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
            .unwrap_or_else(|| "-".into())
    };
    let memory = s["memory_used_bytes"]
        .as_u64()
        .map(|b| format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64))
        .unwrap_or_else(|| "-".into());
    format!(
        "{:<36}  {:<8}  {:<7}  {:<8}  {:>5}  {:>9}  {:<20}  {}",
        text("id"),
        text("state"),
        text("front_door"),
        text("kernel"),
        s["execution_count"].as_u64().unwrap_or(0),
        memory,
        time("created_at"),
        time("last_activity"),
    )
}

/// Forks a session of the caller's into `count` new ones and prints their ids, one a line
/// (stdout, for scripts); what the broker refuses (a busy kernel, a quota) is its error.
pub async fn fork(args: &ClientArgs, session: &str, count: u32) -> Result<(), CliError> {
    let client = Client::new(args)?;
    let id = resolve_session(&client, session).await?;
    let made = client
        .json(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/fork"),
            Some(serde_json::json!({ "count": count })),
        )
        .await?;
    let ids = forked_ids(&made);
    for new in &ids {
        println!("{new}");
    }
    eprintln!("session {id} forked into {}", ids.len());
    Ok(())
}

/// The new sessions' ids in the fork's answer (`{"sessions": [{"id": ...}, ...]}`).
fn forked_ids(made: &Value) -> Vec<String> {
    made["sessions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Ends a session of the caller's (its kernel and everything in it).
pub async fn kill(args: &ClientArgs, session: &str) -> Result<(), CliError> {
    let client = Client::new(args)?;
    let id = resolve_session(&client, session).await?;
    client
        .json(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await?;
    eprintln!("session {id} ended");
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_row_shows_what_the_api_said_and_dashes_for_what_it_did_not() {
        let line = super::row(&json!({
            "id": "6a1f7f0e-4f0a-4b44-9c57-8f7f5b7b1d2e", "state": "idle", "kernel": "python3",
            "front_door": "e2b",
            "execution_count": 3, "memory_used_bytes": 99614720,
            "created_at": "2026-11-22T00:53:19.123456Z", "last_activity": null
        }));
        assert!(
            line.starts_with("6a1f7f0e-4f0a-4b44-9c57-8f7f5b7b1d2e  idle      e2b      python3"),
            "{line}"
        );
        assert!(line.contains(" 95 MiB  2026-11-22 00:53:19   -"), "{line}");
    }
}
