//! Settings of the session layer ([`SessionConfig`]), of its warm pool
//! ([`PoolConfig`]) and of one session ([`WorkspaceChoice`]), in one place so the
//! configuration file maps onto them.

use std::time::Duration;

/// Settings of the session layer.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub idle_timeout: Duration,
    pub max_idle_timeout: Duration,
    pub max_busy: Duration,
    pub execution_timeout: Duration,
    pub max_execution_timeout: Duration,
    pub interrupt_grace: Duration,
    pub output_limit: usize,
    pub result_limit: usize,
    pub max_queue: usize,
    /// Heartbeat and message limits of the broker's kernel connections.
    pub kernel: crate::kernel::ConnectOptions,
    /// How long an expired session still answers 410 before it is forgotten (404).
    pub tombstone_ttl: Duration,
    pub pool: PoolConfig,
    /// `--keep-sessions`: where each session's record is kept (`<data dir>/sessions`), so
    /// the next run adopts it; `None`: sessions end with the broker.
    pub keep_dir: Option<std::path::PathBuf>,
    /// Where paused sessions' records are kept (`<data dir>/paused-sessions`), so that a
    /// paused session outlives the broker (issue 37); `None`: paused state ends with it.
    pub paused_dir: Option<std::path::PathBuf>,
    /// Where snapshots' records are kept (`<data dir>/snapshot-records`), so that a
    /// snapshot outlives the broker; `None`: snapshots end with it.
    pub snapshots_dir: Option<std::path::PathBuf>,
    /// Kernel specs whose kernels cannot be copied (forks, checkpoints, pause, snapshots
    /// are ipykernel's: the in-kernel fork), by name: R, Deno, bash, Java, SQL.
    pub not_copyable: std::sync::Arc<std::collections::BTreeSet<String>>,
    /// The broker's credentials, masked in every session's output besides its own secrets,
    /// and every live session's secrets (issue 39).
    pub secret_book: std::sync::Arc<crate::secrets::SecretBook>,
    /// Seals kept records' secrets (`None`: records are not kept).
    pub sealer: Option<crate::secrets::seal::Sealer>,
    /// The operator's pre-execution policy (issue 39; empty: none).
    pub policy: std::sync::Arc<crate::policy::Policy>,
    /// Each kernel spec's language, by name (what the policy checks: Python's code only).
    pub languages: std::sync::Arc<std::collections::BTreeMap<String, String>>,
    /// Cluster mode with `--carry-paused`: who carries paused sessions to the other nodes
    /// (set once the cluster is joined; empty: paused state stays on this node).
    pub carrier: super::carry::CarrierSlot,
}

impl SessionConfig {
    /// Why a kernel of `kernel` cannot be copied, if it cannot.
    pub fn copy_refusal(&self, kernel: &str) -> Option<String> {
        self.not_copyable.contains(kernel).then(|| {
            format!(
                "its kernel is {kernel:?}: forks, checkpoints, pause and snapshots copy a \
                 Python (ipykernel) kernel's process from inside it, and only Python \
                 kernels can do that"
            )
        })
    }
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(600),
            max_idle_timeout: Duration::from_secs(86_400),
            max_busy: Duration::from_secs(3600),
            execution_timeout: Duration::from_secs(60),
            max_execution_timeout: Duration::from_secs(600),
            interrupt_grace: Duration::from_secs(5),
            output_limit: 10_000,
            result_limit: 16 << 20,
            max_queue: 64,
            kernel: Default::default(),
            tombstone_ttl: Duration::from_secs(86_400),
            pool: PoolConfig::default(),
            keep_dir: None,
            paused_dir: None,
            snapshots_dir: None,
            not_copyable: Default::default(),
            secret_book: Default::default(),
            sealer: None,
            policy: Default::default(),
            languages: Default::default(),
            carrier: Default::default(),
        }
    }
}

/// Pool settings.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Ready kernels kept per user and kernel spec; 0 disables the pool.
    pub size: usize,
    /// A user's pooled kernels are shut down after this long without a take.
    pub idle: Duration,
    /// Kernel specs that keep fewer ready kernels than `size` (their spec's
    /// `metadata.kernel_broker.pool_size`: 0 for Java, whose idle JVM holds the user's
    /// memory), by name.
    pub per_kernel: std::sync::Arc<std::collections::BTreeMap<String, usize>>,
}

impl PoolConfig {
    /// Ready kernels kept per user of `kernel`.
    pub fn size_for(&self, kernel: &str) -> usize {
        self.per_kernel
            .get(kernel)
            .map_or(self.size, |n| (*n).min(self.size))
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            size: 1,
            idle: Duration::from_secs(600),
            per_kernel: Default::default(),
        }
    }
}

/// Which workspace a new session's kernels work in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WorkspaceChoice {
    /// The user's workspace, shared by all her sessions and kept after them (`/workspace`).
    #[default]
    Shared,
    /// One of its own (E2B's sandbox shape: `/home/user`, also at `/workspace`, and a
    /// `/tmp` of its own), made empty with the session and removed when it ends.
    Own,
    /// The own workspace of the live session `of` (an E2B sandbox's contexts work in their
    /// sandbox's); removed when the last session working in it ends.
    OwnOf(uuid::Uuid),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kernels_listed_as_not_copyable_are_refused() {
        let config = SessionConfig {
            not_copyable: std::sync::Arc::new(["r".to_string()].into()),
            ..SessionConfig::default()
        };
        assert!(config.copy_refusal("python3").is_none());
        let why = config.copy_refusal("r").unwrap();
        assert!(why.contains("\"r\"") && why.contains("Python"), "{why}");
    }

    #[test]
    fn a_spec_keeps_at_most_its_own_pool_size() {
        let config = PoolConfig {
            size: 2,
            idle: Duration::from_secs(60),
            per_kernel: std::sync::Arc::new([("java".to_string(), 0), ("r".to_string(), 5)].into()),
        };
        assert_eq!(config.size_for("java"), 0);
        assert_eq!(config.size_for("python3"), 2);
        // Never more than the broker's own size (`--pool-size 0` turns every pool off).
        assert_eq!(config.size_for("r"), 2);
    }
}
