//! Forking a live kernel on the local sandbox (`sandbox/fork.rs` says what is exchanged).
//!
//! Only kernels forked from a template can be forked: their forks live in the template's
//! sandbox beside them (its pid, mount and network namespaces, the user's trust domain), so
//! the parent's end does not take a fork along. A kernel started plainly is its sandbox's
//! only command: killing it ends its pid namespace and every fork in it, so it is refused.
//!
//! The child's runtime directory is made in the template's directory (which the user's
//! kernels can write) by descriptor, as a forked kernel's own is (`template/mod.rs`). The
//! pid the kernel reports is untrusted: it names a process only if that process is a
//! direct child of the parent kernel's host process (found through the parent's
//! `task/*/children` and the child's `NSpid`), runs as the kernel's uid, is still in the
//! parent's cgroups (an earlier fork, a session's kernel in a leaf of its own, is the
//! parent's child too), and is still that process once a pidfd is held on it. It then enters a leaf of its own, is checked alive
//! after the move (so the pid moved was that process: a pid is not reused before its
//! process is reaped), and is watched through its pidfd. Its sockets are reached as every
//! kernel's are, never through a symlink (`kernel::zmtp::connect_ipc`).

use std::os::fd::AsFd;
use std::path::Path;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use uuid::Uuid;

use super::files::endpoints_for;
use super::reaper::{Reaped, Watched};
use super::{LocalSandbox, TERMINATE_TIMEOUT};
use crate::sandbox::fork::{find_fork, ForkError, ForkOrigin, PreparedFork};
use crate::sandbox::fsutil::{self, launch_failed, launch_step};
use crate::sandbox::pidfd;
use crate::sandbox::watched::WatchedKernel;
use crate::sandbox::{KernelProcess, LaunchSpec, Launched, SandboxError};

/// Why a kernel started plainly cannot be forked.
pub(super) const PLAIN_START: &str =
    "this session's kernel was started plainly, not forked from its \
    user's template, and only those can be forked (a plain kernel's forks would end with it); \
    kernels are forked from templates when the broker runs with cgroups (as root, or with a \
    delegated cgroup v2 subtree), without --keep-sessions, with fork_server on and a kernel \
    spec that preloads modules; restart the session to get such a kernel";

impl LocalSandbox {
    pub(super) async fn prepare_kernel_fork(
        &self,
        parent: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let origin = parent
            .fork_origin()
            .ok_or_else(|| ForkError::Unsupported(PLAIN_START.into()))?;
        if origin.own_workspace.is_some() {
            return self.prepare_copy(origin, spec).await;
        }
        if origin.dir.as_os_str().is_empty() {
            // A plain kernel sharing its user's workspace: no template to fork in.
            return Err(ForkError::Unsupported(PLAIN_START.into()));
        }
        if spec.own_workspace.is_some() {
            return Err(ForkError::Unsupported(
                "a fork with a workspace of its own is a copy of a kernel with one".into(),
            ));
        }
        if self.startup().await?.is_none() {
            return Err(ForkError::Unsupported(PLAIN_START.into()));
        }
        // Short: the host's socket paths are `<run base>/<template>/<name>/k-5`.
        let name = format!("f{}", &Uuid::new_v4().simple().to_string()[..12]);
        let dir = origin.dir.join(&name);
        let endpoints = endpoints_for(&dir).map_err(|e| launch_failed(&spec.user, e))?;
        let ids = self.kernel_ids(&spec.user)?;
        let (parent_dir, made) = (origin.dir.clone(), dir.clone());
        let child = name.clone();
        tokio::task::spawn_blocking(move || -> Result<(), SandboxError> {
            let parent = fsutil::open_tree_root(&parent_dir).map_err(fsutil::io_err(
                "cannot open the template's directory",
                &parent_dir,
            ))?;
            // Made here, never one the kernel planted (`make_dir_at` refuses it).
            fsutil::make_dir_at(parent.as_fd(), Path::new(&child), 0o700, ids)
                .map(drop)
                .map_err(fsutil::io_err("cannot create the fork's directory", &made))
        })
        .await
        .map_err(|e| launch_step(&spec.user, "preparing the fork", e))??;
        Ok(PreparedFork::new(origin, spec, dir, &name, endpoints))
    }

    pub(super) async fn adopt_kernel_fork(
        &self,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<Launched, ForkError> {
        if prepared.origin.own_workspace.is_some() {
            return self.adopt_copy(prepared, pid).await;
        }
        let cgroups = match self.startup().await {
            Ok(Some(cgroups)) => cgroups,
            Ok(None) => {
                remove_fork_dir(prepared.dir).await;
                return Err(ForkError::Unsupported(PLAIN_START.into()));
            }
            Err(e) => {
                remove_fork_dir(prepared.dir).await;
                return Err(e.into());
            }
        };
        let (host_pid, fd) = match find_fork(&prepared.origin, pid) {
            Ok(found) => found,
            Err(why) => {
                remove_fork_dir(prepared.dir).await;
                return Err(ForkError::NotItsChild { pid, why });
            }
        };
        let PreparedFork {
            origin, spec, dir, ..
        } = prepared;
        let user = &spec.user;
        let session = spec.session_id;
        // Its own leaf with the new session's limits; from here on killing the parent (its
        // leaf) does not kill it.
        let placed = {
            let (cg, name, user_limits, limits) = (
                cgroups.clone(),
                user.name.clone(),
                user.limits.clone(),
                spec.limits,
            );
            tokio::task::spawn_blocking(move || {
                let leaf = cg.create_leaf(&name, &user_limits, &limits, session)?;
                let entered = leaf.enter(host_pid);
                Ok::<_, SandboxError>((leaf, entered))
            })
            .await
        };
        let leaf = match placed {
            Ok(Ok((leaf, Ok(())))) => leaf,
            Ok(Ok((leaf, Err(e)))) => {
                let _ = pidfd::signal(&fd, pidfd::Signal::KILL);
                cgroups.remove_leaf(&leaf).await;
                remove_fork_dir(dir).await;
                return Err(e.into());
            }
            Ok(Err(e)) => {
                let _ = pidfd::signal(&fd, pidfd::Signal::KILL);
                remove_fork_dir(dir).await;
                return Err(e.into());
            }
            Err(e) => {
                let _ = pidfd::signal(&fd, pidfd::Signal::KILL);
                remove_fork_dir(dir).await;
                return Err(launch_step(user, "placing the fork", e).into());
            }
        };
        // Alive after the move: the pid moved was this process's.
        if pidfd::ended(&fd).unwrap_or(true) {
            leaf.kill_all().await;
            cgroups.remove_leaf(&leaf).await;
            remove_fork_dir(dir).await;
            return Err(ForkError::NotItsChild {
                pid,
                why: "it ended before it was placed in its own cgroup",
            });
        }
        let endpoints = endpoints_for(&dir).map_err(|e| launch_failed(user, e));
        // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the
        // AsyncFd that owns it drops it.
        let watched = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        let ready = endpoints.and_then(|endpoints| match watched {
            Ok(pidfd) => Ok((endpoints, pidfd)),
            Err(e) => Err(launch_step(user, "cannot watch the fork", e.into_parts().1)),
        });
        let (endpoints, pidfd) = match ready {
            Ok(ready) => ready,
            Err(e) => {
                leaf.kill_all().await;
                cgroups.remove_leaf(&leaf).await;
                remove_fork_dir(dir).await;
                return Err(e.into());
            }
        };
        let workspace = self.workspace_path(user)?;
        let process = Watched::ForkOfKernel {
            pidfd,
            pid: host_pid,
        };
        let kernel = Reaped {
            kernel_pid: Some(host_pid),
            leaf: Some(leaf),
            cgroups: Some(cgroups.clone()),
            // A fork can be forked in turn, in the same directory.
            fork_origin: Some(ForkOrigin { host_pid, ..origin }),
            ..Reaped::new(session, user, process, dir, spec.limits, workspace)
        }
        .spawn(&self.kernels);
        tracing::info!(%session, user = %user.name, pid = host_pid, "kernel forked from a live kernel");
        Ok(Launched {
            endpoints,
            process: Box::new(WatchedKernel::new(kernel, TERMINATE_TIMEOUT)),
        })
    }
}

/// Removes a fork's runtime directory (given up, or its kernel ended): the one path-based
/// removal here. Its parent, the template's directory, is the kernel's to write, but std's
/// `remove_dir_all` opens the last component `O_NOFOLLOW` and removes below it by
/// descriptor; the directories above are the broker's.
pub(super) async fn remove_fork_dir(dir: std::path::PathBuf) {
    fsutil::remove_dir_logged(dir).await;
}
