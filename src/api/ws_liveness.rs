//! Liveness of the broker's WebSocket clients: the broker pings a client it has not heard
//! from for `websocket_ping_interval` and drops it when nothing (the pong, or any frame)
//! arrives within `websocket_pong_timeout` after that.
//!
//! Why: a client that vanished without closing (a laptop that slept, a dropped NAT entry)
//! or one that never reads keeps its socket, its tasks and its session subscription
//! forever otherwise. Every client library answers pings by itself (browsers, tungstenite,
//! tornado), so a live client never notices.
//!
//! Used by both WebSockets (the agent stream and the Jupyter channels): the reading loop
//! takes frames through [`Liveness::next`], the writer task sends a ping when
//! [`Liveness::ping_due`] resolves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::time::Instant;

use super::clients::ClientLimits;
use super::metrics::{ClientTimeout, Metrics};

/// When a connection last heard from its client; shared by its reader and its writer.
#[derive(Clone)]
pub struct Liveness {
    start: Instant,
    /// Milliseconds from `start` to the last frame heard.
    heard_ms: Arc<AtomicU64>,
    ping_interval: Duration,
    pong_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Liveness {
    pub fn new(limits: &ClientLimits, metrics: Arc<Metrics>) -> Self {
        Self {
            start: Instant::now(),
            heard_ms: Arc::new(AtomicU64::new(0)),
            ping_interval: limits.websocket_ping_interval,
            pong_timeout: limits.websocket_pong_timeout,
            metrics,
        }
    }

    fn last_heard(&self) -> Instant {
        self.start + Duration::from_millis(self.heard_ms.load(Ordering::Relaxed))
    }

    fn heard(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.heard_ms.store(ms, Ordering::Relaxed);
    }

    /// The client's next frame; `None` when the stream ended or the client stopped
    /// answering (logged and counted).
    pub async fn next<S: Stream + Unpin>(&self, source: &mut S) -> Option<S::Item> {
        if self.ping_interval.is_zero() {
            return source.next().await;
        }
        // Only this reader moves `heard`, so the deadline is fixed while it waits.
        let deadline = self.last_heard() + self.ping_interval + self.pong_timeout;
        match tokio::time::timeout_at(deadline, source.next()).await {
            Ok(item) => {
                self.heard();
                item
            }
            Err(_) => {
                tracing::info!(
                    pong_timeout = ?self.pong_timeout,
                    "a WebSocket client did not answer its ping; dropping it"
                );
                self.metrics
                    .connection_timed_out(ClientTimeout::WebSocketPong);
                None
            }
        }
    }

    /// Resolves when the writer should ping: nothing heard for the ping interval, and no
    /// ping sent since `last_ping`. Never resolves when pings are off.
    pub async fn ping_due(&self, last_ping: Option<Instant>) {
        if self.ping_interval.is_zero() {
            return std::future::pending().await;
        }
        loop {
            let quiet_since = match last_ping {
                Some(p) => self.last_heard().max(p),
                None => self.last_heard(),
            };
            let due = quiet_since + self.ping_interval;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn liveness(ping: u64, pong: u64) -> Liveness {
        let limits = ClientLimits {
            websocket_ping_interval: Duration::from_secs(ping),
            websocket_pong_timeout: Duration::from_secs(pong),
            ..ClientLimits::default()
        };
        Liveness::new(&limits, Arc::new(Metrics::new("local")))
    }

    /// A silent client is pinged after the interval and dropped after the pong timeout.
    #[tokio::test(start_paused = true)]
    async fn a_silent_client_is_pinged_then_dropped() {
        let l = liveness(30, 10);
        let started = Instant::now();
        l.ping_due(None).await;
        assert_eq!(started.elapsed(), Duration::from_secs(30));
        let mut silent = futures::stream::pending::<()>();
        assert!(l.next(&mut silent).await.is_none());
        assert_eq!(started.elapsed(), Duration::from_secs(40));
    }

    /// Every frame heard pushes the ping and the drop back; after a ping, the next one
    /// waits a full interval.
    #[tokio::test(start_paused = true)]
    async fn frames_heard_keep_a_client_alive() {
        let l = liveness(30, 10);
        let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
        let mut rx = rx;
        tokio::time::sleep(Duration::from_secs(25)).await;
        tx.unbounded_send(1).ok();
        assert_eq!(l.next(&mut rx).await, Some(1));
        let heard_at = Instant::now();
        l.ping_due(None).await;
        assert_eq!(heard_at.elapsed(), Duration::from_secs(30));
        let pinged = Instant::now();
        // The pong arrives 5 s after the ping (35 s after the last frame): the client stays.
        tokio::time::sleep(Duration::from_secs(5)).await;
        tx.unbounded_send(2).ok();
        assert_eq!(l.next(&mut rx).await, Some(2));
        let ponged = Instant::now();
        // The next ping is a full interval after what came last (the pong, not the ping).
        l.ping_due(Some(pinged)).await;
        assert_eq!(ponged.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_interval_turns_pings_off() {
        let l = liveness(0, 10);
        let r = tokio::time::timeout(Duration::from_secs(3600), l.ping_due(None)).await;
        assert!(r.is_err());
        let mut silent = futures::stream::pending::<()>();
        let r = tokio::time::timeout(Duration::from_secs(3600), l.next(&mut silent)).await;
        assert!(r.is_err());
    }
}
