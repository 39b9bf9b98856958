//! Broker events read back from a recording, typed.
//!
//! A recording holds two sorts of broker events: what the session layer reported (a
//! [`StoredEvent`], converted from its `LifecycleEvent`) and the recording's own markers (a gap when the writer fell behind, a
//! cut when a budget was reached, the broker's stop). Both are stored as a `kind` and a JSON
//! `detail`; this is where they become types again, for the writer's budgets, the notebook
//! export and replay. Stored kind names are read and written here and in
//! [`StoredEvent`] only: the rest of the recording matches on the types.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::stored::{from_tagged, stored_detail, StoredEvent};

/// The recording's own markers, in their stored form (tag = `kind`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RecordingMarker {
    /// Reports the writer could not keep up with were dropped.
    RecordingGap { dropped: u64, reason: String },
    /// An execution's or the session's recording reached its cap.
    RecordingTruncated {
        scope: String,
        #[serde(default)]
        msg_id: String,
        limit_bytes: u64,
        dropped_messages: u64,
        dropped_bytes: u64,
        reason: String,
    },
    /// The broker stopped (killed or crashed) without closing the session.
    BrokerStopped { reason: String },
    /// Cluster mode: the node that held the session stopped renewing its lease; another
    /// node closed the recording (the kernel is gone with its node).
    NodeLost { node: String, reason: String },
}

impl RecordingMarker {
    pub fn kind(&self) -> &'static str {
        match self {
            RecordingMarker::RecordingGap { .. } => "recording_gap",
            RecordingMarker::RecordingTruncated { .. } => "recording_truncated",
            RecordingMarker::BrokerStopped { .. } => "broker_stopped",
            RecordingMarker::NodeLost { .. } => "node_lost",
        }
    }

    pub fn reason(&self) -> &str {
        match self {
            RecordingMarker::RecordingGap { reason, .. }
            | RecordingMarker::RecordingTruncated { reason, .. }
            | RecordingMarker::BrokerStopped { reason }
            | RecordingMarker::NodeLost { reason, .. } => reason,
        }
    }

    /// The stored `detail`: every field but the tag.
    pub fn detail(&self) -> Value {
        stored_detail(self)
    }
}

/// A stored broker event, typed.
#[derive(Debug, Clone, PartialEq)]
pub enum BrokerEvent {
    Session(StoredEvent),
    Recording(RecordingMarker),
    /// A kind this version does not know (written by a newer broker), or an `execution_*`
    /// detail the recording's budget cut to `{msg_id, recording_truncated, bytes}`: only
    /// what every event has is kept.
    Unreadable {
        kind: String,
        msg_id: Option<String>,
    },
}

/// Which of an execution's events a cut one was (see [`BrokerEvent::cut_execution`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutionPhase {
    Started,
    Done,
    Timeout,
}

impl BrokerEvent {
    /// The stored `kind`.
    pub fn kind(&self) -> &str {
        match self {
            BrokerEvent::Session(e) => e.kind(),
            BrokerEvent::Recording(m) => m.kind(),
            BrokerEvent::Unreadable { kind, .. } => kind,
        }
    }

    /// The stored `detail` (of an unreadable event, what is left of it: its `msg_id`).
    pub fn detail(&self) -> Value {
        match self {
            BrokerEvent::Session(e) => e.detail(),
            BrokerEvent::Recording(m) => m.detail(),
            BrokerEvent::Unreadable { msg_id, .. } => match msg_id {
                Some(id) => serde_json::json!({ "msg_id": id }),
                None => Value::Object(serde_json::Map::new()),
            },
        }
    }

    /// The `execute_request` msg_id of an execution's event (started, done, timeout), also
    /// when its detail was cut.
    pub fn execution_msg_id(&self) -> Option<&str> {
        match self {
            BrokerEvent::Session(
                StoredEvent::ExecutionStarted { msg_id, .. }
                | StoredEvent::ExecutionDone { msg_id, .. }
                | StoredEvent::ExecutionTimeout { msg_id, .. },
            ) => Some(msg_id),
            BrokerEvent::Unreadable { .. } => self.cut_execution().map(|(_, id)| id),
            _ => None,
        }
    }

    /// An execution's event whose detail the recording's budget cut: which one, and the
    /// msg_id that is all it kept.
    pub fn cut_execution(&self) -> Option<(ExecutionPhase, &str)> {
        let BrokerEvent::Unreadable {
            kind,
            msg_id: Some(msg_id),
        } = self
        else {
            return None;
        };
        let phase = match kind.as_str() {
            "execution_started" => ExecutionPhase::Started,
            "execution_done" => ExecutionPhase::Done,
            "execution_timeout" => ExecutionPhase::Timeout,
            _ => return None,
        };
        Some((phase, msg_id))
    }

    /// How the session ends with this event (`sessions.end_reason`), if it does.
    pub fn end_reason(&self) -> Option<&'static str> {
        match self {
            BrokerEvent::Session(StoredEvent::SessionClosed { .. }) => Some("closed"),
            BrokerEvent::Session(StoredEvent::SessionExpired) => Some("expired"),
            _ => None,
        }
    }

    /// Reads a stored `kind` and its `detail` text.
    pub fn parse(kind: &str, detail: &str) -> Self {
        let detail: Value = serde_json::from_str(detail).unwrap_or(Value::Null);
        let msg_id = detail["msg_id"].as_str().map(str::to_string);
        if let Some(e) = StoredEvent::from_stored(kind, detail.clone()) {
            return BrokerEvent::Session(e);
        }
        match from_tagged(kind, detail) {
            Some(m) => BrokerEvent::Recording(m),
            None => BrokerEvent::Unreadable {
                kind: kind.to_string(),
                msg_id,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn markers_round_trip_through_their_stored_form() {
        let cases = [
            RecordingMarker::RecordingGap {
                dropped: 3,
                reason: "behind".into(),
            },
            RecordingMarker::RecordingTruncated {
                scope: "execution".into(),
                msg_id: "m".into(),
                limit_bytes: 10,
                dropped_messages: 2,
                dropped_bytes: 30,
                reason: "cap".into(),
            },
            RecordingMarker::BrokerStopped {
                reason: "killed".into(),
            },
        ];
        for m in cases {
            let parsed = BrokerEvent::parse(m.kind(), &m.detail().to_string());
            assert_eq!(parsed, BrokerEvent::Recording(m));
        }
    }

    #[test]
    fn lifecycle_events_unknown_kinds_and_cut_details() {
        assert_eq!(
            BrokerEvent::parse("kernel_died", r#"{"reason": "oom"}"#),
            BrokerEvent::Session(StoredEvent::KernelDied {
                reason: "oom".into()
            })
        );
        assert_eq!(
            BrokerEvent::parse("from_the_future", "{}"),
            BrokerEvent::Unreadable {
                kind: "from_the_future".into(),
                msg_id: None
            }
        );
        let cut = json!({"msg_id": "m", "recording_truncated": true, "bytes": 5}).to_string();
        assert_eq!(
            BrokerEvent::parse("execution_done", &cut),
            BrokerEvent::Unreadable {
                kind: "execution_done".into(),
                msg_id: Some("m".into())
            }
        );
        assert!(matches!(
            BrokerEvent::parse("interrupt", "not json"),
            BrokerEvent::Session(StoredEvent::Interrupt)
        ));
    }

    #[test]
    fn what_the_writer_and_the_notebook_ask_of_an_event() {
        let cut = |kind: &str| BrokerEvent::Unreadable {
            kind: kind.into(),
            msg_id: Some("m".into()),
        };
        let timeout = BrokerEvent::Session(StoredEvent::ExecutionTimeout {
            msg_id: "m".into(),
            timeout_seconds: 1.0,
        });
        let gap = BrokerEvent::Recording(RecordingMarker::RecordingGap {
            dropped: 1,
            reason: "r".into(),
        });
        // (event, execution msg_id, cut phase, end reason)
        let cases = [
            (timeout, Some("m"), None, None),
            (
                cut("execution_done"),
                Some("m"),
                Some(ExecutionPhase::Done),
                None,
            ),
            (
                cut("execution_started"),
                Some("m"),
                Some(ExecutionPhase::Started),
                None,
            ),
            (cut("from_the_future"), None, None, None),
            (gap, None, None, None),
            (
                BrokerEvent::Session(StoredEvent::SessionClosed { by: None }),
                None,
                None,
                Some("closed"),
            ),
            (
                BrokerEvent::Session(StoredEvent::SessionExpired),
                None,
                None,
                Some("expired"),
            ),
            (
                BrokerEvent::Session(StoredEvent::Interrupt),
                None,
                None,
                None,
            ),
        ];
        for (event, msg_id, phase, end) in cases {
            assert_eq!(event.execution_msg_id(), msg_id, "{event:?}");
            assert_eq!(event.cut_execution().map(|(p, _)| p), phase, "{event:?}");
            assert_eq!(event.end_reason(), end, "{event:?}");
            // What is stored reads back as the same event.
            let back = BrokerEvent::parse(event.kind(), &event.detail().to_string());
            assert_eq!(back, event);
        }
    }
}
