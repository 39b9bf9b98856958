//! What the actor is asked to do: the [`Command`]s a [`Session`](super::Session) handle
//! sends to its actor's queue, among them an [`ExecRequest`].

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::error::SessionError;
use super::execution::{Execution, OutputEvent};
use super::front_door::SessionEnd;
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
    /// Ask the kernel to fork itself (`kb_fork_request` with `content`), if it is idle;
    /// its reply goes to `route`. `done` gets the execution count the fork starts from.
    Fork {
        content: serde_json::Value,
        route: ReplyRoute,
        done: oneshot::Sender<Result<u64, SessionError>>,
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
}
