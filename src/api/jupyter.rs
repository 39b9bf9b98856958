//! The Jupyter Server / Kernel Gateway kernels API, so `jupyter server --gateway-url`,
//! JupyterLab and any Jupyter client can use the broker. A kernel here is a session (same
//! id, same owner): an agent's session can be opened in a notebook while the agent uses it.
//!
//! `/api/kernels/{id}/channels` carries Jupyter messages over a WebSocket: legacy JSON
//! text frames (binary, with the legacy offset header, when a message has buffers), or the
//! `v1.kernel.websocket.jupyter.org` binary framing when the client offers it. Messages
//! from clients are forwarded to the kernel as they are (re-signed, not re-serialised);
//! replies go only to the client whose request they answer; iopub goes to every client.
//!
//! Reconnects: a client is identified by its `session_id` query parameter. When its socket
//! closes, its subscription to the kernel's iopub and its reply queue are parked (bounded,
//! for [`PARK_FOR`]); a reconnect with the same `session_id` takes them back and first
//! receives everything it missed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ws::{Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::auth::{url_query, Caller};
use super::error::{ApiError, ApiResult};
use super::sessions::{iso, parse_json, read_body, sandbox_user};
use super::AppState;
use crate::kernel::spec::KernelSpec;
use crate::session::{CreateOptions, Session, SessionEvent, SessionInfo, SessionState};
use crate::wire::{Channel, Message};

/// The subprotocol of Jupyter's binary WebSocket framing.
pub const V1_PROTOCOL: &str = "v1.kernel.websocket.jupyter.org";

/// How long a disconnected client's subscription waits for it to come back.
pub const PARK_FOR: Duration = Duration::from_secs(120);

/// Capacity of one client's reply queue.
const REPLY_QUEUE: usize = 1024;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api", get(api_version))
        .route("/api/kernelspecs", get(kernelspecs))
        .route("/api/kernelspecs/{name}", get(kernelspec))
        .route("/kernelspecs/{name}/{*resource}", get(kernelspec_resource))
        .route("/api/kernels", get(list_kernels).post(start_kernel))
        .route("/api/kernels/{id}", get(get_kernel).delete(delete_kernel))
        .route("/api/kernels/{id}/interrupt", post(interrupt_kernel))
        .route("/api/kernels/{id}/restart", post(restart_kernel))
        .route("/api/kernels/{id}/channels", get(channels))
}

/// An error answered with Jupyter's body (`message`, `reason`) alongside ours (`error`).
pub struct JupyterError(ApiError);

impl IntoResponse for JupyterError {
    fn into_response(self) -> Response {
        let e = self.0;
        let body = json!({
            "error": {"code": e.code, "message": e.message},
            "message": e.message,
            "reason": e.status.canonical_reason(),
        });
        (e.status, Json(body)).into_response()
    }
}

fn jupyter_error(e: ApiError) -> JupyterError {
    JupyterError(e)
}

type JResult<T> = Result<T, JupyterError>;

fn j<T>(r: ApiResult<T>) -> JResult<T> {
    r.map_err(jupyter_error)
}

/// The kernel model as Jupyter clients parse it.
pub fn kernel_model(info: &SessionInfo) -> Value {
    let state = match info.state {
        SessionState::Starting => "starting",
        SessionState::Idle => "idle",
        SessionState::Busy => "busy",
        SessionState::Dead => "dead",
        SessionState::Expired | SessionState::Closed => "dead",
    };
    json!({
        "id": info.id,
        "name": info.kernel,
        "last_activity": iso(info.last_activity),
        "execution_state": state,
        "connections": info.connections,
    })
}

/// A kernel spec as the Jupyter API shows it: `{name, spec, resources}`.
fn spec_model(spec: &KernelSpec) -> Value {
    let resources: serde_json::Map<String, Value> = spec
        .logos
        .iter()
        .map(|file| {
            let key = file.rsplit_once('.').map(|(k, _)| k).unwrap_or(file);
            (
                key.to_string(),
                json!(format!("/kernelspecs/{}/{file}", spec.name)),
            )
        })
        .collect();
    json!({"name": spec.name, "spec": spec.raw, "resources": resources})
}

async fn api_version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "kernel_broker": true}))
}

async fn kernelspecs(State(state): State<AppState>, _caller: Caller) -> Json<Value> {
    let ks = &state.kernelspecs;
    let all: serde_json::Map<String, Value> =
        ks.iter().map(|s| (s.name.clone(), spec_model(s))).collect();
    Json(json!({"default": ks.default_name(), "kernelspecs": all}))
}

async fn kernelspec(
    State(state): State<AppState>,
    _caller: Caller,
    Path(name): Path<String>,
) -> JResult<Json<Value>> {
    state
        .kernelspecs
        .get(&name)
        .map(|s| Json(spec_model(s)))
        .ok_or_else(|| jupyter_error(ApiError::not_found(format!("no kernel spec {name:?}"))))
}

async fn kernelspec_resource(
    State(state): State<AppState>,
    _caller: Caller,
    Path((name, resource)): Path<(String, String)>,
) -> JResult<Response> {
    // Only the logos found at start-up are served: no path from the URL reaches the disk.
    let logo = state
        .kernelspecs
        .get(&name)
        .filter(|s| s.logos.contains(&resource));
    if let Some(spec) = logo {
        if let Ok(bytes) = tokio::fs::read(spec.resource_dir.join(&resource)).await {
            return Ok(([(header::CONTENT_TYPE, "image/png")], bytes).into_response());
        }
    }
    Err(jupyter_error(ApiError::not_found(format!(
        "no resource {resource:?} for kernel spec {name:?}"
    ))))
}

async fn list_kernels(State(state): State<AppState>, caller: Caller) -> Json<Vec<Value>> {
    Json(
        state
            .registry
            .list(&caller.0.name)
            .iter()
            .map(|s| kernel_model(&s.info()))
            .collect(),
    )
}

#[derive(Deserialize, Default)]
struct StartBody {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    env: HashMap<String, Value>,
    /// Accepted and ignored (a path on the client's host).
    #[serde(default)]
    #[allow(dead_code)]
    path: Option<String>,
}

async fn start_kernel(
    State(state): State<AppState>,
    caller: Caller,
    body: Body,
) -> JResult<Response> {
    let bytes = j(read_body(body, 256 << 10, "request body").await)?;
    let req: StartBody = j(parse_json(&bytes, "request body"))?;
    // Enterprise Gateway's convention: a client may propose the kernel id.
    let id = req
        .env
        .get("KERNEL_ID")
        .and_then(|v| v.as_str())
        .and_then(|s| Uuid::parse_str(s).ok());
    let kernel = req.name.filter(|n| !n.is_empty());
    if let Some(k) = &kernel {
        if !state.registry.kernel_names().contains(k) {
            return Err(jupyter_error(ApiError::not_found(format!(
                "no kernel spec {k:?}; see /api/kernelspecs"
            ))));
        }
    }
    let session = j(state
        .registry
        .create(
            &sandbox_user(&caller),
            caller.0.max_sessions,
            CreateOptions {
                kernel,
                idle_timeout_seconds: None,
                id,
            },
        )
        .await
        .map_err(ApiError::from))?;
    let location = format!("/api/kernels/{}", session.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(kernel_model(&session.info())),
    )
        .into_response())
}

fn kernel_of(state: &AppState, caller: &Caller, id: &str) -> JResult<Arc<Session>> {
    let uuid = Uuid::parse_str(id).map_err(|_| {
        jupyter_error(ApiError::new(
            StatusCode::NOT_FOUND,
            "session_not_found",
            format!("no kernel {id:?}"),
        ))
    })?;
    state
        .registry
        .get(&caller.0.name, uuid)
        .map_err(|e| jupyter_error(e.into()))
}

async fn get_kernel(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> JResult<Json<Value>> {
    Ok(Json(kernel_model(&kernel_of(&state, &caller, &id)?.info())))
}

async fn delete_kernel(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> JResult<StatusCode> {
    let session = kernel_of(&state, &caller, &id)?;
    j(state
        .registry
        .delete(&caller.0.name, session.id)
        .await
        .map_err(ApiError::from))?;
    state.jupyter_clients.forget_kernel(session.id);
    Ok(StatusCode::NO_CONTENT)
}

async fn interrupt_kernel(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> JResult<StatusCode> {
    let session = kernel_of(&state, &caller, &id)?;
    j(session.interrupt().await.map_err(ApiError::from))?;
    Ok(StatusCode::NO_CONTENT)
}

async fn restart_kernel(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> JResult<Json<Value>> {
    let session = kernel_of(&state, &caller, &id)?;
    j(session.restart().await.map_err(ApiError::from))?;
    Ok(Json(kernel_model(&session.info())))
}

// ---------------------------------------------------------------------------------------
// Channels

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

    fn forget_kernel(&self, kernel: Uuid) {
        self.lock().parked.retain(|(k, _), _| *k != kernel);
    }
}

async fn channels(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> JResult<Response> {
    let session = kernel_of(&state, &caller, &id)?;
    let client_id = query
        .as_deref()
        .and_then(|q| url_query(q, "session_id"))
        .filter(|s| !s.is_empty() && s.len() <= 256);
    let offers_v1 = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == V1_PROTOCOL);
    let max = state.limits.max_code_bytes * 2 + (64 << 20);
    let ws = ws.max_message_size(max);
    let ws = if offers_v1 {
        ws.protocols([V1_PROTOCOL])
    } else {
        ws
    };
    let framing = if offers_v1 {
        Framing::V1
    } else if is_gateway_proxy(&headers) {
        Framing::LegacyTextOnly
    } else {
        Framing::Legacy
    };
    Ok(ws.on_upgrade(move |socket| serve_channels(socket, session, state, client_id, framing)))
}

/// jupyter_server's gateway proxy (`jupyter server --gateway-url`, GatewayWebSocketConnection)
/// opens its socket with Tornado's client and decodes every frame it receives as UTF-8: one
/// binary frame kills its read loop and the notebook stops getting anything, silently. It
/// is recognised by Tornado's default User-Agent and gets text frames only.
fn is_gateway_proxy(headers: &HeaderMap) -> bool {
    headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ua| ua.starts_with("Tornado/"))
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Framing {
    /// JSON text frames; a message with buffers goes as a binary frame with the offsets header.
    Legacy,
    /// JSON text frames only: a message's binary buffers are left out (`"buffers": []`),
    /// for clients that cannot take binary frames (jupyter_server's gateway proxy).
    LegacyTextOnly,
    /// `v1.kernel.websocket.jupyter.org`: every message a binary frame.
    V1,
}

/// How long a closing connection waits for its writer to hand back what it holds.
const WRITER_STOP: Duration = Duration::from_secs(5);

async fn serve_channels(
    socket: WebSocket,
    session: Arc<Session>,
    state: AppState,
    client_id: Option<String>,
    framing: Framing,
) {
    let _guard = session.connect_client();
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
    let writer = tokio::spawn(write_to_client(
        sink,
        held,
        framing,
        session.clone(),
        stop.clone(),
    ));

    while let Some(frame) = source.next().await {
        let decoded = match frame {
            Ok(WsMessage::Text(t)) => decode_legacy_json(t.as_bytes(), Vec::new()),
            Ok(WsMessage::Binary(b)) => match framing {
                Framing::V1 => decode_v1(&b),
                Framing::Legacy | Framing::LegacyTextOnly => decode_legacy_binary(&b),
            },
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
    stop: CancellationToken,
) -> Held {
    loop {
        let next = match held.unsent.pop_front() {
            Some(m) => Some(m),
            None => tokio::select! {
                biased;
                _ = stop.cancelled() => break,
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

/// A JSON part, checked to be valid JSON (a kernel could send anything); `{}` otherwise.
fn json_part(b: &Bytes) -> &str {
    match std::str::from_utf8(b) {
        Ok(s) if serde_json::from_str::<&serde_json::value::RawValue>(s).is_ok() => s,
        _ => "{}",
    }
}

/// Encode a kernel message for the client.
fn encode_frame(framing: Framing, channel: Channel, m: &Message) -> WsMessage {
    match framing {
        Framing::V1 => WsMessage::Binary(encode_v1(channel, m).into()),
        Framing::Legacy | Framing::LegacyTextOnly => {
            let text = format!(
                "{{\"header\":{},\"parent_header\":{},\"metadata\":{},\"content\":{},\"buffers\":[],\"channel\":{},\"msg_id\":{},\"msg_type\":{}}}",
                json_part(&m.header),
                json_part(&m.parent_header),
                json_part(&m.metadata),
                json_part(&m.content),
                json!(channel.as_str()),
                json!(m.msg_id),
                json!(m.msg_type),
            );
            if m.buffers.is_empty() || framing == Framing::LegacyTextOnly {
                WsMessage::Text(text.into())
            } else {
                WsMessage::Binary(encode_legacy_binary(text.as_bytes(), &m.buffers).into())
            }
        }
    }
}

/// Jupyter's legacy binary message: u32 BE count, u32 BE offsets, then the JSON and buffers.
fn encode_legacy_binary(json: &[u8], buffers: &[Bytes]) -> Vec<u8> {
    let n = buffers.len() + 1;
    let mut offsets = Vec::with_capacity(n);
    let mut pos = 4 * (n + 1);
    offsets.push(pos);
    pos += json.len();
    for b in &buffers[..buffers.len() - 1] {
        offsets.push(pos);
        pos += b.len();
    }
    if let Some(last) = buffers.last() {
        offsets.push(pos);
        pos += last.len();
    }
    let mut out = Vec::with_capacity(pos);
    out.extend_from_slice(&(n as u32).to_be_bytes());
    for o in offsets.iter().take(n) {
        out.extend_from_slice(&(*o as u32).to_be_bytes());
    }
    out.extend_from_slice(json);
    for b in buffers {
        out.extend_from_slice(b);
    }
    out
}

/// The v1 binary framing: u64 LE count of offsets, the offsets, then channel, header,
/// parent_header, metadata, content and buffers; the last offset is the end.
fn encode_v1(channel: Channel, m: &Message) -> Vec<u8> {
    let parts: Vec<&[u8]> = [
        channel.as_str().as_bytes(),
        json_part(&m.header).as_bytes(),
        json_part(&m.parent_header).as_bytes(),
        json_part(&m.metadata).as_bytes(),
        json_part(&m.content).as_bytes(),
    ]
    .into_iter()
    .chain(m.buffers.iter().map(|b| b.as_ref()))
    .collect();
    let count = parts.len() + 1;
    let mut pos = 8 * (count + 1);
    let total: usize = pos + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(count as u64).to_le_bytes());
    for p in &parts {
        out.extend_from_slice(&(pos as u64).to_le_bytes());
        pos += p.len();
    }
    out.extend_from_slice(&(pos as u64).to_le_bytes());
    for p in &parts {
        out.extend_from_slice(p);
    }
    out
}

type Decoded = Result<(Channel, Message), String>;

fn raw_json(v: Option<&serde_json::value::RawValue>) -> Bytes {
    match v {
        Some(r) if r.get() != "null" => Bytes::copy_from_slice(r.get().as_bytes()),
        _ => Bytes::from_static(b"{}"),
    }
}

/// A legacy JSON frame from a client (buffers come from the binary envelope, if any).
fn decode_legacy_json(text: &[u8], buffers: Vec<Bytes>) -> Decoded {
    #[derive(Deserialize)]
    struct Frame<'a> {
        #[serde(borrow)]
        header: &'a serde_json::value::RawValue,
        #[serde(borrow, default)]
        parent_header: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, default)]
        metadata: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, default)]
        content: Option<&'a serde_json::value::RawValue>,
        #[serde(default)]
        channel: Option<String>,
    }
    let f: Frame =
        serde_json::from_slice(text).map_err(|e| format!("not a Jupyter message: {e}"))?;
    let channel = f.channel.as_deref().unwrap_or("shell");
    let channel = Channel::parse(channel).ok_or_else(|| format!("unknown channel {channel:?}"))?;
    let msg = Message::from_parts(
        Vec::new(),
        Bytes::copy_from_slice(f.header.get().as_bytes()),
        raw_json(f.parent_header),
        raw_json(f.metadata),
        raw_json(f.content),
        buffers,
    )
    .map_err(|e| e.to_string())?;
    if msg.msg_id.is_empty() || msg.msg_type.is_empty() {
        return Err("the header needs msg_id and msg_type".into());
    }
    Ok((channel, msg))
}

fn decode_legacy_binary(b: &[u8]) -> Decoded {
    let be32 = |i: usize| -> Result<usize, String> {
        b.get(i..i + 4)
            .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
            .ok_or_else(|| "truncated binary frame".to_string())
    };
    let n = be32(0)?;
    if n == 0 || n > 1024 {
        return Err(format!("bad part count {n}"));
    }
    let mut offsets = (0..n)
        .map(|i| be32(4 * (i + 1)))
        .collect::<Result<Vec<_>, _>>()?;
    offsets.push(b.len());
    let part = |i: usize| -> Result<&[u8], String> {
        let (s, e) = (offsets[i], offsets[i + 1]);
        if s > e || e > b.len() {
            return Err("bad offsets".into());
        }
        Ok(&b[s..e])
    };
    let json = part(0)?;
    let buffers = (1..n)
        .map(|i| part(i).map(Bytes::copy_from_slice))
        .collect::<Result<Vec<_>, _>>()?;
    decode_legacy_json(json, buffers)
}

fn decode_v1(b: &[u8]) -> Decoded {
    let le64 = |i: usize| -> Result<usize, String> {
        b.get(i..i + 8)
            .map(|s| u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]) as usize)
            .ok_or_else(|| "truncated v1 frame".to_string())
    };
    let count = le64(0)?;
    if !(6..=1024).contains(&count) {
        return Err(format!("bad offset count {count}"));
    }
    let offsets = (0..count)
        .map(|i| le64(8 * (i + 1)))
        .collect::<Result<Vec<_>, _>>()?;
    let part = |i: usize| -> Result<&[u8], String> {
        let (s, e) = (offsets[i], offsets[i + 1]);
        if s > e || e > b.len() {
            return Err("bad offsets".into());
        }
        Ok(&b[s..e])
    };
    let channel = std::str::from_utf8(part(0)?).map_err(|_| "bad channel".to_string())?;
    let channel = Channel::parse(channel).ok_or_else(|| format!("unknown channel {channel:?}"))?;
    let valid = |p: &[u8]| -> Result<Bytes, String> {
        serde_json::from_slice::<&serde_json::value::RawValue>(p)
            .map_err(|e| format!("bad JSON part: {e}"))?;
        Ok(Bytes::copy_from_slice(p))
    };
    let header = valid(part(1)?)?;
    let parent = valid(part(2)?)?;
    let metadata = valid(part(3)?)?;
    let content = valid(part(4)?)?;
    let buffers = (5..count - 1)
        .map(|i| part(i).map(Bytes::copy_from_slice))
        .collect::<Result<Vec<_>, _>>()?;
    let msg = Message::from_parts(Vec::new(), header, parent, metadata, content, buffers)
        .map_err(|e| e.to_string())?;
    if msg.msg_id.is_empty() || msg.msg_type.is_empty() {
        return Err("the header needs msg_id and msg_type".into());
    }
    Ok((channel, msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Message {
        let mut m = Message::new("comm_msg", &json!({"data": {"x": 1}}), None, "s", "u");
        m.buffers = vec![Bytes::from_static(b"\x00\x01"), Bytes::from_static(b"abc")];
        m
    }

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

    #[test]
    fn v1_round_trip() {
        let m = sample();
        let frame = encode_v1(Channel::Shell, &m);
        let (ch, back) = decode_v1(&frame).unwrap();
        assert_eq!(ch, Channel::Shell);
        assert_eq!(back.header, m.header);
        assert_eq!(back.content, m.content);
        assert_eq!(back.buffers, m.buffers);
        // The count is parts + 1 and the last offset is the length.
        let count = u64::from_le_bytes(frame[..8].try_into().unwrap()) as usize;
        assert_eq!(count, 5 + 2 + 1);
        let last = u64::from_le_bytes(frame[8 * count..8 * count + 8].try_into().unwrap()) as usize;
        assert_eq!(last, frame.len());
    }

    #[test]
    fn legacy_binary_round_trip() {
        let m = sample();
        let WsMessage::Binary(frame) = encode_frame(Framing::Legacy, Channel::Iopub, &m) else {
            panic!("buffers need a binary frame")
        };
        let (ch, back) = decode_legacy_binary(&frame).unwrap();
        assert_eq!(ch, Channel::Iopub);
        assert_eq!(back.msg_id, m.msg_id);
        assert_eq!(back.buffers, m.buffers);
    }

    #[test]
    fn text_only_clients_get_text_without_buffers() {
        let m = sample();
        let WsMessage::Text(t) = encode_frame(Framing::LegacyTextOnly, Channel::Iopub, &m) else {
            panic!("a text-only client must never get a binary frame")
        };
        let v: Value = serde_json::from_str(t.as_str()).unwrap();
        assert_eq!(v["buffers"], json!([]));
        assert_eq!(v["content"]["data"]["x"], 1);
        let mut h = HeaderMap::new();
        h.insert(header::USER_AGENT, "Tornado/6.5.2".parse().unwrap());
        assert!(is_gateway_proxy(&h));
        h.insert(header::USER_AGENT, "Mozilla/5.0".parse().unwrap());
        assert!(!is_gateway_proxy(&h));
        assert!(!is_gateway_proxy(&HeaderMap::new()));
    }

    #[test]
    fn legacy_text_has_top_level_ids() {
        let m = Message::new(
            "status",
            &json!({"execution_state": "idle"}),
            None,
            "s",
            "u",
        );
        let WsMessage::Text(t) = encode_frame(Framing::Legacy, Channel::Iopub, &m) else {
            panic!("no buffers: text")
        };
        let v: Value = serde_json::from_str(t.as_str()).unwrap();
        assert_eq!(v["msg_id"], m.msg_id.as_str());
        assert_eq!(v["msg_type"], "status");
        assert_eq!(v["channel"], "iopub");
        assert_eq!(v["buffers"], json!([]));
        assert_eq!(v["content"]["execution_state"], "idle");
    }

    #[test]
    fn malformed_frames_are_refused() {
        for bad in [
            &b"{"[..],
            b"{\"channel\": \"shell\"}",
            b"{\"header\": {}, \"channel\": \"shell\"}",
            b"{\"header\": {\"msg_id\": \"1\", \"msg_type\": \"x\"}, \"channel\": \"mars\"}",
        ] {
            assert!(
                decode_legacy_json(bad, Vec::new()).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(decode_v1(&[0u8; 4]).is_err());
        assert!(decode_v1(&[255u8; 64]).is_err());
        assert!(decode_legacy_binary(&[0, 0, 0, 9, 0]).is_err());
        let mut bad_offsets = vec![0, 0, 0, 2, 0, 0, 0, 200, 0, 0, 0, 3];
        bad_offsets.extend_from_slice(b"{}");
        assert!(decode_legacy_binary(&bad_offsets).is_err());
    }
}
