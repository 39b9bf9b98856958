//! Held checkpoints on the local sandbox (`sandbox/held.rs` says what they are).
//!
//! The live kernel forks a held child, which connects to the broker's control socket in a
//! directory of the broker's in the template's directory (made by descriptor, mode 0711)
//! and is adopted as a fork is (`fork.rs`: the parent kernel's direct child by `NSpid`, of
//! its uid, in its cgroups, held through a pidfd), and its connection is taken by the pid
//! that `SO_PEERCRED` names. It is made the OOM killer's first choice (`oom_score_adj`
//! 1000) and answers the request at once; nothing else is on the request's path.
//!
//! **The leaves.** Right after `fork()` every page of the checkpoint is charged to the
//! live kernel's leaf, and so would be each old copy of a page the live kernel rewrites
//! from then on: checkpoints would use up their live kernel's memory limit and push it into
//! the OOM killer. So the leaf goes to the checkpoint and the live kernel moves to a new
//! one with the same limits: what the live kernel charges after the move is its own, and
//! what it rewrote stays with the checkpoint. Moving a process between cgroups waits for
//! an RCU grace period (6-27 ms here, `BENCHMARKS.md`), so the move is done in the
//! background, under the two kernels' leaf locks (`reaper.rs`): a reaper that begins its
//! kernel's end meanwhile waits for it, and one that began first stops it (a kernel
//! that ended keeps its leaf, a checkpoint that ended gets none). The session layer
//! settles the move (`KernelProcess::settle`) before it forks the kernel again, so the
//! next checkpoint starts in the leaf that is the live kernel's own.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::OwnedMutexGuard;
use uuid::Uuid;

use super::fork::{remove_fork_dir, PLAIN_START};
use super::reaper::{LeafSlot, LocalKernel, Reaped, Watched};
use super::{LocalSandbox, TERMINATE_TIMEOUT};
use crate::sandbox::cgroup::{set_oom_score_adj, Cgroups};
use crate::sandbox::fork::{find_fork, ForkError, ForkOrigin, HeldCheckpoint, PreparedFork};
use crate::sandbox::fsutil::{self, launch_failed, launch_step};
use crate::sandbox::held::{ControlListener, CONTROL_NAME};
use crate::sandbox::pidfd;
use crate::sandbox::watched::WatchedKernel;
use crate::sandbox::{KernelLimits, KernelProcess, LaunchSpec, SandboxError, UserLimits};
use crate::sync::lock;

/// How long a held child may take to connect to its control socket once it answered (it
/// connects before it answers: this only bounds a kernel that lies).
const CONNECT_LIMIT: Duration = Duration::from_secs(5);

impl LocalSandbox {
    pub(super) async fn prepare_held_checkpoint(
        &self,
        parent: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let unsupported = || ForkError::Unsupported(PLAIN_START.into());
        let mut origin = parent.fork_origin().ok_or_else(unsupported)?;
        if origin.own_workspace.is_some()
            || origin.dir.as_os_str().is_empty()
            || spec.own_workspace.is_some()
        {
            return Err(ForkError::Unsupported(
                "a kernel with a workspace of its own is checkpointed as a copy".into(),
            ));
        }
        if self.startup().await?.is_none() {
            return Err(unsupported());
        }
        origin.kernel = parent.kernel_id();
        let name = format!("c{}", &Uuid::new_v4().simple().to_string()[..12]);
        let dir = origin.dir.join(&name);
        let endpoints =
            super::files::endpoints_for(&dir).map_err(|e| launch_failed(&spec.user, e))?;
        let (parent_dir, made, child) = (origin.dir.clone(), dir.clone(), name.clone());
        let opened = tokio::task::spawn_blocking(move || -> Result<_, SandboxError> {
            let parent = fsutil::open_tree_root(&parent_dir).map_err(fsutil::io_err(
                "cannot open the template's directory",
                &parent_dir,
            ))?;
            // The broker's: the kernels may enter it (to connect), not list or change it.
            fsutil::make_dir_at(parent.as_fd(), Path::new(&child), 0o711, None).map_err(
                fsutil::io_err("cannot create the checkpoint's directory", &made),
            )
        })
        .await
        .map_err(|e| launch_step(&spec.user, "preparing the checkpoint", e))??;
        let listener = match ControlListener::bind(opened) {
            Ok(listener) => listener,
            Err(e) => {
                remove_fork_dir(dir.clone()).await;
                return Err(
                    launch_step(&spec.user, "binding the checkpoint's control socket", e).into(),
                );
            }
        };
        let control = format!("{}/{name}/{CONTROL_NAME}", origin.inside);
        let mut prepared = PreparedFork::new(origin, spec, dir, &name, endpoints);
        prepared.request = serde_json::json!({ "hold": { "control": control } });
        prepared.control = Some(listener);
        Ok(prepared)
    }

    pub(super) async fn adopt_held_checkpoint(
        &self,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<HeldCheckpoint, ForkError> {
        let PreparedFork {
            origin,
            spec,
            dir,
            control,
            ..
        } = prepared;
        let parent = origin.kernel.and_then(|id| self.kernels.get(&id));
        let (Some(listener), Some(parent), Ok(Some(cgroups))) =
            (control, parent, self.startup().await)
        else {
            remove_fork_dir(dir).await;
            return Err(ForkError::Unsupported(PLAIN_START.into()));
        };
        let (host_pid, fd) = match find_fork(&origin, pid) {
            Ok(found) => found,
            Err(why) => {
                remove_fork_dir(dir).await;
                return Err(ForkError::NotItsChild { pid, why });
            }
        };
        let give_up = |fd: &std::os::fd::OwnedFd| {
            let _ = pidfd::signal(fd, pidfd::Signal::KILL);
        };
        let user = &spec.user;
        let held = async {
            let control = listener
                .accept_from(host_pid, CONNECT_LIMIT)
                .await
                .map_err(|why| ForkError::Copy(format!("the checkpoint was not held: {why}")))?;
            set_oom_score_adj(host_pid, 1000)?;
            Ok::<_, ForkError>((control, self.workspace_path(user)?))
        };
        let (control, workspace) = match held.await {
            Ok(held) => held,
            Err(e) => {
                give_up(&fd);
                remove_fork_dir(dir).await;
                return Err(e);
            }
        };
        // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the
        // AsyncFd that owns it drops it.
        let pidfd = match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
            Ok(pidfd) => pidfd,
            Err(e) => {
                let (fd, e) = e.into_parts();
                give_up(&fd);
                remove_fork_dir(dir).await;
                return Err(launch_step(user, "cannot watch the checkpoint", e).into());
            }
        };
        let process = Watched::ForkOfKernel {
            pidfd,
            pid: host_pid,
        };
        // No leaf yet: its parent's, given once the parent moved out (below).
        let held = Reaped {
            kernel_pid: Some(host_pid),
            cgroups: Some(cgroups.clone()),
            // Its kernels are forked from it in the same directory.
            fork_origin: Some(ForkOrigin {
                host_pid,
                kernel: None,
                ..origin
            }),
            ..Reaped::new(spec.session_id, user, process, dir, spec.limits, workspace)
        }
        .spawn(&self.kernels);
        // Until the move, the leaf it will have counts what it holds.
        *lock(&held.memory_usage) = lock(&parent.memory_usage).clone();
        *lock(&held.cpu) = lock(&parent.cpu).clone();
        // Locked before the answer, so that a `settle` asked after it waits for the move.
        let theirs = parent.leaf.clone().lock_owned().await;
        let ours = held.leaf.clone().lock_owned().await;
        let (user_name, user_limits) = (user.name.clone(), user.limits.clone());
        tokio::spawn(give_leaf(
            cgroups,
            Leaves {
                parent,
                held: held.clone(),
                theirs,
                ours,
            },
            user_name,
            user_limits,
            spec.limits,
        ));
        tracing::debug!(session = %spec.session_id, pid = host_pid, "held checkpoint adopted");
        Ok(HeldCheckpoint {
            process: Box::new(WatchedKernel::new(held, TERMINATE_TIMEOUT)),
            control,
        })
    }
}

/// Gives `parent`'s leaf to its held checkpoint `held`: the parent moves to a new leaf of
/// the same limits first (so the old one never holds anything but the checkpoint once it
/// is the checkpoint's). Under both leaf locks; nothing is done if either kernel's end
/// began, and a failed move leaves the parent where it was.
async fn give_leaf(
    cgroups: Arc<Cgroups>,
    leaves: Leaves,
    user: String,
    user_limits: UserLimits,
    limits: KernelLimits,
) {
    let Leaves {
        parent,
        held,
        mut theirs,
        mut ours,
    } = leaves;
    let Some(pid) = parent.kernel_pid else {
        return;
    };
    if theirs.ended || ours.ended || theirs.leaf.is_none() {
        return;
    }
    let cg = cgroups.clone();
    let moved = tokio::task::spawn_blocking(move || {
        let leaf = cg.create_leaf(&user, &user_limits, &limits, Uuid::new_v4())?;
        let entered = leaf.enter(pid);
        Ok::<_, SandboxError>((leaf, entered))
    })
    .await;
    let new = match moved {
        Ok(Ok((leaf, Ok(())))) => leaf,
        Ok(Ok((leaf, Err(e)))) => {
            // Back where it was in every hierarchy, then the new leaf (empty) goes.
            if let Some(old) = theirs.leaf.as_ref() {
                if let Err(back) = old.enter(pid) {
                    tracing::error!(error = %back, "a kernel could not be moved back to its leaf");
                }
            }
            tracing::warn!(error = %e, "a checkpoint's leaf stays its kernel's: the kernel could not move");
            if leaf.pids().is_empty() {
                cgroups.remove_leaf(&leaf).await;
            }
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "a checkpoint's leaf stays its kernel's: no new leaf");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "a checkpoint's leaf stays its kernel's");
            return;
        }
    };
    *lock(&parent.memory_usage) = new.memory_usage_file();
    *lock(&parent.cpu) = Some(new.cpu_clock());
    let old = theirs.leaf.replace(new);
    *lock(&held.memory_usage) = old.as_ref().and_then(|l| l.memory_usage_file());
    *lock(&held.cpu) = old.as_ref().map(|l| l.cpu_clock());
    ours.leaf = old;
}

/// A kernel and its held checkpoint, each with its leaf slot locked.
struct Leaves {
    parent: Arc<LocalKernel>,
    held: Arc<LocalKernel>,
    theirs: OwnedMutexGuard<LeafSlot>,
    ours: OwnedMutexGuard<LeafSlot>,
}
