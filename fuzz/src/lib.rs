//! The fuzz harnesses of kernel-broker: one function per target, each taking the fuzzer's
//! bytes, driving one decoder of untrusted input and checking what must hold of its
//! answer. A panic is a finding. The AFL++ entry points (`src/bin/`) call these, and so do
//! the replay tests (`tests/corpus.rs`), so a crash file reproduces with `cargo test`.
//!
//! Targets, and the input each reads:
//! - [`wire_decode`]: a kernel's multipart message (`wire::decode`). Byte 0
//!   chooses the key (bit 0: a real HMAC key, else signing off) and whether the harness
//!   signs the message itself (bit 1), so the fuzzer reaches past the signature check; the
//!   rest is the frames, separated by `0x00`.
//! - [`zmtp_reader`]: the bytes a kernel sends on a ZeroMQ connection, read by our ZMTP
//!   client (`kernel::zmtp`): handshake, then messages until an error. Byte
//!   0: bit 0 prepends a valid greeting and `READY` (so mutations land on frames), bit 1
//!   sets small limits (so the limit checks are reached).
//! - [`jupyter_framing`]: a client's frame on `/api/kernels/{id}/channels`. Byte 0 % 3
//!   picks legacy JSON text, legacy binary (offsets) or v1 binary; a frame that decodes is
//!   encoded again and must decode to the same message.
//! - [`stream_frame`]: a text frame of the agent stream (`/v1/sessions/{id}/stream`).
//!
//! The decoders are compiled from the broker's own source files, the very files the broker
//! is built from (`#[path]` below), not through the kernel-broker crate: instrumenting the
//! whole broker for AFL++ took most of a smoke run's minutes, these files and their few
//! dependencies take seconds. Each of these files uses nothing of the broker's crate but
//! the others here (`crate::wire`); the broker's architecture tests keep it so
//! (`src/architecture_tests`, "the fuzzed decoders stand alone").

#[path = "../../src/wire/mod.rs"]
pub mod wire;

#[path = "../../src/kernel/zmtp/mod.rs"]
pub mod zmtp;

#[path = "../../src/api/jupyter/framing.rs"]
pub mod framing;

// The broker reads the frame's fields; the harness only parses.
#[allow(dead_code)]
#[path = "../../src/api/stream/frame.rs"]
pub mod stream_frame;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ws::Message as WsMessage;
use bytes::Bytes;
use crate::framing::Framing;
use crate::zmtp::{Incoming, Limits, SocketType};
use crate::wire::{Signer, DELIMITER};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The key of the signed mode: any fixed key does, the fuzzer never learns it.
const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

/// Multipart decode and verification; a message that decodes survives encode + decode.
pub fn wire_decode(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let signer = Signer::new(if mode & 1 != 0 { KEY } else { b"" });
    let mut frames: Vec<Bytes> = rest
        .split(|&b| b == 0)
        .map(Bytes::copy_from_slice)
        .collect();
    if mode & 2 != 0 {
        sign_in_place(&mut frames, &signer);
    }
    let Ok(msg) = wire::decode(frames, &signer) else {
        return;
    };
    let again = wire::decode(wire::encode(&msg, &signer), &signer)
        .expect("a message the broker encoded must decode");
    assert_eq!(again, msg, "encode + decode changed the message");
}

/// Puts the right signature in the frame after the delimiter, when there are five frames.
fn sign_in_place(frames: &mut [Bytes], signer: &Signer) {
    let Some(d) = frames.iter().position(|f| f.as_ref() == DELIMITER) else {
        return;
    };
    if frames.len() < d + 6 {
        return;
    }
    let parts = [
        frames[d + 2].as_ref(),
        frames[d + 3].as_ref(),
        frames[d + 4].as_ref(),
        frames[d + 5].as_ref(),
    ];
    frames[d + 1] = Bytes::from(signer.sign(parts));
}

/// A kernel's side of a ZeroMQ connection: reads give the fuzzer's bytes, then end of
/// stream; writes are accepted and dropped. Never pending, so the reader cannot hang.
struct Peer {
    data: Vec<u8>,
    pos: usize,
}

impl AsyncRead for Peer {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = buf.remaining().min(self.data.len() - self.pos);
        let start = self.pos;
        buf.put_slice(&self.data[start..start + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Peer {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// A kernel's valid greeting (ZMTP 3.0, NULL, as server) and `READY` (ROUTER).
pub fn zmtp_prefix() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = 1;
    let mut ready = vec![5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&6u32.to_be_bytes());
    ready.extend_from_slice(b"ROUTER");
    g.push(0x04);
    g.push(ready.len() as u8);
    g.extend_from_slice(&ready);
    g
}

thread_local! {
    /// One runtime for all runs of a process (AFL's persistent mode calls us in a loop).
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime builds");
}

/// The handshake, then every message and command until the reader refuses or the bytes end;
/// what it returns must respect the limits.
pub fn zmtp_reader(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = if mode & 1 != 0 {
        zmtp_prefix()
    } else {
        Vec::new()
    };
    bytes.extend_from_slice(rest);
    let limits = if mode & 2 != 0 {
        Limits {
            max_message: 300,
            max_frames: 4,
        }
    } else {
        Limits::default()
    };
    let peer = Peer {
        data: bytes,
        pos: 0,
    };
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let Ok((mut reader, _writer)) = zmtp::handshake(
                peer,
                SocketType::Dealer,
                Some(b"fuzz"),
                limits,
                Duration::from_secs(5),
            )
            .await
            else {
                return;
            };
            // Every read consumes at least one byte, so this ends with the input.
            while let Ok(incoming) = reader.next().await {
                match incoming {
                    Incoming::Message(frames, _) => {
                        assert!(!frames.is_empty(), "a message of no frames");
                        assert!(frames.len() <= limits.max_frames, "over the frame limit");
                        let total: usize = frames.iter().map(|f| f.len()).sum();
                        assert!(total as u64 <= limits.max_message, "over the byte limit");
                    }
                    Incoming::Ping(context) => assert!(context.len() <= 16, "a long context"),
                    // Only a reader given a cutter may cut an oversized message; this one
                    // has none, so an oversized message must be an error.
                    Incoming::Cut(..) => panic!("a reader without a cutter cut a message"),
                }
            }
        })
    });
}

/// A client's frame in one of the three framings; what decodes must survive the broker's
/// own encoding (as it sends messages back) in every framing.
pub fn jupyter_framing(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let decoded = match mode % 3 {
        0 => framing::decode_legacy_json(rest, Vec::new()),
        1 => framing::decode_binary(Framing::Legacy, rest),
        _ => framing::decode_binary(Framing::V1, rest),
    };
    let Ok((channel, msg)) = decoded else {
        return;
    };
    for f in [Framing::Legacy, Framing::LegacyTextOnly, Framing::V1] {
        let again = match framing::encode_frame(f, channel, &msg) {
            WsMessage::Text(t) => framing::decode_legacy_json(t.as_bytes(), Vec::new()),
            WsMessage::Binary(b) => framing::decode_binary(f, &b),
            other => panic!("encode_frame gave {other:?}"),
        };
        let (c2, m2) = again.unwrap_or_else(|e| panic!("{f:?} re-encoding does not decode: {e}"));
        assert_eq!(c2, channel, "{f:?} changed the channel");
        assert_eq!(m2.msg_id, msg.msg_id, "{f:?} changed msg_id");
        assert_eq!(m2.msg_type, msg.msg_type, "{f:?} changed msg_type");
        assert_eq!(
            m2.parent_msg_id, msg.parent_msg_id,
            "{f:?} changed the parent"
        );
        if f != Framing::LegacyTextOnly {
            assert_eq!(m2.buffers, msg.buffers, "{f:?} changed the buffers");
        }
    }
}

/// The agent stream's frame parser on any text.
pub fn stream_frame(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = stream_frame::parse_client_frame(text);
    }
}
