//! The store end to end: reports in, events and sessions read back, blobs, budgets, the
//! queue bound, stale sessions and retention.

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

on_both!(
    events_round_trip_in_order_with_blobs,
    every_message_type_is_capped_per_execution_with_one_marker,
    an_image_shown_again_costs_only_its_reference,
    the_session_cap_holds_across_executions,
    an_overfull_queue_drops_and_marks_the_gap,
    reopening_closes_stale_sessions_and_retention_deletes_old_ones,
);

async fn events_round_trip_in_order_with_blobs(backend: Backend) {
    let store = open_store(backend, |_| {}).await;
    let id = Uuid::new_v4();
    let k = key(id);
    let req = msg(
        "execute_request",
        "",
        json!({"code": "plot()", "silent": false}),
    );
    store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
    store.report_event(k.clone(), started(&req.msg_id, "plot()"));
    let png = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, vec![7u8; 5000]);
    // As a kernel sends it: the request's header as its parent header (re-serialised).
    let parent: Value = serde_json::from_slice(&req.header).unwrap();
    let parent = Bytes::from(serde_json::to_string_pretty(&parent).unwrap());
    let disp = Message::new(
        "display_data",
        &json!({"data": {"image/png": png, "text/plain": "<Figure>"}, "metadata": {}}),
        Some(&parent),
        "k",
        "alice",
    );
    store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &disp);
    store.report_event(
        k.clone(),
        done(
            &req.msg_id,
            json!({"results": [{"data": {"image/png": png}}]}),
        ),
    );
    store.report_event(k.clone(), LifecycleEvent::SessionClosed);
    store.flush().await;

    let all = store.all_events(id).await.unwrap();
    let types: Vec<&str> = all.iter().map(|e| e.type_name()).collect();
    assert_eq!(
        types,
        [
            "execute_request",
            "execution_started",
            "display_data",
            "execution_done",
            "session_closed"
        ]
    );
    assert_eq!(
        all.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    // The display's parent header is stored as a reference to the request, and put back.
    let RecordedKind::Message {
        header: req_header, ..
    } = &all[0].kind
    else {
        panic!()
    };
    let RecordedKind::Message { parent_header, .. } = &all[2].kind else {
        panic!()
    };
    assert_eq!(parent_header, req_header);
    let stored = scalar(
        &store,
        "SELECT parent_seq FROM events WHERE seq = 3 AND parent_header IS NULL",
    )
    .await;
    assert_eq!(stored, Some(1));
    let RecordedKind::Message { content, .. } = &all[2].kind else {
        panic!()
    };
    let c: Value = serde_json::from_str(content).unwrap();
    assert_eq!(c["data"]["image/png"], png.as_str());
    let RecordedKind::Broker { detail, .. } = &all[3].kind else {
        panic!()
    };
    let d: Value = serde_json::from_str(detail).unwrap();
    assert_eq!(
        d["execution"]["results"][0]["data"]["image/png"],
        png.as_str()
    );

    let info = store.info(id).await.unwrap().unwrap();
    assert_eq!(info.cells, 1);
    assert_eq!(info.events, 5);
    assert_eq!(info.end_reason.as_deref(), Some("closed"));
    assert!(info.ended_at.is_some());

    // One image, stored once.
    assert_eq!(scalar(&store, "SELECT count(*) FROM blobs").await, Some(1));

    // Filters and paging.
    let page = store
        .events(
            id,
            EventQuery {
                after: 1,
                limit: 2,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        page.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [2, 3]
    );
    assert!(page.more);
    let page = store
        .events(
            id,
            EventQuery {
                limit: 10,
                channels: vec!["broker".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(page.events.len(), 3);
    assert!(!page.more);
    let page = store
        .events(
            id,
            EventQuery {
                limit: 10,
                types: vec!["display_data".into(), "session_closed".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        page.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [3, 5]
    );

    assert!(store.delete(id).await.unwrap());
    assert!(!store.delete(id).await.unwrap());
    assert!(matches!(
        store.events(id, EventQuery::default()).await,
        Err(RecordingError::NotFound(_))
    ));
    assert_eq!(
        scalar(&store, "SELECT count(*) FROM blobs").await,
        Some(0),
        "the blob went with its last session"
    );
    store.close().await;
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

async fn every_message_type_is_capped_per_execution_with_one_marker(backend: Backend) {
    let store = open_store(backend, |c| c.max_execution_bytes = 5000).await;
    let id = Uuid::new_v4();
    let k = key(id);
    let mut requests = Vec::new();
    for (n, kinds) in [
        (10, ["stream", "display_data", "error"]),
        (1, ["stream"; 3]),
    ] {
        let req = msg("execute_request", "", json!({"code": "x", "silent": false}));
        store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
        for i in 0..n {
            for kind in kinds {
                let m = match kind {
                    "display_data" => display(&req.msg_id, format!("{i}{}", "d".repeat(300))),
                    "error" => msg(
                        kind,
                        &req.msg_id,
                        json!({"ename": "E", "evalue": "e".repeat(300), "traceback": []}),
                    ),
                    _ => msg(
                        kind,
                        &req.msg_id,
                        json!({"name": "stdout", "text": "s".repeat(300)}),
                    ),
                };
                store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
            }
        }
        let execution = json!({"stdout": "s".repeat(3000 * n)});
        store.report_event(k.clone(), done(&req.msg_id, execution));
        requests.push(req.msg_id);
    }
    store.flush().await;
    let all = store.all_events(id).await.unwrap();
    let t = types(&all);
    let markers: Vec<_> = all
        .iter()
        .filter(|e| e.type_name() == "recording_truncated")
        .collect();
    assert_eq!(markers.len(), 1, "{t:?}");
    let m = detail(markers[0]);
    assert_eq!(m["scope"], "execution");
    assert_eq!(m["msg_id"], requests[0].as_str());
    let first = t.iter().position(|x| *x == "recording_truncated").unwrap();
    let kept = first - 1;
    assert!(kept > 3 && kept < 30, "{t:?}");
    assert_eq!(m["dropped_messages"], 30 - kept as u64 + 1, "{m}");
    assert!(
        m["dropped_bytes"].as_u64().unwrap() > 300 * (30 - kept as u64),
        "{m}"
    );
    // The capped execution's end is kept, cut; the next execution is recorded whole.
    assert_eq!(
        t[first + 1..],
        [
            "execution_done",
            "execute_request",
            "stream",
            "stream",
            "stream",
            "execution_done"
        ]
    );
    assert_eq!(
        detail(&all[first + 1]),
        json!({"msg_id": requests[0], "recording_truncated": true, "bytes": detail(&all[first + 1])["bytes"]})
    );
    assert!(detail(&all[first + 6])["execution"]["stdout"].is_string());
    assert_eq!(store.stats().truncated, 30 - kept as u64 + 1);
    store.close().await;
}

async fn an_image_shown_again_costs_only_its_reference(backend: Backend) {
    let store = open_store(backend, |c| c.max_execution_bytes = 20_000).await;
    let id = Uuid::new_v4();
    let k = key(id);
    let png = base64::engine::general_purpose::STANDARD.encode([7u8; 9000]);
    let req = msg("execute_request", "", json!({"code": "x", "silent": false}));
    store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
    for _ in 0..20 {
        let m = msg(
            "display_data",
            &req.msg_id,
            json!({"data": {"image/png": png}, "metadata": {}, "transient": {}}),
        );
        store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
    }
    // A second, different image does not fit any more.
    let other = base64::engine::general_purpose::STANDARD.encode([8u8; 9000]);
    let m = msg(
        "display_data",
        &req.msg_id,
        json!({"data": {"image/png": other}, "metadata": {}, "transient": {}}),
    );
    store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
    store.flush().await;
    let all = store.all_events(id).await.unwrap();
    let t = types(&all);
    assert_eq!(
        t.iter().filter(|x| **x == "display_data").count(),
        20,
        "{t:?}"
    );
    assert_eq!(t.last(), Some(&"recording_truncated"));
    store.close().await;
}

async fn the_session_cap_holds_across_executions(backend: Backend) {
    let store = open_store(backend, |c| c.max_session_bytes = 6000).await;
    let id = Uuid::new_v4();
    let k = key(id);
    for _ in 0..10 {
        let req = msg("execute_request", "", json!({"code": "x", "silent": false}));
        store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
        store.report_event(k.clone(), started(&req.msg_id, "x"));
        let m = display(&req.msg_id, "d".repeat(1000));
        store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &m);
        store.report_event(k.clone(), done(&req.msg_id, json!({})));
    }
    store.report_event(k.clone(), LifecycleEvent::SessionClosed);
    store.flush().await;
    let all = store.all_events(id).await.unwrap();
    let t = types(&all);
    let markers: Vec<_> = all
        .iter()
        .filter(|e| e.type_name() == "recording_truncated")
        .collect();
    assert_eq!(markers.len(), 1, "{t:?}");
    assert_eq!(detail(markers[0])["scope"], "session");
    let first = t.iter().position(|x| *x == "recording_truncated").unwrap();
    assert!(first >= 4, "{t:?}");
    assert_eq!(t[first + 1..], ["session_closed"], "{t:?}");
    let info = store.info(id).await.unwrap().unwrap();
    assert_eq!(info.end_reason.as_deref(), Some("closed"));
    assert_eq!(info.events as usize, all.len());
    store.close().await;
}

async fn an_overfull_queue_drops_and_marks_the_gap(backend: Backend) {
    let store = open_store(backend, |c| c.max_queue_bytes = 0).await;
    let id = Uuid::new_v4();
    let k = key(id);
    for _ in 0..3 {
        store.report_event(k.clone(), LifecycleEvent::Interrupt);
    }
    assert_eq!(store.stats().dropped, 3);
    store.flush().await;
    assert!(matches!(
        store.events(id, EventQuery::default()).await,
        Err(RecordingError::NotFound(_))
    ));
    // Room again: the next report is preceded by the marker.
    drop(store);
    let store = open_store(backend, |c| c.max_queue_bytes = 1 << 20).await;
    store.gaps.lock().unwrap().insert(id, 3);
    store.gaps_pending.store(1, Ordering::Release);
    store.report_event(k.clone(), LifecycleEvent::Interrupt);
    store.flush().await;
    let all = store.all_events(id).await.unwrap();
    assert_eq!(
        all.iter().map(|e| e.type_name()).collect::<Vec<_>>(),
        ["recording_gap", "interrupt"]
    );
    let RecordedKind::Broker { detail, .. } = &all[0].kind else {
        panic!()
    };
    assert_eq!(
        serde_json::from_str::<Value>(detail.as_str()).unwrap()["dropped"],
        3
    );
    assert_eq!(store.stats().queued_bytes, 0);
    store.close().await;
}

/// What recording costs an execution: the report calls on the session's task, and the
/// barrier wait before the acknowledgement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: KB_TEST_POSTGRES_URL=... cargo test --release --lib recording_cost -- --ignored --nocapture"]
async fn recording_cost() {
    for (backend, sync) in [
        (Backend::Sqlite, Synchronous::Normal),
        (Backend::Sqlite, Synchronous::Full),
        (Backend::Postgres, Synchronous::Normal),
    ] {
        eprintln!("{backend:?}, synchronous = {sync:?}");
        measure_recording_cost(backend, sync).await;
    }
}

async fn measure_recording_cost(backend: Backend, sync: Synchronous) {
    let store = open_store(backend, |c| c.synchronous = sync).await;
    let k = key(Uuid::new_v4());
    let req = msg(
        "execute_request",
        "",
        json!({"code": "1+1", "silent": false}),
    );
    let reply = msg(
        "execute_result",
        &req.msg_id,
        json!({"data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1}),
    );
    let (mut report, mut barrier) = (Vec::new(), Vec::new());
    for _ in 0..3000 {
        let t = std::time::Instant::now();
        store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
        for _ in 0..6 {
            store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &reply);
        }
        store.report_event(k.clone(), done(&req.msg_id, json!({"stdout": ""})));
        report.push(t.elapsed());
        let t = std::time::Instant::now();
        store.flush().await;
        barrier.push(t.elapsed());
    }
    for (what, mut v) in [("8 reports", report), ("barrier", barrier)] {
        v.sort();
        let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
        eprintln!(
            "{what}: p50 {:?} p90 {:?} p99 {:?}",
            p(0.5),
            p(0.9),
            p(0.99)
        );
    }
    store.close().await;
}

async fn reopening_closes_stale_sessions_and_retention_deletes_old_ones(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = new_config(backend, &dir).await;
    let id = Uuid::new_v4();
    {
        let store = RecordingStore::open(cfg.clone()).unwrap();
        store.report_event(
            key(id),
            LifecycleEvent::SessionCreated {
                kernel: "python3".into(),
                idle_timeout_seconds: None,
            },
        );
        store.flush().await;
        // Not closed: as if the broker was killed.
    }
    let store = RecordingStore::open(cfg.clone()).unwrap();
    // The writer closes stale sessions before anything else it does.
    store.flush().await;
    let info = store.info(id).await.unwrap().unwrap();
    assert_eq!(info.end_reason.as_deref(), Some("broker_stopped"));
    let all = store.all_events(id).await.unwrap();
    assert_eq!(all.last().unwrap().type_name(), "broker_stopped");
    store.close().await;

    // Retention: nothing ended a day ago; everything ended before now.
    let mut db: Box<dyn WriteDb> = match backend {
        Backend::Sqlite => Box::new(SqliteDb::new(schema::open(&cfg).unwrap(), cfg.path.clone())),
        Backend::Postgres => {
            let url = cfg.database_url.clone().unwrap();
            // The writer's connection has a runtime of its own: made off this one.
            tokio::task::spawn_blocking(move || PgDb::open(&url, "local").unwrap())
                .await
                .map(|db| Box::new(db) as Box<dyn WriteDb>)
                .unwrap()
        }
    };
    // (dropped there too: a runtime may not be dropped on this one)
    tokio::task::spawn_blocking(move || {
        assert_eq!(
            db.retention(micros(Utc::now()) - 86_400_000_000).unwrap(),
            0
        );
        assert_eq!(db.retention(micros(Utc::now()) + 1).unwrap(), 1);
    })
    .await
    .unwrap();
    assert_eq!(scalar(&store, "SELECT count(*) FROM events").await, Some(0));
    assert_eq!(
        scalar(&store, "SELECT count(*) FROM sessions").await,
        Some(0)
    );
}

on_both!(a_kernels_nul_bytes_break_no_batch);

/// A kernel's message whose ids decode to NUL (which PostgreSQL's text refuses, and one
/// failed statement aborts a whole transaction there) is stored, and so is what other
/// sessions report in the same batch.
async fn a_kernels_nul_bytes_break_no_batch(backend: Backend) {
    let store = open_store(backend, |_| {}).await;
    let (hostile, other) = (Uuid::new_v4(), Uuid::new_v4());
    let req = msg("execute_request", "", json!({"code": "x", "silent": false}));
    store.report_message(key(hostile), Direction::ToKernel, Channel::Shell, &req);
    let mut evil = msg(
        "stream",
        "p\0",
        json!({"name": "stdout", "text": "a\u{0}b"}),
    );
    evil.msg_id = "id\0".into();
    evil.msg_type = "str\0eam".into();
    evil.parent_msg_id = Some("p\0".into());
    evil.metadata = Bytes::from_static(b"\x00\xff not json");
    store.report_message(key(hostile), Direction::FromKernel, Channel::Iopub, &evil);
    store.report_event(key(other), LifecycleEvent::Interrupt);
    store.flush().await;
    assert_eq!(store.stats().errors, 0);
    let all = store.all_events(hostile).await.unwrap();
    assert_eq!(all.len(), 2);
    let RecordedKind::Message {
        msg_id,
        msg_type,
        content,
        metadata,
        ..
    } = &all[1].kind
    else {
        panic!()
    };
    let nul = match backend {
        Backend::Sqlite => "\0",
        Backend::Postgres => "\u{fffd}",
    };
    assert_eq!(msg_id, &format!("id{nul}"));
    assert_eq!(msg_type, &format!("str{nul}eam"));
    // JSON escapes NUL: the content is kept as sent.
    let c: Value = serde_json::from_str(content).unwrap();
    assert_eq!(c["text"], "a\u{0}b");
    assert!(serde_json::from_str::<Value>(metadata).unwrap().is_string());
    assert_eq!(store.all_events(other).await.unwrap().len(), 1);
    store.close().await;
}

/// Two brokers (nodes) on one PostgreSQL database: each sees the other's recordings; one
/// that restarts closes only the sessions it left open; an image both stored outlives the
/// deletion of one of them.
#[tokio::test]
async fn brokers_share_one_postgres_database() {
    let dir = tempfile::tempdir().unwrap();
    let mut a_cfg = new_config(Backend::Postgres, &dir).await;
    a_cfg.node = "node-a".into();
    let b_cfg = RecordingConfig {
        node: "node-b".into(),
        ..a_cfg.clone()
    };
    let png = base64::engine::general_purpose::STANDARD.encode(vec![9u8; 4000]);
    let image = |parent: &str| {
        msg(
            "display_data",
            parent,
            json!({"data": {"image/png": png.clone()}, "metadata": {}, "transient": {}}),
        )
    };
    let (sa, sb) = (Uuid::new_v4(), Uuid::new_v4());
    let a = RecordingStore::open(a_cfg.clone()).unwrap();
    let b = RecordingStore::open(b_cfg).unwrap();
    for (store, id) in [(&a, sa), (&b, sb)] {
        let req = msg(
            "execute_request",
            "",
            json!({"code": "plot()", "silent": false}),
        );
        store.report_message(key(id), Direction::ToKernel, Channel::Shell, &req);
        store.report_message(
            key(id),
            Direction::FromKernel,
            Channel::Iopub,
            &image(&req.msg_id),
        );
        store.flush().await;
    }
    assert_eq!(scalar(&a, "SELECT count(*) FROM blobs").await, Some(1));
    // Either broker reads both.
    for store in [&a, &b] {
        let listed: Vec<Uuid> = store
            .list("alice", 10)
            .await
            .unwrap()
            .iter()
            .map(|i| i.id)
            .collect();
        assert!(listed.contains(&sa) && listed.contains(&sb), "{listed:?}");
        assert_eq!(store.all_events(sa).await.unwrap().len(), 2);
    }
    // Node a is killed (its session left open) and starts again: only its session is closed.
    drop(a);
    let a = RecordingStore::open(a_cfg).unwrap();
    a.flush().await;
    let info = |s: &Arc<RecordingStore>, id| {
        let s = s.clone();
        async move { s.info(id).await.unwrap().unwrap() }
    };
    assert_eq!(
        info(&a, sa).await.end_reason.as_deref(),
        Some("broker_stopped")
    );
    assert_eq!(
        info(&a, sb).await.end_reason,
        None,
        "node b's session is live"
    );
    // Deleting a's recording keeps the image b still shows.
    assert!(a.delete(sa).await.unwrap());
    assert_eq!(scalar(&a, "SELECT count(*) FROM blobs").await, Some(1));
    let all = b.all_events(sb).await.unwrap();
    let RecordedKind::Message { content, .. } = &all[1].kind else {
        panic!()
    };
    let c: Value = serde_json::from_str(content).unwrap();
    assert_eq!(c["data"]["image/png"], png.as_str());
    assert!(b.delete(sb).await.unwrap());
    assert_eq!(scalar(&a, "SELECT count(*) FROM blobs").await, Some(0));
    a.close().await;
    b.close().await;
}

/// Brokers starting together on a new database migrate it once; a database of a newer
/// schema than this broker knows is refused, not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_schema_is_migrated_once_and_a_newer_one_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = new_config(Backend::Postgres, &dir).await;
    let opens: Vec<_> = (0..4)
        .map(|i| {
            let mut c = cfg.clone();
            c.node = format!("n{i}");
            tokio::task::spawn_blocking(move || RecordingStore::open(c).map(|_| ()))
        })
        .collect();
    for o in opens {
        o.await.unwrap().unwrap();
    }
    let store = RecordingStore::open(cfg.clone()).unwrap();
    assert_eq!(
        scalar(&store, "SELECT count(*) FROM schema_migrations").await,
        Some(crate::recording::postgres::SCHEMA_VERSION)
    );
    scalar(
        &store,
        "INSERT INTO schema_migrations (version) VALUES (99) RETURNING version",
    )
    .await;
    let err = tokio::task::spawn_blocking(move || RecordingStore::open(cfg).map(|_| ()))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(err, RecordingError::SchemaTooNew { found: 99, .. }),
        "{err}"
    );
    store.close().await;
}
