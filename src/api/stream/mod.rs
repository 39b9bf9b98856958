//! The agent stream: `GET /v1/sessions/{id}/stream`, a WebSocket of JSON text frames.
//!
//! Each connection has one writer task fed by an [`Outbox`] bounded in bytes; each execution
//! gets a forwarding task that turns the session's output events into frames tagged with
//! the client's execution id. Session state changes reach every attached client. The session
//! never waits on a client: when a client falls behind, streamed copies are dropped and the
//! final `done` frame still carries the whole (limited) Execution.
//!
//! A client that reads slowly (or not at all) costs bounded memory (issue 18): at most
//! [`OUT_BYTES`] of frames wait for it (and as much again held for executions whose turn
//! has not come), at most [`IN_FLIGHT`] of its executions are in the
//! session (each bounded by the output and result limits), and the code of at most
//! [`WAITING_MAX`] more waits here for a place.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::extract::ws::{Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

mod branch;
mod frame;

use self::branch::{Branch, Brancher};
use self::frame::{parse_client_frame, ClientFrame};
use super::clients::{websocket_place, WebSocketPlace};
use super::extract::OwnedSession;
use super::shapes::{ErrorResponse, ExecutionJson, SessionStateJson};
use super::ws_liveness::Liveness;
use super::AppState;
use crate::session::{
    ExecuteRequest, Origin, OutputEvent, Session, SessionEvent, SessionState, Timeout,
};

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(upgrade))
}

/// Agent stream (WebSocket of JSON frames)
///
/// Client frames: `{"type": "execute", "id", "code", "timeout_seconds"?}`,
/// `{"type": "input_reply", "value"}`, `{"type": "interrupt"}`, and `checkpoint`, `rewind`,
/// `fork` (issue 36). Server frames: `status`, `stdout`, `stderr`, `display`, `result`,
/// `error`, `input_request`, `done` (with the Execution), `checkpoint_taken`, `rewound`,
/// `forked`, `refused` and `protocol_error`; see docs/API.md.
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
    let place = match websocket_place(&state, &owned.caller.0.name, &owned.session) {
        Ok(place) => place,
        Err(e) => return e.into_response(),
    };
    let session = owned.session;
    let brancher = Brancher::new(state.clone(), owned.caller, session.clone());
    let max_frame = state.limits.max_code_bytes * 2 + 4096;
    ws.max_message_size(max_frame)
        .on_upgrade(move |socket| serve(socket, session, state, place, brancher))
}

/// Events of one execution between the session actor and its forwarding task.
const OUT_QUEUE: usize = 1024;

/// Executions of one connection in the session at once (running or queued there).
const IN_FLIGHT: usize = 4;

/// Execute frames a connection may have waiting for a place among [`IN_FLIGHT`].
const WAITING_MAX: usize = 64;

/// Bytes of frames waiting for a client at most (the frame being written aside): a client
/// that reads slowly holds this much of the broker's memory, no more.
const OUT_BYTES: usize = 4 << 20;

/// The frames waiting for the writer, bounded in bytes by [`OUT_BYTES`]. A sender waits
/// while the client is behind; no sender is one the rest of the broker waits on: output of
/// other clients' executions is dropped by the session's broadcast when this connection's
/// status task lags, and an execution's streamed copies are dropped by the session actor
/// (the `done` frame carries the whole Execution).
#[derive(Clone)]
struct Outbox {
    frames: mpsc::UnboundedSender<(String, OwnedSemaphorePermit)>,
    bytes: Arc<Semaphore>,
    /// Streamed frames of executions held until the connection's earlier execution is
    /// out: a budget of their own, so that what they hold never blocks the earlier one's
    /// `done` (which may need the whole of `bytes`).
    held: Arc<Semaphore>,
}

/// The writer's end of an [`Outbox`].
type Outgoing = mpsc::UnboundedReceiver<(String, OwnedSemaphorePermit)>;

/// The writer has stopped (the client is gone).
struct Gone;

impl Outbox {
    fn new() -> (Self, Outgoing) {
        let (frames, rx) = mpsc::unbounded_channel();
        let bytes = Arc::new(Semaphore::new(OUT_BYTES));
        let held = Arc::new(Semaphore::new(OUT_BYTES));
        (
            Self {
                frames,
                bytes,
                held,
            },
            rx,
        )
    }

    /// Queue `frame`, waiting while the frames already queued fill the budget.
    async fn send(&self, frame: String) -> Result<(), Gone> {
        let permit = self
            .bytes
            .clone()
            .acquire_many_owned(cost(&frame))
            .await
            .map_err(|_| Gone)?;
        self.frames.send((frame, permit)).map_err(|_| Gone)
    }

    /// Queue `frame` if the budget has room for it now; drop it otherwise (output a client
    /// may miss: another client's, or a streamed copy of what `done` carries).
    fn offer(&self, frame: String) -> Result<(), Offer> {
        match self.reserve(&frame) {
            Ok(permit) => self.queue(frame, permit).map_err(|_| Offer::Gone),
            Err(()) if self.is_gone() => Err(Offer::Gone),
            Err(()) => Err(Offer::Dropped),
        }
    }

    /// Room for `frame` in the budget, if there is some now.
    fn reserve(&self, frame: &str) -> Result<OwnedSemaphorePermit, ()> {
        let cost = frame.len().clamp(1, OUT_BYTES) as u32;
        self.bytes
            .clone()
            .try_acquire_many_owned(cost)
            .map_err(|_| ())
    }

    /// Room for `frame` among the held frames, if there is some now.
    fn hold(&self, frame: &str) -> Result<OwnedSemaphorePermit, ()> {
        let cost = frame.len().clamp(1, OUT_BYTES) as u32;
        self.held
            .clone()
            .try_acquire_many_owned(cost)
            .map_err(|_| ())
    }

    /// Send what was held, in order, each as it finds room in the outbox.
    async fn release(&self, held: &mut Vec<(String, OwnedSemaphorePermit)>) -> Result<(), Gone> {
        for (frame, _hold) in held.drain(..) {
            self.send(frame).await?;
        }
        Ok(())
    }

    /// Queue a frame whose room is reserved.
    fn queue(&self, frame: String, permit: OwnedSemaphorePermit) -> Result<(), Gone> {
        self.frames.send((frame, permit)).map_err(|_| Gone)
    }

    /// Whether the writer has stopped.
    fn is_gone(&self) -> bool {
        self.frames.is_closed()
    }
}

/// A frame's permits in a budget: its bytes, at least 1, and a frame larger than the whole
/// budget takes all of it (it waits for the queue to empty).
fn cost(frame: &str) -> u32 {
    frame.len().clamp(1, OUT_BYTES) as u32
}

/// Why [`Outbox::offer`] did not queue a frame.
#[derive(Debug)]
enum Offer {
    /// The budget was full: the frame was dropped.
    Dropped,
    /// The writer has stopped.
    Gone,
}

async fn serve(
    socket: WebSocket,
    session: Arc<Session>,
    state: AppState,
    place: WebSocketPlace,
    brancher: Brancher,
) {
    let _place = place;
    let (mut sink, mut source) = socket.split();
    let (out, mut out_rx) = Outbox::new();
    let liveness = Liveness::new(&state.limits.clients, state.metrics.clone());

    let writer = {
        let liveness = liveness.clone();
        tokio::spawn(async move {
            let mut last_ping = None;
            loop {
                let (message, permit) = tokio::select! {
                    text = out_rx.recv() => match text {
                        Some((text, permit)) => (WsMessage::Text(text.into()), Some(permit)),
                        None => break,
                    },
                    () = liveness.ping_due(last_ping) => {
                        last_ping = Some(tokio::time::Instant::now());
                        (WsMessage::Ping(Default::default()), None)
                    }
                };
                // The frame's bytes stay counted until the socket has taken them.
                let sent = sink.send(message).await;
                drop(permit);
                if sent.is_err() {
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
                            // Another client's output: dropped for a client that is behind.
                            if out.offer(frame.to_string()).is_err() {
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
    // Execute frames not yet handed to the session: at most IN_FLIGHT of this connection's
    // executions are in the session at once, so a client that stops reading stops its
    // executions from piling up results in the broker (the code waits here instead).
    let mut waiting: VecDeque<(Value, String, Option<f64>)> = VecDeque::new();
    let in_flight = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let frame = tokio::select! {
            permit = in_flight.clone().acquire_owned(), if !waiting.is_empty() => {
                let (Ok(permit), Some(execute)) = (permit, waiting.pop_front()) else { break };
                let previous = previous_done.take();
                previous_done =
                    start_execution(&state, &session, &out, execute, previous, permit).await;
                continue;
            }
            frame = liveness.next(&mut source) => match frame {
                Some(frame) => frame,
                None => break,
            },
        };
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
        let frame = match parse_client_frame(text.as_str()) {
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
                if waiting.len() >= WAITING_MAX {
                    let message = format!(
                        "{WAITING_MAX} executions are already waiting on this connection; read their results first"
                    );
                    let _ = out
                        .send(
                            json!({"type": "protocol_error", "id": id, "message": message})
                                .to_string(),
                        )
                        .await;
                    continue;
                }
                waiting.push_back((id, code, timeout_seconds));
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
            ClientFrame::Fork {
                id,
                count,
                checkpoint,
            } => {
                brancher
                    .start(&out, id, Branch::Fork { count, checkpoint })
                    .await;
            }
            ClientFrame::Checkpoint { id } => brancher.start(&out, id, Branch::Checkpoint).await,
            ClientFrame::Rewind { id, checkpoint } => {
                brancher
                    .start(&out, id, Branch::Rewind { checkpoint })
                    .await;
            }
            ClientFrame::Pause { id } => brancher.start(&out, id, Branch::Pause).await,
            ClientFrame::Resume { id } => brancher.start(&out, id, Branch::Resume).await,
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

async fn send_protocol_error(out: &Outbox, message: &str) {
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
    out: &Outbox,
    (id, code, timeout_seconds): (Value, String, Option<f64>),
    previous: Option<oneshot::Receiver<()>>,
    in_flight: OwnedSemaphorePermit,
) -> Option<oneshot::Receiver<()>> {
    let fail = |message: String| {
        json!({"type": "protocol_error", "id": id, "message": message}).to_string()
    };
    let timeout = Timeout::Asked(timeout_seconds);
    let (stream_tx, mut stream_rx) = mpsc::channel(OUT_QUEUE);
    let submitted =
        ExecuteRequest::new(code, timeout, Origin::WebSocket, &state.execution_limits())
            .and_then(|request| session.submit(request.streaming(stream_tx).with_stdin()));
    let done_rx = match submitted {
        Ok(done) => done,
        Err(e) => {
            let _ = out.send(fail(e.to_string())).await;
            return previous;
        }
    };
    let out = out.clone();
    let (sent_tx, sent_rx) = oneshot::channel();
    tokio::spawn(async move {
        let _in_flight = in_flight;
        // Streamed copies are taken as they come, whatever the client's pace: while the
        // previous execution's frames are still going out they are held within a budget
        // of their own, and dropped past it (as they are for a client that is behind);
        // the `done` frame carries the whole Execution either way.
        let mut previous = previous;
        let mut held = Vec::new();
        loop {
            let ev = tokio::select! {
                biased;
                () = settled(&mut previous) => {
                    previous = None;
                    if out.release(&mut held).await.is_err() {
                        return;
                    }
                    continue;
                }
                ev = stream_rx.recv() => ev,
            };
            let Some(ev) = ev else { break };
            let frame = event_frame(&id, ev);
            let kept = if previous.is_some() {
                out.hold(&frame).map(|permit| held.push((frame, permit)))
            } else {
                out.offer(frame).map_err(|_| ())
            };
            if kept.is_err() && out.is_gone() {
                return;
            }
        }
        // The stream closes when the execution is finished; then the result is there.
        if let Some(previous) = previous {
            // Err: the previous task ended without sending; nothing to wait for.
            let _ = previous.await;
        }
        if out.release(&mut held).await.is_err() {
            return;
        }
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

/// Resolves once the previous execution's frames are out; never when there is nothing to
/// wait for (`None`), so the `select!` branch it feeds stays quiet.
async fn settled(previous: &mut Option<oneshot::Receiver<()>>) {
    match previous {
        // Err: the previous task ended without sending; nothing more to wait for.
        Some(rx) => {
            let _ = rx.await;
        }
        None => std::future::pending().await,
    }
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
