//! The notebook export's pure transforms as tables (`check(events, expect)`): recorded
//! events in, the timeline (cells, outputs, markers) or the notebook's cells out, each as
//! a short text to compare. This file has the fixtures; `timeline` and `nbformat` the
//! cases.

mod nbformat;
mod timeline;

use chrono::DateTime;
use serde_json::{json, Value};

use super::*;
use crate::recording::{RecordedEvent, RecordedKind};
use crate::session::{Direction, LifecycleEvent};

fn msg(
    seq: i64,
    direction: Direction,
    channel: &str,
    msg_type: &str,
    msg_id: &str,
    parent: Option<&str>,
    content: Value,
) -> RecordedEvent {
    RecordedEvent {
        seq,
        time: DateTime::from_timestamp(1_700_000_000 + seq, 0).unwrap(),
        kind: RecordedKind::Message {
            direction,
            channel: channel.into(),
            msg_type: msg_type.into(),
            msg_id: msg_id.into(),
            parent_msg_id: parent.map(str::to_string),
            header: "{}".into(),
            parent_header: "{}".into(),
            metadata: "{}".into(),
            content: content.to_string(),
            buffers: Vec::new(),
        },
    }
}

fn broker(seq: i64, kind: &str, detail: Value) -> RecordedEvent {
    RecordedEvent {
        seq,
        time: DateTime::from_timestamp(1_700_000_000 + seq, 0).unwrap(),
        kind: RecordedKind::Broker {
            kind: kind.into(),
            detail: detail.to_string(),
        },
    }
}

fn iopub(seq: i64, msg_type: &str, parent: &str, content: Value) -> RecordedEvent {
    msg(
        seq,
        Direction::FromKernel,
        "iopub",
        msg_type,
        &format!("m{seq}"),
        Some(parent),
        content,
    )
}

fn recording() -> Vec<RecordedEvent> {
    use Direction::*;
    vec![
        broker(1, "session_created", json!({})),
        msg(
            2,
            ToKernel,
            "shell",
            "execute_request",
            "a",
            None,
            json!({"code": "print(1)\nprint(2)", "silent": false}),
        ),
        broker(
            3,
            "execution_started",
            json!({"msg_id": "a", "code": "print(1)\nprint(2)", "timeout_seconds": 30.0}),
        ),
        iopub(
            4,
            "execute_input",
            "a",
            json!({"code": "", "execution_count": 1}),
        ),
        iopub(5, "stream", "a", json!({"name": "stdout", "text": "1\n"})),
        iopub(6, "stream", "a", json!({"name": "stdout", "text": "2\n"})),
        iopub(7, "stream", "a", json!({"name": "stderr", "text": "w\n"})),
        iopub(
            8,
            "display_data",
            "a",
            json!({"data": {"image/png": "iVBO", "text/plain": "<Figure>"}, "metadata": {}, "transient": {"display_id": "d1"}}),
        ),
        iopub(
            9,
            "update_display_data",
            "a",
            json!({"data": {"text/plain": "updated"}, "metadata": {}, "transient": {"display_id": "d1"}}),
        ),
        msg(
            10,
            FromKernel,
            "shell",
            "execute_reply",
            "r",
            Some("a"),
            json!({"status": "ok", "execution_count": 1}),
        ),
        broker(
            11,
            "execution_done",
            json!({"msg_id": "a", "execution": {"status": "ok", "execution_count": 1, "stdout": "1\n2\n", "stderr": "w\n", "results": [], "error": null, "truncated": false, "duration_ms": 3.5}}),
        ),
        // A silent request (a frontend's introspection) is no cell.
        msg(
            12,
            ToKernel,
            "shell",
            "execute_request",
            "s",
            None,
            json!({"code": "x", "silent": true}),
        ),
        msg(
            13,
            ToKernel,
            "shell",
            "execute_request",
            "b",
            None,
            json!({"code": "1/0"}),
        ),
        iopub(
            14,
            "error",
            "b",
            json!({"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": ["\u{1b}[0;31mZeroDivisionError\u{1b}[0m"]}),
        ),
        msg(
            15,
            FromKernel,
            "shell",
            "execute_reply",
            "r2",
            Some("b"),
            json!({"status": "error", "execution_count": 2}),
        ),
        broker(16, "kernel_restarted", json!({"reason": "by request"})),
        msg(
            17,
            ToKernel,
            "shell",
            "execute_request",
            "c",
            None,
            json!({"code": "'x'"}),
        ),
        iopub(18, "stream", "c", json!({"name": "stdout", "text": "gone"})),
        iopub(19, "clear_output", "c", json!({"wait": true})),
        iopub(
            20,
            "execute_result",
            "c",
            json!({"data": {"text/plain": "'x'"}, "metadata": {}, "execution_count": 1}),
        ),
    ]
}

/// A recording written in order: each event gets the next `seq` (and second).
#[derive(Default)]
struct Rec(Vec<RecordedEvent>);

impl Rec {
    fn seq(&self) -> i64 {
        self.0.len() as i64 + 1
    }

    fn request(self, id: &str, code: &str) -> Self {
        self.execute_request(id, code, false)
    }

    fn silent(self, id: &str, code: &str) -> Self {
        self.execute_request(id, code, true)
    }

    fn execute_request(mut self, id: &str, code: &str, silent: bool) -> Self {
        let content = json!({"code": code, "silent": silent});
        let e = msg(
            self.seq(),
            Direction::ToKernel,
            "shell",
            "execute_request",
            id,
            None,
            content,
        );
        self.0.push(e);
        self
    }

    fn iopub(mut self, msg_type: &str, parent: &str, content: Value) -> Self {
        let e = iopub(self.seq(), msg_type, parent, content);
        self.0.push(e);
        self
    }

    fn stream(self, parent: &str, name: &str, text: &str) -> Self {
        self.iopub("stream", parent, json!({"name": name, "text": text}))
    }

    fn display(self, msg_type: &str, parent: &str, id: Option<&str>, text: &str) -> Self {
        let transient = id.map_or(json!({}), |id| json!({"display_id": id}));
        let content = json!({"data": {"text/plain": text}, "metadata": {}, "transient": transient});
        self.iopub(msg_type, parent, content)
    }

    fn reply(mut self, parent: &str, status: &str, count: u64) -> Self {
        let content = json!({"status": status, "execution_count": count});
        let e = msg(
            self.seq(),
            Direction::FromKernel,
            "shell",
            "execute_reply",
            "r",
            Some(parent),
            content,
        );
        self.0.push(e);
        self
    }

    fn broker(mut self, kind: &str, detail: Value) -> Self {
        let e = broker(self.seq(), kind, detail);
        self.0.push(e);
        self
    }

    /// An event as the session reports it, stored as the recording stores it.
    fn event(self, event: LifecycleEvent) -> Self {
        let event = StoredEvent::from(event);
        self.broker(event.kind(), event.detail())
    }

    fn cut(self, kind: &str, id: &str) -> Self {
        self.broker(
            kind,
            json!({"msg_id": id, "recording_truncated": true, "bytes": 9}),
        )
    }
}

/// An agent's Execution, as `execution_done` carries it.
fn execution(status: &str, count: u64) -> Execution {
    serde_json::from_value(json!({
        "status": status, "execution_count": count, "stdout": "", "stderr": "", "results": [],
        "error": null, "truncated": false, "duration_ms": 1.0,
    }))
    .unwrap()
}

/// The timeline as text: a line per cell (index, msg_id, code, then what is known of
/// it), one per output, one per marker.
fn summary(entries: &[Entry]) -> String {
    let mut out = String::new();
    for entry in entries {
        match entry {
            Entry::Cell(c) => {
                out.push_str(&format!("cell {} {} {:?}", c.index, c.msg_id, c.code));
                if let Some(n) = c.execution_count {
                    out.push_str(&format!(" #{n}"));
                }
                if let Some(s) = &c.reply_status {
                    out.push_str(&format!(" reply={s}"));
                }
                if let Some(t) = c.timeout_seconds {
                    out.push_str(&format!(" timeout={t}"));
                }
                if c.timed_out {
                    out.push_str(" timed_out");
                }
                if c.input_at.is_some() {
                    out.push_str(" input");
                }
                if c.finished_at.is_some() {
                    out.push_str(" finished");
                }
                if let Some(x) = &c.execution {
                    out.push_str(&format!(" agent={}", json!(x.status).as_str().unwrap()));
                }
                out.push('\n');
                for o in &c.outputs {
                    let line = match o["output_type"].as_str().unwrap() {
                        "stream" => format!(
                            "stream {} {:?}",
                            o["name"].as_str().unwrap(),
                            o["text"].as_str().unwrap()
                        ),
                        "error" => format!(
                            "error {}: {} {}",
                            o["ename"].as_str().unwrap(),
                            o["evalue"].as_str().unwrap(),
                            o["traceback"]
                        ),
                        "execute_result" => format!(
                            "execute_result #{} {} {}",
                            o["execution_count"], o["data"], o["metadata"]
                        ),
                        t => format!("{t} {} {}", o["data"], o["metadata"]),
                    };
                    out.push_str(&format!("  {line}\n"));
                }
            }
            Entry::Marker(m) => {
                out.push_str(&format!("marker {}", m.kind()));
                if !m.reason().is_empty() {
                    out.push_str(&format!(": {}", m.reason()));
                }
                out.push('\n');
            }
        }
    }
    out
}

/// Builds the timeline of each case and compares its summary; every mismatch is listed.
fn check(cases: Vec<(&str, Rec, &str)>) {
    let mut wrong = Vec::new();
    for (name, rec, expect) in cases {
        let got = summary(&timeline(&rec.0));
        if got != expect {
            wrong.push(format!("{name}:\n--- got\n{got}--- want\n{expect}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

fn markers() -> Rec {
    Rec::default()
        .event(LifecycleEvent::SessionCreated { kernel: "python3".into(), idle_timeout_seconds: Some(60) , provenance: Default::default(), forked_from: None, own_workspace: false })
        .event(LifecycleEvent::Interrupt)
        .event(LifecycleEvent::KernelRestarted { reason: "by request".into() })
        .event(LifecycleEvent::KernelDied { reason: "out of memory".into() })
        .broker(
            "recording_gap",
            json!({"dropped": 3, "reason": "the writer fell behind"}),
        )
        .broker(
            "recording_truncated",
            json!({"scope": "execution", "msg_id": "a", "limit_bytes": 10, "dropped_messages": 2, "dropped_bytes": 30, "reason": "over its cap"}),
        )
        .event(LifecycleEvent::SessionExpired)
        .event(LifecycleEvent::SessionClosed { by: crate::session::EndedBy::Client(crate::session::FrontDoor::Rest) })
        .broker("broker_stopped", json!({"reason": "killed"}))
        .broker("from_the_future", json!({"reason": "?"}))
}
