//! Agent executions in flight, and how their `execution_done` is stored. An execution is
//! stored once: its messages, and in `execution_done` only its outcome (version 2, see
//! [`crate::recording::stored`]), from which and the messages a reader rebuilds it
//! ([`crate::recording::rebuild`]). For that the writer holds, from an execution's
//! `execution_started` to its `execution_done`, the messages of it that it recorded (their
//! bytes shared with the reports, not copied), and at the end checks that they rebuild the
//! very execution the session answered.
//!
//! When the messages were not all recorded, the execution could not be read back from
//! them, so `execution_done` keeps the whole execution (version 1): the writer knows when
//! that is, and marks the execution lost: a message of it dropped at a cap
//! ([`super::budget`]), reports of its session dropped by the queue (`recording_gap`), a
//! write of its session that failed, a batch whose commit failed. Likewise past
//! [`MAX_HELD_BYTES`] held for all executions: memory stays bounded, and the execution is
//! stored whole as it was before.

use std::collections::HashMap;

use bytes::Bytes;
use serde_json::Value;

use crate::recording::rebuild::{outcome_of, Part};
use crate::recording::stored::{StoredDone, StoredExecution};
use crate::session::Direction;
use crate::wire::{Channel, Message};

/// Bytes of messages the writer holds for all executions in flight at most.
const MAX_HELD_BYTES: usize = 64 << 20;

/// An agent execution between its `execution_started` and its `execution_done`.
pub(super) struct InFlight {
    /// The `execute_request`'s msg_id.
    msg_id: String,
    /// The sequence number of its `execution_started`.
    started_seq: i64,
    /// The messages of it recorded so far: channel, msg_type, content (as a reader will
    /// see it).
    held: Vec<(Channel, String, Bytes)>,
    bytes: usize,
    /// Some message of it was not recorded, or is not held: stored whole.
    lost: bool,
}

/// The executions in flight, per session row (an agent's executions run one at a time).
#[derive(Default)]
pub(super) struct Executions {
    by_session: HashMap<i64, InFlight>,
    held_bytes: usize,
}

impl Executions {
    /// Session `sid`'s execution `msg_id` started; its `execution_started` is `seq`.
    pub(super) fn start(&mut self, sid: i64, msg_id: &str, seq: i64) {
        let new = InFlight {
            msg_id: msg_id.to_string(),
            started_seq: seq,
            held: Vec::new(),
            bytes: 0,
            lost: false,
        };
        if let Some(old) = self.by_session.insert(sid, new) {
            self.held_bytes -= old.bytes;
        }
    }

    /// Whether `msg` is one a reader rebuilds session `sid`'s execution in flight from.
    pub(super) fn wants(
        &self,
        sid: i64,
        direction: Direction,
        channel: Channel,
        msg: &Message,
    ) -> bool {
        let Some(x) = self.by_session.get(&sid) else {
            return false;
        };
        !x.lost
            && direction == Direction::FromKernel
            && msg.parent_msg_id.as_deref() == Some(x.msg_id.as_str())
            && (channel == Channel::Iopub
                || (channel == Channel::Shell && msg.msg_type == "execute_reply"))
    }

    /// Holds a recorded message that [`Executions::wants`]; `content` as a reader will see
    /// it.
    pub(super) fn hold(&mut self, sid: i64, channel: Channel, msg_type: &str, content: Bytes) {
        let over = self.held_bytes + content.len() > MAX_HELD_BYTES;
        let Some(x) = self.by_session.get_mut(&sid) else {
            return;
        };
        if over {
            x.lost = true;
        }
        if x.lost {
            self.held_bytes -= x.bytes;
            x.bytes = 0;
            x.held = Vec::new();
            return;
        }
        x.bytes += content.len();
        self.held_bytes += content.len();
        x.held.push((channel, msg_type.to_string(), content));
    }

    /// A report of session `sid` whose parent is `parent` was not recorded.
    pub(super) fn dropped(&mut self, sid: i64, parent: Option<&str>) {
        if let Some(x) = self.by_session.get_mut(&sid) {
            if parent == Some(x.msg_id.as_str()) {
                x.lost = true;
            }
        }
    }

    /// Reports of session `sid` were lost (whatever their parent).
    pub(super) fn lost(&mut self, sid: i64) {
        if let Some(x) = self.by_session.get_mut(&sid) {
            x.lost = true;
        }
    }

    /// A batch was lost with its commit: every execution in flight may miss messages.
    pub(super) fn all_lost(&mut self) {
        for x in self.by_session.values_mut() {
            x.lost = true;
        }
    }

    /// Session `sid` ended.
    pub(super) fn forget(&mut self, sid: i64) {
        if let Some(old) = self.by_session.remove(&sid) {
            self.held_bytes -= old.bytes;
        }
    }

    /// Execution `msg_id` of session `sid` ended with `execution`, gathered under `limits`
    /// (output, results): its stored `execution_done` detail when it can be stored once.
    pub(super) fn done(
        &mut self,
        sid: i64,
        msg_id: &str,
        execution: &StoredExecution,
        limits: (usize, usize),
    ) -> Option<Value> {
        if self.by_session.get(&sid)?.msg_id != msg_id {
            return None;
        }
        let x = self.by_session.remove(&sid)?;
        self.held_bytes -= x.bytes;
        if x.lost {
            return None;
        }
        let parts = x.held.iter().map(|(channel, msg_type, content)| Part {
            channel: channel.as_str(),
            msg_type,
            content,
        });
        let outcome = outcome_of(execution, x.started_seq, limits, parts)?;
        let done = StoredDone {
            msg_id: msg_id.to_string(),
            outcome,
        };
        serde_json::to_value(done).ok()
    }
}
