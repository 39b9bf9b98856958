//! Running code from MCP: `run_python` in this connection's own session (or a named one),
//! and `run_code` in the session of the language asked: a named session of that language,
//! else this connection's own session of it, made on first use in the workspace of its own
//! Python session (so a file uploaded once is every language's).

use std::sync::Arc;

use rmcp::model::ProgressNotificationParam;
use tokio::sync::mpsc;

use super::args::{RunCodeArgs, RunPythonArgs};
use super::call::{Call, Made};
use super::content;
use super::server::McpServer;
use super::tools::{session_error, tool_error, Outcome, Refusal};
use crate::session::{
    CreateOptions, ExecuteRequest, Origin, Session, SessionError, Timeout, WorkspaceChoice,
};

impl McpServer {
    pub(super) async fn run_python_call(&self, call: Call, args: RunPythonArgs) -> Outcome {
        // The request is checked before a session is made for it.
        let request = match request(&call, args.code, args.timeout_seconds) {
            Ok(r) => r,
            Err(refused) => return Ok(refused),
        };
        let session = self
            .session_or_refusal(&call, args.session_id.as_deref(), true)
            .await;
        self.execute_call(call, session, request).await
    }

    /// `run_code`: the session of the language asked (a named one must run that language;
    /// otherwise this connection's own of that language), then as `run_python`.
    pub(super) async fn run_code_call(&self, call: Call, args: RunCodeArgs) -> Outcome {
        let request = match request(&call, args.code, args.timeout_seconds) {
            Ok(r) => r,
            Err(refused) => return Ok(refused),
        };
        let specs = call.state.kernelspecs.clone();
        let kernel = match args
            .language
            .as_deref()
            .map(str::trim)
            .filter(|l| !l.is_empty())
        {
            None => None,
            Some(language) => match specs.resolve(language) {
                Some(spec) => Some(spec.name.clone()),
                None => {
                    return Ok(tool_error(format!(
                        "language {:?} is not available here; the languages are: {}",
                        language.chars().take(64).collect::<String>(),
                        specs.summary()
                    )))
                }
            },
        };
        let session = match (args.session_id.as_deref(), kernel) {
            (Some(id), kernel) => match self.session_or_refusal(&call, Some(id), false).await {
                Ok(s) => match kernel {
                    Some(k) if k != s.kernel_name => {
                        return Ok(tool_error(format!(
                            "session {} runs {}, not {k}: leave session_id out to use this connection's own {k} session, or create one with create_session",
                            s.id, s.kernel_name
                        )))
                    }
                    _ => Ok(s),
                },
                Err(m) => Err(m),
            },
            (None, Some(k)) if k != specs.default_name() => self.language_session(&call, &k).await,
            (None, _) => self.session_or_refusal(&call, None, true).await,
        };
        self.execute_call(call, session, request).await
    }

    /// This connection's own session of `kernel`, made on first use in the workspace of its
    /// own (Python) session, which is made first if need be.
    async fn language_session(&self, call: &Call, kernel: &str) -> Result<Arc<Session>, Refusal> {
        let owner = self.session_or_refusal(call, None, true).await?;
        let user = &call.caller.0.name;
        let mut made = self.own.languages().lock().await;
        if let Some(m) = made.get(kernel) {
            match call.state.registry.get(user, m.id) {
                Ok(s) => return Ok(s),
                Err(_) => {
                    made.remove(kernel);
                }
            }
        }
        let room = crate::api::cluster::quota::room(&call.state, &call.caller.0)
            .await
            .map_err(|e| Refusal(session_error(e)))?;
        let session = call
            .state
            .registry
            .create_session(room.request(call.caller.0.create_request(CreateOptions {
                provenance: call.provenance(),
                kernel: Some(kernel.to_string()),
                workspace: WorkspaceChoice::OwnOf(owner.id),
                ..CreateOptions::default()
            })))
            .await
            .map_err(|e| Refusal(session_error(room.explain(e))))?;
        drop(room);
        tracing::info!(session = %session.id, user = %user, kernel, "MCP session made a session of another language");
        made.insert(
            kernel.to_string(),
            Made {
                id: session.id,
                user: user.clone(),
                state: call.state.clone(),
            },
        );
        Ok(session)
    }

    async fn execute_call(
        &self,
        call: Call,
        session: Result<Arc<Session>, Refusal>,
        request: ExecuteRequest,
    ) -> Outcome {
        let session = match session {
            Ok(s) => s,
            Err(m) => return Ok(tool_error(m.0)),
        };
        let progress = call.context.meta.get_progress_token();
        // Output is streamed only to a client that asked for progress; the actor drops
        // what does not fit the queue (it never waits for us), the result still has it all.
        let (out_tx, mut out_rx) = mpsc::channel(256);
        let request = match progress {
            Some(_) => request.streaming(out_tx),
            None => request,
        };
        let mut finished = match session.submit(request) {
            Ok(done) => done,
            Err(e) => return Ok(tool_error(session_error(e))),
        };
        let mut streaming = progress.is_some();
        let mut interrupted = false;
        let mut count = 0u32;
        let execution = loop {
            tokio::select! {
                result = &mut finished => break result,
                event = out_rx.recv(), if streaming => match (event, &progress) {
                    (Some(event), Some(token)) => {
                        if let Some(message) = content::progress_message(&event) {
                            count += 1;
                            let note = ProgressNotificationParam::new(token.clone(), f64::from(count))
                                .with_message(message);
                            // A client gone away is the cancellation's business, below.
                            let _ = call.context.peer.notify_progress(note).await;
                        }
                    }
                    _ => streaming = false,
                },
                // The client cancelled the call (or went away): stop the code, as Ctrl-C
                // would, and answer with what it produced.
                () = call.context.ct.cancelled(), if !interrupted => {
                    interrupted = true;
                    let _ = session.interrupt().await;
                }
            }
        };
        match execution {
            Ok(execution) => Ok(content::execution_result(
                &execution,
                call.state.registry.config().output_limit,
            )),
            Err(_) => Ok(tool_error(session_error(SessionError::Closed(session.id)))),
        }
    }
}

/// The execution asked, checked against the limits; a refusal is the tool's error result.
fn request(
    call: &Call,
    code: String,
    timeout_seconds: Option<f64>,
) -> Result<ExecuteRequest, rmcp::model::CallToolResult> {
    let limits = call.state.execution_limits();
    ExecuteRequest::new(code, Timeout::Asked(timeout_seconds), Origin::Mcp, &limits).map_err(|e| {
        match e {
            SessionError::CodeTooLarge { .. } => tool_error(format!(
                "{e}: run it in smaller parts, or upload it as a file and exec it"
            )),
            e => tool_error(session_error(e)),
        }
    })
}
