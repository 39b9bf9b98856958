//! Each stored kind's form, as recordings hold it.

use serde_json::json;

use super::*;

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
                provenance: Default::default(),
                forked_from: None,
                own_workspace: false,
            },
            "session_created",
            json!({"kernel": "python3", "idle_timeout_seconds": 60, "front_door": "rest", "metadata": {}}),
        ),
        (
            LifecycleEvent::SessionCreated {
                kernel: "python3".into(),
                idle_timeout_seconds: None,
                provenance: Default::default(),
                forked_from: Some(crate::session::lifecycle::ForkedFrom {
                    session: uuid::Uuid::nil(),
                    execution_count: 7,
                    checkpoint: None,
                }),
                own_workspace: false,
            },
            "session_created",
            json!({"kernel": "python3", "idle_timeout_seconds": null, "front_door": "rest", "metadata": {},
                   "forked_from": {"session": "00000000-0000-0000-0000-000000000000", "execution_count": 7}}),
        ),
        (
            LifecycleEvent::SessionForked {
                sessions: vec![uuid::Uuid::nil()],
                execution_count: 7,
            },
            "session_forked",
            json!({"sessions": ["00000000-0000-0000-0000-000000000000"], "execution_count": 7}),
        ),
        (
            LifecycleEvent::CheckpointTaken {
                checkpoint: uuid::Uuid::nil(),
                execution_count: 3,
            },
            "checkpoint_taken",
            json!({"checkpoint": "00000000-0000-0000-0000-000000000000", "execution_count": 3}),
        ),
        (
            LifecycleEvent::CheckpointDropped {
                checkpoint: uuid::Uuid::nil(),
                execution_count: 3,
                reason: "deleted by request".into(),
            },
            "checkpoint_dropped",
            json!({"checkpoint": "00000000-0000-0000-0000-000000000000", "execution_count": 3,
                   "reason": "deleted by request"}),
        ),
        (
            LifecycleEvent::SessionRewound {
                checkpoint: uuid::Uuid::nil(),
                execution_count: 3,
            },
            "session_rewound",
            json!({"checkpoint": "00000000-0000-0000-0000-000000000000", "execution_count": 3}),
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
                output_limit: 10_000,
                result_limit: 1 << 20,
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
        (
            LifecycleEvent::SessionClosed {
                by: crate::session::EndedBy::Client(crate::session::FrontDoor::Rest),
            },
            "session_closed",
            json!({"by": "rest"}),
        ),
        (
            LifecycleEvent::SessionDetached {
                by: crate::session::FrontDoor::Jupyter,
            },
            "session_detached",
            json!({"by": "jupyter"}),
        ),
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
        let event = StoredEvent::from(&event);
        assert_eq!(event.kind(), kind);
        assert_eq!(event.detail(), detail, "{kind}");
        assert_eq!(
            StoredEvent::from_stored(kind, detail).as_ref(),
            Some(&event),
            "{kind}"
        );
    }
}

#[test]
fn older_and_unknown_stored_forms() {
    // Written before queue_wait_seconds existed.
    let old = StoredEvent::from_stored(
        "execution_started",
        json!({"msg_id": "m", "code": "x", "timeout_seconds": 1.0}),
    );
    assert!(matches!(
        old,
        Some(StoredEvent::ExecutionStarted { queue_wait_seconds, .. }) if queue_wait_seconds == 0.0
    ));
    assert_eq!(
        StoredEvent::from_stored("interrupt", serde_json::Value::Null),
        Some(StoredEvent::Interrupt)
    );
    assert_eq!(StoredEvent::from_stored("broker_gone", json!({})), None);
    // A detail cut by the recording's budget no longer fits its kind.
    assert_eq!(
        StoredEvent::from_stored(
            "execution_done",
            json!({"msg_id": "m", "recording_truncated": true, "bytes": 9})
        ),
        None
    );
    assert_eq!(StoredEvent::from_stored("interrupt", json!([1])), None);
}

/// The kinds added after the first stored form: a file changed through the broker, a
/// command run in the sandbox.
#[test]
fn file_and_command_kinds_round_trip() {
    let cases = [
        (
            LifecycleEvent::FileWritten {
                path: "data/a.csv".into(),
                bytes: 12,
                content: None,
            },
            "file_written",
            json!({"path": "data/a.csv", "bytes": 12}),
        ),
        (
            LifecycleEvent::FileRemoved {
                path: "old.txt".into(),
            },
            "file_removed",
            json!({"path": "old.txt"}),
        ),
        (
            LifecycleEvent::FileRenamed {
                from: "a.txt".into(),
                to: "b/a.txt".into(),
            },
            "file_renamed",
            json!({"from": "a.txt", "to": "b/a.txt"}),
        ),
        (
            LifecycleEvent::CommandStarted {
                pid: 42,
                argv: vec!["ls".into(), "-l".into()],
                cwd: Some("/home/user".into()),
            },
            "command_started",
            json!({"pid": 42, "argv": ["ls", "-l"], "cwd": "/home/user"}),
        ),
        (
            LifecycleEvent::CommandEnded {
                pid: 42,
                exit_code: Some(0),
                signal: None,
                seconds: 0.25,
                stdout: crate::session::lifecycle::CommandOutput {
                    text: "a\n".into(),
                    bytes: 2,
                },
                stderr: crate::session::lifecycle::CommandOutput {
                    text: "oops\n".into(),
                    bytes: 5,
                },
            },
            "command_ended",
            json!({"pid": 42, "exit_code": 0, "signal": null, "seconds": 0.25,
                   "stdout": "a\n", "stderr": "oops\n", "stdout_bytes": 2, "stderr_bytes": 5}),
        ),
    ];
    for (event, kind, detail) in cases {
        let event = StoredEvent::from(&event);
        assert_eq!(event.kind(), kind);
        assert_eq!(event.detail(), detail, "{kind}");
        assert_eq!(
            StoredEvent::from_stored(kind, detail),
            Some(event),
            "{kind}"
        );
    }
}

/// The stored Execution reads back as the Execution the agent was answered.
#[test]
fn execution_converts_both_ways() {
    let x = Execution {
        status: ExecutionStatus::Error,
        execution_count: Some(7),
        stdout: "out".into(),
        stderr: "err".into(),
        results: vec![ResultItem {
            data: json!({"text/plain": "1"}),
            metadata: json!({}),
            is_main_result: true,
        }],
        error: Some(ExecutionError {
            ename: "ValueError".into(),
            evalue: "bad".into(),
            traceback: vec!["line".into()],
        }),
        truncated: true,
        duration_ms: 9.0,
    };
    let stored = StoredExecution::from(x.clone());
    assert_eq!(
        serde_json::to_value(&stored).unwrap(),
        serde_json::to_value(&x).unwrap()
    );
    assert_eq!(Execution::from(stored), x);
}
