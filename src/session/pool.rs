//! The warm pool: kernels started ahead of demand, so that creating a session (or restarting
//! one) takes a ready kernel instead of waiting a second or more for Python to start.
//!
//! Pooled kernels are launched *for a user*: in that user's sandbox, under that user's
//! uid, cgroup limits and workspace, exactly as a cold start would. So isolation and quotas
//! hold from the moment of hand-over (before it, in fact), and a kernel never changes hands:
//! it is given to one session and never returned. The pool is filled lazily, for a user and
//! kernel spec once that user has created a session, refilled in the background after every
//! take, and a user's pooled kernels are shut down after `idle` without a take, so a user
//! who stopped working holds nothing.
//!
//! Memory: a pooled kernel has the user's default session limits and holds its own
//! [`Reservation`] of the user's memory from before its launch until it is gone or handed
//! over (then the reservation becomes the session's). The pool only reserves what is free,
//! so it never takes room a session needs: when a create does not fit, the registry
//! [`Pool::evict`]s the user's pooled kernels first. A session that asks for other limits
//! than the default gets a kernel of its own, never a pooled one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::config::PoolConfig;
use super::error::SessionError;
use super::launch::{start_kernel, Live};
use super::memory::{Holder, Ledger, Reservation};
use crate::kernel::ConnectOptions;
use crate::sandbox::{KernelLimits, LaunchSpec, Sandbox, SandboxUser};
use crate::wire::Signer;

struct Pooled {
    id: Uuid,
    live: Live,
    memory: Reservation,
}

#[derive(Default)]
struct Slot {
    ready: Vec<Pooled>,
    launching: usize,
    last_take: Option<Instant>,
    /// Cancels the launches in flight (an eviction).
    cancel: CancellationToken,
}

type Key = (String, String);

pub(crate) struct Pool {
    config: PoolConfig,
    sandbox: Arc<dyn Sandbox>,
    kernel: ConnectOptions,
    ledger: Arc<Ledger>,
    slots: Mutex<HashMap<Key, Slot>>,
    shutdown: CancellationToken,
}

/// A kernel taken from the pool: its id, the connected kernel, and its memory reservation.
pub(crate) type Taken = (Uuid, Live, Reservation);

impl Pool {
    pub fn new(
        config: PoolConfig,
        sandbox: Arc<dyn Sandbox>,
        kernel: ConnectOptions,
        ledger: Arc<Ledger>,
    ) -> Arc<Self> {
        let any = config.size > 0;
        let pool = Arc::new(Self {
            config,
            sandbox,
            kernel,
            ledger,
            slots: Mutex::new(HashMap::new()),
            shutdown: CancellationToken::new(),
        });
        if any {
            tokio::spawn(pool.clone().idle_task());
        }
        pool
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<Key, Slot>> {
        crate::sync::lock(&self.slots)
    }

    /// A ready kernel for `user` running `kernel`, if the pool has one. Starts a refill.
    pub fn take(self: &Arc<Self>, user: &SandboxUser, kernel: &str) -> Option<Taken> {
        if self.config.size_for(kernel) == 0 || self.shutdown.is_cancelled() {
            return None;
        }
        let key = (user.name.clone(), kernel.to_string());
        let mut dead = Vec::new();
        let taken = {
            let mut slots = self.slots();
            let slot = slots.entry(key).or_default();
            slot.last_take = Some(Instant::now());
            let mut taken = None;
            while let Some(mut p) = slot.ready.pop() {
                // A kernel that died while waiting is not handed out.
                if p.live.exited() {
                    dead.push(p);
                    continue;
                }
                taken = Some((p.id, p.live, p.memory));
                break;
            }
            taken
        };
        for p in dead {
            tokio::spawn(async move { p.live.process.terminate().await });
        }
        self.refill(user, kernel);
        taken
    }

    /// Launch kernels in the background until the pool holds `size` for this user.
    pub fn refill(self: &Arc<Self>, user: &SandboxUser, kernel: &str) {
        let size = self.config.size_for(kernel);
        if size == 0 || self.shutdown.is_cancelled() {
            return;
        }
        let key = (user.name.clone(), kernel.to_string());
        let limits = user.limits.kernel(None);
        let (reserved, cancel) = {
            let mut slots = self.slots();
            let slot = slots.entry(key.clone()).or_default();
            slot.last_take.get_or_insert_with(Instant::now);
            let missing = size.saturating_sub(slot.ready.len() + slot.launching);
            // Only room no one holds: a pooled kernel never pushes a session out.
            let reserved: Vec<Reservation> = (0..missing)
                .map_while(|_| {
                    self.ledger
                        .reserve(
                            &user.name,
                            user.limits.memory_bytes,
                            limits.memory_bytes,
                            Holder::Pooled,
                        )
                        .ok()
                })
                .collect();
            slot.launching += reserved.len();
            (reserved, slot.cancel.clone())
        };
        for memory in reserved {
            let pool = self.clone();
            let user = user.clone();
            let key = key.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                let id = Uuid::new_v4();
                let spec = LaunchSpec {
                    session_id: id,
                    user: user.clone(),
                    kernel_name: key.1.clone(),
                    key: Signer::random_key(),
                    env: Vec::new(),
                    limits,
                    own_workspace: None,
                };
                let started = tokio::select! {
                    r = start_kernel(&pool.sandbox, spec, pool.kernel) => Some(r),
                    _ = pool.shutdown.cancelled() => None,
                    _ = cancel.cancelled() => None,
                };
                let Some(started) = started else {
                    // Dropping the launch killed its kernel; the reservation goes with it.
                    pool.launch_ended(&key);
                    return;
                };
                let leftover = {
                    let mut slots = pool.slots();
                    let slot = slots.entry(key).or_default();
                    slot.launching = slot.launching.saturating_sub(1);
                    match started {
                        Ok(live) if !pool.shutdown.is_cancelled() && !cancel.is_cancelled() => {
                            slot.ready.push(Pooled { id, live, memory });
                            None
                        }
                        Ok(live) => Some((live, memory)),
                        Err(e) => {
                            tracing::warn!(user = %user.name, error = %e, "warm pool: could not start a kernel");
                            None
                        }
                    }
                };
                if let Some((live, memory)) = leftover {
                    live.process.terminate().await;
                    drop(memory);
                }
            });
        }
    }

    fn launch_ended(&self, key: &Key) {
        if let Some(slot) = self.slots().get_mut(key) {
            slot.launching = slot.launching.saturating_sub(1);
        }
    }

    /// Shuts down `user`'s pooled kernels (ready and launching) to make room for a session,
    /// and returns once their memory is given back (or after a few seconds). Later refills
    /// reserve anew, only what is free then.
    pub async fn evict(&self, user: &str) {
        let evicted: Vec<Pooled> = {
            let mut slots = self.slots();
            let mut evicted = Vec::new();
            for ((name, _), slot) in slots.iter_mut() {
                if name == user {
                    evicted.append(&mut slot.ready);
                    slot.cancel.cancel();
                    slot.cancel = CancellationToken::new();
                }
            }
            evicted
        };
        let n = evicted.len();
        futures::future::join_all(evicted.into_iter().map(|p| async move {
            p.live.process.terminate().await;
            drop(p.memory);
        }))
        .await;
        // Launches in flight give their reservation back as they stop.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.ledger.usage(user).pooled > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::debug!(user, evicted = n, "warm pool: made room for a session");
    }

    /// Reserves the memory of a session of `user` with `limits` (a new one, or a paused
    /// one resuming): from what is free, else after evicting the user's pooled kernels;
    /// refused when the sessions' limits would pass the user's total.
    pub(crate) async fn admit(
        &self,
        user: &SandboxUser,
        limits: &KernelLimits,
    ) -> Result<Reservation, SessionError> {
        let reserve = || {
            self.ledger.reserve(
                &user.name,
                user.limits.memory_bytes,
                limits.memory_bytes,
                Holder::Session,
            )
        };
        let used = match reserve() {
            Ok(r) => return Ok(r),
            Err(used) => used,
        };
        if used.pooled > 0 && used.session_bytes + limits.memory_bytes <= user.limits.memory_bytes {
            self.evict(&user.name).await;
            if let Ok(r) = reserve() {
                return Ok(r);
            }
        }
        let used = self.ledger.usage(&user.name);
        Err(SessionError::NoMemoryLeft {
            user: user.name.clone(),
            sessions: used.sessions,
            used: used.session_bytes,
            total: user.limits.memory_bytes,
            pooled: used.pooled_bytes,
            asked: limits.memory_bytes,
        })
    }

    /// Kernels ready now (for metrics).
    pub fn ready(&self) -> usize {
        self.slots().values().map(|s| s.ready.len()).sum()
    }

    /// Shut down the pooled kernels of users who have not taken one for `idle`.
    async fn idle_task(self: Arc<Self>) {
        let period = (self.config.idle / 4).max(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = self.shutdown.cancelled() => return,
            }
            let stale: Vec<Pooled> = {
                let mut slots = self.slots();
                let mut stale = Vec::new();
                for slot in slots.values_mut() {
                    if slot
                        .last_take
                        .is_some_and(|t| t.elapsed() >= self.config.idle)
                    {
                        stale.append(&mut slot.ready);
                    }
                }
                slots.retain(|_, s| {
                    !s.ready.is_empty()
                        || s.launching > 0
                        || s.last_take.is_some_and(|t| t.elapsed() < self.config.idle)
                });
                stale
            };
            for p in stale {
                tracing::debug!(kernel = %p.id, "warm pool: shutting down an unused kernel");
                p.live.process.terminate().await;
            }
        }
    }

    /// Shut every pooled kernel down; the pool takes no more.
    pub async fn drain(&self) {
        self.shutdown.cancel();
        let all: Vec<Pooled> = self.slots().drain().flat_map(|(_, s)| s.ready).collect();
        futures::future::join_all(
            all.into_iter()
                .map(|p| async move { p.live.process.terminate().await }),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::ExitReason;
    use crate::session::testing::fake_sandbox::user;
    use crate::session::testing::{config as test_config, FakeSandbox};

    fn pool(size: usize, idle: Duration) -> (Arc<Pool>, Arc<FakeSandbox>) {
        let sandbox = FakeSandbox::new();
        let dyn_sandbox: Arc<dyn Sandbox> = sandbox.clone();
        let config = PoolConfig {
            size,
            idle,
            per_kernel: Default::default(),
        };
        (
            Pool::new(config, dyn_sandbox, test_config().kernel, Ledger::new()),
            sandbox,
        )
    }

    /// Wait (in paused time, so at no cost) until the pool holds `n` ready kernels.
    async fn until_ready(pool: &Pool, n: usize) {
        tokio::time::timeout(Duration::from_secs(600), async {
            while pool.ready() != n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the pool never got there");
    }

    #[tokio::test(start_paused = true)]
    async fn a_take_hands_out_a_kernel_launched_for_that_user_and_refills() {
        let (pool, sandbox) = pool(1, Duration::from_secs(600));
        let alice = user("alice");
        assert!(
            pool.take(&alice, "script").is_none(),
            "the pool starts empty"
        );
        until_ready(&pool, 1).await;
        assert_eq!(sandbox.kernel(0).user, "alice");

        let (_, mut live, _) = pool.take(&alice, "script").expect("a ready kernel");
        assert!(!live.exited());
        assert_eq!(pool.ready(), 0);
        until_ready(&pool, 1).await;
        assert_eq!(sandbox.launched().len(), 2, "one refill after the take");

        // Alice's kernels are never handed to anybody else.
        assert!(pool.take(&user("bob"), "script").is_none());
        until_ready(&pool, 2).await;
        assert_eq!(sandbox.kernel(2).user, "bob");
        drop(live);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pooled_kernel_that_died_is_not_handed_out() {
        let (pool, sandbox) = pool(1, Duration::from_secs(600));
        let alice = user("alice");
        pool.refill(&alice, "script");
        until_ready(&pool, 1).await;
        sandbox.kernel(0).exit(ExitReason::Exited(1));
        // Let the process watcher see it.
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(pool.take(&alice, "script").is_none());
        until_ready(&pool, 1).await;
        assert!(pool.take(&alice, "script").is_some(), "the replacement is");
        until_ready(&pool, 1).await;
        assert_eq!(
            sandbox.launched().len(),
            3,
            "the replacement, then the refill"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn unused_kernels_are_shut_down_after_idle() {
        let (pool, sandbox) = pool(1, Duration::from_secs(60));
        pool.refill(&user("alice"), "script");
        until_ready(&pool, 1).await;
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(pool.ready(), 1, "not yet");
        assert!(!sandbox.kernel(0).terminated());
        tokio::time::sleep(Duration::from_secs(50)).await;
        assert_eq!(pool.ready(), 0);
        assert!(sandbox.kernel(0).terminated());
    }

    #[tokio::test(start_paused = true)]
    async fn size_zero_disables_the_pool() {
        let (pool, sandbox) = pool(0, Duration::from_secs(60));
        assert!(pool.take(&user("alice"), "script").is_none());
        pool.refill(&user("alice"), "script");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(sandbox.launched().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn drain_shuts_pooled_kernels_down_and_takes_no_more() {
        let (pool, sandbox) = pool(1, Duration::from_secs(600));
        let alice = user("alice");
        pool.refill(&alice, "script");
        until_ready(&pool, 1).await;
        pool.drain().await;
        assert!(sandbox.kernel(0).terminated());
        assert_eq!(pool.ready(), 0);
        assert!(pool.take(&alice, "script").is_none());
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(sandbox.launched().len(), 1, "no refill after drain");
    }
}
