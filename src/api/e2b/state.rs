//! What the E2B API knows of each sandbox beyond its session: the template it was asked
//! for, its metadata and environment, its contexts (more sessions) and its running
//! commands. Kept in memory: after a broker restart a sandbox's session may live on (kept
//! with `--keep-sessions`, or paused); the first E2B request after the start rebuilds its
//! record from the session ([`E2bState::recover`]): its metadata (as text), its start time
//! and its contexts come back; its template reads `code-interpreter-v1`, its `envVars`
//! are not known again (the kernel's environment keeps them) and its commands ended with
//! the broker.
//!
//! A sandbox's end (kill, or its deadline through the session layer's expiry) takes its
//! contexts and commands along: a watcher task per sandbox waits for the session's final
//! state and cleans up.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::command::Command;
use crate::api::output_budget::ByteBudgets;
use crate::session::{EndedBy, Registry, Session};
use crate::sync::lock;

/// The session metadata that marks a language's default context (its kernel's name), so
/// that a broker taking the sandbox back from an earlier run knows it again.
pub(super) const DEFAULT_CONTEXT_KEY: &str = "default_context";

/// One sandbox's E2B side.
pub struct SandboxMeta {
    pub template: String,
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub env: Vec<(String, String)>,
    pub started_at: DateTime<Utc>,
    /// Context sessions besides the sandbox's own (its default context).
    pub contexts: Vec<Uuid>,
    /// The working directory each context was created with, when not the home directory
    /// (`GET /contexts` lists it as E2B does).
    pub context_cwds: HashMap<Uuid, String>,
    /// Each language's default context (by its kernel's name): where `run_code(language=...)`
    /// without a context runs, made at its first use.
    pub default_contexts: HashMap<String, Uuid>,
    pub commands: HashMap<u32, Arc<Command>>,
}

pub struct E2bState {
    sandboxes: Mutex<HashMap<Uuid, SandboxMeta>>,
    /// Whether the sandboxes an earlier run left were looked for ([`Self::recover`]).
    recovered: std::sync::atomic::AtomicBool,
    /// What each user's commands' unread output may hold of the broker's memory.
    pub command_output: ByteBudgets,
    /// What each user's executions' unread output (`/execute` lines) may hold.
    pub execution_output: ByteBudgets,
    /// The sandboxes' directory watchers (`watching.rs`).
    pub watchers: super::watching::Watchers,
}

/// Bytes of `/execute` NDJSON lines a user's clients may leave unread, all her executions
/// together; past it lines are cut with a marker.
pub const EXECUTION_OUTPUT_BUDGET: usize = 8 << 20;

/// Bytes of command output (as sent: Connect envelopes) a user's clients may leave unread,
/// all her commands together; past it her commands wait on their pipes.
pub const COMMAND_OUTPUT_BUDGET: usize = 8 << 20;

impl Default for E2bState {
    fn default() -> Self {
        Self {
            sandboxes: Mutex::default(),
            recovered: Default::default(),
            command_output: ByteBudgets::new(COMMAND_OUTPUT_BUDGET),
            execution_output: ByteBudgets::new(EXECUTION_OUTPUT_BUDGET),
            watchers: Default::default(),
        }
    }
}

impl E2bState {
    pub fn insert(&self, id: Uuid, meta: SandboxMeta) {
        lock(&self.sandboxes).insert(id, meta);
    }

    /// Runs `f` on sandbox `id`'s record, if the broker has one.
    pub fn with<R>(&self, id: Uuid, f: impl FnOnce(&mut SandboxMeta) -> R) -> Option<R> {
        lock(&self.sandboxes).get_mut(&id).map(f)
    }

    /// Forgets sandbox `id`; its contexts and commands are returned for ending.
    pub fn remove(&self, id: Uuid) -> Option<SandboxMeta> {
        lock(&self.sandboxes).remove(&id)
    }

    /// Ends what the sandbox `id` holds besides its session: commands, then contexts.
    pub async fn end(&self, registry: &Registry, user: &str, id: Uuid) {
        self.watchers.end_sandbox(id);
        let Some(meta) = self.remove(id) else { return };
        for cmd in meta.commands.values() {
            cmd.control.kill().await;
        }
        for ctx in meta.contexts {
            let _ = registry.delete(user, ctx, EndedBy::SandboxEnded).await;
        }
    }

    /// Watches sandbox `session`: once it ends (deleted, expired at its deadline), its
    /// contexts and commands end too.
    pub fn watch(self: &Arc<Self>, registry: Registry, session: Arc<Session>) {
        let state = self.clone();
        tokio::spawn(async move {
            session.ended().await;
            state.end(&registry, &session.user.name, session.id).await;
        });
    }
}

impl E2bState {
    /// Once, at the first E2B request after a start: a record for each sandbox the session
    /// layer took back from an earlier run (a session the E2B API made, with its own
    /// workspace), and its contexts (E2B sessions working in that workspace), each watched
    /// as a created one is.
    pub fn recover(self: &Arc<Self>, registry: &Registry) {
        if self
            .recovered
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let all = registry.all();
        let e2b = |s: &Session| s.provenance.front_door == crate::session::FrontDoor::E2b;
        let mut recovered = 0;
        for sandbox in all
            .iter()
            .filter(|s| e2b(s) && s.own_workspace == Some(s.id))
        {
            if self.with(sandbox.id, |_| ()).is_some() {
                continue;
            }
            let context_sessions: Vec<_> = all
                .iter()
                .filter(|c| e2b(c) && c.id != sandbox.id && c.own_workspace == Some(sandbox.id))
                .collect();
            let contexts = context_sessions.iter().map(|c| c.id).collect();
            let default_contexts = context_sessions
                .iter()
                .filter_map(|c| {
                    let kernel = c.provenance.metadata.entries().get(DEFAULT_CONTEXT_KEY)?;
                    (*kernel == c.kernel_name).then(|| (kernel.clone(), c.id))
                })
                .collect();
            let metadata = sandbox
                .provenance
                .metadata
                .entries()
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect();
            self.insert(
                sandbox.id,
                SandboxMeta {
                    template: "code-interpreter-v1".into(),
                    metadata,
                    env: Vec::new(),
                    started_at: sandbox.created_at,
                    contexts,
                    context_cwds: HashMap::new(),
                    default_contexts,
                    commands: HashMap::new(),
                },
            );
            self.watch(registry.clone(), sandbox.clone());
            recovered += 1;
        }
        if recovered > 0 {
            tracing::info!(
                count = recovered,
                "E2B sandboxes taken back from an earlier run"
            );
        }
    }
}

impl SandboxMeta {
    pub fn contains_context(&self, id: Uuid) -> bool {
        self.contexts.contains(&id)
    }
}
