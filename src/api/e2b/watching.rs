//! envd's directory watching (`watch_dir`): the Connect server stream `WatchDir` (what the
//! async Python SDK and the JavaScript SDK use: `{"start": {}}`, then `{"filesystem":
//! event}` messages and a `{"keepalive": {}}` every 30 s) and the polled watchers `CreateWatcher` /
//! `GetWatcherEvents` / `RemoveWatcher` (the sync Python SDK's). Events are envd's
//! (`EVENT_TYPE_CREATE`, `WRITE`, `REMOVE`, `RENAME`, `CHMOD`, `name` relative to the
//! watched directory, with the entry's `EntryInfo` for create, write and chmod when
//! `includeEntry` is asked, as envd 0.6.3 sends it); recursive watching follows new
//! subdirectories. The host side is `session::files::watch` (inotify, never through a
//! symlink).
//!
//! Bounded: a user holds at most [`MAX_WATCHES_PER_USER`] watches (streams and watchers
//! together), the broker at most [`MAX_WATCHES_TOTAL`]; a watcher buffers at most [`MAX_BUFFERED`] events between polls and a stream
//! at most [`MAX_QUEUED`] its client has not read: past that, events are dropped and the
//! broker logs how many (envd's buffer has no bound). A watcher belongs to its sandbox: it
//! ends with it, and another sandbox's (another user's) watcher id is not found.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use uuid::Uuid;

use super::auth::SandboxCaller;
use super::connect::{end_stream, envelope, stream_request, unary_request, ConnectError};
use super::entry::{entry_json, fs_error, rel_of};
use crate::session::files::watch::{ChangeKind, DirWatch};
use crate::session::{Session, Workspace};
use crate::sync::lock;

/// Watches (streams and watchers together) one user may hold.
pub const MAX_WATCHES_PER_USER: usize = 8;
/// Watches the whole broker holds: each is an inotify instance of the broker's uid, and the
/// system allows a uid 128 by default (`fs.inotify.max_user_instances`); one user's watches
/// must not use up everyone's.
pub const MAX_WATCHES_TOTAL: usize = 64;
/// Events a watcher keeps between two `GetWatcherEvents`.
pub const MAX_BUFFERED: usize = 10_000;
/// Events a `WatchDir` stream holds that its client has not read.
pub const MAX_QUEUED: usize = 1024;
const KEEPALIVE: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, alias = "include_entry")]
    include_entry: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherReq {
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

struct Buffered {
    events: VecDeque<Value>,
    dropped: u64,
}

struct Watcher {
    sandbox: Uuid,
    events: Arc<Mutex<Buffered>>,
    task: tokio::task::AbortHandle,
}

/// The polled watchers, and how many watches each user holds.
#[derive(Default)]
pub struct Watchers {
    watchers: Mutex<HashMap<String, Watcher>>,
    per_user: Arc<Mutex<HashMap<String, usize>>>,
}

/// A user's place among [`MAX_WATCHES_PER_USER`], given back when dropped.
struct Slot {
    per_user: Arc<Mutex<HashMap<String, usize>>>,
    user: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut map = lock(&self.per_user);
        if let Some(n) = map.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.user);
            }
        }
    }
}

impl Watchers {
    fn slot(&self, user: &str) -> Result<Slot, ConnectError> {
        let mut map = lock(&self.per_user);
        if map.values().sum::<usize>() >= MAX_WATCHES_TOTAL {
            return Err(ConnectError::new(
                "resource_exhausted",
                format!("the broker holds {MAX_WATCHES_TOTAL} directory watches (its limit); retry once one has ended"),
            ));
        }
        let n = map.entry(user.to_string()).or_default();
        if *n >= MAX_WATCHES_PER_USER {
            return Err(ConnectError::new(
                "resource_exhausted",
                format!("user {user} already watches {MAX_WATCHES_PER_USER} directories (the limit); stop one first"),
            ));
        }
        *n += 1;
        Ok(Slot {
            per_user: self.per_user.clone(),
            user: user.to_string(),
        })
    }

    /// Ends the watchers of sandbox `id` (it ended).
    pub fn end_sandbox(&self, id: Uuid) {
        lock(&self.watchers).retain(|_, w| {
            if w.sandbox == id {
                w.task.abort();
            }
            w.sandbox != id
        });
    }
}

fn kind_name(kind: ChangeKind) -> &'static str {
    match kind {
        ChangeKind::Create => "EVENT_TYPE_CREATE",
        ChangeKind::Write => "EVENT_TYPE_WRITE",
        ChangeKind::Remove => "EVENT_TYPE_REMOVE",
        ChangeKind::Rename => "EVENT_TYPE_RENAME",
        ChangeKind::Chmod => "EVENT_TYPE_CHMOD",
    }
}

/// Opens the watch a request asks for.
async fn open(
    state: &crate::api::AppState,
    caller: &SandboxCaller,
    req: &WatchReq,
) -> Result<(Workspace, String, DirWatch), ConnectError> {
    let rel = rel_of(&req.path)?;
    let ws = state
        .registry
        .workspace(&caller.session)
        .map_err(|e| ConnectError::new("internal", e.to_string()))?;
    let dir = ws.watch(&rel, req.recursive).await.map_err(fs_error)?;
    Ok((ws, rel, dir))
}

/// Runs `watch` until the sandbox ends or `emit` says stop, turning changes into envd's
/// events (with their entries if `include_entry`).
async fn pump(
    mut watch: DirWatch,
    ws: Workspace,
    base: String,
    include_entry: bool,
    session: Arc<Session>,
    mut emit: impl FnMut(Option<Value>) -> bool,
) {
    let mut keepalive = tokio::time::interval(KEEPALIVE);
    keepalive.tick().await;
    loop {
        let changes = tokio::select! {
            _ = session.ended() => return,
            _ = keepalive.tick() => {
                if !emit(None) { return; }
                continue;
            }
            c = watch.next() => c,
        };
        let Ok(changes) = changes else {
            return;
        };
        if changes.overflowed {
            tracing::warn!(session = %session.id, "a directory watch lost events: the system's queue overflowed");
        }
        for change in changes.changes {
            let name = change.rel.to_string_lossy().into_owned();
            let mut event = json!({"name": name, "type": kind_name(change.kind)});
            let carries = matches!(
                change.kind,
                ChangeKind::Create | ChangeKind::Write | ChangeKind::Chmod
            );
            if include_entry && carries {
                let path = if base.is_empty() {
                    name.clone()
                } else {
                    format!("{base}/{name}")
                };
                if let Ok(e) = ws.stat(&path).await {
                    event["entry"] = entry_json(&e, &ws);
                }
            }
            if !emit(Some(event)) {
                return;
            }
        }
    }
}

/// `CreateWatcher`: a watcher whose events `GetWatcherEvents` collects.
pub async fn create_watcher(
    state: &crate::api::AppState,
    caller: &SandboxCaller,
    bytes: &[u8],
) -> Result<Value, ConnectError> {
    let req: WatchReq = unary_request(bytes)?;
    let slot = caller.e2b.watchers.slot(&caller.session.user.name)?;
    let (ws, base, watch) = open(state, caller, &req).await?;
    let events = Arc::new(Mutex::new(Buffered {
        events: VecDeque::new(),
        dropped: 0,
    }));
    let sink = events.clone();
    let session = caller.session.clone();
    let task = tokio::spawn(async move {
        let _slot = slot;
        pump(watch, ws, base, req.include_entry, session.clone(), |event| {
            let Some(event) = event else { return true };
            let mut b = lock(&sink);
            if b.events.len() >= MAX_BUFFERED {
                b.dropped += 1;
                if b.dropped == 1 {
                    tracing::warn!(session = %session.id, "a directory watcher holds {MAX_BUFFERED} unread events; newer ones are dropped");
                }
            } else {
                b.events.push_back(event);
            }
            true
        })
        .await;
    });
    let id = Uuid::new_v4().to_string();
    lock(&caller.e2b.watchers.watchers).insert(
        id.clone(),
        Watcher {
            sandbox: caller.session.id,
            events,
            task: task.abort_handle(),
        },
    );
    Ok(json!({"watcherId": id}))
}

fn no_watcher(id: &str) -> ConnectError {
    ConnectError::not_found(format!("watcher with id {id} not found"))
}

/// `GetWatcherEvents`: what the watcher saw since the last call.
pub fn get_watcher_events(caller: &SandboxCaller, bytes: &[u8]) -> Result<Value, ConnectError> {
    let req: WatcherReq = unary_request(bytes)?;
    let watchers = lock(&caller.e2b.watchers.watchers);
    let w = watchers
        .get(&req.watcher_id)
        .filter(|w| w.sandbox == caller.session.id)
        .ok_or_else(|| no_watcher(&req.watcher_id))?;
    let mut b = lock(&w.events);
    b.dropped = 0;
    let events: Vec<Value> = b.events.drain(..).collect();
    Ok(json!({"events": events}))
}

/// `RemoveWatcher`.
pub fn remove_watcher(caller: &SandboxCaller, bytes: &[u8]) -> Result<Value, ConnectError> {
    let req: WatcherReq = unary_request(bytes)?;
    let mut watchers = lock(&caller.e2b.watchers.watchers);
    match watchers.get(&req.watcher_id) {
        Some(w) if w.sandbox == caller.session.id => {
            w.task.abort();
            watchers.remove(&req.watcher_id);
            Ok(json!({}))
        }
        _ => Err(no_watcher(&req.watcher_id)),
    }
}

fn stream_error(e: ConnectError) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        end_stream(Some(&e)),
    )
        .into_response()
}

/// `WatchDir`: a server stream of the directory's events until the client goes away or the
/// sandbox ends (then E2B's `unavailable`, as its proxy ends such a stream).
pub async fn watch_dir(
    state: &crate::api::AppState,
    caller: &SandboxCaller,
    bytes: &[u8],
) -> Response {
    let req: WatchReq = match stream_request(bytes) {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    let slot = match caller.e2b.watchers.slot(&caller.session.user.name) {
        Ok(s) => s,
        Err(e) => return stream_error(e),
    };
    let (ws, base, watch) = match open(state, caller, &req).await {
        Ok(o) => o,
        Err(e) => return stream_error(e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(MAX_QUEUED);
    let session = caller.session.clone();
    // `WatchDirResponse`'s oneof is the message's own: `{"start": {}}`, not nested.
    let _ = tx.try_send(envelope(&json!({"start": {}})));
    tokio::spawn(async move {
        let _slot = slot;
        let mut dropped = 0u64;
        let sink = tx.clone();
        pump(watch, ws, base, req.include_entry, session.clone(), |event| {
            let frame = match event {
                Some(e) => json!({"filesystem": e}),
                None => json!({"keepalive": {}}),
            };
            match sink.try_send(envelope(&frame)) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    dropped += 1;
                    if dropped == 1 {
                        tracing::warn!(session = %session.id, "a directory watch's client reads too slowly; events are dropped");
                    }
                    true
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        })
        .await;
        let end = if session.status().ended() {
            end_stream(Some(&ConnectError::new(
                "unavailable",
                format!(
                    "the connection to sandbox {} ended before the stream completed",
                    session.id
                ),
            )))
        } else {
            end_stream(None)
        };
        let _ = tx.send(end).await;
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(body),
    )
        .into_response()
}
