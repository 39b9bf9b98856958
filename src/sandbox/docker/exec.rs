//! A kernel in its user's container: the exec that runs it (its command, connection file
//! and session directory), its own cgroup leaf, and its interrupt. What ends what it
//! started is `reaper.rs`; one-off commands in the container are `running.rs`.
//!
//! Memory and processes are the kernel's own: the kernel's command first waits for a `go`
//! file in its session directory; the broker meanwhile moves the exec's
//! process (its host pid, from the daemon) into a leaf of the container's cgroup with the
//! kernel's limits ([`ContainerCgroup`]), then writes `go`. So the kernel and everything it
//! forks run in the leaf from their first instruction, and a kernel past its limit is the
//! only one its leaf's OOM killer can pick. Where the broker cannot manage cgroups (not
//! root, rootless daemons) it says so once in the log and writes `go` anyway: the kernel
//! then runs under the container's (the user's) limits only.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bollard::errors::Error as DockerError;
use bollard::exec::CreateExecOptions;
use bollard::Docker;
use tokio::time::timeout;

use super::daemon::error_text;
use super::engine::Engine;
use super::place::exec_pid;
use super::running::{exec_output, start_exec, ContainerInfo};
use super::{
    Inner, EXEC_TIMEOUT, KERNEL_GID, KERNEL_UID, MAX_SOCKET_PATH, RUN_DIR_INSIDE, WORKSPACE_INSIDE,
};
use crate::sandbox::cgroup::{ContainerCgroup, CpuClock, Freezer, Leaf};
use crate::sandbox::fork::ForkOrigin;
use crate::sandbox::fsutil::{self, io_err, FileMode, SocketPathError};
use crate::sandbox::pidfd;
use crate::sandbox::procfs::{children_of, uids_of};
use crate::sandbox::watched::{BackendKernel, KernelWatch};
use crate::sandbox::{
    runtime_env, thread_env, KernelEndpoints, KernelLimits, LaunchSpec, SandboxError, UserLimits,
};

/// What waiters hear if the watcher went away without a word.
pub(super) const LOST: &str = "the broker stopped watching the kernel (runtime shut down)";

/// What a kernel's handle and its watcher share.
pub(super) struct DockerKernel {
    pub watch: KernelWatch,
    pub docker: Docker,
    pub container: Arc<ContainerInfo>,
    /// The session directory's name (`/run/kernel/<dir>`).
    pub dir: String,
    pub host_dir: PathBuf,
    /// The kernel's exec; empty for a kernel forked from a template (`template.rs`), which
    /// has no exec of its own (see [`Self::forked`]).
    pub exec_id: String,
    /// The host pid of a plainly started kernel's exec in a sandbox's own container (its
    /// `sh`, whose `tini` runs the kernel), known as root: where its copies start
    /// (`copy.rs`). None for any other kernel.
    pub exec_pid: Option<i32>,
    /// A kernel forked from its user's template: its host pid and a pidfd on it.
    pub forked: Option<ForkedPid>,
    /// Under Podman, a pidfd on the exec's process (a host pid): how its watcher sees the
    /// kernel's end, which Podman does not report (`engine.rs`). None under Docker.
    pub exec_pidfd: Option<OwnedFd>,
    /// The kernel's own cgroup leaf (none where the broker cannot manage cgroups).
    pub leaf: Option<Leaf>,
    /// What freezes that leaf, for a forked kernel (one that can have checkpoints).
    pub freezer: Option<Freezer>,
    pub limits: KernelLimits,
    /// The user's workspace on the host and its quota, to tell a full disk.
    pub workspace: PathBuf,
    pub quota_bytes: u64,
}

/// Where a kernel of the Docker sandbox can be forked (`fork.rs` says which can).
pub(super) fn fork_origin(kernel: &DockerKernel) -> Option<ForkOrigin> {
    if kernel.watch.has_exited() {
        return None;
    }
    let host_pid = match (&kernel.forked, kernel.container.own) {
        (Some(forked), _) => forked.host_pid,
        // A sandbox's own kernel started plainly: its copies start from it (`copy.rs`).
        (None, Some(_)) => plain_kernel_pid(kernel.exec_pid?)?,
        (None, None) => return None,
    };
    // The uid it runs as on the host (the image's kernel user, or what a user namespace
    // maps it to): its forks must run as that uid too.
    let uids = uids_of(host_pid)?;
    if uids.iter().any(|u| *u != uids[0]) {
        return None;
    }
    Some(ForkOrigin {
        host_pid,
        uid: Some(uids[0]),
        dir: kernel.host_dir.parent()?.to_path_buf(),
        inside: RUN_DIR_INSIDE.to_string(),
        pid_namespace: None,
        kernel: Some(kernel.watch.session_id),
        own_workspace: kernel.container.own,
    })
}

/// The kernel a plain exec runs (`kernel_command`): the one child of the one child (`tini
/// -s`) of the exec's `sh`, host pid `exec`.
fn plain_kernel_pid(exec: i32) -> Option<i32> {
    let only = |pid: i32| match children_of(pid).as_slice() {
        [one] => Some(*one),
        _ => None,
    };
    only(only(exec)?)
}

/// A forked kernel's process, as the broker (root on the host) sees it.
pub(super) struct ForkedPid {
    pub host_pid: i32,
    /// Signals go through it, so they never reach a process that reused the pid.
    pub pidfd: OwnedFd,
    /// The container's cgroup, where the leaves of this kernel's own forks go (`fork.rs`).
    pub cgroup: ContainerCgroup,
}

impl DockerKernel {
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

#[async_trait]
impl BackendKernel for DockerKernel {
    fn watch(&self) -> &KernelWatch {
        &self.watch
    }

    fn memory_usage_file(&self) -> Option<PathBuf> {
        self.leaf.as_ref()?.memory_usage_file()
    }

    fn cpu_clock(&self) -> Option<CpuClock> {
        self.leaf.as_ref().map(|l| l.cpu_clock())
    }

    /// A kernel forked in its user's container (from the template, or from a live kernel)
    /// can be forked in turn (`fork.rs`); a plain exec or a sandbox's own container's
    /// kernel cannot.
    fn fork_origin(&self) -> Option<ForkOrigin> {
        fork_origin(self)
    }

    /// A forked kernel's leaf, frozen beneath the container's own freezer cgroup (v1) or
    /// by its `cgroup.freeze` (v2): such a kernel can be held as a checkpoint.
    fn freezer(&self) -> Option<&Freezer> {
        self.freezer.as_ref()
    }

    /// The container's init: every kernel of the user shares the container's namespace.
    async fn network_pid(&self) -> Option<i32> {
        super::running::init_pid(&self.docker, &self.container).await
    }

    async fn interrupt(&self) -> Result<(), SandboxError> {
        let shared = self;
        let fail = |why: String| SandboxError::Io {
            what: "cannot interrupt the kernel",
            path: shared.host_dir.join("pid"),
            source: io::Error::other(why),
        };
        if shared.watch.has_exited() {
            return Err(fail("the kernel has exited".to_string()));
        }
        if let Some(forked) = &shared.forked {
            // Straight to the kernel: no tini of its own stands between.
            pidfd::signal(&forked.pidfd, pidfd::Signal::INT)
                .map_err(|e| fail(format!("cannot signal process {}: {e}", forked.host_pid)))?;
            tracing::debug!(session = %shared.watch.session_id, "sent SIGINT to the forked kernel");
            return Ok(());
        }
        let script = shared.signal_script("INT");
        match timeout(
            EXEC_TIMEOUT,
            exec_output(&shared.docker, &shared.container.id, &["sh", "-c", &script]),
        )
        .await
        {
            Ok(Ok((0, _))) => {
                tracing::debug!(session = %shared.watch.session_id, "sent SIGINT to the kernel");
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
}

impl Inner {
    /// Under Podman, a pidfd on a started kernel exec's process ([`DockerKernel::exec_pidfd`]);
    /// None under Docker, which reports the exec's end itself. Opened while the process
    /// waits for its `go`, so the pid cannot have been reused.
    pub(super) async fn exec_pidfd(&self, docker: &Docker, exec_id: &str) -> Option<OwnedFd> {
        if self.engine().await.ok()? != Engine::Podman {
            return None;
        }
        let opened = match exec_pid(docker, exec_id).await {
            Ok(pid) => pidfd::open(pid).map_err(|e| format!("pidfd_open({pid}): {e}")),
            Err(e) => Err(e.to_string()),
        };
        match opened {
            Ok(fd) => Some(fd),
            Err(why) => {
                tracing::warn!(exec = %exec_id, %why, "cannot watch the kernel's process; its end is seen only with its container's");
                None
            }
        }
    }

    /// Starts the kernel with a detached exec; returns the exec id.
    pub(super) async fn start_kernel(
        &self,
        docker: &Docker,
        container: &ContainerInfo,
        spec: &LaunchSpec,
        dir: &str,
    ) -> Result<String, ExecError> {
        let mut env = base_env(&spec.user.limits);
        // The spec's own variables (its kernel.json's `env`: Deno's `NO_COLOR`, jjava's
        // startup statement), as the local sandbox sets them: before the runtimes' bounds
        // and the tenant's, which win (`last_wins` below).
        env.extend(self.spec_env(&spec.kernel_name));
        // The runtimes' own memory bounds (a JVM's heap, R's vectors: `runtime_env`).
        env.extend(
            runtime_env(&spec.limits, &spec.user.limits)
                .into_iter()
                .map(|(k, v)| format!("{k}={v}")),
        );
        // A sandbox's own container: E2B's user and home (`own.rs`).
        let cwd = match spec.own_workspace {
            Some(_) => {
                env.extend(super::own::own_env());
                // Its copies' connection files are in the container's runtime directory.
                env.push(format!(
                    "{}={RUN_DIR_INSIDE}",
                    crate::sandbox::boot::FORK_ROOT_ENV
                ));
                crate::sandbox::own_workspace::HOME_INSIDE
            }
            None => WORKSPACE_INSIDE,
        };
        env.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
        // The bootstrap script the kernel starts through, in the runtime directory its
        // container shows at /run/kernel (the user's, or a sandbox container's: the
        // broker's, which no kernel can write), as a template's is.
        let slot = match spec.own_workspace {
            Some(key) => super::own::own_slot(key),
            None => spec.user.name.clone(),
        };
        let user_dir = self.user_run_dir(&slot);
        let installed = tokio::task::spawn_blocking(move || {
            crate::sandbox::boot::install_script(&user_dir).map_err(|source| ExecError::Boot {
                dir: user_dir,
                source,
            })
        })
        .await;
        match installed {
            Ok(result) => result?,
            Err(e) => {
                return Err(ExecError::Boot {
                    dir: self.user_run_dir(&slot),
                    source: io::Error::other(e),
                })
            }
        };
        let argv = match self.other_kernel(&spec.kernel_name) {
            Some(kernel) => spec_argv(kernel, dir),
            None => python_argv(dir),
        };
        let cmd = kernel_command(dir, self.privileged, &argv);
        let exec_id = create_exec_in(docker, &container.id, cmd, last_wins(env), false, cwd)
            .await
            .map_err(|source| ExecError::Create {
                container: container.name.clone(),
                advice: self.advice(&source),
                source,
            })?;
        start_exec(docker, &exec_id, true)
            .await
            .map_err(|source| ExecError::Start {
                container: container.name.clone(),
                advice: self.advice(&source),
                source,
            })?;
        Ok(exec_id)
    }
}

/// Why a kernel's exec did not start; `advice` is what the engine's refusal means here.
#[derive(Debug, thiserror::Error)]
pub(super) enum ExecError {
    #[error("cannot install the kernels' bootstrap script in {}", dir.display())]
    Boot {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot create the kernel's exec in {container}: {advice}")]
    Create {
        container: String,
        advice: String,
        #[source]
        source: DockerError,
    },
    #[error("cannot start the kernel in {container}: {advice}")]
    Start {
        container: String,
        advice: String,
        #[source]
        source: DockerError,
    },
}

/// Creates an exec of `cmd` set up as every kernel process is (its environment, the
/// workspace as working directory), with its stdio attached when `attach`; returns its id.
pub(super) async fn create_kernel_exec(
    docker: &Docker,
    container_id: &str,
    cmd: Vec<String>,
    env: Vec<String>,
    attach: bool,
) -> Result<String, DockerError> {
    create_exec_in(docker, container_id, cmd, env, attach, WORKSPACE_INSIDE).await
}

/// [`create_kernel_exec`] with `cwd` as the working directory.
pub(super) async fn create_exec_in(
    docker: &Docker,
    container_id: &str,
    cmd: Vec<String>,
    env: Vec<String>,
    attach: bool,
    cwd: &str,
) -> Result<String, DockerError> {
    let options = CreateExecOptions {
        cmd: Some(cmd),
        env: Some(env),
        working_dir: Some(cwd.to_string()),
        attach_stdin: Some(attach),
        attach_stdout: Some(attach),
        attach_stderr: Some(attach),
        ..Default::default()
    };
    Ok(docker.create_exec(container_id, options).await?.id)
}

/// What every kernel's process gets in its environment (a forked kernel from its
/// template): debugpy's file check off, thread pools sized to the user's CPUs.
pub(super) fn base_env(limits: &UserLimits) -> Vec<String> {
    let mut env: Vec<String> = vec!["PYDEVD_DISABLE_FILE_VALIDATION=1".to_string()];
    env.extend(
        thread_env(limits)
            .into_iter()
            .map(|(k, v)| format!("{k}={v}")),
    );
    env
}

/// `env` (`NAME=value` entries) with each name once, at its last value: Docker's exec
/// keeps every entry it is given, and a process's `getenv` reads the first.
pub(super) fn last_wins(env: Vec<String>) -> Vec<String> {
    let name = |e: &String| e.split_once('=').map_or(e.clone(), |(k, _)| k.to_string());
    let mut seen = std::collections::HashSet::new();
    let mut kept: Vec<String> = env
        .into_iter()
        .rev()
        .filter(|e| seen.insert(name(e)))
        .collect();
    kept.reverse();
    kept
}

/// The exit status a kernel's command wrote to [`STATUS_FILE`] in its session directory
/// `host_dir`, if it wrote one that reads as a status (0..=255). Read without following a
/// symlink anywhere below the directory holding the session directories: the kernel can
/// replace both its session directory and the file.
pub(super) fn recorded_status(host_dir: &Path) -> Option<i64> {
    let parent = fsutil::open_tree_root(host_dir.parent()?).ok()?;
    let rel = Path::new(host_dir.file_name()?).join(STATUS_FILE);
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let fd = fsutil::open_beneath(&parent, &rel, flags, 0).ok()?;
    let stat = rustix::fs::fstat(&fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return None;
    }
    let mut buf = [0u8; 8];
    let n = rustix::io::read(&fd, &mut buf).ok()?;
    let code: i64 = std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()?;
    (0..=255).contains(&code).then_some(code)
}

use super::kernel_argv::{kernel_command, python_argv, spec_argv};
pub(super) use super::kernel_argv::{kernel_log, HISTORY, STATUS_FILE};

/// The connection file (`ipc` transport; sockets `/run/kernel/<dir>/k-<port>`).
pub(super) fn connection_file(spec: &LaunchSpec, dir: &str) -> serde_json::Value {
    fsutil::connection_file(spec, &format!("{RUN_DIR_INSIDE}/{dir}/k"))
}

/// The host-side endpoints of a session directory; fails if a socket path is too long.
pub(super) fn endpoints_for(host_dir: &Path) -> Result<KernelEndpoints, SocketPathError> {
    fsutil::ipc_endpoints(
        host_dir,
        MAX_SOCKET_PATH,
        "configure a shorter run_dir or use a shorter user name",
    )
}

/// What a launch writes on the host: the session directory and the connection file.
pub(super) struct SessionFiles {
    pub dir: PathBuf,
    pub privileged: bool,
    /// None for a template's directory.
    pub connection: Option<serde_json::Value>,
}

impl SessionFiles {
    pub fn write(&self) -> Result<(), SandboxError> {
        // As root: the kernel's own directory. Otherwise world-writable, so the kernel can
        // create its sockets; the broker's 0700 runtime base keeps other host users out.
        let (mode, owner) = if self.privileged {
            (0o700, Some((KERNEL_UID, KERNEL_GID)))
        } else {
            (0o777, None)
        };
        let err = |what| io_err(what, &self.dir);
        let (Some(parent), Some(name)) = (self.dir.parent(), self.dir.file_name()) else {
            return Err(err("the session directory has no parent")(
                io::ErrorKind::InvalidInput.into(),
            ));
        };
        // Through descriptors (docs/SECURITY.md): made in the user's runtime directory (the
        // broker's, 0711), chowned and written through the new directory's descriptor.
        let parent = fsutil::open_tree_root(parent)
            .map_err(err("cannot open the user's runtime directory"))?;
        let dir = fsutil::make_dir_at(parent.as_fd(), Path::new(name), mode, owner)
            .map_err(err("cannot create the session's runtime directory"))?;
        let Some(connection) = &self.connection else {
            return Ok(());
        };
        let file_mode = if self.privileged { 0o600 } else { 0o644 };
        fsutil::write_connection_file(
            dir.as_fd(),
            &self.dir,
            connection,
            FileMode::Exact(file_mode),
            owner,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variable_is_set_once_at_its_last_value() {
        let env = [
            "NO_COLOR=1",
            "A=spec",
            "PATH=/x",
            "A=tenant",
            "B",
            "B=2",
            "C=a=b",
        ];
        let env = last_wins(env.iter().map(|e| e.to_string()).collect());
        assert_eq!(env, ["NO_COLOR=1", "PATH=/x", "A=tenant", "B=2", "C=a=b"]);
    }

    #[test]
    fn connection_files_point_into_the_session_directory() {
        let spec = LaunchSpec::example();
        let c = connection_file(&spec, "0123456789ab");
        assert_eq!(c["transport"], "ipc");
        assert_eq!(c["ip"], "/run/kernel/0123456789ab/k");
        assert_eq!(c["key"], "abc");
        assert_eq!(c["signature_scheme"], "hmac-sha256");
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
        assert!(endpoints_for(&long)
            .unwrap_err()
            .to_string()
            .contains("too long"));
    }

    #[test]
    fn a_recorded_status_is_read_only_from_a_regular_file_in_the_session_directory() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("0123456789ab");
        std::fs::create_dir(&dir).unwrap();
        assert_eq!(recorded_status(&dir), None);
        std::fs::write(dir.join(STATUS_FILE), "3\n").unwrap();
        assert_eq!(recorded_status(&dir), Some(3));
        std::fs::write(dir.join(STATUS_FILE), "137\n").unwrap();
        assert_eq!(recorded_status(&dir), Some(137));
        for bad in ["", "-1", "256", "x", "99999999999"] {
            std::fs::write(dir.join(STATUS_FILE), bad).unwrap();
            assert_eq!(recorded_status(&dir), None, "{bad:?}");
        }
        // A symlink for the file, or for the session directory, is not followed.
        let elsewhere = base.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join(STATUS_FILE), "7").unwrap();
        std::fs::remove_file(dir.join(STATUS_FILE)).unwrap();
        std::os::unix::fs::symlink(elsewhere.join(STATUS_FILE), dir.join(STATUS_FILE)).unwrap();
        assert_eq!(recorded_status(&dir), None);
        let swapped = base.path().join("swapped");
        std::os::unix::fs::symlink(&elsewhere, &swapped).unwrap();
        assert_eq!(recorded_status(&swapped), None);
        // Not a regular file (a fifo would block a plain read).
        std::fs::remove_file(dir.join(STATUS_FILE)).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.join(STATUS_FILE),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        assert_eq!(recorded_status(&dir), None);
    }
}
