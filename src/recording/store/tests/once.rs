//! An execution stored once: its `execution_done` keeps only its outcome, and reads back
//! whole (rebuilt from its messages) in every read: all events, a page that holds the
//! execution's messages and one that does not, the cells (what replay compares with) and
//! the notebook. And stored whole when the writer lost some of its reports.

use super::*;
use crate::recording::notebook::{cells, notebook};
use crate::recording::stored::StoredEvent;
use crate::session::execution::Collector;
use crate::session::ExecutionStatus;

on_both!(
    an_execution_stored_once_reads_back_as_the_session_answered,
    an_execution_whose_reports_were_lost_is_stored_whole,
);

/// An execution as a kernel answers `print; warn; show a PNG; 42; raise`: its request, its
/// iopub and its reply, and the Execution the session gathered from them.
struct Run {
    request: Message,
    iopub: Vec<Message>,
    reply: Message,
    execution: Execution,
}

fn run(code: &str) -> Run {
    let request = msg(
        "execute_request",
        "",
        json!({"code": code, "silent": false}),
    );
    let parent = request.msg_id.clone();
    let png = base64::engine::general_purpose::STANDARD.encode(
        (0..6000u32)
            .map(|i| (i * 13 % 256) as u8)
            .collect::<Vec<_>>(),
    );
    let iopub = vec![
        msg("status", &parent, json!({"execution_state": "busy"})),
        msg(
            "execute_input",
            &parent,
            json!({"code": code, "execution_count": 5}),
        ),
        msg(
            "stream",
            &parent,
            json!({"name": "stdout", "text": "hello\n"}),
        ),
        msg(
            "stream",
            &parent,
            json!({"name": "stderr", "text": "careful\n"}),
        ),
        msg(
            "display_data",
            &parent,
            json!({"data": {"image/png": png, "text/plain": "<Figure size 640x480>"},
                   "metadata": {"image/png": {"width": 640}}, "transient": {}}),
        ),
        msg(
            "execute_result",
            &parent,
            json!({"data": {"text/plain": "42"}, "metadata": {}, "execution_count": 5}),
        ),
        msg(
            "error",
            &parent,
            json!({"ename": "ValueError", "evalue": "bad",
                   "traceback": ["\u{1b}[0;31mValueError\u{1b}[0m: bad"]}),
        ),
        msg("status", &parent, json!({"execution_state": "idle"})),
    ];
    let reply = msg(
        "execute_reply",
        &parent,
        json!({"status": "error", "execution_count": 5, "ename": "ValueError",
               "evalue": "bad", "traceback": []}),
    );
    // What the session's actor gathers from them.
    let mut collector = Collector::new(10_000, 16 << 20);
    for m in &iopub {
        collector.on_iopub(&m.msg_type, &m.content);
    }
    collector.on_reply(&reply.content);
    let execution = collector.finish(ExecutionStatus::Error, None, 31.25);
    Run {
        request,
        iopub,
        reply,
        execution,
    }
}

/// Reports `r` as the session does; `between` runs before the execution's end.
fn report(store: &RecordingStore, k: &SessionKey, r: &Run, between: impl FnOnce()) {
    let code = "print('hello'); show(png); 42; raise ValueError('bad')";
    store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &r.request);
    store.report_event(k.clone(), started(&r.request.msg_id, code));
    for m in &r.iopub {
        store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, m);
    }
    store.report_message(k.clone(), Direction::FromKernel, Channel::Shell, &r.reply);
    between();
    store.report_event(
        k.clone(),
        LifecycleEvent::ExecutionDone {
            msg_id: r.request.msg_id.clone(),
            execution: r.execution.clone(),
            output_limit: 10_000,
            result_limit: 16 << 20,
        },
    );
}

/// The `execution_done` detail of version 1: what every read returns.
fn whole(r: &Run) -> Value {
    let event: StoredEvent = LifecycleEvent::ExecutionDone {
        msg_id: r.request.msg_id.clone(),
        execution: r.execution.clone(),
        output_limit: 10_000,
        result_limit: 16 << 20,
    }
    .into();
    event.detail()
}

/// How many `execution_done` rows hold only an outcome (version 2).
async fn stored_once(store: &RecordingStore) -> Option<i64> {
    scalar(
        store,
        "SELECT count(*) FROM events WHERE kind = 'execution_done'
           AND content LIKE '%\"outcome\"%' AND content NOT LIKE '%\"execution\"%'",
    )
    .await
}

async fn an_execution_stored_once_reads_back_as_the_session_answered(backend: Backend) {
    let store = open_store(backend, |_| {}).await;
    let id = Uuid::new_v4();
    let k = key(id);
    let r = run("x");
    let x = &r.execution;
    // What the session answered: stdout, stderr, the PNG and the result, the error, the count.
    assert_eq!(
        (x.stdout.as_str(), x.stderr.as_str()),
        ("hello\n", "careful\n")
    );
    assert_eq!(x.results.len(), 2);
    assert_eq!(x.error.as_ref().map(|e| e.evalue.as_str()), Some("bad"));
    assert_eq!(
        (x.status, x.execution_count),
        (ExecutionStatus::Error, Some(5))
    );
    report(&store, &k, &r, || {});
    // Output that trails the end is recorded, but is not the execution's.
    let late = msg(
        "stream",
        &r.request.msg_id,
        json!({"name": "stdout", "text": "late\n"}),
    );
    store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &late);
    store.report_event(
        k.clone(),
        LifecycleEvent::SessionClosed {
            by: crate::session::EndedBy::Client(crate::session::FrontDoor::Rest),
        },
    );
    store.flush().await;

    assert_eq!(stored_once(&store).await, Some(1));
    let done_bytes = scalar(
        &store,
        "SELECT CAST(length(content) AS BIGINT) FROM events WHERE kind = 'execution_done'",
    )
    .await
    .unwrap();
    assert!(done_bytes < 300, "{done_bytes}");

    let want = whole(&r);
    let all = store.all_events(id).await.unwrap();
    let done_at = all
        .iter()
        .position(|e| e.type_name() == "execution_done")
        .unwrap();
    assert_eq!(detail(&all[done_at]), want);
    let done_seq = all[done_at].seq;
    // Pages that hold the execution_done but not its messages.
    let query = |after, limit, channels: &[&str], types: &[&str]| EventQuery {
        after,
        limit,
        channels: channels.iter().map(|c| c.to_string()).collect(),
        types: types.iter().map(|t| t.to_string()).collect(),
    };
    for q in [
        query(0, 10, &[], &["execution_done"]),
        query(0, 10, &["broker"], &[]),
        query(done_seq - 1, 1, &[], &[]),
        query(3, 100, &[], &[]),
        query(0, 100, &[], &[]),
    ] {
        let page = store.events(id, q.clone()).await.unwrap();
        let done = page
            .events
            .iter()
            .find(|e| e.type_name() == "execution_done")
            .unwrap_or_else(|| panic!("{q:?}"));
        assert_eq!(detail(done), want, "{q:?}");
    }

    // The cell (what a replay compares with) and the notebook see what the session answered.
    let cells = cells(&all);
    assert_eq!(cells.len(), 1);
    assert_eq!(cells[0].execution.as_ref(), Some(x));
    let png = x.results[0].data["image/png"].as_str().unwrap();
    assert_eq!(
        cells[0].execution.as_ref().unwrap().results[0].data["image/png"],
        png
    );
    let info = store.info(id).await.unwrap().unwrap();
    let nb = notebook(&info, &all);
    assert_eq!(
        nb["cells"][0]["metadata"]["kernel_broker"],
        json!({"status": "error", "duration_ms": 31.25})
    );
    store.close().await;
}

async fn an_execution_whose_reports_were_lost_is_stored_whole(backend: Backend) {
    let store = open_store(backend, |_| {}).await;
    let id = Uuid::new_v4();
    let k = key(id);
    let r = run("x");
    // The queue dropped a report of the session while the execution ran: the writer hears
    // of it (a `recording_gap` before the next report) and stores the execution whole.
    report(&store, &k, &r, || {
        store.gaps.lock().unwrap().insert(id, 1);
        store.gaps_pending.store(1, Ordering::Release);
    });
    store.flush().await;
    assert_eq!(stored_once(&store).await, Some(0));
    let all = store.all_events(id).await.unwrap();
    let t = types(&all);
    assert_eq!(t[t.len() - 2..], ["recording_gap", "execution_done"]);
    assert_eq!(detail(all.last().unwrap()), whole(&r));
    // The next execution, wholly recorded, is stored once.
    let next = run("y");
    report(&store, &k, &next, || {});
    store.flush().await;
    assert_eq!(stored_once(&store).await, Some(1));
    let all = store.all_events(id).await.unwrap();
    assert_eq!(detail(all.last().unwrap()), whole(&next));
    store.close().await;
}
