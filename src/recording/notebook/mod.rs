//! A recording read back as cells, and exported as an nbformat 4.5 notebook.
//!
//! A code cell is a non-silent `execute_request` sent to the kernel (by an agent's execution
//! or by a notebook frontend), or an `execution_started` event; its outputs are the iopub
//! messages whose parent is that request: streams (consecutive ones of the same name
//! merged), `display_data`, `execute_result`, `error`, with `clear_output` and
//! `update_display_data` applied; an execution's timeout marks its cell. Broker events that
//! change the session (restart, death, expiry) and the recording's own markers (a gap, a
//! cut, the broker's stop) become markers, and markdown cells in the notebook. Pure
//! functions over recorded events: no I/O.
//!
//! Layout: [`timeline()`] (events in, cells and markers out), `outputs` (kernel messages as
//! nbformat outputs), [`notebook()`] (the nbformat document).

mod nbformat;
mod outputs;
#[cfg(test)]
mod tests;
mod timeline;

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::event::BrokerEvent;
use crate::recording::stored::StoredEvent;
use crate::session::Execution;

pub use nbformat::notebook;
pub use timeline::{cells, timeline};

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

/// A broker event worth showing between cells: a restart, a death, an expiry, or a marker
/// of the recording itself (a gap, a cut, the broker's stop).
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    /// A [`BrokerEvent::Session`] or [`BrokerEvent::Recording`].
    pub event: BrokerEvent,
    pub time: DateTime<Utc>,
}

impl Marker {
    /// The stored kind (`kernel_restarted`, `recording_gap`, ...).
    pub fn kind(&self) -> &str {
        self.event.kind()
    }

    /// Why, when the event says.
    pub fn reason(&self) -> &str {
        match &self.event {
            BrokerEvent::Session(
                StoredEvent::KernelRestarted { reason } | StoredEvent::KernelDied { reason },
            ) => reason,
            BrokerEvent::Recording(m) => m.reason(),
            _ => "",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
// Cells are most entries; boxing them would cost an allocation each.
#[allow(clippy::large_enum_variant)]
pub enum Entry {
    Cell(RecordedCell),
    Marker(Marker),
}
