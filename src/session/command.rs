//! What the actor is asked to do: the [`Command`]s a [`Session`](super::Session) handle
//! sends to its actor's queue, among them an [`ExecRequest`].

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use uuid::Uuid;

use super::checkpoint::{CheckpointBook, CheckpointInfo, CheckpointList, CheckpointPolicy};
use super::error::SessionError;
use super::execution::{Execution, OutputEvent};
use super::front_door::SessionEnd;
use super::launch::Live;
use super::pause::PauseInfo;
use crate::sandbox::fork::PreparedFork;
use crate::sandbox::LaunchSpec;
use crate::wire::{Channel, Message};

/// A request to run code.
pub struct ExecRequest {
    pub code: String,
    /// Already capped by the configured maximum.
    pub timeout: Duration,
    /// Whether `input()` may ask the client (only streaming clients can answer).
    pub allow_stdin: bool,
    /// Output as it happens; dropped (not awaited) when the client falls behind.
    pub stream: Option<mpsc::Sender<OutputEvent>>,
    /// What the kernel's own hooks apply to this execution (none: plain IPython).
    pub hooks: Option<super::hooks::KernelHooks>,
    /// The variables of `hooks` set and put back by code of the kernel's own language
    /// (kernels without the hooks: `env_code.rs`).
    pub env_code: Option<super::env_code::EnvCode>,
    /// A client's code, checked against the pre-execution policy (not the broker's own).
    pub checked: bool,
    pub done: oneshot::Sender<Execution>,
}

/// Where replies to a forwarded message go (a Jupyter client's channel).
pub type ReplyRoute = mpsc::Sender<(Channel, Arc<Message>)>;

pub(super) enum Command {
    Execute(ExecRequest),
    InputReply(String),
    Interrupt(oneshot::Sender<Result<(), SessionError>>),
    Restart(oneshot::Sender<Result<(), SessionError>>),
    /// Send a client's message to the kernel as is; replies to it go to `route`.
    Forward {
        channel: Channel,
        msg: Message,
        route: ReplyRoute,
    },
    /// Ask the live kernel to fork itself into a kernel for `spec`, if it is idle: the
    /// actor prepares the fork with the sandbox for the kernel it then asks (a checkpoint
    /// may have swapped the live kernel since the caller last looked) and sends
    /// `kb_fork_request`; the reply goes to `route`. `done` gets the prepared fork and the
    /// execution count the fork starts from.
    Fork {
        spec: LaunchSpec,
        route: ReplyRoute,
        done: oneshot::Sender<Result<(PreparedFork, u64), SessionError>>,
    },
    /// Take a checkpoint now (`session/checkpoint.rs`), kept within the user's bounds.
    Checkpoint {
        done: oneshot::Sender<Result<CheckpointInfo, SessionError>>,
    },
    /// The user's checkpoint bounds and their book (sent by a front door); with
    /// `set_mode`, `policy.every_execution` too (otherwise the session keeps its own).
    CheckpointPolicy {
        policy: CheckpointPolicy,
        book: Arc<CheckpointBook>,
        set_mode: bool,
    },
    ListCheckpoints(oneshot::Sender<CheckpointList>),
    /// End a checkpoint (`why`: asked, or a bound); `done` says whether there was one.
    DropCheckpoint {
        id: Uuid,
        why: String,
        done: Option<oneshot::Sender<bool>>,
    },
    /// Make a fork of the checkpoint the live kernel.
    Rewind {
        checkpoint: Uuid,
        done: oneshot::Sender<Result<(), SessionError>>,
    },
    /// Fork the checkpoint into a connected kernel for another session (`spec`'s).
    ForkCheckpoint {
        checkpoint: Uuid,
        spec: LaunchSpec,
        done: oneshot::Sender<Result<(Live, u64), SessionError>>,
    },
    /// Pause the session to disk (`actor/pause.rs`); a paused one stays as it is.
    Pause {
        done: oneshot::Sender<Result<PauseInfo, SessionError>>,
    },
    /// Take a snapshot of the session's kernel for `spec` (the snapshot's id and own
    /// workspace); the kernel goes on. `done` gets its images and the execution count.
    Snapshot {
        spec: LaunchSpec,
        done: oneshot::Sender<Result<(crate::sandbox::pause::PausedImage, u64), SessionError>>,
    },
    /// Resume a paused session (one that is not paused stays as it is).
    Resume {
        done: oneshot::Sender<Result<(), SessionError>>,
    },
    Shutdown {
        end: SessionEnd,
        done: oneshot::Sender<()>,
    },
    /// The broker stops with `--keep-sessions`: answer what waits, let go of the kernel
    /// without ending it, and stop.
    Detach {
        done: oneshot::Sender<()>,
    },
    /// Cluster mode with `--carry-paused`, at start: carry this paused session to the
    /// other nodes (its copy was cut short by the node's stop, or the option is new). One
    /// that is not paused, or is being carried, stays as it is.
    CarryPaused {
        done: oneshot::Sender<()>,
    },
    /// Cluster mode: another node took this paused session over (`--carry-paused`): its
    /// paused state here goes, nothing is recorded (the recording goes on there), and the
    /// actor stops.
    TakenOver {
        done: oneshot::Sender<()>,
    },
}

impl Command {
    /// Whether doing it needs the session's kernel running: a paused session is resumed
    /// first (`actor/pause.rs`).
    pub(super) fn uses_kernel(&self) -> bool {
        matches!(
            self,
            Command::Execute(_)
                | Command::Restart(_)
                | Command::Forward { .. }
                | Command::Fork { .. }
                | Command::Checkpoint { .. }
                | Command::Rewind { .. }
                | Command::Snapshot { .. }
        )
    }

    /// Its name, for logs.
    pub(super) fn name(&self) -> &'static str {
        match self {
            Command::Execute(_) => "execute",
            Command::InputReply(_) => "input_reply",
            Command::Interrupt(_) => "interrupt",
            Command::Restart(_) => "restart",
            Command::Forward { .. } => "forward",
            Command::Fork { .. } => "fork",
            Command::Checkpoint { .. } => "checkpoint",
            Command::CheckpointPolicy { .. } => "checkpoint_policy",
            Command::ListCheckpoints(_) => "list_checkpoints",
            Command::DropCheckpoint { .. } => "drop_checkpoint",
            Command::Rewind { .. } => "rewind",
            Command::ForkCheckpoint { .. } => "fork_checkpoint",
            Command::Pause { .. } => "pause",
            Command::Resume { .. } => "resume",
            Command::Snapshot { .. } => "snapshot",
            Command::Shutdown { .. } => "shutdown",
            Command::Detach { .. } => "detach",
            Command::TakenOver { .. } => "taken_over",
            Command::CarryPaused { .. } => "carry_paused",
        }
    }
}
