//! The local sandbox: kernels in Linux namespaces (bubblewrap) under cgroup limits.
//!
//! This module owns everything a kernel needs on this host: the user's persistent
//! workspace (`<data_dir>/workspaces/<user>`), a runtime directory per launch holding the
//! connection file and the ZeroMQ `ipc://` sockets, the `bwrap` command line that builds the
//! kernel's view of the file system, and the process's life from spawn to reaping.
//!
//! What a kernel sees: `/usr` and its Python (at `/opt/kernel-venv`, `python.rs`) read-only,
//! a tiny `/etc`, a private `/proc`, `/dev`, `/tmp` and home (tmpfs), its workspace at
//! `/workspace` and its runtime directory at `/run/kernel`. Nothing else of the host: not `/root`, `/home`, `/var`, `/srv`,
//! nor the broker's own tree (except the kernels' venv). The network namespace is empty
//! (loopback only); the kernel talks to the broker through sockets in `/run/kernel`. Every
//! kernel runs under a seccomp filter ([`super::seccomp`]): no namespaces, mounts, ptrace,
//! bpf, io_uring and the like. `/proc/self/mountinfo` shows where each bind came from on
//! the host, so as root the runtime directories live under `/run`, not in the data directory
//! (see [`LocalSandboxConfig::run_dir`]).
//!
//! Two modes, chosen by who runs the broker:
//!
//! - **root**: each user's kernels run as a host uid of their own (`uid_base + index + 1`),
//!   with no capabilities and `no_new_privs` (via `setpriv` inside the sandbox); the user's
//!   limits are enforced with cgroups ([`super::cgroup`], v1 or v2).
//! - **unprivileged**: `bwrap --unshare-user`; kernels run as the broker's uid; limits need a
//!   delegated cgroup v2 subtree. Without one, [`LocalSandboxConfig::require_limits`] decides
//!   between refusing to start and running without limits.
//!
//! Process shape: the broker spawns `bwrap` (host pid A), which clones the sandbox's init
//! (B, pid 1 inside; its host pid comes from `--info-fd`), which forks the kernel (C, pid 2
//! inside). A is placed in the user's leaf cgroup between `fork` and `exec`, so everything
//! after it is too. One reaper task per kernel owns A's `Child`, classifies the exit (reading
//! the leaf's OOM counter), removes the leaf and the runtime directory, and only then
//! publishes the [`ExitReason`](super::ExitReason): once `wait` returns, nothing is left.
//!
//! Layout: this file holds the configuration, [`LocalSandbox`] and its [`Sandbox`]
//! implementation; `bwrap.rs` the pure argv and mount plan; `files.rs` a launch's host
//! files and runtime base; `process.rs` the launch and spawn; `reaper.rs` the kernel's
//! handle half and its reaper; `output.rs` log forwarding; `host.rs` what is learned of
//! the host once; `python.rs` where kernels find their Python; `check.rs` the startup test run; `terminal.rs` a command's pseudo-terminal; `fork.rs` a live kernel's fork adopted. Limits are [`super::cgroup`]'s.

mod adopt;
mod bwrap;
mod carry;
mod check;
mod checkpoint;
mod command;
mod config;
mod copy;
mod files;
mod fork;
mod host;
mod keep;
mod launch;
mod output;
mod own;
mod pause;
mod process;
mod python;
mod reaper;
mod snapshot;
mod startup;
mod template;
mod terminal;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::OnceCell;

use self::bwrap::BwrapOptions;
pub use self::config::{instance_defaults, LocalSandboxConfig};
use self::files::{choose_run_base, is_safe_component, sweep_run_base, workspace_owner};
use self::host::{discover_python, find_program, unavailable, unavailable_by};
use self::process::SandboxCommand;
use self::reaper::LocalKernel;
use super::boot;
use super::cgroup::{Cgroups, DetectError};
use super::fsutil::{self, absolute, launch_err};
use super::own_workspace::OwnWorkspaces;
use super::seccomp::SyscallFilter;
use super::watched::KernelTable;
use super::workspace_fs::WorkspaceImages;
use super::LaunchRefusal;
use super::{AdoptError, AdoptSpec, LaunchSpec, Launched, Sandbox, SandboxError, SandboxUser};
use crate::kernel::spec::KernelSpecs;
use crate::sandbox::workspace_fs::prepare_workspace;

pub(super) const BACKEND: &str = "local";
/// Where the runtime directory appears inside the sandbox.
pub(super) const RUN_DIR_INSIDE: &str = "/run/kernel";
/// Where the bootstrap script is shown, read-only, from the runtime base's
/// [`BOOT_DIR_NAME`]: a directory only the broker writes (never the kernel's runtime
/// directory, which the kernel can write and which would be its `sys.path[0]`).
pub(super) const BOOT_DIR_INSIDE: &str = "/opt/kernel-broker";
/// The bootstrap script's directory in the runtime base (swept by no one: not a session's).
pub(super) const BOOT_DIR_NAME: &str = "boot";
/// The kernel's environment as a shell script, read after the drop (`environ.rs`).
pub(super) const ENV_FILE_INSIDE: &str = "/etc/kernel-broker.env";
/// The connection file inside the sandbox.
pub(super) const CONNECTION_FILE_INSIDE: &str = "/run/kernel/connection.json";
/// The `ip` of the connection file: ipykernel binds `ipc://{ip}-{port}`.
pub(super) const IPC_BASE_INSIDE: &str = "/run/kernel/k";
/// The workspace inside the sandbox (also `$HOME`).
pub(super) const WORKSPACE_INSIDE: &str = "/workspace";
/// The kernel's `HOME` (a tmpfs: its caches stay out of the workspace), as in the Docker
/// image.
pub(super) const HOME_INSIDE: &str = "/home/kernel";
/// The sandbox's host name.
pub(super) const HOSTNAME: &str = "kernel";
/// How long `terminate` waits for the kill and the cleanup.
pub(super) const TERMINATE_TIMEOUT: Duration = Duration::from_secs(15);

/// The local sandbox backend.
pub struct LocalSandbox {
    cfg: LocalSandboxConfig,
    privileged: bool,
    bwrap: PathBuf,
    /// What every bwrap command line of this sandbox shares (mode, uid switch, bwrap's
    /// features, the Python installation).
    bwrap_opts: BwrapOptions,
    /// The syscall filter bwrap installs on every kernel; `None` on an architecture we
    /// have no filter for (see [`super::seccomp`]).
    seccomp: Option<SyscallFilter>,
    /// The kernels' Python (its `bin` goes first on the kernel's `PATH`).
    venv: python::KernelPython,
    specs: Arc<KernelSpecs>,
    run_base: PathBuf,
    workspaces: PathBuf,
    /// The workspaces' file systems (the per-user disk quota).
    workspace_images: Arc<WorkspaceImages>,
    /// Sessions' own workspaces (`own_workspace.rs`).
    own_workspaces: Arc<OwnWorkspaces>,
    cgroups: Result<Arc<Cgroups>, DetectError>,
    /// Startup work (cgroup setup, sweeping what an earlier run left), done once before the
    /// first launch; holds the cgroups to use (none when limits are off).
    started: OnceCell<Option<Arc<Cgroups>>>,
    kernels: KernelTable<LocalKernel>,
    /// The kept kernels' files (`--keep-sessions`); `None` when kernels end with the broker.
    kept: Option<Arc<keep::KeptKernels>>,
    /// The fork-server templates, by user and kernel spec.
    templates: Arc<template::Templates>,
    /// What copying a kernel into a sandbox of its own runs (`copy.rs`), found at the first
    /// copy; or why it cannot be done here.
    copy_tools:
        OnceCell<Result<crate::sandbox::criu::CopyTools, crate::sandbox::criu::NoCopyTools>>,
    /// The room copies under way hold for their images (`criu/room.rs`).
    copy_room: Arc<crate::sandbox::criu::CopyRoom>,
    /// Paused kernels and snapshots an earlier run left, found at startup.
    found: super::pause::FoundImages,
}

impl LocalSandbox {
    /// Discovers what the sandbox needs: `bwrap` (and `setpriv` as root), the interpreter's
    /// installation, the kernel specs, the cgroup hierarchies. Runs the interpreter once, so
    /// it blocks for a moment; call it before serving.
    pub fn new(cfg: LocalSandboxConfig) -> Result<Self, SandboxError> {
        let mut cfg = cfg;
        cfg.data_dir = absolute(&cfg.data_dir)?;
        cfg.kernels_dir = absolute(&cfg.kernels_dir)?;
        cfg.python = absolute(&cfg.python)?;
        if let Some(dir) = &cfg.run_dir {
            cfg.run_dir = Some(absolute(dir)?);
        }
        // SAFETY: geteuid(2) cannot fail and has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let privileged = euid == 0;
        if privileged && cfg.uid_base < 1000 {
            return Err(unavailable(format!(
                "uid_base {} would map kernels onto system accounts; use 100000 or more",
                cfg.uid_base
            )));
        }

        let bwrap = find_program("bwrap").ok_or_else(|| {
            unavailable("bwrap (bubblewrap) is not installed; install the `bubblewrap` package")
        })?;
        let help = std::process::Command::new(&bwrap)
            .arg("--help")
            .output()
            .map_err(|e| unavailable_by(format!("cannot run {}: {e}", bwrap.display()), e))?;
        let help = String::from_utf8_lossy(&help.stdout);
        let setpriv = if privileged {
            let path = find_program("setpriv")
                .filter(|p| p.starts_with("/usr"))
                .ok_or_else(|| {
                    unavailable(
                        "setpriv (util-linux) is not installed under /usr; it drops the \
                         kernel's privileges inside the sandbox",
                    )
                })?;
            Some(path)
        } else {
            None
        };

        let venv = discover_python(&cfg.python)?;
        let specs = match &cfg.kernel_specs {
            Some(specs) => specs.clone(),
            None => Arc::new(
                KernelSpecs::load(&cfg.kernels_dir)
                    .map_err(|e| unavailable_by(e.to_string(), e))?,
            ),
        };
        let run_base = choose_run_base(&cfg, privileged, euid)?;
        let workspaces = cfg.data_dir.join("workspaces");
        for path in &cfg.extra_ro_binds {
            if !path.is_absolute() || !path.exists() {
                tracing::warn!(path = %path.display(), "extra read-only bind is not an existing absolute path; skipped");
            }
        }
        let cgroups = Cgroups::detect(&cfg.cgroup_name, privileged).map(Arc::new);
        let seccomp = SyscallFilter::for_host().map_err(|e| {
            unavailable_by(
                format!("cannot compile the kernels' syscall filter: {e}"),
                e,
            )
        })?;
        if seccomp.is_none() {
            tracing::warn!(
                arch = std::env::consts::ARCH,
                "no syscall filter for this architecture: kernels run WITHOUT one (namespaces, \
                 mounts, ptrace, bpf, io_uring and the rest stay open to them)"
            );
        }

        Ok(Self {
            privileged,
            bwrap,
            bwrap_opts: BwrapOptions {
                privileged,
                setpriv,
                has_size: help.contains("--size"),
                has_disable_userns: help.contains("--disable-userns"),
                python: venv.clone(),
                die_with_parent: !cfg.keep_kernels,
                tools_dir: Some(run_base.join(super::sudo::TOOLS_DIR_NAME)),
            },
            seccomp,
            venv,
            specs,
            run_base,
            workspace_images: Arc::new(WorkspaceImages::new(BACKEND, &workspaces, privileged)),
            own_workspaces: Arc::new(OwnWorkspaces::new(BACKEND, &cfg.data_dir, privileged)),
            workspaces,
            cgroups,
            started: OnceCell::new(),
            kernels: KernelTable::default(),
            kept: cfg
                .keep_kernels
                .then(|| Arc::new(keep::KeptKernels::new(&cfg.data_dir))),
            templates: Arc::new(template::Templates::default()),
            copy_tools: OnceCell::new(),
            copy_room: Default::default(),
            found: Default::default(),
            cfg,
        })
    }

    /// The directory holding the runtime directories of launched kernels.
    pub fn run_base(&self) -> &Path {
        &self.run_base
    }

    /// Under /run (root) the base is outside the data directory: leave nothing behind. The
    /// bootstrap script's directory goes (the broker's own; a template reads the script only
    /// when it starts), then the base if that left it empty (a kept kernel's runtime
    /// directory stays, and so does the base); the next start creates them again.
    fn remove_run_base(&self) {
        let _ = std::fs::remove_dir_all(self.run_base.join(BOOT_DIR_NAME));
        let _ = std::fs::remove_dir_all(self.run_base.join(super::sudo::TOOLS_DIR_NAME));
        let _ = std::fs::remove_dir(&self.run_base);
    }

    /// Names of the kernel specs found in `kernels_dir`, the default first.
    pub fn kernel_names(&self) -> Vec<String> {
        self.specs.names()
    }

    /// Launches `argv` in the sandbox instead of the kernel spec's command, with everything
    /// else as for a kernel (workspace, runtime directory and connection file, cgroup leaf,
    /// uid). An `argv[0]` of `python` means the kernels' interpreter. For tests.
    #[doc(hidden)]
    pub async fn launch_command(
        &self,
        spec: LaunchSpec,
        argv: Vec<String>,
    ) -> Result<Launched, SandboxError> {
        let cgroups = self.startup().await?;
        let argv = self.substitute_argv(&argv, None);
        let command = SandboxCommand {
            argv,
            env: HashMap::new(),
            resource_dir: None,
        };
        self.launch_argv(spec, command, cgroups).await
    }

    /// The host uid and gid a user's kernels run as (root mode only).
    fn kernel_ids(&self, user: &SandboxUser) -> Result<Option<(u32, u32)>, SandboxError> {
        if !self.privileged {
            return Ok(None);
        }
        let id = self
            .cfg
            .uid_base
            .checked_add(user.index)
            .and_then(|id| id.checked_add(1))
            .ok_or_else(|| launch_err(user, LaunchRefusal::UidOverflow))?;
        Ok(Some((id, id)))
    }

    fn workspace_path(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        if !is_safe_component(&user.name) {
            return Err(launch_err(
                user,
                LaunchRefusal::UserNameNotADirectory(user.name.clone()),
            ));
        }
        Ok(self.workspaces.join(&user.name))
    }
}

#[async_trait]
impl Sandbox for LocalSandbox {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn launch_timeout(&self) -> std::time::Duration {
        self.cfg.launch_timeout
    }

    async fn check(&self) -> Result<(), SandboxError> {
        self.startup().await?;
        self.smoke_test().await
    }

    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, SandboxError> {
        self.launch_kernel(spec).await
    }

    fn workspace(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        let path = self.workspace_path(user)?;
        let quota = (&*self.workspace_images, user.limits.workspace_quota_bytes);
        prepare_workspace(&path, workspace_owner(self.kernel_ids(user)?), Some(quota))?;
        Ok(path)
    }

    fn own_workspace(
        &self,
        user: &SandboxUser,
        key: uuid::Uuid,
    ) -> Result<Option<PathBuf>, SandboxError> {
        self.prepare_own(user, key).map(Some)
    }

    async fn remove_own_workspace(&self, user: &SandboxUser, key: uuid::Uuid) {
        self.remove_own(user, key).await;
    }

    /// The user's kernel uid as root (uploads must be the kernel's to overwrite and
    /// delete); without root kernels run as the broker's uid, which owns what it writes.
    fn workspace_owner(&self, user: &SandboxUser) -> Option<(u32, u32)> {
        self.kernel_ids(user).ok().flatten()
    }

    fn keeps_kernels(&self) -> bool {
        self.kept.is_some()
    }

    async fn adopt(&self, spec: AdoptSpec) -> Result<Launched, AdoptError> {
        let cgroups = self.startup().await?;
        let kept = self.kept.as_ref().ok_or(AdoptError::Missing)?;
        self.adopt_kept(kept, cgroups, spec).await
    }

    async fn discard_unadopted(&self) {
        let Some(kept) = &self.kept else { return };
        let Ok(cgroups) = self.startup().await else {
            return;
        };
        self.discard_kept(kept, cgroups).await;
    }

    async fn prepare_fork(
        &self,
        parent: &dyn super::KernelProcess,
        spec: LaunchSpec,
    ) -> Result<super::fork::PreparedFork, super::fork::ForkError> {
        self.prepare_kernel_fork(parent, spec).await
    }

    async fn adopt_fork(
        &self,
        prepared: super::fork::PreparedFork,
        pid: i64,
    ) -> Result<Launched, super::fork::ForkError> {
        self.adopt_kernel_fork(prepared, pid).await
    }

    async fn prepare_checkpoint(
        &self,
        parent: &dyn super::KernelProcess,
        spec: LaunchSpec,
    ) -> Result<super::fork::PreparedFork, super::fork::ForkError> {
        self.prepare_held_checkpoint(parent, spec).await
    }

    async fn adopt_checkpoint(
        &self,
        prepared: super::fork::PreparedFork,
        pid: i64,
    ) -> Result<super::fork::HeldCheckpoint, super::fork::ForkError> {
        self.adopt_held_checkpoint(prepared, pid).await
    }

    async fn discard_fork(&self, prepared: super::fork::PreparedFork) {
        if prepared.pause {
            return fsutil::remove_dir_logged(prepared.dir).await;
        }
        if prepared.origin.own_workspace.is_some() {
            return self.discard_copy(prepared).await;
        }
        fork::remove_fork_dir(prepared.dir).await;
    }

    async fn prepare_pause(
        &self,
        kernel: &dyn super::KernelProcess,
        spec: LaunchSpec,
    ) -> Result<super::fork::PreparedFork, super::fork::ForkError> {
        self.prepare_kernel_pause(kernel, spec).await
    }

    async fn dump_paused(
        &self,
        prepared: super::fork::PreparedFork,
        pid: i64,
    ) -> Result<super::pause::PausedImage, super::fork::ForkError> {
        self.dump_kernel_held(prepared, pid).await
    }

    async fn resume_paused(
        &self,
        image: &super::pause::PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, super::fork::ForkError> {
        self.resume_kernel(image, spec).await
    }

    fn paused_kernel_ends_after_answer(&self) -> bool {
        // A resumed kernel has a kernel id, a runtime directory and a leaf of its own.
        true
    }

    fn keeps_paused(&self) -> bool {
        true
    }

    fn carry(&self) -> Option<&dyn super::carry::SandboxCarry> {
        self.privileged.then_some(self as _)
    }

    async fn paused_images(&self) -> Vec<super::pause::PausedImage> {
        self.found
            .take_after(self.startup(), super::pause::Found::Paused)
            .await
    }

    async fn prepare_snapshot(
        &self,
        kernel: &dyn super::KernelProcess,
        spec: LaunchSpec,
    ) -> Result<super::fork::PreparedFork, super::fork::ForkError> {
        self.prepare_kernel_snapshot(kernel, spec).await
    }

    async fn start_from_snapshot(
        &self,
        image: &super::pause::PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, super::fork::ForkError> {
        self.start_kernel_from_snapshot(image, spec).await
    }

    async fn snapshot_images(&self) -> Vec<super::pause::PausedImage> {
        self.found
            .take_after(self.startup(), super::pause::Found::Snapshots)
            .await
    }

    async fn discard_snapshot(&self, image: super::pause::PausedImage) {
        self.discard_kernel_snapshot(image).await
    }

    async fn run_command(
        &self,
        spec: super::command::CommandSpec,
    ) -> Result<super::command::RunningCommand, SandboxError> {
        self.start_command(spec).await
    }

    async fn user_idle(&self, user: &SandboxUser) {
        let launches = self.templates.launches(&user.name);
        if self.cfg.template_idle.is_zero() {
            self.templates.end_idle(&user.name, launches).await;
        } else {
            let (templates, name, grace) = (
                self.templates.clone(),
                user.name.clone(),
                self.cfg.template_idle,
            );
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                templates.end_idle(&name, launches).await;
            });
        }
        if let Some(Some(cgroups)) = self.started.get() {
            cgroups.remove_user_if_unused(&user.name);
        }
    }

    async fn shutdown(&self) {
        if self.kept.is_some() {
            // `--keep-sessions`: the kernels outlive the broker, with their leaves, runtime
            // directories and workspace mounts; the next run adopts them.
            let released = self.kernels.release_all();
            self.workspace_images.keep_mounted();
            self.own_workspaces.keep_mounted();
            // Only what no kept kernel uses goes.
            if let Some(Some(cgroups)) = self.started.get() {
                cgroups.remove_base_if_unused();
            }
            self.remove_run_base();
            tracing::info!(
                kernels = released,
                "kernels kept running for the next start"
            );
            return;
        }
        let kernels = self.kernels.terminate_all();
        KernelTable::wait_all(&kernels, TERMINATE_TIMEOUT).await;
        self.templates.shutdown().await;
        if let Some(Some(cgroups)) = self.started.get() {
            cgroups.remove_all().await;
        }
        self.remove_run_base();
        // The kernels are gone, so nothing holds the workspace file systems.
        let (images, own) = (self.workspace_images.clone(), self.own_workspaces.clone());
        let unmounted = tokio::task::spawn_blocking(move || {
            images.unmount_all();
            own.unmount_all();
        });
        if let Err(e) = unmounted.await {
            tracing::warn!(error = %e, "unmounting the workspaces failed");
        }
    }
}
