//! The writer's housekeeping: sessions a killed broker left open are closed at the next
//! start; retention deletes those that ended long ago.

use super::*;

on_both!(reopening_closes_stale_sessions_and_retention_deletes_old_ones,);

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
                provenance: Default::default(),
                forked_from: None,
                own_workspace: false,
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
