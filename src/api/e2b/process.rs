//! envd's Connect process service (JSON): `Start` (server streaming: `start`, `data`,
//! `end` events, keepalives), `Connect` (the events of a running command), `List`,
//! `SendInput`, `CloseStdin`, `SendSignal`. A command runs in the user's sandbox through
//! `Registry::run_command` (the sandbox's `run_command`), isolated and limited
//! as the user's kernels are, never on the host; it ends with its sandbox. Pseudo
//! terminals (`pty`), `Update` and `StreamInput` are not supported.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::SandboxCaller;
use super::command::{Command, Event, Fanout};
use super::connect::{
    end_stream, envelope, stream_request, unary_request, ConnectError, MAX_MESSAGE,
};
use super::documented::SandboxErrors;
use crate::api::extract::read_limited;
use crate::api::AppState;
use crate::session::{check_user_env, CommandRequest};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;
/// How often a stream with nothing to say sends a keepalive event.
const KEEPALIVE: Duration = Duration::from_secs(30);

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
    pty: Option<Value>,
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
}

/// envd's Connect process service: `Start`, `Connect` (streams), `List`, `SendInput`, `CloseStdin`, `SendSignal`
#[utoipa::path(post, operation_id = "e2b_process", path = "/e2b/sandbox/process.Process/{method}", tag = "e2b", security(()),
    params(("method" = String, Path)),
    responses((status = 200, description = "the response message, or for `Start`/`Connect` a Connect stream (`application/connect+json`)", body = serde_json::Value), SandboxErrors))]
async fn process(
    State(state): State<AppState>,
    Path(method): Path<String>,
    caller: SandboxCaller,
    body: Body,
) -> Response {
    let bytes = match read_limited(body, MAX_MESSAGE + 5, "request").await {
        Ok(b) => b,
        Err(e) => return ConnectError::new("resource_exhausted", e.message).into_response(),
    };
    caller.session.touch();
    let result = match method.as_str() {
        "Start" => return start(&state, &caller, &bytes).await,
        "Connect" => return connect(&caller, &bytes),
        "List" => Ok(list(&caller)),
        "SendInput" => send_input(&caller, &bytes).await,
        "CloseStdin" => close_stdin(&caller, &bytes).await,
        "SendSignal" => send_signal(&caller, &bytes).await,
        other => Err(ConnectError::unimplemented(format!(
            "process.Process/{other} is not supported by kernel-broker"
        ))),
    };
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A Connect stream of `first`, then what `events` brings until the command's end (or until
/// the client leaves: the body is dropped, and with it the receiver and the budget its
/// unread events held); keepalives while nothing happens. An event's budget permits are let
/// go when the connection takes its bytes, so a client that does not read holds what the
/// connection buffers (hyper's write buffer) plus what waits here, within its user's budget.
fn stream_response(first: Bytes, events: mpsc::UnboundedReceiver<Event>) -> Response {
    enum Next {
        First(Bytes, mpsc::UnboundedReceiver<Event>),
        Events(mpsc::UnboundedReceiver<Event>),
        Done,
    }
    let stream = futures::stream::unfold(Next::First(first, events), |next| async move {
        let mut rx = match next {
            Next::First(first, rx) => return Some((first, Next::Events(rx))),
            Next::Events(rx) => rx,
            Next::Done => return None,
        };
        match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
            Err(_) => Some((
                envelope(&json!({"event": {"keepalive": {}}})),
                Next::Events(rx),
            )),
            Ok(Some(Event::Output(bytes, _budget))) => Some((bytes, Next::Events(rx))),
            Ok(Some(Event::End(bytes))) => {
                let mut last = bytes.to_vec();
                last.extend_from_slice(&end_stream(None));
                Some((Bytes::from(last), Next::Done))
            }
            // The command was forgotten without an end (its sandbox ended first).
            Ok(None) => Some((end_stream(None), Next::Done)),
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(stream.map(Ok::<_, std::convert::Infallible>)),
    )
        .into_response()
}

/// A stream that is only an error (Connect answers stream errors in the end envelope).
fn stream_error(e: ConnectError) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        end_stream(Some(&e)),
    )
        .into_response()
}

async fn start(state: &AppState, caller: &SandboxCaller, bytes: &[u8]) -> Response {
    let req: StartReq = match stream_request(bytes) {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    if req.pty.is_some() {
        return stream_error(ConnectError::unimplemented(
            "pseudo-terminals (pty) are not supported by kernel-broker",
        ));
    }
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
    let mut env = caller
        .e2b
        .with(caller.session.id, |m| m.env.clone())
        .unwrap_or_default();
    env.extend(config.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    let request = CommandRequest {
        argv,
        env,
        cwd: config.cwd.clone().filter(|c| !c.is_empty()),
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
    });
    let known = caller
        .e2b
        .with(caller.session.id, |m| {
            m.commands.insert(cmd.pid, cmd.clone())
        })
        .is_some();
    if !known {
        running.control.kill().await;
        return stream_error(ConnectError::not_found("the sandbox has ended"));
    }
    // Reads both streams into events, then the end; forgets the command once it ended.
    let (e2b, sandbox, pid, control) = (
        caller.e2b.clone(),
        caller.session.id,
        cmd.pid,
        running.control,
    );
    tokio::spawn(async move {
        let out = tokio::spawn(pump(
            running.stdout,
            "stdout",
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
        events.end(envelope(&json!({"event": {"end": end}})));
        e2b.with(sandbox, |m| m.commands.remove(&pid));
    });
    stream_response(envelope(&json!({"event": {"start": {"pid": pid}}})), first)
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

fn connect(caller: &SandboxCaller, bytes: &[u8]) -> Response {
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
        (Some(Value::String(s)), _) => B64
            .decode(s)
            .map_err(|e| ConnectError::invalid(format!("input.stdin is not base64: {e}")))?,
        (_, Some(_)) => return Err(ConnectError::unimplemented("pty input is not supported")),
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
