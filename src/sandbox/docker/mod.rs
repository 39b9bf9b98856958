//! The docker sandbox: kernels in one long-lived container per user, through the Docker
//! Engine API (also Podman's compatible API).
//!
//! This module owns a user's container (created on the user's first launch, removed after
//! [`DockerSandboxConfig::container_idle`] without sessions), the host directories it
//! mounts (the persistent workspace `<data_dir>/workspaces-docker/<user>` at `/workspace`
//! and the user's runtime directory at `/run/kernel`), and each kernel's life inside it.
//!
//! Why one container per user and `docker exec` per kernel, not a container per kernel: a
//! user's kernels share one workspace and one set of limits (the
//! [`UserLimits`](super::UserLimits) are per user, as in the local backend), so the
//! container *is* the user's limit boundary;
//! a warm launch is an exec (~0.1 s) instead of a container start; and one container per
//! user keeps the daemon's load and the idle memory low. The price: a user's kernels see
//! each other's processes and runtime files (same uid, same trust domain), and memory,
//! process and CPU limits are shared by all of them.
//!
//! The container: the image's `tini` as PID 1 running `sleep infinity`, network `none`,
//! read-only root, `/tmp` a 256 MiB tmpfs, no capabilities, `no-new-privileges` (the
//! default seccomp profile stays), uid/gid 1000:1000, memory = swap limit (no swap), CPU
//! and pids limits from [`UserLimits`](super::UserLimits). Containers carry the labels
//! [`LABEL_MANAGED`]`=true` and [`LABEL_DATA_DIR_HASH`]`=<hash of the data dir>`, and are
//! named `kernel-broker-<hash>-<user>`, so two brokers on one daemon never touch each
//! other's containers.
//!
//! A kernel, forked from the user's fork-server template when there is one (`template.rs`),
//! else `docker exec -d` of `sh -c '<wait for go>; tini -s -- sh -c "echo $$ >
//! /run/kernel/<dir>/pid; exec python -m ipykernel_launcher -f ..."; echo $? > status'`
//! (`kernel_argv::kernel_command`) with an `ipc` connection file in `/run/kernel/<dir>/`; the
//! broker connects to the sockets on the host side of the bind mount. A watcher task per
//! kernel polls the exec (`inspect_exec`, every 500 ms; under Podman also a pidfd on the
//! exec's process, with the status file for how it ended) and classifies its end (the
//! [`ExitReason`](super::ExitReason) mapping is in `watch.rs`). Interrupts are a small exec
//! (`kill -INT` of the recorded pid, the kernel itself, after checking that pid still runs
//! this kernel).
//!
//! No process outlives its session (see `exec.rs`: each kernel under its own `tini -s`, and
//! a reaper exec when it ends); an OOM kill is attributed to one kernel (see `watch.rs`).
//!
//! Startup and shutdown: by default, before the first check or launch, containers with this
//! broker's labels left by an earlier run are *removed* (sessions do not survive a broker
//! restart, so nothing in them is reachable any more), and the runtime directory is
//! emptied; [`Sandbox::shutdown`] removes every container of this broker. With
//! [`DockerSandboxConfig::keep_kernels`] (`--keep-sessions`) kernels outlive the broker
//! instead: shutdown leaves them, their containers, session directories, cgroup leaves and
//! workspace mounts in place; start-up keeps the containers and directories the kept
//! kernels need (named by the tickets a launch writes), and [`Sandbox::adopt`] takes each
//! kernel over (see `keep/`).
//!
//! The broker is expected to run as root (it chowns the workspace to 1000:1000 and
//! connects to sockets the kernel creates). As another user, the session directory is
//! made world-writable inside the broker's private (0700) runtime directory and the
//! kernel runs with `umask 000`, so the broker can connect; the workspace is made 0777
//! if it cannot be given to uid 1000. Rootless Podman is tested so (docs/HOSTS-podman.md:
//! container uid 1000 is a subordinate uid the broker cannot chown to); rootless Docker is not.
//! Whatever the engine, a new user container's cgroup must enforce the limits asked for
//! (`limits::verify_limits`), or the launch fails (`require_limits`).
//!
//! A session with a workspace of its own (every E2B sandbox) gets a container of its own
//! instead, shared by the kernels and commands of its key (`own.rs`). All of a user's
//! containers sit under one parent cgroup holding her limits (`parent.rs`).
//!
//! Layout: this file holds the configuration, [`DockerSandbox`] and its [`Sandbox`]
//! implementation and a user's slot; `launch.rs` the launch; `own.rs` sandboxes' own
//! containers and workspaces; `parent.rs` the users' parent cgroups; `daemon.rs` the client and its errors;
//! `container.rs` the pure container spec and the container's lifecycle; `exec.rs` a
//! kernel's exec, its interrupt and the reaper; `place.rs` a process's own cgroup leaf;
//! `template.rs` fork-server templates and the kernels forked from them; `fork.rs` a live
//! kernel's fork beside it in the container; `copy.rs` and `restore.rs` a copy of a kernel
//! with a workspace of its own into a container of its own (CRIU); `watch.rs` the
//! watchers that classify a kernel's end (OOM attribution included); `keep/` kernels kept across a restart (their
//! tickets, the start-up that keeps them, adoption).

mod command;
mod config;
mod container;
mod copy;
mod daemon;
mod engine;
mod exec;
mod fork;
mod keep;
mod kernel_argv;
mod launch;
mod limits;
mod own;
mod parent;
mod pause;
mod place;
mod reaper;
mod restore;
mod running;
mod snapshot;
mod specs;
mod stop;
mod template;
mod watch;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use tokio::sync::{oneshot, OnceCell};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use self::config::DockerSandboxConfig;
use self::container::choose_run_base;
use self::daemon::{error_text, socket_path, status_of};
use self::engine::Engine;
use self::exec::DockerKernel;
pub use self::own::LABEL_SANDBOX;
use self::running::ContainerInfo;
use super::fsutil::{self, absolute, current_ids, launch_err, launch_step};
use super::watched::KernelTable;
use super::workspace_fs::WorkspaceImages;
use super::LaunchRefusal;
use super::{AdoptError, AdoptSpec, LaunchSpec, Launched, Sandbox, SandboxError, SandboxUser};
use crate::sandbox::own_workspace::OwnWorkspaces;
use crate::sandbox::workspace_fs::{prepare_workspace, WorkspaceOwner};
use crate::sync::lock;

const BACKEND: &str = "docker";
/// The Docker Engine socket when none is configured.
pub const DEFAULT_SOCKET: &str = "/var/run/docker.sock";
/// The kernel image when none is configured (see `docker/README.md`).
pub const DEFAULT_IMAGE: &str = "kernel-broker/python-kernel:latest";
/// Label on every container a broker creates (`true`).
pub const LABEL_MANAGED: &str = "org.kernel-broker.managed";
/// Label holding the hash of the creating broker's data directory.
pub const LABEL_DATA_DIR_HASH: &str = "org.kernel-broker.data-dir-hash";
/// Label holding the broker user a container belongs to.
pub const LABEL_USER: &str = "org.kernel-broker.user";
/// Label holding the creating broker's data directory (for humans).
pub const LABEL_DATA_DIR: &str = "org.kernel-broker.data-dir";

/// uid and gid of the image's `kernel` user.
const KERNEL_UID: u32 = 1000;
const KERNEL_GID: u32 = 1000;
const PYTHON_INSIDE: &str = "/opt/kernel-venv/bin/python";
/// The image's Python environment (`{prefix}` in a spec's argv).
const VENV_INSIDE: &str = "/opt/kernel-venv";
/// The image's tini (Debian's package), also the container's PID 1.
const TINI_INSIDE: &str = "/usr/bin/tini";
/// How long the reaper inside the container may keep killing before it gives up.
const REAP_LIMIT_SECS: u32 = 10;
const RUN_DIR_INSIDE: &str = "/run/kernel";
const WORKSPACE_INSIDE: &str = "/workspace";
const HOSTNAME: &str = "kernel";
/// Options of the container's `/tmp` tmpfs (its pages count against the memory limit).
const TMPFS_OPTIONS: &str = "rw,nosuid,nodev,size=256m,mode=1777";
/// The size of that `/tmp`, in bytes (what a snapshot archives of it at most).
const TMPFS_BYTES: u64 = 256 << 20;
/// `sun_path` holds 108 bytes including the NUL.
const MAX_SOCKET_PATH: usize = 107;
/// User-name length the default runtime directory must leave room for.
const USER_NAME_BUDGET: usize = 32;
/// Hex digits of the session id naming its runtime directory (`/run/kernel/<dir>`).
const SESSION_DIR_LEN: usize = 12;
/// How often a kernel's watcher asks the daemon whether the kernel still runs.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// How long a helper exec (kill, reading a counter) may take.
const EXEC_TIMEOUT: Duration = Duration::from_secs(15);
/// How long `terminate` waits for the kernel to be gone.
const TERMINATE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a watcher tolerates a daemon that does not answer before giving the kernel up.
const DAEMON_GRACE: Duration = Duration::from_secs(30);
/// Bytes of a helper exec's output kept, and of a dead kernel's log shown.
const MAX_EXEC_OUTPUT: usize = 16 * 1024;
const LOG_TAIL_BYTES: usize = 2000;

/// The docker sandbox backend. Cheap handle over shared state, which its background tasks
/// (kernel watchers, idle timers) hold too.
pub struct DockerSandbox {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: DockerSandboxConfig,
    /// The socket's file path (without `unix://`).
    socket_path: String,
    /// Short hash of the data directory: tells this broker's containers apart.
    hash: String,
    privileged: bool,
    workspaces: PathBuf,
    /// The workspaces' file systems (the per-user disk quota).
    workspace_images: Arc<WorkspaceImages>,
    run_base: PathBuf,
    /// Connected (and version-negotiated) on first use, with the engine it turned out to
    /// be; retried until it works.
    client: OnceCell<(Docker, Engine)>,
    /// Startup work (directories, sweeping an earlier run's containers), once.
    started: OnceCell<()>,
    users: Mutex<HashMap<String, Arc<UserSlot>>>,
    kernels: KernelTable<DockerKernel>,
    /// Kernels an earlier run kept that no session has adopted yet (`--keep-sessions`),
    /// by session; filled at start-up.
    kept: Mutex<HashMap<Uuid, keep::Ticket>>,
    /// Sandboxes' own workspaces (`own.rs`), `<data_dir>/sandboxes-docker`.
    own_workspaces: Arc<OwnWorkspaces>,
    /// The users' fork-server templates.
    templates: template::Templates,
    /// The users' parent cgroups, each holding all of one user's containers (`parent.rs`).
    parents: parent::Parents,
    /// Cancelled by `shutdown`: stops idle timers.
    shutdown: CancellationToken,
    /// The programs a copy into a container of its own runs (`copy.rs`), found once.
    copy_tools: OnceCell<Result<Arc<restore::CopyTools>, String>>,
    /// The room copies under way hold for their images (`criu/room.rs`).
    copy_room: Arc<crate::sandbox::criu::CopyRoom>,
    /// Paused kernels and snapshots an earlier run left, found at startup.
    found: super::pause::FoundImages,
}

/// Per-user state.
#[derive(Default)]
struct UserSlot {
    /// The user's container. An async mutex on purpose: it is held across the Docker calls
    /// that create the container and start a kernel in it, so that two concurrent launches
    /// do not both create a container, and an idle removal cannot remove the container
    /// under a launch.
    container: Arc<tokio::sync::Mutex<Option<Arc<ContainerInfo>>>>,
    /// The pending idle removal, cancelled by the next launch.
    idle: Mutex<Option<CancellationToken>>,
}

impl DockerSandbox {
    /// Validates the settings; does not contact the daemon (`check` does).
    pub fn new(cfg: DockerSandboxConfig) -> Result<Self, SandboxError> {
        let mut cfg = cfg;
        cfg.data_dir = absolute(&cfg.data_dir)?;
        if let Some(dir) = &cfg.run_dir {
            cfg.run_dir = Some(absolute(dir)?);
        }
        let socket_path = socket_path(&cfg.socket)?;
        let hash = fsutil::data_dir_hash(&cfg.data_dir);
        let (euid, _) = current_ids();
        let privileged = euid == 0;
        let run_base = choose_run_base(&cfg, &hash, privileged, euid)?;
        let workspaces = cfg.data_dir.join("workspaces-docker");
        let own_dir = cfg.data_dir.join("sandboxes-docker");
        let parents = parent::Parents::new(&hash, cfg.cgroup_parent.as_deref());
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                socket_path,
                hash,
                privileged,
                workspace_images: Arc::new(WorkspaceImages::new(BACKEND, &workspaces, privileged)),
                workspaces,
                run_base,
                client: OnceCell::new(),
                started: OnceCell::new(),
                users: Mutex::new(HashMap::new()),
                kernels: KernelTable::default(),
                kept: Mutex::new(HashMap::new()),
                own_workspaces: Arc::new(OwnWorkspaces::in_dir(BACKEND, own_dir, privileged)),
                templates: template::Templates::default(),
                parents,
                shutdown: CancellationToken::new(),
                copy_tools: OnceCell::new(),
                copy_room: Default::default(),
                found: Default::default(),
            }),
        })
    }

    /// The container name of a user: `kernel-broker-<hash>-<user>`.
    pub fn container_name(&self, user: &str) -> String {
        self.inner.container_name(user)
    }

    /// The value of [`LABEL_DATA_DIR_HASH`] on this broker's containers.
    pub fn data_dir_hash(&self) -> &str {
        &self.inner.hash
    }

    /// The directory holding the per-user runtime directories.
    pub fn run_base(&self) -> &Path {
        &self.inner.run_base
    }
}

#[async_trait]
impl Sandbox for DockerSandbox {
    fn name(&self) -> &'static str {
        BACKEND
    }

    async fn check(&self) -> Result<(), SandboxError> {
        let inner = &self.inner;
        let docker = inner.client().await?;
        let limit = inner.cfg.api_timeout;
        timeout(limit, docker.ping())
            .await
            .map_err(|_| {
                inner.unreachable(format!("the daemon did not answer a ping within {limit:?}"))
            })?
            .map_err(|e| inner.unreachable(error_text(&e)))?;
        match docker.inspect_image(&inner.cfg.image).await {
            Ok(_) => {}
            Err(e) if status_of(&e) == Some(404) => {
                return Err(unavailable(format!(
                    "the kernel image {} is not present; build it with docker/build-offline.sh \
                     or `docker build -f docker/Dockerfile -t {} .`",
                    inner.cfg.image, inner.cfg.image
                )))
            }
            Err(e) => {
                let reason = format!(
                    "cannot inspect the kernel image {}: {}",
                    inner.cfg.image,
                    inner.advice(&e)
                );
                return Err(unavailable_by(reason, e));
            }
        }
        inner.startup().await
    }

    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, SandboxError> {
        // Run the launch in its own task: if the caller gives up (its timeout drops this
        // future), the launch still completes consistently and the kernel it started is
        // terminated instead of leaking.
        let inner = self.inner.clone();
        let user = spec.user.clone();
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let result = inner.launch(spec).await;
            if let Err(Ok(launched)) = tx.send(result) {
                tracing::info!("launch abandoned by the caller; terminating its kernel");
                launched.process.terminate().await;
            }
        });
        rx.await
            .map_err(|e| launch_step(&user, "the launch task failed", e))?
    }

    fn workspace(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        let path = self.inner.workspace_path(user)?;
        let quota = (
            &*self.inner.workspace_images,
            user.limits.workspace_quota_bytes,
        );
        prepare_workspace(&path, workspace_owner(self.inner.privileged), Some(quota))?;
        Ok(path)
    }

    fn own_workspace(
        &self,
        _user: &SandboxUser,
        key: Uuid,
    ) -> Result<Option<PathBuf>, SandboxError> {
        self.inner.own_home(key).map(Some)
    }

    async fn remove_own_workspace(&self, user: &SandboxUser, key: Uuid) {
        self.inner.remove_own(user, key).await;
    }

    fn workspace_owner(&self, _user: &SandboxUser) -> Option<(u32, u32)> {
        Some((KERNEL_UID, KERNEL_GID))
    }

    async fn user_idle(&self, user: &SandboxUser) {
        self.inner.start_idle_timer(&user.name);
    }

    async fn shutdown(&self) {
        self.inner.shutdown().await;
    }

    fn keeps_kernels(&self) -> bool {
        self.inner.cfg.keep_kernels
    }

    async fn adopt(&self, spec: AdoptSpec) -> Result<Launched, AdoptError> {
        if !self.inner.cfg.keep_kernels {
            return Err(AdoptError::Missing);
        }
        self.inner.adopt(spec).await
    }

    async fn discard_unadopted(&self) {
        self.inner.discard_unadopted().await;
    }

    fn launch_timeout(&self) -> Duration {
        self.inner.cfg.launch_timeout
    }

    async fn run_command(
        &self,
        spec: super::command::CommandSpec,
    ) -> Result<super::command::RunningCommand, SandboxError> {
        self.inner.start_command(spec).await
    }

    async fn prepare_fork(
        &self,
        parent: &dyn super::KernelProcess,
        spec: LaunchSpec,
    ) -> Result<super::fork::PreparedFork, super::fork::ForkError> {
        if spec.own_workspace.is_some() {
            // A fork beside it would share its container, and so its workspace: a copy.
            return self.inner.prepare_copy(parent, spec).await;
        }
        self.inner.prepare_kernel_fork(parent, spec).await
    }

    async fn adopt_fork(
        &self,
        prepared: super::fork::PreparedFork,
        pid: i64,
    ) -> Result<Launched, super::fork::ForkError> {
        if prepared.origin.own_workspace.is_some() {
            return self.inner.adopt_copy(prepared, pid).await;
        }
        self.inner.adopt_kernel_fork(prepared, pid).await
    }

    async fn discard_fork(&self, prepared: super::fork::PreparedFork) {
        if prepared.pause {
            return super::fsutil::remove_dir_logged(prepared.dir).await;
        }
        if prepared.origin.own_workspace.is_some() {
            return self.inner.discard_copy(prepared).await;
        }
        self.inner.discard_kernel_fork(prepared).await;
    }

    async fn prepare_pause(
        &self,
        kernel: &dyn super::KernelProcess,
        spec: LaunchSpec,
    ) -> Result<super::fork::PreparedFork, super::fork::ForkError> {
        self.inner.prepare_pause(kernel, spec).await
    }

    async fn dump_paused(
        &self,
        prepared: super::fork::PreparedFork,
        pid: i64,
    ) -> Result<super::pause::PausedImage, super::fork::ForkError> {
        self.inner.dump_paused(prepared, pid).await
    }

    async fn resume_paused(
        &self,
        image: &super::pause::PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, super::fork::ForkError> {
        self.inner.resume_kernel(image, spec).await
    }

    async fn release_paused(&self, user: &SandboxUser, key: Uuid) {
        self.inner.release_own_container(user, key).await
    }

    fn keeps_paused(&self) -> bool {
        true
    }

    async fn paused_images(&self) -> Vec<super::pause::PausedImage> {
        let inner = &self.inner;
        inner
            .found
            .take_after(inner.startup(), super::pause::Found::Paused)
            .await
    }

    async fn prepare_snapshot(
        &self,
        kernel: &dyn super::KernelProcess,
        spec: LaunchSpec,
    ) -> Result<super::fork::PreparedFork, super::fork::ForkError> {
        self.inner.prepare_snapshot(kernel, spec).await
    }

    async fn start_from_snapshot(
        &self,
        image: &super::pause::PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, super::fork::ForkError> {
        self.inner.start_from_snapshot(image, spec).await
    }

    async fn snapshot_images(&self) -> Vec<super::pause::PausedImage> {
        let inner = &self.inner;
        inner
            .found
            .take_after(inner.startup(), super::pause::Found::Snapshots)
            .await
    }
}

impl Inner {
    fn container_name(&self, user: &str) -> String {
        format!("kernel-broker-{}-{user}", self.hash)
    }

    /// Whether this broker's containers are being removed whole (a shutdown that keeps no
    /// kernels), so a kernel's own processes need no reaping one by one.
    fn removing_containers(&self) -> bool {
        self.shutdown.is_cancelled() && !self.cfg.keep_kernels
    }

    fn slot(&self, user: &str) -> Arc<UserSlot> {
        lock(&self.users)
            .entry(user.to_string())
            .or_default()
            .clone()
    }

    fn workspace_path(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        if !is_container_safe(&user.name) {
            return Err(launch_err(
                user,
                LaunchRefusal::UserNameNotAContainer(user.name.clone()),
            ));
        }
        Ok(self.workspaces.join(&user.name))
    }

    fn user_run_dir(&self, user: &str) -> PathBuf {
        self.run_base.join(user)
    }
}

/// Usable after `kernel-broker-<hash>-` in a container name (`[a-zA-Z0-9_.-]`) and as a
/// path component.
fn is_container_safe(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn unavailable(reason: impl Into<String>) -> SandboxError {
    fsutil::unavailable(BACKEND, reason)
}

/// [`unavailable`] because of `source`, kept as the error's source.
fn unavailable_by(
    reason: impl Into<String>,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> SandboxError {
    fsutil::unavailable_by(BACKEND, reason, source)
}

/// The workspace belongs to the image's `kernel` user; only root can give it away.
fn workspace_owner(privileged: bool) -> WorkspaceOwner {
    let (uid, gid) = (KERNEL_UID, KERNEL_GID);
    if privileged {
        WorkspaceOwner::Kernel { uid, gid }
    } else {
        WorkspaceOwner::KernelUnchowned { uid, gid }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_must_fit_container_names_and_paths() {
        for ok in ["alice", "bob-2", "a.b_c", "_bot", "-x"] {
            assert!(is_container_safe(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "é"] {
            assert!(!is_container_safe(bad), "{bad}");
        }
    }
}
