//! The local sandbox: kernels in Linux namespaces (bubblewrap) under cgroup limits.
//!
//! This module owns everything a kernel needs on this host: the user's persistent
//! workspace (`<data_dir>/workspaces/<user>`), a runtime directory per launch holding the
//! connection file and the ZeroMQ `ipc://` sockets, the `bwrap` command line that builds the
//! kernel's view of the file system, and the process's life from spawn to reaping.
//!
//! What a kernel sees: `/usr` (and the Python installation) read-only, a tiny `/etc`, a
//! private `/proc`, `/dev` and `/tmp` (tmpfs), its workspace at `/workspace` and its runtime
//! directory at `/run/kernel`. Nothing else of the host: not `/root`, `/home`, `/var`, `/srv`,
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
//! publishes the [`ExitReason`] on a `watch` channel: once `wait` returns, nothing is left.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{watch, OnceCell};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::cgroup::{Cgroups, Leaf};
use super::fsutil::{
    self, absolute, current_ids, io_err, launch_err, prepare_workspace, remove_dir_logged,
    write_new_file, FileMode, WorkspaceOwner,
};
use super::seccomp::SyscallFilter;
use super::workspace_fs::WorkspaceImages;
use super::{
    ExitReason, KernelEndpoints, KernelProcess, LaunchSpec, Launched, Sandbox, SandboxError,
    SandboxUser,
};
use crate::kernel::spec::KernelSpecs;

const BACKEND: &str = "local";
/// Where the runtime directory appears inside the sandbox.
const RUN_DIR_INSIDE: &str = "/run/kernel";
/// The connection file inside the sandbox.
const CONNECTION_FILE_INSIDE: &str = "/run/kernel/connection.json";
/// The `ip` of the connection file: ipykernel binds `ipc://{ip}-{port}`.
const IPC_BASE_INSIDE: &str = "/run/kernel/k";
/// The workspace inside the sandbox (also `$HOME`).
const WORKSPACE_INSIDE: &str = "/workspace";
/// The sandbox's host name.
const HOSTNAME: &str = "kernel";
/// Longest socket path we create; `sun_path` holds 108 bytes including the NUL, and some
/// libraries are stricter.
const MAX_SOCKET_PATH: usize = 100;
/// How long bwrap may take to report the sandbox's init pid.
const INFO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `terminate` waits for the kill and the cleanup.
const TERMINATE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long `check` lets its test run in the sandbox take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest line of kernel output forwarded to the log; the rest is cut.
const MAX_LOG_LINE: usize = 2048;
/// Lines of kernel stderr logged at WARN before the rest goes to DEBUG.
const MAX_WARN_LINES: usize = 200;
/// Lines of stderr kept to explain a failed launch.
const STDERR_TAIL_LINES: usize = 20;
/// Host files that are harmless to show read-only in the sandbox's `/etc`, if present.
const ETC_RO_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/fonts",
    "/etc/ssl/certs",
    "/etc/alternatives",
    "/etc/mime.types",
];

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
    /// More host paths to show read-only in the sandbox, at the same place.
    pub extra_ro_binds: Vec<PathBuf>,
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
}

impl LocalSandboxConfig {
    /// The defaults for a data directory and a `kernels/` directory.
    pub fn new(data_dir: impl Into<PathBuf>, kernels_dir: impl Into<PathBuf>) -> Self {
        let kernels_dir = kernels_dir.into();
        Self {
            data_dir: data_dir.into(),
            python: kernels_dir.join(".venv/bin/python"),
            kernels_dir,
            uid_base: 200_000,
            require_limits: true,
            extra_ro_binds: Vec::new(),
            run_dir: None,
            cgroup_name: "kernel-broker".to_string(),
            kernel_specs: None,
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
        // SAFETY: geteuid(2) cannot fail and has no preconditions.
        let euid = unsafe { libc::geteuid() };
        choose_run_base(&cfg, euid == 0, euid)
    }
}

/// The kernels this sandbox launched and has not reaped yet.
type Registry = Arc<Mutex<HashMap<Uuid, Arc<KernelShared>>>>;
/// The last lines a kernel wrote to stderr.
type Tail = Arc<Mutex<VecDeque<String>>>;

/// The local sandbox backend.
pub struct LocalSandbox {
    cfg: LocalSandboxConfig,
    privileged: bool,
    bwrap: PathBuf,
    /// `setpriv`, to drop to the kernel's uid inside the sandbox (root mode).
    setpriv: Option<PathBuf>,
    bwrap_has_size: bool,
    bwrap_has_disable_userns: bool,
    /// The syscall filter bwrap installs on every kernel; `None` on an architecture we
    /// have no filter for (see [`super::seccomp`]).
    seccomp: Option<SyscallFilter>,
    /// The venv directory (its `bin` goes first on the kernel's `PATH`).
    venv: PathBuf,
    /// Host directories of the Python installation, shown read-only at the same place.
    python_dirs: Vec<PathBuf>,
    specs: Arc<KernelSpecs>,
    run_base: PathBuf,
    workspaces: PathBuf,
    /// The workspaces' file systems (the per-user disk quota).
    workspace_images: Arc<WorkspaceImages>,
    cgroups: Result<Arc<Cgroups>, String>,
    /// Startup work (cgroup setup, sweeping what an earlier run left), done once before the
    /// first launch; holds the cgroups to use (none when limits are off).
    started: OnceCell<Option<Arc<Cgroups>>>,
    kernels: Registry,
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
            .map_err(|e| unavailable(format!("cannot run {}: {e}", bwrap.display())))?;
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

        let (venv, python_dirs) = discover_python(&cfg.python)?;
        let specs = match &cfg.kernel_specs {
            Some(specs) => specs.clone(),
            None => Arc::new(
                KernelSpecs::load(&cfg.kernels_dir).map_err(|e| unavailable(e.to_string()))?,
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
        let seccomp = SyscallFilter::for_host()
            .map_err(|e| unavailable(format!("cannot compile the kernels' syscall filter: {e}")))?;
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
            setpriv,
            bwrap_has_size: help.contains("--size"),
            bwrap_has_disable_userns: help.contains("--disable-userns"),
            seccomp,
            venv,
            python_dirs,
            specs,
            run_base,
            workspace_images: Arc::new(WorkspaceImages::new(BACKEND, &workspaces, privileged)),
            workspaces,
            cgroups,
            started: OnceCell::new(),
            kernels: Arc::new(Mutex::new(HashMap::new())),
            cfg,
        })
    }

    /// The directory holding the runtime directories of launched kernels.
    pub fn run_base(&self) -> &Path {
        &self.run_base
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
        self.launch_argv(spec, argv, HashMap::new(), None, cgroups)
            .await
    }

    /// Does the startup work once: creates the directories, removes runtime directories and
    /// cgroup leaves an earlier run left behind, sets up the cgroup tree.
    async fn startup(&self) -> Result<Option<Arc<Cgroups>>, SandboxError> {
        self.started
            .get_or_try_init(|| async {
                fsutil::prepare_state_dirs(
                    BACKEND,
                    &self.cfg.data_dir,
                    &self.workspaces,
                    &self.run_base,
                    sweep_run_base,
                )
                .await?;

                let cgroups = match &self.cgroups {
                    Ok(cgroups) => match cgroups.setup() {
                        Ok(()) => {
                            let stale = cgroups.sweep_stale().await;
                            if stale > 0 {
                                tracing::info!(count = stale, "removed kernel cgroups left by an earlier run");
                            }
                            tracing::info!(version = ?cgroups.version(), bases = ?cgroups.bases(), "kernel limits enforced with cgroups");
                            Some(cgroups.clone())
                        }
                        Err(e) => self.without_limits(e.to_string())?,
                    },
                    Err(reason) => self.without_limits(reason.clone())?,
                };
                Ok(cgroups)
            })
            .await
            .cloned()
    }

    fn without_limits(&self, reason: String) -> Result<Option<Arc<Cgroups>>, SandboxError> {
        if self.cfg.require_limits {
            Err(unavailable(format!(
                "cannot enforce memory, CPU and process limits with cgroups: {reason}. \
                 Run the broker as root, or give it a delegated cgroup v2 subtree \
                 (systemd: Delegate=yes), or set require_limits = false to run kernels \
                 without limits"
            )))
        } else {
            tracing::warn!(%reason, "running kernels WITHOUT memory, CPU and process limits (require_limits = false)");
            Ok(None)
        }
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
            .ok_or_else(|| launch_err(user, "uid_base + user index overflows a uid"))?;
        Ok(Some((id, id)))
    }

    fn workspace_path(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        if !is_safe_component(&user.name) {
            return Err(launch_err(
                user,
                format!(
                    "the user name {:?} is not usable as a directory name",
                    user.name
                ),
            ));
        }
        Ok(self.workspaces.join(&user.name))
    }

    /// Replaces `python`/`python3` as the program and `{python}`, `{connection_file}` and
    /// `{resource_dir}` anywhere.
    fn substitute_argv(&self, argv: &[String], resource_dir: Option<&Path>) -> Vec<String> {
        let python = self.cfg.python.to_string_lossy();
        argv.iter()
            .enumerate()
            .map(|(i, arg)| {
                if i == 0 && (arg == "python" || arg == "python3") {
                    return python.to_string();
                }
                let mut arg = arg
                    .replace("{python}", &python)
                    .replace("{connection_file}", CONNECTION_FILE_INSIDE);
                if let Some(dir) = resource_dir {
                    arg = arg.replace("{resource_dir}", &dir.to_string_lossy());
                }
                arg
            })
            .collect()
    }

    async fn launch_argv(
        &self,
        spec: LaunchSpec,
        argv: Vec<String>,
        spec_env: HashMap<String, String>,
        resource_dir: Option<PathBuf>,
        cgroups: Option<Arc<Cgroups>>,
    ) -> Result<Launched, SandboxError> {
        let user = spec.user.clone();
        let session = spec.session_id;
        if self.lock_kernels().contains_key(&session) {
            return Err(launch_err(
                &user,
                format!("session {session} already has a kernel"),
            ));
        }
        let workspace = self.workspace_path(&user)?;
        let ids = self.kernel_ids(&user)?;
        let rundir = self.run_base.join(session.to_string());
        let endpoints = endpoints_for(&rundir).map_err(|e| launch_err(&user, e))?;

        // Workspace, runtime directory, connection file, /etc files. On failure `write`
        // removes what it created; from then on the guard does, until the reaper takes over.
        let files = LaunchFiles {
            workspace: workspace.clone(),
            rundir: rundir.clone(),
            ids,
            login: login_name(&user.name),
            connection: connection_file(&spec),
            quota: Some((
                self.workspace_images.clone(),
                user.limits.workspace_quota_bytes,
            )),
        };
        tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| launch_err(&user, format!("preparing files failed: {e}")))??;
        let mut guard = LaunchGuard {
            rundir: Some(rundir.clone()),
            leaf: None,
        };

        if let Some(cg) = &cgroups {
            let (cg2, name, limits) = (cg.clone(), user.name.clone(), user.limits.clone());
            let leaf =
                tokio::task::spawn_blocking(move || cg2.create_leaf(&name, &limits, session))
                    .await
                    .map_err(|e| launch_err(&user, format!("creating the cgroup failed: {e}")))??;
            guard.leaf = Some((cg.clone(), leaf));
        }

        let request = BwrapRequest {
            workspace: &workspace,
            rundir: &rundir,
            ids,
            tmp_size: Some(user.limits.memory_bytes).filter(|b| *b > 0),
            resource_dir: resource_dir.as_deref(),
            argv: &argv,
        };
        let leaf = guard.leaf.as_ref().map(|(_, leaf)| leaf);
        let (child, info, stderr_task, tail) = self.spawn(&spec, &request, spec_env, leaf)?;

        // From here the reaper owns the leaf and the runtime directory, and the handle's
        // drop (also when this future is dropped half-way) kills the kernel.
        let (exit_tx, exit_rx) = watch::channel(None);
        let shared = Arc::new(KernelShared {
            session_id: session,
            user: user.name.clone(),
            init_pid: OnceLock::new(),
            bwrap_pid: child.id().and_then(|p| i32::try_from(p).ok()),
            terminating: AtomicBool::new(false),
            kill: CancellationToken::new(),
            exit: exit_rx,
        });
        let (cgroups, leaf) = guard
            .leaf
            .take()
            .map_or((None, None), |(c, l)| (Some(c), Some(l)));
        guard.rundir = None;
        let reaper = Reaper {
            child,
            shared: shared.clone(),
            exit_tx,
            leaf,
            cgroups,
            rundir,
            memory_limit: user.limits.memory_bytes,
            registry: self.kernels.clone(),
            tail: tail.clone(),
        };
        self.lock_kernels().insert(session, shared.clone());
        tokio::spawn(reaper.run());
        let kernel = LocalKernel { shared };

        match read_init_pid(info).await {
            Ok(pid) => {
                let _ = kernel.shared.init_pid.set(pid);
            }
            Err(why) => {
                // bwrap failed before the sandbox existed; explain with what it wrote.
                kernel.terminate().await;
                let _ = timeout(Duration::from_secs(2), stderr_task).await;
                let tail: Vec<String> = lock_tail(&tail).iter().cloned().collect();
                return Err(launch_err(
                    &user,
                    format!("the sandbox did not start ({why}): {}", tail.join(" | ")),
                ));
            }
        }
        tracing::info!(
            %session,
            user = %user.name,
            kernel = %spec.kernel_name,
            pid = ?kernel.shared.init_pid.get(),
            "kernel launched"
        );
        Ok(Launched {
            endpoints,
            process: Box::new(kernel),
        })
    }

    /// Builds and spawns the bwrap command; returns the child, the read end of its info
    /// pipe, the stderr forwarding task and the stderr tail.
    fn spawn(
        &self,
        spec: &LaunchSpec,
        request: &BwrapRequest<'_>,
        spec_env: HashMap<String, String>,
        leaf: Option<&Leaf>,
    ) -> Result<(Child, OwnedFd, JoinHandle<()>, Tail), SandboxError> {
        let user = &spec.user;
        let (info_read, info_write) =
            io::pipe().map_err(|e| launch_err(user, format!("cannot create a pipe: {e}")))?;
        let info_fd = info_write.as_raw_fd();
        let seccomp = self
            .seccomp_memfd()
            .map_err(|e| launch_err(user, format!("cannot pass the syscall filter: {e}")))?;
        let seccomp_fd = seccomp.as_ref().map(AsRawFd::as_raw_fd);

        let mut args = vec![OsString::from("--info-fd"), info_fd.to_string().into()];
        args.extend(self.bwrap_args(request, seccomp_fd));
        let mut cmd = Command::new(&self.bwrap);
        cmd.args(&args)
            .env_clear()
            .envs(self.kernel_env(&user.name))
            .envs(spec_env)
            .envs(spec.env.iter().cloned())
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Keep terminal signals (Ctrl-C on the broker) away from kernels; the broker
            // shuts them down itself.
            .process_group(0)
            .kill_on_drop(true);

        let procs: Vec<CString> = leaf.map(|l| l.procs_files().to_vec()).unwrap_or_default();
        // SAFETY: the closure runs between fork and exec and calls only async-signal-safe
        // functions (open, write, close, fcntl) on data prepared before the fork; it does not
        // allocate (iterating a Vec and building an io::Error from errno do not).
        unsafe {
            cmd.pre_exec(move || {
                for path in &procs {
                    join_cgroup(path)?;
                }
                // Let bwrap inherit the info pipe and the filter (created close-on-exec so
                // that no other child of the broker does).
                inherit_fd(info_fd)?;
                if let Some(fd) = seccomp_fd {
                    inherit_fd(fd)?;
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| launch_err(user, format!("cannot start {}: {e}", self.bwrap.display())))?;
        drop(info_write);
        // bwrap has its own copy; it reads the filter and closes it before the kernel runs.
        drop(seccomp);

        let tail: Tail = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(stdout) = child.stdout.take() {
            tokio::spawn(forward_output(
                stdout,
                spec.session_id,
                Stream::Stdout,
                None,
            ));
        }
        let stderr_task = match child.stderr.take() {
            Some(stderr) => tokio::spawn(forward_output(
                stderr,
                spec.session_id,
                Stream::Stderr,
                Some(tail.clone()),
            )),
            None => tokio::spawn(async {}),
        };
        Ok((child, OwnedFd::from(info_read), stderr_task, tail))
    }

    /// The kernel's whole environment (bwrap and setpriv pass it through unchanged); the
    /// broker's own environment is not inherited.
    fn kernel_env(&self, user: &str) -> Vec<(String, String)> {
        let login = login_name(user);
        let path = format!(
            "{}:/usr/local/bin:/usr/bin:/bin",
            self.venv.join("bin").to_string_lossy()
        );
        [
            ("PATH", path.as_str()),
            ("HOME", WORKSPACE_INSIDE),
            ("USER", login.as_str()),
            ("LOGNAME", login.as_str()),
            ("LANG", "C.UTF-8"),
            ("TMPDIR", "/tmp"),
            ("PYTHONUNBUFFERED", "1"),
            ("MPLBACKEND", "module://matplotlib_inline.backend_inline"),
            // debugpy warns about frozen modules on every start otherwise.
            ("PYDEVD_DISABLE_FILE_VALIDATION", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// A memfd holding the syscall filter for one bwrap run (none without a filter).
    fn seccomp_memfd(&self) -> io::Result<Option<OwnedFd>> {
        self.seccomp.as_ref().map(SyscallFilter::memfd).transpose()
    }

    /// The bwrap arguments after `--info-fd`: namespaces, the syscall filter (read from
    /// `seccomp_fd`, which bwrap must inherit), the file system, the command.
    fn bwrap_args(&self, req: &BwrapRequest<'_>, seccomp_fd: Option<RawFd>) -> Vec<OsString> {
        let mut fs = MountPlan::default();
        fs.flag("--unshare-pid");
        fs.flag("--unshare-net");
        fs.flag("--unshare-ipc");
        fs.flag("--unshare-uts");
        fs.flag("--unshare-cgroup-try");
        if !self.privileged {
            // As root, a user namespace would leave setpriv no uid to switch to.
            fs.flag("--unshare-user");
            if self.bwrap_has_disable_userns {
                fs.flag("--disable-userns");
            }
        }
        if let Some(fd) = seccomp_fd {
            // bwrap installs it last, right before exec'ing the command: after its own
            // namespace and mount work, before setpriv (whose setresuid, setgroups, capset
            // and prctl the filter allows).
            fs.push(["--seccomp".to_string(), fd.to_string()]);
        }
        fs.flag("--die-with-parent");
        fs.flag("--new-session");
        fs.push(["--hostname", HOSTNAME]);

        fs.ro_bind(Path::new("/usr"), Path::new("/usr"));
        for top in ["bin", "sbin", "lib", "lib64", "lib32", "libx32"] {
            let host = Path::new("/").join(top);
            match std::fs::read_link(&host) {
                Ok(target) => fs.symlink(&target, &host),
                Err(_) if host.is_dir() => fs.ro_bind(&host, &host),
                Err(_) => {}
            }
        }
        // The private mounts come before the binds, so that a bind below /tmp (a venv
        // there, say) lands on the tmpfs instead of being hidden by it.
        fs.push(["--proc", "/proc", "--dev", "/dev"]);
        fs.dirs.insert(PathBuf::from("/dev"));
        // /tmp, and /dev/shm for POSIX semaphores and shared memory (multiprocessing).
        for tmp in ["/tmp", "/dev/shm"] {
            fs.push(["--perms", "1777"]);
            if let (Some(size), true) = (req.tmp_size, self.bwrap_has_size) {
                // tmpfs pages count against the memory cgroup anyway; the cap keeps a
                // tmpfs from claiming more than the user may use at all.
                fs.push(["--size".to_string(), size.to_string()]);
            }
            fs.push(["--tmpfs", tmp]);
            fs.dirs.insert(PathBuf::from(tmp));
        }
        for dir in &self.python_dirs {
            fs.ro_bind(dir, dir);
        }
        for dir in &self.cfg.extra_ro_binds {
            if dir.is_absolute() && dir.exists() {
                fs.ro_bind(dir, dir);
            }
        }
        if let Some(dir) = req.resource_dir {
            fs.ro_bind(dir, dir);
        }
        fs.dir(Path::new("/etc"));
        for file in ETC_RO_FILES {
            let path = Path::new(file);
            if path.exists() {
                fs.ro_bind(path, path);
            }
        }
        for name in ["passwd", "group", "hosts"] {
            fs.ro_bind(&req.rundir.join(name), &Path::new("/etc").join(name));
        }

        fs.bind(req.rundir, Path::new(RUN_DIR_INSIDE));
        fs.bind(req.workspace, Path::new(WORKSPACE_INSIDE));
        fs.push(["--chdir", WORKSPACE_INSIDE]);

        let mut args = fs.args;
        args.push("--".into());
        if let (Some(setpriv), Some((uid, gid))) = (&self.setpriv, req.ids) {
            args.push(setpriv.into());
            args.push(format!("--reuid={uid}").into());
            args.push(format!("--regid={gid}").into());
            for a in [
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
                "--",
            ] {
                args.push(a.into());
            }
        }
        args.extend(req.argv.iter().map(OsString::from));
        args
    }

    /// Runs the kernels' interpreter in a sandbox and imports ipykernel: proves the whole
    /// chain (bwrap, binds, uid switch, venv) before the first session needs it.
    async fn smoke_test(&self) -> Result<(), SandboxError> {
        let rundir = self.run_base.join(format!("check-{}", Uuid::new_v4()));
        let workspace = rundir.join("workspace");
        let ids = self
            .privileged
            .then_some((self.cfg.uid_base, self.cfg.uid_base));
        let files = LaunchFiles {
            workspace: workspace.clone(),
            rundir: rundir.clone(),
            ids,
            login: "check".to_string(),
            connection: serde_json::Value::Null,
            quota: None,
        };
        let prepared = tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| unavailable(format!("preparing the test run failed: {e}")))?;
        let result = match prepared {
            Ok(()) => self.run_smoke_test(&rundir, &workspace, ids).await,
            Err(e) => Err(unavailable(format!("preparing the test run failed: {e}"))),
        };
        remove_dir_logged(rundir).await;
        result
    }

    async fn run_smoke_test(
        &self,
        rundir: &Path,
        workspace: &Path,
        ids: Option<(u32, u32)>,
    ) -> Result<(), SandboxError> {
        // With a filter, also prove that it is in force (seccomp mode 2), so that a bwrap
        // that silently ignored it would stop the broker here.
        let code = if self.seccomp.is_some() {
            "import ipykernel, sys\n\
             status = open('/proc/self/status').read()\n\
             sys.exit(None if 'Seccomp:\\t2' in status else 'no syscall filter in the sandbox')"
        } else {
            "import ipykernel"
        };
        let argv = self.substitute_argv(
            &["python".to_string(), "-c".to_string(), code.to_string()],
            None,
        );
        let seccomp = self
            .seccomp_memfd()
            .map_err(|e| unavailable(format!("cannot pass the syscall filter: {e}")))?;
        let seccomp_fd = seccomp.as_ref().map(AsRawFd::as_raw_fd);
        let args = self.bwrap_args(
            &BwrapRequest {
                workspace,
                rundir,
                ids,
                tmp_size: None,
                resource_dir: None,
                argv: &argv,
            },
            seccomp_fd,
        );
        let mut cmd = Command::new(&self.bwrap);
        cmd.args(&args)
            .env_clear()
            .envs(self.kernel_env("check"))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(fd) = seccomp_fd {
            // SAFETY: the closure only calls fcntl, which is async-signal-safe.
            unsafe {
                cmd.pre_exec(move || inherit_fd(fd));
            }
        }
        let output = match timeout(CHECK_TIMEOUT, cmd.output()).await {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => return Err(unavailable(format!("cannot run {}: {e}", self.bwrap.display()))),
            Err(_) => {
                return Err(unavailable(format!(
                    "a test run of the kernels' Python in the sandbox took longer than {CHECK_TIMEOUT:?}"
                )))
            }
        };
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(STDERR_TAIL_LINES).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Err(unavailable(format!(
            "a test run of `{} -c 'import ipykernel'` in the sandbox failed ({}): {}. \
             Is the venv set up (kernels/setup.sh)?",
            self.cfg.python.display(),
            output.status,
            tail.join(" | ")
        )))
    }

    fn lock_kernels(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<KernelShared>>> {
        lock_registry(&self.kernels)
    }
}

#[async_trait]
impl Sandbox for LocalSandbox {
    fn name(&self) -> &'static str {
        BACKEND
    }

    async fn check(&self) -> Result<(), SandboxError> {
        self.startup().await?;
        self.smoke_test().await
    }

    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, SandboxError> {
        let cgroups = self.startup().await?;
        let kspec = self.specs.get(&spec.kernel_name).ok_or_else(|| {
            launch_err(
                &spec.user,
                format!(
                    "no kernel spec named {:?} in {} (found: {})",
                    spec.kernel_name,
                    self.cfg.kernels_dir.display(),
                    self.kernel_names().join(", ")
                ),
            )
        })?;
        let uses_resource_dir = kspec.argv.iter().any(|a| a.contains("{resource_dir}"));
        let resource_dir = uses_resource_dir.then(|| kspec.resource_dir.clone());
        let argv = self.substitute_argv(&kspec.argv, resource_dir.as_deref());
        tracing::debug!(kernel = %spec.kernel_name, interrupt_mode = ?kspec.interrupt_mode, ?argv, "launching kernel");
        self.launch_argv(spec, argv, kspec.env.clone(), resource_dir, cgroups)
            .await
    }

    fn workspace(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        let path = self.workspace_path(user)?;
        let quota = (&*self.workspace_images, user.limits.workspace_quota_bytes);
        prepare_workspace(&path, workspace_owner(self.kernel_ids(user)?), Some(quota))?;
        Ok(path)
    }

    async fn user_idle(&self, user: &SandboxUser) {
        if let Some(Some(cgroups)) = self.started.get() {
            cgroups.remove_user_if_unused(&user.name);
        }
    }

    async fn shutdown(&self) {
        let kernels: Vec<Arc<KernelShared>> = self.lock_kernels().values().cloned().collect();
        if !kernels.is_empty() {
            tracing::info!(count = kernels.len(), "terminating kernels");
        }
        for kernel in &kernels {
            kernel.terminating.store(true, Ordering::SeqCst);
            kernel.kill.cancel();
        }
        let waits = kernels.iter().map(|k| async move {
            if timeout(TERMINATE_TIMEOUT, k.wait()).await.is_err() {
                tracing::error!(session = %k.session_id, "kernel did not go away on shutdown");
            }
        });
        futures::future::join_all(waits).await;
        if let Some(Some(cgroups)) = self.started.get() {
            cgroups.remove_base_if_unused();
        }
        // Under /run (root) the base is outside the data directory: leave nothing behind.
        // Only an empty directory goes; the next start creates it again.
        let _ = std::fs::remove_dir(&self.run_base);
        // The kernels are gone, so nothing holds the workspace file systems.
        let images = self.workspace_images.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || images.unmount_all()).await {
            tracing::warn!(error = %e, "unmounting the workspaces failed");
        }
    }
}

/// What a launch and its reaper share.
struct KernelShared {
    session_id: Uuid,
    user: String,
    /// Host pid of the sandbox's init (pid 1 inside), from bwrap's `--info-fd`; set once
    /// bwrap reports it, shortly after the spawn.
    init_pid: OnceLock<i32>,
    /// Host pid of bwrap itself.
    bwrap_pid: Option<i32>,
    /// Set before a requested kill, so the exit reads as [`ExitReason::Terminated`].
    terminating: AtomicBool,
    /// Tells the reaper to kill the kernel.
    kill: CancellationToken,
    /// Set once by the reaper, after cleanup.
    exit: watch::Receiver<Option<ExitReason>>,
}

impl KernelShared {
    async fn wait(&self) -> ExitReason {
        super::wait_for_exit(
            &self.exit,
            "the broker stopped watching the kernel process (runtime shut down)",
        )
        .await
    }

    fn has_exited(&self) -> bool {
        self.exit.borrow().is_some()
    }
}

/// The handle the session layer holds. Dropping it kills the kernel.
struct LocalKernel {
    shared: Arc<KernelShared>,
}

#[async_trait]
impl KernelProcess for LocalKernel {
    async fn interrupt(&self) -> Result<(), SandboxError> {
        let no_process = |why: &str| SandboxError::Io {
            what: "cannot interrupt the kernel",
            path: PathBuf::from(format!(
                "/proc/{}",
                self.shared.init_pid.get().copied().unwrap_or(0)
            )),
            source: io::Error::new(io::ErrorKind::NotFound, why.to_string()),
        };
        if self.shared.has_exited() {
            return Err(no_process("the kernel process has exited"));
        }
        let init = *self
            .shared
            .init_pid
            .get()
            .ok_or_else(|| no_process("the sandbox's init pid is unknown"))?;
        let pid = sandbox_command_pid(init)
            .ok_or_else(|| no_process("the kernel process is not running"))?;
        // Only the kernel: its process group also holds the sandbox's init, which must not
        // see the signal.
        // SAFETY: kill(2) has no memory-safety preconditions.
        if unsafe { libc::kill(pid, libc::SIGINT) } != 0 {
            return Err(SandboxError::Io {
                what: "cannot send SIGINT to the kernel",
                path: PathBuf::from(format!("/proc/{pid}")),
                source: io::Error::last_os_error(),
            });
        }
        tracing::debug!(session = %self.shared.session_id, pid, "sent SIGINT to the kernel");
        Ok(())
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
        if timeout(TERMINATE_TIMEOUT, self.shared.wait())
            .await
            .is_err()
        {
            tracing::error!(
                session = %self.shared.session_id,
                user = %self.shared.user,
                "the kernel was not reaped within {TERMINATE_TIMEOUT:?} of being killed"
            );
        }
    }
}

impl Drop for LocalKernel {
    fn drop(&mut self) {
        // Last resort: the reaper kills and cleans up; a no-op if the kernel has ended.
        self.shared.kill.cancel();
    }
}

/// Owns the bwrap child: waits for it (or kills it), classifies the exit, cleans up.
struct Reaper {
    child: Child,
    shared: Arc<KernelShared>,
    exit_tx: watch::Sender<Option<ExitReason>>,
    leaf: Option<Leaf>,
    cgroups: Option<Arc<Cgroups>>,
    rundir: PathBuf,
    memory_limit: u64,
    registry: Registry,
    tail: Tail,
}

impl Reaper {
    async fn run(mut self) {
        let status = tokio::select! {
            status = self.child.wait() => status,
            () = self.shared.kill.cancelled() => {
                kill_sandbox(self.leaf.as_ref(), self.shared.init_pid.get().copied(), self.shared.bwrap_pid).await;
                self.child.wait().await
            }
        };
        let oom_kills = self.leaf.as_ref().and_then(Leaf::oom_kills).unwrap_or(0);
        let terminating = self.shared.terminating.load(Ordering::SeqCst);
        let reason = classify_exit(status, terminating, oom_kills, self.memory_limit);
        let session = self.shared.session_id;
        match &reason {
            ExitReason::Terminated | ExitReason::Exited(0) => {
                tracing::info!(%session, %reason, "kernel process ended");
            }
            _ => {
                let tail: Vec<String> = lock_tail(&self.tail).iter().cloned().collect();
                if tail.is_empty() {
                    tracing::warn!(%session, %reason, "kernel process ended");
                } else {
                    tracing::warn!(%session, %reason, last_stderr = %tail.join(" | "), "kernel process ended");
                }
            }
        }

        if let (Some(cgroups), Some(leaf)) = (&self.cgroups, &self.leaf) {
            cgroups.remove_leaf(leaf).await;
        }
        remove_dir_logged(self.rundir.clone()).await;
        lock_registry(&self.registry).remove(&session);
        self.exit_tx.send_replace(Some(reason));
    }
}

/// SIGKILLs everything of one kernel: the whole leaf when there is one; otherwise the
/// sandbox's init (the pid namespace dies with it) and bwrap.
async fn kill_sandbox(leaf: Option<&Leaf>, init_pid: Option<i32>, bwrap_pid: Option<i32>) {
    for pid in [init_pid, bwrap_pid].into_iter().flatten() {
        if pid > 0 {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    if let Some(leaf) = leaf {
        leaf.kill_all().await;
    }
}

/// Turns bwrap's exit status into an [`ExitReason`].
fn classify_exit(
    status: io::Result<ExitStatus>,
    terminating: bool,
    oom_kills: u64,
    memory_limit: u64,
) -> ExitReason {
    if terminating {
        return ExitReason::Terminated;
    }
    let status = match status {
        Ok(status) => status,
        Err(e) => return ExitReason::Lost(format!("waiting for the kernel process failed: {e}")),
    };
    // bwrap reports a command killed by signal N as exit code 128 + N.
    let signal = status.signal().or_else(|| {
        status
            .code()
            .filter(|c| (129..=128 + 64).contains(c))
            .map(|c| c - 128)
    });
    match signal {
        Some(libc::SIGKILL) if oom_kills > 0 => ExitReason::OutOfMemory {
            limit_bytes: memory_limit,
        },
        Some(sig) => ExitReason::Signaled(sig),
        None => ExitReason::Exited(status.code().unwrap_or(-1)),
    }
}

/// Writes `0` to a `cgroup.procs` file: moves the calling process. Runs between fork and
/// exec: async-signal-safe calls only.
fn join_cgroup(path: &CString) -> io::Result<()> {
    // SAFETY: `path` is a valid NUL-terminated string; the buffer passed to write is a
    // static one-byte slice; `fd` is closed exactly once.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let written = libc::write(fd, b"0".as_ptr().cast(), 1);
        let err = io::Error::last_os_error();
        libc::close(fd);
        if written != 1 {
            return Err(err);
        }
    }
    Ok(())
}

/// Clears close-on-exec on `fd` so the exec'd program inherits it. Runs between fork and
/// exec: async-signal-safe calls only.
fn inherit_fd(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl(2) with F_SETFD has no memory-safety preconditions.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads bwrap's `--info-fd` report and returns the host pid of the sandbox's init.
async fn read_init_pid(fd: OwnedFd) -> Result<i32, String> {
    let mut rx = tokio::net::unix::pipe::Receiver::from_owned_fd(fd)
        .map_err(|e| format!("cannot read bwrap's info pipe: {e}"))?;
    let mut buf = Vec::new();
    match timeout(INFO_TIMEOUT, rx.read_to_end(&mut buf)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(format!("reading bwrap's info pipe failed: {e}")),
        Err(_) => return Err(format!("bwrap did not report within {INFO_TIMEOUT:?}")),
    }
    if buf.is_empty() {
        return Err("bwrap exited before creating the sandbox".to_string());
    }
    #[derive(Deserialize)]
    struct Info {
        #[serde(rename = "child-pid")]
        child_pid: i32,
    }
    serde_json::from_slice::<Info>(&buf)
        .map(|info| info.child_pid)
        .map_err(|e| format!("bwrap's info report is not understood: {e}"))
}

/// The host pid of the sandboxed command: the child of the sandbox's init that is pid 2 in
/// the sandbox (init may also have adopted orphans).
fn sandbox_command_pid(init_pid: i32) -> Option<i32> {
    let children = std::fs::read_to_string(format!("/proc/{init_pid}/task/{init_pid}/children"))
        .ok()
        .map(|text| {
            text.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|| children_by_scan(init_pid));
    children
        .iter()
        .copied()
        .find(|pid| namespace_pid(*pid) == Some(2))
        .or_else(|| children.first().copied())
}

/// Children of `pid` by scanning `/proc` (when `/proc/<pid>/task/<pid>/children` is missing).
fn children_by_scan(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // pid (comm) state ppid ...; comm may contain spaces and parentheses.
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// The innermost pid of a process (the last `NSpid` field), if the kernel reports it.
fn namespace_pid(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// Which stream of the kernel a line came from.
#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// Forwards a kernel's stdout or stderr to the log, line by line, lines cut at
/// [`MAX_LOG_LINE`]. Ends when the kernel closes the stream.
async fn forward_output<R: AsyncRead + Unpin>(
    stream: R,
    session: Uuid,
    which: Stream,
    tail: Option<Tail>,
) {
    let mut reader = BufReader::new(stream);
    let mut line: Vec<u8> = Vec::new();
    let mut cut = false;
    let mut count = 0usize;
    loop {
        let (consumed, complete) = match reader.fill_buf().await {
            Ok([]) | Err(_) => {
                if !line.is_empty() {
                    emit_line(&line, cut, session, which, &mut count, tail.as_ref());
                }
                return;
            }
            Ok(buf) => {
                let (chunk, consumed, complete) = match buf.iter().position(|b| *b == b'\n') {
                    Some(pos) => (&buf[..pos], pos + 1, true),
                    None => (buf, buf.len(), false),
                };
                let room = MAX_LOG_LINE.saturating_sub(line.len());
                if chunk.len() > room {
                    cut = true;
                }
                line.extend_from_slice(&chunk[..chunk.len().min(room)]);
                (consumed, complete)
            }
        };
        reader.consume(consumed);
        if complete {
            emit_line(&line, cut, session, which, &mut count, tail.as_ref());
            line.clear();
            cut = false;
        }
    }
}

fn emit_line(
    line: &[u8],
    cut: bool,
    session: Uuid,
    which: Stream,
    count: &mut usize,
    tail: Option<&Tail>,
) {
    let text = String::from_utf8_lossy(line);
    let text = text.trim_end_matches('\r');
    let marker = if cut { " [cut]" } else { "" };
    match which {
        Stream::Stdout => tracing::debug!(%session, "kernel stdout: {text}{marker}"),
        Stream::Stderr => {
            *count += 1;
            if *count <= MAX_WARN_LINES {
                tracing::warn!(%session, "kernel stderr: {text}{marker}");
            } else {
                if *count == MAX_WARN_LINES + 1 {
                    tracing::warn!(%session, "kernel stderr is noisy; further lines are logged at DEBUG");
                }
                tracing::debug!(%session, "kernel stderr: {text}{marker}");
            }
        }
    }
    if let Some(tail) = tail {
        let mut tail = lock_tail(tail);
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(format!("{text}{marker}"));
    }
}

fn lock_tail(tail: &Tail) -> std::sync::MutexGuard<'_, VecDeque<String>> {
    // Lines of log text: a panic while holding the lock cannot leave them inconsistent.
    crate::sync::lock(tail)
}

fn lock_registry(
    registry: &Registry,
) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<KernelShared>>> {
    // Every critical section is a single insert, remove or clone; none can leave the map
    // half-updated.
    crate::sync::lock(registry)
}

/// What bwrap should build for one run.
struct BwrapRequest<'a> {
    workspace: &'a Path,
    rundir: &'a Path,
    ids: Option<(u32, u32)>,
    tmp_size: Option<u64>,
    resource_dir: Option<&'a Path>,
    argv: &'a [String],
}

/// Builds bwrap's file system arguments. bwrap creates missing parents of a mount point
/// with mode 0700, which would hide everything below them from a non-root kernel, so every
/// parent is created explicitly with 0755 first; and a bind inside a read-only bind made
/// earlier (say, a Python under `/usr`) is skipped, as it is visible already.
#[derive(Default)]
struct MountPlan {
    args: Vec<OsString>,
    /// Directories that exist in the sandbox (created or mounted).
    dirs: BTreeSet<PathBuf>,
    /// Read-only binds of a host path onto the same path.
    ro_roots: Vec<PathBuf>,
}

impl MountPlan {
    fn flag(&mut self, flag: &str) {
        self.args.push(flag.into());
    }

    fn push<I, S>(&mut self, args: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
    }

    fn covered(&self, path: &Path) -> bool {
        self.ro_roots.iter().any(|root| path.starts_with(root))
    }

    /// Creates `dir` and its missing parents, 0755.
    fn dir(&mut self, dir: &Path) {
        let mut missing: Vec<&Path> = dir
            .ancestors()
            .filter(|a| *a != Path::new("/") && !a.as_os_str().is_empty())
            .take_while(|a| !self.dirs.contains(*a) && !self.covered(a))
            .collect();
        missing.reverse();
        for d in missing {
            self.args
                .extend(["--perms".into(), "0755".into(), "--dir".into(), d.into()]);
            self.dirs.insert(d.to_path_buf());
        }
    }

    fn parents(&mut self, dest: &Path) {
        if let Some(parent) = dest.parent() {
            self.dir(parent);
        }
    }

    fn ro_bind(&mut self, src: &Path, dest: &Path) {
        if self.covered(dest) {
            return;
        }
        self.parents(dest);
        self.args
            .extend(["--ro-bind".into(), src.into(), dest.into()]);
        if src == dest {
            self.ro_roots.push(dest.to_path_buf());
        }
        self.dirs.insert(dest.to_path_buf());
    }

    fn bind(&mut self, src: &Path, dest: &Path) {
        self.parents(dest);
        self.args.extend(["--bind".into(), src.into(), dest.into()]);
        self.dirs.insert(dest.to_path_buf());
    }

    fn symlink(&mut self, target: &Path, link: &Path) {
        self.parents(link);
        self.args
            .extend(["--symlink".into(), target.into(), link.into()]);
    }
}

/// Removes a launch's runtime directory and cgroup leaf if the launch does not get as far
/// as handing them to its reaper (an error, or the launch future dropped). Nothing runs in
/// them yet, so plain `rmdir`s do; they are quick enough for `drop`.
struct LaunchGuard {
    rundir: Option<PathBuf>,
    leaf: Option<(Arc<Cgroups>, Leaf)>,
}

impl Drop for LaunchGuard {
    fn drop(&mut self) {
        if let Some((cgroups, leaf)) = self.leaf.take() {
            for dir in leaf.dirs() {
                if let Err(e) = std::fs::remove_dir(dir) {
                    tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove the cgroup of a failed launch");
                }
            }
            if let Some(user) = leaf
                .dirs()
                .first()
                .and_then(|d| d.parent())
                .and_then(|p| p.file_name())
                .and_then(|n| n.to_str())
            {
                cgroups.remove_user_if_unused(user);
            }
        }
        if let Some(dir) = self.rundir.take() {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!(path = %dir.display(), error = %e, "cannot remove the runtime directory of a failed launch");
            }
        }
    }
}

/// The files a launch writes on the host before bwrap starts.
struct LaunchFiles {
    workspace: PathBuf,
    rundir: PathBuf,
    ids: Option<(u32, u32)>,
    login: String,
    /// The connection file's JSON (`Null`: write none).
    connection: serde_json::Value,
    /// The workspace's file system and its size (`None`: a scratch workspace).
    quota: Option<(Arc<WorkspaceImages>, u64)>,
}

impl LaunchFiles {
    /// Writes everything; on failure removes the runtime directory if it created it.
    fn write(&self) -> Result<(), SandboxError> {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&self.rundir)
            .map_err(|source| SandboxError::Io {
                what: "cannot create the runtime directory",
                path: self.rundir.clone(),
                source,
            })?;
        let result = self.write_in_rundir();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&self.rundir);
        }
        result
    }

    fn write_in_rundir(&self) -> Result<(), SandboxError> {
        if let Some((uid, gid)) = self.ids {
            std::os::unix::fs::chown(&self.rundir, Some(uid), Some(gid))
                .map_err(io_err("cannot chown the runtime directory", &self.rundir))?;
        }
        // After the runtime directory: `check` puts its scratch workspace inside it.
        let quota = self.quota.as_ref().map(|(fs, bytes)| (&**fs, *bytes));
        prepare_workspace(&self.workspace, workspace_owner(self.ids), quota)?;
        let (uid, gid) = self.ids.unwrap_or_else(current_ids);
        let login = &self.login;
        let passwd = format!(
            "root:x:0:0:root:/root:/usr/sbin/nologin\n\
             {login}:x:{uid}:{gid}:{login}:{WORKSPACE_INSIDE}:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        );
        let group = format!("root:x:0:\n{login}:x:{gid}:\nnogroup:x:65534:\n");
        let hosts =
            format!("127.0.0.1 localhost\n::1 localhost ip6-localhost\n127.0.1.1 {HOSTNAME}\n");
        for (name, text) in [("passwd", passwd), ("group", group), ("hosts", hosts)] {
            let path = self.rundir.join(name);
            write_new_file(&path, text.as_bytes(), FileMode::Masked(0o644), None)
                .map_err(io_err("cannot write a sandbox /etc file", &path))?;
        }
        if !self.connection.is_null() {
            fsutil::write_connection_file(
                &self.rundir,
                &self.connection,
                FileMode::Masked(0o600),
                self.ids,
            )?;
        }
        Ok(())
    }
}

/// The connection file the kernel reads (`ipc` transport; sockets `/run/kernel/k-<port>`).
fn connection_file(spec: &LaunchSpec) -> serde_json::Value {
    fsutil::connection_file(spec, IPC_BASE_INSIDE)
}

/// The host-side endpoints for a runtime directory; fails if a socket path would be too long.
fn endpoints_for(rundir: &Path) -> Result<KernelEndpoints, String> {
    fsutil::ipc_endpoints(rundir, MAX_SOCKET_PATH, |longest| {
        format!(
            "the socket path {longest} is too long ({} bytes, the limit is {MAX_SOCKET_PATH}); \
             configure a shorter run_dir",
            longest.len()
        )
    })
}

/// Picks the runtime base directory (see [`LocalSandboxConfig::run_dir`]).
fn choose_run_base(
    cfg: &LocalSandboxConfig,
    privileged: bool,
    euid: u32,
) -> Result<PathBuf, SandboxError> {
    // Several brokers may share a fallback on one host: tell them apart by their data
    // directory.
    let hash = fsutil::data_dir_hash(&cfg.data_dir);
    // A bind mount's source shows in the sandbox's mountinfo (the `root` field: the path
    // inside its file system), and /proc cannot be masked per process; a runtime directory
    // outside the data directory keeps that path from pointing at the workspaces. Root only:
    // /run is root's.
    let preferred = (privileged && cfg.run_dir.is_none())
        .then(|| PathBuf::from(format!("/run/kernel-broker-{hash}")));
    let layout = fsutil::RunBaseLayout {
        backend: BACKEND,
        data_dir: &cfg.data_dir,
        run_dir: cfg.run_dir.as_deref().or(preferred.as_deref()),
        default_name: "run",
        fallback_name: "kernel-broker",
        // `/<uuid>/k-5`
        room: 1 + 36 + 4,
        max_socket_path: MAX_SOCKET_PATH,
    };
    fsutil::choose_run_base(&layout, &hash, privileged, euid)
}

/// Removes runtime directories an earlier run left (named by session id, or `check-...`).
fn sweep_run_base(run_base: &Path) -> Result<usize, SandboxError> {
    let entries = std::fs::read_dir(run_base).map_err(|source| SandboxError::Io {
        what: "cannot list the runtime directory",
        path: run_base.to_path_buf(),
        source,
    })?;
    let mut removed = 0;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let ours = Uuid::parse_str(name).is_ok()
            || name
                .strip_prefix("check-")
                .is_some_and(|id| Uuid::parse_str(id).is_ok());
        if !ours {
            continue;
        }
        match std::fs::remove_dir_all(entry.path()) {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(path = %entry.path().display(), error = %e, "cannot remove a stale runtime directory")
            }
        }
    }
    Ok(removed)
}

/// Runs the interpreter once to learn its venv and installation directories, which the
/// sandbox shows read-only at the same paths.
fn discover_python(python: &Path) -> Result<(PathBuf, Vec<PathBuf>), SandboxError> {
    const SCRIPT: &str =
        "import os, sys; print(sys.prefix); print(sys.base_prefix); print(os.path.realpath(sys.executable))";
    let output = std::process::Command::new(python)
        .args(["-I", "-c", SCRIPT])
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            unavailable(format!(
                "cannot run the kernels' Python {}: {e}; create it with kernels/setup.sh",
                python.display()
            ))
        })?;
    if !output.status.success() {
        return Err(unavailable(format!(
            "the kernels' Python {} failed ({}): {}",
            python.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let [prefix, base_prefix, executable] = lines[..] else {
        return Err(unavailable(format!(
            "unexpected answer from {}: {stdout:?}",
            python.display()
        )));
    };
    let venv = PathBuf::from(prefix);
    let mut dirs: Vec<PathBuf> = Vec::new();
    for dir in [prefix, base_prefix] {
        let dir = PathBuf::from(dir);
        if !dir.starts_with("/usr") && !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    // An interpreter binary outside both prefixes (unusual): show its directory too.
    let executable = PathBuf::from(executable);
    if !executable.starts_with("/usr") && !dirs.iter().any(|d| executable.starts_with(d)) {
        if let Some(bin) = executable.parent() {
            dirs.push(bin.to_path_buf());
        }
    }
    if dirs.iter().any(|d| d == Path::new("/")) {
        return Err(unavailable(format!(
            "the kernels' Python {} is installed at /, which cannot be shown to kernels alone",
            python.display()
        )));
    }
    tracing::debug!(venv = %venv.display(), ?dirs, "kernels' Python found");
    Ok((venv, dirs))
}

fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// A user name as a login name in the sandbox's /etc/passwd.
fn login_name(user: &str) -> String {
    let name: String = user
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "kernel".to_string()
    } else {
        name
    }
}

fn is_safe_component(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

fn unavailable(reason: impl Into<String>) -> SandboxError {
    fsutil::unavailable(BACKEND, reason)
}

/// Who owns a workspace: the kernel's uid as root, else the broker.
fn workspace_owner(ids: Option<(u32, u32)>) -> WorkspaceOwner {
    ids.map_or(WorkspaceOwner::Broker, |(uid, gid)| {
        WorkspaceOwner::Kernel { uid, gid }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_plan_creates_every_parent_once_with_0755() {
        let mut fs = MountPlan::default();
        fs.ro_bind(Path::new("/usr"), Path::new("/usr"));
        fs.ro_bind(
            Path::new("/root/.pyenv/v/3.11"),
            Path::new("/root/.pyenv/v/3.11"),
        );
        fs.ro_bind(
            Path::new("/root/.pyenv/v/other"),
            Path::new("/root/.pyenv/v/other"),
        );
        fs.ro_bind(Path::new("/usr/lib/python3"), Path::new("/usr/lib/python3"));
        let args: Vec<String> = fs
            .args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--ro-bind",
                "/usr",
                "/usr",
                "--perms",
                "0755",
                "--dir",
                "/root",
                "--perms",
                "0755",
                "--dir",
                "/root/.pyenv",
                "--perms",
                "0755",
                "--dir",
                "/root/.pyenv/v",
                "--ro-bind",
                "/root/.pyenv/v/3.11",
                "/root/.pyenv/v/3.11",
                "--ro-bind",
                "/root/.pyenv/v/other",
                "/root/.pyenv/v/other",
            ]
        );
    }

    #[test]
    fn endpoints_use_ipc_paths_in_the_runtime_directory() {
        let id = Uuid::nil();
        let ep = endpoints_for(&Path::new("/var/lib/kb/run").join(id.to_string())).unwrap();
        assert_eq!(ep.shell, format!("ipc:///var/lib/kb/run/{id}/k-1"));
        assert_eq!(ep.iopub, format!("ipc:///var/lib/kb/run/{id}/k-2"));
        assert_eq!(ep.stdin, format!("ipc:///var/lib/kb/run/{id}/k-3"));
        assert_eq!(ep.control, format!("ipc:///var/lib/kb/run/{id}/k-4"));
        assert_eq!(ep.hb, format!("ipc:///var/lib/kb/run/{id}/k-5"));
        let long = Path::new("/").join("x".repeat(60)).join(id.to_string());
        assert!(endpoints_for(&long).unwrap_err().contains("too long"));
    }

    #[test]
    fn run_dirs_stay_out_of_the_data_dir_as_root_and_short_unprivileged() {
        let short = LocalSandboxConfig::new("/var/lib/kernel-broker", "/opt/kb/kernels");
        let hash = fsutil::data_dir_hash(Path::new("/var/lib/kernel-broker"));
        assert_eq!(
            choose_run_base(&short, true, 0).unwrap(),
            PathBuf::from(format!("/run/kernel-broker-{hash}"))
        );
        assert_eq!(
            choose_run_base(&short, false, 1000).unwrap(),
            PathBuf::from("/var/lib/kernel-broker/run")
        );
        let long = LocalSandboxConfig::new(format!("/srv/{}", "d".repeat(80)), "/k");
        let base = choose_run_base(&long, true, 0).unwrap();
        assert!(
            base.starts_with("/run") && base.to_str().unwrap().starts_with("/run/kernel-broker-")
        );
        assert!(!choose_run_base(&long, false, 1000)
            .unwrap()
            .starts_with(&long.data_dir));
        let mut explicit = long.clone();
        explicit.run_dir = Some(PathBuf::from(format!("/{}", "r".repeat(70))));
        assert!(choose_run_base(&explicit, true, 0).is_err());
    }

    #[test]
    fn exit_statuses_map_to_reasons() {
        let exited = |code: i32| Ok(ExitStatus::from_raw(code << 8));
        let killed = |sig: i32| Ok(ExitStatus::from_raw(sig));
        assert_eq!(classify_exit(exited(0), false, 0, 1), ExitReason::Exited(0));
        assert_eq!(classify_exit(exited(3), false, 0, 1), ExitReason::Exited(3));
        // bwrap's 128 + N convention.
        assert_eq!(
            classify_exit(exited(137), false, 0, 1),
            ExitReason::Signaled(9)
        );
        assert_eq!(
            classify_exit(exited(130), false, 0, 1),
            ExitReason::Signaled(2)
        );
        assert_eq!(
            classify_exit(exited(137), false, 1, 64 << 20),
            ExitReason::OutOfMemory {
                limit_bytes: 64 << 20
            }
        );
        assert_eq!(
            classify_exit(killed(9), false, 2, 5),
            ExitReason::OutOfMemory { limit_bytes: 5 }
        );
        assert_eq!(
            classify_exit(killed(15), false, 2, 5),
            ExitReason::Signaled(15)
        );
        assert_eq!(classify_exit(killed(9), true, 2, 5), ExitReason::Terminated);
        assert!(matches!(
            classify_exit(Err(io::Error::other("x")), false, 0, 0),
            ExitReason::Lost(_)
        ));
    }

    #[test]
    fn login_names_are_safe_for_passwd() {
        assert_eq!(login_name("alice"), "alice");
        assert_eq!(login_name("a:b\nc"), "a_b_c");
        assert_eq!(login_name(""), "kernel");
    }

    #[test]
    fn connection_file_uses_ipc() {
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
        let c = connection_file(&spec);
        assert_eq!(c["transport"], "ipc");
        assert_eq!(c["ip"], "/run/kernel/k");
        assert_eq!(c["hb_port"], 5);
        assert_eq!(c["key"], "abc");
        assert_eq!(c["signature_scheme"], "hmac-sha256");
    }
}
