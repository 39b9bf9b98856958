//! ZMTP 3.0 with the NULL mechanism: the ZeroMQ wire protocol, client side, over one unix
//! stream socket, with every length the peer claims bounded before anything is allocated.
//!
//! Why hand-written: the peer is a kernel running untrusted code, which can write any bytes
//! on its end of our connections. The `zeromq` crate reserves whatever frame length a peer
//! claims (a header claiming 2^62 bytes aborted the broker) and has no maximum message size;
//! libzmq has `ZMQ_MAXMSGSIZE` but binds to blocking sockets and cannot connect through a
//! file descriptor (see [`connect_ipc`]). The broker needs only the client half of three
//! socket types talking to exactly one peer each (DEALER, SUB, REQ), which is a small part
//! of ZMTP: the 64-byte greeting, the `READY` command, and frames.
//!
//! Layout of the wire (RFC 23/ZMTP):
//! - greeting: `FF 00*7 01 7F`, version `03 00`, mechanism `NULL` padded to 20 bytes,
//!   as-server `00`, 31 bytes of filler;
//! - then frames: a flags byte (`MORE` 0x01, `LONG` 0x02, `COMMAND` 0x04), a size (one
//!   byte, or eight bytes big-endian when `LONG`), the body;
//! - the first frame each way is the `READY` command: `05 "READY"` then properties
//!   (`name-len:u8 name value-len:u32be value`), at least `Socket-Type`;
//! - a message is one or more frames, all but the last with `MORE`.
//!
//! Bounds ([`Limits`]): a frame's claimed size, a message's total size and frame count are
//! checked against the limits before the body is read, and the body buffer grows only as
//! bytes actually arrive, so a peer that claims much and sends little costs nothing. A
//! violation is a [`ZmtpError::Protocol`]: the caller drops the connection.
//!
//! Cutting ([`Reader::cut_oversized`]): on a connection whose big messages are the peer's
//! normal business (a kernel's output on iopub), a message over the limit may instead be
//! cut. The caller's [`Cutter`] decides from the frames before the one that crosses the
//! limit whether this message may be cut (the zmtp layer knows frames, not what is in
//! them); if so the rest of the message is read through a fixed buffer, a bounded prefix of
//! it kept and the remainder discarded as it arrives, and the [`Cutter`] sees every byte
//! (to verify a signature over what is discarded). A cut message still has a hard ceiling
//! ([`CutLimits::max_total`]) and the frame-count limit; a claim past them is a violation
//! like any other, before anything is read or allocated.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

mod connect;
pub use connect::connect_ipc;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// Commands (READY, PING, ERROR) are small; anything bigger is an attack.
const MAX_COMMAND: u64 = 64 * 1024;
/// Bodies are read in chunks of at most this, so memory follows the bytes that arrived.
const READ_CHUNK: usize = 64 * 1024;

/// The most a peer may send; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// One message, all frames together, in bytes.
    pub max_message: u64,
    /// Frames in one message.
    pub max_frames: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message: 64 << 20,
            max_frames: 1024,
        }
    }
}

/// Decides about, and watches, messages over [`Limits::max_message`] on a reader that may
/// cut them (see [`Reader::cut_oversized`]).
pub trait Cutter: Send + Sync {
    /// The frame after `whole` (each frame complete) takes the message over the limit.
    /// `true` lets the reader cut this message, and [`Cutter::feed`] then sees the rest of
    /// it; `false` refuses it, and the connection fails as for any broken limit.
    fn begin(&mut self, whole: &[Bytes]) -> bool;
    /// Bytes of frame `index` (counted from the message's first frame) of the message being
    /// cut, in order, kept or not: once with no bytes when the frame starts, then as they
    /// arrive.
    fn feed(&mut self, index: usize, piece: &[u8]);
    /// The message being cut has ended: whether it is genuine (say, its signature verified
    /// over every byte fed).
    fn finish(&mut self) -> bool;
}

/// How much of a message being cut is kept, and the most it may claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CutLimits {
    /// Bytes kept of the frames from the one that crossed the limit on, all together; never
    /// more than the message limit leaves after the whole frames before them.
    pub keep: u64,
    /// The most a cut message may claim, all frames together. Past it the connection fails
    /// as for any broken limit: reading a near-endless frame only to discard it would let a
    /// peer hold the reader forever.
    pub max_total: u64,
}

/// A message that was cut (see [`Reader::cut_oversized`]).
#[derive(Debug)]
pub struct CutMessage {
    /// The whole frames before the limit was crossed, then the kept prefixes of the others.
    pub frames: Vec<Bytes>,
    /// The message's full size, all frames together.
    pub bytes: u64,
    /// What [`Cutter::finish`] said.
    pub genuine: bool,
}

/// The ZeroMQ socket type we announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    Dealer,
    Sub,
    Req,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            SocketType::Dealer => "DEALER",
            SocketType::Sub => "SUB",
            SocketType::Req => "REQ",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The peer broke the protocol or a limit; the connection must be dropped.
    #[error("the kernel broke the ZeroMQ protocol: {0}")]
    Protocol(String),
    #[error("the kernel closed the connection")]
    Closed,
}

fn protocol(why: impl Into<String>) -> ZmtpError {
    ZmtpError::Protocol(why.into())
}

/// Our greeting: ZMTP 3.0, NULL mechanism, client.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks the peer's greeting: the signature, a version of at least 3.0, NULL security.
fn check_greeting(g: &[u8; 64]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(protocol("not a ZMTP greeting"));
    }
    if g[10] < 3 {
        return Err(protocol(format!(
            "unsupported ZMTP version {}.{}",
            g[10], g[11]
        )));
    }
    let mechanism = &g[12..32];
    if &mechanism[..4] != b"NULL" || mechanism[4..].iter().any(|&b| b != 0) {
        return Err(protocol(
            "the kernel asks for a security mechanism other than NULL",
        ));
    }
    Ok(())
}

/// The `READY` command body with our socket type and, if given, our routing identity.
fn ready_body(socket_type: SocketType, identity: Option<&[u8]>) -> Vec<u8> {
    let mut body = Vec::with_capacity(64);
    body.push(5);
    body.extend_from_slice(b"READY");
    let mut prop = |name: &[u8], value: &[u8]| {
        // Names are our constants and identities are at most 255 bytes (checked by callers).
        body.push(name.len() as u8);
        body.extend_from_slice(name);
        body.extend_from_slice(&(value.len() as u32).to_be_bytes());
        body.extend_from_slice(value);
    };
    prop(b"Socket-Type", socket_type.name().as_bytes());
    if let Some(id) = identity {
        prop(b"Identity", id);
    }
    body
}

/// Splits a command body into its name and data.
fn command_name(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let len = *body.first().ok_or_else(|| protocol("an empty command"))? as usize;
    if body.len() < 1 + len {
        return Err(protocol("a command name longer than its frame"));
    }
    Ok((&body[1..1 + len], &body[1 + len..]))
}

/// Encodes one frame header.
fn frame_header(len: usize, more: bool, command: bool) -> ([u8; 9], usize) {
    let mut h = [0u8; 9];
    let mut flags = 0;
    if more {
        flags |= FLAG_MORE;
    }
    if command {
        flags |= FLAG_COMMAND;
    }
    if len > 255 {
        h[0] = flags | FLAG_LONG;
        h[1..9].copy_from_slice(&(len as u64).to_be_bytes());
        (h, 9)
    } else {
        h[0] = flags;
        h[1] = len as u8;
        (h, 2)
    }
}

/// The writing half of a connection.
pub struct Writer<W> {
    io: W,
    /// Small frames are gathered here and written with one call.
    buf: BytesMut,
}

impl<W: AsyncWrite + Unpin> Writer<W> {
    fn new(io: W) -> Self {
        Self {
            io,
            buf: BytesMut::with_capacity(8 * 1024),
        }
    }

    async fn flush_buf(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.io.write_all(&self.buf).await?;
            self.buf.clear();
        }
        Ok(())
    }

    async fn frame(&mut self, body: &[u8], more: bool, command: bool) -> io::Result<()> {
        let (h, n) = frame_header(body.len(), more, command);
        self.buf.put_slice(&h[..n]);
        if body.len() <= READ_CHUNK {
            self.buf.put_slice(body);
        } else {
            // A big body goes straight from its buffer to the socket.
            self.flush_buf().await?;
            self.io.write_all(body).await?;
        }
        Ok(())
    }

    /// Sends one multipart message.
    pub async fn send(&mut self, frames: &[Bytes]) -> io::Result<()> {
        let last = frames.len().saturating_sub(1);
        for (i, f) in frames.iter().enumerate() {
            self.frame(f, i < last, false).await?;
        }
        self.flush_buf().await?;
        self.io.flush().await
    }

    async fn command(&mut self, body: &[u8]) -> io::Result<()> {
        self.frame(body, false, true).await?;
        self.flush_buf().await?;
        self.io.flush().await
    }
}

/// The reading half of a connection.
pub struct Reader<R> {
    io: BufReader<R>,
    limits: Limits,
    /// Bytes of messages the caller may hold at once (see [`Reader::set_budget`]).
    budget: Option<Arc<Semaphore>>,
    /// Set by [`Reader::cut_oversized`].
    cut: Option<(Box<dyn Cutter>, CutLimits)>,
}

/// What [`Reader::next`] found.
#[derive(Debug)]
pub enum Incoming {
    /// A message's frames, and the budget permits its bytes hold (with a budget set):
    /// dropping them gives the bytes back.
    Message(Vec<Bytes>, Option<OwnedSemaphorePermit>),
    /// A `PING`: answer with [`pong`] (its context is kept for the answer).
    Ping(Bytes),
    /// A message over the limit that was cut (only with [`Reader::cut_oversized`]), and
    /// the budget permits its kept bytes hold.
    Cut(CutMessage, Option<OwnedSemaphorePermit>),
}

impl<R: AsyncRead + Unpin> Reader<R> {
    fn new(io: R, limits: Limits) -> Self {
        Self {
            io: BufReader::with_capacity(READ_CHUNK, io),
            limits,
            budget: None,
            cut: None,
        }
    }

    /// Lets messages over [`Limits::max_message`] be cut instead of failing the connection,
    /// when `cutter` agrees (see the module documentation). Without it, every message over
    /// the limit is a protocol violation.
    pub fn cut_oversized(&mut self, cutter: Box<dyn Cutter>, limits: CutLimits) {
        self.cut = Some((cutter, limits));
    }

    /// Shares a byte budget with other readers: before a frame's body is read, permits for
    /// its size are taken (waiting while the budget is spent), and the message carries them
    /// to the consumer. The budget must hold at least [`Limits::max_message`] permits.
    pub fn set_budget(&mut self, budget: Arc<Semaphore>) {
        self.budget = Some(budget);
    }

    /// Reads one frame header: (flags, claimed size). `Closed` on a clean end of stream
    /// before the header.
    async fn header(&mut self) -> Result<(u8, u64), ZmtpError> {
        let flags = match self.io.read_u8().await {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(ZmtpError::Closed),
            Err(e) => return Err(e.into()),
        };
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(protocol(format!("reserved frame flags set ({flags:#04x})")));
        }
        let size = if flags & FLAG_LONG != 0 {
            self.io.read_u64().await?
        } else {
            u64::from(self.io.read_u8().await?)
        };
        Ok((flags, size))
    }

    /// Reads a body whose size was already checked against the limits. The buffer grows
    /// with the bytes received, not with the size claimed.
    async fn body(&mut self, size: u64) -> Result<Bytes, ZmtpError> {
        let size = usize::try_from(size).map_err(|_| protocol("frame size overflows"))?;
        let mut buf = BytesMut::with_capacity(size.min(READ_CHUNK));
        while buf.len() < size {
            let want = (size - buf.len()).min(READ_CHUNK);
            buf.reserve(want);
            let n = (&mut self.io).take(want as u64).read_buf(&mut buf).await?;
            if n == 0 {
                return Err(protocol("the connection ended inside a frame"));
            }
        }
        Ok(buf.freeze())
    }

    /// Reads a command frame's body (bounded) after its header.
    async fn command_body(&mut self, size: u64) -> Result<Bytes, ZmtpError> {
        if size > MAX_COMMAND {
            return Err(protocol(format!("a command of {size} bytes")));
        }
        self.body(size).await
    }

    /// Takes permits for `n` bytes from the budget, if one is set, into `held`.
    async fn hold(&self, n: u64, held: &mut Option<OwnedSemaphorePermit>) -> Result<(), ZmtpError> {
        if let Some(budget) = &self.budget {
            // n <= max_message, which the caller keeps within u32 and the budget.
            let n = u32::try_from(n).map_err(|_| protocol("frame size overflows"))?;
            let permit = budget
                .clone()
                .acquire_many_owned(n)
                .await
                .map_err(|_| ZmtpError::Closed)?;
            match held {
                Some(h) => h.merge(permit),
                None => *held = Some(permit),
            }
        }
        Ok(())
    }

    /// The next message or command. Commands other than PING are consumed here (an
    /// `ERROR` ends the connection).
    pub async fn next(&mut self) -> Result<Incoming, ZmtpError> {
        let mut frames: Vec<Bytes> = Vec::new();
        let mut total: u64 = 0;
        let mut held: Option<OwnedSemaphorePermit> = None;
        // While a message is being cut: how many more of its bytes may be kept.
        let mut cutting: Option<u64> = None;
        loop {
            let (flags, size) = match self.header().await {
                Err(ZmtpError::Closed) if !frames.is_empty() => {
                    return Err(protocol("the connection ended inside a message"))
                }
                r => r?,
            };
            if flags & FLAG_COMMAND != 0 {
                if !frames.is_empty() || cutting.is_some() || flags & FLAG_MORE != 0 {
                    return Err(protocol("a command inside a multipart message"));
                }
                let body = self.command_body(size).await?;
                let (name, data) = command_name(&body)?;
                match name {
                    b"PING" => {
                        // PING: TTL (2 bytes), then a context of at most 16 bytes.
                        let context = data.get(2..).unwrap_or_default();
                        return Ok(Incoming::Ping(Bytes::copy_from_slice(
                            &context[..context.len().min(16)],
                        )));
                    }
                    b"ERROR" => {
                        return Err(protocol(format!(
                            "the kernel sent ERROR: {}",
                            String::from_utf8_lossy(data.get(1..).unwrap_or_default())
                        )))
                    }
                    // PONG, SUBSCRIBE and others mean nothing to a client: skip them.
                    _ => continue,
                }
            }
            if frames.len() >= self.limits.max_frames {
                return Err(protocol(format!(
                    "a message of more than {} frames",
                    self.limits.max_frames
                )));
            }
            let before = total;
            total = total.saturating_add(size);
            if cutting.is_none() && total > self.limits.max_message {
                let may_cut = match &mut self.cut {
                    Some((cutter, cut)) => total <= cut.max_total && cutter.begin(&frames),
                    None => false,
                };
                if !may_cut {
                    return Err(protocol(format!(
                        "a message of at least {total} bytes, over the limit of {} bytes",
                        self.limits.max_message
                    )));
                }
                let keep = self.cut.as_ref().map_or(0, |(_, c)| c.keep);
                // The whole frames plus what is kept stay within the message limit.
                cutting = Some(keep.min(self.limits.max_message - before));
            }
            let Some(keep_left) = &mut cutting else {
                self.hold(size, &mut held).await?;
                frames.push(self.body(size).await?);
                if flags & FLAG_MORE == 0 {
                    return Ok(Incoming::Message(frames, held));
                }
                continue;
            };
            let max_total = self.cut.as_ref().map_or(0, |(_, c)| c.max_total);
            if total > max_total {
                return Err(protocol(format!(
                    "a message of at least {total} bytes, over the limit of {max_total} bytes for a message that is cut"
                )));
            }
            let keep = size.min(*keep_left);
            *keep_left -= keep;
            self.hold(keep, &mut held).await?;
            let Some((cutter, _)) = &mut self.cut else {
                return Err(protocol("cutting a message without a cutter"));
            };
            let index = frames.len();
            frames.push(body_cut(&mut self.io, cutter.as_mut(), index, size, keep).await?);
            if flags & FLAG_MORE == 0 {
                let genuine = cutter.finish();
                return Ok(Incoming::Cut(
                    CutMessage {
                        frames,
                        bytes: total,
                        genuine,
                    },
                    held,
                ));
            }
        }
    }
}

/// Reads a frame body of `size` bytes through the reader's buffer, keeping the first
/// `keep` and showing every byte to `cutter`: memory follows `keep`, not the size.
async fn body_cut<R: AsyncRead + Unpin>(
    io: &mut BufReader<R>,
    cutter: &mut dyn Cutter,
    index: usize,
    size: u64,
    keep: u64,
) -> Result<Bytes, ZmtpError> {
    // keep <= max_message, which the caller keeps within u32.
    let keep = usize::try_from(keep).map_err(|_| protocol("frame size overflows"))?;
    let mut kept = BytesMut::with_capacity(keep.min(READ_CHUNK));
    let mut left = size;
    cutter.feed(index, &[]);
    while left > 0 {
        let buf = io.fill_buf().await?;
        if buf.is_empty() {
            return Err(protocol("the connection ended inside a frame"));
        }
        let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let piece = &buf[..n];
        cutter.feed(index, piece);
        let room = keep.saturating_sub(kept.len()).min(n);
        kept.extend_from_slice(&piece[..room]);
        io.consume(n);
        left -= n as u64;
    }
    Ok(kept.freeze())
}

/// The `PONG` answer to a `PING` with `context`.
pub async fn pong<W: AsyncWrite + Unpin>(w: &mut Writer<W>, context: &[u8]) -> io::Result<()> {
    let mut body = Vec::with_capacity(5 + context.len());
    body.push(4);
    body.extend_from_slice(b"PONG");
    body.extend_from_slice(context);
    w.command(&body).await
}

/// Runs the ZMTP handshake on `io` as a client of type `socket_type`, and splits the
/// connection. `timeout` bounds the whole handshake (a kernel that never answers cannot
/// hold a caller).
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    io: S,
    socket_type: SocketType,
    identity: Option<&[u8]>,
    limits: Limits,
    timeout: Duration,
) -> Result<
    (
        Reader<tokio::io::ReadHalf<S>>,
        Writer<tokio::io::WriteHalf<S>>,
    ),
    ZmtpError,
> {
    if identity.is_some_and(|id| id.is_empty() || id.len() > 255) {
        return Err(protocol("an identity must be 1 to 255 bytes"));
    }
    let (r, w) = tokio::io::split(io);
    let mut reader = Reader::new(r, limits);
    let mut writer = Writer::new(w);
    let run = async {
        writer.io.write_all(&greeting()).await?;
        writer.io.flush().await?;
        let mut theirs = [0u8; 64];
        reader.io.read_exact(&mut theirs).await?;
        check_greeting(&theirs)?;
        writer.command(&ready_body(socket_type, identity)).await?;
        let (flags, size) = reader.header().await?;
        if flags & FLAG_COMMAND == 0 || flags & FLAG_MORE != 0 {
            return Err(protocol("the kernel did not start with READY"));
        }
        let body = reader.command_body(size).await?;
        match command_name(&body)? {
            (b"READY", _) => Ok(()),
            (b"ERROR", data) => Err(protocol(format!(
                "the kernel refused the connection: {}",
                String::from_utf8_lossy(data.get(1..).unwrap_or_default())
            ))),
            (other, _) => Err(protocol(format!(
                "the kernel started with {:?} instead of READY",
                String::from_utf8_lossy(other)
            ))),
        }
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(protocol(format!("no ZMTP handshake within {timeout:?}"))),
    }
    if socket_type == SocketType::Sub {
        // Subscribe to everything (ZMTP 3.0 form: a message `01` + empty prefix).
        writer.send(&[Bytes::from_static(&[1])]).await?;
    }
    Ok((reader, writer))
}

#[cfg(test)]
mod tests;
