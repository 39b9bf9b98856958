//! What the session layer reports about a session's life, as one typed enum.
//!
//! The recording converts these events into its own stored types (`recording::stored`) and
//! the metrics count them. This type has no serde form: changing it never changes what is
//! on disk, only the recording's conversion does.

use super::execution::Execution;
use super::front_door::{EndedBy, FrontDoor, Provenance};
use crate::egress::EgressEvent;

/// Where a forked session came from: the session and its execution count at the fork.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForkedFrom {
    pub session: uuid::Uuid,
    pub execution_count: u64,
    /// The checkpoint of that session it was forked from, if it was.
    pub checkpoint: Option<uuid::Uuid>,
}

/// Something that happened to a session, in the order it happened.
#[derive(Debug, Clone, PartialEq)]
pub enum LifecycleEvent {
    /// The pre-execution policy refused an execution before it reached the kernel
    /// (`msg_id`: the Jupyter client's request, or none for an agent's).
    ExecutionRefused {
        msg_id: Option<String>,
        rule: String,
        what: String,
    },
    /// The session exists and its first kernel is ready.
    SessionCreated {
        kernel: String,
        idle_timeout_seconds: Option<u64>,
        /// The front door that made it, and what its client said about it.
        provenance: Provenance,
        /// The session whose live kernel it is a fork of, if it is one.
        forked_from: Option<ForkedFrom>,
        /// It works in a workspace of its own (`"workspace": "own"`): a replay makes one
        /// too, and writes into it the files the API wrote (see `FileWritten`).
        own_workspace: bool,
    },
    /// The session's kernel was forked into new sessions (`sessions`), after
    /// `execution_count` executions.
    SessionForked {
        sessions: Vec<uuid::Uuid>,
        execution_count: u64,
    },
    /// A checkpoint of the session's kernel was taken after `execution_count` executions.
    CheckpointTaken {
        checkpoint: uuid::Uuid,
        execution_count: u64,
    },
    /// A checkpoint ended before its session: asked, or over its user's bounds (`reason`).
    CheckpointDropped {
        checkpoint: uuid::Uuid,
        execution_count: u64,
        reason: String,
    },
    /// The session's kernel was paused to disk (issue 37): its images take `image_bytes`.
    SessionPaused {
        execution_count: u64,
        image_bytes: u64,
    },
    /// A paused session's kernel runs again, with the state it was paused with.
    SessionResumed { execution_count: u64 },
    /// The session's kernel was replaced by a fork of `checkpoint`; its execution count is
    /// the checkpoint's again.
    SessionRewound {
        checkpoint: uuid::Uuid,
        execution_count: u64,
    },
    /// The session got a kernel (at creation or after a restart): how long it waited for
    /// one, and whether a pre-started one from the warm pool was ready.
    KernelStarted { startup_seconds: f64, pooled: bool },
    /// An agent execution was sent to the kernel, after waiting in the session's queue.
    ExecutionStarted {
        msg_id: String,
        code: String,
        timeout_seconds: f64,
        queue_wait_seconds: f64,
    },
    /// An agent execution ended; `execution` is what the agent was answered, its output
    /// gathered under `output_limit` and `result_limit` (the recording rebuilds it from the
    /// messages with them).
    ExecutionDone {
        msg_id: String,
        execution: Execution,
        output_limit: usize,
        result_limit: usize,
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
    /// The session was closed: by whom or what.
    SessionClosed { by: EndedBy },
    /// A front door that did not make the session was asked to end it (JupyterLab
    /// shutting down its kernels): it let go of the session, which goes on.
    SessionDetached { by: FrontDoor },
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
    /// A file of the session's workspace was written through the broker (an upload, an
    /// E2B write): `path` relative to the workspace, `bytes` its new size; `content` its
    /// bytes, kept for a session with a workspace of its own (which ends with it) up to
    /// [`crate::session::RECORDED_FILE_MAX`], so that a replay can write it again.
    FileWritten {
        path: String,
        bytes: u64,
        content: Option<std::sync::Arc<[u8]>>,
    },
    /// A workspace file (or empty directory) was removed through the broker.
    FileRemoved { path: String },
    /// A workspace entry was moved through the broker.
    FileRenamed { from: String, to: String },
    /// A command (E2B's commands) started in the session's sandbox as process `pid`.
    CommandStarted {
        pid: u32,
        argv: Vec<String>,
        cwd: Option<String>,
    },
    /// Command `pid` ended, with its exit code or the signal that ended it, after `seconds`,
    /// and what it printed (bounded).
    CommandEnded {
        pid: u32,
        exit_code: Option<i32>,
        signal: Option<i32>,
        seconds: f64,
        stdout: CommandOutput,
        stderr: CommandOutput,
    },
}

/// What a command printed on one stream: the text kept (its start and end when it printed
/// more than the bound, with what was left out said between them) and the bytes it printed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommandOutput {
    pub text: String,
    pub bytes: u64,
}

impl From<EgressEvent> for LifecycleEvent {
    /// What the egress proxy reports about a session's kernel, as the session reports it.
    fn from(event: EgressEvent) -> Self {
        match event {
            EgressEvent::Allowed {
                method,
                host,
                port,
                address,
            } => LifecycleEvent::EgressAllowed {
                method,
                host,
                port,
                address,
            },
            EgressEvent::Refused {
                method,
                host,
                port,
                reason,
            } => LifecycleEvent::EgressRefused {
                method,
                host,
                port,
                reason,
            },
            EgressEvent::Closed {
                host,
                port,
                bytes_sent,
                bytes_received,
                seconds,
            } => LifecycleEvent::EgressClosed {
                host,
                port,
                bytes_sent,
                bytes_received,
                seconds,
            },
        }
    }
}
