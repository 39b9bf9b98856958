//! The heartbeat: a ping to the kernel's echo socket every interval; a kernel that misses
//! `max_misses` in a row is reported lost.
//!
//! Two rules keep a live kernel from being declared dead for the broker's own trouble
//! (issue 18):
//! - A late echo keeps its connection. Each ping carries a fresh payload and only its own
//!   echo counts, so a stale one is skipped; the connection is made again only when it
//!   broke. (Rebuilding after every miss needs a new descriptor each time, exactly what an
//!   overloaded broker may not have.)
//! - A reconnect that fails because the broker ran out of descriptors or memory is not a
//!   miss: nothing was learnt of the kernel. It is logged as the broker's shortage and tried
//!   again at the next interval.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio::time::{timeout, Instant};

use super::link::{open_connection, AbortOnDrop, OpenFailed, ZmtpWriter};
use super::zmtp::{self, Incoming, SocketType};
use super::{Heartbeat, KernelEvent, MessageLimits};

/// The heartbeat echoes a few bytes; nothing bigger is accepted on it.
const LIMITS: MessageLimits = MessageLimits {
    max_message: 64 * 1024,
    max_frames: 4,
};

/// How often the broker's own shortage is logged for one kernel's heartbeat.
const SHORTAGE_LOG_EVERY: Duration = Duration::from_secs(30);

/// What the connection's reader hands to the loop.
enum Heard {
    Echo(Bytes),
    Ping(Bytes),
}

/// An open heartbeat connection: the writer, and the echoes its reader task found.
struct Connection {
    writer: ZmtpWriter,
    heard: mpsc::Receiver<Heard>,
    _reader: AbortOnDrop,
}

/// The outcome of one beat.
enum Beat {
    Answered,
    /// No echo in time (the connection is kept) or the connection broke (it is dropped).
    Missed,
    /// The broker could not open a socket: says nothing of the kernel.
    BrokerShort(String),
}

/// Ping `endpoint` every `hb.interval` until `events` closes; report
/// [`KernelEvent::HeartbeatLost`] after `hb.max_misses` misses in a row.
pub(super) async fn run(
    endpoint: String,
    hb: Heartbeat,
    events: mpsc::Sender<(KernelEvent, Option<OwnedSemaphorePermit>)>,
) {
    let mut misses = 0u32;
    let mut conn: Option<Connection> = None;
    let mut n: u64 = 0;
    let mut last_shortage_log: Option<Instant> = None;
    loop {
        tokio::time::sleep(hb.interval).await;
        if events.is_closed() {
            return;
        }
        n += 1;
        let payload = Bytes::from(format!("ping-{n}"));
        match beat(&endpoint, hb.interval, &mut conn, payload).await {
            Beat::Answered => misses = 0,
            Beat::BrokerShort(why) => {
                if last_shortage_log.is_none_or(|t| t.elapsed() >= SHORTAGE_LOG_EVERY) {
                    last_shortage_log = Some(Instant::now());
                    tracing::warn!(%endpoint, reason = %why, "cannot check a kernel's heartbeat: the broker is out of descriptors or memory; the kernel is not blamed");
                }
            }
            Beat::Missed => {
                misses += 1;
                tracing::debug!(misses, "heartbeat missed");
                if misses >= hb.max_misses {
                    if events
                        .send((KernelEvent::HeartbeatLost { misses }, None))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    misses = 0;
                }
            }
        }
    }
}

/// One ping and its echo, within `interval`.
async fn beat(
    endpoint: &str,
    interval: Duration,
    conn: &mut Option<Connection>,
    payload: Bytes,
) -> Beat {
    let deadline = Instant::now() + interval;
    if conn.is_none() {
        match timeout(interval, open(endpoint, deadline)).await {
            Ok(Ok(c)) => *conn = Some(c),
            Ok(Err(failed)) if failed.exhausted => {
                return Beat::BrokerShort(failed.error.to_string())
            }
            Ok(Err(_)) | Err(_) => return Beat::Missed,
        }
    }
    let Some(c) = conn.as_mut() else {
        return Beat::Missed;
    };
    // A send cut short by the timeout may have left half a frame on the socket: that
    // connection cannot be used again.
    let sent = timeout(
        deadline.saturating_duration_since(Instant::now()),
        c.writer.send(&[Bytes::new(), payload.clone()]),
    )
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        *conn = None;
        return Beat::Missed;
    }
    let answer = timeout(deadline.saturating_duration_since(Instant::now()), async {
        loop {
            match c.heard.recv().await {
                Some(Heard::Echo(p)) if p == payload => return true,
                // The echo of an earlier, late ping.
                Some(Heard::Echo(_)) => {}
                Some(Heard::Ping(ctx)) => {
                    if zmtp::pong(&mut c.writer, &ctx).await.is_err() {
                        return false;
                    }
                }
                None => return false,
            }
        }
    })
    .await;
    match answer {
        Ok(true) => Beat::Answered,
        // Late: the connection stays; its echo will be skipped when it comes.
        Err(_) => Beat::Missed,
        Ok(false) => {
            *conn = None;
            Beat::Missed
        }
    }
}

/// Connect, and read the connection in a task of its own (a ZMTP read cannot be cut short
/// by a timeout without losing its place in the stream).
async fn open(endpoint: &str, deadline: Instant) -> Result<Connection, OpenFailed> {
    let (mut reader, writer) =
        open_connection(endpoint, SocketType::Req, None, LIMITS, deadline).await?;
    let (tx, heard) = mpsc::channel(8);
    let task = tokio::spawn(async move {
        loop {
            let h = match reader.next().await {
                Ok(Incoming::Message(frames, _)) => match &frames[..] {
                    [empty, payload] if empty.is_empty() => Heard::Echo(payload.clone()),
                    // Not an echo of ours: skipped, as a late echo is.
                    _ => continue,
                },
                Ok(Incoming::Ping(ctx)) => Heard::Ping(ctx),
                // Closed, or broke the protocol (a heartbeat never cuts, so a cut message
                // cannot come): the loop sees the channel close.
                Ok(Incoming::Cut(..)) | Err(_) => return,
            };
            if tx.send(h).await.is_err() {
                return;
            }
        }
    });
    Ok(Connection {
        writer,
        heard,
        _reader: AbortOnDrop(task),
    })
}
