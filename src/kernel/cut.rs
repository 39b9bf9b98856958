//! Output messages too large to hold, cut instead of taken for an attack.
//!
//! A kernel's output is its normal business: an endless `print` loop makes ipykernel flush
//! one iopub `stream` message of whatever piled up, which can pass the kernel-message limit
//! ([`super::MessageLimits::max_message`]). On iopub, a `stream`, `display_data` or
//! `execute_result` message over the limit is read through a fixed buffer by the ZMTP
//! reader ([`super::zmtp::Reader::cut_oversized`]): its header, parent header and metadata
//! are kept whole, at most [`KEEP`] bytes of its content, and the rest is discarded as it
//! arrives. [`OutputCutter`] decides which messages may be cut and verifies their signature
//! over every byte, discarded or not (the HMAC is streamed), so a cut message is exactly as
//! authentic as a whole one. [`replace_content`] then gives the message a content that says
//! it was cut and how big it was: the first part of a stream's text with a marker, or a
//! marker in place of a display. Anything else over the limit (replies, a header that does
//! not fit, frames that are not a Jupyter message, or claims past [`MAX_CUT`]) still
//! fails the connection, as before.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;

use super::zmtp::{CutLimits, Cutter};
use crate::wire::{self, Message, SignatureStream, Signer, WireError, DELIMITER};

/// The iopub messages that are output, and so may be cut.
const CUT_TYPES: [&str; 3] = ["stream", "display_data", "execute_result"];

/// Bytes of a cut message's content kept: far more than an execution keeps of a stream
/// (`output_limit`, 10,000 characters by default), and small next to the message limit.
pub const KEEP: u64 = 256 << 10;

/// The most a cut message may claim, all frames together: 16 GiB. A print loop's flush is
/// as big as the kernel's output buffer grew while its flush thread waited for the GIL
/// (34 MB in under a second was seen), so this is no multiple of the message limit but far
/// more than a kernel can hold to send; it only turns an absurd claim (2^62 bytes) into a
/// protocol violation, as without cutting. Reading and discarding up to it costs the
/// broker CPU, not memory, as a stream of messages under the limit would.
pub const MAX_CUT: u64 = 16 << 30;

/// The cut limits for a kernel whose messages may be `max_message` bytes.
pub fn cut_limits(max_message: u64) -> CutLimits {
    CutLimits {
        keep: KEEP.min(max_message),
        max_total: MAX_CUT.max(max_message),
    }
}

/// Lets output messages be cut and checks their signature as their bytes stream by.
pub struct OutputCutter {
    signer: Signer,
    verifying: Option<Verifying>,
}

/// The signature check of the message being cut.
struct Verifying {
    /// The index of the content frame, the one signed part that can still be streaming.
    content: usize,
    mac: SignatureStream,
    signature: Bytes,
}

impl OutputCutter {
    pub fn new(signer: Signer) -> Self {
        Self {
            signer,
            verifying: None,
        }
    }
}

impl Cutter for OutputCutter {
    fn begin(&mut self, whole: &[Bytes]) -> bool {
        self.verifying = None;
        let Some(d) = whole.iter().position(|f| f.as_ref() == DELIMITER) else {
            return false;
        };
        // The signature, header, parent header and metadata must be whole: only the
        // content and buffers are cut.
        let (Some(signature), Some(header)) = (whole.get(d + 1), whole.get(d + 2)) else {
            return false;
        };
        if whole.len() < d + 5 {
            return false;
        }
        #[derive(Deserialize)]
        struct Header<'a> {
            #[serde(borrow)]
            msg_type: Cow<'a, str>,
        }
        match serde_json::from_slice::<Header>(header) {
            Ok(h) if CUT_TYPES.contains(&h.msg_type.as_ref()) => {}
            _ => return false,
        }
        let mut mac = self.signer.stream();
        for part in &whole[d + 2..whole.len().min(d + 6)] {
            mac.update(part);
        }
        self.verifying = Some(Verifying {
            content: d + 5,
            mac,
            signature: signature.clone(),
        });
        true
    }

    fn feed(&mut self, index: usize, piece: &[u8]) {
        if let Some(v) = &mut self.verifying {
            if index == v.content {
                v.mac.update(piece);
            }
        }
    }

    fn finish(&mut self) -> bool {
        self.verifying
            .take()
            .is_some_and(|v| v.mac.verify(&v.signature))
    }
}

/// The message of a cut output message's frames (its signature already verified while it
/// streamed), with a content that says it was cut from `bytes` bytes; buffers are dropped.
pub fn replace_content(frames: Vec<Bytes>, bytes: u64) -> Result<Message, WireError> {
    let mut m = wire::decode_stream_verified(frames)?;
    let content = match m.msg_type.as_str() {
        "stream" => {
            let (name, text) =
                stream_prefix(&m.content).unwrap_or_else(|| ("stdout".to_string(), String::new()));
            let kept = text.chars().count();
            let marker = if kept == 0 {
                format!("[kernel-broker: an output message of {bytes} bytes was cut]\n")
            } else {
                format!(
                    "\n[kernel-broker: an output message of {bytes} bytes was cut to its first {kept} characters]\n"
                )
            };
            serde_json::json!({"name": name, "text": text + &marker})
        }
        msg_type => {
            let mut c = serde_json::json!({
                "data": {"text/plain": format!(
                    "[kernel-broker: an output message ({msg_type}) of {bytes} bytes was cut]"
                )},
                "metadata": {},
            });
            if msg_type == "execute_result" {
                c["execution_count"] = serde_json::Value::Null;
            }
            c
        }
    };
    // Serialising a `Value` cannot fail.
    m.content = Bytes::from(serde_json::to_vec(&content).unwrap_or_default());
    m.buffers.clear();
    Ok(m)
}

/// The stream name and the first part of the text of a stream message's content, of which
/// only a prefix arrived: the JSON is closed right after the last whole character of the
/// string it stops in (ipykernel writes `name` before `text`, so that string is the text).
/// `None` when nothing sensible can be made of it.
fn stream_prefix(content: &[u8]) -> Option<(String, String)> {
    #[derive(Deserialize)]
    struct Stream {
        #[serde(default = "stdout")]
        name: String,
        text: String,
    }
    fn stdout() -> String {
        "stdout".into()
    }
    let s = match std::str::from_utf8(content) {
        Ok(s) => s,
        Err(e) => std::str::from_utf8(content.get(..e.valid_up_to())?).ok()?,
    };
    if let Ok(c) = serde_json::from_str::<Stream>(s) {
        return Some((c.name, c.text));
    }
    // Where the string the prefix stops in can be closed: after its last whole character
    // or escape. An escape may be half of a surrogate pair, so the start of the last escape
    // is the fallback.
    let mut in_string = false;
    let mut escaped = false;
    let mut hex_left = 0;
    let mut close_at = None;
    let mut last_escape = None;
    for (i, c) in s.char_indices() {
        let after = i + c.len_utf8();
        if !in_string {
            if c == '"' {
                in_string = true;
                close_at = Some(after);
            }
        } else if hex_left > 0 {
            hex_left -= 1;
            if hex_left == 0 {
                close_at = Some(after);
            }
        } else if escaped {
            escaped = false;
            if c == 'u' {
                hex_left = 4;
            } else {
                close_at = Some(after);
            }
        } else if c == '\\' {
            escaped = true;
            last_escape = Some(i);
        } else if c == '"' {
            in_string = false;
        } else {
            close_at = Some(after);
        }
    }
    if !in_string {
        return None;
    }
    [close_at, last_escape]
        .into_iter()
        .flatten()
        .find_map(|at| {
            let closed = format!("{}\"}}", s.get(..at)?);
            serde_json::from_str::<Stream>(&closed)
                .ok()
                .map(|c| (c.name, c.text))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_prefix_keeps_the_whole_characters_of_the_text() {
        let cases: [(&str, Option<(&str, &str)>); 9] = [
            (
                r#"{"name": "stderr", "text": "abc"}"#,
                Some(("stderr", "abc")),
            ),
            (
                r#"{"name": "stdout", "text": "abc"#,
                Some(("stdout", "abc")),
            ),
            (
                r#"{"name": "stdout", "text": "a\nb\"c\"#,
                Some(("stdout", "a\nb\"c")),
            ),
            (
                r#"{"name": "stdout", "text": "a\u00e"#,
                Some(("stdout", "a")),
            ),
            (
                r#"{"name": "stdout", "text": "é\u00e9"#,
                Some(("stdout", "éé")),
            ),
            // Half a surrogate pair is dropped with its escape.
            (
                r#"{"name": "stdout", "text": "x\ud83d"#,
                Some(("stdout", "x")),
            ),
            (r#"{"name": "stdout", "text": ""#, Some(("stdout", ""))),
            (r#"{"name": "stdout", "te"#, None),
            (r#"{"name": "stdout", "text": 12"#, None),
        ];
        for (content, want) in cases {
            let got = stream_prefix(content.as_bytes());
            let want = want.map(|(n, t)| (n.to_string(), t.to_string()));
            assert_eq!(got, want, "{content}");
        }
        // A multi-byte character cut in the middle of its UTF-8 bytes.
        let mut raw = br#"{"name": "stdout", "text": "ab"#.to_vec();
        raw.extend_from_slice(&"é".as_bytes()[..1]);
        assert_eq!(stream_prefix(&raw), Some(("stdout".into(), "ab".into())));
    }
}
