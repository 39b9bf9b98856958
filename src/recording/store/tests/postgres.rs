//! PostgreSQL only: brokers sharing one database, its migration.

use super::*;

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
