//! What bounds a recording: the per-execution and per-session caps (one marker each), and
//! the writer's queue (a gap marker).

use super::*;

on_both!(
    every_message_type_is_capped_per_execution_with_one_marker,
    an_image_shown_again_costs_only_its_reference,
    the_session_cap_holds_across_executions,
    an_overfull_queue_drops_and_marks_the_gap,
);

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
    store.report_event(
        k.clone(),
        LifecycleEvent::SessionClosed {
            by: crate::session::EndedBy::Client(crate::session::FrontDoor::Rest),
        },
    );
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
