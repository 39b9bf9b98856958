//! The accept loop: takes client TCP connections within the caps of [`ClientLimits`],
//! serves HTTP/1.1 on each with hyper (header read timeout, upgrades for the WebSockets),
//! and on shutdown stops accepting and lets open requests finish.
//!
//! Why not `axum::serve`: it has no header read timeout and no connection caps, so a client
//! that opens connections and sends half a request line keeps each forever (issue 18).
//!
//! A connection holds its [`Slot`] for as long as its socket is open: the slot travels
//! inside the socket ([`CountedStream`]), so an upgraded WebSocket, which outlives hyper's
//! connection task, still counts.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tower::ServiceExt;

use super::clients::ClientLimits;
use super::metrics::{ClientTimeout, Metrics, Refusal};

/// Open connections, in all and by client address.
#[derive(Default)]
struct Open {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// Counts open connections against the caps.
#[derive(Clone)]
pub struct ConnectionCaps {
    open: Arc<Mutex<Open>>,
    max_total: usize,
    max_per_address: usize,
    metrics: Arc<Metrics>,
}

/// The most connections one address may hold under a total cap of `max_total` (0: none)
/// and a per-address cap of `per_address` (0: none): never the whole total, so that one
/// flooding address (even with the per-address cap set as high as the total) leaves an
/// eighth of the slots, at least one, to everyone else.
fn one_address_share(max_total: usize, per_address: usize) -> usize {
    if max_total < 2 {
        return per_address;
    }
    let share = max_total - (max_total / 8).max(1);
    if per_address == 0 {
        share
    } else {
        per_address.min(share)
    }
}

impl ConnectionCaps {
    pub fn new(limits: &ClientLimits, metrics: Arc<Metrics>) -> Self {
        Self {
            open: Arc::default(),
            max_total: limits.max_connections,
            max_per_address: one_address_share(
                limits.max_connections,
                limits.max_connections_per_client,
            ),
            metrics,
        }
    }

    /// A slot for a new connection from `ip`, unless a cap is reached (0 means no cap).
    pub fn admit(&self, ip: IpAddr) -> Result<Slot, Refusal> {
        let mut open = crate::sync::lock(&self.open);
        if self.max_total != 0 && open.total >= self.max_total {
            return Err(Refusal::MaxConnections);
        }
        let from_ip = open.by_address.get(&ip).copied().unwrap_or(0);
        if self.max_per_address != 0 && from_ip >= self.max_per_address {
            return Err(Refusal::MaxConnectionsPerClient);
        }
        open.total += 1;
        open.by_address.insert(ip, from_ip + 1);
        self.metrics.client_connections_changed(1);
        Ok(Slot {
            caps: self.clone(),
            ip,
        })
    }
}

/// One open connection's place under the caps; given back when dropped.
pub struct Slot {
    caps: ConnectionCaps,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = crate::sync::lock(&self.caps.open);
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_address.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.by_address.remove(&self.ip);
            }
        }
        self.caps.metrics.client_connections_changed(-1);
    }
}

/// A client socket that holds its slot until it is closed.
struct CountedStream {
    tcp: TcpStream,
    _slot: Slot,
}

impl AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

/// Serve `app` on `listener` until `shutdown` resolves; then stop accepting, close idle
/// connections, and return once every open request has been answered. WebSockets already
/// upgraded carry on (the session shutdown that follows closes them).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &ClientLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let caps = ConnectionCaps::new(limits, metrics.clone());
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new());
    // hyper's own default is 30 s once a timer is set; 0 in the settings means none.
    http.header_read_timeout((!limits.header_timeout.is_zero()).then_some(limits.header_timeout));
    // Each connection task holds a receiver: `closed()` resolves when all have ended.
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    let mut failures = AcceptFailures::default();
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    failures.failed(e, &metrics).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let slot = match caps.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                // Closed at once: reading a request to answer it would cost what the cap
                // is there to save.
                metrics.connection_refused(why);
                tracing::debug!(%peer, ?why, "connection refused");
                drop(tcp);
                continue;
            }
        };
        // Without TCP_NODELAY small WebSocket frames meet delayed ACKs (~40 ms each).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        let io = TokioIo::new(CountedStream { tcp, _slot: slot });
        // The client's address, for the failed-authentication throttle (`auth_failures`).
        let app = app
            .clone()
            .map_request(move |mut req: axum::extract::Request<_>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req
            });
        let conn = http
            .serve_connection(io, TowerToHyperService::new(app))
            .with_upgrades();
        let mut stop = stop_rx.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut conn = pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            if e.is_timeout() {
                                metrics.connection_timed_out(ClientTimeout::Header);
                                tracing::debug!(%peer, "connection closed: no request headers within the header timeout");
                            } else {
                                tracing::trace!(%peer, error = %e, "connection ended with an error");
                            }
                        }
                        break;
                    }
                    changed = stop.changed(), if !stopping => {
                        // Err: the loop is gone, which also means stop.
                        let _ = changed;
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(stop);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(stop_rx);
    stop_tx.closed().await;
}

/// Failed `accept`s, logged in summary: when descriptors run out, every accept fails
/// until some close, and a line each would flood the log.
#[derive(Default)]
struct AcceptFailures {
    last_logged: Option<tokio::time::Instant>,
    unlogged: u64,
}

impl AcceptFailures {
    /// `accept` failed with `e`. Errors of one connection are nothing; running out of
    /// descriptors (EMFILE, ENFILE) passes once some close, so wait a little rather than
    /// spin.
    async fn failed(&mut self, e: io::Error, metrics: &Metrics) {
        if matches!(
            e.kind(),
            io::ErrorKind::ConnectionRefused
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
        ) {
            return;
        }
        if crate::descriptors::is_exhaustion(&e) {
            metrics.connection_refused(Refusal::Descriptors);
        }
        if self
            .last_logged
            .is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY)
        {
            self.last_logged = Some(tokio::time::Instant::now());
            tracing::error!(error = %e, also_failed = self.unlogged, "accept failed (sessions keep their reserved descriptors; raise ulimit -n or lower --max-connections)");
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(total: usize, per_address: usize) -> ConnectionCaps {
        let limits = ClientLimits {
            max_connections: total,
            max_connections_per_client: per_address,
            ..ClientLimits::default()
        };
        ConnectionCaps::new(&limits, Arc::new(Metrics::new("local")))
    }

    #[test]
    fn caps_count_per_address_and_in_all_and_free_on_drop() {
        let c = caps(3, 2);
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        let a1 = c.admit(a).map_err(|_| ()).unwrap();
        let _a2 = c.admit(a).map_err(|_| ()).unwrap();
        assert_eq!(c.admit(a).err(), Some(Refusal::MaxConnectionsPerClient));
        let _b1 = c.admit(b).map_err(|_| ()).unwrap();
        assert_eq!(c.admit(b).err(), Some(Refusal::MaxConnections));
        drop(a1);
        assert!(c.admit(b).is_ok(), "a closed connection frees its slot");
        assert_eq!(crate::sync::lock(&c.open).by_address.get(&a), Some(&1));
    }

    #[test]
    fn one_address_never_takes_every_slot() {
        // The per-address cap as high as the total: one address still leaves an eighth.
        let c = caps(16, 16);
        let flood: IpAddr = [10, 0, 0, 1].into();
        let other: IpAddr = [10, 0, 0, 2].into();
        let held: Vec<Slot> = (0..16).filter_map(|_| c.admit(flood).ok()).collect();
        assert_eq!(held.len(), 14);
        let others: Vec<Slot> = (0..16).filter_map(|_| c.admit(other).ok()).collect();
        assert_eq!(others.len(), 2);
        // No per-address cap: the same share applies; a lower per-address cap wins.
        assert_eq!(one_address_share(16, 0), 14);
        assert_eq!(one_address_share(6, 4), 4);
        assert_eq!(one_address_share(6, 0), 5);
        assert_eq!(one_address_share(1, 0), 0);
        assert_eq!(one_address_share(0, 0), 0);
        assert_eq!(one_address_share(0, 7), 7);
    }

    #[test]
    fn zero_means_no_cap() {
        let c = caps(0, 0);
        let ip: IpAddr = [10, 0, 0, 1].into();
        let slots: Vec<Slot> = (0..5000).filter_map(|_| c.admit(ip).ok()).collect();
        assert_eq!(slots.len(), 5000);
        drop(slots);
        assert!(crate::sync::lock(&c.open).by_address.is_empty());
    }
}
