//! Checkpoints of a session (issue 36): what they are to the rest of the broker, and the
//! book that bounds them per user.
//!
//! A checkpoint is a copy of a session's kernel made by forking it. Where the sandbox keeps
//! *held* checkpoints (the local sandbox, `sandbox/held.rs`) the copy is the live kernel's
//! child, held on a control socket of the broker's: the live kernel goes on untouched and
//! moves to a new cgroup leaf, the checkpoint keeping the old one, so each page the live
//! kernel rewrites leaves its old copy charged to the checkpoint, never to the live kernel's
//! leaf; a rewind has the checkpoint fork a kernel that becomes the live one. Elsewhere
//! (Docker, and copies into sandboxes of their own) the copy that is *frozen* is the parent,
//! the kernel that was live, which keeps its leaf for the same reason: the child becomes the
//! session's live kernel (the session, its id, recording and execution count stay); the
//! parent keeps its leaf, its charges and its sockets and is frozen, and a rewind forks it
//! again. Either way a checkpoint gets `oom_score_adj` 1000, so that if its user's memory
//! runs out the OOM killer takes a checkpoint before any live kernel, and it stays for the
//! next rewind.
//!
//! Memory: a checkpoint reserves nothing from its user's memory total up front (the
//! session's reservation covers its live kernel only); what its leaf is charged (its
//! kernel's pages, less whatever it shares with nothing) counts against the user's
//! checkpoint memory budget, and the user's cgroup (above both leaves) is the backstop,
//! where the OOM killer prefers checkpoints. Over the count or the budget the user's oldest
//! checkpoints are dropped (never the one just taken).
//!
//! Checkpoints end with their session (delete, expiry, broker shutdown) and are never kept
//! or adopted across broker restarts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::sandbox::KernelProcess;
use crate::sync::lock;

/// A user's bounds on checkpoints, and whether a session takes one after every successful
/// execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointPolicy {
    /// The most checkpoints the user holds at once, over all sessions.
    pub max_count: usize,
    /// The most memory their leaves may be charged, together, in bytes.
    pub memory_budget_bytes: u64,
    /// Take a checkpoint after every execution that ends with status ok.
    pub every_execution: bool,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        Self {
            max_count: 32,
            memory_budget_bytes: 2 << 30,
            every_execution: false,
        }
    }
}

/// One checkpoint, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub id: Uuid,
    pub session: Uuid,
    /// The session's execution count when it was taken (a rewind goes back to it).
    pub execution_count: u64,
    pub created_at: DateTime<Utc>,
    /// What its cgroup leaf is charged now; `None` when the sandbox cannot tell.
    pub memory_bytes: Option<u64>,
}

/// A checkpoint that is gone before its session, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedCheckpoint {
    pub id: Uuid,
    pub execution_count: u64,
    pub dropped_at: DateTime<Utc>,
    pub why: String,
}

/// A session's checkpoints, and those it lost.
#[derive(Debug, Clone, Default)]
pub struct CheckpointList {
    pub checkpoints: Vec<CheckpointInfo>,
    pub dropped: Vec<DroppedCheckpoint>,
    /// Whether this session takes one after every successful execution (its own mode,
    /// which may differ from its user's default).
    pub every_execution: bool,
}

/// What a user's checkpoints hold together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointUse {
    pub count: usize,
    pub memory_bytes: u64,
}

/// What ends a checkpoint of a session, asked from elsewhere (another session's bound):
/// `(checkpoint, why)`. It only asks the session's actor, never waits.
pub(super) type Dropper = Arc<dyn Fn(Uuid, String) + Send + Sync>;

/// A checkpoint to drop for a bound: whose, which, why.
pub(super) struct Victim {
    pub session: Uuid,
    pub dropper: Dropper,
    pub id: Uuid,
    pub why: String,
}

struct Entry {
    id: Uuid,
    session: Uuid,
    dropper: Dropper,
    process: Arc<dyn KernelProcess>,
}

/// Every user's checkpoints, oldest first, so bounds can be kept per user across
/// sessions. Critical sections are a push, a removal or a clone.
#[derive(Default)]
pub(crate) struct CheckpointBook {
    users: Mutex<HashMap<String, Vec<Entry>>>,
}

impl CheckpointBook {
    pub(super) fn add(
        &self,
        (user, session): (&str, Uuid),
        id: Uuid,
        process: Arc<dyn KernelProcess>,
        dropper: Dropper,
    ) {
        lock(&self.users)
            .entry(user.to_string())
            .or_default()
            .push(Entry {
                id,
                session,
                dropper,
                process,
            });
    }

    pub(super) fn remove(&self, user: &str, id: Uuid) {
        let mut users = lock(&self.users);
        if let Some(list) = users.get_mut(user) {
            list.retain(|e| e.id != id);
            if list.is_empty() {
                users.remove(user);
            }
        }
    }

    /// What `user`'s checkpoints hold now (memory read from their leaves, outside the lock).
    pub fn usage(&self, user: &str) -> CheckpointUse {
        let processes: Vec<Arc<dyn KernelProcess>> = lock(&self.users)
            .get(user)
            .map(|l| l.iter().map(|e| e.process.clone()).collect())
            .unwrap_or_default();
        CheckpointUse {
            count: processes.len(),
            memory_bytes: processes.iter().filter_map(|p| p.memory_used()).sum(),
        }
    }

    /// The oldest checkpoints of `user` to drop so that the rest fit `policy` (never
    /// `keep`, the one just taken); taken out of the book.
    pub(super) fn over_budget(
        &self,
        user: &str,
        policy: &CheckpointPolicy,
        keep: Uuid,
    ) -> Vec<Victim> {
        type Listed = (Uuid, Uuid, Dropper, Arc<dyn KernelProcess>);
        let entries: Vec<Listed> = lock(&self.users)
            .get(user)
            .map(|l| {
                l.iter()
                    .map(|e| (e.id, e.session, e.dropper.clone(), e.process.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let mut memory: Vec<u64> = entries
            .iter()
            .map(|e| e.3.memory_used().unwrap_or(0))
            .collect();
        let (mut count, mut total) = (entries.len(), memory.iter().sum::<u64>());
        let mut victims = Vec::new();
        for (i, (id, session, dropper, _)) in entries.iter().enumerate() {
            if *id == keep {
                continue;
            }
            let why = if count > policy.max_count {
                format!(
                    "the oldest of {count} checkpoints, over the user's maximum of {}",
                    policy.max_count
                )
            } else if total > policy.memory_budget_bytes {
                format!(
                    "the oldest checkpoint while the user's checkpoints held {} of a {} budget",
                    super::memory::human_bytes(total),
                    super::memory::human_bytes(policy.memory_budget_bytes)
                )
            } else {
                break;
            };
            count -= 1;
            total -= std::mem::take(&mut memory[i]);
            victims.push(Victim {
                session: *session,
                dropper: dropper.clone(),
                id: *id,
                why,
            });
        }
        for v in &victims {
            self.remove(user, v.id);
        }
        victims
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::{ExitReason, SandboxError};

    /// A checkpoint's kernel that only reports its memory.
    struct Charged(u64);

    #[async_trait::async_trait]
    impl KernelProcess for Charged {
        async fn interrupt(&self) -> Result<(), SandboxError> {
            Ok(())
        }
        async fn wait(&self) -> ExitReason {
            ExitReason::Terminated
        }
        async fn terminate(&self) {}
        fn memory_used(&self) -> Option<u64> {
            Some(self.0)
        }
    }

    /// Checkpoints of `user` with these charges, oldest first; their ids.
    fn book(user: &str, charges: &[u64]) -> (CheckpointBook, Vec<Uuid>) {
        let book = CheckpointBook::default();
        let session = Uuid::new_v4();
        let dropper: Dropper = Arc::new(|_, _| {});
        let ids: Vec<Uuid> = charges.iter().map(|_| Uuid::new_v4()).collect();
        for (id, bytes) in ids.iter().zip(charges) {
            book.add(
                (user, session),
                *id,
                Arc::new(Charged(*bytes)),
                dropper.clone(),
            );
        }
        (book, ids)
    }

    #[test]
    fn the_oldest_go_first_until_the_rest_fit_and_the_newest_stays() {
        let policy = |max_count, memory_budget_bytes| CheckpointPolicy {
            max_count,
            memory_budget_bytes,
            every_execution: false,
        };
        // (charges, max count, budget, how many of the oldest go, what the reason says)
        let cases: &[(&[u64], usize, u64, usize, &str)] = &[
            (&[10, 10, 10], 3, 100, 0, ""),
            (&[10, 10, 10], 2, 100, 1, "maximum of 2"),
            (&[10, 10, 10, 10], 1, 100, 3, "maximum of 1"),
            (&[50, 30, 30], 5, 70, 1, "budget"),
            (&[50, 30, 30], 5, 40, 2, "budget"),
            // The newest alone over the budget: it stays (its take is not undone).
            (&[10, 90], 5, 50, 1, "budget"),
            (&[90], 5, 50, 0, ""),
        ];
        for (charges, max, budget, gone, why) in cases {
            let (book, ids) = book("alice", charges);
            let newest = *ids.last().unwrap();
            let victims = book.over_budget("alice", &policy(*max, *budget), newest);
            let dropped: Vec<Uuid> = victims.iter().map(|v| v.id).collect();
            assert_eq!(dropped, ids[..*gone].to_vec(), "{charges:?} {max} {budget}");
            assert!(victims.iter().all(|v| v.why.contains(why)), "{charges:?}");
            // Taken out of the book: what is left fits.
            let left = book.usage("alice");
            assert_eq!(left.count, charges.len() - gone);
            assert_eq!(left.memory_bytes, charges[*gone..].iter().sum::<u64>());
            // Another user's book is not touched.
            assert_eq!(book.usage("bob"), CheckpointUse::default());
        }
    }
}
