//! The ZeroMQ multipart framing of a Jupyter message:
//! `[identities...] <IDS|MSG> signature header parent_header metadata content [buffers...]`.

use bytes::Bytes;

use super::{Message, Signer, WireError};

/// The frame that separates routing identities from the message.
pub const DELIMITER: &[u8] = b"<IDS|MSG>";

/// Decode and verify one multipart message. A message whose signature does not verify is
/// an error: callers drop it and log, never act on it.
pub fn decode(frames: Vec<Bytes>, signer: &Signer) -> Result<Message, WireError> {
    decode_inner(frames, Some(signer))
}

/// Decode a message whose signature the caller has already verified over every byte while
/// they streamed in ([`Signer::stream`]): a message too large to hold, whose frames are
/// now cut short, so the signature no longer matches what is left of them.
pub fn decode_stream_verified(frames: Vec<Bytes>) -> Result<Message, WireError> {
    decode_inner(frames, None)
}

fn decode_inner(frames: Vec<Bytes>, signer: Option<&Signer>) -> Result<Message, WireError> {
    let total = frames.len();
    let split = frames
        .iter()
        .position(|f| f.as_ref() == DELIMITER)
        .ok_or(WireError::NoDelimiter { frames: total })?;
    let mut frames = frames;
    let mut rest = frames.split_off(split + 1);
    frames.pop(); // the delimiter itself
    let identities = frames;
    if rest.len() < 5 {
        return Err(WireError::TooFewFrames { found: rest.len() });
    }
    let buffers = rest.split_off(5);
    let mut it = rest.into_iter();
    // The length check above guarantees five frames.
    let (Some(signature), Some(header), Some(parent), Some(metadata), Some(content)) =
        (it.next(), it.next(), it.next(), it.next(), it.next())
    else {
        return Err(WireError::TooFewFrames { found: 0 });
    };
    if signer.is_some_and(|s| !s.verify(&signature, [&header, &parent, &metadata, &content])) {
        let msg_type = serde_json::from_slice::<serde_json::Value>(&header)
            .ok()
            .and_then(|h| h.get("msg_type").and_then(|t| t.as_str()).map(String::from))
            .unwrap_or_else(|| "unparseable".into());
        return Err(WireError::BadSignature { msg_type });
    }
    Message::from_parts(identities, header, parent, metadata, content, buffers)
}

/// Encode a message into frames, signing it with `signer`.
pub fn encode(msg: &Message, signer: &Signer) -> Vec<Bytes> {
    let signature = signer.sign([&msg.header, &msg.parent_header, &msg.metadata, &msg.content]);
    let mut frames = Vec::with_capacity(msg.identities.len() + 6 + msg.buffers.len());
    frames.extend(msg.identities.iter().cloned());
    frames.push(Bytes::from_static(DELIMITER));
    frames.push(Bytes::from(signature));
    frames.push(msg.header.clone());
    frames.push(msg.parent_header.clone());
    frames.push(msg.metadata.clone());
    frames.push(msg.content.clone());
    frames.extend(msg.buffers.iter().cloned());
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Message {
        Message::new(
            "execute_request",
            &serde_json::json!({"code": "print('hi')"}),
            None,
            "session-1",
            "alice",
        )
    }

    #[test]
    fn round_trip_with_identities_and_buffers() {
        let signer = Signer::new(b"k");
        let mut m = sample();
        m.identities = vec![Bytes::from_static(b"id-a"), Bytes::from_static(b"id-b")];
        m.buffers = vec![Bytes::from_static(b"\x00\x01binary")];
        let frames = encode(&m, &signer);
        assert_eq!(frames.len(), 2 + 6 + 1);
        assert_eq!(&frames[2][..], DELIMITER);
        let back = decode(frames, &signer).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn bad_signature_is_rejected() {
        let m = sample();
        let mut frames = encode(&m, &Signer::new(b"right"));
        assert!(matches!(
            decode(frames.clone(), &Signer::new(b"wrong")),
            Err(WireError::BadSignature { ref msg_type }) if msg_type == "execute_request"
        ));
        // Tamper with the content under the right key.
        let last = frames.len() - 1;
        frames[last] = Bytes::from_static(b"{\"code\": \"import os\"}");
        assert!(matches!(
            decode(frames, &Signer::new(b"right")),
            Err(WireError::BadSignature { .. })
        ));
    }

    #[test]
    fn malformed_frames_are_errors() {
        let s = Signer::new(b"");
        assert_eq!(
            decode(vec![Bytes::from_static(b"x")], &s),
            Err(WireError::NoDelimiter { frames: 1 })
        );
        assert_eq!(
            decode(
                vec![Bytes::from_static(DELIMITER), Bytes::from_static(b"")],
                &s
            ),
            Err(WireError::TooFewFrames { found: 1 })
        );
        let frames = vec![
            Bytes::from_static(DELIMITER),
            Bytes::new(),
            Bytes::from_static(b"not json"),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
        ];
        assert!(matches!(
            decode(frames, &s),
            Err(WireError::Malformed { part: "header", .. })
        ));
    }

    proptest! {
        #[test]
        fn decode_never_panics(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..10)) {
            let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
            let _ = decode(frames, &Signer::new(b"key"));
        }

        #[test]
        fn any_content_round_trips(code in ".{0,200}", ids in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..8), 0..3),
                                    bufs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..3)) {
            let signer = Signer::new(b"prop-key");
            let mut m = Message::new("execute_request", &serde_json::json!({"code": code}), None, "s", "u");
            m.identities = ids.into_iter().filter(|i| i.as_slice() != DELIMITER).map(Bytes::from).collect();
            m.buffers = bufs.into_iter().map(Bytes::from).collect();
            let back = decode(encode(&m, &signer), &signer).unwrap();
            prop_assert_eq!(back, m);
        }
    }
}
