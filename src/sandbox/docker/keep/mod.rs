//! Kernels that outlive the broker (`--keep-sessions`): what a run leaves behind for the
//! next one, and how the next one takes it over.
//!
//! A docker kernel survives its broker by construction: it is a detached exec in a
//! long-lived container, and the broker holds no pipe of it. So keeping a kernel is about
//! what the broker does *not* do, and what it writes down:
//!
//! - **A ticket per kernel**, written at launch (so a `kill -9` of the broker keeps the
//!   kernel too) and removed when the kernel ends for real: `<data_dir>/kept-docker/
//!   <session>.json`, JSON, 0600 in a 0700 directory only the broker uses (never the
//!   kernel's runtime directory, which the kernel can write), written to a temporary file
//!   and renamed into place. It holds what the daemon cannot tell later: the exec id and
//!   its pid (a kernel CRIU restored, which has no exec, is named by its host pid and that
//!   process's start time instead), the container, the kernel's limits and whether it had
//!   a cgroup leaf. Read back
//!   with a size cap and checked against what the broker derives itself (container name,
//!   session directory, leaf directories): a ticket is a file on disk, not a promise.
//! - **Shutdown** releases every kernel (its watcher stops; nothing is killed), keeps the
//!   containers, the session directories, the cgroup leaves and the workspace mounts.
//! - **Start-up** ([`Inner::take_over`]) loads the tickets, registers each running container
//!   that has a ticket as its user's container (so launches reuse it, and the idle rule
//!   counts its kernels), and sweeps only what no ticket names: other containers of this
//!   broker, the runtime directories of users without a kept container, session
//!   directories without a ticket.
//! - **Adoption** ([`Inner::adopt_ticket`]) checks that the exec still runs (the daemon's
//!   `Running` and the same pid), reopens the kernel's leaf, and hands back the same
//!   [`DockerKernel`] handle and watcher a launch makes. A kernel that ended meanwhile gets
//!   the reason the watcher would have given (exit code, or the OOM kill its leaf counted)
//!   and is reclaimed like any ended kernel (reaper, leaf, session directory, ticket). A
//!   restored kernel is adopted only if its pid is still the process that started then
//!   (through a pidfd opened first), of the image's kernel uid, in its reopened leaf; it is
//!   then watched through that pidfd as a restored kernel of this run is, and a kernel that
//!   is not (it ended, or left another process in its place) is reclaimed with its leaf.
//! - [`Inner::discard_unadopted`]: kernels no session took are terminated, stopped kept
//!   containers removed, and every container without a kernel goes back under the idle rule.
//!
//! Limit: a broker killed in the few milliseconds between a kernel's exec start and its
//! ticket's write leaves that kernel unknown to the next run; it lives on in its container
//! (its session directory swept) until the container is removed by the idle rule.
//!
//! Layout: this file holds start-up, the tickets' life and the discard; `ticket.rs` the
//! ticket (its checks, its file, the runtime sweep); `adopt.rs` adoption.

mod adopt;
mod ticket;

use std::collections::{HashMap, HashSet};
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bollard::models::ContainerSummaryStateEnum;
use bollard::Docker;
use uuid::Uuid;

use self::ticket::RestoredPid;
use self::ticket::{load_tickets, sweep_runtime, ticket_path, write_ticket, TICKET_VERSION};
pub(crate) use self::ticket::{session_dir, Ticket};
use super::daemon::error_text;
use super::exec::DockerKernel;
use super::running::ContainerInfo;
use super::{unavailable_by, Inner, UserSlot, LABEL_USER};
use crate::sandbox::fsutil::{create_private_dir, remove_dir_logged};
use crate::sandbox::{AdoptError, KernelLimits, SandboxError, SandboxUser};
use crate::sync::lock;

/// Why a launched kernel's ticket could not be written (the kernel is then not launched).
#[derive(Debug, thiserror::Error)]
pub(super) enum TicketNotKept {
    #[error("cannot inspect the kernel's exec: {}", error_text(.0))]
    ExecUninspectable(#[source] bollard::errors::Error),
    #[error("the restored kernel (host pid {0}) is gone")]
    RestoredGone(i32),
    #[error("{0}")]
    NoDirectory(#[source] crate::sandbox::SandboxError),
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing the kernel's ticket failed: {0}")]
    Interrupted(#[source] tokio::task::JoinError),
}

/// The tickets' directory under the data directory.
const TICKETS_DIR: &str = "kept-docker";

impl Inner {
    fn tickets_dir(&self) -> PathBuf {
        self.cfg.data_dir.join(TICKETS_DIR)
    }

    /// Start-up with `--keep-sessions` (see the module comment): loads the tickets,
    /// registers the running containers they name, removes this broker's other containers
    /// and sweeps the runtime directories no ticket needs.
    pub(super) async fn take_over(&self, docker: &Docker) -> Result<(), SandboxError> {
        let dir = self.tickets_dir();
        let hash = self.hash.clone();
        let tickets = tokio::task::spawn_blocking(move || {
            create_private_dir(&dir, Some(0o700))?;
            let name = |user: &str, own: Option<Uuid>| match own {
                Some(key) => format!("kernel-broker-{hash}-sandbox-{key}"),
                None => format!("kernel-broker-{hash}-{user}"),
            };
            Ok::<_, SandboxError>(load_tickets(&dir, &name))
        })
        .await
        .map_err(|e| unavailable_by(format!("loading the kept kernels failed: {e}"), e))??;
        let wanted: HashMap<&str, &Ticket> = tickets
            .values()
            .map(|t| (t.container_id.as_str(), t))
            .collect();
        let containers = self
            .our_container_summaries(docker)
            .await
            .map_err(|e| unavailable_by(self.advice(&e), e))?;
        let (mut kept_users, mut removed) = (HashSet::new(), 0);
        for c in containers {
            let Some(id) = c.id else { continue };
            let owner = c.labels.as_ref().and_then(|l| l.get(LABEL_USER)).cloned();
            match wanted.get(id.as_str()) {
                Some(t) if owner.as_deref() == Some(t.user.as_str()) => {
                    if c.state == Some(ContainerSummaryStateEnum::RUNNING) {
                        let info = Arc::new(ContainerInfo {
                            id,
                            name: t.container_name.clone(),
                            memory_limit: t.container_memory_bytes,
                            oom_claimed: Mutex::new(0),
                            reaping: tokio::sync::Mutex::new(()),
                            own: t.own,
                        });
                        *self.slot(&t.slot()).container.lock().await = Some(info);
                        kept_users.insert(t.slot());
                    }
                    // A stopped one stays until its kernels were offered: adoption reads
                    // from it how they ended; `discard_unadopted` removes it.
                }
                _ => {
                    self.remove_container(docker, &id).await;
                    removed += 1;
                }
            }
        }
        let sessions: HashSet<(String, String)> = tickets
            .values()
            .filter(|t| kept_users.contains(&t.slot()))
            .map(|t| (t.slot(), t.session_dir.clone()))
            .collect();
        tracing::info!(
            kernels = tickets.len(),
            containers = kept_users.len(),
            removed_containers = removed,
            "found the kernels an earlier run kept (--keep-sessions)"
        );
        let base = self.run_base.clone();
        let swept =
            tokio::task::spawn_blocking(move || sweep_runtime(&base, &kept_users, &sessions))
                .await
                .unwrap_or(0);
        if swept > 0 {
            tracing::info!(
                count = swept,
                "removed runtime entries no kept kernel needs"
            );
        }
        *lock(&self.kept) = tickets;
        Ok(())
    }

    /// Start-up without `--keep-sessions`: tickets of an earlier run that kept its kernels
    /// name nothing any more (their containers are being removed).
    pub(super) async fn forget_tickets(&self) {
        let dir = self.tickets_dir();
        if tokio::fs::metadata(&dir).await.is_ok() {
            remove_dir_logged(dir).await;
        }
    }

    /// Writes the ticket of a kernel just launched, or just restored by CRIU (see the
    /// module comment).
    pub(super) async fn keep_ticket(&self, kernel: &DockerKernel) -> Result<(), TicketNotKept> {
        let (exec_pid, restored) = match &kernel.forked {
            // A restored kernel (the only kind with no exec kept: templates are off).
            Some(forked) => {
                let host_pid = forked.host_pid;
                let start = crate::sandbox::procfs::start_time(host_pid)
                    .ok_or(TicketNotKept::RestoredGone(host_pid))?;
                (None, Some(RestoredPid { host_pid, start }))
            }
            None => match kernel.docker.inspect_exec(&kernel.exec_id).await {
                Ok(exec) => (exec.pid, None),
                Err(e) => return Err(TicketNotKept::ExecUninspectable(e)),
            },
        };
        let ticket = Ticket {
            version: TICKET_VERSION,
            session_id: kernel.watch.session_id,
            user: kernel.watch.user.clone(),
            container_id: kernel.container.id.clone(),
            container_name: kernel.container.name.clone(),
            exec_id: kernel.exec_id.clone(),
            exec_pid,
            session_dir: kernel.dir.clone(),
            leaf: kernel
                .leaf
                .as_ref()
                .map(|l| l.dirs().to_vec())
                .unwrap_or_default(),
            memory_bytes: kernel.limits.memory_bytes,
            pids: kernel.limits.pids,
            container_memory_bytes: kernel.container.memory_limit,
            quota_bytes: kernel.quota_bytes,
            own: kernel.container.own,
            restored,
        };
        let dir = self.tickets_dir();
        tokio::task::spawn_blocking(move || {
            create_private_dir(&dir, Some(0o700)).map_err(TicketNotKept::NoDirectory)?;
            write_ticket(&dir, &ticket).map_err(|source| TicketNotKept::Write {
                path: ticket_path(&dir, ticket.session_id),
                source,
            })
        })
        .await
        .map_err(TicketNotKept::Interrupted)?
    }

    /// Removes a kernel's ticket (it ended for real). Failures are logged.
    pub(super) async fn remove_ticket(&self, session: Uuid) {
        let path = ticket_path(&self.tickets_dir(), session);
        match tokio::fs::remove_file(&path).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a kept kernel's ticket")
            }
        }
    }

    /// [`Sandbox::discard_unadopted`](crate::sandbox::Sandbox::discard_unadopted).
    pub(super) async fn discard_unadopted(self: &Arc<Self>) {
        if !self.cfg.keep_kernels || self.startup().await.is_err() {
            return;
        }
        let left: Vec<Ticket> = lock(&self.kept).drain().map(|(_, t)| t).collect();
        let sandboxes: HashMap<Uuid, String> = left
            .iter()
            .filter_map(|t| t.own.map(|key| (key, t.user.clone())))
            .collect();
        let ends = left.into_iter().map(|ticket| async move {
            let session = ticket.session_id;
            let user = SandboxUser {
                name: ticket.user.clone(),
                index: 0,
                limits: Default::default(),
            };
            let limits = KernelLimits {
                memory_bytes: ticket.memory_bytes,
                pids: ticket.pids,
            };
            let quota = ticket.quota_bytes;
            match self.adopt_ticket(ticket, limits, quota, &user).await {
                Ok(launched) => {
                    tracing::info!(%session, user = %user.name, "ending a kept kernel no session adopted");
                    launched.process.terminate().await;
                }
                Err(AdoptError::Failed(e)) => {
                    tracing::warn!(%session, error = %e, "cannot end a kept kernel no session adopted")
                }
                Err(_) => {}
            }
        });
        futures::future::join_all(ends).await;
        // A sandbox's own container none of whose kernels was adopted goes with its
        // workspace (its session did not come back).
        for (key, name) in sandboxes {
            if !self.kernels.any(|k| k.container.own == Some(key)) {
                let user = SandboxUser {
                    name,
                    index: 0,
                    limits: Default::default(),
                };
                self.remove_own(&user, key).await;
            }
        }
        // Stopped containers kept for their kernels' ends, now told.
        if let Ok(docker) = self.client().await {
            let mut registered = HashSet::new();
            let slots: Vec<(String, Arc<UserSlot>)> = lock(&self.users)
                .iter()
                .map(|(u, s)| (u.clone(), s.clone()))
                .collect();
            for (_, slot) in &slots {
                if let Some(c) = slot.container.lock().await.as_ref() {
                    registered.insert(c.id.clone());
                }
            }
            // Only stopped ones: a running container no slot held a moment ago is one a
            // launch has just made.
            if let Ok(list) = self.our_container_summaries(&docker).await {
                for c in list {
                    let Some(id) = c.id else { continue };
                    let running = c.state == Some(ContainerSummaryStateEnum::RUNNING);
                    if !running && !registered.contains(&id) {
                        self.remove_container(&docker, &id).await;
                    }
                }
            }
            // The usual idle rule for every container without a kernel.
            // A sandbox's own container (`own.rs`) goes with its sandbox, not when idle.
            for (user, _) in slots.into_iter().filter(|(u, _)| !u.starts_with('+')) {
                if !self.kernels.has_user(&user) {
                    self.start_idle_timer(&user);
                }
            }
        }
    }
}
