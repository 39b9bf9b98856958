//! A running E2B command as the process service and the sandbox's state both hold it: the
//! [`Command`] (its pid, stdin, control) and the [`Fanout`] of its output to its clients.
//! Its own file so that `state.rs` (which keeps the commands) and `process.rs` (which runs
//! them) each use it without using each other.

use std::sync::Arc;

use axum::body::Bytes;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::session::CommandControl;
use crate::sync::lock;

/// A running command of a sandbox.
pub struct Command {
    pub pid: u32,
    pub tag: Option<String>,
    /// The request's process config, echoed by `List`.
    pub config: serde_json::Value,
    pub control: Arc<dyn CommandControl>,
    pub stdin: tokio::sync::Mutex<Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>>,
    /// Its events (`start` is not repeated), for `Start` and every `Connect`.
    pub events: Arc<Fanout>,
    /// Whether it runs on a pseudo-terminal (`stdin` then writes to the terminal).
    pub pty: bool,
}

/// What a command's clients are sent after `start`.
pub enum Event {
    /// A `data` envelope, with the user's budget permits its bytes hold (shared by every
    /// client it was sent to: let go once the last has taken it).
    Output(Bytes, Arc<OwnedSemaphorePermit>),
    /// The `end` envelope.
    End(Bytes),
}

/// A command's output on its way to its clients (the `Start` stream and any `Connect`
/// ones), each with a queue of its own. The queues are unbounded in count and bounded in
/// bytes by the user's command-output budget (`state::COMMAND_OUTPUT_BUDGET`):
/// the readers of the command's pipes take permits before publishing, so when the user's
/// clients leave that much unread, the readers wait, the pipes fill and the command blocks
/// on its write, as with any pipe nobody reads. Back-pressure rather than cutting: nothing
/// is lost (a cut would corrupt what a command writes, binary or not, and a client that
/// reads late would get a hole), and what waits is the user's own processes; her other
/// commands share the wait, another user's do not. The slowest client sets the pace, as
/// with `tee`.
#[derive(Default)]
pub struct Fanout {
    inner: std::sync::Mutex<FanoutInner>,
}

#[derive(Default)]
struct FanoutInner {
    clients: Vec<mpsc::UnboundedSender<Event>>,
    /// The `end` envelope, once the command ended: a late `Connect` gets it at once.
    ended: Option<Bytes>,
}

impl Fanout {
    /// A new client's queue: the events from now on.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inner = lock(&self.inner);
        match &inner.ended {
            Some(end) => {
                let _ = tx.send(Event::End(end.clone()));
            }
            None => inner.clients.push(tx),
        }
        rx
    }

    /// Whether any client listens (output nobody listens to is not held).
    pub fn listened(&self) -> bool {
        let mut inner = lock(&self.inner);
        inner.clients.retain(|c| !c.is_closed());
        !inner.clients.is_empty()
    }

    pub fn publish(&self, bytes: Bytes, budget: OwnedSemaphorePermit) {
        let budget = Arc::new(budget);
        lock(&self.inner)
            .clients
            .retain(|c| c.send(Event::Output(bytes.clone(), budget.clone())).is_ok());
    }

    /// The command's end: sent to every client, whose queues then close.
    pub fn end(&self, bytes: Bytes) {
        let mut inner = lock(&self.inner);
        for c in inner.clients.drain(..) {
            let _ = c.send(Event::End(bytes.clone()));
        }
        inner.ended = Some(bytes);
    }
}
