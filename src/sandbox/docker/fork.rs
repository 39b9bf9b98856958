//! Forking a live kernel in its user's container (`sandbox/fork.rs` says what is
//! exchanged; the local backend's `local/fork.rs` does the same in a bwrap sandbox).
//!
//! Only kernels forked in the user's shared container can be forked: those a fork-server
//! template forked (`template.rs`), and their forks in turn. They run as the container's
//! kernel uid beside their parent in the container's namespaces, the broker (root) knows
//! their host pids, and each has a cgroup leaf of its own; a fork joins them there and
//! lives on when its parent ends (it is reparented to the template's `tini -s`, and only
//! its own leaf's removal ends what it started). A kernel started by a plain `docker exec`
//! (the fork server off, `--keep-sessions`, or a broker not running as root) is refused:
//! without root the broker can neither find its child's host pid nor give it a leaf, and
//! with one the exec's end reaps what the kernel left (`reaper.rs`), the fork included. A
//! sandbox's own container (E2B) is not forked beside itself (its workspace would be
//! shared) but copied into a container of its own (`copy.rs`).
//!
//! The child's runtime directory is made by descriptor in the user's runtime directory
//! (the broker's, 0711, `/run/kernel` in the container), named like a launched kernel's
//! session directory and owned by the kernel uid, as `SessionFiles` makes every one
//! (`exec.rs`); the kernels get `KERNEL_BROKER_FORK_ROOT=/run/kernel`. The pid the kernel
//! reports is untrusted and checked from the host as the local backend checks it
//! ([`find_fork`]: the parent kernel's direct child by `NSpid`, its uid, still in its
//! leaf, held by a pidfd and checked again), and it must be in the pid namespace of the
//! container's init (asked of the daemon when the fork is prepared). It then enters a leaf
//! of its own in the container's cgroup with the new session's limits, is checked alive
//! after the move, and is watched through its pidfd (`watch.rs`, [`ForkedStatus::Zombie`]:
//! its parent kernel reaps it, so its status is read from its zombie). Its sockets are
//! reached as every kernel's are, never through a symlink.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::exec::{endpoints_for, DockerKernel, ForkedPid, SessionFiles, LOST};
use super::place::enter_new_leaf;
use super::running::init_pid;
use super::watch::{register_forked, ForkedStatus};
use super::{keep, Inner};
use crate::sandbox::cgroup::ContainerCgroup;
use crate::sandbox::fork::{find_fork, pid_namespace_of, ForkError, ForkOrigin, PreparedFork};
use crate::sandbox::fsutil::{launch_failed, launch_step, remove_dir_logged};
use crate::sandbox::pidfd;
use crate::sandbox::watched::KernelWatch;
use crate::sandbox::{KernelProcess, LaunchSpec, Launched};

/// Why a kernel not forked in its user's container cannot be forked.
pub(super) const PLAIN_START: &str = "this session's kernel was started plainly by `docker \
    exec`, not forked from its user's fork-server template in her container, and only those \
    can be forked (the broker could neither find a plain kernel's fork on the host nor give \
    it a cgroup of its own, and the exec's end would take the fork along); kernels are \
    forked from templates when the broker runs as root with fork_server on \
    (KERNEL_BROKER_FORK_SERVER, --fork-server), something to preload and without \
    --keep-sessions, in the user's shared container (not a sandbox's own); restart the \
    session to get such a kernel";

/// Removes a fork's session directory (given up, or never adopted): made by descriptor in
/// the user's runtime directory, the broker's.
async fn give_up(dir: PathBuf) {
    remove_dir_logged(dir).await;
}

impl Inner {
    pub(super) async fn discard_kernel_fork(&self, prepared: PreparedFork) {
        give_up(prepared.dir).await;
    }

    /// The parent kernel's entry, if `origin` names one of this sandbox's live kernels.
    fn fork_parent(&self, origin: &ForkOrigin) -> Option<Arc<DockerKernel>> {
        let kernel = self.kernels.get(&origin.kernel?)?;
        let same = kernel.forked.as_ref().map(|f| f.host_pid) == Some(origin.host_pid);
        (same && !kernel.watch.has_exited()).then_some(kernel)
    }

    pub(super) async fn prepare_kernel_fork(
        &self,
        parent: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let refused = || ForkError::Unsupported(PLAIN_START.into());
        let mut origin = parent.fork_origin().ok_or_else(refused)?;
        if !self.forks() || spec.own_workspace.is_some() {
            return Err(refused());
        }
        let kernel = self.fork_parent(&origin).ok_or_else(refused)?;
        if kernel.watch.user != spec.user.name {
            return Err(refused());
        }
        // The fork must be in the container's pid namespace: its init's, from the host.
        let init = init_pid(&kernel.docker, &kernel.container).await;
        let Some(namespace) = init.and_then(pid_namespace_of) else {
            return Err(launch_step(
                &spec.user,
                "preparing the fork",
                format!(
                    "cannot find the pid namespace of container {}",
                    kernel.container.name
                ),
            )
            .into());
        };
        // A kernel resumed from a pause runs in a pid namespace of its own (the restore's):
        // no longer a fork of the template, its forks could not be found. Refused, saying so.
        if pid_namespace_of(origin.host_pid).as_ref() != Some(&namespace) {
            return Err(ForkError::Unsupported(
                "this session's kernel was resumed from a pause: it no longer runs in its \
                 user's fork-server template, and only the template's kernels can be forked; \
                 restart the session to fork it again"
                    .into(),
            ));
        }
        origin.pid_namespace = Some(namespace);
        let name = keep::session_dir(spec.session_id);
        let dir = origin.dir.join(&name);
        let endpoints = endpoints_for(&dir).map_err(|e| launch_failed(&spec.user, e))?;
        let files = SessionFiles {
            dir: dir.clone(),
            privileged: self.privileged,
            connection: None,
        };
        // Made here, by descriptor in the broker's directory, never one the kernel planted.
        tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| launch_step(&spec.user, "preparing the fork", e))??;
        Ok(PreparedFork::new(origin, spec, dir, &name, endpoints))
    }

    pub(super) async fn adopt_kernel_fork(
        self: &Arc<Self>,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<Launched, ForkError> {
        let PreparedFork {
            origin, spec, dir, ..
        } = prepared;
        let Some(parent) = self.fork_parent(&origin) else {
            give_up(dir).await;
            return Err(ForkError::NotItsChild {
                pid,
                why: "the kernel it was asked of has ended",
            });
        };
        let (host_pid, fd) = match find_fork(&origin, pid) {
            Ok(found) => found,
            Err(why) => {
                give_up(dir).await;
                return Err(ForkError::NotItsChild { pid, why });
            }
        };
        let user = &spec.user;
        let session = spec.session_id;
        let Some(cgroup) = parent.forked.as_ref().map(|f| f.cgroup.clone()) else {
            give_up(dir).await;
            return Err(ForkError::Unsupported(PLAIN_START.into()));
        };
        // Its own leaf with the new session's limits; from here on the parent's end (its
        // leaf's removal) does not take it along.
        let placed = {
            let (cgroup, limits, id) = (cgroup.clone(), spec.limits, session.to_string());
            tokio::task::spawn_blocking(move || enter_new_leaf(&cgroup, &id, &limits, host_pid))
                .await
        };
        let leaf = match placed {
            Ok(Ok(leaf)) => leaf,
            Ok(Err(e)) => {
                let _ = pidfd::signal(&fd, pidfd::Signal::KILL);
                give_up(dir).await;
                return Err(e.into());
            }
            Err(e) => {
                let _ = pidfd::signal(&fd, pidfd::Signal::KILL);
                give_up(dir).await;
                return Err(launch_step(user, "placing the fork", e).into());
            }
        };
        // Alive after the move: the pid moved was this process's.
        if pidfd::ended(&fd).unwrap_or(true) {
            ContainerCgroup::remove_leaf(&leaf).await;
            give_up(dir).await;
            return Err(ForkError::NotItsChild {
                pid,
                why: "it ended before it was placed in its own cgroup",
            });
        }
        let endpoints = endpoints_for(&dir).map_err(|e| launch_failed(user, e));
        // The watcher's own copy: the kernel's handle keeps the other for interrupts.
        let watch_fd = fd.try_clone().and_then(|fd| {
            // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the
            // AsyncFd that owns it drops it.
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| e.into_parts().1)
        });
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ready = endpoints.and_then(|endpoints| match watch_fd {
            Ok(watch_fd) => Ok((endpoints, watch_fd)),
            Err(e) => Err(launch_step(user, "cannot watch the fork", e)),
        });
        let (endpoints, watch_fd) = match ready {
            Ok(ready) => ready,
            Err(e) => {
                ContainerCgroup::remove_leaf(&leaf).await;
                give_up(dir).await;
                return Err(e.into());
            }
        };
        let (watch, exit) = KernelWatch::new(session, user.name.clone(), LOST);
        let freezer = Some(cgroup.freezer(&leaf));
        let shared = Arc::new(DockerKernel {
            watch,
            docker: parent.docker.clone(),
            container: parent.container.clone(),
            dir: name,
            host_dir: dir,
            exec_id: String::new(),
            forked: Some(ForkedPid {
                host_pid,
                pidfd: fd,
                cgroup,
            }),
            exec_pid: None,
            exec_pidfd: None,
            leaf: Some(leaf),
            freezer,
            limits: spec.limits,
            workspace: parent.workspace.clone(),
            quota_bytes: user.limits.workspace_quota_bytes,
        });
        tracing::info!(%session, user = %user.name, container = %shared.container.name, pid = host_pid, "kernel forked from a live kernel");
        let handle = register_forked(self, session, shared, exit, watch_fd, ForkedStatus::Zombie);
        Ok(Launched {
            endpoints,
            process: Box::new(handle),
        })
    }
}
