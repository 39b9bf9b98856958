//! One Jupyter message: its routing identities, the four JSON parts kept as raw bytes, and
//! binary buffers. The few header fields the broker routes on are parsed once on decode.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::{WireError, PROTOCOL_VERSION};

/// The channel a message travels on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Channel {
    Shell,
    Iopub,
    Stdin,
    Control,
    Heartbeat,
}

impl Channel {
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Shell => "shell",
            Channel::Iopub => "iopub",
            Channel::Stdin => "stdin",
            Channel::Control => "control",
            Channel::Heartbeat => "hb",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "shell" => Channel::Shell,
            "iopub" => Channel::Iopub,
            "stdin" => Channel::Stdin,
            "control" => Channel::Control,
            "hb" | "heartbeat" => Channel::Heartbeat,
            _ => return None,
        })
    }
}

/// A Jupyter message. `header`, `parent_header`, `metadata` and `content` are the JSON
/// bytes exactly as received (or as built), so forwarding needs no re-serialisation.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub identities: Vec<Bytes>,
    pub header: Bytes,
    pub parent_header: Bytes,
    pub metadata: Bytes,
    pub content: Bytes,
    pub buffers: Vec<Bytes>,
    /// `header.msg_id`
    pub msg_id: String,
    /// `header.msg_type`
    pub msg_type: String,
    /// `parent_header.msg_id`, when there is a parent.
    pub parent_msg_id: Option<String>,
}

#[derive(Deserialize)]
struct HeaderFields {
    #[serde(default)]
    msg_id: String,
    #[serde(default)]
    msg_type: String,
}

#[derive(Deserialize)]
struct ParentFields {
    #[serde(default)]
    msg_id: Option<String>,
}

/// The current time as Jupyter writes it: RFC 3339, microseconds, `Z`.
pub fn now_iso() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

impl Message {
    /// Build a message from its raw parts, parsing the routing fields.
    pub fn from_parts(
        identities: Vec<Bytes>,
        header: Bytes,
        parent_header: Bytes,
        metadata: Bytes,
        content: Bytes,
        buffers: Vec<Bytes>,
    ) -> Result<Self, WireError> {
        let h: HeaderFields =
            serde_json::from_slice(&header).map_err(|e| WireError::Malformed {
                part: "header",
                reason: e.to_string(),
            })?;
        let parent_msg_id = if parent_header.is_empty() {
            None
        } else {
            let p: ParentFields =
                serde_json::from_slice(&parent_header).map_err(|e| WireError::Malformed {
                    part: "parent_header",
                    reason: e.to_string(),
                })?;
            p.msg_id.filter(|id| !id.is_empty())
        };
        Ok(Self {
            identities,
            header,
            parent_header,
            metadata,
            content,
            buffers,
            msg_id: h.msg_id,
            msg_type: h.msg_type,
            parent_msg_id,
        })
    }

    /// A new message from the broker (a request to a kernel, or a reply of its own), with a
    /// fresh `msg_id`, the given Jupyter `session` and `username`, and an optional parent.
    pub fn new(
        msg_type: &str,
        content: &impl Serialize,
        parent_header: Option<&Bytes>,
        session: &str,
        username: &str,
    ) -> Self {
        let msg_id = uuid::Uuid::new_v4().to_string();
        let header = serde_json::json!({
            "msg_id": msg_id,
            "msg_type": msg_type,
            "session": session,
            "username": username,
            "date": now_iso(),
            "version": PROTOCOL_VERSION,
        });
        // Serialising a `Value` or a plain derive(Serialize) struct cannot fail.
        let header = Bytes::from(serde_json::to_vec(&header).unwrap_or_default());
        let content = Bytes::from(serde_json::to_vec(content).unwrap_or_else(|_| b"{}".to_vec()));
        let parent_header = parent_header
            .cloned()
            .unwrap_or_else(|| Bytes::from_static(b"{}"));
        let parent_msg_id = serde_json::from_slice::<ParentFields>(&parent_header)
            .ok()
            .and_then(|p| p.msg_id)
            .filter(|id| !id.is_empty());
        Self {
            identities: Vec::new(),
            header,
            parent_header,
            metadata: Bytes::from_static(b"{}"),
            content,
            buffers: Vec::new(),
            msg_id,
            msg_type: msg_type.to_string(),
            parent_msg_id,
        }
    }

    /// Parse the content as `T`.
    pub fn parse_content<'a, T: Deserialize<'a>>(&'a self) -> Result<T, WireError> {
        serde_json::from_slice(&self.content).map_err(|e| WireError::Malformed {
            part: "content",
            reason: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_message_has_jupyter_header() {
        let m = Message::new(
            "execute_request",
            &serde_json::json!({"code": "1+1"}),
            None,
            "sess",
            "alice",
        );
        let h: serde_json::Value = serde_json::from_slice(&m.header).unwrap();
        assert_eq!(h["msg_type"], "execute_request");
        assert_eq!(h["version"], "5.3");
        assert_eq!(h["session"], "sess");
        assert_eq!(h["msg_id"], m.msg_id.as_str());
        let date = h["date"].as_str().unwrap();
        assert!(date.ends_with('Z'), "{date}");
        assert_eq!(date.split('.').nth(1).unwrap().len(), 7, "{date}");
        assert_eq!(&m.parent_header[..], b"{}");
        assert_eq!(m.parent_msg_id, None);
    }

    #[test]
    fn parent_is_parsed() {
        let parent = Message::new("execute_request", &serde_json::json!({}), None, "s", "u");
        let child = Message::new(
            "status",
            &serde_json::json!({}),
            Some(&parent.header),
            "s",
            "u",
        );
        assert_eq!(child.parent_msg_id.as_deref(), Some(parent.msg_id.as_str()));
    }

    #[test]
    fn channel_names_round_trip() {
        for c in [
            Channel::Shell,
            Channel::Iopub,
            Channel::Stdin,
            Channel::Control,
            Channel::Heartbeat,
        ] {
            assert_eq!(Channel::parse(c.as_str()), Some(c));
        }
        assert_eq!(Channel::parse("nope"), None);
    }
}
