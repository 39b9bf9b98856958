//! Who a session belongs to among the front doors, and who or what ended it.
//!
//! The front door that made a session owns its life ([`FrontDoor`]): another front door
//! may use the session (JupyterLab attached to an agent's session), but asking it to end
//! the session only lets go of it ([`Registry::detach_front_door`](super::registry::Registry)).
//! Every end of a session says who or what ended it ([`EndedBy`]); the recording keeps both,
//! with the metadata the client gave the session at creation ([`Metadata`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::SessionError;

/// The API a session was made through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FrontDoor {
    /// The agent API (`POST /v1/sessions`, and the command line, which uses it).
    #[default]
    Rest,
    /// The Jupyter kernels and sessions API (`POST /api/kernels`, `/api/sessions`).
    Jupyter,
    /// E2B's sandboxes and contexts.
    E2b,
    /// MCP's tools.
    Mcp,
}

impl FrontDoor {
    pub const ALL: [FrontDoor; 4] = [
        FrontDoor::Rest,
        FrontDoor::Jupyter,
        FrontDoor::E2b,
        FrontDoor::Mcp,
    ];

    /// The name in the recording and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            FrontDoor::Rest => "rest",
            FrontDoor::Jupyter => "jupyter",
            FrontDoor::E2b => "e2b",
            FrontDoor::Mcp => "mcp",
        }
    }

    /// The front door named `name`, if there is one.
    pub fn parse(name: &str) -> Option<FrontDoor> {
        FrontDoor::ALL.into_iter().find(|d| d.as_str() == name)
    }
}

/// Who or what ended a session (the recording's `session_closed {by}`; an idle session's
/// expiry is `session_expired`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndedBy {
    /// A client of this front door asked (a delete, a kill, the MCP tool).
    Client(FrontDoor),
    /// The MCP session that made it ended (the client's DELETE /mcp, or its keep-alive ran
    /// out): its own session goes with it.
    McpSessionEnded,
    /// The E2B sandbox it was a context of ended.
    SandboxEnded,
    /// Setting the session up failed after its kernel started (E2B's `envVars`, an MCP
    /// session that lost the race to make one): the broker ended it.
    SetupFailed,
    /// The broker stopped (without `--keep-sessions`).
    BrokerShutdown,
    /// Cluster mode: this node learnt that the cluster declared it dead.
    NodeLost,
}

impl EndedBy {
    /// The name in the recording and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            EndedBy::Client(door) => door.as_str(),
            EndedBy::McpSessionEnded => "mcp_session_ended",
            EndedBy::SandboxEnded => "sandbox_ended",
            EndedBy::SetupFailed => "setup_failed",
            EndedBy::BrokerShutdown => "broker_shutdown",
            EndedBy::NodeLost => "node_lost",
        }
    }
}

/// How a session ends: closed by someone or something, or expired for idleness (or, for
/// an E2B sandbox, at its deadline).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    Closed(EndedBy),
    Expired,
}

/// The most entries a session's metadata holds.
pub const MAX_METADATA_ENTRIES: usize = 32;
/// The longest metadata key, in bytes.
pub const MAX_METADATA_KEY: usize = 64;
/// The longest metadata value, in bytes.
pub const MAX_METADATA_VALUE: usize = 1024;

/// What a client said about a session at creation, as text: E2B's sandbox `metadata`, the
/// MCP client's name and version, the agent API's `metadata`. Shown in the session browser
/// and searched; never interpreted. Bounded ([`Metadata::new`]) because it is stored with
/// the session and in its recording.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Metadata(BTreeMap<String, String>);

impl Metadata {
    /// `entries` checked against the bounds: at most [`MAX_METADATA_ENTRIES`], keys of
    /// 1..=[`MAX_METADATA_KEY`] bytes, values of at most [`MAX_METADATA_VALUE`] bytes, no
    /// control characters in keys.
    pub fn new(entries: BTreeMap<String, String>) -> Result<Self, SessionError> {
        let bad = |why: String| Err(SessionError::InvalidMetadata(why));
        if entries.len() > MAX_METADATA_ENTRIES {
            return bad(format!(
                "{} entries; at most {MAX_METADATA_ENTRIES}",
                entries.len()
            ));
        }
        for (k, v) in &entries {
            if k.is_empty() || k.len() > MAX_METADATA_KEY {
                return bad(format!(
                    "key {:?} is {} bytes; keys are 1 to {MAX_METADATA_KEY} bytes",
                    truncate(k),
                    k.len()
                ));
            }
            if k.chars().any(char::is_control) {
                return bad(format!("key {:?} has a control character", truncate(k)));
            }
            if v.len() > MAX_METADATA_VALUE {
                return bad(format!(
                    "the value of {k:?} is {} bytes; at most {MAX_METADATA_VALUE}",
                    v.len()
                ));
            }
        }
        Ok(Self(entries))
    }

    /// Metadata the broker itself writes (a client's name it was told), cut to the bounds
    /// instead of refused: it comes from a protocol handshake, not from a request to check.
    pub fn lenient(entries: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut out = BTreeMap::new();
        for (k, v) in entries.into_iter().take(MAX_METADATA_ENTRIES) {
            let k = cut(&k, MAX_METADATA_KEY).replace(char::is_control, " ");
            if !k.is_empty() {
                out.insert(k, cut(&v, MAX_METADATA_VALUE).to_string());
            }
        }
        Self(out)
    }

    pub fn entries(&self) -> &BTreeMap<String, String> {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    &s[..s.floor_char_boundary(max)]
}

fn truncate(s: &str) -> &str {
    cut(s, 40)
}

/// Which front door made a session, and what its client said about it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Provenance {
    pub front_door: FrontDoor,
    pub metadata: Metadata,
}

impl Provenance {
    pub fn new(front_door: FrontDoor) -> Self {
        Self {
            front_door,
            metadata: Metadata::default(),
        }
    }

    pub fn with_metadata(mut self, metadata: Metadata) -> Self {
        self.metadata = metadata;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn metadata_within_bounds_is_kept_and_beyond_them_refused_with_the_reason() {
        assert!(Metadata::new(map(&[("agent", "analyst"), ("run", "7")])).is_ok());
        let too_many: BTreeMap<_, _> = (0..=MAX_METADATA_ENTRIES)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        let long_key = "k".repeat(MAX_METADATA_KEY + 1);
        let long_value = "v".repeat(MAX_METADATA_VALUE + 1);
        for (entries, says) in [
            (too_many, "entries"),
            (map(&[("", "v")]), "1 to 64 bytes"),
            (map(&[(&long_key, "v")]), "1 to 64 bytes"),
            (map(&[("a\nb", "v")]), "control character"),
            (map(&[("k", &long_value)]), "at most 1024"),
        ] {
            let e = Metadata::new(entries).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn lenient_metadata_is_cut_to_the_bounds() {
        let m = Metadata::lenient([
            ("é".repeat(40), "x".repeat(5000)),
            ("\n".into(), "kept under a space".into()),
        ]);
        let (k, v) = m
            .entries()
            .iter()
            .find(|(k, _)| k.starts_with('é'))
            .unwrap();
        assert_eq!((k.len(), v.len()), (64, MAX_METADATA_VALUE));
        assert_eq!(m.entries()[" "], "kept under a space");
        assert_eq!(m.entries().len(), 2, "a control character becomes a space");
    }

    #[test]
    fn front_door_names_round_trip() {
        for d in FrontDoor::ALL {
            assert_eq!(FrontDoor::parse(d.as_str()), Some(d));
        }
        assert_eq!(FrontDoor::parse("REST"), None);
    }
}
