//! What a client connection may cost the broker before and after it authenticates: the
//! time limits and caps of [`ClientLimits`] (their defaults live here), and the request
//! body deadline, a middleware. The accept loop that applies the rest is `listener.rs`; the
//! WebSocket ping/pong limit is `ws_liveness.rs`.
//!
//! Why: one anonymous client that opens many connections and sends nothing (or half a
//! request line) must not exhaust the broker's descriptors and so kill every user's
//! sessions (issue 18).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Body as _, Frame, SizeHint};

use super::error::ApiError;
use super::metrics::{ClientTimeout, Refused};
use super::user_load::{Held, Kind};
use super::AppState;

/// Time limits and caps on client connections. `Duration::ZERO` or a cap of 0 turns that
/// limit off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientLimits {
    /// From the moment a connection waits for a request (when it opens, and after each
    /// response on a keep-alive connection) until the request line and headers are all in.
    /// So it is also the idle keep-alive timeout, and it covers the WebSocket handshake
    /// (an HTTP request). hyper's timer works this way; a separate idle limit would need a
    /// second timer on the socket that also fires during long requests.
    pub header_timeout: Duration,
    /// From the end of the headers until the request body is all in.
    pub body_timeout: Duration,
    /// A broker WebSocket that has heard nothing from its client for this long sends a ping.
    pub websocket_ping_interval: Duration,
    /// After its ping, how long a WebSocket waits for any frame (the pong) before it drops
    /// the client.
    pub websocket_pong_timeout: Duration,
    /// Client TCP connections open at once (WebSockets included); past it a new one is
    /// closed at accept.
    pub max_connections: usize,
    /// Client TCP connections open at once from one IP address.
    pub max_connections_per_client: usize,
    /// WebSockets open at once on one session (agent streams and Jupyter channels).
    pub max_websockets_per_session: usize,
    /// WebSockets open at once by one user, on all their sessions.
    pub max_websockets_per_user: usize,
    /// Requests of one user in progress at once (from the end of the headers until the
    /// response body is sent; an upgraded WebSocket no longer counts as one).
    pub max_requests_per_user: usize,
    /// Failed authentications from one address within a minute after which its tokens are
    /// refused (429) for a minute.
    pub max_auth_failures: u32,
}

impl Default for ClientLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(300),
            websocket_ping_interval: Duration::from_secs(30),
            websocket_pong_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_connections_per_client: 256,
            max_websockets_per_session: 64,
            max_websockets_per_user: 256,
            max_requests_per_user: 64,
            max_auth_failures: 10,
        }
    }
}

/// Middleware: a request whose body does not arrive within `body_timeout` gets a 408 and
/// its connection is closed. Requests without a body (GET, WebSocket upgrades) pass as
/// they are.
pub async fn body_deadline(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let limit = state.limits.clients.body_timeout;
    if limit.is_zero() || req.body().size_hint().exact() == Some(0) {
        return next.run(req).await;
    }
    let fired = Arc::new(AtomicBool::new(false));
    let req = {
        let fired = fired.clone();
        req.map(move |inner| {
            Body::new(DeadlineBody {
                inner,
                deadline: Box::pin(tokio::time::sleep(limit)),
                fired,
            })
        })
    };
    let response = next.run(req).await;
    if !fired.load(Ordering::Relaxed) {
        return response;
    }
    // The handler saw a body error (a 400 of its extractor); tell the client what it was.
    state.metrics.connection_timed_out(ClientTimeout::Body);
    let mut response = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        format!(
            "the request body did not arrive within {} s",
            limit.as_secs_f64()
        ),
    )
    .into_response();
    // The rest of the body may still be on its way: the connection cannot be reused.
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// A WebSocket's place on its session and among its user's, held while it is open.
pub struct WebSocketPlace {
    _session: crate::session::ConnectionGuard,
    _user: Held,
}

/// The place of a new WebSocket of `user` on `session`, or the 429 that refuses it.
pub fn websocket_place(
    state: &AppState,
    user: &str,
    session: &Arc<crate::session::Session>,
) -> Result<WebSocketPlace, ApiError> {
    let max = state.limits.clients.max_websockets_per_session;
    let Some(on_session) = session.try_connect_client(max) else {
        state.metrics.request_refused(Refused::WebSocketsPerSession);
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_websockets",
            format!(
                "session {} already has {max} WebSockets open (the limit)",
                session.id
            ),
        ));
    };
    let user: Arc<str> = user.into();
    let Some(of_user) = state.user_load.try_hold(&user, Kind::WebSocket) else {
        state.metrics.request_refused(Refused::WebSocketsPerUser);
        let max = state.user_load.cap(Kind::WebSocket);
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_websockets",
            format!("user {user} already has {max} WebSockets open (the limit)"),
        ));
    };
    Ok(WebSocketPlace {
        _session: on_session,
        _user: of_user,
    })
}

#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
struct BodyTimedOut;

/// A request body that fails once its deadline passes.
struct DeadlineBody {
    inner: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
    fired: Arc<AtomicBool>,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        // What has arrived is taken even past the deadline; only waiting is limited.
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|r| r.map_err(Into::into))),
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    self.fired.store(true, Ordering::Relaxed);
                    Poll::Ready(Some(Err(BodyTimedOut.into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body that never sends fails at its deadline and says so; one that has its data
    /// ready gives it even when the deadline has passed.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_fails_at_its_deadline() {
        let (_tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
        let stalled = Body::new(ChannelBody(rx));
        let fired = Arc::new(AtomicBool::new(false));
        let mut body = DeadlineBody {
            inner: stalled,
            deadline: Box::pin(tokio::time::sleep(Duration::from_secs(5))),
            fired: fired.clone(),
        };
        let started = tokio::time::Instant::now();
        let r = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        assert!(matches!(r, Some(Err(_))));
        assert!(fired.load(Ordering::Relaxed));
        assert_eq!(started.elapsed(), Duration::from_secs(5));

        let mut ready = DeadlineBody {
            inner: Body::from("abc"),
            deadline: Box::pin(tokio::time::sleep(Duration::ZERO)),
            fired: Arc::new(AtomicBool::new(false)),
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let r = std::future::poll_fn(|cx| Pin::new(&mut ready).poll_frame(cx)).await;
        let data = r.and_then(|f| f.ok()).and_then(|f| f.into_data().ok());
        assert_eq!(data.as_deref(), Some(&b"abc"[..]));
        assert!(!ready.fired.load(Ordering::Relaxed));
    }

    /// A body fed from a channel (a client that sends when the test says so).
    struct ChannelBody(tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>);

    impl http_body::Body for ChannelBody {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            self.0.poll_recv(cx)
        }
    }
}
