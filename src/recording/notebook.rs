//! A recording read back as cells, and exported as an nbformat 4.5 notebook.
//!
//! A code cell is a non-silent `execute_request` sent to the kernel (by an agent's execution
//! or by a notebook frontend), or an `execution_started` event; its outputs are the iopub
//! messages whose parent is that request: streams (consecutive ones of the same name
//! merged), `display_data`, `execute_result`, `error`, with `clear_output` and
//! `update_display_data` applied. Broker events that change the session (restart, death,
//! expiry, timeout, gaps in the recording) become markers, and markdown cells in the
//! notebook. Pure functions over recorded events: no I/O.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde_json::{json, Map, Value};

use super::event::BrokerEvent;
use super::{RecordedEvent, RecordedKind, RecordingInfo};
use crate::session::{Direction, Execution, LifecycleEvent};

/// One code cell of a recording.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedCell {
    /// Position among the code cells, from 0.
    pub index: usize,
    pub msg_id: String,
    pub code: String,
    /// The timeout the execution asked for, when it came through the agent API.
    pub timeout_seconds: Option<f64>,
    pub execution_count: Option<u64>,
    /// nbformat output objects.
    pub outputs: Vec<Value>,
    /// The Execution the agent API answered with, if it did.
    pub execution: Option<Execution>,
    /// `execute_reply` status (`ok`, `error`, `aborted`).
    pub reply_status: Option<String>,
    pub started_at: DateTime<Utc>,
    pub input_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub timed_out: bool,
}

/// A broker event worth showing between cells.
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    /// The stored kind (`kernel_restarted`, `recording_gap`, ...).
    pub kind: &'static str,
    pub time: DateTime<Utc>,
    /// Why, when the event says.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq)]
// Cells are most entries; boxing them would cost an allocation each.
#[allow(clippy::large_enum_variant)]
pub enum Entry {
    Cell(RecordedCell),
    Marker(Marker),
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or(Value::Null)
}

/// The recording as a timeline of code cells and markers.
pub fn timeline(events: &[RecordedEvent]) -> Vec<Entry> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut by_msg: HashMap<String, usize> = HashMap::new();
    let mut clear_pending: HashSet<usize> = HashSet::new();
    // display_id -> (entry, output index)
    let mut displays: HashMap<String, Vec<(usize, usize)>> = HashMap::new();
    let mut cells = 0;
    for e in events {
        match &e.kind {
            RecordedKind::Message {
                direction: Direction::ToKernel,
                channel,
                msg_type,
                msg_id,
                content,
                ..
            } if channel == "shell" && msg_type == "execute_request" => {
                let c = parse(content);
                if c["silent"].as_bool().unwrap_or(false) || by_msg.contains_key(msg_id) {
                    continue;
                }
                let code = c["code"].as_str().unwrap_or("").to_string();
                by_msg.insert(msg_id.clone(), entries.len());
                entries.push(Entry::Cell(new_cell(cells, msg_id, code, e.time)));
                cells += 1;
            }
            RecordedKind::Broker { kind, detail } => {
                match BrokerEvent::parse(kind, detail) {
                    BrokerEvent::Session(LifecycleEvent::ExecutionStarted {
                        msg_id,
                        code,
                        timeout_seconds,
                        ..
                    }) => {
                        started_cell(&mut entries, &mut by_msg, &mut cells, &msg_id, code, e.time);
                        if let Some(c) = cell_of(&mut entries, &by_msg, &msg_id) {
                            c.timeout_seconds = Some(timeout_seconds);
                        }
                    }
                    BrokerEvent::Session(LifecycleEvent::ExecutionDone { msg_id, execution }) => {
                        if let Some(c) = cell_of(&mut entries, &by_msg, &msg_id) {
                            c.finished_at = Some(e.time);
                            if c.execution_count.is_none() {
                                c.execution_count = execution.execution_count;
                            }
                            c.execution = Some(execution);
                        }
                    }
                    BrokerEvent::Session(LifecycleEvent::ExecutionTimeout { msg_id, .. }) => {
                        if let Some(c) = cell_of(&mut entries, &by_msg, &msg_id) {
                            c.timed_out = true;
                        }
                    }
                    BrokerEvent::Session(
                        ev @ (LifecycleEvent::KernelRestarted { .. }
                        | LifecycleEvent::KernelDied { .. }
                        | LifecycleEvent::SessionExpired),
                    ) => {
                        let reason = match &ev {
                            LifecycleEvent::KernelRestarted { reason }
                            | LifecycleEvent::KernelDied { reason } => reason.clone(),
                            _ => String::new(),
                        };
                        entries.push(Entry::Marker(Marker {
                            kind: ev.kind(),
                            time: e.time,
                            reason,
                        }));
                    }
                    BrokerEvent::Session(_) => {}
                    BrokerEvent::Recording(m) => entries.push(Entry::Marker(Marker {
                        kind: m.kind(),
                        time: e.time,
                        reason: m.reason().to_string(),
                    })),
                    // An execution's event whose detail the recording's budget cut: the cell
                    // is still there (with the code unknown) and it still ended.
                    BrokerEvent::Unreadable {
                        kind,
                        msg_id: Some(msg_id),
                    } => match kind.as_str() {
                        "execution_started" => started_cell(
                            &mut entries,
                            &mut by_msg,
                            &mut cells,
                            &msg_id,
                            String::new(),
                            e.time,
                        ),
                        "execution_done" => {
                            if let Some(c) = cell_of(&mut entries, &by_msg, &msg_id) {
                                c.finished_at = Some(e.time);
                            }
                        }
                        _ => {}
                    },
                    BrokerEvent::Unreadable { .. } => {}
                }
            }
            RecordedKind::Message {
                direction: Direction::FromKernel,
                channel,
                msg_type,
                parent_msg_id: Some(parent),
                content,
                ..
            } => {
                let Some(&idx) = by_msg.get(parent) else {
                    continue;
                };
                let Some(Entry::Cell(cell)) = entries.get_mut(idx) else {
                    continue;
                };
                let c = parse(content);
                if channel == "shell" && msg_type == "execute_reply" {
                    cell.reply_status = c["status"].as_str().map(str::to_string);
                    if let Some(n) = c["execution_count"].as_u64() {
                        cell.execution_count = Some(n);
                    }
                    cell.finished_at.get_or_insert(e.time);
                    continue;
                }
                if channel != "iopub" {
                    continue;
                }
                if msg_type == "execute_input" {
                    cell.input_at = Some(e.time);
                    if let Some(n) = c["execution_count"].as_u64() {
                        cell.execution_count = Some(n);
                    }
                    continue;
                }
                if msg_type == "clear_output" {
                    if c["wait"].as_bool().unwrap_or(false) {
                        clear_pending.insert(idx);
                    } else {
                        cell.outputs.clear();
                    }
                    continue;
                }
                if msg_type == "update_display_data" {
                    let Some(did) = c["transient"]["display_id"].as_str() else {
                        continue;
                    };
                    for &(i, o) in displays.get(did).map(Vec::as_slice).unwrap_or(&[]) {
                        if let Some(Entry::Cell(target)) = entries.get_mut(i) {
                            if let Some(out) = target.outputs.get_mut(o) {
                                out["data"] = mimebundle(&c["data"]);
                                out["metadata"] = object(&c["metadata"]);
                            }
                        }
                    }
                    continue;
                }
                let Some(output) = output_of(msg_type, &c) else {
                    continue;
                };
                if clear_pending.remove(&idx) {
                    cell.outputs.clear();
                }
                if let Some(did) = c["transient"]["display_id"].as_str() {
                    displays
                        .entry(did.to_string())
                        .or_default()
                        .push((idx, cell.outputs.len()));
                }
                push_output(&mut cell.outputs, output);
            }
            _ => {}
        }
    }
    entries
}

/// The code cells of a recording, in order.
pub fn cells(events: &[RecordedEvent]) -> Vec<RecordedCell> {
    timeline(events)
        .into_iter()
        .filter_map(|e| match e {
            Entry::Cell(c) => Some(c),
            Entry::Marker(_) => None,
        })
        .collect()
}

fn new_cell(index: usize, msg_id: &str, code: String, time: DateTime<Utc>) -> RecordedCell {
    RecordedCell {
        index,
        msg_id: msg_id.to_string(),
        code,
        timeout_seconds: None,
        execution_count: None,
        outputs: Vec::new(),
        execution: None,
        reply_status: None,
        started_at: time,
        input_at: None,
        finished_at: None,
        timed_out: false,
    }
}

fn object(v: &Value) -> Value {
    match v {
        Value::Object(_) => v.clone(),
        _ => json!({}),
    }
}

/// A mimebundle as nbformat wants it: text values (or lists of them), JSON only for JSON types.
fn mimebundle(v: &Value) -> Value {
    let Value::Object(m) = v else {
        return json!({});
    };
    let mut out = Map::new();
    for (k, v) in m {
        let is_json = k.starts_with("application/") && k.ends_with("json");
        let ok = is_json
            || v.is_string()
            || v.as_array().is_some_and(|a| a.iter().all(Value::is_string));
        out.insert(
            k.clone(),
            if ok {
                v.clone()
            } else {
                Value::String(v.to_string())
            },
        );
    }
    Value::Object(out)
}

fn strings(v: &Value) -> Vec<Value> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| Value::String(s.as_str().unwrap_or("").to_string()))
                .collect()
        })
        .unwrap_or_default()
}

fn output_of(msg_type: &str, c: &Value) -> Option<Value> {
    Some(match msg_type {
        "stream" => json!({
            "output_type": "stream",
            "name": if c["name"] == "stderr" { "stderr" } else { "stdout" },
            "text": c["text"].as_str().unwrap_or(""),
        }),
        "display_data" => json!({
            "output_type": "display_data",
            "data": mimebundle(&c["data"]),
            "metadata": object(&c["metadata"]),
        }),
        "execute_result" => json!({
            "output_type": "execute_result",
            "data": mimebundle(&c["data"]),
            "metadata": object(&c["metadata"]),
            "execution_count": c["execution_count"].as_u64(),
        }),
        "error" => json!({
            "output_type": "error",
            "ename": c["ename"].as_str().unwrap_or(""),
            "evalue": c["evalue"].as_str().unwrap_or(""),
            "traceback": strings(&c["traceback"]),
        }),
        _ => return None,
    })
}

/// Append an output, merging a stream into the previous one of the same name.
fn push_output(outputs: &mut Vec<Value>, output: Value) {
    if output["output_type"] == "stream" {
        if let Some(last) = outputs.last_mut() {
            if last["output_type"] == "stream" && last["name"] == output["name"] {
                let text = format!(
                    "{}{}",
                    last["text"].as_str().unwrap_or(""),
                    output["text"].as_str().unwrap_or("")
                );
                last["text"] = Value::String(text);
                return;
            }
        }
    }
    outputs.push(output);
}

/// A cell id nbformat 4.5 accepts (`^[a-zA-Z0-9-_]+$`, 1 to 64 characters), unique.
fn cell_id(seed: &str, used: &mut HashSet<String>) -> String {
    let mut id: String = seed
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(64)
        .collect();
    if id.is_empty() || used.contains(&id) {
        id = format!("cell-{}", used.len());
        while used.contains(&id) {
            id.push('x');
        }
    }
    used.insert(id.clone());
    id
}

fn iso(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The cell of an execution, by its `execute_request`'s msg_id.
fn cell_of<'a>(
    entries: &'a mut [Entry],
    by_msg: &HashMap<String, usize>,
    msg_id: &str,
) -> Option<&'a mut RecordedCell> {
    match entries.get_mut(*by_msg.get(msg_id)?) {
        Some(Entry::Cell(c)) => Some(c),
        _ => None,
    }
}

/// Adds the cell of an agent execution unless its `execute_request` made it already.
fn started_cell(
    entries: &mut Vec<Entry>,
    by_msg: &mut HashMap<String, usize>,
    cells: &mut usize,
    msg_id: &str,
    code: String,
    time: DateTime<Utc>,
) {
    if by_msg.contains_key(msg_id) {
        return;
    }
    by_msg.insert(msg_id.to_string(), entries.len());
    entries.push(Entry::Cell(new_cell(*cells, msg_id, code, time)));
    *cells += 1;
}

fn marker_text(m: &Marker) -> String {
    let reason = m.reason.as_str();
    let what = match m.kind {
        "kernel_restarted" => "The kernel was restarted",
        "kernel_died" => "The kernel died",
        "session_expired" => "The session expired",
        "broker_stopped" => "The broker stopped",
        "recording_gap" => "Part of the recording is missing",
        "recording_truncated" => "Output of a cell was cut in the recording",
        other => other,
    };
    let mut s = format!("*[kernel-broker, {}] {what}", iso(m.time));
    if !reason.is_empty() {
        s.push_str(": ");
        s.push_str(reason);
    }
    s.push('*');
    s
}

/// The recording as an nbformat 4.5 notebook.
pub fn notebook(info: &RecordingInfo, events: &[RecordedEvent]) -> Value {
    let mut used = HashSet::new();
    let mut nb_cells = Vec::new();
    for entry in timeline(events) {
        match entry {
            Entry::Cell(c) => {
                let mut timing = Map::new();
                if let Some(t) = c.input_at {
                    timing.insert("iopub.execute_input".into(), Value::String(iso(t)));
                }
                if let Some(t) = c.finished_at {
                    timing.insert("shell.execute_reply".into(), Value::String(iso(t)));
                }
                let mut meta = Map::new();
                if !timing.is_empty() {
                    meta.insert("execution".into(), Value::Object(timing));
                }
                if let Some(x) = &c.execution {
                    meta.insert(
                        "kernel_broker".into(),
                        json!({"status": x.status, "duration_ms": x.duration_ms}),
                    );
                }
                nb_cells.push(json!({
                    "cell_type": "code",
                    "id": cell_id(&c.msg_id, &mut used),
                    "metadata": meta,
                    "execution_count": c.execution_count,
                    "source": c.code,
                    "outputs": c.outputs,
                }));
            }
            Entry::Marker(m) => {
                nb_cells.push(json!({
                    "cell_type": "markdown",
                    "id": cell_id("", &mut used),
                    "metadata": {"kernel_broker": {"event": m.kind}},
                    "source": marker_text(&m),
                }));
            }
        }
    }
    let language_info = events
        .iter()
        .find_map(|e| match &e.kind {
            RecordedKind::Message {
                direction: Direction::FromKernel,
                msg_type,
                content,
                ..
            } if msg_type == "kernel_info_reply" => {
                let v = parse(content);
                v["language_info"]
                    .is_object()
                    .then(|| v["language_info"].clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| json!({"name": "python"}));
    let language = language_info["name"]
        .as_str()
        .unwrap_or("python")
        .to_string();
    let display_name = if info.kernel == "python3" {
        "Python 3 (ipykernel)".to_string()
    } else {
        info.kernel.clone()
    };
    json!({
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": info.kernel, "display_name": display_name, "language": language},
            "language_info": language_info,
            "kernel_broker": {
                "session_id": info.id,
                "user": info.user,
                "created_at": iso(info.created_at),
                "ended_at": info.ended_at.map(iso),
                "end_reason": info.end_reason,
            },
        },
        "cells": nb_cells,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

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
    fn notebook_has_cells_markers_and_metadata() {
        let info = RecordingInfo {
            id: Uuid::nil(),
            user: "alice".into(),
            kernel: "python3".into(),
            created_at: DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            ended_at: None,
            end_reason: None,
            cells: 3,
            events: 20,
            last_event_at: None,
        };
        let nb = notebook(&info, &recording());
        assert_eq!(nb["nbformat"], 4);
        assert_eq!(nb["nbformat_minor"], 5);
        assert_eq!(nb["metadata"]["kernelspec"]["name"], "python3");
        let cells = nb["cells"].as_array().unwrap();
        let types: Vec<&str> = cells
            .iter()
            .map(|c| c["cell_type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["code", "code", "markdown", "code"]);
        assert_eq!(cells[0]["id"], "a");
        assert!(cells[2]["source"].as_str().unwrap().contains("restarted"));
        let ids: HashSet<&str> = cells.iter().map(|c| c["id"].as_str().unwrap()).collect();
        assert_eq!(ids.len(), 4);
        assert_eq!(cells[0]["metadata"]["kernel_broker"]["status"], "ok");
    }

    #[test]
    fn ids_are_valid_and_unique() {
        let mut used = HashSet::new();
        let cases = ["abc-1_2", "a b/c", "", "abc-1_2", &"x".repeat(100)];
        for seed in cases {
            let id = cell_id(seed, &mut used);
            assert!(!id.is_empty() && id.len() <= 64, "{id}");
            assert!(
                id.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                "{id}"
            );
        }
        assert_eq!(used.len(), cases.len());
    }
}
