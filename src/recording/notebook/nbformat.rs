//! The timeline as an nbformat 4.5 notebook: code cells with their outputs, execution
//! timings and the agent's status in the metadata; markers as markdown cells; the kernel
//! spec and `language_info` from the recorded `kernel_info_reply`; a fork's origin and the
//! session's forks in the notebook's metadata.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use serde_json::{json, Map, Value};

use super::timeline::{parse, timeline};
use super::{Entry, Marker};
use crate::recording::event::{BrokerEvent, RecordingMarker};
use crate::recording::stored::{StoredEvent, StoredForkedFrom};
use crate::recording::{RecordedEvent, RecordedKind, RecordingInfo};
use crate::session::Direction;

/// A cell id nbformat 4.5 accepts (`^[a-zA-Z0-9-_]+$`, 1 to 64 characters), unique.
pub(super) fn cell_id(seed: &str, used: &mut HashSet<String>) -> String {
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

/// A marker's markdown: what happened, when, and why.
fn marker_text(m: &Marker) -> String {
    let reason = m.reason();
    let what: std::borrow::Cow<str> = match &m.event {
        BrokerEvent::Session(StoredEvent::KernelRestarted { .. }) => {
            "The kernel was restarted".into()
        }
        BrokerEvent::Session(StoredEvent::KernelDied { .. }) => "The kernel died".into(),
        BrokerEvent::Session(StoredEvent::SessionExpired) => "The session expired".into(),
        BrokerEvent::Session(StoredEvent::SessionClosed { by: Some(by) }) => {
            format!("The session was closed by {by}").into()
        }
        BrokerEvent::Session(StoredEvent::SessionDetached { by }) => {
            format!("{by} let go of the session, which went on (another front door made it)").into()
        }
        BrokerEvent::Session(StoredEvent::SessionForked {
            sessions,
            execution_count,
        }) => {
            let ids: Vec<String> = sessions.iter().map(|s| format!("`{s}`")).collect();
            format!(
                "The session was forked after execution {execution_count} into {}",
                ids.join(", ")
            )
            .into()
        }
        BrokerEvent::Session(StoredEvent::SessionRewound {
            checkpoint,
            execution_count,
        }) => format!(
            "The session was rewound to checkpoint `{checkpoint}` (after execution \
             {execution_count}): the cells below ran on that state"
        )
        .into(),
        BrokerEvent::Recording(RecordingMarker::BrokerStopped { .. }) => {
            "The broker stopped".into()
        }
        BrokerEvent::Recording(RecordingMarker::NodeLost { .. }) => {
            "The node that held the session was lost".into()
        }
        BrokerEvent::Recording(RecordingMarker::RecordingGap { .. }) => {
            "Part of the recording is missing".into()
        }
        BrokerEvent::Recording(RecordingMarker::RecordingTruncated { .. }) => {
            "Output of a cell was cut in the recording".into()
        }
        other => other.kind().into(),
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
                    "metadata": {"kernel_broker": {"event": m.kind()}},
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
    let mut broker = json!({
        "session_id": info.id,
        "user": info.user,
        "created_at": iso(info.created_at),
        "ended_at": info.ended_at.map(iso),
        "end_reason": info.end_reason,
    });
    // A fork names its origin, and the session its forks: the notebooks link up.
    let (forked_from, forks) = lineage(events);
    if let Some(from) = forked_from {
        broker["forked_from"] =
            json!({"session": from.session, "execution_count": from.execution_count});
        if let Some(cp) = from.checkpoint {
            broker["forked_from"]["checkpoint"] = json!(cp);
        }
    }
    if !forks.is_empty() {
        broker["forks"] = json!(forks);
    }
    json!({
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": info.kernel, "display_name": display_name, "language": language},
            "language_info": language_info,
            "kernel_broker": broker,
        },
        "cells": nb_cells,
    })
}

/// Where the recorded session was forked from (its `session_created`), and the sessions
/// forked from it (each `session_forked`), in order.
fn lineage(events: &[RecordedEvent]) -> (Option<StoredForkedFrom>, Vec<Value>) {
    let (mut from, mut forks) = (None, Vec::new());
    for e in events {
        let RecordedKind::Broker { kind, detail } = &e.kind else {
            continue;
        };
        match BrokerEvent::parse(kind, detail) {
            BrokerEvent::Session(StoredEvent::SessionCreated {
                forked_from: Some(f),
                ..
            }) => from = Some(f),
            BrokerEvent::Session(StoredEvent::SessionForked {
                sessions,
                execution_count,
            }) => forks.extend(
                sessions
                    .into_iter()
                    .map(|s| json!({"session": s, "execution_count": execution_count})),
            ),
            _ => {}
        }
    }
    (from, forks)
}
