//! Starting a kernel: the launch's files and cgroup leaf, the bwrap child (placed in the
//! leaf between `fork` and `exec`, handed the info pipe and the syscall filter), its output
//! forwarding, the reaper that owns it from then on, and bwrap's report of the sandbox's
//! init pid.
//!
//! Process shape: the broker spawns `bwrap` (host pid A), which clones the sandbox's init
//! (B, pid 1 inside; its host pid comes from `--info-fd`), which forks the kernel (C, pid 2
//! inside). A is placed in the user's leaf cgroup between `fork` and `exec`, so everything
//! after it is too.

use std::collections::HashMap;
use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use uuid::Uuid;

use super::bwrap::{bwrap_args, kernel_env, BwrapRequest, HostRoot};
use super::files::{connection_file, endpoints_for, login_name, LaunchFiles, LaunchGuard};
use super::keep;
use super::output::{forward_output, Stream, Tail};
use super::own::{own_env, Placement};
use super::reaper::{LocalKernel, Reaped, Watched};
use super::{LocalSandbox, TERMINATE_TIMEOUT};
use super::{BOOT_DIR_NAME, HOME_INSIDE};
use crate::sandbox::boot;
use crate::sandbox::cgroup::{Cgroups, Leaf};
use crate::sandbox::fsutil::{self, launch_err, launch_failed, launch_step};
use crate::sandbox::own_workspace::{self, OwnDirs};
use crate::sandbox::seccomp::SyscallFilter;
use crate::sandbox::watched::WatchedKernel;
use crate::sandbox::LaunchRefusal;
use crate::sandbox::{
    environ, runtime_env, thread_env, KernelLimits, KernelProcess, LaunchSpec, Launched,
    SandboxError, SandboxUser, KERNEL_OOM_SCORE_ADJ,
};

/// How long bwrap may take to report the sandbox's init pid.
const INFO_TIMEOUT: Duration = Duration::from_secs(10);

/// How one sandbox is started, beyond its command.
#[derive(Debug, Clone, Default)]
pub(super) struct StartOptions {
    /// Show the bootstrap script (`boot.rs`) at [`super::BOOT_DIR_INSIDE`], read-only.
    pub boot_script: bool,
    /// Keep the command's stdin and stdout as a control channel (a fork-server template)
    /// instead of forwarding stdout to the log.
    pub control: bool,
    /// The command is CRIU restoring a copied kernel (`copy.rs`, [`BwrapRequest::restore`]),
    /// which inherits these descriptors (CRIU itself, the images, its log).
    pub restore: Option<Vec<RawFd>>,
}

/// What a sandbox runs: the command, the kernel spec's environment, and the spec's
/// resource directory (shown read-only).
pub(super) struct SandboxCommand {
    pub argv: Vec<String>,
    pub env: HashMap<String, String>,
    pub resource_dir: Option<PathBuf>,
}

/// A started sandbox, with what a template needs beyond the handle.
pub(super) struct Started {
    pub launched: Launched,
    pub kernel: Arc<LocalKernel>,
    pub control: Option<(ChildStdin, ChildStdout)>,
}

/// What [`LocalSandbox::prepare_launch`] made ready.
pub(super) struct Prepared {
    pub workspace: PathBuf,
    /// The session's own workspace, when it has one (`workspace` is then its home).
    pub own: Option<OwnDirs>,
    pub ids: Option<(u32, u32)>,
    pub rundir: PathBuf,
    pub guard: LaunchGuard,
}

impl LocalSandbox {
    /// Starts `command` in a sandbox of its own as a kernel (its output forwarded to the
    /// log).
    pub(super) async fn launch_argv(
        &self,
        spec: LaunchSpec,
        command: SandboxCommand,
        cgroups: Option<Arc<Cgroups>>,
    ) -> Result<Launched, SandboxError> {
        let options = StartOptions {
            boot_script: boot::runs_broker_script(&command.argv),
            control: false,
            restore: None,
        };
        self.start_sandbox(spec, command, cgroups, options)
            .await
            .map(|started| started.launched)
    }

    pub(super) async fn start_sandbox(
        &self,
        spec: LaunchSpec,
        command: SandboxCommand,
        cgroups: Option<Arc<Cgroups>>,
        options: StartOptions,
    ) -> Result<Started, SandboxError> {
        let SandboxCommand {
            argv,
            env: spec_env,
            resource_dir,
        } = command;
        let user = spec.user.clone();
        let session = spec.session_id;
        if self.kernels.contains(&session) {
            return Err(launch_err(&user, LaunchRefusal::SessionHasKernel(session)));
        }
        let endpoints = endpoints_for(&self.run_base.join(session.to_string()))
            .map_err(|e| launch_failed(&user, e))?;
        // The bootstrap script, in a directory of the broker's shown read-only.
        let boot_dir = options
            .boot_script
            .then(|| self.run_base.join(BOOT_DIR_NAME));
        let Prepared {
            workspace,
            own,
            ids,
            rundir,
            mut guard,
        } = self
            .prepare_launch(
                &user,
                session,
                connection_file(&spec),
                spec.limits,
                cgroups.as_ref(),
                Placement {
                    boot_dir: boot_dir.clone(),
                    own_workspace: spec.own_workspace,
                },
            )
            .await?;

        // The kernel's whole environment, read only after the drop (`environ.rs`).
        let mut env: Vec<(String, String)> = spec_env.into_iter().collect();
        env.sort();
        if own.is_some() {
            env.extend(own_env());
        }
        // The runtimes' own memory bounds (a JVM's heap, V8's), then the tenant's.
        env.extend(runtime_env(&spec.limits, &user.limits));
        env.extend(spec.env.iter().cloned());
        let environment = self.environment_memfd(&user, &env, &argv)?;
        let request = BwrapRequest {
            workspace: &workspace,
            rundir: &rundir,
            ids,
            // /tmp's pages are the kernel's memory: no larger than its limit.
            tmp_size: Some(spec.limits.memory_bytes).filter(|b| *b > 0),
            resource_dir: resource_dir.as_deref(),
            boot_dir: boot_dir.as_deref(),
            env_fd: environment.as_raw_fd(),
            own: own.as_ref(),
            restore: options.restore.is_some(),
        };
        let leaf = guard.leaf.as_ref().map(|(_, leaf)| leaf);
        // Kept kernels (`--keep-sessions`) report their end to a file the next run reads.
        let status = match &self.kept {
            Some(kept) => Some(
                kept.open_status(session)
                    .map_err(|e| launch_step(&user, "cannot create the kernel's status file", e))?,
            ),
            None => None,
        };
        let (mut child, info, stderr_task, tail) =
            self.spawn(&spec, &request, environment, leaf, status, &options)?;
        let control = match (child.stdin.take(), child.stdout.take()) {
            (Some(stdin), Some(stdout)) if options.control => Some((stdin, stdout)),
            _ => None,
        };
        let bwrap_pid = child.id().and_then(|p| i32::try_from(p).ok());

        // From here the reaper owns the leaf and the runtime directory, and the handle's
        // drop (also when this future is dropped half-way) kills the kernel.
        let (cgroups, leaf) = guard.disarm();
        let process = Watched::Child(child);
        let kernel = Reaped {
            bwrap_pid,
            own_workspace: spec.own_workspace,
            leaf,
            cgroups,
            tail: tail.clone(),
            kept: self.kept.clone(),
            ..Reaped::new(
                session,
                &user,
                process,
                rundir,
                spec.limits,
                workspace.clone(),
            )
        }
        .spawn(&self.kernels);
        let handle = WatchedKernel::new(kernel.clone(), TERMINATE_TIMEOUT);

        let own = spec.own_workspace;
        match read_init_pid(info).await {
            Ok(pid) => {
                let _ = kernel.init_pid.set(pid);
                if let Some(kept) = &self.kept {
                    if let Err(e) =
                        keep::write_ticket(kept, session, &user.name, bwrap_pid, pid, own).await
                    {
                        handle.terminate().await;
                        return Err(launch_failed(&user, NotRecorded(e)));
                    }
                }
            }
            Err(why) => {
                // bwrap failed before the sandbox existed; explain with what it wrote.
                handle.terminate().await;
                let _ = timeout(Duration::from_secs(2), stderr_task).await;
                let stderr = tail.lines().join(" | ");
                return Err(launch_failed(&user, NotStarted { why, stderr }));
            }
        }
        tracing::info!(
            %session,
            user = %user.name,
            kernel = %spec.kernel_name,
            pid = ?kernel.init_pid.get(),
            "kernel launched"
        );
        Ok(Started {
            launched: Launched {
                endpoints,
                process: Box::new(handle),
            },
            kernel,
            control,
        })
    }

    /// Builds and spawns the bwrap command; returns the child, the read end of its info
    /// pipe, the stderr forwarding task and the stderr tail.
    fn spawn(
        &self,
        spec: &LaunchSpec,
        request: &BwrapRequest<'_>,
        environment: OwnedFd,
        leaf: Option<&Leaf>,
        status: Option<OwnedFd>,
        options: &StartOptions,
    ) -> Result<(Child, OwnedFd, JoinHandle<()>, Tail), SandboxError> {
        let user = &spec.user;
        let control = options.control;
        let inherited = options.restore.as_deref().unwrap_or_default();
        let (info_read, info_write) =
            io::pipe().map_err(|e| launch_step(user, "cannot create a pipe", e))?;
        let info_fd = info_write.as_raw_fd();
        // A restore runs without the filter: CRIU puts the kernel's own back on it.
        let seccomp = match request.restore {
            true => None,
            false => self
                .seccomp_memfd()
                .map_err(|e| launch_step(user, "cannot pass the syscall filter", e))?,
        };
        let seccomp_fd = seccomp.as_ref().map(AsRawFd::as_raw_fd);

        let status_fd = status.as_ref().map(AsRawFd::as_raw_fd);
        let env_fd = request.env_fd;
        let mut args = vec![OsString::from("--info-fd"), info_fd.to_string().into()];
        if let Some(fd) = status_fd {
            args.extend([OsString::from("--json-status-fd"), fd.to_string().into()]);
        }
        args.extend(bwrap_args(
            &self.bwrap_opts,
            &HostRoot::probe(&self.cfg.extra_ro_binds).with_ca_file(self.cfg.ca_file.as_deref()),
            request,
            seccomp_fd,
        ));
        let mut cmd = self.bwrap_command(
            &args,
            leaf,
            [Some(info_fd), Some(env_fd), seccomp_fd, status_fd]
                .into_iter()
                .flatten()
                .chain(inherited.iter().copied())
                .collect(),
        );
        cmd.stdin(if control {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        // A kept kernel must outlive this process, however it ends; otherwise the child is
        // killed if its handle is ever dropped unreaped.
        .kill_on_drop(self.kept.is_none());
        let mut child = cmd
            .spawn()
            .map_err(|e| launch_step(user, format!("cannot start {}", self.bwrap.display()), e))?;
        drop(info_write);
        // bwrap has its own copy; it reads the filter and closes it before the kernel runs.
        drop(seccomp);
        drop(status);
        drop(environment);

        let tail = Tail::default();
        // A template's stdout is its control channel, read by `template.rs`.
        if let Some(stdout) = (!control).then(|| child.stdout.take()).flatten() {
            tokio::spawn(forward_output(
                stdout,
                spec.session_id,
                Stream::Stdout,
                None,
                self.cfg.log_filter.clone(),
            ));
        }
        let stderr_task = match child.stderr.take() {
            Some(stderr) => tokio::spawn(forward_output(
                stderr,
                spec.session_id,
                Stream::Stderr,
                Some(tail.clone()),
                self.cfg.log_filter.clone(),
            )),
            None => tokio::spawn(async {}),
        };
        Ok((child, OwnedFd::from(info_read), stderr_task, tail))
    }

    /// The host side of a launch before bwrap starts: the workspace, the runtime directory
    /// of `id` and its files (`connection` the connection file's JSON; `Null`: none), the
    /// bootstrap script in `boot_dir` if given, then a cgroup leaf for `id` with `limits`.
    /// The guard removes the directory and the leaf if the launch fails before a reaper
    /// takes them ([`LaunchGuard::disarm`]).
    pub(super) async fn prepare_launch(
        &self,
        user: &SandboxUser,
        id: Uuid,
        connection: serde_json::Value,
        limits: KernelLimits,
        cgroups: Option<&Arc<Cgroups>>,
        placement: Placement,
    ) -> Result<Prepared, SandboxError> {
        let Placement {
            boot_dir,
            own_workspace,
        } = placement;
        let ids = self.kernel_ids(user)?;
        let own = own_workspace.map(|key| (key, self.own_workspaces.dirs(key)));
        let workspace = match &own {
            Some((_, dirs)) => dirs.home.clone(),
            None => self.workspace_path(user)?,
        };
        let rundir = self.run_base.join(id.to_string());
        // On failure `write` removes what it created; from then on the guard does, until
        // the reaper takes over.
        let files = LaunchFiles {
            workspace: workspace.clone(),
            rundir: rundir.clone(),
            ids,
            login: match own {
                Some(_) => own_workspace::LOGIN.to_string(),
                None => login_name(&user.name),
            },
            home: match own {
                Some(_) => own_workspace::HOME_INSIDE,
                None => HOME_INSIDE,
            },
            connection,
            // An own workspace is its own file system, made ready below.
            quota: own.is_none().then(|| {
                (
                    self.workspace_images.clone(),
                    user.limits.workspace_quota_bytes,
                )
            }),
        };
        let own_workspaces = self.own_workspaces.clone();
        let quota = user.limits.workspace_quota_bytes;
        let own_key = own.as_ref().map(|(key, _)| *key);
        tokio::task::spawn_blocking(move || {
            if let Some(key) = own_key {
                own_workspaces.prepare(key, quota, ids)?;
            }
            if let Some(dir) = &boot_dir {
                fsutil::create_private_dir(dir, Some(0o755))?;
                boot::install_script(dir).map_err(fsutil::io_err(
                    "cannot install the kernels' bootstrap script",
                    dir,
                ))?;
            }
            files.write()
        })
        .await
        .map_err(|e| launch_step(user, "preparing files failed", e))??;
        let mut guard = LaunchGuard {
            rundir: Some(rundir.clone()),
            leaf: None,
        };
        if let Some(cg) = cgroups {
            let (cg2, name, user_limits) = (cg.clone(), user.name.clone(), user.limits.clone());
            let leaf = tokio::task::spawn_blocking(move || {
                cg2.create_leaf(&name, &user_limits, &limits, id)
            })
            .await
            .map_err(|e| launch_step(user, "creating the cgroup failed", e))??;
            guard.leaf = Some((cg.clone(), leaf));
        }
        Ok(Prepared {
            workspace,
            own: own.map(|(_, dirs)| dirs),
            ids,
            rundir,
            guard,
        })
    }

    /// bwrap with `args`, as a kernel's and a command's sandbox both start: an empty
    /// environment (bwrap runs as root, see `environ.rs`), run from `/`, stdout and stderr
    /// piped, in its own process group (terminal signals such as Ctrl-C on the broker stay
    /// away from kernels; the broker ends them itself). Between fork and exec it joins
    /// `leaf`, raises its OOM score, and inherits `fds` (created close-on-exec so that no
    /// other child of the broker does).
    pub(super) fn bwrap_command(
        &self,
        args: &[OsString],
        leaf: Option<&Leaf>,
        fds: Vec<RawFd>,
    ) -> Command {
        let mut cmd = Command::new(&self.bwrap);
        cmd.args(args)
            .env_clear()
            .current_dir("/")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let procs: Vec<CString> = leaf.map(|l| l.procs_files().to_vec()).unwrap_or_default();
        // SAFETY: the closure runs between fork and exec and calls only async-signal-safe
        // functions (open, write, close, fcntl) on data prepared before the fork; it does not
        // allocate (iterating a Vec and building an io::Error from errno do not).
        unsafe {
            cmd.pre_exec(move || {
                for path in &procs {
                    join_cgroup(path)?;
                }
                raise_oom_score()?;
                for fd in &fds {
                    inherit_fd(*fd)?;
                }
                Ok(())
            });
        }
        cmd
    }

    /// A memfd holding the syscall filter for one bwrap run (none without a filter).
    pub(super) fn seccomp_memfd(&self) -> io::Result<Option<OwnedFd>> {
        self.seccomp.as_ref().map(SyscallFilter::memfd).transpose()
    }

    /// The whole environment of a kernel or command of `user` and its `argv`, as a sealed
    /// memfd for `BwrapRequest::env_fd`: the fixed part, the thread caps, then `extra` (the
    /// spec's and the tenant's; later entries win). Read only after the drop (`environ.rs`).
    pub(super) fn environment_memfd(
        &self,
        user: &SandboxUser,
        extra: &[(String, String)],
        argv: &[String],
    ) -> Result<OwnedFd, SandboxError> {
        let mut env = kernel_env(&self.venv, &user.name);
        env.extend(thread_env(&user.limits));
        env.extend(extra.iter().cloned());
        let script = environ::launch_script(&env, argv)
            .map_err(|e| launch_step(user, "the environment is refused", e))?;
        environ::env_memfd(&script).map_err(|e| launch_step(user, "cannot pass the environment", e))
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

/// Writes [`KERNEL_OOM_SCORE_ADJ`] to `/proc/self/oom_score_adj`: the host's OOM killer
/// picks kernels before the broker. Runs between fork and exec: async-signal-safe calls
/// only (the value is a constant, formatted at compile time).
fn raise_oom_score() -> io::Result<()> {
    const PATH: &[u8] = b"/proc/self/oom_score_adj\0";
    const VALUE: &[u8] = b"500";
    const _: () = assert!(KERNEL_OOM_SCORE_ADJ == 500);
    // SAFETY: PATH is NUL-terminated; VALUE is a static slice; `fd` is closed once.
    unsafe {
        let fd = libc::open(PATH.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let written = libc::write(fd, VALUE.as_ptr().cast(), VALUE.len());
        let err = io::Error::last_os_error();
        libc::close(fd);
        if written != VALUE.len() as isize {
            return Err(err);
        }
    }
    Ok(())
}

pub(super) use crate::sandbox::fsutil::inherit_fd;

/// Reads bwrap's `--info-fd` report and returns the host pid of the sandbox's init.
async fn read_init_pid(fd: OwnedFd) -> Result<i32, NoInitPid> {
    let mut rx =
        tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(NoInitPid::PipeUnusable)?;
    let mut buf = Vec::new();
    match timeout(INFO_TIMEOUT, rx.read_to_end(&mut buf)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(NoInitPid::ReadFailed(e)),
        Err(_) => return Err(NoInitPid::TimedOut(INFO_TIMEOUT)),
    }
    if buf.is_empty() {
        return Err(NoInitPid::ExitedEarly);
    }
    #[derive(Deserialize)]
    struct Info {
        #[serde(rename = "child-pid")]
        child_pid: i32,
    }
    serde_json::from_slice::<Info>(&buf)
        .map(|info| info.child_pid)
        .map_err(NoInitPid::NotUnderstood)
}

/// Why bwrap's report did not name the sandbox's init.
#[derive(Debug, thiserror::Error)]
enum NoInitPid {
    #[error("cannot read bwrap's info pipe: {0}")]
    PipeUnusable(#[source] io::Error),
    #[error("reading bwrap's info pipe failed: {0}")]
    ReadFailed(#[source] io::Error),
    #[error("bwrap did not report within {0:?}")]
    TimedOut(Duration),
    #[error("bwrap exited before creating the sandbox")]
    ExitedEarly,
    #[error("bwrap's info report is not understood: {0}")]
    NotUnderstood(#[source] serde_json::Error),
}

/// A sandbox that bwrap did not start; `stderr`: the last lines it wrote.
#[derive(Debug, thiserror::Error)]
#[error("the sandbox did not start ({why}): {stderr}")]
struct NotStarted {
    #[source]
    why: NoInitPid,
    stderr: String,
}

/// A kernel launched with `--keep-sessions` whose ticket could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot record the kernel for --keep-sessions: {0}")]
struct NotRecorded(#[source] io::Error);
