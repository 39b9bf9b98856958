//! The docker sandbox: kernels in one long-lived container per user, through the Docker
//! Engine API (also Podman's compatible API).
//!
//! This module owns a user's container (created on the user's first launch, removed after
//! [`DockerSandboxConfig::container_idle`] without sessions), the host directories it
//! mounts (the persistent workspace `<data_dir>/workspaces-docker/<user>` at `/workspace`
//! and the user's runtime directory at `/run/kernel`), and each kernel's life inside it.
//!
//! Why one container per user and `docker exec` per kernel, not a container per kernel: a
//! user's kernels share one workspace and one set of limits (the [`UserLimits`] are
//! per user, as in the local backend), so the container *is* the user's limit boundary;
//! a warm launch is an exec (~0.1 s) instead of a container start; and one container per
//! user keeps the daemon's load and the idle memory low. The price: a user's kernels see
//! each other's processes and runtime files (same uid, same trust domain), and memory,
//! process and CPU limits are shared by all of them.
//!
//! The container: the image's `tini` as PID 1 running `sleep infinity`, network `none`,
//! read-only root, `/tmp` a 256 MiB tmpfs, no capabilities, `no-new-privileges` (the
//! default seccomp profile stays), uid/gid 1000:1000, memory = swap limit (no swap), CPU
//! and pids limits from [`UserLimits`]. Containers carry the labels
//! [`LABEL_MANAGED`]`=true` and [`LABEL_DATA_DIR_HASH`]`=<hash of the data dir>`, and are
//! named `kernel-broker-<hash>-<user>`, so two brokers on one daemon never touch each
//! other's containers.
//!
//! A kernel: `docker exec -d` of `sh -c 'echo $$ > /run/kernel/<dir>/pid; exec tini -s --
//! python -m ipykernel_launcher -f ...'` with an `ipc` connection file in
//! `/run/kernel/<dir>/`; the broker connects to the sockets on the host side of the bind
//! mount. A watcher task per kernel polls the exec (`inspect_exec`, every 500 ms) and
//! classifies its end; see [`ExitReason`] mapping in `classify_exec_end`. Interrupts are a
//! small exec (`kill -INT` of the recorded pid, the kernel's tini, which forwards it to the
//! kernel, after checking that pid still runs this kernel).
//!
//! No process outlives its session. The container outlives each session, so a kernel's
//! end must take along everything the kernel started, whatever it did to escape (a new
//! session, a double fork, ignoring SIGTERM/SIGINT/SIGHUP), without touching the user's
//! other sessions in the same container. Two mechanisms, both unprivileged and both inside
//! the container (so they work the same with rootless Docker or Podman, where the host
//! cannot signal the container's processes):
//! - Each kernel runs under its own `tini -s`, a child subreaper: a daemon that double-forks
//!   is reparented to its kernel's tini, not to the container's PID 1, so it stays in its
//!   session's process subtree (and another session's end leaves it alone). tini also
//!   reaps those orphans when they exit, so zombies do not pile up against the pids limit.
//! - When a kernel ends (killed by the broker, or by itself), a reaper exec ([`REAPER`],
//!   a short python script reading `/proc`) kills, until a scan finds none left, the
//!   process subtree of that kernel's exec and every orphan reparented to PID 1 (all of
//!   whose session has ended: a live session's orphans go to its tini), sparing PID 1's
//!   own `sleep infinity`. Each round SIGSTOPs every target before SIGKILLing any, so a
//!   process that forks in a loop cannot outrun it. The exec of a kernel is recognised by
//!   parent pid 0 (only `docker exec` makes those; a kernel cannot) and its argv holding
//!   its connection file, never by the pid file, which the kernel can overwrite. Other
//!   execs (other kernels, interrupts, counters) are never targets. One reaper per
//!   container at a time (`ContainerInfo::reaping`). Measured: ~0.1 s for a kernel with a
//!   new-session child, a daemon, a signal-deaf process and a fork runner.
//!   Limits: a process of the session that ptraces another session's tini could hide
//!   under it (same uid: one trust domain, as said above); on shutdown the container is
//!   removed whole instead.
//!
//! Out of memory: with a memory limit on the container, the kernel's OOM killer kills the
//! biggest process in it, normally the python kernel that allocated the memory, and the
//! container survives. Docker does not report that per exec, so a kernel whose exec ended
//! by SIGKILL (137) is reported as [`ExitReason::OutOfMemory`] only if the container's
//! cgroup counter `oom_kill` (`memory.events` on cgroup v2, `memory.oom_control` on v1,
//! read from inside the container) went up by a kill no other kernel has claimed yet;
//! otherwise it is [`ExitReason::Signaled`]`(9)`. An OOM kill of some other process (a
//! subprocess the kernel started) can thus be attributed to a kernel killed later by
//! `kill -9`; rare, and said here to stay honest. If the OOM killer hits tini instead, the
//! container dies and every kernel in it ends with OutOfMemory (`State.OOMKilled`).
//!
//! Startup and shutdown: before the first check or launch, containers with this broker's
//! labels left by an earlier run are *removed*, not adopted (sessions do not survive a
//! broker restart, so nothing in them is reachable any more), and the runtime directory
//! is emptied. [`Sandbox::shutdown`] removes every container of this broker.
//!
//! The broker is expected to run as root (it chowns the workspace to 1000:1000 and
//! connects to sockets the kernel creates). As another user, the session directory is
//! made world-writable inside the broker's private (0700) runtime directory and the
//! kernel runs with `umask 000`, so the broker can connect; the workspace is made 0777
//! if it cannot be given to uid 1000. Rootless Docker/Podman (uid remapping) is untested.

use crate::sync::lock;
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType};
use bollard::query_parameters::{
    CreateContainerOptions, ListContainersOptions, RemoveContainerOptions,
};
use bollard::Docker;
use futures::StreamExt;
use tokio::sync::{oneshot, watch, OnceCell};
use tokio::time::{sleep, timeout};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::fsutil::{
    self, absolute, current_ids, io_err, launch_err, prepare_workspace, remove_dir_logged,
    FileMode, WorkspaceOwner,
};
use super::workspace_fs::WorkspaceImages;
use super::{
    ExitReason, KernelEndpoints, KernelProcess, LaunchSpec, Launched, Sandbox, SandboxError,
    SandboxUser, UserLimits,
};

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
/// The image's tini (Debian's package), also the container's PID 1.
const TINI_INSIDE: &str = "/usr/bin/tini";
/// How long the reaper inside the container may keep killing before it gives up.
const REAP_LIMIT_SECS: u32 = 10;
const RUN_DIR_INSIDE: &str = "/run/kernel";
const WORKSPACE_INSIDE: &str = "/workspace";
const HOSTNAME: &str = "kernel";
/// Options of the container's `/tmp` tmpfs (its pages count against the memory limit).
const TMPFS_OPTIONS: &str = "rw,nosuid,nodev,size=256m,mode=1777";
/// `sun_path` holds 108 bytes including the NUL.
const MAX_SOCKET_PATH: usize = 107;
/// User-name length the default runtime directory must leave room for.
const USER_NAME_BUDGET: usize = 32;
/// Hex digits of the session id naming its runtime directory (`/run/kernel/<dir>`).
const SESSION_DIR_LEN: usize = 12;
/// How often a kernel's watcher asks the daemon whether the kernel still runs.
const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Per-request timeout of the Docker client, in seconds.
const API_TIMEOUT_SECS: u64 = 60;
/// How long connecting to the daemon (version negotiation) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a helper exec (kill, reading a counter) may take.
const EXEC_TIMEOUT: Duration = Duration::from_secs(15);
/// How long `terminate` waits for the kernel to be gone.
const TERMINATE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a watcher tolerates a daemon that does not answer before giving the kernel up.
const DAEMON_GRACE: Duration = Duration::from_secs(30);
/// Bytes of a helper exec's output kept, and of a dead kernel's log shown.
const MAX_EXEC_OUTPUT: usize = 16 * 1024;
const LOG_TAIL_BYTES: usize = 2000;

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
}

impl DockerSandboxConfig {
    /// The defaults for a data directory.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            socket: DEFAULT_SOCKET.to_string(),
            image: DEFAULT_IMAGE.to_string(),
            container_idle: Duration::from_secs(300),
            run_dir: None,
        }
    }
}

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
    /// Connected (and version-negotiated) on first use; retried until it works.
    client: OnceCell<Docker>,
    /// Startup work (directories, sweeping an earlier run's containers), once.
    started: OnceCell<()>,
    users: Mutex<HashMap<String, Arc<UserSlot>>>,
    kernels: Mutex<HashMap<Uuid, Arc<KernelShared>>>,
    /// Cancelled by `shutdown`: stops idle timers.
    shutdown: CancellationToken,
}

/// Per-user state.
#[derive(Default)]
struct UserSlot {
    /// The user's container. An async mutex on purpose: it is held across the Docker calls
    /// that create the container and start a kernel in it, so that two concurrent launches
    /// do not both create a container, and an idle removal cannot remove the container
    /// under a launch.
    container: tokio::sync::Mutex<Option<Arc<ContainerInfo>>>,
    /// The pending idle removal, cancelled by the next launch.
    idle: Mutex<Option<CancellationToken>>,
}

/// A running user container.
struct ContainerInfo {
    id: String,
    name: String,
    memory_limit: u64,
    /// OOM kills in this container already attributed to a kernel.
    oom_claimed: Mutex<u64>,
    /// Held while a reaper runs in this container: two reapers at once would each see the
    /// other's victims half-dead and race on the fixed point. An async mutex because it is
    /// held across the reaper's exec.
    reaping: tokio::sync::Mutex<()>,
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
                kernels: Mutex::new(HashMap::new()),
                shutdown: CancellationToken::new(),
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
        timeout(CONNECT_TIMEOUT, docker.ping())
            .await
            .map_err(|_| inner.unreachable("the daemon did not answer a ping within 10 s"))?
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
                return Err(unavailable(format!(
                    "cannot inspect the kernel image {}: {}",
                    inner.cfg.image,
                    inner.advice(&e)
                )))
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
            .map_err(|_| launch_err(&user, "the launch task failed"))?
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

    fn workspace_owner(&self, _user: &SandboxUser) -> Option<(u32, u32)> {
        Some((KERNEL_UID, KERNEL_GID))
    }

    async fn user_idle(&self, user: &SandboxUser) {
        let inner = &self.inner;
        if inner.shutdown.is_cancelled() {
            return;
        }
        let slot = inner.slot(&user.name);
        let token = CancellationToken::new();
        if let Some(old) = lock(&slot.idle).replace(token.clone()) {
            old.cancel();
        }
        let inner = inner.clone();
        let name = user.name.clone();
        let delay = inner.cfg.container_idle;
        tokio::spawn(async move {
            tokio::select! {
                () = sleep(delay) => {}
                () = token.cancelled() => return,
                () = inner.shutdown.cancelled() => return,
            }
            inner.remove_idle_container(&name, &slot, &token).await;
        });
    }

    async fn shutdown(&self) {
        self.inner.shutdown().await;
    }

    fn launch_timeout(&self) -> Duration {
        // A cold launch creates and starts a container first.
        Duration::from_secs(60)
    }
}

impl Inner {
    fn container_name(&self, user: &str) -> String {
        format!("kernel-broker-{}-{user}", self.hash)
    }

    fn unreachable(&self, why: impl std::fmt::Display) -> SandboxError {
        unavailable(format!(
            "cannot reach the Docker daemon at {} ({why}); start dockerd (or Podman's API \
             service), or check --docker-socket and that the broker may use it (root or the \
             docker group)",
            self.cfg.socket
        ))
    }

    /// The connected client; connects (and negotiates the API version) on first use.
    async fn client(&self) -> Result<Docker, SandboxError> {
        self.client
            .get_or_try_init(|| async {
                let docker = Docker::connect_with_unix(
                    &self.socket_path,
                    API_TIMEOUT_SECS,
                    bollard::API_DEFAULT_VERSION,
                )
                .map_err(|e| self.unreachable(error_text(&e)))?;
                let docker = timeout(CONNECT_TIMEOUT, docker.negotiate_version())
                    .await
                    .map_err(|_| self.unreachable("no answer within 10 s"))?
                    .map_err(|e| self.unreachable(error_text(&e)))?;
                let version = docker.client_version();
                tracing::debug!(socket = %self.cfg.socket, api = %format!("{}.{}", version.major_version, version.minor_version), "connected to the Docker daemon");
                Ok(docker)
            })
            .await
            .cloned()
    }

    /// A Docker error as text that tells the operator what to do.
    fn advice(&self, e: &DockerError) -> String {
        match e {
            DockerError::DockerResponseServerError {
                status_code,
                message,
            } => {
                if *status_code == 404 && message.contains("image") {
                    format!(
                        "{message}; build the image with docker/build-offline.sh or \
                         `docker build -f docker/Dockerfile -t {} .`",
                        self.cfg.image
                    )
                } else {
                    format!("the Docker daemon refused ({status_code}): {message}")
                }
            }
            DockerError::RequestTimeoutError => format!(
                "the Docker daemon at {} did not answer within {API_TIMEOUT_SECS} s",
                self.cfg.socket
            ),
            _ => format!(
                "cannot talk to the Docker daemon at {} ({}); is dockerd running? \
                 (check --docker-socket)",
                self.cfg.socket,
                error_text(e)
            ),
        }
    }

    /// Creates the directories and removes what an earlier run left; once.
    async fn startup(&self) -> Result<(), SandboxError> {
        self.started
            .get_or_try_init(|| async {
                let docker = self.client().await?;
                fsutil::prepare_state_dirs(
                    BACKEND,
                    &self.cfg.data_dir,
                    &self.workspaces,
                    &self.run_base,
                    empty_dir,
                )
                .await?;
                let stale = self
                    .our_containers(&docker)
                    .await
                    .map_err(|e| unavailable(self.advice(&e)))?;
                for id in &stale {
                    self.remove_container(&docker, id).await;
                }
                if !stale.is_empty() {
                    tracing::info!(
                        count = stale.len(),
                        "removed kernel containers left by an earlier run"
                    );
                }
                Ok(())
            })
            .await
            .copied()
    }

    /// Ids of every container (running or not) with this broker's labels.
    async fn our_containers(&self, docker: &Docker) -> Result<Vec<String>, DockerError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![
                format!("{LABEL_MANAGED}=true"),
                format!("{LABEL_DATA_DIR_HASH}={}", self.hash),
            ],
        )]);
        let list = docker
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters: Some(filters),
                ..Default::default()
            }))
            .await?;
        Ok(list.into_iter().filter_map(|c| c.id).collect())
    }

    /// Force-removes a container; a missing one is fine, other errors are logged.
    async fn remove_container(&self, docker: &Docker, id: &str) {
        let opts = RemoveContainerOptions {
            force: true,
            ..Default::default()
        };
        match docker.remove_container(id, Some(opts)).await {
            Ok(()) => tracing::debug!(container = %id, "container removed"),
            Err(e) if status_of(&e) == Some(404) => {}
            // 409: removal already in progress.
            Err(e) if status_of(&e) == Some(409) => {}
            Err(e) => {
                tracing::warn!(container = %id, error = %self.advice(&e), "cannot remove a kernel container")
            }
        }
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
                format!(
                    "the user name {:?} is not usable in a container name (letters, digits, \
                     `_`, `.`, `-`)",
                    user.name
                ),
            ));
        }
        Ok(self.workspaces.join(&user.name))
    }

    fn user_run_dir(&self, user: &str) -> PathBuf {
        self.run_base.join(user)
    }

    async fn launch(self: &Arc<Self>, spec: LaunchSpec) -> Result<Launched, SandboxError> {
        let user = spec.user.clone();
        if spec.kernel_name != "python3" {
            return Err(launch_err(
                &user,
                format!(
                    "the docker image provides only the python3 kernel, not {:?}",
                    spec.kernel_name
                ),
            ));
        }
        let workspace = self.workspace_path(&user)?;
        self.startup().await?;
        let docker = self.client().await?;
        let slot = self.slot(&user.name);
        if let Some(idle) = lock(&slot.idle).take() {
            idle.cancel();
        }

        let started = Instant::now();
        let mut guard = slot.container.lock().await;
        if self.shutdown.is_cancelled() {
            return Err(launch_err(&user, "the broker is shutting down"));
        }
        let (container, cold) = match self.running_container(&docker, &mut guard).await? {
            Some(c) => (c, false),
            None => {
                let c = self.create_container(&docker, &user, &workspace).await?;
                *guard = Some(c.clone());
                (c, true)
            }
        };
        let container_ready = started.elapsed();

        let dir = spec.session_id.simple().to_string()[..SESSION_DIR_LEN].to_string();
        let host_dir = self.user_run_dir(&user.name).join(&dir);
        let endpoints = endpoints_for(&host_dir).map_err(|e| launch_err(&user, e))?;
        let files = SessionFiles {
            dir: host_dir.clone(),
            privileged: self.privileged,
            connection: connection_file(&spec, &dir),
        };
        tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| launch_err(&user, format!("preparing files failed: {e}")))??;

        let exec_id = match self.start_kernel(&docker, &container, &spec, &dir).await {
            Ok(id) => id,
            Err(e) => {
                remove_dir_logged(host_dir).await;
                return Err(launch_err(&user, e));
            }
        };

        let (exit_tx, exit_rx) = watch::channel(None);
        let shared = Arc::new(KernelShared {
            docker: docker.clone(),
            session_id: spec.session_id,
            user: user.name.clone(),
            container,
            dir,
            host_dir,
            exec_id,
            terminating: AtomicBool::new(false),
            kill: CancellationToken::new(),
            exit: exit_rx,
        });
        lock(&self.kernels).insert(spec.session_id, shared.clone());
        tokio::spawn(watch_kernel(self.clone(), shared.clone(), exit_tx));
        // Registered: an idle removal waiting for the lock will now see a live kernel.
        drop(guard);
        tracing::info!(
            session = %spec.session_id,
            user = %user.name,
            container = %shared.container.name,
            cold,
            container_ms = container_ready.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "kernel launched"
        );
        Ok(Launched {
            endpoints,
            process: Box::new(DockerKernel { shared }),
        })
    }

    /// The user's container if it runs; forgets (and removes) it if it does not.
    async fn running_container(
        &self,
        docker: &Docker,
        slot: &mut Option<Arc<ContainerInfo>>,
    ) -> Result<Option<Arc<ContainerInfo>>, SandboxError> {
        let Some(c) = slot.clone() else {
            return Ok(None);
        };
        match docker.inspect_container(&c.id, None).await {
            Ok(info) if info.state.as_ref().and_then(|s| s.running) == Some(true) => Ok(Some(c)),
            Ok(info) => {
                tracing::warn!(container = %c.name, state = %describe_state(&info), "the user's container stopped; replacing it");
                self.remove_container(docker, &c.id).await;
                *slot = None;
                Ok(None)
            }
            Err(e) if status_of(&e) == Some(404) => {
                tracing::warn!(container = %c.name, "the user's container disappeared; replacing it");
                *slot = None;
                Ok(None)
            }
            Err(e) => Err(unavailable(self.advice(&e))),
        }
    }

    /// Creates and starts the user's container.
    async fn create_container(
        &self,
        docker: &Docker,
        user: &SandboxUser,
        workspace: &Path,
    ) -> Result<Arc<ContainerInfo>, SandboxError> {
        let run_dir = self.user_run_dir(&user.name);
        {
            let workspace = workspace.to_path_buf();
            let run_dir = run_dir.clone();
            let privileged = self.privileged;
            let images = self.workspace_images.clone();
            let quota = user.limits.workspace_quota_bytes;
            tokio::task::spawn_blocking(move || {
                let quota = Some((&*images, quota));
                prepare_workspace(&workspace, workspace_owner(privileged), quota)?;
                prepare_user_run_dir(&run_dir)
            })
            .await
            .map_err(|e| launch_err(user, format!("preparing directories failed: {e}")))??;
        }
        let name = self.container_name(&user.name);
        // A container of that name can only be left from a crash in the middle of a launch.
        self.remove_container(docker, &name).await;
        let body = self.container_body(user, workspace, &run_dir);
        let created = docker
            .create_container(
                Some(CreateContainerOptions {
                    name: Some(name.clone()),
                    ..Default::default()
                }),
                body,
            )
            .await
            .map_err(|e| {
                launch_err(
                    user,
                    format!("cannot create the container {name}: {}", self.advice(&e)),
                )
            })?;
        for warning in &created.warnings {
            tracing::warn!(container = %name, "docker: {warning}");
        }
        if let Err(e) = docker.start_container(&created.id, None).await {
            self.remove_container(docker, &created.id).await;
            return Err(launch_err(
                user,
                format!("cannot start the container {name}: {}", self.advice(&e)),
            ));
        }
        tracing::info!(container = %name, user = %user.name, "user container started");
        Ok(Arc::new(ContainerInfo {
            id: created.id,
            name,
            memory_limit: user.limits.memory_bytes,
            oom_claimed: Mutex::new(0),
            reaping: tokio::sync::Mutex::new(()),
        }))
    }

    fn container_body(
        &self,
        user: &SandboxUser,
        workspace: &Path,
        run_dir: &Path,
    ) -> ContainerCreateBody {
        let labels = HashMap::from([
            (LABEL_MANAGED.to_string(), "true".to_string()),
            (LABEL_DATA_DIR_HASH.to_string(), self.hash.clone()),
            (LABEL_USER.to_string(), user.name.clone()),
            (
                LABEL_DATA_DIR.to_string(),
                self.cfg.data_dir.to_string_lossy().into_owned(),
            ),
        ]);
        let bind = |source: &Path, target: &str| Mount {
            target: Some(target.to_string()),
            source: Some(source.to_string_lossy().into_owned()),
            typ: Some(MountType::BIND),
            read_only: Some(false),
            ..Default::default()
        };
        let limits = resource_limits(&user.limits);
        ContainerCreateBody {
            image: Some(self.cfg.image.clone()),
            hostname: Some(HOSTNAME.to_string()),
            user: Some(format!("{KERNEL_UID}:{KERNEL_GID}")),
            working_dir: Some(WORKSPACE_INSIDE.to_string()),
            labels: Some(labels),
            // The image's tini is PID 1 and runs `sleep infinity` (its CMD).
            host_config: Some(HostConfig {
                network_mode: Some("none".to_string()),
                readonly_rootfs: Some(true),
                tmpfs: Some(HashMap::from([(
                    "/tmp".to_string(),
                    TMPFS_OPTIONS.to_string(),
                )])),
                cap_drop: Some(vec!["ALL".to_string()]),
                security_opt: Some(vec!["no-new-privileges".to_string()]),
                ipc_mode: Some("private".to_string()),
                memory: limits.memory,
                memory_swap: limits.memory,
                nano_cpus: limits.nano_cpus,
                pids_limit: limits.pids,
                mounts: Some(vec![
                    bind(workspace, WORKSPACE_INSIDE),
                    bind(run_dir, RUN_DIR_INSIDE),
                ]),
                auto_remove: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Starts the kernel with a detached exec; returns the exec id.
    async fn start_kernel(
        &self,
        docker: &Docker,
        container: &ContainerInfo,
        spec: &LaunchSpec,
        dir: &str,
    ) -> Result<String, String> {
        let mut env: Vec<String> = vec!["PYDEVD_DISABLE_FILE_VALIDATION=1".to_string()];
        env.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
        let exec = docker
            .create_exec(
                &container.id,
                CreateExecOptions {
                    cmd: Some(kernel_command(dir, self.privileged)),
                    env: Some(env),
                    working_dir: Some(WORKSPACE_INSIDE.to_string()),
                    attach_stdin: Some(false),
                    attach_stdout: Some(false),
                    attach_stderr: Some(false),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                format!(
                    "cannot create the kernel's exec in {}: {}",
                    container.name,
                    self.advice(&e)
                )
            })?;
        docker
            .start_exec(
                &exec.id,
                Some(StartExecOptions {
                    detach: true,
                    ..Default::default()
                }),
            )
            .await
            .map_err(|e| {
                format!(
                    "cannot start the kernel in {}: {}",
                    container.name,
                    self.advice(&e)
                )
            })?;
        Ok(exec.id)
    }

    /// After `container_idle` without sessions: removes the user's container, unless a
    /// launch came meanwhile.
    async fn remove_idle_container(&self, user: &str, slot: &UserSlot, token: &CancellationToken) {
        let mut guard = slot.container.lock().await;
        if token.is_cancelled() {
            return;
        }
        let live = lock(&self.kernels).values().any(|k| k.user == user);
        if live {
            return;
        }
        lock(&slot.idle).take();
        let Some(container) = guard.take() else {
            return;
        };
        let Ok(docker) = self.client().await else {
            return;
        };
        self.remove_container(&docker, &container.id).await;
        tracing::info!(container = %container.name, user, "removed the idle user container");
    }

    async fn shutdown(&self) {
        self.shutdown.cancel();
        // Wait for launches in flight (they hold their user's lock, and give up once they
        // get it after this point), so no container is created behind our back.
        let slots: Vec<Arc<UserSlot>> = lock(&self.users).values().cloned().collect();
        for slot in slots {
            slot.container.lock().await.take();
        }
        let kernels: Vec<Arc<KernelShared>> = lock(&self.kernels).values().cloned().collect();
        if !kernels.is_empty() {
            tracing::info!(count = kernels.len(), "terminating kernels");
        }
        for kernel in &kernels {
            kernel.terminating.store(true, Ordering::SeqCst);
            kernel.kill.cancel();
        }
        if let Some(docker) = self.client.get() {
            match self.our_containers(docker).await {
                Ok(ids) => {
                    futures::future::join_all(
                        ids.iter().map(|id| self.remove_container(docker, id)),
                    )
                    .await;
                    if !ids.is_empty() {
                        tracing::info!(count = ids.len(), "removed the user containers");
                    }
                }
                Err(e) => {
                    tracing::error!(error = %self.advice(&e), "cannot list the kernel containers to remove them")
                }
            }
        }
        let waits = kernels.iter().map(|k| async move {
            if timeout(TERMINATE_TIMEOUT + EXEC_TIMEOUT, k.wait()).await.is_err() {
                tracing::error!(session = %k.session_id, "kernel watcher did not finish on shutdown");
            }
        });
        futures::future::join_all(waits).await;
        // The containers are removed, so nothing holds the workspace file systems.
        let images = self.workspace_images.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || images.unmount_all()).await {
            tracing::warn!(error = %e, "unmounting the workspaces failed");
        }
    }
}

/// Docker's resource settings for a user's limits (0 means unlimited).
struct ResourceLimits {
    memory: Option<i64>,
    nano_cpus: Option<i64>,
    pids: Option<i64>,
}

fn resource_limits(limits: &UserLimits) -> ResourceLimits {
    let positive = |v: i64| (v > 0).then_some(v);
    ResourceLimits {
        memory: positive(i64::try_from(limits.memory_bytes).unwrap_or(i64::MAX)),
        nano_cpus: positive((limits.cpus * 1e9).round() as i64),
        pids: positive(i64::try_from(limits.pids).unwrap_or(i64::MAX)),
    }
}

/// The kernel's command: records its pid (`$$`, kept by `exec`) so interrupts can find it,
/// runs the kernel under `tini -s` (a child subreaper that forwards signals to the kernel
/// and reaps zombies: see the module comment, "No process outlives its session"), and
/// sends its stderr to `/tmp` (the container's tmpfs: bounded, private to the user) to
/// explain a crash. Its stdout only carries ipykernel's connection banner (user output goes
/// to iopub), so it is dropped. IPython's history stays in memory: a file in the shared
/// workspace would make every kernel of the user queue on one SQLite lock.
fn kernel_command(dir: &str, privileged: bool) -> Vec<String> {
    // Without root, the broker connects to the kernel's sockets as "other".
    let umask = if privileged { "" } else { "umask 000; " };
    let script = format!(
        "{umask}echo $$ > {RUN_DIR_INSIDE}/{dir}/pid; exec {TINI_INSIDE} -s -- {PYTHON_INSIDE} \
         -m ipykernel_launcher -f {RUN_DIR_INSIDE}/{dir}/connection.json --HistoryManager.hist_file=:memory: \
         >/dev/null 2>{log}",
        log = kernel_log(dir)
    );
    vec!["sh".to_string(), "-c".to_string(), script]
}

fn kernel_log(dir: &str) -> String {
    format!("/tmp/kernel-{dir}.log")
}

/// The connection file (`ipc` transport; sockets `/run/kernel/<dir>/k-<port>`).
fn connection_file(spec: &LaunchSpec, dir: &str) -> serde_json::Value {
    fsutil::connection_file(spec, &format!("{RUN_DIR_INSIDE}/{dir}/k"))
}

/// The host-side endpoints of a session directory; fails if a socket path is too long.
fn endpoints_for(host_dir: &Path) -> Result<KernelEndpoints, String> {
    fsutil::ipc_endpoints(host_dir, MAX_SOCKET_PATH, |longest| {
        format!(
            "the socket path {longest} is too long ({} bytes; unix sockets allow {}); \
             configure a shorter run_dir or use a shorter user name",
            longest.len(),
            MAX_SOCKET_PATH - 1
        )
    })
}

/// What a launch writes on the host: the session directory and the connection file.
struct SessionFiles {
    dir: PathBuf,
    privileged: bool,
    connection: serde_json::Value,
}

impl SessionFiles {
    fn write(&self) -> Result<(), SandboxError> {
        // As root: the kernel's own directory. Otherwise world-writable, so the kernel can
        // create its sockets; the broker's 0700 runtime base keeps other host users out.
        let (mode, owner) = if self.privileged {
            (0o700, Some((KERNEL_UID, KERNEL_GID)))
        } else {
            (0o777, None)
        };
        std::fs::DirBuilder::new()
            .mode(mode)
            .create(&self.dir)
            .map_err(io_err(
                "cannot create the session's runtime directory",
                &self.dir,
            ))?;
        // The umask may have narrowed the mode.
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(mode)).map_err(
            io_err("cannot set the runtime directory's permissions", &self.dir),
        )?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&self.dir, Some(uid), Some(gid))
                .map_err(io_err("cannot chown the runtime directory", &self.dir))?;
        }
        let file_mode = if self.privileged { 0o600 } else { 0o644 };
        fsutil::write_connection_file(
            &self.dir,
            &self.connection,
            FileMode::Exact(file_mode),
            owner,
        )
    }
}

/// What a kernel's handle and its watcher share.
struct KernelShared {
    docker: Docker,
    session_id: Uuid,
    user: String,
    container: Arc<ContainerInfo>,
    /// The session directory's name (`/run/kernel/<dir>`).
    dir: String,
    host_dir: PathBuf,
    exec_id: String,
    /// Set before a requested kill, so the end reads as [`ExitReason::Terminated`].
    terminating: AtomicBool,
    /// Tells the watcher to kill the kernel.
    kill: CancellationToken,
    /// Set once by the watcher, after cleanup.
    exit: watch::Receiver<Option<ExitReason>>,
}

impl KernelShared {
    async fn wait(&self) -> ExitReason {
        super::wait_for_exit(
            &self.exit,
            "the broker stopped watching the kernel (runtime shut down)",
        )
        .await
    }

    fn has_exited(&self) -> bool {
        self.exit.borrow().is_some()
    }

    /// A shell snippet that sends `signal` to the kernel, only if the recorded pid still
    /// runs this kernel (pids are reused within the container).
    fn signal_script(&self, signal: &str) -> String {
        let dir = &self.dir;
        format!(
            "p=$(cat {RUN_DIR_INSIDE}/{dir}/pid 2>/dev/null) && [ -n \"$p\" ] && \
             grep -aqF {RUN_DIR_INSIDE}/{dir}/connection.json /proc/$p/cmdline 2>/dev/null && \
             kill -{signal} $p"
        )
    }
}

/// The handle the session layer holds. Dropping it kills the kernel.
struct DockerKernel {
    shared: Arc<KernelShared>,
}

#[async_trait]
impl KernelProcess for DockerKernel {
    async fn interrupt(&self) -> Result<(), SandboxError> {
        let shared = &self.shared;
        let fail = |why: String| SandboxError::Io {
            what: "cannot interrupt the kernel",
            path: shared.host_dir.join("pid"),
            source: io::Error::other(why),
        };
        if shared.has_exited() {
            return Err(fail("the kernel has exited".to_string()));
        }
        let script = shared.signal_script("INT");
        match timeout(
            EXEC_TIMEOUT,
            exec_output(&shared.docker, &shared.container.id, &["sh", "-c", &script]),
        )
        .await
        {
            Ok(Ok((0, _))) => {
                tracing::debug!(session = %shared.session_id, "sent SIGINT to the kernel");
                Ok(())
            }
            Ok(Ok((code, out))) => Err(fail(format!(
                "the kernel process is not running (kill exited with {code}: {})",
                out.trim()
            ))),
            Ok(Err(e)) => Err(fail(format!("docker exec failed: {}", error_text(&e)))),
            Err(_) => Err(fail(format!(
                "docker exec took longer than {EXEC_TIMEOUT:?}"
            ))),
        }
    }

    async fn wait(&self) -> ExitReason {
        self.shared.wait().await
    }

    async fn terminate(&self) {
        if self.shared.has_exited() {
            return;
        }
        self.shared.terminating.store(true, Ordering::SeqCst);
        self.shared.kill.cancel();
        if timeout(TERMINATE_TIMEOUT + EXEC_TIMEOUT, self.shared.wait())
            .await
            .is_err()
        {
            tracing::error!(
                session = %self.shared.session_id,
                user = %self.shared.user,
                "the kernel was not confirmed gone within {TERMINATE_TIMEOUT:?} of being killed"
            );
        }
    }
}

impl Drop for DockerKernel {
    fn drop(&mut self) {
        // Last resort: the watcher kills and cleans up; a no-op if the kernel has ended.
        self.shared.kill.cancel();
    }
}

/// Watches one kernel until it ends or is killed; then cleans up and publishes the reason.
async fn watch_kernel(
    inner: Arc<Inner>,
    shared: Arc<KernelShared>,
    exit_tx: watch::Sender<Option<ExitReason>>,
) {
    let docker = shared.docker.clone();
    let (reason, reaped) = loop {
        tokio::select! {
            () = sleep(POLL_INTERVAL) => {}
            () = shared.kill.cancelled() => {
                // On shutdown the whole container is being removed: nothing to reap one by
                // one, only the end to wait for.
                kill_kernel(&docker, &shared, !inner.shutdown.is_cancelled()).await;
                break (ExitReason::Terminated, true);
            }
        }
        match poll_exec(&docker, &shared).await {
            Poll::Running => continue,
            Poll::Ended(reason) => break (reason, false),
        }
    };
    let reason = if shared.terminating.load(Ordering::SeqCst) {
        ExitReason::Terminated
    } else {
        reason
    };
    let session = shared.session_id;
    match &reason {
        ExitReason::Terminated | ExitReason::Exited(0) => {
            tracing::info!(%session, user = %shared.user, %reason, "kernel ended");
        }
        _ => {
            let tail = kernel_log_tail(&docker, &shared).await;
            tracing::warn!(%session, user = %shared.user, %reason, last_output = %tail, "kernel ended");
        }
    }
    if !reaped && !inner.shutdown.is_cancelled() {
        // Ended by itself: what it started outlives it, reparented to PID 1.
        reap(&docker, &shared).await;
    }
    remove_dir_logged(shared.host_dir.clone()).await;
    lock(&inner.kernels).remove(&session);
    exit_tx.send_replace(Some(reason));
}

enum Poll {
    Running,
    Ended(ExitReason),
}

/// Asks the daemon about the kernel's exec; tolerates a silent daemon for [`DAEMON_GRACE`].
async fn poll_exec(docker: &Docker, shared: &KernelShared) -> Poll {
    let since = Instant::now();
    loop {
        match docker.inspect_exec(&shared.exec_id).await {
            Ok(exec) if exec.running == Some(true) => return Poll::Running,
            Ok(exec) => {
                return Poll::Ended(classify_exec_end(docker, shared, exec.exit_code).await)
            }
            // The exec is gone: the container was removed.
            Err(e) if status_of(&e) == Some(404) => {
                return Poll::Ended(
                    container_reason(docker, &shared.container)
                        .await
                        .unwrap_or_else(|| {
                            ExitReason::Lost("the user's container was removed".to_string())
                        }),
                )
            }
            Err(e) => {
                if since.elapsed() >= DAEMON_GRACE {
                    return Poll::Ended(ExitReason::Lost(format!(
                        "lost contact with the Docker daemon: {}",
                        error_text(&e)
                    )));
                }
                tracing::debug!(session = %shared.session_id, error = %error_text(&e), "cannot inspect the kernel's exec; retrying");
                tokio::select! {
                    () = sleep(Duration::from_secs(1)) => {}
                    () = shared.kill.cancelled() => return Poll::Running,
                }
            }
        }
    }
}

/// Why a kernel's exec ended: the container's end if the container stopped, else the
/// exec's exit code (see the module comment for how SIGKILL becomes OutOfMemory).
async fn classify_exec_end(
    docker: &Docker,
    shared: &KernelShared,
    exit_code: Option<i64>,
) -> ExitReason {
    if let Some(reason) = container_reason(docker, &shared.container).await {
        return reason;
    }
    let code = exit_code.unwrap_or(-1);
    if code == 128 + i64::from(libc::SIGKILL) {
        match oom_kills(docker, &shared.container.id).await {
            Some(count) => {
                if claim_oom(&shared.container, count) {
                    return ExitReason::OutOfMemory {
                        limit_bytes: shared.container.memory_limit,
                    };
                }
            }
            None => {
                // The counter is unreadable: maybe the container is going away right now.
                if let Some(reason) = container_reason(docker, &shared.container).await {
                    return reason;
                }
            }
        }
    }
    exit_reason_from_code(code)
}

/// Exit code of an exec'd process as a reason (Docker reports signal N as 128 + N).
fn exit_reason_from_code(code: i64) -> ExitReason {
    match code {
        129..=192 => ExitReason::Signaled((code - 128) as i32),
        c => ExitReason::Exited(i32::try_from(c).unwrap_or(-1)),
    }
}

/// Takes one not yet attributed OOM kill of the container, if there is one.
fn claim_oom(container: &ContainerInfo, count: u64) -> bool {
    let mut claimed = lock(&container.oom_claimed);
    if count > *claimed {
        *claimed += 1;
        true
    } else {
        false
    }
}

/// `Some(reason)` if the container no longer runs.
async fn container_reason(docker: &Docker, container: &ContainerInfo) -> Option<ExitReason> {
    match docker.inspect_container(&container.id, None).await {
        Ok(info) => {
            let state = info.state.as_ref()?;
            if state.running == Some(true) {
                return None;
            }
            if state.oom_killed == Some(true) {
                return Some(ExitReason::OutOfMemory {
                    limit_bytes: container.memory_limit,
                });
            }
            Some(ExitReason::Lost(format!(
                "the user's container stopped: {}",
                describe_state(&info)
            )))
        }
        Err(e) if status_of(&e) == Some(404) => Some(ExitReason::Lost(
            "the user's container was removed".to_string(),
        )),
        Err(_) => None,
    }
}

fn describe_state(info: &bollard::models::ContainerInspectResponse) -> String {
    let Some(state) = &info.state else {
        return "state unknown".to_string();
    };
    let mut text = state
        .status
        .map(|s| s.to_string())
        .unwrap_or_else(|| "unknown".to_string());
    if let Some(code) = state.exit_code {
        text.push_str(&format!(", exit code {code}"));
    }
    if state.oom_killed == Some(true) {
        text.push_str(", out of memory");
    }
    if let Some(err) = state.error.as_deref().filter(|e| !e.is_empty()) {
        text.push_str(&format!(", {err}"));
    }
    text
}

/// The container's OOM-kill counter, read from its own cgroup (v2, then v1).
async fn oom_kills(docker: &Docker, container: &str) -> Option<u64> {
    let script = "cat /sys/fs/cgroup/memory.events 2>/dev/null || \
                  cat /sys/fs/cgroup/memory/memory.oom_control";
    let (code, out) = timeout(
        EXEC_TIMEOUT,
        exec_output(docker, container, &["sh", "-c", script]),
    )
    .await
    .ok()?
    .ok()?;
    if code != 0 {
        return None;
    }
    parse_oom_kill(&out)
}

/// The `oom_kill N` line of `memory.events` (v2) or `memory.oom_control` (v1).
fn parse_oom_kill(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some("oom_kill"))
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

/// Kills the kernel with everything it started (see [`reap`]) unless `reap_first` is false,
/// and waits until Docker reports the exec ended (or the container gone). Errors only
/// logged: the container may be going away at the same time.
async fn kill_kernel(docker: &Docker, shared: &KernelShared, reap_first: bool) {
    if reap_first {
        reap(docker, shared).await;
    }
    let deadline = Instant::now() + TERMINATE_TIMEOUT;
    while Instant::now() < deadline {
        match docker.inspect_exec(&shared.exec_id).await {
            Ok(exec) if exec.running == Some(true) => {}
            Ok(_) => return,
            Err(e) if status_of(&e) == Some(404) => return,
            Err(e) => tracing::debug!(error = %error_text(&e), "inspecting a killed kernel failed"),
        }
        sleep(Duration::from_millis(100)).await;
    }
    tracing::warn!(session = %shared.session_id, "the kernel's exec still runs after SIGKILL");
}

/// The reaper, run by the container's python (`-I -S`: no site, no current directory on
/// the path, since `/workspace` is the kernel's) as the kernels' uid. Arguments: the ended
/// kernel's connection file and log. It kills, until a scan of `/proc` finds none left:
/// the process subtree of the exec whose argv holds that connection file (exec processes
/// have parent 0 in the container's pid namespace; a kernel cannot make one), and every
/// descendant of PID 1 except its first child (the container's `sleep infinity`, started
/// before any exec, so no later process can have an earlier start time). Each round
/// stops every target before killing any, so a forking process cannot outrun it; zombies
/// are skipped (their parent reaps them). Prints `killed rounds`, exits 2 if processes
/// were still appearing after the time limit.
const REAPER: &str = r#"
import os, signal, sys, time
conn, log, limit = sys.argv[1].encode(), sys.argv[2], float(sys.argv[3])
me = os.getpid()
def scan():
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(b")") + 2:].split()
        procs[int(name)] = (rest[0], int(rest[1]), int(rest[19]))
    return procs
def targets():
    procs = scan()
    children = {}
    for pid, (_, ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    roots = []
    for pid in children.get(0, []):
        if pid in (1, me):
            continue
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if conn in argv:
            roots.append(pid)
    orphans = sorted(children.get(1, []), key=lambda p: (procs[p][2], p))
    roots += orphans[1:]
    found, stack = [], roots
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        if procs[pid][0] != b"Z":
            found.append(pid)
    return found
def send(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
try:
    os.unlink(log)
except OSError:
    pass
killed, rounds, deadline = set(), 0, time.monotonic() + limit
while True:
    found = targets()
    if not found:
        break
    send(found, signal.SIGSTOP)
    send(found, signal.SIGKILL)
    killed.update(found)
    rounds += 1
    if time.monotonic() > deadline:
        print(len(killed), rounds, "still", len(found))
        sys.exit(2)
    time.sleep(0.01)
print(len(killed), rounds)
"#;

/// Runs [`REAPER`] in the kernel's container for this kernel, one reaper per container at
/// a time. Called when a kernel is killed and when it ended by itself (then only its
/// orphans are left). Failures are logged: a removed container has nothing left to reap.
async fn reap(docker: &Docker, shared: &KernelShared) {
    let conn = format!("{RUN_DIR_INSIDE}/{}/connection.json", shared.dir);
    let log = kernel_log(&shared.dir);
    let limit = REAP_LIMIT_SECS.to_string();
    let cmd = [PYTHON_INSIDE, "-I", "-S", "-c", REAPER, &conn, &log, &limit];
    let _serial = shared.container.reaping.lock().await;
    let started = Instant::now();
    let limit = EXEC_TIMEOUT + Duration::from_secs(u64::from(REAP_LIMIT_SECS));
    match timeout(limit, exec_output(docker, &shared.container.id, &cmd)).await {
        Ok(Ok((0, out))) => tracing::debug!(
            session = %shared.session_id,
            killed_rounds = %out.trim(),
            ms = started.elapsed().as_millis() as u64,
            "reaped the kernel's processes"
        ),
        Ok(Ok((code, out))) => {
            if container_reason(docker, &shared.container).await.is_some() {
                // The container is gone (removed under the reaper): nothing is left.
                tracing::debug!(session = %shared.session_id, code, "reaper ended with its container");
            } else {
                tracing::warn!(
                    session = %shared.session_id,
                    code,
                    output = %out.trim(),
                    "the reaper did not reach a fixed point; processes of the session may be left"
                );
            }
        }
        Ok(Err(e)) => {
            tracing::debug!(session = %shared.session_id, error = %error_text(&e), "reaper exec failed")
        }
        Err(_) => tracing::warn!(session = %shared.session_id, "the reaper exec timed out"),
    }
}

/// The end of a dead kernel's stdout/stderr (from the container's `/tmp`), then removes it.
async fn kernel_log_tail(docker: &Docker, shared: &KernelShared) -> String {
    let log = kernel_log(&shared.dir);
    let script = format!("tail -c {LOG_TAIL_BYTES} {log} 2>/dev/null; rm -f {log}");
    match timeout(
        EXEC_TIMEOUT,
        exec_output(docker, &shared.container.id, &["sh", "-c", &script]),
    )
    .await
    {
        Ok(Ok((_, out))) => out.trim().replace('\n', " | "),
        _ => String::new(),
    }
}

/// Runs a command in the container and collects its output (cut at [`MAX_EXEC_OUTPUT`])
/// and exit code.
async fn exec_output(
    docker: &Docker,
    container: &str,
    cmd: &[&str],
) -> Result<(i64, String), DockerError> {
    let exec = docker
        .create_exec(
            container,
            CreateExecOptions {
                cmd: Some(cmd.iter().map(|s| s.to_string()).collect()),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            },
        )
        .await?;
    let mut text = Vec::new();
    if let StartExecResults::Attached { mut output, .. } = docker.start_exec(&exec.id, None).await?
    {
        while let Some(chunk) = output.next().await {
            let bytes = chunk?.into_bytes();
            let room = MAX_EXEC_OUTPUT.saturating_sub(text.len());
            text.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
    }
    let code = docker.inspect_exec(&exec.id).await?.exit_code.unwrap_or(-1);
    Ok((code, String::from_utf8_lossy(&text).into_owned()))
}

/// The HTTP status of a daemon's error answer.
fn status_of(e: &DockerError) -> Option<u16> {
    match e {
        DockerError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// An error with its chain of causes (hyper's errors say little at the top).
fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The socket's file path from a path or `unix://` URL.
fn socket_path(socket: &str) -> Result<String, SandboxError> {
    let path = socket.strip_prefix("unix://").unwrap_or(socket);
    if path.contains("://") || !path.starts_with('/') {
        return Err(unavailable(format!(
            "the Docker socket {socket:?} is not a unix socket path; use e.g. \
             /var/run/docker.sock or unix:///run/podman/podman.sock"
        )));
    }
    Ok(path.to_string())
}

/// Picks the runtime base directory (see [`DockerSandboxConfig::run_dir`]).
fn choose_run_base(
    cfg: &DockerSandboxConfig,
    hash: &str,
    privileged: bool,
    euid: u32,
) -> Result<PathBuf, SandboxError> {
    let layout = fsutil::RunBaseLayout {
        backend: BACKEND,
        data_dir: &cfg.data_dir,
        run_dir: cfg.run_dir.as_deref(),
        default_name: "run-docker",
        fallback_name: "kernel-broker-docker",
        // `/<user>/<dir>/k-5`
        room: 1 + USER_NAME_BUDGET + 1 + SESSION_DIR_LEN + 4,
        max_socket_path: MAX_SOCKET_PATH,
    };
    fsutil::choose_run_base(&layout, hash, privileged, euid)
}

/// Removes everything inside `dir` (an earlier run's per-user runtime directories).
fn empty_dir(dir: &Path) -> Result<usize, SandboxError> {
    let entries = std::fs::read_dir(dir).map_err(|source| SandboxError::Io {
        what: "cannot list the runtime directory",
        path: dir.to_path_buf(),
        source,
    })?;
    let mut removed = 0;
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let result = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        match result {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale runtime entry")
            }
        }
    }
    Ok(removed)
}

/// The user's runtime directory, mounted at `/run/kernel`: the kernel needs to reach (not
/// list or write) it; session directories inside it are the kernel's.
fn prepare_user_run_dir(dir: &Path) -> Result<(), SandboxError> {
    let err = |what: &'static str| io_err(what, dir);
    match std::fs::DirBuilder::new().mode(0o711).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err("cannot create the user's runtime directory")(e)),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .map_err(err("cannot set the runtime directory's permissions"))
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
    fn oom_kill_counters_parse_for_both_cgroup_versions() {
        let v2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kill(v2), Some(2));
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n";
        assert_eq!(parse_oom_kill(v1), Some(5));
        // Kernels before 4.13 have no counter in memory.oom_control.
        assert_eq!(parse_oom_kill("oom_kill_disable 0\nunder_oom 0\n"), None);
        assert_eq!(parse_oom_kill(""), None);
    }

    #[test]
    fn exec_exit_codes_map_to_reasons() {
        assert_eq!(exit_reason_from_code(0), ExitReason::Exited(0));
        assert_eq!(exit_reason_from_code(3), ExitReason::Exited(3));
        assert_eq!(exit_reason_from_code(128), ExitReason::Exited(128));
        assert_eq!(exit_reason_from_code(130), ExitReason::Signaled(2));
        assert_eq!(exit_reason_from_code(137), ExitReason::Signaled(9));
        assert_eq!(exit_reason_from_code(255), ExitReason::Exited(255));
        assert_eq!(exit_reason_from_code(-1), ExitReason::Exited(-1));
    }

    #[test]
    fn each_oom_kill_is_claimed_once() {
        let c = ContainerInfo {
            id: "x".into(),
            name: "x".into(),
            memory_limit: 1,
            oom_claimed: Mutex::new(0),
            reaping: tokio::sync::Mutex::new(()),
        };
        assert!(!claim_oom(&c, 0));
        assert!(claim_oom(&c, 2));
        assert!(claim_oom(&c, 2));
        assert!(!claim_oom(&c, 2));
        assert!(claim_oom(&c, 3));
    }

    #[test]
    fn sockets_are_paths_or_unix_urls() {
        assert_eq!(
            socket_path("/var/run/docker.sock").unwrap(),
            "/var/run/docker.sock"
        );
        assert_eq!(
            socket_path("unix:///run/podman/podman.sock").unwrap(),
            "/run/podman/podman.sock"
        );
        assert!(socket_path("tcp://127.0.0.1:2375").is_err());
        assert!(socket_path("docker.sock").is_err());
    }

    #[test]
    fn endpoints_are_host_paths_and_bounded() {
        let ep = endpoints_for(Path::new("/var/lib/kb/run-docker/alice/0123456789ab")).unwrap();
        assert_eq!(
            ep.shell,
            "ipc:///var/lib/kb/run-docker/alice/0123456789ab/k-1"
        );
        assert_eq!(ep.hb, "ipc:///var/lib/kb/run-docker/alice/0123456789ab/k-5");
        let long = Path::new("/").join("x".repeat(90)).join("0123456789ab");
        assert!(endpoints_for(&long).unwrap_err().contains("too long"));
    }

    #[test]
    fn connection_files_point_into_the_session_directory() {
        let spec = LaunchSpec {
            session_id: Uuid::nil(),
            user: SandboxUser {
                name: "u".into(),
                index: 0,
                limits: Default::default(),
            },
            kernel_name: "python3".into(),
            key: "abc".into(),
            env: vec![],
        };
        let c = connection_file(&spec, "0123456789ab");
        assert_eq!(c["transport"], "ipc");
        assert_eq!(c["ip"], "/run/kernel/0123456789ab/k");
        assert_eq!(c["key"], "abc");
        assert_eq!(c["signature_scheme"], "hmac-sha256");
        let cmd = kernel_command("0123456789ab", true);
        assert_eq!(cmd[..2], ["sh", "-c"]);
        assert!(cmd[2].starts_with("echo $$ > /run/kernel/0123456789ab/pid; exec "));
        assert!(kernel_command("d", false)[2].starts_with("umask 000; "));
    }

    #[test]
    fn limits_map_to_docker_settings() {
        let l = resource_limits(&UserLimits {
            memory_bytes: 1 << 30,
            cpus: 1.5,
            pids: 256,
            workspace_quota_bytes: 0,
        });
        assert_eq!(l.memory, Some(1 << 30));
        assert_eq!(l.nano_cpus, Some(1_500_000_000));
        assert_eq!(l.pids, Some(256));
        let none = resource_limits(&UserLimits {
            memory_bytes: 0,
            cpus: 0.0,
            pids: 0,
            workspace_quota_bytes: 0,
        });
        assert_eq!((none.memory, none.nano_cpus, none.pids), (None, None, None));
    }

    #[test]
    fn run_base_falls_back_when_socket_paths_would_be_too_long() {
        let short = DockerSandboxConfig::new("/var/lib/kernel-broker");
        assert_eq!(
            choose_run_base(&short, "abcd1234", true, 0).unwrap(),
            PathBuf::from("/var/lib/kernel-broker/run-docker")
        );
        let long = DockerSandboxConfig::new(format!("/srv/{}", "d".repeat(60)));
        assert_eq!(
            choose_run_base(&long, "abcd1234", true, 0).unwrap(),
            PathBuf::from("/run/kernel-broker-docker-abcd1234")
        );
        let mut explicit = long.clone();
        explicit.run_dir = Some(PathBuf::from(format!("/{}", "r".repeat(70))));
        assert!(choose_run_base(&explicit, "abcd1234", true, 0).is_err());
    }

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
