//! The two ways Jupyter messages travel over `/api/kernels/{id}/channels`, as bytes; no I/O.
//! The pump (`channels.rs`) sees only `(Channel, Message)` pairs and WebSocket messages.
//!
//! **Legacy** (jupyter_server's default): a text frame holding one JSON object,
//!
//! ```text
//! {"header": {...}, "parent_header": {...}, "metadata": {...}, "content": {...},
//!  "buffers": [], "channel": "shell", "msg_id": "...", "msg_type": "..."}
//! ```
//!
//! and, for a message with binary buffers, a binary frame:
//!
//! ```text
//! u32 BE  n              number of parts (the JSON + one per buffer), 1..=1024
//! u32 BE  offset[0..n]   where each part starts, from the start of the frame
//! ...     part 0         the JSON object above
//! ...     part 1..n      the buffers; each ends where the next starts, the last at the end
//! ```
//!
//! **v1** (`v1.kernel.websocket.jupyter.org`, chosen when the client offers it): every
//! message is a binary frame,
//!
//! ```text
//! u64 LE  count             number of offsets = parts + 1, 6..=1024
//! u64 LE  offset[0..count]  where each part starts; the last offset is the frame's end
//! ...     channel           UTF-8 channel name (shell, control, stdin, iopub)
//! ...     header, parent_header, metadata, content   four JSON parts
//! ...     buffers           the rest, one part each
//! ```
//!
//! Frames come from untrusted clients: counts are checked before anything is allocated for
//! them, every offset is checked against the frame, the JSON parts are validated, and the
//! header must carry `msg_id` and `msg_type`. What the broker sends is re-checked too (a
//! kernel's JSON part that is not JSON goes out as `{}`).

use axum::extract::ws::Message as WsMessage;
use axum::http::{header, HeaderMap};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;

use crate::wire::{Channel, Message};

/// The subprotocol of Jupyter's binary WebSocket framing.
pub const V1_PROTOCOL: &str = "v1.kernel.websocket.jupyter.org";

/// Most parts a client frame may claim (either framing).
const MAX_PARTS: usize = 1024;

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Framing {
    /// JSON text frames; a message with buffers goes as a binary frame with the offsets header.
    Legacy,
    /// JSON text frames only: a message's binary buffers are left out (`"buffers": []`),
    /// for clients that cannot take binary frames (jupyter_server's gateway proxy).
    LegacyTextOnly,
    /// `v1.kernel.websocket.jupyter.org`: every message a binary frame.
    V1,
}

impl Framing {
    /// The framing of a connection from its upgrade request's headers.
    pub fn for_request(headers: &HeaderMap) -> Self {
        if offers_v1(headers) {
            Framing::V1
        } else if is_gateway_proxy(headers) {
            Framing::LegacyTextOnly
        } else {
            Framing::Legacy
        }
    }
}

/// Whether the client offers the v1 subprotocol.
pub fn offers_v1(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == V1_PROTOCOL)
}

/// jupyter_server's gateway proxy (`jupyter server --gateway-url`, GatewayWebSocketConnection)
/// opens its socket with Tornado's client and decodes every frame it receives as UTF-8: one
/// binary frame kills its read loop and the notebook stops getting anything, silently. It
/// is recognised by Tornado's default User-Agent and gets text frames only.
fn is_gateway_proxy(headers: &HeaderMap) -> bool {
    headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ua| ua.starts_with("Tornado/"))
}

/// A JSON part, checked to be valid JSON (a kernel could send anything); `{}` otherwise.
fn json_part(b: &Bytes) -> &str {
    match std::str::from_utf8(b) {
        Ok(s) if serde_json::from_str::<&RawValue>(s).is_ok() => s,
        _ => "{}",
    }
}

/// Encode a kernel message for the client.
pub fn encode_frame(framing: Framing, channel: Channel, m: &Message) -> WsMessage {
    match framing {
        Framing::V1 => WsMessage::Binary(encode_v1(channel, m).into()),
        Framing::Legacy | Framing::LegacyTextOnly => {
            let text = format!(
                "{{\"header\":{},\"parent_header\":{},\"metadata\":{},\"content\":{},\"buffers\":[],\"channel\":{},\"msg_id\":{},\"msg_type\":{}}}",
                json_part(&m.header),
                json_part(&m.parent_header),
                json_part(&m.metadata),
                json_part(&m.content),
                json!(channel.as_str()),
                json!(m.msg_id),
                json!(m.msg_type),
            );
            if m.buffers.is_empty() || framing == Framing::LegacyTextOnly {
                WsMessage::Text(text.into())
            } else {
                WsMessage::Binary(encode_legacy_binary(text.as_bytes(), &m.buffers).into())
            }
        }
    }
}

/// The legacy binary frame: u32 BE count, u32 BE start offsets, then the JSON and buffers.
fn encode_legacy_binary(json: &[u8], buffers: &[Bytes]) -> Vec<u8> {
    let parts: Vec<&[u8]> = std::iter::once(json)
        .chain(buffers.iter().map(|b| b.as_ref()))
        .collect();
    let n = parts.len();
    let mut pos = 4 * (n + 1);
    let total = pos + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(n as u32).to_be_bytes());
    for p in &parts {
        out.extend_from_slice(&(pos as u32).to_be_bytes());
        pos += p.len();
    }
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

/// The v1 binary frame: u64 LE count of offsets, the offsets, then channel, header,
/// parent_header, metadata, content and buffers; the last offset is the end.
fn encode_v1(channel: Channel, m: &Message) -> Vec<u8> {
    let parts: Vec<&[u8]> = [
        channel.as_str().as_bytes(),
        json_part(&m.header).as_bytes(),
        json_part(&m.parent_header).as_bytes(),
        json_part(&m.metadata).as_bytes(),
        json_part(&m.content).as_bytes(),
    ]
    .into_iter()
    .chain(m.buffers.iter().map(|b| b.as_ref()))
    .collect();
    let count = parts.len() + 1;
    let mut pos = 8 * (count + 1);
    let total: usize = pos + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(count as u64).to_le_bytes());
    for p in &parts {
        out.extend_from_slice(&(pos as u64).to_le_bytes());
        pos += p.len();
    }
    out.extend_from_slice(&(pos as u64).to_le_bytes());
    for p in &parts {
        out.extend_from_slice(p);
    }
    out
}

/// Why a client's frame was refused (logged; the frame is dropped).
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("not a Jupyter message: {0}")]
    NotAMessage(#[source] serde_json::Error),
    #[error("unknown channel {0:?}")]
    UnknownChannel(String),
    #[error("bad channel")]
    BadChannel,
    #[error("{0}")]
    BadMessage(#[source] crate::wire::WireError),
    #[error("the header needs msg_id and msg_type")]
    MissingIds,
    #[error("bad offsets")]
    BadOffsets,
    /// The frame ends inside its table of offsets (`binary`: legacy; `v1`).
    #[error("truncated {framing} frame")]
    Truncated { framing: &'static str },
    #[error("bad part count {0}")]
    BadPartCount(usize),
    #[error("bad offset count {0}")]
    BadOffsetCount(usize),
    #[error("bad JSON part: {0}")]
    BadJsonPart(#[source] serde_json::Error),
}

/// A client's message, or why it was refused.
pub type Decoded = Result<(Channel, Message), FrameError>;

/// Decode a client's binary frame in the connection's framing.
pub fn decode_binary(framing: Framing, b: &[u8]) -> Decoded {
    match framing {
        Framing::V1 => decode_v1(b),
        Framing::Legacy | Framing::LegacyTextOnly => decode_legacy_binary(b),
    }
}

fn raw_json(v: Option<&RawValue>) -> Bytes {
    match v {
        Some(r) if r.get() != "null" => Bytes::copy_from_slice(r.get().as_bytes()),
        _ => Bytes::from_static(b"{}"),
    }
}

/// A legacy JSON frame from a client (buffers come from the binary envelope, if any).
pub fn decode_legacy_json(text: &[u8], buffers: Vec<Bytes>) -> Decoded {
    #[derive(Deserialize)]
    struct Frame<'a> {
        #[serde(borrow)]
        header: &'a RawValue,
        #[serde(borrow, default)]
        parent_header: Option<&'a RawValue>,
        #[serde(borrow, default)]
        metadata: Option<&'a RawValue>,
        #[serde(borrow, default)]
        content: Option<&'a RawValue>,
        #[serde(default)]
        channel: Option<String>,
    }
    let f: Frame = serde_json::from_slice(text).map_err(FrameError::NotAMessage)?;
    let channel = f.channel.as_deref().unwrap_or("shell");
    let channel =
        Channel::parse(channel).ok_or_else(|| FrameError::UnknownChannel(channel.to_string()))?;
    let msg = Message::from_parts(
        Vec::new(),
        Bytes::copy_from_slice(f.header.get().as_bytes()),
        raw_json(f.parent_header),
        raw_json(f.metadata),
        raw_json(f.content),
        buffers,
    )
    .map_err(FrameError::BadMessage)?;
    if msg.msg_id.is_empty() || msg.msg_type.is_empty() {
        return Err(FrameError::MissingIds);
    }
    Ok((channel, msg))
}

/// The byte range `offsets[i]..offsets[i + 1]` of `b`, checked.
fn part<'b>(b: &'b [u8], offsets: &[usize], i: usize) -> Result<&'b [u8], FrameError> {
    let (s, e) = (offsets[i], offsets[i + 1]);
    if s > e || e > b.len() {
        return Err(FrameError::BadOffsets);
    }
    Ok(&b[s..e])
}

fn decode_legacy_binary(b: &[u8]) -> Decoded {
    let be32 = |i: usize| -> Result<usize, FrameError> {
        b.get(i..i + 4)
            .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
            .ok_or(FrameError::Truncated { framing: "binary" })
    };
    let n = be32(0)?;
    if n == 0 || n > MAX_PARTS {
        return Err(FrameError::BadPartCount(n));
    }
    let mut offsets = (0..n)
        .map(|i| be32(4 * (i + 1)))
        .collect::<Result<Vec<_>, _>>()?;
    offsets.push(b.len());
    let json = part(b, &offsets, 0)?;
    let buffers = (1..n)
        .map(|i| part(b, &offsets, i).map(Bytes::copy_from_slice))
        .collect::<Result<Vec<_>, _>>()?;
    decode_legacy_json(json, buffers)
}

fn decode_v1(b: &[u8]) -> Decoded {
    let le64 = |i: usize| -> Result<usize, FrameError> {
        b.get(i..i + 8)
            .map(|s| u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]) as usize)
            .ok_or(FrameError::Truncated { framing: "v1" })
    };
    let count = le64(0)?;
    if !(6..=MAX_PARTS).contains(&count) {
        return Err(FrameError::BadOffsetCount(count));
    }
    let offsets = (0..count)
        .map(|i| le64(8 * (i + 1)))
        .collect::<Result<Vec<_>, _>>()?;
    let channel = std::str::from_utf8(part(b, &offsets, 0)?).map_err(|_| FrameError::BadChannel)?;
    let channel =
        Channel::parse(channel).ok_or_else(|| FrameError::UnknownChannel(channel.to_string()))?;
    let valid = |p: &[u8]| -> Result<Bytes, FrameError> {
        serde_json::from_slice::<&RawValue>(p).map_err(FrameError::BadJsonPart)?;
        Ok(Bytes::copy_from_slice(p))
    };
    let header = valid(part(b, &offsets, 1)?)?;
    let parent = valid(part(b, &offsets, 2)?)?;
    let metadata = valid(part(b, &offsets, 3)?)?;
    let content = valid(part(b, &offsets, 4)?)?;
    let buffers = (5..count - 1)
        .map(|i| part(b, &offsets, i).map(Bytes::copy_from_slice))
        .collect::<Result<Vec<_>, _>>()?;
    let msg = Message::from_parts(Vec::new(), header, parent, metadata, content, buffers)
        .map_err(FrameError::BadMessage)?;
    if msg.msg_id.is_empty() || msg.msg_type.is_empty() {
        return Err(FrameError::MissingIds);
    }
    Ok((channel, msg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn sample() -> Message {
        let mut m = Message::new("comm_msg", &json!({"data": {"x": 1}}), None, "s", "u");
        m.buffers = vec![Bytes::from_static(b"\x00\x01"), Bytes::from_static(b"abc")];
        m
    }

    fn binary(frame: WsMessage) -> Bytes {
        match frame {
            WsMessage::Binary(b) => b,
            other => panic!("expected a binary frame, got {other:?}"),
        }
    }

    fn text(frame: WsMessage) -> String {
        match frame {
            WsMessage::Text(t) => t.as_str().to_string(),
            other => panic!("expected a text frame, got {other:?}"),
        }
    }

    fn assert_same(back: &Message, m: &Message) {
        assert_eq!(back.msg_id, m.msg_id);
        assert_eq!(back.msg_type, m.msg_type);
        assert_eq!(back.header, m.header);
        assert_eq!(back.parent_header, m.parent_header);
        assert_eq!(back.content, m.content);
        assert_eq!(back.buffers, m.buffers);
    }

    #[test]
    fn v1_round_trip() {
        for channel in [
            Channel::Shell,
            Channel::Control,
            Channel::Stdin,
            Channel::Iopub,
        ] {
            for buffers in [vec![], sample().buffers] {
                let m = Message {
                    buffers,
                    ..sample()
                };
                let frame = binary(encode_frame(Framing::V1, channel, &m));
                let (ch, back) = decode_binary(Framing::V1, &frame).unwrap();
                assert_eq!(ch, channel);
                assert_same(&back, &m);
                // The count is parts + 1 and the last offset is the length.
                let count = u64::from_le_bytes(frame[..8].try_into().unwrap()) as usize;
                assert_eq!(count, 5 + m.buffers.len() + 1);
                let last = u64::from_le_bytes(frame[8 * count..8 * count + 8].try_into().unwrap());
                assert_eq!(last as usize, frame.len());
            }
        }
    }

    #[test]
    fn legacy_binary_round_trip() {
        let m = sample();
        let frame = binary(encode_frame(Framing::Legacy, Channel::Iopub, &m));
        let (ch, back) = decode_binary(Framing::Legacy, &frame).unwrap();
        assert_eq!(ch, Channel::Iopub);
        assert_same(&back, &m);
        // One offset per part: the JSON and each buffer; the first starts after them.
        assert_eq!(&frame[..4], &3u32.to_be_bytes());
        assert_eq!(&frame[4..8], &16u32.to_be_bytes());
    }

    #[test]
    fn legacy_text_round_trip() {
        let m = Message::new("execute_request", &json!({"code": "1"}), None, "s", "u");
        let t = text(encode_frame(Framing::Legacy, Channel::Shell, &m));
        let (ch, back) = decode_legacy_json(t.as_bytes(), Vec::new()).unwrap();
        assert_eq!(ch, Channel::Shell);
        assert_same(&back, &m);
    }

    #[test]
    fn text_only_clients_get_text_without_buffers() {
        let m = sample();
        let t = text(encode_frame(Framing::LegacyTextOnly, Channel::Iopub, &m));
        let v: Value = serde_json::from_str(&t).unwrap();
        assert_eq!(v["buffers"], json!([]));
        assert_eq!(v["content"]["data"]["x"], 1);
        let mut h = HeaderMap::new();
        h.insert(header::USER_AGENT, "Tornado/6.5.2".parse().unwrap());
        assert!(is_gateway_proxy(&h));
        assert_eq!(Framing::for_request(&h), Framing::LegacyTextOnly);
        h.insert(header::USER_AGENT, "Mozilla/5.0".parse().unwrap());
        assert!(!is_gateway_proxy(&h));
        assert!(!is_gateway_proxy(&HeaderMap::new()));
        assert_eq!(Framing::for_request(&h), Framing::Legacy);
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            format!("other, {V1_PROTOCOL}").parse().unwrap(),
        );
        assert_eq!(Framing::for_request(&h), Framing::V1);
    }

    #[test]
    fn legacy_text_has_top_level_ids() {
        let m = Message::new(
            "status",
            &json!({"execution_state": "idle"}),
            None,
            "s",
            "u",
        );
        let t = text(encode_frame(Framing::Legacy, Channel::Iopub, &m));
        let v: Value = serde_json::from_str(&t).unwrap();
        assert_eq!(v["msg_id"], m.msg_id.as_str());
        assert_eq!(v["msg_type"], "status");
        assert_eq!(v["channel"], "iopub");
        assert_eq!(v["buffers"], json!([]));
        assert_eq!(v["content"]["execution_state"], "idle");
    }

    #[test]
    fn a_kernels_invalid_json_part_goes_out_as_an_empty_object() {
        let mut m = sample();
        m.metadata = Bytes::from_static(b"{not json");
        let t = text(encode_frame(Framing::LegacyTextOnly, Channel::Iopub, &m));
        let v: Value = serde_json::from_str(&t).unwrap();
        assert_eq!(v["metadata"], json!({}));
    }

    #[test]
    fn malformed_legacy_json_is_refused() {
        for bad in [
            &b"{"[..],
            b"{\"channel\": \"shell\"}",
            b"{\"header\": {}, \"channel\": \"shell\"}",
            b"{\"header\": {\"msg_id\": \"1\", \"msg_type\": \"x\"}, \"channel\": \"mars\"}",
            b"\xff\xfe",
        ] {
            assert!(
                decode_legacy_json(bad, Vec::new()).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// A legacy binary frame from its parts' start offsets (possibly lying) and bytes.
    fn legacy(n: u32, offsets: &[u32], body: &[u8]) -> Vec<u8> {
        let mut out = n.to_be_bytes().to_vec();
        for o in offsets {
            out.extend_from_slice(&o.to_be_bytes());
        }
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn malformed_legacy_binary_is_refused() {
        let good = binary(encode_frame(Framing::Legacy, Channel::Shell, &sample()));
        assert!(decode_legacy_binary(&good).is_ok());
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", vec![]),
            ("truncated count", vec![0, 0]),
            ("zero parts", legacy(0, &[], b"{}")),
            ("huge part count", legacy(u32::MAX, &[], b"")),
            ("one past the limit", legacy(1025, &[], b"")),
            ("truncated offsets", vec![0, 0, 0, 9, 0]),
            ("offset past the end", legacy(2, &[12, 200], b"{}")),
            ("offsets backwards", legacy(2, &[13, 12], b"{}x")),
            ("first offset past the end", legacy(1, &[99], b"{}")),
            ("not JSON", legacy(1, &[8], b"\xff\xfe")),
            ("truncated frame", good[..good.len() / 2].to_vec()),
        ];
        for (why, frame) in cases {
            assert!(decode_legacy_binary(&frame).is_err(), "{why}");
        }
    }

    /// A v1 frame from its offsets (possibly lying) and bytes.
    fn v1(count: u64, offsets: &[u64], body: &[u8]) -> Vec<u8> {
        let mut out = count.to_le_bytes().to_vec();
        for o in offsets {
            out.extend_from_slice(&o.to_le_bytes());
        }
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn malformed_v1_is_refused() {
        let m = sample();
        let good = binary(encode_frame(Framing::V1, Channel::Shell, &m));
        assert!(decode_v1(&good).is_ok());
        // A frame whose channel part is replaced by `channel` (the rest kept).
        let with_channel = |channel: &[u8]| {
            let header = m.header.as_ref();
            let parts: Vec<&[u8]> = vec![channel, header, b"{}", b"{}", b"{}"];
            let count = parts.len() as u64 + 1;
            let mut pos = 8 * (count + 1);
            let mut offsets = Vec::new();
            for p in &parts {
                offsets.push(pos);
                pos += p.len() as u64;
            }
            offsets.push(pos);
            v1(count, &offsets, &parts.concat())
        };
        assert!(decode_v1(&with_channel(b"shell")).is_ok());
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", vec![]),
            ("truncated count", vec![0; 4]),
            ("all ones", vec![255; 64]),
            ("too few offsets", v1(5, &[48, 48, 48, 48, 48], b"")),
            ("huge offset count", v1(u64::MAX, &[], b"")),
            ("one past the limit", v1(1025, &[], b"")),
            ("truncated offsets", v1(6, &[56, 56], b"")),
            (
                "offset past the end",
                v1(6, &[56, 61, 9999, 9999, 9999, 9999], b"shell"),
            ),
            (
                "offsets backwards",
                v1(6, &[61, 56, 61, 61, 61, 61], b"shell"),
            ),
            ("non-UTF-8 channel", with_channel(b"\xff\xfe")),
            ("unknown channel", with_channel(b"mars")),
            ("header not JSON", {
                let mut f = with_channel(b"shell");
                let at = f.len() - 6 - m.header.len() + 1;
                f[at] = b'!';
                f
            }),
            ("truncated frame", good[..good.len() - 3].to_vec()),
        ];
        for (why, frame) in cases {
            assert!(decode_v1(&frame).is_err(), "{why}");
        }
    }
}
