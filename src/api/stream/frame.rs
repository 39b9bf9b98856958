//! What an agent stream client sends: its text frames, parsed. The one place the stream
//! reads a client's JSON. This file uses nothing of the crate (serde only): the fuzz harness
//! (`fuzz/`) compiles it as it is and drives [`parse_client_frame`] with arbitrary text.

use serde::Deserialize;
use serde_json::Value;

/// One frame a client sent (`docs/API.md`, "Agent stream").
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ClientFrame {
    Execute {
        id: Value,
        code: String,
        #[serde(default)]
        timeout_seconds: Option<f64>,
    },
    InputReply {
        value: String,
    },
    Interrupt {},
    /// Fork the session (or its checkpoint `checkpoint`): answered `forked` or `refused`.
    Fork {
        id: Value,
        #[serde(default)]
        count: Option<u64>,
        #[serde(default)]
        checkpoint: Option<String>,
    },
    /// Take a checkpoint: answered `checkpoint_taken` or `refused`.
    Checkpoint {
        id: Value,
    },
    /// Rewind the session to `checkpoint`: answered `rewound` or `refused`.
    Rewind {
        id: Value,
        checkpoint: String,
    },
    /// Pause the session to disk (issue 37): answered `paused` or `refused`.
    Pause {
        id: Value,
    },
    /// Resume the paused session: answered `resumed` or `refused`.
    Resume {
        id: Value,
    },
}

/// One client text frame, parsed.
pub(crate) fn parse_client_frame(text: &str) -> Result<ClientFrame, serde_json::Error> {
    serde_json::from_str(text)
}
