//! The local sandbox's settings ([`LocalSandboxConfig`]) and the per-broker defaults
//! that keep two brokers on one host apart ([`instance_defaults`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::files::choose_run_base;
use crate::kernel::spec::KernelSpecs;
use crate::sandbox::fsutil::absolute;
use crate::sandbox::SandboxError;

/// Settings of the local sandbox.
#[derive(Debug, Clone)]
pub struct LocalSandboxConfig {
    /// The broker's state directory; workspaces live in `<data_dir>/workspaces`.
    pub data_dir: PathBuf,
    /// The repository's `kernels/` directory: kernel specs (`<name>/kernel.json`) and the venv.
    pub kernels_dir: PathBuf,
    /// The kernels' interpreter (default `<kernels_dir>/.venv/bin/python`).
    pub python: PathBuf,
    /// Kernels of user `index` run as host uid/gid `uid_base + index + 1` (root only).
    pub uid_base: u32,
    /// Refuse to run without cgroup limits (when false, only warn).
    pub require_limits: bool,
    /// How long a kernel may take to start before the launch fails (30 s; slow or
    /// emulated hosts need more).
    pub launch_timeout: std::time::Duration,
    /// More host paths to show read-only in the sandbox, at the same place.
    pub extra_ro_binds: Vec<PathBuf>,
    /// A CA bundle to show read-only at `egress::CA_FILE_INSIDE` (`--egress-ca-file`).
    pub ca_file: Option<PathBuf>,
    /// Where per-kernel runtime directories go. Default as root `/run/kernel-broker-<hash>`
    /// (`<hash>` of the data directory), so that the host path a kernel sees in its
    /// `/proc/self/mountinfo` for `/run/kernel` and `/etc/passwd` does not tell where the
    /// data directory (and other users' workspaces) is. Unprivileged: `<data_dir>/run`,
    /// unless socket paths there would be too long; then
    /// `$XDG_RUNTIME_DIR/kernel-broker-<hash>` or `/tmp/kernel-broker-<uid>-<hash>`.
    pub run_dir: Option<PathBuf>,
    /// The broker's directory in the cgroup hierarchies. Everything below it belongs to the
    /// broker and is swept on startup, so two brokers on one host need different names.
    pub cgroup_name: String,
    /// The kernel specs, when the caller has read them already; otherwise they are read
    /// from `kernels_dir`.
    pub kernel_specs: Option<Arc<KernelSpecs>>,
    /// `--keep-sessions`: kernels outlive the broker (no `--die-with-parent`) and are
    /// adopted by its next run (see [`crate::sandbox::Sandbox::keeps_kernels`]).
    pub keep_kernels: bool,
    /// Modules kernels import before their first cell ([`crate::sandbox::boot`]); empty: none.
    pub preload: Vec<String>,
    /// Users' own preload lists (the users file), by user name.
    pub user_preload: HashMap<String, Vec<String>>,
    /// Fork kernels from a per-user template that has imported `preload` (`template.rs`);
    /// off: every kernel starts plainly (importing nothing extra).
    pub fork_server: bool,
    /// How long a user's templates live on once the user has no session (and no kernel
    /// forked from them is left).
    pub template_idle: Duration,
    /// CRIU, for forks of sessions with a workspace of their own (`copy.rs`); `None`: the
    /// first CRIU 4 or later of `/usr/local/sbin`, `/usr/sbin`, `/usr/local/bin`.
    pub criu: Option<PathBuf>,
    /// Bytes of the data directory's file system a copy leaves free (`criu/room.rs`).
    pub copy_reserve_bytes: u64,
    /// What each line of the kernels' own stdout and stderr passes through before the log
    /// and a failed launch's message (the broker masks secrets and credentials with it).
    pub log_filter: Option<crate::sandbox::LogFilter>,
}

impl LocalSandboxConfig {
    /// The defaults for a data directory and a `kernels/` directory. Brokers on one host
    /// with different data directories get different cgroups and uid ranges by default
    /// (see [`instance_defaults`]), so none touches another's kernels.
    pub fn new(data_dir: impl Into<PathBuf>, kernels_dir: impl Into<PathBuf>) -> Self {
        let kernels_dir = kernels_dir.into();
        let data_dir = data_dir.into();
        let (cgroup_name, uid_base) = instance_defaults(&data_dir);
        Self {
            data_dir,
            python: kernels_dir.join(".venv/bin/python"),
            kernels_dir,
            uid_base,
            require_limits: true,
            launch_timeout: std::time::Duration::from_secs(30),
            extra_ro_binds: Vec::new(),
            ca_file: None,
            run_dir: None,
            cgroup_name,
            kernel_specs: None,
            keep_kernels: false,
            preload: crate::sandbox::boot::DEFAULT_PRELOAD
                .iter()
                .map(|m| m.to_string())
                .collect(),
            user_preload: HashMap::new(),
            fork_server: true,
            template_idle: Duration::from_secs(300),
            criu: None,
            copy_reserve_bytes: crate::sandbox::criu::DEFAULT_COPY_RESERVE,
            log_filter: None,
        }
    }

    /// The runtime base directory a sandbox with these settings uses when started by this
    /// process's user (see [`Self::run_dir`]).
    pub fn run_base(&self) -> Result<PathBuf, SandboxError> {
        let mut cfg = self.clone();
        cfg.data_dir = absolute(&cfg.data_dir)?;
        if let Some(dir) = &cfg.run_dir {
            cfg.run_dir = Some(absolute(dir)?);
        }
        let euid = rustix::process::geteuid().as_raw();
        choose_run_base(&cfg, euid == 0, euid)
    }
}

/// The cgroup name and first kernel uid of the broker on `data_dir`: `kernel-broker-<hash>`
/// (the hash that also names its runtime directories and Docker containers) and
/// `200000 + 10000 × (hash mod 10000)`, room for 10,000 users each. Two brokers with
/// different data directories thus sweep, limit and kill only their own kernels, and their
/// kernels never share a uid (unless the hashes collide mod 10,000: set `--uid-base` to
/// choose ranges by hand).
pub fn instance_defaults(data_dir: &Path) -> (String, u32) {
    let absolute = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let hash = crate::sandbox::fsutil::data_dir_hash(&absolute);
    let n = u32::from_str_radix(&hash, 16).unwrap_or(0) % 10_000;
    (format!("kernel-broker-{hash}"), 200_000 + 10_000 * n)
}
