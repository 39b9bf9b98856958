//! Per-user egress limits and counters: bytes through the proxy (both directions, since the
//! broker started) and concurrent connections to it. [`Metered`] wraps an outbound socket
//! so every byte is charged as it passes, and a connection that crosses the byte limit is
//! cut at once, not after it finished.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::UserEgress;

/// One user's egress limits; 0: none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserLimits {
    /// Bytes sent and received through the proxy, together, since the broker started.
    pub max_bytes: u64,
    /// Connections to the proxy open at once (each carries one request or tunnel).
    pub max_connections: usize,
}

/// 1 GiB, about twenty times the data stack's wheels.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
/// pip opens a few connections at a time; 16 leaves room for parallel downloads.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;

impl Default for UserLimits {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// A user's counters, read by `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserUsage {
    pub user: String,
    pub allowed: u64,
    pub refused: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub open_connections: u64,
}

/// A user's policy, limits and counters.
pub(super) struct UserMeter {
    pub egress: UserEgress,
    pub allowed: AtomicU64,
    pub refused: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    open: AtomicUsize,
}

impl UserMeter {
    pub fn new(egress: UserEgress) -> Self {
        Self {
            egress,
            allowed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            open: AtomicUsize::new(0),
        }
    }

    pub fn usage(&self, user: &str) -> UserUsage {
        UserUsage {
            user: user.to_string(),
            allowed: self.allowed.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            bytes_sent: self.sent.load(Ordering::Relaxed),
            bytes_received: self.received.load(Ordering::Relaxed),
            open_connections: self.open.load(Ordering::Relaxed) as u64,
        }
    }

    /// Bytes both ways so far.
    pub fn bytes(&self) -> u64 {
        self.sent.load(Ordering::Relaxed) + self.received.load(Ordering::Relaxed)
    }

    /// The refusal once the byte limit is used up.
    pub fn over_bytes(&self) -> Option<String> {
        let max = self.egress.limits.max_bytes;
        (max > 0 && self.bytes() >= max).then(|| {
            format!("egress byte limit reached: this user may send and receive {max} bytes")
        })
    }

    /// Takes a connection place; `Err` with the refusal when all are taken. Counted before
    /// the check, so two at once cannot both take the last place.
    pub fn connect(self: &Arc<Self>) -> Result<ConnectionPlace, ConnectionLimitReached> {
        let before = self.open.fetch_add(1, Ordering::AcqRel);
        let place = ConnectionPlace(self.clone());
        let max = self.egress.limits.max_connections;
        if max > 0 && before >= max {
            return Err(ConnectionLimitReached { max });
        }
        Ok(place)
    }
}

/// A user has as many egress connections open as it may.
#[derive(Debug, thiserror::Error)]
#[error("egress connection limit reached: this user may have {max} connections open")]
pub struct ConnectionLimitReached {
    pub max: usize,
}

/// A connection's place under the user's cap, given back on drop.
pub(super) struct ConnectionPlace(Arc<UserMeter>);

impl Drop for ConnectionPlace {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What one outbound connection carried.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub sent: AtomicU64,
    pub received: AtomicU64,
}

/// An outbound socket whose bytes are charged to the user as they pass; reads and writes
/// fail once the user's byte limit is used up.
pub(super) struct Metered<S> {
    inner: S,
    meter: Arc<UserMeter>,
    tally: Arc<Tally>,
}

impl<S> Metered<S> {
    pub fn new(inner: S, meter: Arc<UserMeter>, tally: Arc<Tally>) -> Self {
        Self {
            inner,
            meter,
            tally,
        }
    }

    fn over(&self) -> Option<io::Error> {
        self.meter
            .over_bytes()
            .map(|why| io::Error::new(io::ErrorKind::QuotaExceeded, why))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.over() {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        self.meter.received.fetch_add(n, Ordering::Relaxed);
        self.tally.received.fetch_add(n, Ordering::Relaxed);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Metered<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.over() {
            return Poll::Ready(Err(e));
        }
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = &r {
            self.meter.sent.fetch_add(*n as u64, Ordering::Relaxed);
            self.tally.sent.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
