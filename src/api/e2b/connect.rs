//! The Connect protocol's wire for envd's RPCs, JSON codec only (what E2B's SDKs send:
//! `useBinaryFormat: false`): unary calls are plain JSON bodies; server streams are
//! enveloped messages (one flags byte, a big-endian u32 length, the JSON), ending with an
//! end-of-stream envelope (flag `0x02`) that carries `{}` or `{"error": ...}`; errors of
//! unary calls are a JSON body `{"code": "not_found", "message": ...}` with a fitting HTTP
//! status. Pure: no I/O.
//!
//! Hand-written: the Rust Connect libraries (connectrpc-axum and the like) generate from
//! `.proto` files with a protobuf toolchain and bring their own router; the handful of
//! envd calls served here needs only this framing, a few dozen lines.

use axum::body::Bytes;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

/// The flag of the end-of-stream envelope.
const END_STREAM: u8 = 0x02;
/// The flag of a compressed envelope (refused: nothing is compressed here).
const COMPRESSED: u8 = 0x01;
/// Largest request message accepted.
pub const MAX_MESSAGE: usize = 1 << 20;

/// A Connect error: one of the protocol's codes and a sentence.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectError {
    pub code: &'static str,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid_argument", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new("not_found", message)
    }

    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new("unimplemented", message)
    }

    /// The HTTP status of a unary error (Connect's mapping).
    pub fn status(&self) -> StatusCode {
        match self.code {
            "invalid_argument" | "out_of_range" | "failed_precondition" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" | "aborted" => StatusCode::CONFLICT,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code, "message": self.message})
    }
}

impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        (
            self.status(),
            [(header::CONTENT_TYPE, "application/json")],
            self.json().to_string(),
        )
            .into_response()
    }
}

/// One message in an envelope.
pub fn envelope(json: &serde_json::Value) -> Bytes {
    frame(0, json.to_string().as_bytes())
}

/// The end-of-stream envelope: success, or the error that ended the stream.
pub fn end_stream(error: Option<&ConnectError>) -> Bytes {
    let body = match error {
        Some(e) => serde_json::json!({"error": e.json()}),
        None => serde_json::json!({}),
    };
    frame(END_STREAM, body.to_string().as_bytes())
}

fn frame(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    // Payloads here are JSON the broker made, far below 4 GiB.
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// The one request message of a server-streaming call (an enveloped JSON message).
pub fn stream_request<T: DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    let [flags, a, b, c, d, rest @ ..] = body else {
        return Err(ConnectError::invalid(
            "the request is not a Connect envelope (5 header bytes, then the message)",
        ));
    };
    if flags & COMPRESSED != 0 {
        return Err(ConnectError::unimplemented(
            "compressed Connect messages are not supported",
        ));
    }
    let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
    if len > MAX_MESSAGE || len > rest.len() {
        return Err(ConnectError::invalid(format!(
            "the envelope claims {len} bytes; {} arrived (at most {MAX_MESSAGE} are accepted)",
            rest.len()
        )));
    }
    unary_request(&rest[..len])
}

/// The request message of a unary call (a plain JSON body; empty means `{}`).
pub fn unary_request<T: DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(body).map_err(|e| ConnectError::invalid(format!("invalid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Req {
        path: String,
    }

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let msg = envelope(&serde_json::json!({"path": "a"}));
        assert_eq!(msg[0], 0);
        assert_eq!(
            u32::from_be_bytes([msg[1], msg[2], msg[3], msg[4]]) as usize,
            msg.len() - 5
        );
        let req: Req = stream_request(&msg).unwrap();
        assert_eq!(req.path, "a");
        for (bad, needle) in [
            (&b"\x00\x00"[..], "not a Connect envelope"),
            (b"\x00\x00\x00\x00\x09{}", "claims 9 bytes"),
            (b"\x01\x00\x00\x00\x02{}", "compressed"),
            (b"\x00\x00\x00\x00\x02[]", "invalid JSON"),
        ] {
            let e = stream_request::<Req>(bad).unwrap_err();
            assert!(e.message.contains(needle), "{}", e.message);
        }
        let end = end_stream(Some(&ConnectError::not_found("no process 7")));
        assert_eq!(end[0], END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&end[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(&end_stream(None)[5..], b"{}");
        assert_eq!(
            ConnectError::unimplemented("x").status(),
            StatusCode::NOT_IMPLEMENTED
        );
    }
}
