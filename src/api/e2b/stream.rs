//! The streams of envd's process service (`Start`, `Connect`) as Connect server streams: a
//! command's events to one client, keepalives, the caller's deadline
//! (`connect-timeout-ms`) and the end E2B's proxy gives a stream whose sandbox went away.
//! Its own file so that `process.rs` (the methods) and `pty.rs` (terminals) share it.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::auth::SandboxCaller;
use super::command::Event;
use super::connect::{end_stream, envelope, ConnectError};
use super::E2bState;
use crate::api::AppState;
use crate::session::{CommandControl, Registry, Session};

/// How often a stream with nothing to say sends a keepalive event.
const KEEPALIVE: Duration = Duration::from_secs(30);

/// How a command's stream ends besides its command's `end`: at the caller's deadline
/// (`connect-timeout-ms`), or when its sandbox ended under it.
pub(super) struct StreamEnds {
    /// The request's deadline: the stream ends with `deadline_exceeded` then, as a Connect
    /// server (envd is connect-go) ends a call whose deadline passed.
    pub(super) deadline: Option<Instant>,
    /// The command `Start` began, killed at the deadline before the stream ends (a `Connect`
    /// stream's deadline ends only that stream, as in envd).
    pub(super) kill: Option<Arc<dyn CommandControl>>,
    /// The sandbox, to tell a stream dropped by the sandbox's end from a command's end.
    sandbox: Arc<Session>,
    e2b: Arc<E2bState>,
    registry: Registry,
}

impl StreamEnds {
    pub(super) fn of(state: &AppState, caller: &SandboxCaller, deadline: Option<Instant>) -> Self {
        Self {
            deadline,
            kill: None,
            sandbox: caller.session.clone(),
            e2b: caller.e2b.clone(),
            registry: state.registry.clone(),
        }
    }

    /// Whether the sandbox has ended.
    pub(super) fn sandbox_gone(&self) -> bool {
        sandbox_gone(&self.registry, &self.e2b, &self.sandbox)
    }

    /// What E2B's proxy ends a Connect stream with when the sandbox under it goes away:
    /// `unavailable`, which the SDKs answer by asking `/health` (502 then: the sandbox is
    /// not running, `SandboxNotRunningException`).
    pub(super) fn dropped(&self) -> Bytes {
        end_stream(Some(&ConnectError::new(
            "unavailable",
            format!(
                "the connection to sandbox {} ended before the stream completed",
                self.sandbox.id
            ),
        )))
    }
}

/// Whether sandbox `session` has ended: killed (its E2B record is removed before anything
/// of it is ended), or expired or deleted (the registry lets go of a session before its
/// kernel is shut down, and the session's status says so only once it is).
pub(super) fn sandbox_gone(registry: &Registry, e2b: &E2bState, session: &Session) -> bool {
    e2b.with(session.id, |_| ()).is_none()
        || session.status().ended()
        || registry.get(&session.user.name, session.id).is_err()
}

/// A Connect stream of `first`, then what `events` brings until the command's end (or until
/// the client leaves: the body is dropped, and with it the receiver and the budget its
/// unread events held); keepalives while nothing happens. An event's budget permits are let
/// go when the connection takes its bytes, so a client that does not read holds what the
/// connection buffers (hyper's write buffer) plus what waits here, within its user's budget.
/// At `ends.deadline` the stream ends with `deadline_exceeded`; when the sandbox ends under
/// it, with `unavailable` in place of the command's `end` (as E2B's proxy ends it).
pub(super) fn stream_response(
    first: Bytes,
    events: mpsc::UnboundedReceiver<Event>,
    ends: StreamEnds,
) -> Response {
    enum Next {
        First(Bytes, mpsc::UnboundedReceiver<Event>),
        Events(mpsc::UnboundedReceiver<Event>),
        Done,
    }
    let ends = Arc::new(ends);
    let stream = futures::stream::unfold(Next::First(first, events), move |next| {
        let ends = ends.clone();
        async move {
            let mut rx = match next {
                Next::First(first, rx) => return Some((first, Next::Events(rx))),
                Next::Events(rx) => rx,
                Next::Done => return None,
            };
            let wait = tokio::time::timeout(KEEPALIVE, rx.recv());
            let got = match ends.deadline {
                Some(at) => match tokio::time::timeout_at(at, wait).await {
                    Ok(got) => got,
                    Err(_) => {
                        if let Some(control) = &ends.kill {
                            // Killed, and forgotten (its end published) before the caller
                            // hears of the deadline: a `List` right after does not show it.
                            control.kill().await;
                            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                                while let Some(ev) = rx.recv().await {
                                    if matches!(ev, Event::End(_)) {
                                        break;
                                    }
                                }
                            })
                            .await;
                        }
                        let e = ConnectError::new("deadline_exceeded", "context deadline exceeded");
                        return Some((end_stream(Some(&e)), Next::Done));
                    }
                },
                None => wait.await,
            };
            match got {
                Err(_) => Some((
                    envelope(&json!({"event": {"keepalive": {}}})),
                    Next::Events(rx),
                )),
                Ok(Some(Event::Output(bytes, _budget))) => Some((bytes, Next::Events(rx))),
                // The end envelope and the end of the stream, or what the sandbox's end left.
                Ok(Some(Event::End(bytes))) => Some((bytes, Next::Done)),
                // The command was forgotten without an end: its sandbox ended first.
                Ok(None) => Some((ends.dropped(), Next::Done)),
            }
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(stream.map(Ok::<_, std::convert::Infallible>)),
    )
        .into_response()
}

/// The deadline a Connect request asks for in `connect-timeout-ms` (milliseconds, at most
/// 10 digits, as connect-go reads it; 0 or none: no deadline, as envd's processes). Anything
/// else is `invalid_argument`, as connect-go answers it; a sign is refused too (connect-go
/// would take `-5` as a deadline already passed).
pub(super) fn request_deadline(headers: &HeaderMap) -> Result<Option<Instant>, ConnectError> {
    let Some(value) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or("").trim();
    if text.len() > 10 {
        return Err(ConnectError::invalid(format!(
            "parse timeout: {text:?} has >10 digits"
        )));
    }
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConnectError::invalid(format!(
            "parse timeout: connect-timeout-ms must be a number of milliseconds; got {text:?}"
        )));
    }
    // At most 10 digits: below 2^34, no overflow.
    let ms: u64 = text
        .parse()
        .map_err(|e| ConnectError::invalid(format!("parse timeout: {e}")))?;
    Ok((ms > 0).then(|| Instant::now() + Duration::from_millis(ms)))
}

/// A stream that is only an error (Connect answers stream errors in the end envelope).
pub(super) fn stream_error(e: ConnectError) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        end_stream(Some(&e)),
    )
        .into_response()
}
