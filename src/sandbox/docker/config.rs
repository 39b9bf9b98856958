//! The docker sandbox's settings ([`DockerSandboxConfig`]) and their defaults.

use std::path::PathBuf;
use std::time::Duration;

use super::{DEFAULT_IMAGE, DEFAULT_SOCKET};
use crate::sandbox::boot;

/// Settings of the docker sandbox.
#[derive(Debug, Clone)]
pub struct DockerSandboxConfig {
    /// The broker's state directory; workspaces live in `<data_dir>/workspaces-docker`.
    pub data_dir: PathBuf,
    /// The daemon's unix socket, as a path or `unix://` URL (Podman:
    /// `unix:///run/podman/podman.sock`).
    pub socket: String,
    /// The kernel image.
    pub image: String,
    /// How long a user's container outlives the user's last session.
    pub container_idle: Duration,
    /// Where per-user runtime directories go. Default `<data_dir>/run-docker`, unless socket
    /// paths there would be too long; then `/run/kernel-broker-docker-<hash>` (root) or
    /// `$XDG_RUNTIME_DIR/...` or `/tmp/kernel-broker-docker-<uid>-<hash>`.
    pub run_dir: Option<PathBuf>,
    /// `--keep-sessions`: kernels and containers outlive the broker and are adopted by its
    /// next run (see [`Sandbox::keeps_kernels`](crate::sandbox::Sandbox::keeps_kernels)).
    pub keep_kernels: bool,
    /// Modules the user's fork-server template imports before it forks kernels
    /// ([`crate::sandbox::boot`], `template.rs`); empty: no template. Default
    /// [`boot::DEFAULT_PRELOAD`], which the kernel image holds.
    pub preload: Vec<String>,
    /// `--fork-server`: kernels forked from a per-user template (`template.rs`).
    pub fork_server: bool,
    /// Users' own preload lists (the users file), by user name.
    pub user_preload: std::collections::HashMap<String, Vec<String>>,
    /// A CA bundle to show read-only at `egress::CA_FILE_INSIDE` (`--egress-ca-file`).
    pub ca_file: Option<PathBuf>,
    /// The kernel specs the broker offers (`kernels/`): kernels other than `python3` run
    /// their spec's argv in the image, which holds their runtimes and files
    /// (`docker/Dockerfile`). None: `python3` only.
    pub kernel_specs: Option<std::sync::Arc<crate::kernel::spec::KernelSpecs>>,
    /// The cgroup the engine puts users' containers under (`HostConfig.CgroupParent`,
    /// `--docker-cgroup-parent`); None: the engine's default. A rootless Podman without a
    /// systemd user session can only apply limits in a cgroup its user owns.
    pub cgroup_parent: Option<String>,
    /// A user's container whose cgroup does not enforce the limits asked for is removed and
    /// the launch fails (`require_limits`, default true); false: it runs, with a warning.
    pub require_limits: bool,
    /// How long a kernel's start may take (`--launch-timeout`, default 60 s: a cold launch
    /// creates and starts the user's container first).
    pub launch_timeout: Duration,
    /// How long one request to the daemon may take, connecting included
    /// (`--docker-api-timeout`, default 60 s): more for a slow engine (an emulated host).
    pub api_timeout: Duration,
    /// CRIU (`--criu`), which copies a kernel into a container of its own (`copy.rs`);
    /// None: the first of the usual places that is 4.0 or later.
    pub criu: Option<PathBuf>,
    /// Bytes of the data directory's file system a copy leaves free (`criu/room.rs`).
    pub copy_reserve_bytes: u64,
    /// What each line of a template's (and so its forked kernels') stderr passes through
    /// before the log (the broker masks secrets and credentials with it).
    pub log_filter: Option<crate::sandbox::LogFilter>,
}

impl DockerSandboxConfig {
    /// The defaults for a data directory.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            socket: DEFAULT_SOCKET.to_string(),
            image: DEFAULT_IMAGE.to_string(),
            launch_timeout: Duration::from_secs(60),
            container_idle: Duration::from_secs(300),
            run_dir: None,
            keep_kernels: false,
            // Imported once per user, in the template; kernels share the pages.
            preload: boot::DEFAULT_PRELOAD
                .iter()
                .map(|m| m.to_string())
                .collect(),
            fork_server: true,
            user_preload: std::collections::HashMap::new(),
            ca_file: None,
            kernel_specs: None,
            cgroup_parent: None,
            require_limits: true,
            api_timeout: Duration::from_secs(60),
            criu: None,
            copy_reserve_bytes: crate::sandbox::criu::DEFAULT_COPY_RESERVE,
            log_filter: None,
        }
    }
}
