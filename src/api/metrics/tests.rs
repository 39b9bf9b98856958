//! Tests of the metrics: names, labels and what each event feeds.

use super::*;

fn snapshot() -> Snapshot {
    Snapshot {
        sessions: vec![("starting", 0), ("idle", 2), ("busy", 1), ("dead", 0)],
        connections: 3,
        pooled_kernels: 1,
        memory_reserved_sessions: 768 << 20,
        memory_reserved_pool: 256 << 20,
        memory_used: 300 << 20,
        own_sessions: vec![
            ("s-1".into(), 256 << 20, Some(100 << 20)),
            ("s-2".into(), 512 << 20, None),
        ],
        recording: Some(RecordingSnapshot {
            queued_bytes: 10,
            dropped: 1,
            truncated: 2,
            errors: 0,
            events: 42,
        }),
        uptime: Duration::from_millis(1500),
        egress: Vec::new(),
        caller: "alice".into(),
    }
}

#[test]
fn the_scrape_time_values_keep_their_names() {
    let text = Metrics::new("local").render(&snapshot());
    for line in [
        "# TYPE kernel_broker_sessions gauge",
        "kernel_broker_sessions{state=\"idle\"} 2",
        "kernel_broker_sessions{state=\"busy\"} 1",
        "kernel_broker_sessions{state=\"starting\"} 0",
        "kernel_broker_connections 3",
        "kernel_broker_pooled_kernels 1",
        "# TYPE kernel_broker_memory_reserved_bytes gauge",
        "kernel_broker_memory_reserved_bytes{holder=\"sessions\"} 805306368",
        "kernel_broker_memory_reserved_bytes{holder=\"pool\"} 268435456",
        "kernel_broker_memory_used_bytes 314572800",
        "kernel_broker_session_memory_limit_bytes{session=\"s-1\"} 268435456",
        "kernel_broker_session_memory_limit_bytes{session=\"s-2\"} 536870912",
        "kernel_broker_session_memory_used_bytes{session=\"s-1\"} 104857600",
        "kernel_broker_recording_queued_bytes 10",
        "# TYPE kernel_broker_recording_dropped counter",
        "kernel_broker_recording_dropped_total 1",
        "kernel_broker_recording_truncated_total 2",
        "kernel_broker_recording_errors_total 0",
        "kernel_broker_recording_events_total 42",
        "# TYPE kernel_broker_uptime_seconds gauge",
        "kernel_broker_uptime_seconds 1.5",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    assert!(
        !text.contains("session_memory_used_bytes{session=\"s-2\"}"),
        "no use is shown where none is known: {text}"
    );
    assert!(text.ends_with("# EOF\n"));
    assert_eq!(text.matches("# EOF").count(), 1);
    let off = Metrics::new("local").render(&Snapshot {
        recording: None,
        ..snapshot()
    });
    assert!(!off.contains("recording_"), "{off}");
}

#[test]
fn fed_values_show_as_families_with_backend_labels_and_buckets() {
    let m = Metrics::new("docker");
    m.execution_finished(Duration::from_millis(30), ExecutionStatus::Ok);
    m.execution_finished(Duration::from_secs(2), ExecutionStatus::Ok);
    m.execution_finished(Duration::from_secs(60), ExecutionStatus::Timeout);
    m.execution_queued(Duration::from_millis(2));
    m.kernel_started(Duration::from_millis(800));
    m.timed_out();
    m.restarted();
    m.restarted();
    m.died();
    m.expired();
    let text = m.render(&Snapshot::default());
    for line in [
        "# TYPE kernel_broker_execution_duration_seconds histogram",
        "# UNIT kernel_broker_execution_duration_seconds seconds",
        "kernel_broker_execution_duration_seconds_count{backend=\"docker\"} 3",
        "kernel_broker_execution_duration_seconds_sum{backend=\"docker\"} 62.03",
        "kernel_broker_execution_duration_seconds_bucket{le=\"0.04\",backend=\"docker\"} 1",
        "kernel_broker_execution_duration_seconds_bucket{le=\"+Inf\",backend=\"docker\"} 3",
        "kernel_broker_execution_queue_wait_seconds_count{backend=\"docker\"} 1",
        "kernel_broker_execution_queue_wait_seconds_bucket{le=\"0.002\",backend=\"docker\"} 1",
        "kernel_broker_kernel_start_seconds_count{backend=\"docker\"} 1",
        "kernel_broker_kernel_start_seconds_bucket{le=\"0.8\",backend=\"docker\"} 1",
        "kernel_broker_executions_total{backend=\"docker\",status=\"ok\"} 2",
        "kernel_broker_executions_total{backend=\"docker\",status=\"timeout\"} 1",
        "kernel_broker_execution_timeouts_total{backend=\"docker\"} 1",
        "kernel_broker_kernel_restarts_total{backend=\"docker\"} 2",
        "kernel_broker_kernel_deaths_total{backend=\"docker\"} 1",
        "kernel_broker_session_expiries_total{backend=\"docker\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

/// Each lifecycle event feeds its family; the others change nothing.
#[test]
fn lifecycle_events_feed_the_families() {
    let m = Metrics::new("local");
    let execution = crate::session::Execution {
        status: ExecutionStatus::Error,
        execution_count: Some(1),
        stdout: String::new(),
        stderr: String::new(),
        results: Vec::new(),
        error: None,
        truncated: false,
        duration_ms: 250.0,
    };
    for event in [
        LifecycleEvent::SessionCreated {
            kernel: "python3".into(),
            idle_timeout_seconds: None,
            provenance: Default::default(),
            forked_from: None,
            own_workspace: false,
        },
        LifecycleEvent::KernelStarted {
            startup_seconds: 0.3,
            pooled: false,
        },
        LifecycleEvent::ExecutionStarted {
            msg_id: "m".into(),
            code: "x".into(),
            timeout_seconds: 1.0,
            queue_wait_seconds: 0.001,
        },
        LifecycleEvent::ExecutionDone {
            msg_id: "m".into(),
            execution,
            output_limit: 10_000,
            result_limit: 1 << 20,
        },
        LifecycleEvent::ExecutionTimeout {
            msg_id: "m".into(),
            timeout_seconds: 1.0,
        },
        LifecycleEvent::Interrupt,
        LifecycleEvent::KernelRestarted { reason: "r".into() },
        LifecycleEvent::KernelDied { reason: "d".into() },
        LifecycleEvent::SessionExpired,
        LifecycleEvent::SessionClosed {
            by: crate::session::EndedBy::Client(crate::session::FrontDoor::Rest),
        },
    ] {
        m.observe(&event);
    }
    let text = m.render(&Snapshot::default());
    for line in [
        "kernel_broker_kernel_start_seconds_count{backend=\"local\"} 1",
        "kernel_broker_kernel_start_seconds_sum{backend=\"local\"} 0.3",
        "kernel_broker_execution_queue_wait_seconds_count{backend=\"local\"} 1",
        "kernel_broker_execution_duration_seconds_sum{backend=\"local\"} 0.25",
        "kernel_broker_executions_total{backend=\"local\",status=\"error\"} 1",
        "kernel_broker_execution_timeouts_total{backend=\"local\"} 1",
        "kernel_broker_kernel_restarts_total{backend=\"local\"} 1",
        "kernel_broker_kernel_deaths_total{backend=\"local\"} 1",
        "kernel_broker_session_expiries_total{backend=\"local\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

#[test]
fn counters_start_at_zero_for_the_backend() {
    let text = Metrics::new("local").render(&Snapshot::default());
    assert!(text
        .lines()
        .any(|l| l == "kernel_broker_kernel_deaths_total{backend=\"local\"} 0"));
}

/// The client connection families start at 0 for every reason and count what they are fed.
#[test]
fn refused_and_timed_out_connections_are_counted_by_reason() {
    let m = Metrics::new("local");
    let text = m.render(&Snapshot::default());
    for line in [
        "kernel_broker_connections_refused_total{reason=\"max_connections\"} 0",
        "kernel_broker_connections_refused_total{reason=\"max_connections_per_client\"} 0",
        "kernel_broker_connections_timed_out_total{reason=\"header\"} 0",
        "kernel_broker_connections_timed_out_total{reason=\"body\"} 0",
        "kernel_broker_connections_timed_out_total{reason=\"websocket_pong\"} 0",
        "kernel_broker_client_connections 0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    m.connection_refused(Refusal::MaxConnectionsPerClient);
    m.connection_timed_out(ClientTimeout::Header);
    m.connection_timed_out(ClientTimeout::Header);
    m.client_connections_changed(1);
    let text = m.render(&Snapshot::default());
    for line in [
        "kernel_broker_connections_refused_total{reason=\"max_connections_per_client\"} 1",
        "kernel_broker_connections_timed_out_total{reason=\"header\"} 2",
        "kernel_broker_client_connections 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}
