//! What recording costs an execution (a measurement, ignored by default).

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
