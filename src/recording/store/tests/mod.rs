//! The store end to end: reports in, events and sessions read back, blobs, budgets, the
//! queue bound, stale sessions and retention. This file has the fixtures (a store on
//! either database, reports as the session layer makes them); each file a concept:
//! `round_trip` (events and sessions read back, blobs, paging, hostile bytes), `budgets`
//! (the per-execution and per-session caps, the queue bound), `housekeeping` (stale sessions,
//! retention), `postgres` (brokers sharing one database, its migration), `once` (an
//! execution stored once, read back whole), `cost` (measurements), `search` (the list,
//! filtered and searched), `search_speed` (its speed over many sessions).

use super::*;
use base64::Engine;
use bytes::Bytes;
use serde_json::{json, Value};

use crate::recording::{RecordedKind, Synchronous};
use crate::session::Execution;

/// An agent execution's start, as the session reports it.
fn started(msg_id: &str, code: &str) -> LifecycleEvent {
    LifecycleEvent::ExecutionStarted {
        msg_id: msg_id.into(),
        code: code.into(),
        timeout_seconds: 30.0,
        queue_wait_seconds: 0.0,
    }
}

/// An agent execution's end; `execution` holds the fields that differ from an empty one
/// (results as `{"data": ...}`).
fn done(msg_id: &str, execution: Value) -> LifecycleEvent {
    let mut x = json!({
        "status": "ok", "execution_count": null, "stdout": "", "stderr": "", "results": [],
        "error": null, "truncated": false, "duration_ms": 0.0,
    });
    for (k, v) in execution.as_object().unwrap() {
        x[k] = v.clone();
    }
    for r in x["results"].as_array_mut().unwrap() {
        r["metadata"] = json!({});
        r["is_main_result"] = json!(false);
    }
    LifecycleEvent::ExecutionDone {
        msg_id: msg_id.into(),
        execution: serde_json::from_value::<Execution>(x).unwrap(),
        output_limit: 10_000,
        result_limit: 16 << 20,
    }
}

fn key(id: Uuid) -> SessionKey {
    SessionKey {
        id,
        user: "alice".into(),
        kernel: "python3".into(),
        created_at: micros(Utc::now()),
    }
}

fn msg(msg_type: &str, parent: &str, content: Value) -> Message {
    let parent_header = Bytes::from(json!({"msg_id": parent}).to_string());
    Message::new(msg_type, &content, Some(&parent_header), "k", "alice")
}

/// Where a test's recordings are.
#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Postgres,
}

/// A store on either database, and what it needs kept alive.
struct TestStore {
    store: Arc<RecordingStore>,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for TestStore {
    type Target = Arc<RecordingStore>;
    fn deref(&self) -> &Self::Target {
        &self.store
    }
}

/// A config on a new, empty database of `backend`.
async fn new_config(backend: Backend, dir: &tempfile::TempDir) -> RecordingConfig {
    let mut cfg = RecordingConfig::new(dir.path().join("r.sqlite3"));
    if let Backend::Postgres = backend {
        cfg.database_url = Some(crate::db::postgres::testing::fresh_database().await);
    }
    cfg
}

async fn open_store(backend: Backend, tweak: impl FnOnce(&mut RecordingConfig)) -> TestStore {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = new_config(backend, &dir).await;
    tweak(&mut cfg);
    TestStore {
        store: RecordingStore::open(cfg).unwrap(),
        _dir: dir,
    }
}

/// One integer a query on the store's tables answers (the same SQL in both databases).
async fn scalar(store: &RecordingStore, sql: &str) -> Option<i64> {
    match &store.config.database_url {
        None => {
            let conn = schema::open_reader(&store.config.path).unwrap();
            conn.query_row(sql, [], |r| r.get(0)).unwrap()
        }
        Some(url) => {
            let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            client.query_one(sql, &[]).await.unwrap().get(0)
        }
    }
}

/// Runs a test once on each database.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn sqlite() {
                super::$name(super::Backend::Sqlite).await
            }
            #[tokio::test]
            async fn postgres() {
                super::$name(super::Backend::Postgres).await
            }
        }
    )*};
}

fn types(all: &[RecordedEvent]) -> Vec<&str> {
    all.iter().map(|e| e.type_name()).collect()
}

fn detail(e: &RecordedEvent) -> Value {
    match &e.kind {
        RecordedKind::Broker { detail, .. } => serde_json::from_str(detail).unwrap(),
        RecordedKind::Message { .. } => panic!("not a broker event: {e:?}"),
    }
}

fn display(parent: &str, text: String) -> Message {
    msg(
        "display_data",
        parent,
        json!({"data": {"text/plain": text}, "metadata": {}, "transient": {}}),
    )
}

// After the macro: its scope is the text that follows it.
mod budgets;
mod cost;
mod housekeeping;
mod once;
mod postgres;
mod round_trip;
mod search;
mod search_speed;
