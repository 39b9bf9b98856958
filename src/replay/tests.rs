//! Replay's pure transforms as tables (`check(input, expect)`): normalisation, the
//! rendered form of a cell's output, comparison, and outputs read like executions.

use serde_json::{json, Value};

use super::*;
use crate::session::Execution;

/// Normalises each input and compares with its expected text; every mismatch is listed.
fn check(cases: &[(&str, &str)]) {
    let wrong: Vec<String> = cases
        .iter()
        .filter(|(input, expect)| normalise(input) != *expect)
        .map(|(input, expect)| {
            format!(
                "normalise({input:?})\n   got {:?}\n  want {expect:?}",
                normalise(input)
            )
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn normalisation_rules() {
    let cases = [
        // Addresses (rule 3).
        (
            "<object object at 0x7f3a2c1b9e80>",
            "<object object at 0x<addr>>",
        ),
        ("<Foo at 0x7FFF2C1B9E80>", "<Foo at 0x<addr>>"),
        ("0x10 stays", "0x10 stays"),
        ("0x12345 stays, 0x123456 not", "0x12345 stays, 0x<addr> not"),
        // Large integers and epoch times (rule 6).
        ("140234567890123\n", "<number>\n"),
        ("0.8444218515250481", "0.8444218515250481"),
        ("42", "42"),
        ("t=1718000000.123", "t=<timestamp>"),
        ("1718000000", "<timestamp>"),
        ("1499999999 and 2100000000", "1499999999 and 2100000000"),
        ("ms=1718000000123", "ms=<number>"),
        ("12345678901", "12345678901"),
        ("123456789012.5", "123456789012.5"),
        ("3 items in 2 sets", "3 items in 2 sets"),
        // Durations (rule 5).
        (
            "took 1.23 s and 123 ms, 5µs, 3 minutes",
            "took <duration> and <duration>, <duration>, <duration>",
        ),
        ("Wall time: 12.5ms", "Wall time: <duration>"),
        (
            "1 second, 2 secs, 10 us, 5ns, 1 min",
            "<duration>, <duration>, <duration>, <duration>, <duration>",
        ),
        ("3 steps", "3 steps"),
        // UUIDs (rule 1).
        ("id 3f2b8c1e-9a4d-4e6f-8b2a-1c3d5e7f9a0b", "id <uuid>"),
        ("ID 3F2B8C1E-9A4D-4E6F-8B2A-1C3D5E7F9A0B.", "ID <uuid>."),
        // Dates and times (rule 2).
        ("at 2024-05-01T12:03:04.123456+00:00.", "at <datetime>."),
        ("2024-05-01 12:03:04", "<datetime>"),
        ("2024-05-01T12:03Z", "<datetime>"),
        ("on 2024-05-01", "on <date>"),
        ("at 12:03:04.5", "at <time>"),
        ("01/05/2024 stays", "01/05/2024 stays"),
        // Temporary files (rule 4).
        ("wrote /tmp/tmpab3k_9xz/out.csv", "wrote <tmp>"),
        ("file tmpab3k_9xz.txt", "file <tmp>.txt"),
        ("'/var/tmp/x.log'", "'<tmp>'"),
        ("(/dev/shm/seg)", "(<tmp>)"),
        ("/private/var/folders/ab/T/x.txt: ok", "<tmp>: ok"),
        ("/home/alice/data.csv", "/home/alice/data.csv"),
        // Rules apply in order: a date inside a temporary path goes first, and the path
        // then ends at its `>` (the same on both sides, so it still compares equal).
        ("/tmp/run-2024-05-01/x", "<tmp>>/x"),
    ];
    check(&cases);
}

/// Renders `observed` and compares with `expect`.
fn check_render(observed: Observed, expect: &str) {
    assert_eq!(render(&observed), expect, "render({observed:?})");
}

#[test]
fn rendered_outputs() {
    let png = |n: usize| Value::String("A".repeat(n));
    let cases = [
        (Observed::default(), ""),
        (
            Observed {
                stdout: "at 0x7f3a2c1b9e80".into(),
                stderr: "warn".into(),
                ..Default::default()
            },
            "--- stdout\nat 0x<addr>\n--- stderr\nwarn\n",
        ),
        (
            Observed {
                results: vec![
                    (
                        false,
                        json!({"text/plain": ["a", "b\n"], "image/png": png(40), "image/svg+xml": "<svg/>", "text/html": "<b>"}),
                    ),
                    (true, json!({"text/plain": 7})),
                ],
                ..Default::default()
            },
            "--- display\nimage/png: <1 KB\nimage/svg+xml: present\ntext/html: present\ntext/plain:\nab\n--- result\ntext/plain:\n7\n",
        ),
        (
            Observed {
                results: vec![(false, json!({"image/jpeg": png(2_000_000)}))],
                error: Some(("E".into(), "at 12:03:04".into())),
                ..Default::default()
            },
            "--- display\nimage/jpeg: >1 MB\n--- error\nE: at <time>\n",
        ),
    ];
    for (observed, expect) in cases {
        check_render(observed, expect);
    }
}

#[test]
fn image_size_classes() {
    let cases = [
        (0, "<1 KB"),
        (1_332, "<1 KB"),
        (1_336, "1-10 KB"),
        (13_336, "10-100 KB"),
        (133_336, "100 KB-1 MB"),
        (1_333_336, ">1 MB"),
    ];
    for (len, expect) in cases {
        assert_eq!(normalise::size_class(&"A".repeat(len)), expect, "{len}");
    }
}

#[test]
fn executions_are_observed_as_they_were_answered() {
    let x: Execution = serde_json::from_value(json!({
        "status": "error", "execution_count": 3, "stdout": "o", "stderr": "e",
        "results": [{"data": {"text/plain": "1"}, "metadata": {}, "is_main_result": true}],
        "error": {"ename": "E", "evalue": "v", "traceback": ["tb"]},
        "truncated": false, "duration_ms": 1.0,
    }))
    .unwrap();
    assert_eq!(
        Observed::of_execution(&x),
        Observed {
            stdout: "o".into(),
            stderr: "e".into(),
            results: vec![(true, json!({"text/plain": "1"}))],
            error: Some(("E".into(), "v".into())),
        }
    );
}

fn exec(stdout: &str, results: Vec<(bool, Value)>, error: Option<(&str, &str)>) -> Observed {
    Observed {
        stdout: stdout.into(),
        stderr: String::new(),
        results,
        error: error.map(|(a, b)| (a.into(), b.into())),
    }
}

#[test]
fn comparisons() {
    let png = |n: usize| Value::String("A".repeat(n));
    let same = [
        (exec("a\n", vec![], None), exec("a\n", vec![], None)),
        (
            exec(
                "",
                vec![(true, json!({"text/plain": "140234567890123"}))],
                None,
            ),
            exec(
                "",
                vec![(true, json!({"text/plain": "139876543210987"}))],
                None,
            ),
        ),
        (
            exec(
                "",
                vec![(
                    false,
                    json!({"image/png": png(40_000), "text/plain": "<Figure size 640x480 with 1 Axes>"}),
                )],
                None,
            ),
            exec(
                "",
                vec![(
                    false,
                    json!({"image/png": png(44_000), "text/plain": "<Figure size 640x480 with 1 Axes>"}),
                )],
                None,
            ),
        ),
        (
            exec("", vec![], Some(("KeyError", "'x'"))),
            exec("", vec![], Some(("KeyError", "'x'"))),
        ),
    ];
    for (a, b) in same {
        assert_eq!(compare(&a, &b), (true, String::new()));
    }
    let different = [
        (
            exec(
                "",
                vec![(true, json!({"text/plain": "0.8444218515250481"}))],
                None,
            ),
            exec(
                "",
                vec![(true, json!({"text/plain": "0.7579544029403025"}))],
                None,
            ),
            "-0.8444218515250481",
        ),
        (exec("a\n", vec![], None), exec("b\n", vec![], None), "+b"),
        (
            exec("", vec![(false, json!({"image/png": png(400)}))], None),
            exec("", vec![(false, json!({"image/png": png(40_000)}))], None),
            "+image/png: 10-100 KB",
        ),
        (
            exec("", vec![], None),
            exec("", vec![], Some(("NameError", "name 'x' is not defined"))),
            "+NameError",
        ),
    ];
    for (a, b, needle) in different {
        let (same, diff) = compare(&a, &b);
        assert!(!same);
        assert!(
            diff.contains("--- recorded") && diff.contains("+++ replayed"),
            "{diff}"
        );
        assert!(diff.contains(needle), "{needle} not in\n{diff}");
    }
}

#[test]
fn outputs_are_observed_like_executions() {
    let outputs = vec![
        json!({"output_type": "stream", "name": "stdout", "text": "abcdef"}),
        json!({"output_type": "stream", "name": "stderr", "text": "w"}),
        json!({"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {}, "execution_count": 1}),
        json!({"output_type": "error", "ename": "E", "evalue": "v", "traceback": []}),
    ];
    let o = Observed::of_outputs(&outputs, 3);
    assert_eq!(o.stdout, "abc");
    assert_eq!(o.stderr, "w");
    assert_eq!(o.results, vec![(true, json!({"text/plain": "1"}))]);
    assert_eq!(o.error, Some(("E".into(), "v".into())));
}

/// A recording as the broker stored it before the recording had its own stored types: each
/// broker event's `kind` and `detail` text exactly as written then (an `execution_started`
/// from before `queue_wait_seconds`, the Execution inside `execution_done`), with the
/// kernel's messages around them.
fn previous_form_recording() -> Vec<crate::recording::RecordedEvent> {
    use crate::recording::{RecordedEvent, RecordedKind};
    use crate::session::Direction;
    let time = |seq: i64| chrono::DateTime::from_timestamp(1_700_000_000 + seq, 0).unwrap();
    let broker = |seq: i64, kind: &str, detail: &str| RecordedEvent {
        seq,
        time: time(seq),
        kind: RecordedKind::Broker {
            kind: kind.into(),
            detail: detail.into(),
        },
    };
    let message = |seq: i64,
                   direction,
                   channel: &str,
                   msg_type: &str,
                   parent: Option<&str>,
                   content: &str| {
        RecordedEvent {
            seq,
            time: time(seq),
            kind: RecordedKind::Message {
                direction,
                channel: channel.into(),
                msg_type: msg_type.into(),
                msg_id: if parent.is_none() {
                    format!("req{seq}")
                } else {
                    format!("k{seq}")
                },
                parent_msg_id: parent.map(str::to_string),
                header: "{}".into(),
                parent_header: "{}".into(),
                metadata: "{}".into(),
                content: content.into(),
                buffers: Vec::new(),
            },
        }
    };
    use Direction::{FromKernel, ToKernel};
    vec![
        broker(
            1,
            "session_created",
            r#"{"kernel":"python3","idle_timeout_seconds":3600}"#,
        ),
        message(
            2,
            ToKernel,
            "shell",
            "execute_request",
            None,
            r#"{"code":"import math\nprint(math.pi)\nmath.e","silent":false,"store_history":true}"#,
        ),
        broker(
            3,
            "execution_started",
            r#"{"msg_id":"req2","code":"import math\nprint(math.pi)\nmath.e","timeout_seconds":30.0}"#,
        ),
        message(
            4,
            FromKernel,
            "iopub",
            "status",
            Some("req2"),
            r#"{"execution_state":"busy"}"#,
        ),
        message(
            5,
            FromKernel,
            "iopub",
            "execute_input",
            Some("req2"),
            r#"{"code":"import math\nprint(math.pi)\nmath.e","execution_count":1}"#,
        ),
        message(
            6,
            FromKernel,
            "iopub",
            "stream",
            Some("req2"),
            r#"{"name":"stdout","text":"3.141592653589793\n"}"#,
        ),
        message(
            7,
            FromKernel,
            "iopub",
            "display_data",
            Some("req2"),
            r#"{"data":{"image/png":"iVBORw0KGgo=","text/plain":"<Figure size 640x480 with 1 Axes>"},"metadata":{},"transient":{}}"#,
        ),
        message(
            8,
            FromKernel,
            "iopub",
            "execute_result",
            Some("req2"),
            r#"{"data":{"text/plain":"2.718281828459045"},"metadata":{},"execution_count":1}"#,
        ),
        message(
            9,
            FromKernel,
            "shell",
            "execute_reply",
            Some("req2"),
            r#"{"status":"ok","execution_count":1,"user_expressions":{},"payload":[]}"#,
        ),
        message(
            10,
            FromKernel,
            "iopub",
            "status",
            Some("req2"),
            r#"{"execution_state":"idle"}"#,
        ),
        broker(
            11,
            "execution_done",
            concat!(
                r#"{"msg_id":"req2","execution":{"status":"ok","execution_count":1,"#,
                r#""stdout":"3.141592653589793\n","stderr":"","results":["#,
                r#"{"data":{"image/png":"iVBORw0KGgo=","text/plain":"<Figure size 640x480 with 1 Axes>"},"metadata":{},"is_main_result":false},"#,
                r#"{"data":{"text/plain":"2.718281828459045"},"metadata":{},"is_main_result":true}],"#,
                r#""error":null,"truncated":false,"duration_ms":12.5}}"#
            ),
        ),
        message(
            12,
            ToKernel,
            "shell",
            "execute_request",
            None,
            r#"{"code":"1/0","silent":false}"#,
        ),
        broker(
            13,
            "execution_started",
            r#"{"msg_id":"req12","code":"1/0","timeout_seconds":30.0,"queue_wait_seconds":0.001}"#,
        ),
        message(
            14,
            FromKernel,
            "iopub",
            "error",
            Some("req12"),
            r#"{"ename":"ZeroDivisionError","evalue":"division by zero","traceback":["\u001b[0;31mZeroDivisionError\u001b[0m: division by zero"]}"#,
        ),
        message(
            15,
            FromKernel,
            "shell",
            "execute_reply",
            Some("req12"),
            r#"{"status":"error","execution_count":2,"ename":"ZeroDivisionError","evalue":"division by zero","traceback":[]}"#,
        ),
        broker(
            16,
            "execution_done",
            concat!(
                r#"{"msg_id":"req12","execution":{"status":"error","execution_count":2,"stdout":"","stderr":"","results":[],"#,
                r#""error":{"ename":"ZeroDivisionError","evalue":"division by zero","traceback":["ZeroDivisionError: division by zero"]},"#,
                r#""truncated":false,"duration_ms":3.0}}"#
            ),
        ),
        broker(
            17,
            "egress_allowed",
            r#"{"method":"CONNECT","host":"pypi.org","port":443,"address":"151.101.0.223:443"}"#,
        ),
        broker(18, "kernel_restarted", r#"{"reason":"restart requested"}"#),
        broker(19, "session_closed", "{}"),
    ]
}

/// What an earlier broker stored still reads back typed, exports as a notebook and replays.
#[test]
fn a_recording_in_the_previous_stored_form_reads_exports_and_replays() {
    use crate::recording::event::BrokerEvent;
    use crate::recording::notebook::{cells, notebook, timeline, Entry};
    use crate::recording::stored::StoredEvent;
    use crate::recording::{RecordedKind, RecordingInfo};

    let events = previous_form_recording();
    // Every broker event reads back typed, none as unreadable.
    for e in &events {
        if let RecordedKind::Broker { kind, detail } = &e.kind {
            let event = BrokerEvent::parse(kind, detail);
            assert!(
                matches!(event, BrokerEvent::Session(_)),
                "{kind}: {event:?}"
            );
            assert_eq!(event.kind(), kind);
        }
    }
    assert_eq!(
        BrokerEvent::parse(
            "execution_started",
            r#"{"msg_id":"req2","code":"x","timeout_seconds":30.0}"#
        ),
        BrokerEvent::Session(StoredEvent::ExecutionStarted {
            msg_id: "req2".into(),
            code: "x".into(),
            timeout_seconds: 30.0,
            queue_wait_seconds: 0.0,
        })
    );

    // The timeline: two cells with their Executions, then the restart.
    let entries = timeline(&events);
    assert_eq!(entries.len(), 3);
    assert!(matches!(&entries[2], Entry::Marker(m) if m.kind() == "kernel_restarted"));
    let cells = cells(&events);
    let [a, b] = &cells[..] else {
        panic!("{cells:?}")
    };
    assert_eq!(a.code, "import math\nprint(math.pi)\nmath.e");
    assert_eq!(a.execution_count, Some(1));
    assert_eq!(a.timeout_seconds, Some(30.0));
    let x = a.execution.as_ref().unwrap();
    assert_eq!(x.status, ExecutionStatus::Ok);
    assert_eq!(x.stdout, "3.141592653589793\n");
    assert_eq!(x.results.len(), 2);
    assert!(x.results[1].is_main_result);
    assert_eq!(x.duration_ms, 12.5);
    assert_eq!(a.outputs.len(), 3);
    let y = b.execution.as_ref().unwrap();
    assert_eq!(y.status, ExecutionStatus::Error);
    assert_eq!(y.error.as_ref().unwrap().ename, "ZeroDivisionError");

    // The notebook.
    let info = RecordingInfo {
        id: uuid::Uuid::nil(),
        user: "alice".into(),
        kernel: "python3".into(),
        created_at: chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
        ended_at: None,
        end_reason: Some("closed".into()),
        cells: 2,
        events: events.len() as u64,
        last_event_at: None,
    };
    let nb = notebook(&info, &events);
    let nb_cells = nb["cells"].as_array().unwrap();
    assert_eq!(nb_cells.len(), 3);
    assert_eq!(nb_cells[0]["cell_type"], "code");
    assert_eq!(nb_cells[0]["execution_count"], 1);
    assert_eq!(
        nb_cells[0]["metadata"]["kernel_broker"],
        json!({"status": "ok", "duration_ms": 12.5})
    );
    assert_eq!(nb_cells[0]["outputs"][0]["text"], "3.141592653589793\n");
    assert_eq!(nb_cells[1]["metadata"]["kernel_broker"]["status"], "error");
    assert_eq!(nb_cells[2]["cell_type"], "markdown");

    // Replay: a run that answers what was recorded is the same; another one is not.
    let same = compare_cell(a, x, 1 << 20);
    assert!(same.same_output, "{}", same.diff);
    assert_eq!(same.recorded_status, Some(ExecutionStatus::Ok));
    let mut other = x.clone();
    other.stdout = "3.14\n".into();
    let differs = compare_cell(a, &other, 1 << 20);
    assert!(!differs.same_output);
    assert!(differs.diff.contains("3.14"), "{}", differs.diff);
}
