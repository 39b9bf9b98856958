//! Reports in, events and sessions read back: order, parent references, blobs, filters
//! and paging, deletion; a kernel's hostile bytes.

use super::*;

on_both!(
    events_round_trip_in_order_with_blobs,
    a_kernels_nul_bytes_break_no_batch,
    file_and_command_events_are_stored_and_read_back,
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
    store.report_event(
        k.clone(),
        LifecycleEvent::SessionClosed {
            by: crate::session::EndedBy::Client(crate::session::FrontDoor::Rest),
        },
    );
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
    let query = |after, limit, channels: &[&str], types: &[&str]| EventQuery {
        after,
        limit,
        channels: channels.iter().map(|c| c.to_string()).collect(),
        types: types.iter().map(|t| t.to_string()).collect(),
    };
    let (seqs, more) = page(&store, id, query(1, 2, &[], &[])).await;
    assert_eq!(seqs, [2, 3]);
    assert!(more);
    let (seqs, more) = page(&store, id, query(0, 10, &["broker"], &[])).await;
    assert_eq!(seqs.len(), 3);
    assert!(!more);
    let (seqs, _) = page(
        &store,
        id,
        query(0, 10, &[], &["display_data", "session_closed"]),
    )
    .await;
    assert_eq!(seqs, [3, 5]);

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

/// The sequence numbers of a page of `id`'s events, and whether there are more.
async fn page(store: &RecordingStore, id: Uuid, query: EventQuery) -> (Vec<i64>, bool) {
    let page = store.events(id, query).await.unwrap();
    (page.events.iter().map(|e| e.seq).collect(), page.more)
}

/// A workspace change and a command run, as the session layer reports them: stored with
/// their own kinds, read back typed, and neither a cell nor a marker of the timeline.
async fn file_and_command_events_are_stored_and_read_back(backend: Backend) {
    let store = open_store(backend, |_| {}).await;
    let id = Uuid::new_v4();
    let events = [
        LifecycleEvent::FileWritten {
            path: "data/a.csv".into(),
            bytes: 12,
            content: None,
        },
        LifecycleEvent::FileRenamed {
            from: "data/a.csv".into(),
            to: "b.csv".into(),
        },
        LifecycleEvent::FileRemoved {
            path: "b.csv".into(),
        },
        LifecycleEvent::CommandStarted {
            pid: 7,
            argv: vec!["ls".into(), "-l".into()],
            cwd: None,
        },
        LifecycleEvent::CommandEnded {
            pid: 7,
            exit_code: Some(0),
            signal: None,
            seconds: 0.5,
            stdout: crate::session::lifecycle::CommandOutput {
                text: "total 0\n".into(),
                bytes: 8,
            },
            stderr: Default::default(),
        },
    ];
    for e in &events {
        store.report_event(key(id), e.clone());
    }
    store.flush().await;
    let all = store.all_events(id).await.unwrap();
    assert_eq!(
        types(&all),
        [
            "file_written",
            "file_renamed",
            "file_removed",
            "command_started",
            "command_ended"
        ]
    );
    for (stored, reported) in all.iter().zip(&events) {
        let RecordedKind::Broker { kind, detail } = &stored.kind else {
            panic!("{stored:?}")
        };
        assert_eq!(
            crate::recording::event::BrokerEvent::parse(kind, detail),
            crate::recording::event::BrokerEvent::Session(reported.clone().into())
        );
    }
    assert!(crate::recording::notebook::timeline(&all).is_empty());
    let info = store.info(id).await.unwrap().unwrap();
    assert_eq!(info.cells, 0);
    assert_eq!(info.events, 5);
    store.close().await;
}
