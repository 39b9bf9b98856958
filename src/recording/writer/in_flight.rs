//! Agent executions in flight, and how their `execution_done` is stored. An execution is
//! stored once: its messages, and in `execution_done` only its outcome (version 2, see
//! [`crate::recording::stored`]), from which and the messages a reader rebuilds it
//! ([`crate::recording::rebuild`]). For that the writer holds, from an execution's
//! `execution_started` to its `execution_done`, the messages of it that it recorded (a
//! message's bytes shared with its report, not copied, unless its images were taken out:
//! then the text a reader gets back), and at the end checks that they rebuild the very
//! execution the session answered.
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
pub(super) struct Executions {
    by_session: HashMap<i64, InFlight>,
    held_bytes: usize,
    max_held_bytes: usize,
}

impl Default for Executions {
    fn default() -> Self {
        Self {
            by_session: HashMap::new(),
            held_bytes: 0,
            max_held_bytes: MAX_HELD_BYTES,
        }
    }
}

impl InFlight {
    /// Marks it lost, letting go of what it held; the bytes it held.
    fn lose(&mut self) -> usize {
        self.lost = true;
        self.held = Vec::new();
        std::mem::take(&mut self.bytes)
    }
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
        let over = self.held_bytes + content.len() > self.max_held_bytes;
        let Some(x) = self.by_session.get_mut(&sid) else {
            return;
        };
        if x.lost || over {
            self.held_bytes -= x.lose();
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
                self.held_bytes -= x.lose();
            }
        }
    }

    /// Reports of session `sid` were lost (whatever their parent).
    pub(super) fn lost(&mut self, sid: i64) {
        if let Some(x) = self.by_session.get_mut(&sid) {
            self.held_bytes -= x.lose();
        }
    }

    /// A batch was lost with its commit: every execution in flight may miss messages.
    pub(super) fn all_lost(&mut self) {
        for x in self.by_session.values_mut() {
            x.lose();
        }
        self.held_bytes = 0;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recording::stored::StoredStatus;

    fn output(parent: &str, text: &str) -> Message {
        let parent_header = Bytes::from(serde_json::json!({"msg_id": parent}).to_string());
        let content = serde_json::json!({"name": "stdout", "text": text});
        Message::new("stream", &content, Some(&parent_header), "k", "alice")
    }

    fn execution(stdout: &str) -> StoredExecution {
        StoredExecution {
            status: StoredStatus::Ok,
            execution_count: None,
            stdout: stdout.into(),
            stderr: String::new(),
            results: Vec::new(),
            error: None,
            truncated: false,
            duration_ms: 1.0,
        }
    }

    /// Runs `m` through the writer's steps for session 1: wanted, then held.
    fn record(x: &mut Executions, m: &Message) {
        if x.wants(1, Direction::FromKernel, Channel::Iopub, m) {
            x.hold(1, Channel::Iopub, &m.msg_type, m.content.clone());
        }
    }

    #[test]
    fn an_execution_is_stored_once_unless_it_lost_a_message_or_held_too_much() {
        let limits = (100, 100);
        // (what befalls the execution between its messages, stored once)
        let cases: [(&str, bool); 6] = [
            ("nothing", true),
            ("a message of it dropped", false),
            ("a message of another dropped", true),
            ("a gap in the session", false),
            ("a failed commit", false),
            ("over the bound", false),
        ];
        for (what, once) in cases {
            let mut x = Executions {
                // Room for one of its two messages.
                max_held_bytes: if what == "over the bound" {
                    40
                } else {
                    1 << 20
                },
                ..Default::default()
            };
            x.start(1, "m", 2);
            record(&mut x, &output("m", "a"));
            record(&mut x, &output("other", "not this one's"));
            match what {
                "a message of it dropped" => x.dropped(1, Some("m")),
                "a message of another dropped" => x.dropped(1, Some("other")),
                "a gap in the session" => x.lost(1),
                "a failed commit" => x.all_lost(),
                _ => {}
            }
            record(&mut x, &output("m", "b"));
            let done = x.done(1, "m", &execution("ab"), limits);
            assert_eq!(done.is_some(), once, "{what}: {done:?}");
            assert_eq!(x.held_bytes, 0, "{what}");
            assert!(x.by_session.is_empty(), "{what}");
        }
    }

    #[test]
    fn only_the_execution_in_flight_is_stored_once() {
        let mut x = Executions::default();
        assert_eq!(
            x.done(1, "m", &execution(""), (1, 1)),
            None,
            "never started"
        );
        x.start(1, "m", 2);
        record(&mut x, &output("m", "a"));
        assert_eq!(
            x.done(1, "n", &execution(""), (1, 1)),
            None,
            "another one's end"
        );
        x.forget(1);
        assert_eq!(x.held_bytes, 0);
        assert_eq!(
            x.done(1, "m", &execution("a"), (1, 1)),
            None,
            "its session ended"
        );
    }
}
