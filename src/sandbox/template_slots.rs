//! The fork-server templates of a sandbox, one per user and kernel spec, for both backends
//! (`local/template/`, `docker/template.rs`): a template is started by the first launch
//! that needs it (later launches of that user and spec wait for it), replaced when it
//! stopped working, and not tried again for [`RETRY_AFTER`] after a failure, so a broken
//! template costs one failed start a minute, not one per launch.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;

use super::fork_server::{ForkServer, RETRY_AFTER};
use crate::sync::lock;

/// What the slots need of a backend's running template.
#[async_trait]
pub(crate) trait TemplateHandle: Send + Sync + 'static {
    /// Its protocol client.
    fn server(&self) -> &ForkServer;
    /// Whether it still answers forks.
    fn usable(&self) -> bool {
        self.server().usable()
    }
    /// Whether a kernel forked from it is alive.
    fn has_children(&self) -> bool {
        self.server().has_children()
    }
    /// Ends it (its kernels have ends of their own).
    async fn end(&self);
}

/// The templates of one sandbox, by user and kernel spec.
pub(crate) struct TemplateSlots<T> {
    slots: Mutex<HashMap<(String, String), SharedSlot<T>>>,
}

/// One user's and spec's slot; its lock serialises starting the template.
type SharedSlot<T> = Arc<tokio::sync::Mutex<Slot<T>>>;

struct Slot<T> {
    template: Option<Arc<T>>,
    failed_at: Option<Instant>,
}

impl<T> Default for TemplateSlots<T> {
    fn default() -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

impl<T: TemplateHandle> TemplateSlots<T> {
    fn slot(&self, user: &str, kernel: &str) -> SharedSlot<T> {
        lock(&self.slots)
            .entry((user.to_string(), kernel.to_string()))
            .or_insert_with(|| {
                Arc::new(tokio::sync::Mutex::new(Slot {
                    template: None,
                    failed_at: None,
                }))
            })
            .clone()
    }

    /// The working template of `user` and `kernel`, started with `start` if there is none
    /// (one that is no longer usable, or that `fits` refuses, is ended and replaced) and the
    /// last failure is older than [`RETRY_AFTER`]; `None`: start plainly (logged).
    pub async fn get_or_start<E, F>(
        &self,
        user: &str,
        kernel: &str,
        fits: impl Fn(&T) -> bool,
        start: impl FnOnce() -> F,
    ) -> Option<Arc<T>>
    where
        E: Display,
        F: Future<Output = Result<T, E>>,
    {
        let slot = self.slot(user, kernel);
        let mut slot = slot.lock().await;
        if let Some(t) = &slot.template {
            if t.usable() && fits(t) {
                return Some(t.clone());
            }
            tracing::info!(%user, %kernel, "replacing a template that stopped working");
            t.end().await;
            slot.template = None;
            slot.failed_at = Some(Instant::now());
        }
        if slot.failed_at.is_some_and(|at| at.elapsed() < RETRY_AFTER) {
            return None;
        }
        match start().await {
            Ok(t) => {
                let t = Arc::new(t);
                slot.template = Some(t.clone());
                slot.failed_at = None;
                Some(t)
            }
            Err(e) => {
                tracing::warn!(%user, %kernel, error = %e, "the fork-server template did not start; kernels start plainly for now");
                slot.failed_at = Some(Instant::now());
                None
            }
        }
    }

    /// Ends the templates of `user` (every user's: `None`). With `idle_only`, only those
    /// with no kernel alive, and only while `still()` holds (checked under each slot's
    /// lock, so a launch that came meanwhile keeps its template).
    pub async fn end(&self, user: Option<&str>, idle_only: bool, still: impl Fn() -> bool) {
        let slots: Vec<SharedSlot<T>> = lock(&self.slots)
            .iter()
            .filter(|((u, _), _)| user.is_none_or(|name| name == u))
            .map(|(_, s)| s.clone())
            .collect();
        for slot in slots {
            let mut slot = slot.lock().await;
            let ends = slot
                .template
                .as_ref()
                .is_some_and(|t| !(idle_only && t.has_children()));
            if ends && still() {
                if let Some(t) = slot.template.take() {
                    tracing::info!(
                        user = user.unwrap_or("(all)"),
                        idle_only,
                        "ending a fork-server template"
                    );
                    t.end().await;
                }
            }
        }
    }
}
