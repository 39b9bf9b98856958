//! The [`Recorder`]: where the session layer reports every message and lifecycle event.
//! The recording layer implements it; this layer only calls it (a lower layer publishes,
//! a higher one subscribes).

use serde::Serialize;
use uuid::Uuid;

use super::error::BoxError;
use super::handle::Session;
use super::lifecycle::LifecycleEvent;
use crate::wire::{Channel, Message};

/// Which way a recorded message went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// From a client (or the broker on a client's behalf) to the kernel.
    ToKernel,
    /// From the kernel.
    FromKernel,
}

/// Where the session layer reports every message and lifecycle event, for the recording.
/// Implementations must not block: they queue and return.
pub trait Recorder: Send + Sync + 'static {
    /// A message on a kernel channel.
    fn message(&self, session: &Session, direction: Direction, channel: Channel, msg: &Message);
    /// Something that happened to the session.
    fn event(&self, session: &Session, event: &LifecycleEvent);
    /// Resolves once everything reported before the call is stored durably. Results are
    /// acknowledged to clients only after it.
    fn barrier(&self) -> futures::future::BoxFuture<'static, ()>;
    /// Whether session `id` was ever reported here and stored (live or ended, whoever
    /// owned it): a proposed session id is refused when it is, so one session's recording
    /// never receives another's executions. Those that store nothing know nothing.
    fn is_recorded(&self, id: Uuid) -> futures::future::BoxFuture<'static, Result<bool, BoxError>> {
        let _ = id;
        Box::pin(std::future::ready(Ok(false)))
    }
}

/// Records nothing.
pub struct NoRecorder;

impl Recorder for NoRecorder {
    fn message(&self, _: &Session, _: Direction, _: Channel, _: &Message) {}
    fn event(&self, _: &Session, _: &LifecycleEvent) {}
    fn barrier(&self) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// Several recorders told everything, in order (the recording, the metrics, ...). The barrier
/// resolves once every recorder's has.
pub struct Recorders(pub Vec<std::sync::Arc<dyn Recorder>>);

impl Recorder for Recorders {
    fn message(&self, session: &Session, direction: Direction, channel: Channel, msg: &Message) {
        for r in &self.0 {
            r.message(session, direction, channel, msg);
        }
    }

    fn event(&self, session: &Session, event: &LifecycleEvent) {
        for r in &self.0 {
            r.event(session, event);
        }
    }

    fn barrier(&self) -> futures::future::BoxFuture<'static, ()> {
        let all: Vec<_> = self.0.iter().map(|r| r.barrier()).collect();
        Box::pin(async move {
            futures::future::join_all(all).await;
        })
    }

    fn is_recorded(&self, id: Uuid) -> futures::future::BoxFuture<'static, Result<bool, BoxError>> {
        let all: Vec<_> = self.0.iter().map(|r| r.is_recorded(id)).collect();
        Box::pin(async move {
            for known in futures::future::join_all(all).await {
                if known? {
                    return Ok(true);
                }
            }
            Ok(false)
        })
    }
}
