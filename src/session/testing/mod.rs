//! Test support for the session layer (compiled only for tests): a scripted kernel that
//! needs no Python (`scripted_kernel`), a fake sandbox that launches it (`fake_sandbox`),
//! a sandbox where nothing can run (`no_kernels`, for the api layer's router tests),
//! a recorder that remembers what it was told, and settings fit for paused time.

pub mod fake_sandbox;
mod no_kernels;
pub mod scripted_kernel;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

// The scripted kernel names the crate through this alias, so tests/it/kernel_client.rs can
// include the same file under its own name for the crate.
use crate as broker;

use super::{Direction, LifecycleEvent, Recorder, Session, SessionConfig};
use crate::kernel::{ConnectOptions, Heartbeat};
use crate::sync::lock;
use crate::wire::{Channel, Message};

pub use fake_sandbox::FakeSandbox;
pub use no_kernels::NoKernels;

/// Session settings for tests under paused time. The heartbeat is effectively off: under
/// paused time the clock jumps whenever the runtime idles, and a heartbeat's own timeout
/// would then expire before the echo is read, killing the session for no reason.
pub fn config() -> SessionConfig {
    let mut config = SessionConfig {
        interrupt_grace: Duration::from_secs(5),
        ..SessionConfig::default()
    };
    config.pool.size = 0;
    config.kernel = ConnectOptions {
        heartbeat: Heartbeat {
            interval: Duration::from_secs(365 * 86_400),
            max_misses: 3,
        },
        ..ConnectOptions::default()
    };
    config
}

/// Remembers every lifecycle event, and counts the `execute_reply`s the kernel sent (the
/// actor reports a message to the recorder just before it acts on it, in the same step, so
/// once the count moves the actor has taken the reply in).
pub struct TestRecorder {
    events: Mutex<Vec<LifecycleEvent>>,
    replies: watch::Sender<usize>,
    /// Sessions it was told of, as a store that keeps ended sessions' recordings.
    sessions: Mutex<std::collections::HashSet<uuid::Uuid>>,
}

impl TestRecorder {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            events: Mutex::new(Vec::new()),
            replies: watch::channel(0).0,
            sessions: Mutex::default(),
        })
    }

    pub fn events(&self) -> Vec<LifecycleEvent> {
        lock(&self.events).clone()
    }

    /// Wait until `n` `execute_reply`s have been taken in by the actor.
    pub async fn wait_replies(&self, n: usize) {
        let mut rx = self.replies.subscribe();
        let _ = rx.wait_for(|r| *r >= n).await;
    }
}

impl Recorder for TestRecorder {
    fn message(&self, _: &Session, direction: Direction, channel: Channel, msg: &Message) {
        if direction == Direction::FromKernel
            && channel == Channel::Shell
            && msg.msg_type == "execute_reply"
        {
            self.replies.send_modify(|n| *n += 1);
        }
    }

    fn event(&self, session: &Session, event: &LifecycleEvent) {
        lock(&self.sessions).insert(session.id);
        lock(&self.events).push(event.clone());
    }

    fn barrier(&self) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }

    fn is_recorded(
        &self,
        id: uuid::Uuid,
    ) -> futures::future::BoxFuture<'static, Result<bool, super::BoxError>> {
        Box::pin(std::future::ready(Ok(lock(&self.sessions).contains(&id))))
    }
}
