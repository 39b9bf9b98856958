//! One client connection to the egress proxy, served by hyper's HTTP/1.1 server (headers
//! bounded in size and time): `CONNECT host:port` opens a tunnel (TLS passes through, never
//! intercepted) and `GET http://host/...` is forwarded over hyper's client. Before any
//! outbound connection the target passes the user's [`Policy`], its name is resolved here
//! (never by the kernel) and *every* resolved address is checked; the connection then goes
//! to a checked address, never to a second resolution. A refusal is a `403` whose reason
//! phrase and body are the sentence (`host not allowed by policy: example.org`), followed
//! for a refused host or port by the setting that would allow it (`(kernel-broker's egress
//! policy: an operator allows hosts with --egress-allow or a user's egress_allow; ...)`):
//! pip and requests print the reason phrase of a refused `CONNECT` ("Tunnel connection
//! failed: 403 host not allowed by policy: ..."), so the agent reads why and what would
//! change it. The recording keeps the sentence alone.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, CONNECTION, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::meter::{ConnectionPlace, Metered, Tally, UserMeter};
use super::policy::{Refusal, Target};
use super::{Egress, EgressEvent, Timeouts};
use crate::sync::lock;

type Body = BoxBody<Bytes, hyper::Error>;

/// What every connection of one listener shares.
pub(super) struct Context {
    pub meter: Arc<UserMeter>,
    pub user: String,
    /// The session requests are recorded in (a pooled kernel changes hands once).
    pub session: Arc<Mutex<Uuid>>,
    pub egress: Arc<Egress>,
    pub timeouts: Timeouts,
}

impl Context {
    fn report(&self, event: EgressEvent) {
        let session = *lock(&self.session);
        self.egress.report(session, &self.user, event);
    }

    fn refused(&self, method: &str, host: &str, port: u16, reason: String) {
        self.meter.refused.fetch_add(1, Ordering::Relaxed);
        self.report(EgressEvent::Refused {
            method: method.to_string(),
            host: host.to_string(),
            port,
            reason,
        });
    }
}

/// One accepted connection: its context and its place under the user's cap (held by the
/// tunnel or forwarded exchange it carries until that ends).
struct Connection {
    ctx: Arc<Context>,
    _place: ConnectionPlace,
}

/// Accepts until `stop`; each connection is served in its own task.
pub(super) async fn accept_loop(listener: TcpListener, ctx: Arc<Context>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, _)) => {
                tokio::spawn(serve_connection(stream, ctx.clone()));
            }
            Err(e) => {
                // Out of descriptors, most likely: wait rather than spin.
                tracing::warn!(user = %ctx.user, error = %e, "egress proxy: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

async fn serve_connection(mut stream: TcpStream, ctx: Arc<Context>) {
    let place = match ctx.meter.connect() {
        Ok(place) => place,
        Err(limit) => {
            let why = limit.to_string();
            // Refused before its request is read: the answer is written as bytes, and the
            // client reads it as the answer to whatever it sends.
            ctx.refused("-", "", 0, why.clone());
            let body = format!("{why}\n");
            let head = format!(
                "HTTP/1.1 403 {why}\r\ncontent-type: text/plain; charset=utf-8\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = timeout(ctx.timeouts.header, stream.write_all(head.as_bytes())).await;
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let conn = Arc::new(Connection { ctx, _place: place });
    let timeouts = conn.ctx.timeouts;
    let service = hyper::service::service_fn(move |req| handle(req, conn.clone()));
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header)
        // hyper's smallest buffer: request heads past 8 KiB are refused (431).
        .max_buf_size(8192)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    let _ = served.await;
}

async fn handle(
    req: Request<Incoming>,
    conn: Arc<Connection>,
) -> Result<Response<Body>, Infallible> {
    let ctx = &conn.ctx;
    let method = req.method().to_string();
    let (host, port) = match target_of(&req) {
        Ok(t) => t,
        Err(why) => {
            ctx.refused(&method, "", 0, why.to_string());
            return Ok(answer(StatusCode::BAD_REQUEST, why));
        }
    };
    if let Some(why) = ctx.meter.over_bytes() {
        ctx.refused(&method, &host, port, why.clone());
        return Ok(answer(StatusCode::FORBIDDEN, &why));
    }
    let upstream = match open(ctx, &host, port).await {
        Ok(u) => u,
        Err(NotOpened { status, why, hint }) => {
            ctx.refused(&method, &host, port, why.clone());
            let said = match hint {
                Some(hint) => format!("{why} ({hint})"),
                None => why,
            };
            return Ok(answer(status, &said));
        }
    };
    ctx.meter.allowed.fetch_add(1, Ordering::Relaxed);
    ctx.report(EgressEvent::Allowed {
        method: method.clone(),
        host: host.clone(),
        port,
        address: upstream.1.to_string(),
    });
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let metered = Metered::new(upstream.0, ctx.meter.clone(), tally.clone());
    let closed = {
        let conn = conn.clone();
        let tally = tally.clone();
        let host = host.clone();
        move || {
            conn.ctx.report(EgressEvent::Closed {
                host,
                port,
                bytes_sent: tally.sent.load(Ordering::Relaxed),
                bytes_received: tally.received.load(Ordering::Relaxed),
                seconds: started.elapsed().as_secs_f64(),
            });
        }
    };
    if req.method() == Method::CONNECT {
        let idle = ctx.timeouts.idle;
        let held = conn.clone();
        tokio::spawn(async move {
            if let Ok(upgraded) = hyper::upgrade::on(req).await {
                let mut client = TokioIo::new(upgraded);
                let mut server = metered;
                let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
                idle_limited(copy, &tally, idle).await;
            }
            closed();
            drop(held);
        });
        return Ok(Response::new(empty()));
    }
    forward(req, metered, tally, conn.clone(), closed).await
}

/// A request's target: `CONNECT host:port`, or an absolute `http://` URL (port 80 unless
/// given). Anything else is a client that does not speak to a proxy.
fn target_of(req: &Request<Incoming>) -> Result<(String, u16), &'static str> {
    let uri = req.uri();
    let authority = uri.authority();
    if req.method() == Method::CONNECT {
        let a = authority.ok_or("CONNECT needs host:port")?;
        let port = a.port_u16().ok_or("CONNECT needs host:port")?;
        return Ok((unbracket(a.host()), port));
    }
    match (uri.scheme_str(), authority) {
        (Some("http"), Some(a)) => Ok((unbracket(a.host()), a.port_u16().unwrap_or(80))),
        (Some(_), Some(_)) => {
            Err("only http:// URLs are forwarded; https goes through CONNECT (set HTTPS_PROXY)")
        }
        _ => Err("this is an HTTP proxy: send an absolute http:// URL or CONNECT"),
    }
}

fn unbracket(host: &str) -> String {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .to_string()
}

/// Why [`open`] made no connection: the answer's status, the sentence (recorded as the
/// refusal's reason) and, for what the policy refused, the setting that would allow it,
/// said to the client only: code in a kernel that reads the answer learns what to ask an
/// operator for.
struct NotOpened {
    status: StatusCode,
    why: String,
    hint: Option<&'static str>,
}

impl NotOpened {
    fn new(status: StatusCode, why: String) -> Self {
        Self {
            status,
            why,
            hint: None,
        }
    }
}

/// The setting that would allow what the policy refused; none for an address no setting
/// makes reachable, or whose network the refusal already names.
fn allowing_setting(refusal: &Refusal) -> Option<&'static str> {
    match refusal {
        Refusal::Host(_) => Some(
            "kernel-broker's egress policy: an operator allows hosts with --egress-allow or \
             a user's egress_allow; docs/API.md, Network policy",
        ),
        Refusal::Port { .. } => Some(
            "kernel-broker's egress policy: an operator allows ports with --egress-ports or \
             a user's egress_ports; docs/API.md, Network policy",
        ),
        Refusal::Address { .. } => None,
    }
}

/// Policy, resolution, every address checked, then a connection to a checked address.
async fn open(ctx: &Context, host: &str, port: u16) -> Result<(TcpStream, SocketAddr), NotOpened> {
    let refuse = |r: Refusal| NotOpened {
        status: StatusCode::FORBIDDEN,
        hint: allowing_setting(&r),
        why: r.to_string(),
    };
    let target = ctx.meter.egress.policy.check(host, port).map_err(refuse)?;
    let addresses: Vec<SocketAddr> = match &target {
        Target::Address(ip) => vec![SocketAddr::new(*ip, port)],
        Target::Name(name) => {
            let looked_up = timeout(
                ctx.timeouts.resolve,
                tokio::net::lookup_host((name.as_str(), port)),
            )
            .await;
            match looked_up {
                Ok(Ok(found)) => found.collect(),
                Ok(Err(e)) => {
                    return Err(NotOpened::new(
                        StatusCode::BAD_GATEWAY,
                        format!("cannot resolve {name}: {e}"),
                    ))
                }
                Err(_) => {
                    return Err(NotOpened::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        format!("cannot resolve {name}: no answer in time"),
                    ))
                }
            }
        }
    };
    if addresses.is_empty() {
        return Err(NotOpened::new(
            StatusCode::BAD_GATEWAY,
            format!("{target} has no address"),
        ));
    }
    // All of them, not only the first: a name that resolves to a public address and a
    // private one is refused as a whole.
    for a in &addresses {
        ctx.meter.egress.policy.address_ok(a.ip()).map_err(|why| {
            refuse(Refusal::Address {
                host: target.to_string(),
                address: a.ip(),
                why,
            })
        })?;
    }
    let mut last = String::new();
    for a in addresses {
        match timeout(ctx.timeouts.connect, TcpStream::connect(a)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok((stream, a));
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer in time".to_string(),
        }
    }
    Err(NotOpened::new(
        StatusCode::BAD_GATEWAY,
        format!("cannot connect to {target}:{port}: {last}"),
    ))
}

/// Forwards a plain HTTP request over its own outbound connection (hyper's client), the
/// request in origin form with the proxy's hop-by-hop headers removed.
async fn forward(
    mut req: Request<Incoming>,
    upstream: Metered<TcpStream>,
    tally: Arc<Tally>,
    conn: Arc<Connection>,
    closed: impl FnOnce() + Send + 'static,
) -> Result<Response<Body>, Infallible> {
    let idle = conn.ctx.timeouts.idle;
    let (mut sender, connection) =
        match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(pair) => pair,
            Err(e) => {
                closed();
                return Ok(answer(StatusCode::BAD_GATEWAY, &format!("upstream: {e}")));
            }
        };
    tokio::spawn(async move {
        idle_limited(connection, &tally, idle).await;
        closed();
        drop(conn);
    });
    let authority = req.uri().authority().map(|a| a.to_string());
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    match path.parse() {
        Ok(uri) => *req.uri_mut() = uri,
        Err(_) => return Ok(answer(StatusCode::BAD_REQUEST, "not a valid request path")),
    }
    strip_hop_by_hop(req.headers_mut());
    if let Some(a) = authority.and_then(|a| HeaderValue::from_str(&a).ok()) {
        req.headers_mut().insert(HOST, a);
    }
    match sender.send_request(req).await {
        Ok(mut resp) => {
            strip_hop_by_hop(resp.headers_mut());
            Ok(resp.map(|b| b.boxed()))
        }
        Err(e) => Ok(answer(StatusCode::BAD_GATEWAY, &format!("upstream: {e}"))),
    }
}

/// Removes the headers that concern only one hop (RFC 9110 §7.6.1), and those the
/// `Connection` header names.
fn strip_hop_by_hop(headers: &mut hyper::HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

/// Runs `work` until it ends or no byte passed either way for `idle`.
async fn idle_limited<F: Future>(work: F, tally: &Tally, idle: std::time::Duration) {
    tokio::pin!(work);
    let total = || tally.sent.load(Ordering::Relaxed) + tally.received.load(Ordering::Relaxed);
    let (mut last, mut since) = (total(), Instant::now());
    loop {
        tokio::select! {
            _ = &mut work => return,
            _ = tokio::time::sleep(idle / 8) => {
                let now = total();
                if now != last {
                    (last, since) = (now, Instant::now());
                } else if since.elapsed() >= idle {
                    return;
                }
            }
        }
    }
}

fn empty() -> Body {
    Full::new(Bytes::new())
        .map_err(|never| match never {})
        .boxed()
}

/// An answer of the proxy itself: the sentence as the reason phrase and as the body.
fn answer(status: StatusCode, why: &str) -> Response<Body> {
    let body = Full::new(Bytes::from(format!("{why}\n")))
        .map_err(|never| match never {})
        .boxed();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(why.as_bytes()) {
        resp.extensions_mut().insert(reason);
    }
    resp
}
