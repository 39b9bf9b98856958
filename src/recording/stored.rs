//! The recording's own stored form of what the session layer reports.
//!
//! A recording outlives the broker that wrote it (sessions and recordings are kept across
//! restarts and upgrades), so what is on disk must not change when a session type does:
//! [`StoredEvent`] and [`StoredExecution`] are this layer's types, converted from the
//! session's [`LifecycleEvent`] and [`Execution`] when reported, and their serde form is the
//! stored one (the tag is the stored `kind`, the other fields its `detail`).
//!
//! Versions of the stored form: version 1 is what brokers wrote before these types existed
//! (the session layer's serde form): every kind and field below reads what version 1 wrote.
//! Kinds added later (`file_*`, `command_*`) are new kinds, which an older broker reads back
//! as unreadable events rather than misreading them; a field added to a kind must be
//! optional (`#[serde(default)]`) so that what was written before it still reads.
//!
//! Version 2 stores an execution once: `execution_done` holds `{msg_id, outcome}`
//! ([`StoredDone`]: status, count, duration and what else its messages do not carry) instead
//! of `{msg_id, execution}`, and the execution is rebuilt from its recorded messages on read
//! (`super::rebuild`), so that every reader above the queries sees the version-1 form
//! ([`StoredEvent::ExecutionDone`]) whichever was written. The writer still writes the
//! version-1 form when it cannot vouch for the messages (it dropped some of the execution's
//! messages at a cap, the queue dropped reports, or they do not rebuild the very execution the
//! session answered). Readers take both. The tests at the end hold each kind's stored form
//! as written.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::session::execution::{ExecutionError, ResultItem};
use crate::session::{Execution, ExecutionStatus, LifecycleEvent};

/// Where a forked session came from, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredForkedFrom {
    pub session: uuid::Uuid,
    pub execution_count: u64,
    /// The checkpoint of that session it was forked from, if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<uuid::Uuid>,
}

/// What the session layer reported, as the recording stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StoredEvent {
    SessionCreated {
        kernel: String,
        idle_timeout_seconds: Option<u64>,
        /// The front door that made it (`rest`, `jupyter`, `e2b`, `mcp`); absent in
        /// recordings made before it was kept.
        #[serde(default)]
        front_door: Option<String>,
        /// What its client said about it (text to text).
        #[serde(default)]
        metadata: BTreeMap<String, String>,
        /// The session whose live kernel it is a fork of, and that session's execution
        /// count at the fork; absent when it is not a fork.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        forked_from: Option<StoredForkedFrom>,
        /// It worked in a workspace of its own; absent (false) in recordings made before
        /// it was kept.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        own_workspace: bool,
    },
    /// The session's kernel was forked into these new sessions.
    SessionForked {
        sessions: Vec<uuid::Uuid>,
        execution_count: u64,
    },
    /// Checkpoints (issue 36): taken, dropped (and why), rewound to.
    CheckpointTaken {
        checkpoint: uuid::Uuid,
        execution_count: u64,
    },
    CheckpointDropped {
        checkpoint: uuid::Uuid,
        execution_count: u64,
        reason: String,
    },
    SessionRewound {
        checkpoint: uuid::Uuid,
        execution_count: u64,
    },
    /// Pause and resume (issue 37).
    SessionPaused {
        execution_count: u64,
        image_bytes: u64,
    },
    SessionResumed {
        execution_count: u64,
    },
    KernelStarted {
        startup_seconds: f64,
        #[serde(default)]
        pooled: bool,
    },
    ExecutionStarted {
        msg_id: String,
        code: String,
        timeout_seconds: f64,
        #[serde(default)]
        queue_wait_seconds: f64,
    },
    ExecutionDone {
        msg_id: String,
        execution: StoredExecution,
    },
    ExecutionTimeout {
        msg_id: String,
        timeout_seconds: f64,
    },
    OutputCut {
        msg_id: String,
        #[serde(default)]
        parent_msg_id: Option<String>,
        msg_type: String,
        bytes: u64,
    },
    Interrupt,
    /// The pre-execution policy refused an execution (issue 39).
    ExecutionRefused {
        #[serde(default)]
        msg_id: Option<String>,
        rule: String,
        what: String,
    },
    KernelRestarted {
        reason: String,
    },
    KernelDied {
        reason: String,
    },
    SessionExpired,
    /// Who or what closed it (`EndedBy`'s names); absent in recordings made before it was
    /// kept.
    SessionClosed {
        #[serde(default)]
        by: Option<String>,
    },
    /// A front door that did not make the session let go of it; it went on.
    SessionDetached {
        by: String,
    },
    SessionKept,
    BrokerRestarted {
        down_seconds: f64,
        kernel_alive: bool,
    },
    EgressAllowed {
        method: String,
        host: String,
        port: u16,
        address: String,
    },
    EgressRefused {
        method: String,
        host: String,
        port: u16,
        reason: String,
    },
    EgressClosed {
        host: String,
        port: u16,
        bytes_sent: u64,
        bytes_received: u64,
        seconds: f64,
    },
    /// A workspace file written through the broker (an upload, an E2B write), with its
    /// content (base64) where it was kept: a replay writes it again.
    FileWritten {
        path: String,
        bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content_base64: Option<String>,
    },
    /// A workspace file or empty directory removed through the broker.
    FileRemoved {
        path: String,
    },
    /// A workspace entry moved through the broker.
    FileRenamed {
        from: String,
        to: String,
    },
    /// A command started in the session's sandbox.
    CommandStarted {
        pid: u32,
        argv: Vec<String>,
        #[serde(default)]
        cwd: Option<String>,
    },
    /// A command ended: its exit code or the signal that ended it, and what it printed
    /// (its start and end past a bound; `*_bytes` all it printed). Recordings made before the
    /// output was kept have none.
    CommandEnded {
        pid: u32,
        #[serde(default)]
        exit_code: Option<i32>,
        #[serde(default)]
        signal: Option<i32>,
        seconds: f64,
        #[serde(default)]
        stdout: String,
        #[serde(default)]
        stderr: String,
        #[serde(default)]
        stdout_bytes: u64,
        #[serde(default)]
        stderr_bytes: u64,
    },
}

/// How an execution ended, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoredStatus {
    Ok,
    Error,
    Timeout,
    Interrupted,
    Dead,
}

/// A `display_data` or `execute_result` of an execution, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResult {
    pub data: Value,
    pub metadata: Value,
    pub is_main_result: bool,
}

/// An execution's error, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredError {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

/// What an agent execution was answered, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredExecution {
    pub status: StoredStatus,
    pub execution_count: Option<u64>,
    pub stdout: String,
    pub stderr: String,
    pub results: Vec<StoredResult>,
    pub error: Option<StoredError>,
    pub truncated: bool,
    pub duration_ms: f64,
}

/// Version 2 of `execution_done`'s detail: the execution's outcome only, for an execution
/// whose messages were all recorded. Its output (stdout, stderr, results, the kernel's
/// error, the count) is in its messages, and read back from them (`super::rebuild`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredDone {
    pub msg_id: String,
    pub outcome: StoredOutcome,
}

/// What an execution's messages do not say about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredOutcome {
    pub status: StoredStatus,
    /// The sequence number of its `execution_started`: its messages are those after it (and
    /// before the `execution_done`) whose parent is its request.
    pub started_seq: i64,
    pub execution_count: Option<u64>,
    pub truncated: bool,
    pub duration_ms: f64,
    /// The broker's own error (a timeout, a dead kernel...), which replaced the kernel's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<StoredError>,
    /// The limits the output was gathered under, when they cut it (characters of stdout and
    /// of stderr; bytes of results); none means nothing was cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_limit: Option<u64>,
}

impl StoredEvent {
    /// Whether a user or a kernel can make this event as often as it likes (file changes,
    /// commands, egress, interrupts, cut outputs), unlike a lifecycle event, which comes a
    /// few times in a session's life. The recording's budget counts these against the
    /// session's cap and drops them past it (`writer::budget`).
    pub fn is_repeatable(&self) -> bool {
        matches!(
            self,
            StoredEvent::Interrupt
                | StoredEvent::ExecutionRefused { .. }
                | StoredEvent::OutputCut { .. }
                | StoredEvent::EgressAllowed { .. }
                | StoredEvent::EgressRefused { .. }
                | StoredEvent::EgressClosed { .. }
                | StoredEvent::FileWritten { .. }
                | StoredEvent::FileRemoved { .. }
                | StoredEvent::FileRenamed { .. }
                | StoredEvent::CommandStarted { .. }
                | StoredEvent::CommandEnded { .. }
        )
    }

    /// The stored `kind` (the serde tag).
    pub fn kind(&self) -> &'static str {
        match self {
            StoredEvent::SessionCreated { .. } => "session_created",
            StoredEvent::SessionForked { .. } => "session_forked",
            StoredEvent::CheckpointTaken { .. } => "checkpoint_taken",
            StoredEvent::CheckpointDropped { .. } => "checkpoint_dropped",
            StoredEvent::SessionRewound { .. } => "session_rewound",
            StoredEvent::SessionPaused { .. } => "session_paused",
            StoredEvent::SessionResumed { .. } => "session_resumed",
            StoredEvent::KernelStarted { .. } => "kernel_started",
            StoredEvent::ExecutionStarted { .. } => "execution_started",
            StoredEvent::ExecutionDone { .. } => "execution_done",
            StoredEvent::ExecutionTimeout { .. } => "execution_timeout",
            StoredEvent::OutputCut { .. } => "output_cut",
            StoredEvent::Interrupt => "interrupt",
            StoredEvent::ExecutionRefused { .. } => "execution_refused",
            StoredEvent::KernelRestarted { .. } => "kernel_restarted",
            StoredEvent::KernelDied { .. } => "kernel_died",
            StoredEvent::SessionExpired => "session_expired",
            StoredEvent::SessionClosed { .. } => "session_closed",
            StoredEvent::SessionDetached { .. } => "session_detached",
            StoredEvent::SessionKept => "session_kept",
            StoredEvent::BrokerRestarted { .. } => "broker_restarted",
            StoredEvent::EgressAllowed { .. } => "egress_allowed",
            StoredEvent::EgressRefused { .. } => "egress_refused",
            StoredEvent::EgressClosed { .. } => "egress_closed",
            StoredEvent::FileWritten { .. } => "file_written",
            StoredEvent::FileRemoved { .. } => "file_removed",
            StoredEvent::FileRenamed { .. } => "file_renamed",
            StoredEvent::CommandStarted { .. } => "command_started",
            StoredEvent::CommandEnded { .. } => "command_ended",
        }
    }

    /// The stored `detail`: every field but the tag, as a JSON object.
    pub fn detail(&self) -> Value {
        stored_detail(self)
    }

    /// Reads a stored `kind` and `detail` back. `None` for a kind this version does not know
    /// or a detail that does not fit it.
    pub fn from_stored(kind: &str, detail: Value) -> Option<Self> {
        from_tagged(kind, detail)
    }
}

/// A `kind`-tagged enum's fields without the tag: the `detail` a recording stores.
pub(crate) fn stored_detail(tagged: &impl Serialize) -> Value {
    let mut v = serde_json::to_value(tagged).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.remove("kind");
    }
    v
}

/// The inverse of [`stored_detail`]: a stored `kind` and `detail` as a `kind`-tagged enum
/// (a null detail is an empty one). `None` when they do not fit it.
pub(crate) fn from_tagged<T: serde::de::DeserializeOwned>(kind: &str, detail: Value) -> Option<T> {
    let mut object = match detail {
        Value::Object(o) => o,
        Value::Null => serde_json::Map::new(),
        _ => return None,
    };
    object.insert("kind".into(), kind.into());
    serde_json::from_value(Value::Object(object)).ok()
}

impl From<&LifecycleEvent> for StoredEvent {
    fn from(event: &LifecycleEvent) -> Self {
        event.clone().into()
    }
}

impl From<ExecutionStatus> for StoredStatus {
    fn from(s: ExecutionStatus) -> Self {
        match s {
            ExecutionStatus::Ok => StoredStatus::Ok,
            ExecutionStatus::Error => StoredStatus::Error,
            ExecutionStatus::Timeout => StoredStatus::Timeout,
            ExecutionStatus::Interrupted => StoredStatus::Interrupted,
            ExecutionStatus::Dead => StoredStatus::Dead,
        }
    }
}

impl From<StoredStatus> for ExecutionStatus {
    fn from(s: StoredStatus) -> Self {
        match s {
            StoredStatus::Ok => ExecutionStatus::Ok,
            StoredStatus::Error => ExecutionStatus::Error,
            StoredStatus::Timeout => ExecutionStatus::Timeout,
            StoredStatus::Interrupted => ExecutionStatus::Interrupted,
            StoredStatus::Dead => ExecutionStatus::Dead,
        }
    }
}

impl From<Execution> for StoredExecution {
    fn from(x: Execution) -> Self {
        StoredExecution {
            status: x.status.into(),
            execution_count: x.execution_count,
            stdout: x.stdout,
            stderr: x.stderr,
            results: x
                .results
                .into_iter()
                .map(|r| StoredResult {
                    data: r.data,
                    metadata: r.metadata,
                    is_main_result: r.is_main_result,
                })
                .collect(),
            error: x.error.map(|e| StoredError {
                ename: e.ename,
                evalue: e.evalue,
                traceback: e.traceback,
            }),
            truncated: x.truncated,
            duration_ms: x.duration_ms,
        }
    }
}

impl From<StoredExecution> for Execution {
    /// The Execution the agent was answered, as read back (replay compares with it).
    fn from(x: StoredExecution) -> Self {
        Execution {
            status: x.status.into(),
            execution_count: x.execution_count,
            stdout: x.stdout,
            stderr: x.stderr,
            results: x
                .results
                .into_iter()
                .map(|r| ResultItem {
                    data: r.data,
                    metadata: r.metadata,
                    is_main_result: r.is_main_result,
                })
                .collect(),
            error: x.error.map(Into::into),
            truncated: x.truncated,
            duration_ms: x.duration_ms,
        }
    }
}

impl From<StoredError> for ExecutionError {
    /// The error the agent was answered (the kernel's, or the broker's own), as read back.
    fn from(e: StoredError) -> Self {
        ExecutionError {
            ename: e.ename,
            evalue: e.evalue,
            traceback: e.traceback,
        }
    }
}

mod from_session;
#[cfg(test)]
mod tests;
