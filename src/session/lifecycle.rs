//! What the session layer reports about a session's life, as one typed enum.
//!
//! The recording stores these events (the tag is the stored `kind`, the other fields its
//! `detail`), the notebook export reads them back typed, and the metrics count them. The
//! serde form is the recording's stored form, so a field added later must be optional
//! (`#[serde(default)]`) for recordings written before it.

use serde::{Deserialize, Serialize};

use super::execution::Execution;

/// Something that happened to a session, in the order it happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LifecycleEvent {
    /// The session exists and its first kernel is ready.
    SessionCreated {
        kernel: String,
        idle_timeout_seconds: Option<u64>,
    },
    /// The session got a kernel (at creation or after a restart): how long it waited for
    /// one, and whether a pre-started one from the warm pool was ready.
    KernelStarted {
        startup_seconds: f64,
        #[serde(default)]
        pooled: bool,
    },
    /// An agent execution was sent to the kernel, after waiting in the session's queue.
    ExecutionStarted {
        msg_id: String,
        code: String,
        timeout_seconds: f64,
        #[serde(default)]
        queue_wait_seconds: f64,
    },
    /// An agent execution ended; `execution` is what the agent was answered.
    ExecutionDone {
        msg_id: String,
        execution: Execution,
    },
    /// An agent execution passed its timeout and is being interrupted.
    ExecutionTimeout {
        msg_id: String,
        timeout_seconds: f64,
    },
    /// An output message of the kernel (`msg_type`: stream, display_data, execute_result)
    /// was over the kernel-message limit and was cut: `bytes` is the size the kernel sent.
    /// The recorded message itself carries the cut content.
    OutputCut {
        msg_id: String,
        #[serde(default)]
        parent_msg_id: Option<String>,
        msg_type: String,
        bytes: u64,
    },
    /// A client asked for an interrupt.
    Interrupt,
    /// The kernel was replaced by a new one (by request or after a timeout).
    KernelRestarted { reason: String },
    /// The kernel ended or broke the protocol; the session is dead until restarted.
    KernelDied { reason: String },
    /// The session was closed for idleness.
    SessionExpired,
    /// The session was closed by its user or by the broker's shutdown.
    SessionClosed,
    /// The broker stopped and kept the session (`--keep-sessions`): its kernel runs on.
    SessionKept,
    /// A new run of the broker adopted the session; `down_seconds` since the last sign of
    /// the previous run (its orderly stop, or its last record before a crash).
    BrokerRestarted {
        down_seconds: f64,
        /// Whether the kernel was found alive (otherwise the session is dead).
        kernel_alive: bool,
    },
    /// The kernel's request through the egress proxy passed its user's network policy and
    /// the proxy connected to `address` (`method` is `CONNECT` for a TLS tunnel).
    EgressAllowed {
        method: String,
        host: String,
        port: u16,
        address: String,
    },
    /// The kernel's request through the egress proxy was refused before any connection;
    /// `reason` is what the kernel was answered.
    EgressRefused {
        method: String,
        host: String,
        port: u16,
        reason: String,
    },
    /// An allowed egress connection ended, with the bytes it carried each way.
    EgressClosed {
        host: String,
        port: u16,
        bytes_sent: u64,
        bytes_received: u64,
        seconds: f64,
    },
}

impl LifecycleEvent {
    /// The stored `kind` (the serde tag).
    pub fn kind(&self) -> &'static str {
        match self {
            LifecycleEvent::SessionCreated { .. } => "session_created",
            LifecycleEvent::KernelStarted { .. } => "kernel_started",
            LifecycleEvent::ExecutionStarted { .. } => "execution_started",
            LifecycleEvent::ExecutionDone { .. } => "execution_done",
            LifecycleEvent::ExecutionTimeout { .. } => "execution_timeout",
            LifecycleEvent::OutputCut { .. } => "output_cut",
            LifecycleEvent::Interrupt => "interrupt",
            LifecycleEvent::KernelRestarted { .. } => "kernel_restarted",
            LifecycleEvent::KernelDied { .. } => "kernel_died",
            LifecycleEvent::SessionExpired => "session_expired",
            LifecycleEvent::SessionClosed => "session_closed",
            LifecycleEvent::SessionKept => "session_kept",
            LifecycleEvent::BrokerRestarted { .. } => "broker_restarted",
            LifecycleEvent::EgressAllowed { .. } => "egress_allowed",
            LifecycleEvent::EgressRefused { .. } => "egress_refused",
            LifecycleEvent::EgressClosed { .. } => "egress_closed",
        }
    }

    /// The stored `detail`: every field but the tag, as a JSON object.
    pub fn detail(&self) -> serde_json::Value {
        stored_detail(self)
    }

    /// Reads a stored `kind` and `detail` back. `None` for a kind this version does not know
    /// or a detail that does not fit it.
    pub fn from_stored(kind: &str, detail: serde_json::Value) -> Option<Self> {
        let mut object = match detail {
            serde_json::Value::Object(o) => o,
            serde_json::Value::Null => serde_json::Map::new(),
            _ => return None,
        };
        object.insert("kind".into(), kind.into());
        serde_json::from_value(serde_json::Value::Object(object)).ok()
    }
}

/// A `kind`-tagged enum's fields without the tag: the `detail` a recording stores.
pub fn stored_detail(tagged: &impl Serialize) -> serde_json::Value {
    let mut v = serde_json::to_value(tagged).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.remove("kind");
    }
    v
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::session::execution::ExecutionStatus;

    fn execution() -> Execution {
        Execution {
            status: ExecutionStatus::Ok,
            execution_count: Some(3),
            stdout: "hi\n".into(),
            stderr: String::new(),
            results: Vec::new(),
            error: None,
            truncated: false,
            duration_ms: 1.5,
        }
    }

    /// Each event, its stored kind and detail: the stored form recordings already hold.
    #[test]
    fn stored_form_round_trips() {
        let cases = [
            (
                LifecycleEvent::SessionCreated {
                    kernel: "python3".into(),
                    idle_timeout_seconds: Some(60),
                },
                "session_created",
                json!({"kernel": "python3", "idle_timeout_seconds": 60}),
            ),
            (
                LifecycleEvent::KernelStarted {
                    startup_seconds: 0.5,
                    pooled: true,
                },
                "kernel_started",
                json!({"startup_seconds": 0.5, "pooled": true}),
            ),
            (
                LifecycleEvent::ExecutionStarted {
                    msg_id: "m".into(),
                    code: "1+1".into(),
                    timeout_seconds: 30.0,
                    queue_wait_seconds: 0.25,
                },
                "execution_started",
                json!({"msg_id": "m", "code": "1+1", "timeout_seconds": 30.0, "queue_wait_seconds": 0.25}),
            ),
            (
                LifecycleEvent::ExecutionDone {
                    msg_id: "m".into(),
                    execution: execution(),
                },
                "execution_done",
                json!({"msg_id": "m", "execution": {
                    "status": "ok", "execution_count": 3, "stdout": "hi\n", "stderr": "",
                    "results": [], "error": null, "truncated": false, "duration_ms": 1.5}}),
            ),
            (
                LifecycleEvent::ExecutionTimeout {
                    msg_id: "m".into(),
                    timeout_seconds: 2.0,
                },
                "execution_timeout",
                json!({"msg_id": "m", "timeout_seconds": 2.0}),
            ),
            (
                LifecycleEvent::OutputCut {
                    msg_id: "o".into(),
                    parent_msg_id: Some("m".into()),
                    msg_type: "stream".into(),
                    bytes: 70_000_000,
                },
                "output_cut",
                json!({"msg_id": "o", "parent_msg_id": "m", "msg_type": "stream", "bytes": 70_000_000}),
            ),
            (LifecycleEvent::Interrupt, "interrupt", json!({})),
            (
                LifecycleEvent::KernelRestarted {
                    reason: "asked".into(),
                },
                "kernel_restarted",
                json!({"reason": "asked"}),
            ),
            (
                LifecycleEvent::KernelDied {
                    reason: "oom".into(),
                },
                "kernel_died",
                json!({"reason": "oom"}),
            ),
            (LifecycleEvent::SessionExpired, "session_expired", json!({})),
            (LifecycleEvent::SessionClosed, "session_closed", json!({})),
            (LifecycleEvent::SessionKept, "session_kept", json!({})),
            (
                LifecycleEvent::BrokerRestarted {
                    down_seconds: 2.5,
                    kernel_alive: true,
                },
                "broker_restarted",
                json!({"down_seconds": 2.5, "kernel_alive": true}),
            ),
            (
                LifecycleEvent::EgressAllowed {
                    method: "CONNECT".into(),
                    host: "pypi.org".into(),
                    port: 443,
                    address: "151.101.0.223:443".into(),
                },
                "egress_allowed",
                json!({"method": "CONNECT", "host": "pypi.org", "port": 443, "address": "151.101.0.223:443"}),
            ),
            (
                LifecycleEvent::EgressRefused {
                    method: "GET".into(),
                    host: "example.org".into(),
                    port: 80,
                    reason: "host not allowed by policy: example.org".into(),
                },
                "egress_refused",
                json!({"method": "GET", "host": "example.org", "port": 80,
                       "reason": "host not allowed by policy: example.org"}),
            ),
            (
                LifecycleEvent::EgressClosed {
                    host: "pypi.org".into(),
                    port: 443,
                    bytes_sent: 10,
                    bytes_received: 20,
                    seconds: 0.5,
                },
                "egress_closed",
                json!({"host": "pypi.org", "port": 443, "bytes_sent": 10, "bytes_received": 20, "seconds": 0.5}),
            ),
        ];
        for (event, kind, detail) in cases {
            assert_eq!(event.kind(), kind);
            assert_eq!(event.detail(), detail, "{kind}");
            assert_eq!(
                LifecycleEvent::from_stored(kind, detail).as_ref(),
                Some(&event),
                "{kind}"
            );
        }
    }

    #[test]
    fn older_and_unknown_stored_forms() {
        // Written before queue_wait_seconds existed.
        let old = LifecycleEvent::from_stored(
            "execution_started",
            json!({"msg_id": "m", "code": "x", "timeout_seconds": 1.0}),
        );
        assert!(matches!(
            old,
            Some(LifecycleEvent::ExecutionStarted { queue_wait_seconds, .. }) if queue_wait_seconds == 0.0
        ));
        assert_eq!(
            LifecycleEvent::from_stored("interrupt", serde_json::Value::Null),
            Some(LifecycleEvent::Interrupt)
        );
        assert_eq!(LifecycleEvent::from_stored("broker_gone", json!({})), None);
        // A detail cut by the recording's budget no longer fits its kind.
        assert_eq!(
            LifecycleEvent::from_stored(
                "execution_done",
                json!({"msg_id": "m", "recording_truncated": true, "bytes": 9})
            ),
            None
        );
        assert_eq!(LifecycleEvent::from_stored("interrupt", json!([1])), None);
    }
}
