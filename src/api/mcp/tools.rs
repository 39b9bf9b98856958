//! The tools' work (their arguments are in `args.rs`), done through the session layer exactly as the REST handlers do it (`sessions.rs`,
//! `files.rs`): the same registry calls, limits, ownership and recording.
//!
//! What the caller can fix (an unknown session, code over the limit, a missing file, a full
//! quota) is a tool error (`isError: true`) whose text says what is wrong, as the MCP
//! specification asks, so a model reads it and tries again; malformed arguments (a wrong
//! type, a missing field) are rmcp's JSON-RPC `-32602`.

use std::sync::Arc;

use base64::Engine;
use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::ErrorData;

use super::args::{
    CreateSessionArgs, DeleteSessionArgs, DeleteSnapshotArgs, ForkSessionArgs, ReadFileArgs,
    RewindArgs, SessionArgs, SnapshotArgs, UploadFileArgs,
};
use super::call::{internal_or, workspace, Call, Made};
use super::content;
use super::server::McpServer;
use crate::api::checkpoints::{CheckpointJson, CheckpointsJson};
use crate::api::pause::PausedJson;
use crate::api::shapes::{FileJson, SessionJson};
use crate::api::snapshots::SnapshotJson;
use crate::session::{
    files, CreateOptions, EndedBy, ForkRequest, FrontDoor, Session, SessionError, WorkspaceChoice,
};

/// Why a tool cannot do what it was asked, in words for the model (its error result).
#[derive(Debug)]
pub(super) struct Refusal(pub String);

/// What a tool answers: a result (maybe an error result) or a protocol error.
pub(super) type Outcome = Result<CallToolResult, ErrorData>;

/// A message for the model, as a tool error.
pub(super) fn tool_error(message: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message.into())])
}

fn text(message: impl Into<String>) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(message.into())])
}

fn json_text(value: &impl serde::Serialize) -> Outcome {
    serde_json::to_string_pretty(value)
        .map(text)
        .map_err(|e| ErrorData::internal_error(format!("serialise the answer: {e}"), None))
}

/// How a session error reads to a model; a foreign session reads as a missing one (the
/// registry answers both as `NotFound`).
pub(super) fn session_error(e: SessionError) -> String {
    e.to_string()
}

fn parse_id(id: &str) -> Result<uuid::Uuid, String> {
    uuid::Uuid::parse_str(id.trim())
        .map_err(|_| format!("no session {id:?} (session ids are UUIDs; see list_sessions)"))
}

fn parse_checkpoint(id: &str) -> Result<uuid::Uuid, String> {
    uuid::Uuid::parse_str(id.trim()).map_err(|_| {
        format!("no checkpoint {id:?} (checkpoint ids are UUIDs; see list_checkpoints)")
    })
}

impl McpServer {
    /// The session a call names, or this MCP session's own, made now if `create` and
    /// there is none yet.
    async fn session(
        &self,
        call: &Call,
        id: Option<&str>,
        create: bool,
    ) -> Result<Arc<Session>, String> {
        let user = &call.caller.0.name;
        if let Some(id) = id {
            return call
                .state
                .registry
                .get(user, parse_id(id)?)
                .map_err(session_error);
        }
        let mut slot = self.own.slot().lock().await;
        if let Some(made) = slot.as_ref() {
            return match call.state.registry.get(user, made.id) {
                Ok(s) => Ok(s),
                Err(e) => {
                    // Expired or deleted: say so once; the next call starts a new session.
                    *slot = None;
                    Err(format!(
                        "{}; this connection's session is gone with its variables: call again to start a new one",
                        session_error(e)
                    ))
                }
            };
        }
        if !create {
            return Err("this connection has no session yet (run_python makes one)".into());
        }
        let room = crate::api::cluster::quota::room(&call.state, &call.caller.0)
            .await
            .map_err(session_error)?;
        let session = call
            .state
            .registry
            .create_session(room.request(call.caller.0.create_request(CreateOptions {
                provenance: call.provenance(),
                // An MCP session is a sandbox, as E2B's: files of its own (issue 36).
                workspace: WorkspaceChoice::Own,
                ..CreateOptions::default()
            })))
            .await
            .map_err(|e| session_error(room.explain(e)))?;
        drop(room);
        tracing::info!(session = %session.id, user = %user, "MCP session made its session");
        *slot = Some(Made {
            id: session.id,
            user: user.clone(),
            state: call.state.clone(),
        });
        Ok(session)
    }

    /// [`Self::session`] for the other files of this module: what the model is told when
    /// there is none, as a [`Refusal`].
    pub(super) async fn session_or_refusal(
        &self,
        call: &Call,
        id: Option<&str>,
        create: bool,
    ) -> Result<Arc<Session>, Refusal> {
        self.session(call, id, create).await.map_err(Refusal)
    }

    /// The id of this MCP session's own session, if it has one.
    async fn own_id(&self) -> Option<uuid::Uuid> {
        self.own.slot().lock().await.as_ref().map(|m| m.id)
    }

    pub(super) async fn upload_file_call(&self, call: Call, args: UploadFileArgs) -> Outcome {
        let max = call.state.limits.max_file_bytes;
        // Refused before decoding: base64 is 4 characters per 3 bytes.
        if args.content_base64.len() / 4 * 3 > max + 3 {
            return Ok(tool_error(format!(
                "the file is larger than the limit of {max} bytes"
            )));
        }
        let data =
            match base64::engine::general_purpose::STANDARD.decode(args.content_base64.trim()) {
                Ok(d) => d,
                Err(e) => {
                    return Ok(tool_error(format!(
                        "content_base64 is not valid base64: {e}"
                    )))
                }
            };
        if data.len() > max {
            return Ok(tool_error(format!(
                "the file has {} bytes; the limit is {max}",
                data.len()
            )));
        }
        if let Err(e) = files::clean_relative(&args.path) {
            return Ok(tool_error(session_error(e)));
        }
        let session = match self.session(&call, args.session_id.as_deref(), true).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        session.touch();
        let ws = workspace(&call, &session)?;
        let len = data.len();
        Ok(match internal_or(ws.write(&args.path, data).await)? {
            Ok(_) => text(format!(
                "wrote {len} bytes to {} in the workspace",
                args.path
            )),
            Err(e) => tool_error(session_error(e)),
        })
    }

    pub(super) async fn read_file_call(&self, call: Call, args: ReadFileArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), true).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        session.touch();
        let max = call.state.limits.max_file_bytes;
        let read = workspace(&call, &session)?.read(&args.path, max).await;
        Ok(match internal_or(read)? {
            Ok(bytes) => CallToolResult::success(vec![content::file_content(&args.path, bytes)]),
            Err(e) => tool_error(session_error(e)),
        })
    }

    pub(super) async fn list_files_call(&self, call: Call, args: SessionArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), true).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        session.touch();
        let listing = workspace(&call, &session)?.list(10_000).await;
        match internal_or(listing)? {
            Ok(listing) => {
                let files: Vec<FileJson> = listing.files.into_iter().map(FileJson::from).collect();
                json_text(&serde_json::json!({"files": files, "truncated": listing.truncated}))
            }
            Err(e) => Ok(tool_error(session_error(e))),
        }
    }

    pub(super) async fn restart_call(&self, call: Call, args: SessionArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), true).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        Ok(match session.restart().await {
            Ok(()) => text(format!(
                "restarted the kernel of session {}: variables and imports are gone, workspace files stay",
                session.id
            )),
            Err(e) => tool_error(session_error(e)),
        })
    }

    pub(super) async fn interrupt_call(&self, call: Call, args: SessionArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        Ok(match session.interrupt().await {
            Ok(()) => text(format!("interrupted session {}", session.id)),
            Err(e) => tool_error(session_error(e)),
        })
    }

    pub(super) async fn list_sessions_call(&self, call: Call) -> Outcome {
        let own = self.own_id().await;
        let sessions: Vec<serde_json::Value> = call
            .state
            .registry
            .list(&call.caller.0.name)
            .iter()
            .map(|s| {
                let mut v = serde_json::to_value(SessionJson::from(s.info()))
                    .unwrap_or(serde_json::Value::Null);
                if let Some(obj) = v.as_object_mut() {
                    obj.insert("this_connection".into(), (Some(s.id) == own).into());
                }
                v
            })
            .collect();
        json_text(&serde_json::json!({ "sessions": sessions }))
    }

    pub(super) async fn create_session_call(&self, call: Call, args: CreateSessionArgs) -> Outcome {
        if let Err(e) = crate::secrets::check(&args.secrets) {
            return Ok(tool_error(e.to_string()));
        }
        if args.snapshot.is_some() && !args.secrets.is_empty() {
            return Ok(tool_error(
                "a session from a snapshot runs the snapshot's kernel: it cannot take secrets",
            ));
        }
        let snapshot = match args.snapshot.as_deref() {
            None => None,
            Some(s) => match call.state.registry.find_snapshot(&call.caller.0.name, s) {
                Some(found) => Some(found.snapshot_id),
                None => return Ok(tool_error(format!("no snapshot {s:?} of yours"))),
            },
        };
        let room = match crate::api::cluster::quota::room(&call.state, &call.caller.0).await {
            Ok(room) => room,
            Err(e) => return Ok(tool_error(session_error(e))),
        };
        let created = call
            .state
            .registry
            .create_session(room.request(call.caller.0.create_request(CreateOptions {
                kernel: args.kernel,
                idle_timeout_seconds: args.idle_timeout_seconds,
                id: None,
                memory_limit_bytes: args.memory_limit_bytes,
                provenance: call.provenance(),
                workspace: args.workspace.unwrap_or_default().into(),
                snapshot,
                secrets: args.secrets,
            })))
            .await
            .map_err(|e| room.explain(e));
        drop(room);
        match created {
            Ok(session) => json_text(&SessionJson::from(session.info())),
            Err(e) => Ok(tool_error(session_error(e))),
        }
    }

    pub(super) async fn delete_session_call(&self, call: Call, args: DeleteSessionArgs) -> Outcome {
        let id = match parse_id(&args.session_id) {
            Ok(id) => id,
            Err(m) => return Ok(tool_error(m)),
        };
        Ok(
            match call
                .state
                .registry
                .delete(&call.caller.0.name, id, EndedBy::Client(FrontDoor::Mcp))
                .await
            {
                Ok(()) => text(format!("deleted session {id}")),
                Err(e) => tool_error(session_error(e)),
            },
        )
    }

    pub(super) async fn fork_session_call(&self, call: Call, args: ForkSessionArgs) -> Outcome {
        let checkpoint = match args
            .checkpoint_id
            .as_deref()
            .map(parse_checkpoint)
            .transpose()
        {
            Ok(cp) => cp,
            Err(m) => return Ok(tool_error(m)),
        };
        let count = args.count.unwrap_or(1);
        if checkpoint.is_some() && count != 1 {
            return Ok(tool_error(
                "a checkpoint is forked one session at a time: leave count out, or call again",
            ));
        }
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        let base = call.caller.0.create_request(CreateOptions::default());
        let room = match crate::api::cluster::quota::room(&call.state, &call.caller.0).await {
            Ok(room) => room,
            Err(e) => return Ok(tool_error(session_error(e))),
        };
        let forked = call
            .state
            .registry
            .fork(ForkRequest {
                user: base.user,
                max_sessions: room.max_sessions(),
                session: session.id,
                count,
                checkpoint,
                provenance: call.provenance(),
            })
            .await
            .map_err(|e| room.explain(e));
        drop(room);
        match forked {
            Ok(forks) => {
                let sessions: Vec<SessionJson> =
                    forks.iter().map(|s| SessionJson::from(s.info())).collect();
                json_text(&serde_json::json!({ "sessions": sessions }))
            }
            Err(e) => Ok(tool_error(session_error(e))),
        }
    }

    pub(super) async fn checkpoint_call(&self, call: Call, args: SessionArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        let taken = call
            .state
            .registry
            .take_checkpoint(&call.caller.0.name, session.id, call.caller.0.checkpoints)
            .await;
        match taken {
            Ok(info) => json_text(&CheckpointJson::from(info)),
            Err(e) => Ok(tool_error(session_error(e))),
        }
    }

    pub(super) async fn list_checkpoints_call(&self, call: Call, args: SessionArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        let listed = call
            .state
            .registry
            .checkpoints(&call.caller.0.name, session.id)
            .await;
        match listed {
            Ok((list, usage)) => json_text(&CheckpointsJson::new(
                list,
                usage,
                call.caller.0.checkpoints,
            )),
            Err(e) => Ok(tool_error(session_error(e))),
        }
    }

    pub(super) async fn pause_call(&self, call: Call, args: SessionArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        match call
            .state
            .registry
            .pause(&call.caller.0.name, session.id)
            .await
        {
            Ok(info) => json_text(&PausedJson::new(session.id, info)),
            Err(e) => Ok(tool_error(session_error(e))),
        }
    }

    pub(super) async fn resume_call(&self, call: Call, args: SessionArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        match call
            .state
            .registry
            .resume(&call.caller.0.name, session.id)
            .await
        {
            Ok(()) => json_text(&SessionJson::from(session.info())),
            Err(e) => Ok(tool_error(session_error(e))),
        }
    }

    pub(super) async fn rewind_call(&self, call: Call, args: RewindArgs) -> Outcome {
        let checkpoint = match parse_checkpoint(&args.checkpoint_id) {
            Ok(cp) => cp,
            Err(m) => return Ok(tool_error(m)),
        };
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        let rewound = call
            .state
            .registry
            .rewind(&call.caller.0.name, session.id, checkpoint)
            .await;
        Ok(match rewound {
            Ok(s) => text(format!(
                "rewound session {} to checkpoint {checkpoint}: its variables, imports and execution count ({}) are as they were then; workspace files are not rewound; the checkpoint stays",
                s.id,
                s.info().execution_count
            )),
            Err(e) => tool_error(session_error(e)),
        })
    }
}

/// The snapshot tools (issue 37), as `api/snapshots.rs` does them; a session starts from a
/// snapshot through create_session's `snapshot`.
impl McpServer {
    pub(super) async fn snapshot_call(&self, call: Call, args: SnapshotArgs) -> Outcome {
        let session = match self.session(&call, args.session_id.as_deref(), false).await {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m)),
        };
        match call
            .state
            .registry
            .snapshot(&call.caller.0.name, session.id, args.name)
            .await
        {
            Ok(info) => json_text(&SnapshotJson::from(info)),
            Err(e) => Ok(tool_error(e.to_string())),
        }
    }

    pub(super) async fn list_snapshots_call(&self, call: Call) -> Outcome {
        let all: Vec<SnapshotJson> = call
            .state
            .registry
            .snapshots(&call.caller.0.name, None)
            .into_iter()
            .map(SnapshotJson::from)
            .collect();
        json_text(&serde_json::json!({ "snapshots": all }))
    }

    pub(super) async fn delete_snapshot_call(
        &self,
        call: Call,
        args: DeleteSnapshotArgs,
    ) -> Outcome {
        let user = &call.caller.0.name;
        let Some(found) = call
            .state
            .registry
            .find_snapshot(user, args.snapshot.trim())
        else {
            return Ok(tool_error(format!(
                "no snapshot {:?} of yours (see list_snapshots)",
                args.snapshot
            )));
        };
        match call
            .state
            .registry
            .delete_snapshot(user, found.snapshot_id)
            .await
        {
            Ok(()) => Ok(CallToolResult::success(vec![ContentBlock::text(format!(
                "deleted snapshot {}",
                found.snapshot_id
            ))])),
            Err(e) => Ok(tool_error(e.to_string())),
        }
    }
}
