//! What recording costs an execution: time, and bytes stored (measurements, ignored by
//! default).

use super::*;

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

/// What one execution of a cell that prints 100 KB and shows a PNG stores: the bytes of its
/// rows (the JSON text of its messages and broker events) and of its blobs, with the
/// default output limit (10,000 characters: the Execution holds the first 10,000) and with
/// one that keeps the whole print; its `execution_done` stored whole (version 1, as every
/// execution was before) and stored once (version 2).
#[tokio::test]
#[ignore = "a measurement: cargo nextest run --lib bytes_stored_per_execution --run-ignored only --no-capture"]
async fn bytes_stored_per_execution() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        for output_limit in [10_000, 1 << 20] {
            for once in [false, true] {
                let (rows, blobs, done) = store_print_and_png(backend, output_limit, once).await;
                eprintln!(
                    "{backend:?}, output limit {output_limit}, stored once: {once}: rows {rows} B \
                     (execution_done {done} B), blobs {blobs} B; total {} B",
                    rows + blobs
                );
            }
        }
    }
}

/// Stores one execution of `print("x" * 100_000)` and a PNG (20,000 bytes) as the session
/// reports it (unless `once`, without the limits the writer needs to store it once); (bytes
/// of rows, bytes of blobs, bytes of the `execution_done` row).
async fn store_print_and_png(backend: Backend, output_limit: usize, once: bool) -> (i64, i64, i64) {
    let store = open_store(backend, |_| {}).await;
    let id = Uuid::new_v4();
    let k = key(id);
    let code = "print('x' * 100_000); display(Image(png))";
    let req = msg(
        "execute_request",
        "",
        json!({"code": code, "silent": false}),
    );
    store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
    store.report_event(k.clone(), started(&req.msg_id, code));
    let png: Vec<u8> = (0..20_000u32).map(|i| (i * 31 % 251) as u8).collect();
    let png = base64::engine::general_purpose::STANDARD.encode(png);
    let iopub = [
        msg("status", &req.msg_id, json!({"execution_state": "busy"})),
        msg(
            "execute_input",
            &req.msg_id,
            json!({"code": code, "execution_count": 1}),
        ),
        msg(
            "stream",
            &req.msg_id,
            json!({"name": "stdout", "text": format!("{}\n", "x".repeat(100_000))}),
        ),
        msg(
            "display_data",
            &req.msg_id,
            json!({"data": {"image/png": png, "text/plain": "<IPython.core.display.Image object>"},
                   "metadata": {}, "transient": {}}),
        ),
        msg("status", &req.msg_id, json!({"execution_state": "idle"})),
    ];
    let reply = msg(
        "execute_reply",
        &req.msg_id,
        json!({"status": "ok", "execution_count": 1, "user_expressions": {}, "payload": []}),
    );
    let mut collector = crate::session::execution::Collector::new(output_limit, 16 << 20);
    for m in &iopub {
        store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, m);
        collector.on_iopub(&m.msg_type, &m.content);
    }
    store.report_message(k.clone(), Direction::FromKernel, Channel::Shell, &reply);
    collector.on_reply(&reply.content);
    let execution = collector.finish(crate::session::ExecutionStatus::Ok, None, 812.5);
    let done = LifecycleEvent::ExecutionDone {
        msg_id: req.msg_id.clone(),
        execution,
        output_limit,
        result_limit: 16 << 20,
    };
    if once {
        store.report_event(k.clone(), done);
    } else {
        let whole = Item::Event(BrokerEvent::Session(done.into()));
        store.report(k.clone(), whole);
    }
    store.flush().await;
    let rows = scalar(
        &store,
        "SELECT CAST(sum(coalesce(length(header), 0) + coalesce(length(parent_header), 0)
           + coalesce(length(metadata), 0) + coalesce(length(content), 0)
           + coalesce(length(buffers), 0)) AS BIGINT) FROM events",
    )
    .await
    .unwrap_or(0);
    let blobs = scalar(
        &store,
        "SELECT CAST(coalesce(sum(length(data)), 0) AS BIGINT) FROM blobs",
    )
    .await
    .unwrap_or(0);
    let done = scalar(
        &store,
        "SELECT CAST(length(content) AS BIGINT) FROM events WHERE kind = 'execution_done'",
    )
    .await
    .unwrap_or(0);
    store.close().await;
    (rows, blobs, done)
}
