//! The conversion of the session layer's events into the stored ones: the one place a
//! session type meets the recording's on-disk types.

use super::*;

impl From<LifecycleEvent> for StoredEvent {
    fn from(event: LifecycleEvent) -> Self {
        use LifecycleEvent as L;
        match event {
            L::SessionCreated {
                kernel,
                idle_timeout_seconds,
                provenance,
                forked_from,
                own_workspace,
            } => StoredEvent::SessionCreated {
                own_workspace,
                kernel,
                idle_timeout_seconds,
                front_door: Some(provenance.front_door.as_str().to_string()),
                metadata: provenance.metadata.entries().clone(),
                forked_from: forked_from.map(|f| StoredForkedFrom {
                    session: f.session,
                    execution_count: f.execution_count,
                    checkpoint: f.checkpoint,
                }),
            },
            L::SessionForked {
                sessions,
                execution_count,
            } => StoredEvent::SessionForked {
                sessions,
                execution_count,
            },
            L::CheckpointTaken {
                checkpoint,
                execution_count,
            } => StoredEvent::CheckpointTaken {
                checkpoint,
                execution_count,
            },
            L::CheckpointDropped {
                checkpoint,
                execution_count,
                reason,
            } => StoredEvent::CheckpointDropped {
                checkpoint,
                execution_count,
                reason,
            },
            L::SessionRewound {
                checkpoint,
                execution_count,
            } => StoredEvent::SessionRewound {
                checkpoint,
                execution_count,
            },
            L::SessionPaused {
                execution_count,
                image_bytes,
            } => StoredEvent::SessionPaused {
                execution_count,
                image_bytes,
            },
            L::SessionResumed { execution_count } => {
                StoredEvent::SessionResumed { execution_count }
            }
            L::KernelStarted {
                startup_seconds,
                pooled,
            } => StoredEvent::KernelStarted {
                startup_seconds,
                pooled,
            },
            L::ExecutionStarted {
                msg_id,
                code,
                timeout_seconds,
                queue_wait_seconds,
            } => StoredEvent::ExecutionStarted {
                msg_id,
                code,
                timeout_seconds,
                queue_wait_seconds,
            },
            L::ExecutionDone {
                msg_id, execution, ..
            } => StoredEvent::ExecutionDone {
                msg_id,
                execution: execution.into(),
            },
            L::ExecutionTimeout {
                msg_id,
                timeout_seconds,
            } => StoredEvent::ExecutionTimeout {
                msg_id,
                timeout_seconds,
            },
            L::OutputCut {
                msg_id,
                parent_msg_id,
                msg_type,
                bytes,
            } => StoredEvent::OutputCut {
                msg_id,
                parent_msg_id,
                msg_type,
                bytes,
            },
            L::Interrupt => StoredEvent::Interrupt,
            L::ExecutionRefused { msg_id, rule, what } => {
                StoredEvent::ExecutionRefused { msg_id, rule, what }
            }
            L::KernelRestarted { reason } => StoredEvent::KernelRestarted { reason },
            L::KernelDied { reason } => StoredEvent::KernelDied { reason },
            L::SessionExpired => StoredEvent::SessionExpired,
            L::SessionClosed { by } => StoredEvent::SessionClosed {
                by: Some(by.as_str().to_string()),
            },
            L::SessionDetached { by } => StoredEvent::SessionDetached {
                by: by.as_str().to_string(),
            },
            L::SessionKept => StoredEvent::SessionKept,
            L::BrokerRestarted {
                down_seconds,
                kernel_alive,
            } => StoredEvent::BrokerRestarted {
                down_seconds,
                kernel_alive,
            },
            L::EgressAllowed {
                method,
                host,
                port,
                address,
            } => StoredEvent::EgressAllowed {
                method,
                host,
                port,
                address,
            },
            L::EgressRefused {
                method,
                host,
                port,
                reason,
            } => StoredEvent::EgressRefused {
                method,
                host,
                port,
                reason,
            },
            L::EgressClosed {
                host,
                port,
                bytes_sent,
                bytes_received,
                seconds,
            } => StoredEvent::EgressClosed {
                host,
                port,
                bytes_sent,
                bytes_received,
                seconds,
            },
            L::FileWritten {
                path,
                bytes,
                content,
            } => StoredEvent::FileWritten {
                path,
                bytes,
                content_base64: content.map(|c| {
                    use base64::Engine;
                    base64::engine::general_purpose::STANDARD.encode(&c)
                }),
            },
            L::FileRemoved { path } => StoredEvent::FileRemoved { path },
            L::FileRenamed { from, to } => StoredEvent::FileRenamed { from, to },
            L::CommandStarted { pid, argv, cwd } => StoredEvent::CommandStarted { pid, argv, cwd },
            L::CommandEnded {
                pid,
                exit_code,
                signal,
                seconds,
                stdout,
                stderr,
            } => StoredEvent::CommandEnded {
                pid,
                exit_code,
                signal,
                seconds,
                stdout: stdout.text,
                stderr: stderr.text,
                stdout_bytes: stdout.bytes,
                stderr_bytes: stderr.bytes,
            },
        }
    }
}
