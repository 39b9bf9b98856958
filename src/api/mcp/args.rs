//! The tools' arguments: their JSON schemas (through `schemars`), written for a model to
//! read. Their own file so that the server (which declares the tools) and the tools (which
//! do the work) each use them without using each other.

use schemars::JsonSchema;
use serde::Deserialize;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunPythonArgs {
    /// Python source to run, as in a notebook cell (the last expression's value is the
    /// result; `%magics` and `!shell` work).
    pub code: String,
    /// A session id from create_session or list_sessions; leave it out to use this
    /// connection's own session (created on first use).
    pub session_id: Option<String>,
    /// Seconds before the run is interrupted (default and maximum: the broker's).
    #[schemars(range(min = 0.001))]
    pub timeout_seconds: Option<f64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCodeArgs {
    /// Source to run, as in a notebook cell of that language.
    pub code: String,
    /// The language (a kernel's name or alias): `python` (the default), `r`, `javascript`
    /// (or `js`, `typescript`, `ts`: Deno), `bash`, `java`, `sql` (DuckDB over the
    /// workspace's files), as this broker has them (see the tool's description).
    pub language: Option<String>,
    /// A session id from create_session or list_sessions (its kernel must be of that
    /// language); leave it out to use this connection's own session of that language
    /// (created on first use, sharing the workspace of the connection's other sessions).
    pub session_id: Option<String>,
    /// Seconds before the run is interrupted (default and maximum: the broker's).
    #[schemars(range(min = 0.001))]
    pub timeout_seconds: Option<f64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadFileArgs {
    /// Where to write, relative to the workspace (e.g. `data/sales.csv`); no `..`.
    pub path: String,
    /// The file's bytes, base64-encoded.
    pub content_base64: String,
    /// A session id; leave it out to use this connection's own session.
    pub session_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// The file to read, relative to the workspace.
    pub path: String,
    /// A session id; leave it out to use this connection's own session.
    pub session_id: Option<String>,
}

#[derive(Deserialize, JsonSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct SessionArgs {
    /// A session id; leave it out to use this connection's own session.
    pub session_id: Option<String>,
}

#[derive(Deserialize, JsonSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionArgs {
    /// A kernel spec name (default: the broker's default kernel).
    pub kernel: Option<String>,
    /// Seconds without activity before the session expires (capped by the broker).
    pub idle_timeout_seconds: Option<u64>,
    /// The kernel's memory limit in bytes (default: the user's per-kernel default).
    pub memory_limit_bytes: Option<u64>,
    /// `own` (default): an empty workspace of the session's own at `/home/user` (also
    /// `/workspace`) with a `/tmp` of its own, removed when the session ends; its forks and
    /// checkpoints hold copies of its files. `shared`: the user's workspace, shared by all
    /// her sessions and kept after them.
    pub workspace: Option<WorkspaceArg>,
    /// Start from this snapshot of yours (its id or name, from snapshot_session or
    /// list_snapshots): its variables, imports and a copy of its files. The session then
    /// has a workspace of its own.
    pub snapshot: Option<String>,
    /// Secret values by environment variable name: the session's kernel gets them as
    /// environment variables, and every output, recording and export shows
    /// `[secret:NAME]` in a value's place (4 to 4,096 bytes each, at most 8,192 together, at most 32).
    #[serde(default)]
    pub secrets: std::collections::BTreeMap<String, String>,
}

/// Which workspace a session made through MCP works in.
#[derive(Deserialize, JsonSchema, Clone, Copy, Default)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceArg {
    #[default]
    Own,
    Shared,
}

impl From<WorkspaceArg> for crate::session::WorkspaceChoice {
    fn from(arg: WorkspaceArg) -> Self {
        match arg {
            WorkspaceArg::Own => Self::Own,
            WorkspaceArg::Shared => Self::Shared,
        }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteSessionArgs {
    /// The session to shut down.
    pub session_id: String,
}

#[derive(Deserialize, JsonSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct ForkSessionArgs {
    /// The session to fork; leave it out to fork this connection's own session.
    pub session_id: Option<String>,
    /// How many forks to make (1 to 8, default 1).
    #[schemars(range(min = 1, max = 8))]
    pub count: Option<u64>,
    /// Fork this checkpoint of the session (from `checkpoint` or `list_checkpoints`)
    /// instead of its kernel as it is now; one fork.
    pub checkpoint_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewindArgs {
    /// The checkpoint to go back to (from `checkpoint` or `list_checkpoints`).
    pub checkpoint_id: String,
    /// The session; leave it out to rewind this connection's own session.
    pub session_id: Option<String>,
}

#[derive(Deserialize, JsonSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct SnapshotArgs {
    /// A session id; leave it out to use this connection's own session.
    pub session_id: Option<String>,
    /// A name to find the snapshot by (letters, digits and `-_.:/`, at most 128).
    pub name: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteSnapshotArgs {
    /// The snapshot's id or name (the newest of that name).
    pub snapshot: String,
}
