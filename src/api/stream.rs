//! The agent stream: `GET /v1/sessions/{id}/stream`, a WebSocket of JSON text frames.
//!
//! Each connection has one writer task fed by a bounded queue; each execution gets a
//! forwarding task that turns the session's output events into frames tagged with the
//! client's execution id. Session state changes reach every attached client. The session
//! never waits on a client: when a client falls behind, streamed copies are dropped and the
//! final `done` frame still carries the whole (limited) Execution.

use std::sync::Arc;

use axum::extract::ws::{Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc, oneshot};

use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::clients::websocket_place;
use super::extract::{check_code, OwnedSession};
use super::shapes::{ErrorResponse, ExecutionJson, SessionStateJson};
use super::ws_liveness::Liveness;
use super::AppState;
use crate::session::{
    ConnectionGuard, ExecRequest, OutputEvent, Session, SessionEvent, SessionState,
};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(upgrade))
}

/// Agent stream (WebSocket of JSON frames)
///
/// Client frames: `{"type": "execute", "id", "code", "timeout_seconds"?}`,
/// `{"type": "input_reply", "value"}`, `{"type": "interrupt"}`. Server frames: `status`,
/// `stdout`, `stderr`, `display`, `result`, `error`, `input_request`, `done` (with the
/// Execution) and `protocol_error`; see docs/API.md.
#[utoipa::path(get, operation_id = "agent_stream", path = "/v1/sessions/{id}/stream", tag = "sessions", params(("id" = uuid::Uuid, Path)),
    responses((status = 101, description = "switching protocols"),
        (status = 400, description = "not a WebSocket upgrade"),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse),
        (status = 410, response = ErrorResponse),
        (status = 429, response = ErrorResponse)))]
async fn upgrade(
    State(state): State<AppState>,
    owned: OwnedSession,
    ws: WebSocketUpgrade,
) -> Response {
    let session = owned.session;
    let place = match websocket_place(&state, &session) {
        Ok(place) => place,
        Err(e) => return e.into_response(),
    };
    let max_frame = state.limits.max_code_bytes * 2 + 4096;
    ws.max_message_size(max_frame)
        .on_upgrade(move |socket| serve(socket, session, state, place))
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ClientFrame {
    Execute {
        id: Value,
        code: String,
        #[serde(default)]
        timeout_seconds: Option<f64>,
    },
    InputReply {
        value: String,
    },
    Interrupt {},
}

/// Frames to the client are queued here; the writer task drains it.
const OUT_QUEUE: usize = 1024;

async fn serve(socket: WebSocket, session: Arc<Session>, state: AppState, place: ConnectionGuard) {
    let _place = place;
    let (mut sink, mut source) = socket.split();
    let (out, mut out_rx) = mpsc::channel::<String>(OUT_QUEUE);
    let liveness = Liveness::new(&state.limits.clients, state.metrics.clone());

    let writer = {
        let liveness = liveness.clone();
        tokio::spawn(async move {
            let mut last_ping = None;
            loop {
                let message = tokio::select! {
                    text = out_rx.recv() => match text {
                        Some(text) => WsMessage::Text(text.into()),
                        None => break,
                    },
                    () = liveness.ping_due(last_ping) => {
                        last_ping = Some(tokio::time::Instant::now());
                        WsMessage::Ping(Default::default())
                    }
                };
                if sink.send(message).await.is_err() {
                    break;
                }
            }
            let _ = sink.close().await;
        })
    };

    // Session state changes for this client.
    let status_task = {
        let out = out.clone();
        let mut events = session.subscribe();
        let initial = session.state();
        tokio::spawn(async move {
            let _ = out.send(status_frame(initial)).await;
            loop {
                match events.recv().await {
                    Ok(SessionEvent::State(s)) => {
                        if matches!(s, SessionState::Starting) {
                            continue;
                        }
                        if out.send(status_frame(s)).await.is_err() {
                            return;
                        }
                        if matches!(s, SessionState::Expired | SessionState::Closed) {
                            return;
                        }
                    }
                    // Output of executions other clients started (a notebook on the same
                    // kernel): streamed with a null id and `external: true`.
                    Ok(SessionEvent::Iopub {
                        msg, agent: false, ..
                    }) => {
                        if let Some(ev) =
                            crate::session::execution::output_event(&msg.msg_type, &msg.content)
                        {
                            let mut frame = event_value(&Value::Null, ev);
                            frame["external"] = Value::Bool(true);
                            if out.send(frame.to_string()).await.is_err() {
                                return;
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        })
    };

    // Executions run one at a time, and their frames go out in that order too: each
    // execution's frames wait until the previous one's `done` was sent (its result is
    // released only once recorded, which may come after the next one's first output).
    let mut previous_done: Option<oneshot::Receiver<()>> = None;
    while let Some(frame) = liveness.next(&mut source).await {
        let text = match frame {
            Ok(WsMessage::Text(t)) => t,
            Ok(WsMessage::Binary(_)) => {
                send_protocol_error(
                    &out,
                    "binary frames are not accepted; send JSON text frames",
                )
                .await;
                continue;
            }
            Ok(WsMessage::Close(_)) => break,
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!(session = %session.id, error = %e, "websocket read ended");
                break;
            }
        };
        let frame: ClientFrame = match serde_json::from_str(text.as_str()) {
            Ok(f) => f,
            Err(e) => {
                send_protocol_error(&out, &format!("cannot take this frame: {e}")).await;
                continue;
            }
        };
        match frame {
            ClientFrame::Execute {
                id,
                code,
                timeout_seconds,
            } => {
                let previous = previous_done.take();
                previous_done = start_execution(
                    &state,
                    &session,
                    &out,
                    (id, code, timeout_seconds),
                    previous,
                )
                .await;
            }
            ClientFrame::InputReply { value } => {
                if let Err(e) = session.input_reply(value) {
                    send_protocol_error(&out, &e.to_string()).await;
                }
            }
            ClientFrame::Interrupt {} => {
                if let Err(e) = session.interrupt().await {
                    send_protocol_error(&out, &e.to_string()).await;
                }
            }
        }
        if matches!(
            session.state(),
            SessionState::Expired | SessionState::Closed
        ) {
            break;
        }
    }
    status_task.abort();
    drop(out);
    let _ = writer.await;
}

fn status_frame(s: SessionState) -> String {
    json!({"type": "status", "state": SessionStateJson::from(s).as_str()}).to_string()
}

async fn send_protocol_error(out: &mpsc::Sender<String>, message: &str) {
    let _ = out
        .send(json!({"type": "protocol_error", "message": message}).to_string())
        .await;
}

/// Submits an execution and spawns the task that forwards its frames once `previous` (the
/// connection's earlier execution) has sent its `done`. Returns what the next execution
/// waits for (`previous` again when nothing was started).
async fn start_execution(
    state: &AppState,
    session: &Arc<Session>,
    out: &mpsc::Sender<String>,
    (id, code, timeout_seconds): (Value, String, Option<f64>),
    previous: Option<oneshot::Receiver<()>>,
) -> Option<oneshot::Receiver<()>> {
    let fail = |message: String| {
        json!({"type": "protocol_error", "id": id, "message": message}).to_string()
    };
    if let Err(e) = check_code(state, &code) {
        let _ = out.send(fail(e.message)).await;
        return previous;
    }
    let timeout = match state.execution_timeout(timeout_seconds) {
        Ok(t) => t,
        Err(e) => {
            let _ = out.send(fail(e.message)).await;
            return previous;
        }
    };
    let (stream_tx, mut stream_rx) = mpsc::channel(OUT_QUEUE);
    let (done_tx, done_rx) = oneshot::channel();
    if let Err(e) = session.execute(ExecRequest {
        code,
        timeout,
        allow_stdin: true,
        stream: Some(stream_tx),
        done: done_tx,
    }) {
        let _ = out.send(fail(e.to_string())).await;
        return previous;
    }
    let out = out.clone();
    let (sent_tx, sent_rx) = oneshot::channel();
    tokio::spawn(async move {
        if let Some(previous) = previous {
            // Err: the previous task ended without sending; nothing to wait for.
            let _ = previous.await;
        }
        while let Some(ev) = stream_rx.recv().await {
            if out.send(event_frame(&id, ev)).await.is_err() {
                return;
            }
        }
        // The stream closes when the execution is finished; then the result is there.
        if let Ok(execution) = done_rx.await {
            let execution = ExecutionJson::from(execution);
            let _ = out
                .send(json!({"type": "done", "id": id, "execution": execution}).to_string())
                .await;
        }
        let _ = sent_tx.send(());
    });
    Some(sent_rx)
}

fn event_frame(id: &Value, ev: OutputEvent) -> String {
    event_value(id, ev).to_string()
}

fn event_value(id: &Value, ev: OutputEvent) -> Value {
    match ev {
        OutputEvent::Stdout(text) => json!({"type": "stdout", "id": id, "text": text}),
        OutputEvent::Stderr(text) => json!({"type": "stderr", "id": id, "text": text}),
        OutputEvent::Display { data, metadata } => {
            json!({"type": "display", "id": id, "data": data, "metadata": metadata})
        }
        OutputEvent::Result { data, metadata } => {
            json!({"type": "result", "id": id, "data": data, "metadata": metadata})
        }
        OutputEvent::Error(e) => json!({
            "type": "error", "id": id, "ename": e.ename, "evalue": e.evalue, "traceback": e.traceback
        }),
        OutputEvent::InputRequest { prompt, password } => {
            json!({"type": "input_request", "id": id, "prompt": prompt, "password": password})
        }
    }
}
