//! The Jupyter wire protocol (messaging 5.3) as data: messages, the ZeroMQ multipart
//! codec with `<IDS|MSG>` and routing identities, and HMAC-SHA256 signing.
//!
//! Architecture invariant: no I/O here. Messages keep their four JSON parts as the raw
//! bytes that came off the wire, so the broker can forward them without re-serialising;
//! only the few header fields needed for routing are parsed.

mod codec;
mod message;
mod sign;

pub use codec::{decode, decode_stream_verified, encode, DELIMITER};
pub use message::{now_iso, Channel, Message};
pub use sign::{SignatureStream, Signer};

/// The protocol version the broker speaks and stamps on its own messages.
pub const PROTOCOL_VERSION: &str = "5.3";

/// Errors decoding a multipart message; the message is dropped, never acted on.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("no <IDS|MSG> delimiter among {frames} frames")]
    NoDelimiter { frames: usize },
    #[error("message has {found} frames after the delimiter, at least 5 are needed")]
    TooFewFrames { found: usize },
    #[error("bad signature on a {msg_type} message")]
    BadSignature { msg_type: String },
    #[error("malformed {part}: {reason}")]
    Malformed { part: &'static str, reason: String },
}
