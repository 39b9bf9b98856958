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

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
}

/// What [`Reader::next`] found.
#[derive(Debug)]
pub enum Incoming {
    /// A message's frames, and the budget permits its bytes hold (with a budget set):
    /// dropping them gives the bytes back.
    Message(Vec<Bytes>, Option<OwnedSemaphorePermit>),
    /// A `PING`: answer with [`pong`] (its context is kept for the answer).
    Ping(Bytes),
}

impl<R: AsyncRead + Unpin> Reader<R> {
    fn new(io: R, limits: Limits) -> Self {
        Self {
            io: BufReader::with_capacity(READ_CHUNK, io),
            limits,
            budget: None,
        }
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

    /// The next message or command. Commands other than PING are consumed here (an
    /// `ERROR` ends the connection).
    pub async fn next(&mut self) -> Result<Incoming, ZmtpError> {
        let mut frames: Vec<Bytes> = Vec::new();
        let mut total: u64 = 0;
        let mut held: Option<OwnedSemaphorePermit> = None;
        loop {
            let (flags, size) = match self.header().await {
                Err(ZmtpError::Closed) if !frames.is_empty() => {
                    return Err(protocol("the connection ended inside a message"))
                }
                r => r?,
            };
            if flags & FLAG_COMMAND != 0 {
                if !frames.is_empty() || flags & FLAG_MORE != 0 {
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
            total = total.saturating_add(size);
            if total > self.limits.max_message {
                return Err(protocol(format!(
                    "a message of at least {total} bytes, over the limit of {} bytes",
                    self.limits.max_message
                )));
            }
            if let Some(budget) = &self.budget {
                // size <= max_message, which the caller keeps within u32 and the budget.
                let n = u32::try_from(size).map_err(|_| protocol("frame size overflows"))?;
                let permit = budget
                    .clone()
                    .acquire_many_owned(n)
                    .await
                    .map_err(|_| ZmtpError::Closed)?;
                match &mut held {
                    Some(h) => h.merge(permit),
                    None => held = Some(permit),
                }
            }
            frames.push(self.body(size).await?);
            if flags & FLAG_MORE == 0 {
                return Ok(Incoming::Message(frames, held));
            }
        }
    }
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

/// Connects to the unix socket at `path` without following a symlink or any path the
/// kernel can change after the check: the socket's directory is opened (its last component
/// not followed), the socket is opened `O_PATH` beneath it with `openat2(RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS)`, checked to be a socket, and connected through
/// `/proc/self/fd/N`, which names that very inode. A kernel that renames its socket and
/// plants a symlink to a host socket in its place gets `ELOOP`, not a connection.
pub async fn connect_ipc(path: &Path) -> io::Result<UnixStream> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a socket path",
        ));
    };
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    let sock = openat2_path(&dir, name.as_bytes())?;
    let file = std::fs::File::from(sock);
    let meta = file.metadata()?;
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a socket", path.display()),
        ));
    }
    let proc_path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let stream = UnixStream::connect(&proc_path).await;
    drop(file);
    stream
}

/// `openat2(dir, name, O_PATH | O_NOFOLLOW, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`.
fn openat2_path(dir: &std::fs::File, name: &[u8]) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let name = std::ffi::OsStr::from_bytes(name);
    Ok(rustix::fs::openat2(
        dir,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::DuplexStream;

    const T: Duration = Duration::from_secs(5);

    /// A scripted peer: answers the greeting and READY, then runs `script` on the stream.
    async fn peer(mut io: DuplexStream) -> DuplexStream {
        let mut g = [0u8; 64];
        io.read_exact(&mut g).await.unwrap();
        check_greeting(&g).unwrap();
        let mut ours = greeting();
        ours[32] = 1; // as-server
        io.write_all(&ours).await.unwrap();
        // Their READY.
        let mut h = [0u8; 2];
        io.read_exact(&mut h).await.unwrap();
        assert_eq!(h[0], FLAG_COMMAND);
        let mut body = vec![0u8; h[1] as usize];
        io.read_exact(&mut body).await.unwrap();
        assert_eq!(&body[..6], b"\x05READY");
        let ready = ready_body(SocketType::Dealer, None);
        io.write_all(&[FLAG_COMMAND, ready.len() as u8])
            .await
            .unwrap();
        io.write_all(&ready).await.unwrap();
        io
    }

    async fn pair(
        limits: Limits,
    ) -> (
        Reader<tokio::io::ReadHalf<DuplexStream>>,
        Writer<tokio::io::WriteHalf<DuplexStream>>,
        DuplexStream,
    ) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(peer(b));
        let (r, w) = handshake(a, SocketType::Dealer, Some(b"me"), limits, T)
            .await
            .unwrap();
        (r, w, server.await.unwrap())
    }

    #[tokio::test]
    async fn messages_round_trip_short_and_long_frames() {
        let (mut r, mut w, mut peer) = pair(Limits::default()).await;
        let frames = vec![
            Bytes::from_static(b"<IDS|MSG>"),
            Bytes::new(),
            Bytes::from(vec![7u8; 300]),
            Bytes::from(vec![9u8; 200_000]),
        ];
        w.send(&frames).await.unwrap();
        // Echo back what the peer received, byte for byte.
        let mut expect = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let (h, n) = frame_header(f.len(), i + 1 < frames.len(), false);
            expect.extend_from_slice(&h[..n]);
            expect.extend_from_slice(f);
        }
        let mut got = vec![0u8; expect.len()];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(got, expect);
        peer.write_all(&got).await.unwrap();
        match r.next().await.unwrap() {
            Incoming::Message(m, _) => assert_eq!(m, frames),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_huge_claimed_frame_is_refused_before_allocation() {
        let (mut r, _w, mut peer) = pair(Limits::default()).await;
        // A long frame claiming 2^62 bytes, and nothing after it.
        let mut h = vec![FLAG_LONG];
        h.extend_from_slice(&(1u64 << 62).to_be_bytes());
        peer.write_all(&h).await.unwrap();
        let e = r.next().await.unwrap_err();
        assert!(
            matches!(e, ZmtpError::Protocol(ref m) if m.contains("over the limit")),
            "{e}"
        );
    }

    #[tokio::test]
    async fn the_message_total_and_frame_count_are_bounded() {
        let limits = Limits {
            max_message: 1000,
            max_frames: 4,
        };
        let (mut r, _w, mut peer) = pair(limits).await;
        // Three frames of 400 bytes: the third crosses 1000.
        for _ in 0..3 {
            let (h, n) = frame_header(400, true, false);
            peer.write_all(&h[..n]).await.unwrap();
            peer.write_all(&[0u8; 400]).await.unwrap();
        }
        assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

        let (mut r, _w, mut peer) = pair(limits).await;
        for _ in 0..5 {
            peer.write_all(&[FLAG_MORE, 0]).await.unwrap();
        }
        let e = r.next().await.unwrap_err();
        assert!(e.to_string().contains("frames"), "{e}");
    }

    #[tokio::test]
    async fn claimed_but_unsent_bytes_cost_no_memory() {
        // 32 MiB claimed, 10 bytes sent, then the peer goes quiet: the reader waits with
        // a buffer of at most one chunk (checked through capacity growth indirectly: the
        // read does not complete and nothing panics or aborts).
        let (mut r, _w, mut peer) = pair(Limits::default()).await;
        let mut h = vec![FLAG_LONG];
        h.extend_from_slice(&(32u64 << 20).to_be_bytes());
        peer.write_all(&h).await.unwrap();
        peer.write_all(&[1u8; 10]).await.unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(100), r.next())
            .await
            .is_err());
        drop(peer);
    }

    #[tokio::test]
    async fn reserved_flags_bad_commands_and_truncation_are_errors() {
        let (mut r, _w, mut peer) = pair(Limits::default()).await;
        peer.write_all(&[0x80, 1, 0]).await.unwrap();
        assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

        let (mut r, _w, mut peer) = pair(Limits::default()).await;
        let mut h = vec![FLAG_COMMAND | FLAG_LONG];
        h.extend_from_slice(&(1u64 << 40).to_be_bytes());
        peer.write_all(&h).await.unwrap();
        assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

        let (mut r, _w, mut peer) = pair(Limits::default()).await;
        peer.write_all(&[FLAG_MORE, 3, 1, 2, 3, 0, 10, 1])
            .await
            .unwrap();
        drop(peer);
        assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

        let (mut r, _w, peer) = pair(Limits::default()).await;
        drop(peer);
        assert!(matches!(r.next().await, Err(ZmtpError::Closed)));
    }

    #[tokio::test]
    async fn pings_are_reported_and_other_commands_skipped() {
        let (mut r, mut w, mut peer) = pair(Limits::default()).await;
        let mut pong_cmd = vec![4u8];
        pong_cmd.extend_from_slice(b"PONG");
        peer.write_all(&[FLAG_COMMAND, pong_cmd.len() as u8])
            .await
            .unwrap();
        peer.write_all(&pong_cmd).await.unwrap();
        let mut ping = vec![4u8];
        ping.extend_from_slice(b"PING\x00\x10ctx");
        peer.write_all(&[FLAG_COMMAND, ping.len() as u8])
            .await
            .unwrap();
        peer.write_all(&ping).await.unwrap();
        match r.next().await.unwrap() {
            Incoming::Ping(ctx) => {
                assert_eq!(&ctx[..], b"ctx");
                pong(&mut w, &ctx).await.unwrap();
            }
            other => panic!("{other:?}"),
        }
        let mut got = [0u8; 10];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"\x04\x08\x04PONGctx");
    }

    #[tokio::test]
    async fn a_peer_that_is_not_zmtp_or_wants_security_is_refused() {
        let (a, mut b) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let mut g = [0u8; 64];
            let _ = b.read_exact(&mut g).await;
            let _ = b.write_all(&[b'H'; 64]).await;
        });
        assert!(handshake(a, SocketType::Sub, None, Limits::default(), T)
            .await
            .is_err());

        let (a, mut b) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let mut g = [0u8; 64];
            let _ = b.read_exact(&mut g).await;
            let mut theirs = greeting();
            theirs[12..17].copy_from_slice(b"CURVE");
            let _ = b.write_all(&theirs).await;
        });
        assert!(handshake(a, SocketType::Sub, None, Limits::default(), T)
            .await
            .is_err());

        // A peer that never answers: the handshake times out.
        let (a, _b) = tokio::io::duplex(4096);
        let Err(e) = handshake(
            a,
            SocketType::Req,
            None,
            Limits::default(),
            Duration::from_millis(50),
        )
        .await
        else {
            panic!("a silent peer completed the handshake");
        };
        assert!(e.to_string().contains("handshake"), "{e}");
    }

    #[tokio::test]
    async fn connect_ipc_refuses_a_planted_symlink_and_non_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        let listener = tokio::net::UnixListener::bind(&real).unwrap();
        // The genuine socket connects.
        let accept = tokio::spawn(async move { listener.accept().await.map(|_| ()) });
        connect_ipc(&real).await.unwrap();
        accept.await.unwrap().unwrap();
        // A symlink to it does not (O_PATH | O_NOFOLLOW opens the link itself, which is
        // not a socket).
        let link = dir.path().join("k-1");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = connect_ipc(&link).await.unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        // Nor does a path through a symlinked directory.
        let linked_dir = dir.path().join("linked");
        std::os::unix::fs::symlink(dir.path(), &linked_dir).unwrap();
        assert!(connect_ipc(&linked_dir.join("real")).await.is_err());
        // Nor does a regular file.
        let file = dir.path().join("k-2");
        std::fs::write(&file, b"x").unwrap();
        assert!(connect_ipc(&file).await.is_err());
    }
}
