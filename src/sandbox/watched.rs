//! The watched-kernel handle both backends hand to the session layer.
//!
//! Every backend runs a kernel the same way: one task (the *watcher*: the local backend's
//! reaper, the docker backend's exec poller) owns the kernel's process, kills it when asked,
//! cleans up after it, and only then publishes why it ended. The handle the session holds
//! only asks and waits. That shared half lives here, written once:
//!
//! - [`KernelWatch`]: what a handle and its watcher share (who the kernel is for, the kill
//!   request, whether it was a requested termination, the published [`ExitReason`]);
//! - [`WatchedKernel`]: the [`KernelProcess`] implementation (wait, terminate, drop); a
//!   backend supplies only [`BackendKernel::interrupt`], the one thing that differs;
//! - [`KernelTable`]: the kernels a sandbox launched and has not reaped yet, so shutdown can
//!   end them all.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::cgroup::{read_counter, CpuClock};
use super::{ExitReason, KernelProcess, SandboxError};
use crate::sync::lock;

/// What a kernel's handle and its watcher share.
pub(crate) struct KernelWatch {
    pub session_id: Uuid,
    /// The broker user the kernel runs for.
    pub user: String,
    /// Set before a requested kill, so the end reads as [`ExitReason::Terminated`].
    terminating: AtomicBool,
    /// Tells the watcher to kill the kernel.
    kill: CancellationToken,
    /// Tells the watcher to let go of the kernel without ending it (`--keep-sessions`).
    release: CancellationToken,
    /// Set once by the watcher, after cleanup.
    exit: watch::Receiver<Option<ExitReason>>,
    /// The reason [`Self::wait`] gives if the watcher went away without publishing one.
    lost: &'static str,
}

/// The watcher's end of a [`KernelWatch`]: publishes why the kernel ended, once.
pub(crate) struct ExitPublisher {
    tx: watch::Sender<Option<ExitReason>>,
}

impl ExitPublisher {
    /// Publishes `reason` to every waiter (call it after the cleanup: once `wait` returns,
    /// nothing of the kernel is left).
    pub fn publish(self, reason: ExitReason) {
        self.tx.send_replace(Some(reason));
    }
}

impl KernelWatch {
    /// A watch for a kernel of `user` in `session_id`; `lost` is the reason waiters get if
    /// the watcher itself goes away first (the runtime shutting down).
    pub fn new(session_id: Uuid, user: String, lost: &'static str) -> (Self, ExitPublisher) {
        let (tx, exit) = watch::channel(None);
        let watch = Self {
            session_id,
            user,
            terminating: AtomicBool::new(false),
            kill: CancellationToken::new(),
            release: CancellationToken::new(),
            exit,
            lost,
        };
        (watch, ExitPublisher { tx })
    }

    /// Resolves with the published reason; may be awaited by several tasks, and again.
    pub async fn wait(&self) -> ExitReason {
        let mut rx = self.exit.clone();
        let reason = match rx.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone(),
            Err(_) => None,
        };
        reason.unwrap_or_else(|| ExitReason::Lost(self.lost.to_string()))
    }

    /// Whether the watcher has published the end.
    pub fn has_exited(&self) -> bool {
        self.exit.borrow().is_some()
    }

    /// Asks the watcher to kill the kernel as a requested termination (its end then reads
    /// as [`ExitReason::Terminated`]).
    pub fn request_termination(&self) {
        self.terminating.store(true, Ordering::SeqCst);
        self.kill.cancel();
    }

    /// Asks the watcher to kill the kernel without calling it a termination (the handle
    /// dropped: a last resort).
    pub fn request_kill(&self) {
        self.kill.cancel();
    }

    /// Resolves once a kill was requested (for the watcher's `select!`).
    pub async fn kill_requested(&self) {
        self.kill.cancelled().await;
    }

    /// Asks the watcher to let go of the kernel: it stops watching and ends nothing, so
    /// the kernel outlives this broker (`--keep-sessions`). A kill requested afterwards
    /// (the handle's drop) is ignored.
    pub fn request_release(&self) {
        self.release.cancel();
    }

    /// Whether the kernel was let go of.
    pub fn released(&self) -> bool {
        self.release.is_cancelled()
    }

    /// Resolves once a release was requested (for the watcher's `select!`).
    pub async fn release_requested(&self) {
        self.release.cancelled().await;
    }

    /// Whether the end was requested by the broker.
    pub fn terminating(&self) -> bool {
        self.terminating.load(Ordering::SeqCst)
    }

    /// `reason`, unless the broker asked for the end: then [`ExitReason::Terminated`].
    pub fn reason_or_terminated(&self, reason: ExitReason) -> ExitReason {
        if self.terminating() {
            ExitReason::Terminated
        } else {
            reason
        }
    }
}

/// What a backend's kernel adds to the shared handle.
#[async_trait]
pub(crate) trait BackendKernel: Send + Sync + 'static {
    /// The watch its watcher publishes on.
    fn watch(&self) -> &KernelWatch;
    /// Delivers SIGINT to the kernel (and nothing else in its sandbox).
    async fn interrupt(&self) -> Result<(), SandboxError>;
    /// The file that counts the kernel's memory use (its cgroup leaf's), if it has one.
    fn memory_usage_file(&self) -> Option<PathBuf> {
        None
    }
    /// The kernel's memory use now (see [`KernelProcess::memory_used`]): none once it has
    /// ended (its leaf's counter then says nothing about it).
    fn memory_used(&self) -> Option<u64> {
        if self.watch().has_exited() {
            return None;
        }
        read_counter(&self.memory_usage_file()?)
    }
    /// What reads the CPU time of the kernel's leaf, if it has one.
    fn cpu_clock(&self) -> Option<CpuClock> {
        None
    }
    /// The kernel's CPU time (see [`KernelProcess::cpu_time_ns`]): none once it has ended.
    fn cpu_time_ns(&self) -> Option<u64> {
        if self.watch().has_exited() {
            return None;
        }
        self.cpu_clock()?.read_ns()
    }
    /// A host process in the kernel's network namespace (see [`KernelProcess::network_pid`]).
    async fn network_pid(&self) -> Option<i32> {
        None
    }
    /// Where the kernel can be forked (see [`KernelProcess::fork_origin`]).
    fn fork_origin(&self) -> Option<super::fork::ForkOrigin> {
        None
    }
    /// See [`KernelProcess::settle`].
    async fn settle(&self) {}
    /// What freezes the kernel's leaf (see [`KernelProcess::hold_as_checkpoint`]).
    fn freezer(&self) -> Option<&super::cgroup::Freezer> {
        None
    }
    /// See [`KernelProcess::continue_stopped`]: every process of its leaf.
    fn continue_stopped(&self) {
        if let Some(freezer) = self.freezer() {
            freezer.continue_all();
        }
    }
}

/// The handle the session layer holds, for any backend. Dropping it kills the kernel.
pub(crate) struct WatchedKernel<K: BackendKernel> {
    kernel: Arc<K>,
    /// How long `terminate` waits for the watcher to confirm the end.
    terminate_timeout: Duration,
}

impl<K: BackendKernel> WatchedKernel<K> {
    pub fn new(kernel: Arc<K>, terminate_timeout: Duration) -> Self {
        Self {
            kernel,
            terminate_timeout,
        }
    }
}

#[async_trait]
impl<K: BackendKernel> KernelProcess for WatchedKernel<K> {
    async fn interrupt(&self) -> Result<(), SandboxError> {
        self.kernel.interrupt().await
    }

    async fn wait(&self) -> ExitReason {
        self.kernel.watch().wait().await
    }

    fn memory_used(&self) -> Option<u64> {
        self.kernel.memory_used()
    }

    fn cpu_time_ns(&self) -> Option<u64> {
        self.kernel.cpu_time_ns()
    }

    fn release(&self) {
        self.kernel.watch().request_release();
    }

    fn kernel_id(&self) -> Option<uuid::Uuid> {
        Some(self.kernel.watch().session_id)
    }

    fn fork_origin(&self) -> Option<super::fork::ForkOrigin> {
        if self.kernel.watch().has_exited() {
            return None;
        }
        self.kernel.fork_origin()
    }
    async fn network_pid(&self) -> Option<i32> {
        self.kernel.network_pid().await
    }

    fn hold_as_checkpoint(&self, hold: bool) -> Result<(), SandboxError> {
        let freezer = self.kernel.freezer().ok_or(SandboxError::Unsupported(
            "this kernel has no cgroup leaf to freeze",
        ))?;
        if hold {
            freezer.set_oom_score_adj(1000)?;
        }
        freezer.set(hold)
    }

    fn can_hold_as_checkpoint(&self) -> bool {
        self.kernel.freezer().is_some()
    }

    fn continue_stopped(&self) {
        if !self.kernel.watch().has_exited() {
            self.kernel.continue_stopped();
        }
    }

    async fn settle(&self) {
        self.kernel.settle().await
    }

    fn set_live_oom_score(&self) -> Result<(), SandboxError> {
        match self.kernel.freezer() {
            Some(freezer) => freezer.set_oom_score_adj(super::KERNEL_OOM_SCORE_ADJ as i32),
            None => Ok(()),
        }
    }

    async fn terminate(&self) {
        let watch = self.kernel.watch();
        if watch.has_exited() {
            return;
        }
        watch.request_termination();
        if timeout(self.terminate_timeout, watch.wait()).await.is_err() {
            tracing::error!(
                session = %watch.session_id,
                user = %watch.user,
                "the kernel was not confirmed gone within {:?} of being killed",
                self.terminate_timeout
            );
        }
    }
}

impl<K: BackendKernel> Drop for WatchedKernel<K> {
    fn drop(&mut self) {
        // Last resort: the watcher kills and cleans up; a no-op if the kernel has ended,
        // and nothing at all once the kernel was released to outlive the broker.
        if !self.kernel.watch().released() {
            self.kernel.watch().request_kill();
        }
    }
}

/// The kernels a sandbox launched and has not reaped yet, by session. A cheap handle: the
/// sandbox and every watcher (which removes its kernel at the end) hold one.
pub(crate) struct KernelTable<K> {
    // Every critical section is a single insert, remove, lookup or clone.
    kernels: Arc<Mutex<HashMap<Uuid, Arc<K>>>>,
}

impl<K> Clone for KernelTable<K> {
    fn clone(&self) -> Self {
        Self {
            kernels: self.kernels.clone(),
        }
    }
}

impl<K> Default for KernelTable<K> {
    fn default() -> Self {
        Self {
            kernels: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

impl<K: BackendKernel> KernelTable<K> {
    pub fn contains(&self, session: &Uuid) -> bool {
        lock(&self.kernels).contains_key(session)
    }

    pub fn insert(&self, session: Uuid, kernel: Arc<K>) {
        lock(&self.kernels).insert(session, kernel);
    }

    /// The kernel launched for `session`, if it is still in the table.
    pub fn get(&self, session: &Uuid) -> Option<Arc<K>> {
        lock(&self.kernels).get(session).cloned()
    }

    pub fn remove(&self, session: &Uuid) {
        lock(&self.kernels).remove(session);
    }

    /// Whether a kernel in the table matches `pred`.
    pub fn any(&self, pred: impl Fn(&K) -> bool) -> bool {
        lock(&self.kernels).values().any(|k| pred(k))
    }

    /// Whether a kernel of `user` is still in the table.
    pub fn has_user(&self, user: &str) -> bool {
        lock(&self.kernels).values().any(|k| k.watch().user == user)
    }

    /// Asks every kernel's watcher for a termination; returns them, to wait for with
    /// [`Self::wait_all`] (a backend may do its own work between the two).
    pub fn terminate_all(&self) -> Vec<Arc<K>> {
        let kernels: Vec<Arc<K>> = lock(&self.kernels).values().cloned().collect();
        if !kernels.is_empty() {
            tracing::info!(count = kernels.len(), "terminating kernels");
        }
        for kernel in &kernels {
            kernel.watch().request_termination();
        }
        kernels
    }

    /// Lets go of every kernel (`--keep-sessions` shutdown): their watchers stop and end
    /// nothing. Returns how many there were.
    pub fn release_all(&self) -> usize {
        let kernels: Vec<Arc<K>> = lock(&self.kernels).drain().map(|(_, k)| k).collect();
        for kernel in &kernels {
            kernel.watch().request_release();
        }
        kernels.len()
    }

    /// Waits, each for at most `limit`, until `kernels` have ended.
    pub async fn wait_all(kernels: &[Arc<K>], limit: Duration) {
        let waits = kernels.iter().map(|k| async move {
            let watch = k.watch();
            if timeout(limit, watch.wait()).await.is_err() {
                tracing::error!(session = %watch.session_id, "kernel did not go away on shutdown");
            }
        });
        futures::future::join_all(waits).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend whose watcher is the test itself.
    struct Fake {
        watch: KernelWatch,
        interrupts: Mutex<u32>,
    }

    #[async_trait]
    impl BackendKernel for Fake {
        fn watch(&self) -> &KernelWatch {
            &self.watch
        }
        async fn interrupt(&self) -> Result<(), SandboxError> {
            *lock(&self.interrupts) += 1;
            Ok(())
        }
    }

    fn fake() -> (Arc<Fake>, ExitPublisher) {
        let (watch, publisher) = KernelWatch::new(Uuid::nil(), "alice".into(), "lost");
        let fake = Arc::new(Fake {
            watch,
            interrupts: Mutex::new(0),
        });
        (fake, publisher)
    }

    /// A watcher that, when asked to kill, publishes what a backend would.
    fn spawn_watcher(fake: Arc<Fake>, publisher: ExitPublisher) {
        tokio::spawn(async move {
            fake.watch.kill_requested().await;
            let reason = fake.watch.reason_or_terminated(ExitReason::Signaled(9));
            publisher.publish(reason);
        });
    }

    #[tokio::test]
    async fn terminate_reads_as_terminated_for_every_waiter_and_again() {
        let (fake, publisher) = fake();
        spawn_watcher(fake.clone(), publisher);
        let handle = WatchedKernel::new(fake.clone(), Duration::from_secs(5));
        let other = fake.clone();
        let waiter = tokio::spawn(async move { other.watch.wait().await });
        handle.terminate().await;
        assert_eq!(handle.wait().await, ExitReason::Terminated);
        assert_eq!(waiter.await.unwrap(), ExitReason::Terminated);
        assert_eq!(handle.wait().await, ExitReason::Terminated);
        // Idempotent: a second terminate returns at once.
        handle.terminate().await;
    }

    #[tokio::test]
    async fn dropping_the_handle_kills_without_calling_it_a_termination() {
        let (fake, publisher) = fake();
        spawn_watcher(fake.clone(), publisher);
        drop(WatchedKernel::new(fake.clone(), Duration::from_secs(5)));
        assert_eq!(fake.watch.wait().await, ExitReason::Signaled(9));
    }

    #[tokio::test]
    async fn an_end_by_itself_is_reported_as_it_was() {
        let (fake, publisher) = fake();
        let handle = WatchedKernel::new(fake.clone(), Duration::from_secs(5));
        publisher.publish(ExitReason::Exited(3));
        assert_eq!(handle.wait().await, ExitReason::Exited(3));
        handle.terminate().await;
        assert_eq!(handle.wait().await, ExitReason::Exited(3));
        handle.interrupt().await.unwrap();
        assert_eq!(*lock(&fake.interrupts), 1);
    }

    #[tokio::test]
    async fn a_released_kernel_is_not_killed_by_the_drop_of_its_handle() {
        let (fake, _publisher) = fake();
        let table = KernelTable::default();
        table.insert(Uuid::nil(), fake.clone());
        let handle = WatchedKernel::new(fake.clone(), Duration::from_secs(5));
        assert_eq!(table.release_all(), 1);
        assert!(fake.watch.released());
        assert!(!table.contains(&Uuid::nil()));
        drop(handle);
        assert!(!fake.watch.kill.is_cancelled());
    }

    #[tokio::test]
    async fn a_watcher_that_goes_away_reads_as_lost() {
        let (fake, publisher) = fake();
        drop(publisher);
        assert_eq!(fake.watch.wait().await, ExitReason::Lost("lost".into()));
    }

    #[tokio::test(start_paused = true)]
    async fn terminate_gives_up_after_its_timeout() {
        let (fake, _publisher) = fake();
        let handle = WatchedKernel::new(fake.clone(), Duration::from_secs(15));
        handle.terminate().await;
        assert!(fake.watch.terminating());
        assert!(!fake.watch.has_exited());
    }

    #[tokio::test]
    async fn the_table_terminates_every_kernel() {
        let table = KernelTable::default();
        let (a, pa) = fake();
        spawn_watcher(a.clone(), pa);
        table.insert(Uuid::nil(), a.clone());
        assert!(table.contains(&Uuid::nil()));
        assert!(table.has_user("alice"));
        assert!(!table.has_user("bob"));
        let all = table.terminate_all();
        KernelTable::wait_all(&all, Duration::from_secs(5)).await;
        assert_eq!(a.watch.wait().await, ExitReason::Terminated);
        table.remove(&Uuid::nil());
        assert!(!table.contains(&Uuid::nil()));
    }
}
