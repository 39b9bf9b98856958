//! Adopting a kept kernel: the container and the exec checked, the leaf reopened, the same
//! handle and watcher as a launch; or, if the kernel ended meanwhile, its end classified and
//! everything it held reclaimed.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use bollard::Docker;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::ticket::{is_cgroup_dir, RestoredPid, Ticket};
use crate::sandbox::cgroup::{CgroupNotFound, ContainerCgroup, Leaf};
use crate::sandbox::docker::daemon::{error_text, status_of};
use crate::sandbox::docker::engine::{exec_process_gone, Engine};
use crate::sandbox::docker::exec::{endpoints_for, DockerKernel, ForkedPid, LOST};
use crate::sandbox::docker::running::{container_reason, init_pid, ContainerInfo};
use crate::sandbox::docker::watch::{
    classify_exec_end, classify_unreported_exec_end, end_kernel, register_forked, watch_kernel,
    ForkedStatus,
};
use crate::sandbox::docker::{unavailable_by, Inner, EXEC_TIMEOUT, KERNEL_UID, TERMINATE_TIMEOUT};
use crate::sandbox::fsutil::{launch_failed, remove_dir_logged};
use crate::sandbox::pidfd;
use crate::sandbox::procfs::uids_of;
use crate::sandbox::watched::{KernelWatch, WatchedKernel};
use crate::sandbox::{AdoptError, AdoptSpec, ExitReason, KernelLimits, Launched, SandboxUser};
use crate::sync::lock;

impl Inner {
    /// [`Sandbox::adopt`](crate::sandbox::Sandbox::adopt).
    pub(crate) async fn adopt(self: &Arc<Self>, spec: AdoptSpec) -> Result<Launched, AdoptError> {
        self.startup().await?;
        let ticket = {
            let mut kept = lock(&self.kept);
            match kept.remove(&spec.session_id) {
                Some(t) if t.user == spec.user.name => t,
                Some(t) => {
                    // Not this user's kernel: left for `discard_unadopted`.
                    tracing::warn!(session = %spec.session_id, kept_for = %t.user, user = %spec.user.name, "a kept kernel belongs to another user; not adopted");
                    kept.insert(spec.session_id, t);
                    return Err(AdoptError::Missing);
                }
                None => return Err(AdoptError::Missing),
            }
        };
        let quota = spec.user.limits.workspace_quota_bytes;
        self.adopt_ticket(ticket, spec.limits, quota, &spec.user)
            .await
    }

    /// Adopts the kernel of `ticket` with `limits`, or reclaims it if it ended (see the
    /// module comment). On a failure to ask the daemon, the ticket goes back to the kept
    /// ones.
    pub(super) async fn adopt_ticket(
        self: &Arc<Self>,
        ticket: Ticket,
        limits: KernelLimits,
        quota_bytes: u64,
        user: &SandboxUser,
    ) -> Result<Launched, AdoptError> {
        let started = std::time::Instant::now();
        let session = ticket.session_id;
        let docker = self.client().await?;
        let slot = self.slot(&ticket.slot());
        let guard = slot.container.lock().await;
        let registered = guard.clone().filter(|c| c.id == ticket.container_id);
        let container = registered.clone().unwrap_or_else(|| {
            Arc::new(ContainerInfo {
                id: ticket.container_id.clone(),
                name: ticket.container_name.clone(),
                memory_limit: ticket.container_memory_bytes,
                oom_claimed: Mutex::new(0),
                reaping: tokio::sync::Mutex::new(()),
                own: ticket.own,
            })
        });
        let gone = match registered {
            Some(_) => container_reason(&docker, &container).await,
            None => Some(
                container_reason(&docker, &container)
                    .await
                    .unwrap_or_else(|| {
                        ExitReason::Lost("the user's container is no longer this broker's".into())
                    }),
            ),
        };
        if let Some(reason) = gone {
            drop(guard);
            tracing::warn!(%session, user = %ticket.user, %reason, "a kept kernel's container is gone");
            self.reclaim_files(&ticket).await;
            return Err(AdoptError::Ended(reason));
        }

        let host_dir = self.user_run_dir(&ticket.slot()).join(&ticket.session_dir);
        let endpoints = endpoints_for(&host_dir).map_err(|e| launch_failed(user, e))?;
        let leaf = self
            .reopen_leaf(&docker, &container, &ticket, &limits)
            .await;
        let engine = self.engine().await?;
        // Under Podman, the watcher sees the end through a pidfd (`exec.rs`); a pid the
        // exec no longer holds is told apart below.
        let exec_pidfd = match (engine, ticket.exec_pid) {
            (Engine::Podman, Some(pid)) => {
                i32::try_from(pid).ok().and_then(|p| pidfd::open(p).ok())
            }
            _ => None,
        };
        // A kernel CRIU restored has no exec: its process, checked.
        let (forked, gone) = match ticket.restored {
            None => (None, None),
            Some(kept) => {
                match restored_process(&docker, &container, kept, leaf.as_ref(), &limits).await {
                    Ok(forked) => (Some(forked), None),
                    Err(reason) => (None, Some(reason)),
                }
            }
        };
        let freezer = forked.as_ref().zip(leaf.as_ref());
        let freezer = freezer.map(|(f, leaf)| f.cgroup.freezer(leaf));
        let (watch, exit) = KernelWatch::new(session, ticket.user.clone(), LOST);
        let kernel = Arc::new(DockerKernel {
            watch,
            docker: docker.clone(),
            container,
            dir: ticket.session_dir.clone(),
            host_dir,
            exec_id: ticket.exec_id.clone(),
            forked,
            // A plain kernel's in a sandbox's own container, where its copies and pauses
            // start (checked below: the exec still runs this pid).
            exec_pid: match (ticket.own, self.privileged) {
                (Some(_), true) => ticket.exec_pid.and_then(|p| i32::try_from(p).ok()),
                _ => None,
            },
            exec_pidfd,
            leaf,
            freezer,
            limits,
            workspace: self.workspaces.join(&ticket.user),
            quota_bytes,
        });
        if ticket.restored.is_some() {
            let watched = match gone {
                None => watch_fd(&kernel),
                Some(reason) => Err(reason),
            };
            let watch_fd = match watched {
                Ok(fd) => fd,
                Err(reason) => {
                    drop(guard);
                    // Its leaf's removal ends whatever it left.
                    end_kernel(self, &kernel, &reason, true).await;
                    exit.publish(reason.clone());
                    return Err(AdoptError::Ended(reason));
                }
            };
            let zombie = ForkedStatus::Zombie;
            let handle = register_forked(self, session, kernel.clone(), exit, watch_fd, zombie);
            drop(guard);
            if let Some(idle) = lock(&slot.idle).take() {
                idle.cancel();
            }
            tracing::info!(%session, user = %ticket.user, container = %kernel.container.name, ms = started.elapsed().as_millis() as u64, "kept restored kernel adopted");
            return Ok(Launched {
                endpoints,
                process: Box::new(handle),
            });
        }
        let ended = match docker.inspect_exec(&ticket.exec_id).await {
            Ok(e) if e.running == Some(true) => match (ticket.exec_pid, e.pid) {
                (Some(kept), Some(now)) if kept != now => Some(ExitReason::Lost(format!(
                    "the kept kernel's exec runs another process (pid {now}, kept {kept})"
                ))),
                // Podman says "running" for an exec that ended unwatched (`engine.rs`).
                (_, Some(now)) if engine == Engine::Podman => {
                    match init_pid(&docker, &kernel.container).await {
                        Some(init) if exec_process_gone(now, init) => {
                            Some(classify_unreported_exec_end(&docker, &kernel).await)
                        }
                        _ => None,
                    }
                }
                _ => None,
            },
            Ok(e) => Some(classify_exec_end(&docker, &kernel, e.exit_code).await),
            Err(e) if status_of(&e) == Some(404) => Some(ExitReason::Lost(
                "the kernel ended while no broker watched it, and the Docker daemon no \
                 longer knows how"
                    .into(),
            )),
            Err(e) => {
                drop(guard);
                lock(&self.kept).insert(session, ticket);
                let reason = format!("cannot inspect a kept kernel's exec: {}", error_text(&e));
                return Err(AdoptError::Failed(unavailable_by(reason, e)));
            }
        };
        if let Some(reason) = ended {
            drop(guard);
            end_kernel(self, &kernel, &reason, false).await;
            exit.publish(reason.clone());
            return Err(AdoptError::Ended(reason));
        }
        self.kernels.insert(session, kernel.clone());
        tokio::spawn(watch_kernel(self.clone(), kernel.clone(), exit));
        // Registered: an idle removal waiting for the lock now sees a live kernel.
        drop(guard);
        if let Some(idle) = lock(&slot.idle).take() {
            idle.cancel();
        }
        tracing::info!(
            %session,
            user = %ticket.user,
            container = %kernel.container.name,
            leaf = kernel.leaf.is_some(),
            ms = started.elapsed().as_millis() as u64,
            "kept kernel adopted"
        );
        Ok(Launched {
            endpoints,
            process: Box::new(WatchedKernel::new(kernel, TERMINATE_TIMEOUT + EXEC_TIMEOUT)),
        })
    }

    /// The kernel's leaf as it was kept, with `limits` (re)applied; `None` if it had none
    /// or it is not where the broker would put it (logged). Never creates a new leaf: one
    /// that holds no process would limit nothing.
    async fn reopen_leaf(
        &self,
        docker: &Docker,
        container: &ContainerInfo,
        ticket: &Ticket,
        limits: &KernelLimits,
    ) -> Option<Leaf> {
        if ticket.leaf.is_empty() || !self.privileged {
            return None;
        }
        let info = docker.inspect_container(&container.id, None).await.ok()?;
        let pid = i32::try_from(info.state?.pid?).ok().filter(|p| *p > 0)?;
        let (kept, session, limits) = (ticket.leaf.clone(), ticket.session_id, *limits);
        let reopened = tokio::task::spawn_blocking(move || -> Result<Leaf, LeafNotReopened> {
            if !kept.iter().all(|d| d.is_dir()) {
                return Err(LeafNotReopened::Gone);
            }
            let cgroup = ContainerCgroup::of_process(pid)?;
            let leaf = cgroup.create_leaf(&session.to_string(), &limits)?;
            if leaf.dirs() != kept.as_slice() {
                for dir in leaf.dirs().iter().filter(|d| !kept.contains(d)) {
                    let _ = std::fs::remove_dir(dir);
                }
                return Err(LeafNotReopened::NotTheContainers(kept));
            }
            Ok(leaf)
        })
        .await;
        match reopened {
            Ok(Ok(leaf)) => Some(leaf),
            Ok(Err(why)) => {
                tracing::warn!(session = %ticket.session_id, reason = %why, "the adopted kernel runs without its own cgroup leaf");
                None
            }
            Err(e) => {
                tracing::warn!(session = %ticket.session_id, error = %e, "reopening the kernel's leaf failed");
                None
            }
        }
    }

    /// What a kernel whose container is gone held on the host: its session directory, its
    /// leaf (nothing runs in it any more) and its ticket.
    pub(super) async fn reclaim_files(&self, ticket: &Ticket) {
        remove_dir_logged(self.user_run_dir(&ticket.slot()).join(&ticket.session_dir)).await;
        let leaf = ticket.leaf.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for dir in leaf.iter().filter(|d| is_cgroup_dir(d)) {
                let _ = std::fs::remove_dir(dir);
            }
        })
        .await;
        self.remove_ticket(ticket.session_id).await;
    }
}

/// The process of a restored kernel's ticket, if it still is that kernel: the same process
/// (its pid and start time, through a pidfd opened first), running as the image's kernel
/// uid, in the kernel's reopened leaf (which only the broker can move processes into);
/// with its container's cgroup, where the leaves of its forks go. Otherwise why it is not
/// (its own leaf's OOM kill, if that is how it ended).
async fn restored_process(
    docker: &Docker,
    container: &ContainerInfo,
    kept: RestoredPid,
    leaf: Option<&Leaf>,
    limits: &KernelLimits,
) -> Result<ForkedPid, ExitReason> {
    let lost = |why: &str| ExitReason::Lost(format!("the kept kernel {why}"));
    let Some(leaf) = leaf else {
        return Err(lost("has no cgroup leaf any more"));
    };
    if leaf.oom_kills().is_some_and(|k| k > 0) {
        return Err(ExitReason::OutOfMemory {
            limit_bytes: limits.memory_bytes,
        });
    }
    let init = init_pid(docker, container)
        .await
        .ok_or_else(|| lost("is in a container that runs no more"))?;
    let procs = leaf.dirs().first().map(|d| d.join("cgroup.procs"));
    let checked = tokio::task::spawn_blocking(move || {
        let pidfd = pidfd::open_started(kept.host_pid, kept.start)
            .ok_or_else(|| lost("ended while no broker watched it"))?;
        if uids_of(kept.host_pid) != Some([KERNEL_UID; 4]) {
            return Err(lost("runs as another user"));
        }
        let pid = kept.host_pid.to_string();
        let listed = procs
            .and_then(|p| std::fs::read_to_string(p).ok())
            .is_some_and(|s| s.lines().any(|l| l.trim() == pid));
        if !listed {
            return Err(lost("is not in its cgroup leaf"));
        }
        let cgroup = ContainerCgroup::of_process(init)
            .map_err(|e| lost(&format!("is in a container without its cgroup: {e}")))?;
        Ok(ForkedPid {
            host_pid: kept.host_pid,
            pidfd,
            cgroup,
        })
    });
    checked
        .await
        .unwrap_or_else(|e| Err(lost(&format!("could not be checked: {e}"))))
}

/// The pidfd a restored kernel's watcher waits on (a copy of its own).
fn watch_fd(kernel: &DockerKernel) -> Result<AsyncFd<OwnedFd>, ExitReason> {
    let lost =
        |e: std::io::Error| ExitReason::Lost(format!("the kept kernel cannot be watched: {e}"));
    let fd = kernel
        .forked
        .as_ref()
        .ok_or_else(|| lost(std::io::Error::other("no process")))?;
    let fd = fd.pidfd.try_clone().map_err(lost)?;
    // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the AsyncFd
    // that owns it drops it.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
        .map_err(|e| lost(e.into_parts().1))
}

/// Why an adopted kernel's kept cgroup leaf could not be opened again.
#[derive(Debug, thiserror::Error)]
enum LeafNotReopened {
    #[error("the kept leaf is gone")]
    Gone,
    #[error(transparent)]
    NoContainerCgroup(#[from] CgroupNotFound),
    #[error(transparent)]
    Leaf(#[from] crate::sandbox::SandboxError),
    #[error("the kept leaf {0:?} is not the container's")]
    NotTheContainers(Vec<std::path::PathBuf>),
}
