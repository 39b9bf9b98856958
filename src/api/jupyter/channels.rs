//! `/api/kernels/{id}/channels`: the WebSocket pump between a Jupyter client and its kernel,
//! and the table of clients that reconnect.
//!
//! Messages from clients are decoded (`framing.rs`) and forwarded to the kernel as they are
//! (re-signed, not re-serialised); replies go only to the client whose request they answer;
//! iopub goes to every client. Each connection has one writer task that owns what the
//! client is owed ([`Held`]) and hands it back when the socket closes.
//!
//! Reconnects: a client is identified by its `session_id` query parameter. When its socket
//! closes, its subscription to the kernel's iopub and its reply queue are parked (bounded,
//! for [`PARK_FOR`]); a reconnect with the same `session_id` takes them back and first
//! receives everything it missed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::{Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{RawQuery, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde_json::json;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::framing::{decode_binary, decode_legacy_json, encode_frame, Framing, V1_PROTOCOL};
use crate::api::auth::url_query;
use crate::api::clients::{websocket_place, WebSocketPlace};
use crate::api::error::JupyterError;
use crate::api::extract::OwnedKernel;
use crate::api::shapes::ErrorResponse;
use crate::api::ws_liveness::Liveness;
use crate::api::AppState;
use crate::session::{FrontDoor, LifecycleEvent, Session, SessionEvent, SessionState};
use crate::wire::{Channel, Message};

/// How long a disconnected client's subscription waits for it to come back.
pub const PARK_FOR: Duration = Duration::from_secs(120);

/// Capacity of one client's reply queue.
const REPLY_QUEUE: usize = 1024;

/// What a client's connection holds: its subscription to the kernel's iopub, its reply
/// queue, and messages taken from those but not yet written to its socket.
struct Held {
    events: broadcast::Receiver<SessionEvent>,
    replies: mpsc::Receiver<(Channel, Arc<Message>)>,
    unsent: VecDeque<(Channel, Arc<Message>)>,
    /// A restart was announced and the new kernel has not been reported ready yet.
    restarting: bool,
}

/// What a client left behind when its socket closed.
struct Parked {
    held: Held,
    replies_tx: mpsc::Sender<(Channel, Arc<Message>)>,
    since: Instant,
}

type ClientKey = (Uuid, String);

#[derive(Default)]
struct ClientTable {
    parked: HashMap<ClientKey, Parked>,
    /// The newest connection of each (kernel, session_id) that is open now.
    current: HashMap<ClientKey, u64>,
    next_generation: u64,
}

/// Jupyter clients by (kernel id, client session_id): the open ones and the parked ones.
#[derive(Default)]
pub struct JupyterClients {
    table: Mutex<ClientTable>,
}

impl JupyterClients {
    fn lock(&self) -> std::sync::MutexGuard<'_, ClientTable> {
        let mut t = crate::sync::lock(&self.table);
        t.parked.retain(|_, p| p.since.elapsed() < PARK_FOR);
        t
    }

    /// A connection opens: it becomes the current one for its key and takes what a
    /// previous connection with the same session_id parked.
    fn attach(&self, kernel: Uuid, client: &str) -> (u64, Option<Parked>) {
        let mut t = self.lock();
        t.next_generation += 1;
        let generation = t.next_generation;
        let key = (kernel, client.to_string());
        t.current.insert(key.clone(), generation);
        (generation, t.parked.remove(&key))
    }

    /// A connection closed. Only the current one parks what it held: when a newer
    /// connection with the same session_id is already open (a client that reconnected
    /// before the broker saw its old socket close), that one has its own subscription and
    /// what the old one held would be replayed twice.
    fn detach(&self, kernel: Uuid, client: String, generation: u64, parked: Option<Parked>) {
        let mut t = self.lock();
        let key = (kernel, client);
        if t.current.get(&key) != Some(&generation) {
            return;
        }
        t.current.remove(&key);
        if let Some(p) = parked {
            t.parked.insert(key, p);
        }
    }

    pub(super) fn forget_kernel(&self, kernel: Uuid) {
        self.lock().parked.retain(|(k, _), _| *k != kernel);
    }
}

/// Jupyter: channels WebSocket (legacy JSON or v1.kernel.websocket.jupyter.org)
///
/// Jupyter messages both ways; the v1 binary framing when the client offers the
/// `v1.kernel.websocket.jupyter.org` subprotocol. A reconnect with the same `session_id`
/// first receives what it missed (parked for two minutes).
#[utoipa::path(get, path = "/api/kernels/{id}/channels", tag = "jupyter",
    params(("id" = uuid::Uuid, Path),
        ("session_id" = Option<String>, Query, description = "the client's session id; a reconnect with the same one resumes")),
    responses((status = 101, description = "switching protocols"),
        (status = 400, description = "not a WebSocket upgrade"),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse),
        (status = 410, response = ErrorResponse),
        (status = 429, response = ErrorResponse)))]
pub(super) async fn channels(
    State(state): State<AppState>,
    kernel: OwnedKernel,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let place = match websocket_place(&state, &kernel.caller.0.name, &kernel.session) {
        Ok(place) => place,
        Err(e) => return JupyterError(e).into_response(),
    };
    let session = kernel.session;
    let client_id = query
        .as_deref()
        .and_then(|q| url_query(q, "session_id"))
        .filter(|s| !s.is_empty() && s.len() <= 256);
    let framing = Framing::for_request(&headers);
    let max = state.limits.max_code_bytes * 2 + (64 << 20);
    let ws = ws.max_message_size(max);
    let ws = if framing == Framing::V1 {
        ws.protocols([V1_PROTOCOL])
    } else {
        ws
    };
    ws.on_upgrade(move |socket| serve_channels(socket, (session, place), state, client_id, framing))
}

/// How long a closing connection waits for its writer to hand back what it holds.
const WRITER_STOP: Duration = Duration::from_secs(5);

async fn serve_channels(
    socket: WebSocket,
    (session, _place): (Arc<Session>, WebSocketPlace),
    state: AppState,
    client_id: Option<String>,
    framing: Framing,
) {
    let (generation, parked) = match client_id.as_deref() {
        Some(c) => {
            let (g, p) = state.jupyter_clients.attach(session.id, c);
            (Some(g), p)
        }
        None => (None, None),
    };
    let (held, replies_tx) = match parked {
        Some(p) => (p.held, p.replies_tx),
        None => {
            let (tx, rx) = mpsc::channel(REPLY_QUEUE);
            let held = Held {
                events: session.subscribe(),
                replies: rx,
                unsent: VecDeque::new(),
                restarting: false,
            };
            (held, tx)
        }
    };
    let (sink, mut source) = socket.split();
    let stop = CancellationToken::new();
    let liveness = Liveness::new(&state.limits.clients, state.metrics.clone());
    let writer = tokio::spawn(write_to_client(
        sink,
        held,
        framing,
        session.clone(),
        (stop.clone(), liveness.clone()),
    ));

    while let Some(frame) = liveness.next(&mut source).await {
        let decoded = match frame {
            Ok(WsMessage::Text(t)) => decode_legacy_json(t.as_bytes(), Vec::new()),
            Ok(WsMessage::Binary(b)) => decode_binary(framing, &b),
            Ok(WsMessage::Close(_)) => break,
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!(session = %session.id, error = %e, "Jupyter client socket read ended");
                break;
            }
        };
        match decoded {
            Ok((channel, msg)) => {
                if channel == Channel::Iopub || channel == Channel::Heartbeat {
                    continue;
                }
                if let Some(reply) = let_go(&state, &session, channel, &msg) {
                    // Answered as the kernel would have; the kernel never sees it.
                    let _ = replies_tx.try_send((Channel::Control, Arc::new(reply)));
                    continue;
                }
                if let Err(e) = session.forward(channel, msg, replies_tx.clone()) {
                    tracing::debug!(session = %session.id, error = %e, "client message not forwarded");
                }
            }
            Err(why) => {
                tracing::warn!(session = %session.id, %why, "dropped a malformed frame from a Jupyter client");
            }
        }
    }

    // Stop the writer and park what it held (including what it took but could not write),
    // so a reconnect with the same session_id misses nothing.
    stop.cancel();
    let held = match tokio::time::timeout(WRITER_STOP, writer).await {
        Ok(Ok(held)) => Some(held),
        _ => None,
    };
    if let (Some(c), Some(g)) = (client_id, generation) {
        let parked = held.map(|held| Parked {
            held,
            replies_tx,
            since: Instant::now(),
        });
        state.jupyter_clients.detach(session.id, c, g, parked);
    }
}

/// Everything the kernel sends to one client, in one task: first what it missed while
/// away, then iopub (for every client) and the replies to its own requests. Returns what
/// it holds when stopped or when the socket fails; a message is only consumed once written.
async fn write_to_client(
    mut sink: futures::stream::SplitSink<WebSocket, WsMessage>,
    mut held: Held,
    framing: Framing,
    session: Arc<Session>,
    (stop, liveness): (CancellationToken, Liveness),
) -> Held {
    let mut last_ping = None;
    loop {
        let next = match held.unsent.pop_front() {
            Some(m) => Some(m),
            None => tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                () = liveness.ping_due(last_ping) => {
                    last_ping = Some(tokio::time::Instant::now());
                    let sent = tokio::select! {
                        r = sink.send(WsMessage::Ping(Default::default())) => r.is_ok(),
                        _ = stop.cancelled() => false,
                    };
                    if !sent {
                        break;
                    }
                    None
                }
                ev = held.events.recv() => match ev {
                    Ok(SessionEvent::Iopub { msg, .. }) => Some((Channel::Iopub, msg)),
                    Ok(SessionEvent::Restarted) => {
                        held.restarting = true;
                        Some((Channel::Iopub, synthetic_status(&session, "restarting")))
                    }
                    Ok(SessionEvent::State(
                        SessionState::Dead | SessionState::Expired | SessionState::Closed,
                    )) => {
                        held.restarting = false;
                        Some((Channel::Iopub, synthetic_status(&session, "dead")))
                    }
                    // The new kernel is ready. Its own first statuses may have gone to the
                    // broker's readiness check, so the frontend (which shows "restarting"
                    // until told otherwise) hears it from the broker.
                    Ok(SessionEvent::State(SessionState::Idle)) if held.restarting => {
                        held.restarting = false;
                        Some((Channel::Iopub, synthetic_status(&session, "idle")))
                    }
                    Ok(SessionEvent::State(SessionState::Busy)) => {
                        held.restarting = false;
                        None
                    }
                    Ok(SessionEvent::State(_)) => None,
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(session = %session.id, missed = n, "a Jupyter client fell behind; iopub messages dropped");
                        None
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                },
                r = held.replies.recv() => match r {
                    Some(m) => Some(m),
                    None => break,
                },
            },
        };
        let Some((channel, m)) = next else { continue };
        let frame = encode_frame(framing, channel, &m);
        let sent = tokio::select! {
            r = sink.send(frame) => r.is_ok(),
            _ = stop.cancelled() => false,
        };
        if !sent {
            // Perhaps written, perhaps not: keep it for a reconnect (at least once).
            held.unsent.push_front((channel, m));
            break;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
    held
}

/// A Jupyter client's `shutdown_request` (not a restart) for a session another front door
/// made: Jupyter lets go of the session instead of ending it (the front door that made a
/// session owns its life; see `Registry::end_or_detach`). The detach is recorded and the
/// `shutdown_reply` the client waits for is returned; `None` for anything else, which goes
/// to the kernel as it is.
fn let_go(state: &AppState, session: &Session, channel: Channel, msg: &Message) -> Option<Message> {
    if channel != Channel::Control
        || msg.msg_type != "shutdown_request"
        || session.provenance.front_door == FrontDoor::Jupyter
    {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Shutdown {
        #[serde(default)]
        restart: bool,
    }
    // A request that does not parse is the kernel's to refuse, as before.
    let asked: Shutdown = msg.parse_content().ok()?;
    if asked.restart {
        return None;
    }
    state.registry.report(
        session,
        &LifecycleEvent::SessionDetached {
            by: FrontDoor::Jupyter,
        },
    );
    tracing::info!(session = %session.id, owner = session.provenance.front_door.as_str(), "a Jupyter client's shutdown_request let go of a session it did not make");
    let mut reply = Message::new(
        "shutdown_reply",
        &json!({"status": "ok", "restart": false}),
        Some(&msg.header),
        &session.id.to_string(),
        "kernel-broker",
    );
    reply.metadata = Bytes::from_static(b"{}");
    Some(reply)
}

/// An iopub status message made by the broker (restart, readiness and death announcements).
fn synthetic_status(session: &Session, state: &str) -> Arc<Message> {
    let mut m = Message::new(
        "status",
        &json!({"execution_state": state}),
        None,
        &session.id.to_string(),
        "kernel-broker",
    );
    m.metadata = Bytes::from_static(b"{}");
    Arc::new(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked() -> Parked {
        let (_events_tx, events) = broadcast::channel(4);
        let (replies_tx, replies) = mpsc::channel(4);
        Parked {
            held: Held {
                events,
                replies,
                unsent: VecDeque::new(),
                restarting: false,
            },
            replies_tx,
            since: Instant::now(),
        }
    }

    #[test]
    fn only_the_newest_connection_of_a_client_parks() {
        let clients = JupyterClients::default();
        let k = Uuid::new_v4();
        let (old, p) = clients.attach(k, "c");
        assert!(p.is_none());
        // The client reconnects before its old socket is seen closing.
        let (new, p) = clients.attach(k, "c");
        assert!(p.is_none());
        clients.detach(k, "c".into(), old, Some(parked()));
        assert!(
            clients.lock().parked.is_empty(),
            "a superseded connection must not park"
        );
        clients.detach(k, "c".into(), new, Some(parked()));
        let (_, p) = clients.attach(k, "c");
        assert!(p.is_some(), "the newest connection parks for the next one");
        // Another client id or kernel takes nothing.
        assert!(clients.attach(k, "d").1.is_none());
        assert!(clients.attach(Uuid::new_v4(), "c").1.is_none());
    }
}
