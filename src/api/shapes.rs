//! The JSON shapes the API answers with, owned here and converted from the session layer's
//! types. The session types keep `Serialize` for the recording's stored form, but the API
//! never serialises them directly: a renamed field or a new variant below cannot change
//! what clients read without a change in this file (rust-analyzer's serialization
//! boundary). Each shape derives `ToSchema`, so `/openapi.json` is generated from the same
//! types the handlers return.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::{ContentBuilder, Ref, RefOr, Response};
use utoipa::{ToResponse, ToSchema};
use uuid::Uuid;

use crate::session::execution::{ExecutionError, ResultItem};
use crate::session::files::FileEntry;
use crate::session::{Execution, ExecutionStatus, SessionInfo, SessionState};

/// A time as the API writes it: RFC 3339, UTC, microseconds (`2024-05-01T12:00:00.000000Z`).
pub fn iso(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The Session object of the API.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Session)]
pub struct SessionJson {
    pub id: Uuid,
    /// The owner (the token's user).
    pub user: String,
    /// The kernel spec name.
    pub kernel: String,
    pub state: SessionStateJson,
    #[schema(format = DateTime)]
    pub created_at: String,
    #[schema(format = DateTime)]
    pub last_activity: String,
    /// When the session expires if it stays idle; `null` while it is busy.
    #[schema(format = DateTime, required = true)]
    pub expires_at: Option<String>,
    pub execution_count: u64,
    /// WebSocket clients attached right now (agent streams and Jupyter channels).
    pub connections: usize,
    /// The kernel's own memory limit in bytes (past it, this kernel alone is killed).
    pub memory_limit_bytes: u64,
    /// The kernel's memory use now in bytes, as its cgroup counts it; `null` while no
    /// kernel runs (starting, dead) or where the sandbox cannot tell.
    #[schema(required = true)]
    pub memory_used_bytes: Option<u64>,
    /// Why the kernel died, while `state` is `dead` (e.g. "the kernel was killed because it
    /// ran out of memory (limit 256 MiB)"); `null` otherwise.
    #[schema(required = true)]
    pub dead_reason: Option<String>,
    /// The front door that made the session, which owns its life: `rest`, `jupyter`, `e2b`
    /// or `mcp`. A Jupyter client's shutdown of a session it did not make only detaches it.
    /// `null` only for a session of a lost cluster node.
    #[schema(required = true)]
    pub front_door: Option<&'static str>,
    /// What the client said about the session at creation (the agent API's `metadata`,
    /// E2B's sandbox metadata, the MCP client's name and version), text to text.
    pub metadata: BTreeMap<String, String>,
    /// The names of the session's secrets (`secrets` at create, the user's own, E2B's
    /// declared ones); their values are never shown.
    pub secrets: Vec<String>,
}

impl From<SessionInfo> for SessionJson {
    fn from(i: SessionInfo) -> Self {
        Self {
            id: i.id,
            user: i.user,
            kernel: i.kernel,
            state: i.state.into(),
            created_at: iso(i.created_at),
            last_activity: iso(i.last_activity),
            expires_at: i.expires_at.map(iso),
            execution_count: i.execution_count,
            connections: i.connections,
            memory_limit_bytes: i.memory_limit_bytes,
            memory_used_bytes: i.memory_used_bytes,
            dead_reason: i.dead_reason,
            front_door: Some(i.provenance.front_door.as_str()),
            metadata: i.provenance.metadata.entries().clone(),
            secrets: i.secrets,
        }
    }
}

/// A session's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
#[schema(as = SessionState)]
pub enum SessionStateJson {
    Starting,
    Idle,
    Busy,
    Paused,
    Dead,
    Expired,
    Closed,
}

impl From<SessionState> for SessionStateJson {
    fn from(s: SessionState) -> Self {
        match s {
            SessionState::Starting => Self::Starting,
            SessionState::Idle => Self::Idle,
            SessionState::Busy => Self::Busy,
            SessionState::Paused => Self::Paused,
            SessionState::Dead => Self::Dead,
            SessionState::Expired => Self::Expired,
            SessionState::Closed => Self::Closed,
        }
    }
}

impl SessionStateJson {
    /// The state's name in JSON (status frames, `/v1/recordings`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Idle => "idle",
            Self::Busy => "busy",
            Self::Paused => "paused",
            Self::Dead => "dead",
            Self::Expired => "expired",
            Self::Closed => "closed",
        }
    }
}

/// How an execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
#[schema(as = ExecutionStatus)]
pub enum ExecutionStatusJson {
    Ok,
    Error,
    Timeout,
    Interrupted,
    Dead,
}

impl From<ExecutionStatus> for ExecutionStatusJson {
    fn from(s: ExecutionStatus) -> Self {
        match s {
            ExecutionStatus::Ok => Self::Ok,
            ExecutionStatus::Error => Self::Error,
            ExecutionStatus::Timeout => Self::Timeout,
            ExecutionStatus::Interrupted => Self::Interrupted,
            ExecutionStatus::Dead => Self::Dead,
        }
    }
}

/// The Execution object of the API: what one piece of code produced, within the limits.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Execution)]
pub struct ExecutionJson {
    pub status: ExecutionStatusJson,
    /// The kernel's execution counter for this code (`null` when it never ran).
    #[schema(required = true)]
    pub execution_count: Option<u64>,
    /// Standard output, ANSI escapes removed, cut at the output limit.
    pub stdout: String,
    pub stderr: String,
    /// Results and displays, in order.
    pub results: Vec<ResultJson>,
    /// The exception, when the code raised one.
    #[schema(required = true)]
    pub error: Option<ErrorJson>,
    /// Set when output was cut at a limit.
    pub truncated: bool,
    pub duration_ms: f64,
}

impl From<Execution> for ExecutionJson {
    fn from(e: Execution) -> Self {
        Self {
            status: e.status.into(),
            execution_count: e.execution_count,
            stdout: e.stdout,
            stderr: e.stderr,
            results: e.results.into_iter().map(ResultJson::from).collect(),
            error: e.error.map(ErrorJson::from),
            truncated: e.truncated,
            duration_ms: e.duration_ms,
        }
    }
}

/// A `display_data` or `execute_result`: a MIME bundle.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Result)]
pub struct ResultJson {
    /// MIME type to data (`text/plain`, `image/png` as base64, ...).
    #[schema(value_type = Object)]
    pub data: Value,
    #[schema(value_type = Object)]
    pub metadata: Value,
    /// `true` for the cell's value (`execute_result`), `false` for a display.
    pub is_main_result: bool,
}

impl From<ResultItem> for ResultJson {
    fn from(r: ResultItem) -> Self {
        Self {
            data: r.data,
            metadata: r.metadata,
            is_main_result: r.is_main_result,
        }
    }
}

/// The exception an execution raised.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ExecutionError)]
pub struct ErrorJson {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

impl From<ExecutionError> for ErrorJson {
    fn from(e: ExecutionError) -> Self {
        Self {
            ename: e.ename,
            evalue: e.evalue,
            traceback: e.traceback,
        }
    }
}

/// One file of a workspace listing.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = FileEntry)]
pub struct FileJson {
    /// Relative to the workspace.
    pub path: String,
    pub size: u64,
    /// Serialised by chrono, as before the api owned this shape (nanoseconds when present).
    #[schema(value_type = String, format = DateTime)]
    pub modified: DateTime<Utc>,
}

impl From<FileEntry> for FileJson {
    fn from(f: FileEntry) -> Self {
        Self {
            path: f.path,
            size: f.size,
            modified: f.modified,
        }
    }
}

/// The error body of every endpoint: `{"error": {"code", "message"}}`.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable code (`session_not_found`, `quota_exceeded`, `payload_too_large`, ...).
    pub code: String,
    /// A sentence for people.
    pub message: String,
}

/// The error answer every endpoint may give: `components/responses/Error`.
pub struct ErrorResponse;

impl<'r> ToResponse<'r> for ErrorResponse {
    fn response() -> (&'r str, RefOr<Response>) {
        let content = ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("Error")))
            .build();
        (
            "Error",
            ResponseBuilder::new()
                .description(
                    "An error: `{\"error\": {\"code\", \"message\"}}`; the Jupyter API adds \
                     `message` and `reason` at the top level.",
                )
                .content("application/json", content)
                .build()
                .into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn execution() -> Execution {
        Execution {
            status: ExecutionStatus::Error,
            execution_count: Some(3),
            stdout: "out\n".into(),
            stderr: String::new(),
            results: vec![ResultItem {
                data: json!({"text/plain": "1"}),
                metadata: json!({}),
                is_main_result: true,
            }],
            error: Some(ExecutionError {
                ename: "ValueError".into(),
                evalue: "x".into(),
                traceback: vec!["tb".into()],
            }),
            truncated: false,
            duration_ms: 12.5,
        }
    }

    /// The api's shape is byte-for-byte what the session type serialised to when it was
    /// the API's JSON (what clients parse today).
    #[test]
    fn execution_json_is_the_documented_shape() {
        for e in [
            execution(),
            Execution {
                execution_count: None,
                error: None,
                results: vec![],
                status: ExecutionStatus::Timeout,
                ..execution()
            },
        ] {
            let ours = serde_json::to_string(&ExecutionJson::from(e.clone())).unwrap();
            let theirs = serde_json::to_string(&e).unwrap();
            assert_eq!(ours, theirs);
        }
        let v = serde_json::to_value(ExecutionJson::from(execution())).unwrap();
        assert_eq!(
            v,
            json!({
                "status": "error", "execution_count": 3, "stdout": "out\n", "stderr": "",
                "results": [{"data": {"text/plain": "1"}, "metadata": {}, "is_main_result": true}],
                "error": {"ename": "ValueError", "evalue": "x", "traceback": ["tb"]},
                "truncated": false, "duration_ms": 12.5
            })
        );
    }

    #[test]
    fn states_and_statuses_keep_their_names() {
        for s in [
            SessionState::Starting,
            SessionState::Idle,
            SessionState::Busy,
            SessionState::Paused,
            SessionState::Dead,
            SessionState::Expired,
            SessionState::Closed,
        ] {
            let ours = SessionStateJson::from(s);
            assert_eq!(ours.as_str(), s.as_str());
            assert_eq!(
                serde_json::to_string(&ours).unwrap(),
                serde_json::to_string(&s).unwrap()
            );
        }
        for s in [
            ExecutionStatus::Ok,
            ExecutionStatus::Error,
            ExecutionStatus::Timeout,
            ExecutionStatus::Interrupted,
            ExecutionStatus::Dead,
        ] {
            assert_eq!(
                serde_json::to_string(&ExecutionStatusJson::from(s)).unwrap(),
                serde_json::to_string(&s).unwrap()
            );
        }
    }

    #[test]
    fn files_and_sessions_keep_their_shapes() {
        let f = FileEntry {
            path: "a/b.txt".into(),
            size: 3,
            modified: "2024-05-01T12:00:00.123456789Z".parse().unwrap(),
        };
        assert_eq!(
            serde_json::to_string(&FileJson::from(f.clone())).unwrap(),
            serde_json::to_string(&f).unwrap()
        );
        let t: DateTime<Utc> = "2024-05-01T12:00:00Z".parse().unwrap();
        let info = SessionInfo {
            id: Uuid::nil(),
            user: "u".into(),
            kernel: "python3".into(),
            state: SessionState::Idle,
            created_at: t,
            last_activity: t,
            expires_at: None,
            execution_count: 0,
            connections: 1,
            memory_limit_bytes: 256 << 20,
            memory_used_bytes: Some(52 << 20),
            dead_reason: None,
            provenance: Default::default(),
            secrets: vec!["API_KEY".into()],
        };
        assert_eq!(
            serde_json::to_string(&SessionJson::from(info)).unwrap(),
            "{\"id\":\"00000000-0000-0000-0000-000000000000\",\"user\":\"u\",\"kernel\":\"python3\",\
             \"state\":\"idle\",\"created_at\":\"2024-05-01T12:00:00.000000Z\",\
             \"last_activity\":\"2024-05-01T12:00:00.000000Z\",\"expires_at\":null,\
             \"execution_count\":0,\"connections\":1,\"memory_limit_bytes\":268435456,\
             \"memory_used_bytes\":54525952,\"dead_reason\":null,\"front_door\":\"rest\",\"metadata\":{},\
             \"secrets\":[\"API_KEY\"]}"
        );
    }
}
