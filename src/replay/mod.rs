//! Replay: a recording's code cells run again, in order, in a new session of the same user
//! and kernel, and each cell's output compared with what was recorded.
//!
//! What is compared, per cell: stdout, stderr, each result and display in order (its
//! `text/plain`, its images by presence and size class only, other MIME types by presence),
//! and the error's `ename: evalue`. Tracebacks, execution counts and timings are not
//! compared. Both sides are rendered as text (see [`render`]), normalised, and compared;
//! where they differ, `diff` is a unified diff of the two renderings.
//!
//! The normalisation rules are in [`normalise()`].
//!
//! Layer: replay drives the session registry (it creates a session and runs the cells)
//! and reads the recording store, so it sits above both; the API's replay endpoint calls
//! [`replay`].
//!
//! A session that worked in a workspace of its own (an E2B sandbox's shape) lost its files
//! when it ended: its replay gets a workspace of its own too, and before each cell the
//! files the API wrote, removed or moved before that cell are written, removed or moved
//! again, from the contents the recording kept (`files.rs`). A session of the shared
//! workspace replays in it as it is now (nothing is written there: it is the user's).
//!
//! Layout: `normalise` (what is not a difference), `compare` (a cell's two sides as text,
//! and their diff), `files` (the files a replay writes again), this file (the run).

mod compare;
mod files;
mod normalise;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::recording::notebook;
use crate::recording::{RecordingError, RecordingStore};
use crate::session::SandboxUser;
use crate::session::{CreateOptions, ExecutionStatus, Registry, Room, Session, WorkspaceChoice};

pub use compare::{compare, compare_cell, render, Observed};
pub use normalise::normalise;

/// One replayed cell.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayCell {
    /// Position among the recording's code cells, from 0.
    pub index: usize,
    pub code: String,
    /// How the replayed execution ended.
    pub status: ExecutionStatus,
    /// How the recorded one ended, when the recording has its Execution.
    pub recorded_status: Option<ExecutionStatus>,
    pub same_output: bool,
    /// Unified diff of the normalised outputs (recorded, then replayed); empty when same.
    pub diff: String,
}

/// The outcome of a replay: the new session (left running) and each cell.
pub struct Replay {
    pub session: Arc<Session>,
    pub cells: Vec<ReplayCell>,
    /// Files the API wrote that could not be written again (their content was not kept:
    /// larger than the recording keeps, or cut by its bounds).
    pub files_not_replayed: Vec<String>,
}

/// Run session `id`'s recorded cells again in a new session of `user`, made within `room`.
/// The caller has checked that the recording is `user`'s.
pub async fn replay(
    store: &RecordingStore,
    registry: &Registry,
    user: &SandboxUser,
    room: Room,
    id: Uuid,
) -> Result<Replay, RecordingError> {
    let info = store.info(id).await?.ok_or(RecordingError::NotFound(id))?;
    let events = store.all_events(id).await?;
    let cells = notebook::cells(&events);
    let own = files::own_workspace(&events);
    let session = registry
        .create(
            user,
            room.max_sessions(),
            CreateOptions {
                kernel: Some(info.kernel.clone()),
                workspace: match own {
                    true => WorkspaceChoice::Own,
                    false => WorkspaceChoice::Shared,
                },
                ..Default::default()
            },
        )
        .await
        .map_err(|e| room.explain(e))?;
    // Made: the room is let go before the cells run, so the user's other creations wait
    // for no replay.
    drop(room);
    tracing::info!(source = %id, session = %session.id, cells = cells.len(), own, "replaying a recording");
    let config = registry.config();
    let mut ops = match own {
        true => files::operations(&events),
        false => Vec::new(),
    }
    .into_iter()
    .peekable();
    let mut missing = Vec::new();
    let mut out = Vec::with_capacity(cells.len());
    for cell in &cells {
        let before = files::first_seq(&events, &cell.msg_id);
        while let Some(op) = ops.next_if(|(seq, _)| *seq < before) {
            files::apply(registry, &session, op.1, &mut missing).await?;
        }
        let timeout = cell
            .timeout_seconds
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .filter(|d| !d.is_zero())
            .unwrap_or(config.execution_timeout)
            .min(config.max_execution_timeout);
        let x = session.execute_wait(cell.code.clone(), timeout).await?;
        out.push(compare_cell(cell, &x, config.output_limit));
    }
    Ok(Replay {
        session,
        cells: out,
        files_not_replayed: missing,
    })
}
