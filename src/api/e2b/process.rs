//! envd's Connect process service (JSON): `Start` (server streaming: `start`, `data`,
//! `end` events, keepalives), `Connect` (the events of a running command), `List`,
//! `SendInput`, `CloseStdin`, `SendSignal`, `Update` (a terminal's size). A command runs in
//! the user's sandbox through `Registry::run_command` (the sandbox's `run_command`),
//! isolated and limited as the user's kernels are, never on the host; it ends with its
//! sandbox. A `Start` with `pty` runs it on a pseudo-terminal (`pty.rs`). `StreamInput`
//! (client streaming) is not supported.
//!
//! Lifecycle, as envd and E2B's proxy: `Connect-Timeout-Ms` is a call's deadline (a
//! `Start`'s command is killed then and its stream ends `deadline_exceeded`); a stream whose
//! sandbox ends under it ends `unavailable` ("the connection to sandbox ... ended before the
//! stream completed"), which the SDKs check against `/health` and report as the sandbox's end
//! (`stream.rs`).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::SandboxCaller;
use super::command::{Command, Fanout};
use super::connect::{
    end_stream, envelope, stream_request, unary_request, ConnectError, MAX_MESSAGE,
};
use super::documented::SandboxErrors;
use super::pty::{self, PtyReq};
pub(super) use super::stream::sandbox_gone;
use super::stream::{request_deadline, stream_error, stream_response, StreamEnds};
use crate::api::extract::read_limited;
use crate::api::AppState;
use crate::session::{check_user_env, CommandRequest};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(process))
}

#[derive(Deserialize, Default)]
struct ProcessConfig {
    #[serde(default)]
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: std::collections::BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize)]
struct StartReq {
    process: Option<ProcessConfig>,
    pty: Option<PtyReq>,
    tag: Option<String>,
}

#[derive(Deserialize, Default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize)]
struct SelectReq {
    #[serde(default)]
    process: Selector,
    input: Option<Value>,
    signal: Option<Value>,
    pty: Option<PtyReq>,
}

/// envd's Connect process service: `Start`, `Connect` (streams), `List`, `SendInput`, `CloseStdin`, `SendSignal`, `Update`
#[utoipa::path(post, operation_id = "e2b_process", path = "/e2b/sandbox/process.Process/{method}", tag = "e2b", security(()),
    params(("method" = String, Path)),
    responses((status = 200, description = "the response message, or for `Start`/`Connect` a Connect stream (`application/connect+json`)", body = serde_json::Value), SandboxErrors))]
async fn process(
    State(state): State<AppState>,
    Path(method): Path<String>,
    caller: SandboxCaller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let streaming = matches!(method.as_str(), "Start" | "Connect");
    let deadline = match request_deadline(&headers) {
        Ok(d) => d,
        Err(e) if streaming => return stream_error(e),
        Err(e) => return e.into_response(),
    };
    let bytes = match read_limited(body, MAX_MESSAGE + 5, "request").await {
        Ok(b) => b,
        // The rest of the body is not read: the connection closes after the answer, which
        // says so, so that a client does not send its next request on it and lose it.
        Err(e) => {
            let mut answer = ConnectError::new("resource_exhausted", e.message).into_response();
            answer
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return answer;
        }
    };
    caller.session.touch();
    let result = match method.as_str() {
        "Start" => return start(&state, &caller, &bytes, deadline).await,
        "Connect" => return connect(&state, &caller, &bytes, deadline),
        "List" => Ok(list(&caller)),
        "SendInput" => send_input(&caller, &bytes).await,
        "CloseStdin" => close_stdin(&caller, &bytes).await,
        "SendSignal" => send_signal(&caller, &bytes).await,
        "Update" => update(&caller, &bytes).await,
        other => Err(ConnectError::unimplemented(format!(
            "process.Process/{other} is not supported by kernel-broker"
        ))),
    };
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn start(
    state: &AppState,
    caller: &SandboxCaller,
    bytes: &[u8],
    deadline: Option<Instant>,
) -> Response {
    let req: StartReq = match stream_request(bytes) {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    let pty = match req.pty.as_ref().map(PtyReq::size).transpose() {
        Ok(p) => p,
        Err(e) => return stream_error(e),
    };
    let config = req.process.unwrap_or_default();
    if config.cmd.is_empty() {
        return stream_error(ConnectError::invalid("process.cmd is empty"));
    }
    // A 400 before anything runs; what passes is still applied only after the sandbox's
    // drop to the kernel's uid (sandbox/environ.rs).
    if let Err(e) = check_user_env(config.envs.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
        return stream_error(ConnectError::invalid(format!("process.envs: {e}")));
    }
    let mut argv = vec![config.cmd.clone()];
    argv.extend(config.args.iter().cloned());
    let (mut env, declared) = caller
        .e2b
        .with(caller.session.id, |m| {
            (
                m.env.clone(),
                super::control::declared_secrets(Some(&m.metadata)),
            )
        })
        .unwrap_or_default();
    // `envs` the sandbox declared secret are masked from now on.
    let secret: std::collections::BTreeMap<String, String> = config
        .envs
        .iter()
        .filter(|(k, _)| declared.contains(*k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Err(e) = caller.session.secrets.add(&secret) {
        return stream_error(ConnectError::invalid(format!("process.envs: {e}")));
    }
    env.extend(config.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    let cwd = config.cwd.clone().filter(|c| !c.is_empty());
    if let Some(dir) = &cwd {
        if let Err(e) = cwd_exists(state, caller, dir).await {
            return stream_error(e);
        }
    }
    let request = CommandRequest {
        argv,
        env,
        cwd,
        pty,
    };
    let running = match state.registry.run_command(&caller.session, request).await {
        Ok(r) => r,
        Err(e) => return stream_error(ConnectError::new("failed_precondition", e.to_string())),
    };
    let events = Arc::new(Fanout::default());
    let first = events.subscribe();
    let budget = caller.e2b.command_output.of(&caller.session.user.name);
    let cmd = Arc::new(Command {
        pid: running.pid,
        tag: req.tag,
        config: json!({"cmd": config.cmd, "args": config.args, "envs": config.envs, "cwd": config.cwd}),
        control: running.control.clone(),
        stdin: tokio::sync::Mutex::new(Some(running.stdin)),
        events: events.clone(),
        pty: pty.is_some(),
    });
    // A pid names one live command: a second with the same number (which the sandbox's
    // pid namespace never gives two live processes) would take the first one's input.
    let added = caller
        .e2b
        .with(caller.session.id, |m| match m.commands.entry(cmd.pid) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(cmd.clone());
                true
            }
        });
    if added != Some(true) {
        running.control.kill().await;
        return stream_error(match added {
            None => ConnectError::not_found("the sandbox has ended"),
            Some(_) => ConnectError::new(
                "internal",
                format!("a process with pid {} is already running", cmd.pid),
            ),
        });
    }
    // The caller's deadline kills the command, as envd runs it under a context with that
    // deadline (its other clients see it end, killed).
    if let Some(at) = deadline {
        let control = running.control.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep_until(at) => control.kill().await,
                _ = control.wait() => {}
            }
        });
    }
    // Reads both streams into events, then the end; forgets the command once it ended.
    let ends = StreamEnds::of(state, caller, None);
    let (e2b, sandbox, pid, control) = (
        caller.e2b.clone(),
        caller.session.id,
        cmd.pid,
        running.control,
    );
    tokio::spawn(async move {
        // A terminal's output is one stream, sent as `pty` data.
        let out = tokio::spawn(pump(
            running.stdout,
            if pty.is_some() { "pty" } else { "stdout" },
            events.clone(),
            budget.clone(),
        ));
        let err = tokio::spawn(pump(running.stderr, "stderr", events.clone(), budget));
        let _ = out.await;
        let _ = err.await;
        let exit = control.wait().await;
        let (code, status, error) = match (exit.code, exit.signal) {
            (Some(c), _) => (c, format!("exit status {c}"), None),
            (None, Some(s)) => {
                let name = if s == libc::SIGKILL {
                    "killed".to_string()
                } else {
                    format!("signal {s}")
                };
                (
                    -1,
                    format!("signal: {name}"),
                    Some(format!("signal: {name}")),
                )
            }
            (None, None) => (-1, "unknown".to_string(), Some("unknown end".to_string())),
        };
        let mut end = json!({"exitCode": code, "exited": exit.code.is_some(), "status": status});
        if let Some(e) = error {
            end["error"] = e.into();
        }
        // Killed with its sandbox: after its `end` (what happened to it), the stream ends
        // with E2B's `unavailable`, as its proxy ends a stream whose sandbox went away, so
        // the SDKs raise their "the sandbox is not running" error, not the exit code.
        let mut last = envelope(&json!({"event": {"end": end}})).to_vec();
        if ends.sandbox_gone() {
            last.extend_from_slice(&ends.dropped());
        } else {
            last.extend_from_slice(&end_stream(None));
        }
        let last = Bytes::from(last);
        e2b.with(sandbox, |m| {
            if m.commands
                .get(&pid)
                .is_some_and(|c| Arc::ptr_eq(&c.events, &events))
            {
                m.commands.remove(&pid);
            }
        });
        events.end(last);
    });
    let mut ends = StreamEnds::of(state, caller, deadline);
    ends.kill = Some(cmd.control.clone());
    stream_response(
        envelope(&json!({"event": {"start": {"pid": pid}}})),
        first,
        ends,
    )
}

/// Bytes read from a command's pipe at once.
const CHUNK: usize = 32 << 10;

/// Reads one of a command's pipes into `events` until it closes. Each chunk's envelope takes
/// its size in permits of the user's `budget` before it is published, waiting while the
/// budget is spent (and not reading the pipe meanwhile: that is the back-pressure, see
/// [`Fanout`]). With no client listening, output is not held.
async fn pump(
    mut from: Box<dyn AsyncRead + Send + Unpin>,
    stream: &'static str,
    events: Arc<Fanout>,
    budget: Arc<Semaphore>,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !events.listened() {
            continue;
        }
        let bytes = envelope(&json!({"event": {"data": {stream: B64.encode(&buf[..n])}}}));
        // An envelope of a chunk (~44 KiB) is far below any budget, and below u32::MAX.
        let Ok(size) = u32::try_from(bytes.len()) else {
            return;
        };
        let Ok(permit) = budget.clone().acquire_many_owned(size).await else {
            return;
        };
        events.publish(bytes, permit);
    }
}

fn find(caller: &SandboxCaller, sel: &Selector) -> Result<Arc<Command>, ConnectError> {
    caller
        .e2b
        .with(caller.session.id, |m| {
            m.commands
                .values()
                .find(|c| match (sel.pid, &sel.tag) {
                    (Some(pid), _) => c.pid == pid,
                    (None, Some(tag)) => c.tag.as_deref() == Some(tag.as_str()),
                    (None, None) => false,
                })
                .cloned()
        })
        .flatten()
        .ok_or_else(|| ConnectError::not_found("no such process (it may have ended)"))
}

fn connect(
    state: &AppState,
    caller: &SandboxCaller,
    bytes: &[u8],
    deadline: Option<Instant>,
) -> Response {
    let req: SelectReq = match stream_request(bytes) {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    let cmd = match find(caller, &req.process) {
        Ok(c) => c,
        Err(e) => return stream_error(e),
    };
    stream_response(
        envelope(&json!({"event": {"start": {"pid": cmd.pid}}})),
        cmd.events.subscribe(),
        StreamEnds::of(state, caller, deadline),
    )
}

fn list(caller: &SandboxCaller) -> Value {
    let processes: Vec<Value> = caller
        .e2b
        .with(caller.session.id, |m| {
            m.commands
                .values()
                .map(|c| {
                    let mut p = json!({"config": c.config, "pid": c.pid});
                    if let Some(t) = &c.tag {
                        p["tag"] = t.clone().into();
                    }
                    p
                })
                .collect()
        })
        .unwrap_or_default();
    json!({"processes": processes})
}

async fn send_input(caller: &SandboxCaller, bytes: &[u8]) -> Result<Value, ConnectError> {
    let req: SelectReq = unary_request(bytes)?;
    let cmd = find(caller, &req.process)?;
    let input = req.input.unwrap_or_default();
    let data = match (input.get("stdin"), input.get("pty")) {
        (Some(Value::String(s)), _) if !cmd.pty => B64
            .decode(s)
            .map_err(|e| ConnectError::invalid(format!("input.stdin is not base64: {e}")))?,
        (_, Some(Value::String(s))) if cmd.pty => {
            let data = B64
                .decode(s)
                .map_err(|e| ConnectError::invalid(format!("input.pty is not base64: {e}")))?;
            return pty::write(&cmd, &data).await;
        }
        // As envd answers input of the other kind.
        (Some(_), _) if cmd.pty => return Err(pty::stdin_of_a_terminal()),
        (_, Some(_)) if !cmd.pty => return Err(pty::not_a_terminal("writing to tty")),
        _ => return Err(ConnectError::invalid("input.stdin is missing")),
    };
    let mut stdin = cmd.stdin.lock().await;
    let pipe = stdin
        .as_mut()
        .ok_or_else(|| ConnectError::new("failed_precondition", "the process's stdin is closed"))?;
    pipe.write_all(&data).await.map_err(|e| {
        ConnectError::new(
            "failed_precondition",
            format!("writing to stdin failed: {e}"),
        )
    })?;
    let _ = pipe.flush().await;
    Ok(json!({}))
}

async fn close_stdin(caller: &SandboxCaller, bytes: &[u8]) -> Result<Value, ConnectError> {
    let req: SelectReq = unary_request(bytes)?;
    let cmd = find(caller, &req.process)?;
    if cmd.pty {
        return Err(ConnectError::new(
            "unknown",
            "error closing stdin: cannot close stdin for PTY process — send Ctrl+D (0x04) instead",
        ));
    }
    if let Some(mut pipe) = cmd.stdin.lock().await.take() {
        let _ = pipe.shutdown().await;
    }
    Ok(json!({}))
}

async fn send_signal(caller: &SandboxCaller, bytes: &[u8]) -> Result<Value, ConnectError> {
    let req: SelectReq = unary_request(bytes)?;
    let cmd = find(caller, &req.process)?;
    match req
        .signal
        .as_ref()
        .and_then(|s| {
            s.as_str()
                .map(str::to_string)
                .or_else(|| s.as_i64().map(|n| n.to_string()))
        })
        .as_deref()
    {
        Some("SIGNAL_SIGKILL" | "9") => cmd.control.kill().await,
        Some("SIGNAL_SIGTERM" | "15") => cmd.control.signal(libc::SIGTERM).await,
        other => {
            return Err(ConnectError::invalid(format!(
                "signal {other:?} is not one of SIGNAL_SIGKILL, SIGNAL_SIGTERM"
            )))
        }
    }
    Ok(json!({}))
}

/// `Update`: a terminal's new size (envd's only update); without `pty`, nothing changes.
async fn update(caller: &SandboxCaller, bytes: &[u8]) -> Result<Value, ConnectError> {
    let req: SelectReq = unary_request(bytes)?;
    let cmd = find(caller, &req.process)?;
    if let Some(p) = &req.pty {
        pty::resize(&cmd, p.size()?).await?;
    }
    Ok(json!({}))
}

/// How long the sandbox may take to say whether a working directory exists.
const CWD_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// envd refuses a command whose `cwd` does not exist before starting it (`invalid_argument`,
/// "cwd '...' does not exist"; no `start` event). The path is the kernel's to choose (its
/// files, its symlinks), so it is looked up only inside the sandbox, never on the host: a
/// first tiny command, `test -e` with the path as an argument (never read by a shell), run
/// from the sandbox's home as the command would be, so a relative path resolves the same.
async fn cwd_exists(
    state: &AppState,
    caller: &SandboxCaller,
    dir: &str,
) -> Result<(), ConnectError> {
    let probe = CommandRequest {
        argv: ["/bin/sh", "-c", "test -e \"$1\"", "sh", dir]
            .map(str::to_string)
            .to_vec(),
        env: Vec::new(),
        cwd: None,
        pty: None,
    };
    let running = state
        .registry
        .run_command(&caller.session, probe)
        .await
        .map_err(|e| ConnectError::new("failed_precondition", e.to_string()))?;
    drop(running.stdin);
    let exit = tokio::time::timeout(CWD_PROBE_TIMEOUT, running.control.wait()).await;
    match exit {
        Ok(exit) if exit.code == Some(0) => Ok(()),
        Ok(exit) if exit.code == Some(1) => {
            let shown = if dir.starts_with('/') {
                dir.to_string()
            } else {
                format!("{}/{dir}", super::WORKDIR)
            };
            Err(ConnectError::invalid(format!(
                "cwd '{shown}' does not exist"
            )))
        }
        Ok(exit) => Err(ConnectError::new(
            "internal",
            format!("cannot check the working directory in the sandbox: {exit:?}"),
        )),
        Err(_) => {
            running.control.kill().await;
            Err(ConnectError::new(
                "deadline_exceeded",
                "the sandbox took too long to check the working directory",
            ))
        }
    }
}
