//! Recorded events in, a timeline of code cells and markers out.
//!
//! One pass over the events, in order. A cell starts at a non-silent `execute_request` sent
//! to the kernel, or at an agent's `execution_started` (whichever comes first; the other
//! finds it by msg_id). Kernel messages whose parent is a cell's request fill it: the
//! `execute_reply`'s status and count, `execute_input`'s time, outputs (see
//! [`super::outputs`]) with `clear_output` and `update_display_data` applied. Broker events
//! are read typed ([`BrokerEvent`]): an execution's start, end and timeout fill its cell,
//! and what changes the session (restart, death, expiry, the recording's own markers)
//! becomes a [`Marker`].

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::outputs::{mimebundle, object, output_of, push_output};
use super::{Entry, Marker, RecordedCell};
use crate::recording::event::{BrokerEvent, ExecutionPhase};
use crate::recording::stored::StoredEvent;
use crate::recording::{RecordedEvent, RecordedKind};
use crate::session::Direction;

pub(super) fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or(Value::Null)
}

/// The recording as a timeline of code cells and markers.
pub fn timeline(events: &[RecordedEvent]) -> Vec<Entry> {
    let mut t = Timeline::default();
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
                t.request(msg_id, content, e.time)
            }
            RecordedKind::Broker { kind, detail } => {
                t.broker(BrokerEvent::parse(kind, detail), e.time)
            }
            RecordedKind::Message {
                direction: Direction::FromKernel,
                channel,
                msg_type,
                parent_msg_id: Some(parent),
                content,
                ..
            } => t.kernel_message(channel, msg_type, parent, content, e.time),
            _ => {}
        }
    }
    t.entries
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

/// The timeline being built.
#[derive(Default)]
struct Timeline {
    entries: Vec<Entry>,
    /// A cell's entry by its request's msg_id.
    by_msg: HashMap<String, usize>,
    /// Cells whose outputs are cleared by their next output (`clear_output` with `wait`).
    clear_pending: HashSet<usize>,
    /// display_id -> (entry, output index) of the outputs it names.
    displays: HashMap<String, Vec<(usize, usize)>>,
    /// Code cells so far.
    cells: usize,
}

impl Timeline {
    /// An `execute_request` to the kernel: a cell, unless silent or already started.
    fn request(&mut self, msg_id: &str, content: &str, time: DateTime<Utc>) {
        let c = parse(content);
        if c["silent"].as_bool().unwrap_or(false) || self.by_msg.contains_key(msg_id) {
            return;
        }
        let code = c["code"].as_str().unwrap_or("").to_string();
        self.add_cell(msg_id, code, time);
    }

    fn broker(&mut self, event: BrokerEvent, time: DateTime<Utc>) {
        match event {
            BrokerEvent::Session(StoredEvent::ExecutionStarted {
                msg_id,
                code,
                timeout_seconds,
                ..
            }) => {
                self.started(&msg_id, code, time);
                if let Some(c) = self.cell(&msg_id) {
                    c.timeout_seconds = Some(timeout_seconds);
                }
            }
            BrokerEvent::Session(StoredEvent::ExecutionDone { msg_id, execution }) => {
                if let Some(c) = self.cell(&msg_id) {
                    c.finished_at = Some(time);
                    if c.execution_count.is_none() {
                        c.execution_count = execution.execution_count;
                    }
                    c.execution = Some(execution.into());
                }
            }
            BrokerEvent::Session(StoredEvent::ExecutionTimeout { msg_id, .. }) => {
                if let Some(c) = self.cell(&msg_id) {
                    c.timed_out = true;
                }
            }
            BrokerEvent::Session(
                StoredEvent::KernelRestarted { .. }
                | StoredEvent::KernelDied { .. }
                | StoredEvent::SessionExpired
                | StoredEvent::SessionClosed { by: Some(_) }
                | StoredEvent::SessionDetached { .. }
                | StoredEvent::SessionForked { .. }
                | StoredEvent::SessionRewound { .. },
            )
            | BrokerEvent::Recording(_) => {
                self.entries.push(Entry::Marker(Marker { event, time }));
            }
            BrokerEvent::Session(_) => {}
            // An execution's event whose detail the recording's budget cut: the cell is
            // still there (with the code unknown) and it still ended.
            BrokerEvent::Unreadable { .. } => match event.cut_execution() {
                Some((ExecutionPhase::Started, msg_id)) => {
                    self.started(msg_id, String::new(), time)
                }
                Some((ExecutionPhase::Done, msg_id)) => {
                    if let Some(c) = self.cell(msg_id) {
                        c.finished_at = Some(time);
                    }
                }
                Some((ExecutionPhase::Timeout, _)) | None => {}
            },
        }
    }

    /// A message from the kernel: to the cell of its parent request, if there is one.
    fn kernel_message(
        &mut self,
        channel: &str,
        msg_type: &str,
        parent: &str,
        content: &str,
        time: DateTime<Utc>,
    ) {
        let Some(&idx) = self.by_msg.get(parent) else {
            return;
        };
        let Some(Entry::Cell(cell)) = self.entries.get_mut(idx) else {
            return;
        };
        let c = parse(content);
        if channel == "shell" && msg_type == "execute_reply" {
            cell.reply_status = c["status"].as_str().map(str::to_string);
            if let Some(n) = c["execution_count"].as_u64() {
                cell.execution_count = Some(n);
            }
            cell.finished_at.get_or_insert(time);
            return;
        }
        if channel != "iopub" {
            return;
        }
        match msg_type {
            "execute_input" => {
                cell.input_at = Some(time);
                if let Some(n) = c["execution_count"].as_u64() {
                    cell.execution_count = Some(n);
                }
            }
            "clear_output" => {
                if c["wait"].as_bool().unwrap_or(false) {
                    self.clear_pending.insert(idx);
                } else {
                    cell.outputs.clear();
                }
            }
            "update_display_data" => {
                let Some(did) = c["transient"]["display_id"].as_str() else {
                    return;
                };
                let targets = self.displays.get(did).map(Vec::as_slice).unwrap_or(&[]);
                for &(i, o) in targets {
                    if let Some(Entry::Cell(target)) = self.entries.get_mut(i) {
                        if let Some(out) = target.outputs.get_mut(o) {
                            out["data"] = mimebundle(&c["data"]);
                            out["metadata"] = object(&c["metadata"]);
                        }
                    }
                }
            }
            _ => {
                let Some(output) = output_of(msg_type, &c) else {
                    return;
                };
                if self.clear_pending.remove(&idx) {
                    cell.outputs.clear();
                }
                if let Some(did) = c["transient"]["display_id"].as_str() {
                    self.displays
                        .entry(did.to_string())
                        .or_default()
                        .push((idx, cell.outputs.len()));
                }
                push_output(&mut cell.outputs, output);
            }
        }
    }

    fn add_cell(&mut self, msg_id: &str, code: String, time: DateTime<Utc>) {
        self.by_msg.insert(msg_id.to_string(), self.entries.len());
        self.entries
            .push(Entry::Cell(new_cell(self.cells, msg_id, code, time)));
        self.cells += 1;
    }

    /// Adds the cell of an agent execution unless its `execute_request` made it already.
    fn started(&mut self, msg_id: &str, code: String, time: DateTime<Utc>) {
        if !self.by_msg.contains_key(msg_id) {
            self.add_cell(msg_id, code, time);
        }
    }

    /// The cell of an execution, by its `execute_request`'s msg_id.
    fn cell(&mut self, msg_id: &str) -> Option<&mut RecordedCell> {
        match self.entries.get_mut(*self.by_msg.get(msg_id)?) {
            Some(Entry::Cell(c)) => Some(c),
            _ => None,
        }
    }
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
