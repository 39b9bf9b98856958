//! Idle expiry, after mini-redis's purge task: one background task sleeps until the
//! earliest expiry deadline, or until woken by a change, and expires what is due. An
//! expired session leaves a tombstone, so for `tombstone_ttl` its id answers "expired"
//! (410) to its owner rather than "not found".
//!
//! What counts as activity (and so postpones expiry): creating the session, an execute
//! request being received and an execution finishing, an `input_reply`, interrupt,
//! restart, a file read or written through the API, and any message a client sends to the
//! kernel over a WebSocket. What does not: reading the session (GET, list), opening or
//! closing a WebSocket, and output the kernel produces on its own. A busy session (an
//! execution running) is never expired unless it has been busy for longer than `max_busy`.
//!
//! Pausing (issue 37): with `--pause-after`, an idle session that can be paused is paused
//! at that point instead of expiring at its idle timeout, and a paused session expires
//! `--paused-ttl` after its pause; a sandbox with E2B's `autoPause` is paused at its fixed
//! deadline instead of ending.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use super::Registry;
use crate::session::command::Command;
use crate::session::error::SessionError;
use crate::session::front_door::SessionEnd;
use crate::session::handle::Session;
use crate::session::pause::Due;

/// What is left of an expired session until `forget_at`.
pub(super) struct Tombstone {
    pub user: String,
    pub expired_at: DateTime<Utc>,
    pub idle_secs: u64,
    pub forget_at: Instant,
}

impl Registry {
    pub(super) async fn expire(&self, session: Arc<Session>) {
        let idle_secs = session.idle_timeout.map(|t| t.as_secs()).unwrap_or(0);
        {
            let mut t = self.table();
            if t.sessions.remove(&session.id).is_none() {
                return;
            }
            t.tombstones.insert(
                session.id,
                Tombstone {
                    user: session.user.name.clone(),
                    expired_at: Utc::now(),
                    idle_secs,
                    forget_at: Instant::now() + self.inner.config.tombstone_ttl,
                },
            );
        }
        // The expiry task plans its next wake-up with this tombstone's time in it.
        self.inner.notify.notify_one();
        tracing::info!(session = %session.id, user = %session.user.name, "session expired");
        session.shutdown(SessionEnd::Expired).await;
        self.after_removal(&session).await;
    }

    /// Pauses `session`, idle past its `--pause-after` or at the fixed deadline of a
    /// sandbox with E2B's `autoPause`, instead of expiring it. A pause that is refused or
    /// fails leaves the session to expire as it would have without (`Session::end_auto_pause`).
    async fn auto_pause(&self, session: Arc<Session>) {
        if !session.begin_auto_pause() {
            return;
        }
        let (done, answer) = tokio::sync::oneshot::channel();
        let paused = match session.send(Command::Pause { done }) {
            Ok(()) => answer
                .await
                .unwrap_or(Err(SessionError::Closed(session.id))),
            Err(e) => Err(e),
        };
        match &paused {
            Ok(info) => {
                if session.pauses_at_deadline() {
                    // As E2B's: a paused sandbox's timeout stops.
                    session.set_deadline(None);
                }
                tracing::info!(session = %session.id, user = %session.user.name, image_bytes = info.image_bytes, "idle session paused");
            }
            Err(e) => {
                tracing::info!(session = %session.id, user = %session.user.name, error = %e, "idle session not paused: it expires instead");
            }
        }
        session.end_auto_pause(paused.is_err());
    }

    /// Sleep until the next expiry deadline (or a change), expire what is due.
    pub(super) async fn expiry_task(self) {
        let max_busy = self.inner.config.max_busy;
        loop {
            let now = Instant::now();
            let (due, next) = {
                let mut t = self.table();
                t.tombstones.retain(|_, ts| ts.forget_at > now);
                let mut due = Vec::new();
                // The next tombstone to forget is a deadline too: its memory goes on time.
                let mut next: Option<Instant> = t.tombstones.values().map(|ts| ts.forget_at).min();
                for s in t.sessions.values() {
                    if let Some((d, what)) = s.expiry_deadline(max_busy) {
                        if d <= now {
                            due.push((s.clone(), what));
                        } else {
                            next = Some(next.map_or(d, |n: Instant| n.min(d)));
                        }
                    }
                }
                (due, next)
            };
            for (s, what) in due {
                let registry = self.clone();
                match what {
                    Due::Expire => tokio::spawn(async move { registry.expire(s).await }),
                    Due::Pause => tokio::spawn(async move { registry.auto_pause(s).await }),
                };
            }
            let wake = next.unwrap_or(now + Duration::from_secs(3600));
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = self.inner.notify.notified() => {}
                _ = self.inner.shutdown.cancelled() => return,
            }
        }
    }
}
