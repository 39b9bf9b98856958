//! The files a replay writes again: in a session that worked in a workspace of its own,
//! what the API wrote, removed or moved there (an upload, an E2B or MCP write), in the
//! recording's order, each before the first cell recorded after it. Contents come from the
//! recording (`file_written`'s `content_base64`, kept for such sessions up to
//! `session::RECORDED_FILE_MAX`); a write whose content was not kept is named in the
//! replay's answer instead.

use std::sync::Arc;

use base64::Engine;

use crate::recording::event::BrokerEvent;
use crate::recording::stored::StoredEvent;
use crate::recording::{RecordedEvent, RecordedKind, RecordingError};
use crate::session::{Registry, Session};

/// A file operation the API made in the recorded session.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum FileOp {
    /// `content`: `None` when the recording did not keep it.
    Write {
        path: String,
        content: Option<Vec<u8>>,
    },
    Remove {
        path: String,
    },
    Rename {
        from: String,
        to: String,
    },
}

/// The recorded session's broker events, parsed.
fn broker_events(events: &[RecordedEvent]) -> impl Iterator<Item = (i64, BrokerEvent)> + '_ {
    events.iter().filter_map(|e| match &e.kind {
        RecordedKind::Broker { kind, detail } => Some((e.seq, BrokerEvent::parse(kind, detail))),
        RecordedKind::Message { .. } => None,
    })
}

/// Whether the recorded session worked in a workspace of its own.
pub(super) fn own_workspace(events: &[RecordedEvent]) -> bool {
    broker_events(events).any(|(_, e)| {
        matches!(
            e,
            BrokerEvent::Session(StoredEvent::SessionCreated {
                own_workspace: true,
                ..
            })
        )
    })
}

/// The API's file operations of the recording, each with its place (`seq`), in order.
pub(super) fn operations(events: &[RecordedEvent]) -> Vec<(i64, FileOp)> {
    let engine = base64::engine::general_purpose::STANDARD;
    broker_events(events)
        .filter_map(|(seq, e)| {
            let op = match e {
                BrokerEvent::Session(StoredEvent::FileWritten {
                    path,
                    content_base64,
                    ..
                }) => FileOp::Write {
                    path,
                    content: content_base64.and_then(|c| engine.decode(c).ok()),
                },
                BrokerEvent::Session(StoredEvent::FileRemoved { path }) => FileOp::Remove { path },
                BrokerEvent::Session(StoredEvent::FileRenamed { from, to }) => {
                    FileOp::Rename { from, to }
                }
                _ => return None,
            };
            Some((seq, op))
        })
        .collect()
}

/// The place of the first event of the cell whose request was `msg_id` (its request, or
/// the broker's `execution_started`); after everything when none is found.
pub(super) fn first_seq(events: &[RecordedEvent], msg_id: &str) -> i64 {
    events
        .iter()
        .find(|e| match &e.kind {
            RecordedKind::Message { msg_id: m, .. } => m == msg_id,
            RecordedKind::Broker { kind, detail } => {
                kind == "execution_started"
                    && matches!(
                        BrokerEvent::parse(kind, detail),
                        BrokerEvent::Session(StoredEvent::ExecutionStarted { msg_id: m, .. }) if m == msg_id
                    )
            }
        })
        .map(|e| e.seq)
        .unwrap_or(i64::MAX)
}

/// Makes `op` again in `session`'s workspace; a write whose content was not kept is added
/// to `missing`. A path the workspace refuses fails the replay, saying which.
pub(super) async fn apply(
    registry: &Registry,
    session: &Arc<Session>,
    op: FileOp,
    missing: &mut Vec<String>,
) -> Result<(), RecordingError> {
    let workspace = registry.workspace(session)?;
    match op {
        FileOp::Write {
            path,
            content: Some(bytes),
        } => workspace.write(&path, bytes).await?,
        FileOp::Write {
            path,
            content: None,
        } => {
            if !missing.contains(&path) {
                missing.push(path);
            }
        }
        FileOp::Remove { path } => {
            workspace.remove_all(&path).await?;
        }
        FileOp::Rename { from, to } => workspace.rename_over(&from, &to).await?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn broker(seq: i64, event: StoredEvent) -> RecordedEvent {
        RecordedEvent {
            seq,
            time: Utc::now(),
            kind: RecordedKind::Broker {
                kind: event.kind().to_string(),
                detail: event.detail().to_string(),
            },
        }
    }

    #[test]
    fn the_apis_file_operations_are_read_in_order_with_their_contents() {
        let events = vec![
            broker(
                1,
                StoredEvent::FileWritten {
                    path: "a.csv".into(),
                    bytes: 3,
                    content_base64: Some("eCx5".into()),
                },
            ),
            broker(
                2,
                StoredEvent::FileWritten {
                    path: "big.bin".into(),
                    bytes: 9 << 20,
                    content_base64: None,
                },
            ),
            broker(
                3,
                StoredEvent::FileRenamed {
                    from: "a.csv".into(),
                    to: "b.csv".into(),
                },
            ),
            broker(
                4,
                StoredEvent::FileRemoved {
                    path: "big.bin".into(),
                },
            ),
        ];
        assert_eq!(
            operations(&events),
            vec![
                (
                    1,
                    FileOp::Write {
                        path: "a.csv".into(),
                        content: Some(b"x,y".to_vec())
                    }
                ),
                (
                    2,
                    FileOp::Write {
                        path: "big.bin".into(),
                        content: None
                    }
                ),
                (
                    3,
                    FileOp::Rename {
                        from: "a.csv".into(),
                        to: "b.csv".into()
                    }
                ),
                (
                    4,
                    FileOp::Remove {
                        path: "big.bin".into()
                    }
                ),
            ]
        );
        assert!(!own_workspace(&events));
        assert_eq!(first_seq(&events, "nothing"), i64::MAX);
    }
}
