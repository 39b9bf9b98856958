//! The timeline: cells, their outputs, and markers.

use serde_json::json;

use super::*;

#[test]
fn cells_are_rebuilt_from_messages() {
    let cells = cells(&recording());
    assert_eq!(cells.len(), 3);
    let a = &cells[0];
    assert_eq!(a.code, "print(1)\nprint(2)");
    assert_eq!(a.timeout_seconds, Some(30.0));
    assert_eq!(a.execution_count, Some(1));
    assert_eq!(a.outputs.len(), 3, "{:?}", a.outputs);
    assert_eq!(
        a.outputs[0],
        json!({"output_type": "stream", "name": "stdout", "text": "1\n2\n"})
    );
    assert_eq!(a.outputs[2]["data"], json!({"text/plain": "updated"}));
    assert_eq!(a.execution.as_ref().unwrap().duration_ms, 3.5);
    assert_eq!(cells[1].outputs[0]["ename"], "ZeroDivisionError");
    assert_eq!(cells[1].reply_status.as_deref(), Some("error"));
    assert_eq!(
        cells[2].outputs,
        vec![
            json!({"output_type": "execute_result", "data": {"text/plain": "'x'"}, "metadata": {}, "execution_count": 1})
        ]
    );
    assert_eq!(cells.iter().map(|c| c.index).collect::<Vec<_>>(), [0, 1, 2]);
}

#[test]
fn outputs_of_a_cell() {
    check(vec![
        (
            "consecutive streams of one name merge",
            Rec::default()
                .request("a", "x")
                .stream("a", "stdout", "1\n")
                .stream("a", "stdout", "2\n")
                .stream("a", "stderr", "w\n")
                .stream("a", "stdout", "3\n")
                .stream("a", "weird", "4\n"),
            "cell 0 a \"x\"\n  stream stdout \"1\\n2\\n\"\n  stream stderr \"w\\n\"\n  stream stdout \"3\\n4\\n\"\n",
        ),
        (
            "results, displays and errors in order; mimebundles as nbformat wants them",
            Rec::default()
                .request("a", "x")
                .iopub(
                    "execute_result",
                    "a",
                    json!({"data": {"text/plain": ["a", "b"], "application/json": {"k": 1}, "text/html": 5}, "metadata": {"m": 1}, "execution_count": 4}),
                )
                .iopub("display_data", "a", json!({"data": "not a bundle", "metadata": []}))
                .iopub(
                    "error",
                    "a",
                    json!({"ename": "E", "evalue": "v", "traceback": ["t1", 2]}),
                )
                .iopub("status", "a", json!({"execution_state": "idle"})),
            "cell 0 a \"x\"\n  execute_result #4 {\"application/json\":{\"k\":1},\"text/html\":\"5\",\"text/plain\":[\"a\",\"b\"]} {\"m\":1}\n  display_data {} {}\n  error E: v [\"t1\",\"\"]\n",
        ),
        (
            "clear_output clears at once",
            Rec::default()
                .request("a", "x")
                .stream("a", "stdout", "gone")
                .iopub("clear_output", "a", json!({"wait": false}))
                .stream("a", "stdout", "kept"),
            "cell 0 a \"x\"\n  stream stdout \"kept\"\n",
        ),
        (
            "clear_output with wait clears at the next output",
            Rec::default()
                .request("a", "x")
                .stream("a", "stdout", "gone")
                .iopub("clear_output", "a", json!({"wait": true}))
                .iopub("execute_input", "a", json!({"code": "x", "execution_count": 2}))
                .display("display_data", "a", None, "new"),
            "cell 0 a \"x\" #2 input\n  display_data {\"text/plain\":\"new\"} {}\n",
        ),
        (
            "clear_output with wait and no later output keeps the outputs",
            Rec::default()
                .request("a", "x")
                .stream("a", "stdout", "kept")
                .iopub("clear_output", "a", json!({"wait": true})),
            "cell 0 a \"x\"\n  stream stdout \"kept\"\n",
        ),
        (
            "clear_output with wait only clears its own cell",
            Rec::default()
                .request("a", "x")
                .stream("a", "stdout", "a1")
                .iopub("clear_output", "a", json!({"wait": true}))
                .request("b", "y")
                .stream("b", "stdout", "b1"),
            "cell 0 a \"x\"\n  stream stdout \"a1\"\ncell 1 b \"y\"\n  stream stdout \"b1\"\n",
        ),
    ]);
}

#[test]
fn displays_updated_by_id() {
    check(vec![
        (
            "update_display_data replaces every output of its display_id, in any cell",
            Rec::default()
                .request("a", "x")
                .display("display_data", "a", Some("d1"), "v1")
                .display("display_data", "a", Some("d2"), "other")
                .request("b", "y")
                .display("display_data", "b", Some("d1"), "v1 again")
                .display("update_display_data", "b", Some("d1"), "v2"),
            "cell 0 a \"x\"\n  display_data {\"text/plain\":\"v2\"} {}\n  display_data {\"text/plain\":\"other\"} {}\ncell 1 b \"y\"\n  display_data {\"text/plain\":\"v2\"} {}\n",
        ),
        (
            "an execute_result with a display_id can be updated too",
            Rec::default()
                .request("a", "x")
                .iopub("execute_result", "a", json!({"data": {"text/plain": "1"}, "metadata": {}, "execution_count": 1, "transient": {"display_id": "r"}}))
                .display("update_display_data", "a", Some("r"), "2"),
            "cell 0 a \"x\"\n  execute_result #1 {\"text/plain\":\"2\"} {}\n",
        ),
        (
            "an update of an unknown display, or of none, changes nothing and adds nothing",
            Rec::default()
                .request("a", "x")
                .display("display_data", "a", Some("d1"), "v1")
                .display("update_display_data", "a", Some("nope"), "v2")
                .display("update_display_data", "a", None, "v3"),
            "cell 0 a \"x\"\n  display_data {\"text/plain\":\"v1\"} {}\n",
        ),
    ]);
}

#[test]
fn which_requests_are_cells() {
    check(vec![
        (
            "silent requests, foreign parents and requests from the kernel are no cells",
            Rec::default()
                .silent("s", "introspect")
                .stream("s", "stdout", "hidden")
                .stream("nobody", "stdout", "lost")
                .reply("nobody", "ok", 9),
            "",
        ),
        (
            "execute_reply and execute_input fill the cell",
            Rec::default()
                .request("a", "1/0")
                .iopub(
                    "execute_input",
                    "a",
                    json!({"code": "1/0", "execution_count": 1}),
                )
                .reply("a", "error", 2),
            "cell 0 a \"1/0\" #2 reply=error input finished\n",
        ),
        (
            "an agent execution: its request and execution_started are one cell",
            Rec::default()
                .request("a", "sleep(9)")
                .event(LifecycleEvent::ExecutionStarted {
                    msg_id: "a".into(),
                    code: "sleep(9)".into(),
                    timeout_seconds: 5.0,
                    queue_wait_seconds: 0.0,
                })
                .event(LifecycleEvent::ExecutionTimeout {
                    msg_id: "a".into(),
                    timeout_seconds: 5.0,
                })
                .event(LifecycleEvent::ExecutionDone {
                    msg_id: "a".into(),
                    execution: execution("timeout", 3),
                    output_limit: 10_000,
                    result_limit: 1 << 20,
                }),
            "cell 0 a \"sleep(9)\" #3 timeout=5 timed_out finished agent=timeout\n",
        ),
        (
            "execution_started before its request makes the cell; the request adds none",
            Rec::default()
                .event(LifecycleEvent::ExecutionStarted {
                    msg_id: "a".into(),
                    code: "x".into(),
                    timeout_seconds: 30.0,
                    queue_wait_seconds: 0.0,
                })
                .request("a", "x")
                .request("b", "y"),
            "cell 0 a \"x\" timeout=30\ncell 1 b \"y\"\n",
        ),
        (
            "the execute_reply's count wins over the Execution's",
            Rec::default().request("a", "x").reply("a", "ok", 7).event(
                LifecycleEvent::ExecutionDone {
                    msg_id: "a".into(),
                    execution: execution("ok", 3),
                    output_limit: 10_000,
                    result_limit: 1 << 20,
                },
            ),
            "cell 0 a \"x\" #7 reply=ok finished agent=ok\n",
        ),
    ]);
}

#[test]
fn details_cut_by_the_budget() {
    check(vec![
        (
            "a cut execution_done still ends its cell",
            Rec::default().request("a", "x").cut("execution_done", "a"),
            "cell 0 a \"x\" finished\n",
        ),
        (
            "a cut execution_started still makes a cell, its code unknown",
            Rec::default()
                .cut("execution_started", "a")
                .stream("a", "stdout", "out"),
            "cell 0 a \"\"\n  stream stdout \"out\"\n",
        ),
        (
            "a cut execution_timeout, or a cut event of no cell, changes nothing",
            Rec::default()
                .request("a", "x")
                .cut("execution_timeout", "a")
                .cut("execution_done", "nobody"),
            "cell 0 a \"x\"\n",
        ),
    ]);
}

#[test]
fn session_and_recording_markers() {
    check(vec![(
        "restart, death, expiry, the close (who closed it) and each of the recording's markers; nothing else",
        markers(),
        "marker kernel_restarted: by request\nmarker kernel_died: out of memory\nmarker recording_gap: the writer fell behind\nmarker recording_truncated: over its cap\nmarker session_expired\nmarker session_closed\nmarker broker_stopped: killed\n",
    )]);
}
