//! Adopting the kernels an earlier run kept (`--keep-sessions`), and discarding those no
//! session claims. The files that make it possible are described in `keep.rs`.
//!
//! An adopted kernel gets the same handle and the same reaper as a launched one; only the
//! reaper's way of waiting differs (a pidfd of bwrap and bwrap's status file instead of
//! `waitpid`). bwrap's own pid is not kept in the handle: the reaper watches it through its
//! pidfd, and a kill goes to the leaf and the sandbox's init (checked to be the same
//! process), never to a pid that may have been reused.

use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::files::endpoints_for;
use super::keep::{KeptKernels, Ticket};
use super::reaper::{Reaped, Watched};
use super::{LocalSandbox, TERMINATE_TIMEOUT};
use crate::sandbox::cgroup::Cgroups;
use crate::sandbox::fsutil::{launch_failed, launch_step, remove_dir_logged};
use crate::sandbox::pidfd;
use crate::sandbox::procfs::{is_same_process, parent_of};
use crate::sandbox::watched::WatchedKernel;
use crate::sandbox::{AdoptError, AdoptSpec, KernelProcess as _, Launched, Sandbox as _};

impl LocalSandbox {
    pub(super) async fn adopt_kept(
        &self,
        kept: &Arc<KeptKernels>,
        cgroups: Option<Arc<Cgroups>>,
        spec: AdoptSpec,
    ) -> Result<Launched, AdoptError> {
        let session = spec.session_id;
        let user = &spec.user;
        let ticket = kept.take(session).ok_or(AdoptError::Missing)?;
        if ticket.user != user.name {
            // Not this user's kernel: discarded with the rest.
            tracing::warn!(%session, kept_for = %ticket.user, user = %user.name, "a kept kernel's owner does not match its session; not adopted");
            self.end_kept(kept, cgroups.as_deref(), &ticket).await;
            return Err(AdoptError::Missing);
        }
        let workspace = match spec.own_workspace {
            Some(key) => self.own_workspaces.dirs(key).home,
            None => self.workspace_path(user)?,
        };
        let rundir = self.run_base.join(session.to_string());
        let endpoints = endpoints_for(&rundir).map_err(|e| launch_failed(user, e))?;
        let leaf = cgroups
            .as_ref()
            .and_then(|c| c.existing_leaf(&user.name, session));
        let status = kept.status_path(session);
        let alive = pidfd::open_started(ticket.bwrap_pid, ticket.bwrap_start)
            .filter(|_| is_same_process(ticket.init_pid, ticket.init_start));
        let process = match alive {
            Some(pidfd) => Watched::Adopted {
                // SAFETY: an OwnedFd is a valid open descriptor that stays the same until
                // the AsyncFd that owns it drops it.
                pidfd: unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
                    .map_err(|e| launch_step(user, "cannot watch the kept kernel", e))?,
                status,
            },
            None => Watched::Gone { status },
        };
        let ended = matches!(process, Watched::Gone { .. });

        let kernel = Reaped {
            init_pid: (!ended).then_some(ticket.init_pid),
            own_workspace: spec.own_workspace,
            leaf,
            cgroups,
            kept: Some(kept.clone()),
            ..Reaped::new(
                session,
                user,
                process,
                rundir,
                spec.limits,
                workspace.clone(),
            )
        }
        .spawn(&self.kernels);
        // A kernel CRIU restored: itself (not CRIU, the sandbox's command, its parent) if
        // it is still the process the ticket names, CRIU's child in that sandbox.
        if let Some((pid, start)) = ticket.restored.filter(|_| !ended) {
            let criu = super::reaper::sandbox_command_pid(ticket.init_pid);
            if is_same_process(pid, start) && criu.is_some() && parent_of(pid) == criu {
                let _ = kernel.restored_pid.set(pid);
            } else {
                tracing::warn!(%session, pid, "the kept restored kernel is not where its ticket says; its forks and pauses will fail");
            }
        }
        let handle = WatchedKernel::new(kernel, TERMINATE_TIMEOUT);
        if ended {
            // Classified and reclaimed by the reaper, as any end.
            return Err(AdoptError::Ended(handle.wait().await));
        }
        // The workspace file system is still mounted (kept): registered as this run's.
        if let Err(e) = self.workspace(user) {
            tracing::warn!(%session, error = %e, "the adopted kernel's workspace could not be prepared");
        }
        tracing::info!(%session, user = %user.name, pid = ticket.init_pid, "kernel adopted");
        Ok(Launched {
            endpoints,
            process: Box::new(handle),
        })
    }

    /// Ends the kept kernels no session adopted and reclaims what they held.
    pub(super) async fn discard_kept(
        &self,
        kept: &Arc<KeptKernels>,
        cgroups: Option<Arc<Cgroups>>,
    ) {
        let left = kept.take_all();
        for ticket in &left {
            tracing::info!(session = %ticket.session, user = %ticket.user, "ending a kept kernel no session adopted");
            self.end_kept(kept, cgroups.as_deref(), ticket).await;
        }
    }

    /// Kills a kept kernel that will not be adopted, removes its leaf, runtime directory and
    /// files.
    async fn end_kept(&self, kept: &Arc<KeptKernels>, cgroups: Option<&Cgroups>, ticket: &Ticket) {
        if let Some(cgroups) = cgroups {
            if let Some(leaf) = cgroups.existing_leaf(&ticket.user, ticket.session) {
                cgroups.remove_leaf(&leaf).await;
            }
        }
        // Without a leaf: the sandbox's init takes its pid namespace along.
        if is_same_process(ticket.init_pid, ticket.init_start) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(ticket.init_pid, libc::SIGKILL) };
        }
        remove_dir_logged(self.run_base.join(ticket.session.to_string())).await;
        let (kept, session) = (kept.clone(), ticket.session);
        let _ = tokio::task::spawn_blocking(move || kept.forget(session)).await;
    }
}
