//! `GET /v1/recordings` filtered and searched, against a real broker and real kernels, on
//! SQLite and on PostgreSQL: every parameter, combinations, hostile search text, bad values
//! (400 naming the parameter), another user's sessions never found.

use crate::common;

use common::spawned::SpawnedBroker;
use common::*;
use serde_json::Value;

/// `s` percent-encoded for a query string.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn listed(api: &Api, query: &str) -> Vec<Value> {
    let (status, v) = api.get(&format!("/v1/recordings?{query}")).await;
    assert_eq!(status, 200, "{query}: {v}");
    v.as_array().unwrap().clone()
}

async fn ids(api: &Api, query: &str) -> Vec<String> {
    listed(api, query)
        .await
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect()
}

async fn the_list_is_searched_and_filtered(broker: &SpawnedBroker) {
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    let start = chrono::Utc::now();
    let a = alice.create().await;
    let x = alice
        .execute(&a, "print('Needle in the HAYSTACK, 100%_done')\n6 * 7")
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    let b = alice.create().await;
    let x = alice
        .execute(&b, "raise ZeroDivisionError('zebra crossing')")
        .await;
    assert_eq!(x["status"], "error", "{x}");
    let (status, _) = alice.delete(&format!("/v1/sessions/{b}")).await;
    assert_eq!(status, 204);
    let c = bob.create().await;
    let x = bob.execute(&c, "print('Needle in the HAYSTACK')").await;
    assert_eq!(x["status"], "ok", "{x}");

    // Unfiltered: the new fields, no matches.
    let all = listed(&alice, "").await;
    let ids_of = |v: &[Value]| -> Vec<String> {
        v.iter()
            .map(|r| r["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids_of(&all), [b.clone(), a.clone()]);
    let (rb, ra) = (&all[0], &all[1]);
    assert_eq!(
        (ra["errors"].as_u64(), rb["errors"].as_u64()),
        (Some(0), Some(1))
    );
    assert!(ra["ended_by"].is_null(), "{ra}");
    assert!(
        matches!(rb["ended_by"].as_str(), Some("rest" | "closed")),
        "{rb}"
    );
    assert!(
        ra["metadata"].is_object() && ra.get("front_door").is_some(),
        "{ra}"
    );
    assert!(ra.get("matches").is_none(), "{ra}");
    assert_eq!(ra["live"], true);

    // Text, case-insensitive, in code, output, errors; acknowledged means searchable.
    let found = listed(&alice, "q=haystack").await;
    assert_eq!(ids_of(&found), vec![a.clone()]);
    let matches = found[0]["matches"].as_array().unwrap();
    let fields: Vec<&str> = matches
        .iter()
        .map(|m| m["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["code", "output"], "{matches:?}");
    assert_eq!(
        matches[1]["snippet"],
        "Needle in the HAYSTACK, 100%_done\n42\n"
    );
    assert!(matches[0]["seq"].as_i64().unwrap() < matches[1]["seq"].as_i64().unwrap());
    let found = listed(&alice, "q=ZERODIVISION").await;
    assert_eq!(ids_of(&found), vec![b.clone()]);
    assert!(found[0]["matches"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["field"] == "error"
            && m["snippet"]
                .as_str()
                .unwrap()
                .contains("ZeroDivisionError: zebra crossing")));
    assert_eq!(ids(&alice, "q=42").await, vec![a.clone()]);
    // A search that finds nothing still lists as an empty array.
    assert_eq!(
        listed(&alice, "q=nowhere-to-be-found").await,
        Vec::<Value>::new()
    );

    // Hostile text is looked for, never obeyed.
    for (q, want) in [
        ("%", vec![a.clone()]),
        ("_", vec![a.clone()]),
        ("%_d", vec![a.clone()]),
        ("\"", vec![]),
        // The code is `6 * 7`.
        ("*", vec![a.clone()]),
        ("NEAR(", vec![]),
        ("NEAR(needle haystack)", vec![]),
        ("needle OR zebra", vec![]),
        ("needle*", vec![]),
        ("') OR 1=1 --", vec![]),
        ("\\", vec![]),
    ] {
        assert_eq!(
            ids(&alice, &format!("q={}", encode(q))).await,
            want,
            "{q:?}"
        );
    }

    // Filters, alone and combined.
    assert_eq!(ids(&alice, "state=live").await, vec![a.clone()]);
    assert_eq!(ids(&alice, "state=ended").await, vec![b.clone()]);
    assert_eq!(ids(&alice, "state=closed").await, vec![b.clone()]);
    assert_eq!(ids(&alice, "state=expired").await, Vec::<String>::new());
    assert_eq!(ids(&alice, "has_errors=true").await, vec![b.clone()]);
    assert_eq!(ids(&alice, "has_errors=false").await, vec![a.clone()]);
    assert_eq!(ids(&alice, "limit=1").await, vec![b.clone()]);
    let since = encode(&start.to_rfc3339());
    assert_eq!(
        ids(&alice, &format!("since={since}")).await,
        [b.clone(), a.clone()]
    );
    assert_eq!(
        ids(&alice, &format!("until={since}")).await,
        Vec::<String>::new()
    );
    assert_eq!(
        ids(&alice, "since=2999-01-01T00:00:00Z").await,
        Vec::<String>::new()
    );
    assert_eq!(
        ids(&alice, "q=zebra&state=closed&has_errors=true").await,
        vec![b.clone()]
    );
    // Sessions made through REST say so once the session layer reports its front door;
    // until then it is null and matches no front door.
    let rest = ids(
        &alice,
        "q=zebra&state=closed&has_errors=true&front_door=rest",
    )
    .await;
    assert!(rest.is_empty() || rest == vec![b.clone()], "{rest:?}");
    assert_eq!(ids(&alice, "front_door=e2b").await, Vec::<String>::new());
    assert_eq!(
        ids(&alice, "q=zebra&state=live").await,
        Vec::<String>::new()
    );
    assert_eq!(
        ids(&alice, "q=needle&has_errors=true").await,
        Vec::<String>::new()
    );

    // Metadata given at creation is listed and searched.
    let (status, made) = alice
        .post(
            "/v1/sessions",
            serde_json::json!({"metadata": {"ticket": "JIRA-4242", "agent": "triage"}}),
        )
        .await;
    assert_eq!(status, 201, "{made}");
    let m = made["id"].as_str().unwrap().to_string();
    let found = listed(&alice, "q=jira-4242").await;
    assert_eq!(ids_of(&found), vec![m.clone()]);
    assert_eq!(found[0]["metadata"]["ticket"], "JIRA-4242");
    assert_eq!(found[0]["matches"][0]["field"], "metadata");
    assert_eq!(found[0]["matches"][0]["snippet"], "triage\nJIRA-4242");
    assert_eq!(ids(&bob, "q=jira").await, Vec::<String>::new());

    // Another user's sessions never match; theirs are found by them.
    assert_eq!(ids(&bob, "q=needle").await, vec![c.clone()]);
    assert_eq!(ids(&bob, "q=zebra").await, Vec::<String>::new());
    assert_eq!(ids(&bob, "state=ended").await, Vec::<String>::new());

    // Bad values: 400 naming the parameter.
    let long = format!("q={}", "x".repeat(10_000));
    for (query, name) in [
        (long.as_str(), "q"),
        ("q=", ""),
        ("state=open", "state"),
        ("front_door=websocket", "front_door"),
        ("has_errors=1", "has_errors"),
        ("since=yesterday", "since"),
        ("until=2026-13-01T00:00:00Z", "until"),
        ("limit=0", "limit"),
        ("limit=10001", "limit"),
        ("limit=ten", "limit"),
    ] {
        let (status, v) = alice.get(&format!("/v1/recordings?{query}")).await;
        if name.is_empty() {
            // An empty q is no search.
            assert_eq!(status, 200, "{query}: {v}");
            continue;
        }
        assert_eq!(status, 400, "{query}: {v}");
        assert_eq!(v["error"]["code"], "bad_request", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(name), "{query}: {message}");
        assert!(message.len() < 200, "{message}");
    }
}

#[tokio::test]
async fn the_list_is_searched_and_filtered_sqlite() {
    let broker = SpawnedBroker::start(&[], None);
    the_list_is_searched_and_filtered(&broker).await;
    broker.stop().await;
}

#[tokio::test]
async fn the_list_is_searched_and_filtered_postgres() {
    let url = pg::fresh_database().await;
    let broker = SpawnedBroker::start(&["--database-url", &url], None);
    the_list_is_searched_and_filtered(&broker).await;
    broker.stop().await;
}

/// Forks in the list: a fork of the live kernel and a fork from a checkpoint name their
/// parent, its execution count and (for the second) the checkpoint; the parent names none.
async fn forks_are_listed_with_their_parent(broker: &SpawnedBroker) {
    let alice = broker.api(ALICE);
    let (status, v) = alice
        .post(
            "/v1/sessions",
            serde_json::json!({"checkpoint_every_execution": true}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    let parent = v["id"].as_str().unwrap().to_string();
    for code in ["x = 1", "x = 2"] {
        assert_eq!(alice.execute(&parent, code).await["status"], "ok");
    }
    // The checkpoints of both steps (each taken after its execution, before the session
    // serves its next request).
    let mut checkpoints = Value::Null;
    for _ in 0..100 {
        let (status, v) = alice
            .get(&format!("/v1/sessions/{parent}/checkpoints"))
            .await;
        assert_eq!(status, 200, "{v}");
        checkpoints = v;
        if checkpoints["checkpoints"].as_array().map(Vec::len) == Some(2) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let cp = checkpoints["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["execution_count"] == 1)
        .unwrap_or_else(|| panic!("no checkpoint of step 1: {checkpoints}"))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, v) = alice
        .post(
            &format!("/v1/sessions/{parent}/fork"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    let live_fork = v["sessions"][0]["id"].as_str().unwrap().to_string();
    let (status, v) = alice
        .post(
            &format!("/v1/sessions/{parent}/checkpoints/{cp}/fork"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    let cp_fork = v["sessions"][0]["id"].as_str().unwrap().to_string();
    // Bob cannot fork alice's checkpoint, nor does his list show her forks.
    let (status, _) = broker
        .api(BOB)
        .post(
            &format!("/v1/sessions/{parent}/checkpoints/{cp}/fork"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(status, 404);
    assert!(listed(&broker.api(BOB), "").await.is_empty());

    let all = listed(&alice, "").await;
    let row = |id: &str| all.iter().find(|r| r["id"] == id).unwrap().clone();
    assert!(row(&parent)["forked_from"].is_null(), "{all:?}");
    assert_eq!(
        row(&live_fork)["forked_from"],
        serde_json::json!({"session": parent, "execution_count": 2}),
    );
    assert_eq!(
        row(&cp_fork)["forked_from"],
        serde_json::json!({"session": parent, "execution_count": 1, "checkpoint": cp}),
    );
    for id in [&cp_fork, &live_fork, &parent] {
        assert_eq!(alice.delete(&format!("/v1/sessions/{id}")).await.0, 204);
    }
}

#[tokio::test]
async fn forks_are_listed_with_their_parent_sqlite() {
    let broker = SpawnedBroker::start(&[], None);
    forks_are_listed_with_their_parent(&broker).await;
    broker.stop().await;
}

#[tokio::test]
async fn forks_are_listed_with_their_parent_postgres() {
    let url = pg::fresh_database().await;
    let broker = SpawnedBroker::start(&["--database-url", &url], None);
    forks_are_listed_with_their_parent(&broker).await;
    broker.stop().await;
}

/// A recordings file of version 2 (before the search index) with a session in it: the
/// broker of this version migrates it, and the session's code, output and error are found,
/// its failure counted, its front door and closer shown.
#[tokio::test]
async fn a_version_2_recordings_file_is_searched_after_the_upgrade() {
    let mut broker = SpawnedBroker::start(&[], None);
    let alice = broker.api(ALICE);
    let id = alice.create().await;
    let x = alice.execute(&id, "print('upgraded ' + 'needle')").await;
    assert_eq!(x["status"], "ok", "{x}");
    let x = alice.execute(&id, "raise KeyError('gone')").await;
    assert_eq!(x["status"], "error", "{x}");
    let (status, _) = alice.delete(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 204);
    broker.halt(common::spawned::Stop::Term).await;
    // What versions 3 and 4 added, taken away again.
    let db = broker.data_dir().join("recordings.sqlite3");
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch(
        "ALTER TABLE sessions DROP COLUMN forked_from; ALTER TABLE sessions DROP COLUMN forked_at;
         ALTER TABLE sessions DROP COLUMN forked_checkpoint;
         DROP TRIGGER search_text_added; DROP TRIGGER search_text_removed;
         DROP TABLE search_fts; DROP TABLE search_text;
         ALTER TABLE sessions DROP COLUMN front_door; ALTER TABLE sessions DROP COLUMN metadata;
         ALTER TABLE sessions DROP COLUMN errors; ALTER TABLE sessions DROP COLUMN ended_by;
         PRAGMA user_version = 2;",
    )
    .unwrap();
    drop(conn);
    broker.resume();
    let alice = broker.api(ALICE);
    let found = listed(&alice, "q=upgraded%20needle").await;
    assert_eq!(found.len(), 1, "{found:?}");
    let r = &found[0];
    assert_eq!(r["id"], id.as_str());
    assert_eq!(r["matches"][0]["field"], "output", "{r}");
    assert_eq!(r["matches"][0]["snippet"], "upgraded needle\n", "{r}");
    assert_eq!(
        (r["errors"].as_u64(), &r["ended_by"]),
        (Some(1), &Value::from("rest"))
    );
    assert_eq!(r["front_door"], "rest");
    assert!(r["forked_from"].is_null(), "{r}");
    let found = listed(&alice, "q=keyerror").await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0]["matches"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["field"] == "error"));
    assert_eq!(ids(&alice, "q=raise%20KeyError").await, vec![id.clone()]);
    assert_eq!(ids(&alice, "has_errors=true").await, vec![id]);
    broker.stop().await;
}
