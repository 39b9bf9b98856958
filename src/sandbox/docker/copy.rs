//! Forking a kernel with a workspace of its own on Docker (issue 36): a copy of the kernel in
//! a container of its own with a copy of the workspace, made with CRIU, as the local sandbox
//! makes one in a sandbox of its own (`local/copy.rs` says why a `fork()` cannot do it, and
//! `docs/CRIU.md` what was measured). The steps:
//!
//! 1. **Prepare** (the parent idle): the fork's container is made as a sandbox's own is
//!    (`own.rs`; for a rewind it is the session's, which runs), its session directory and
//!    connection file written by descriptor in its runtime directory; the parent container's
//!    `/home/user` and `/tmp` are copied into it by `tar` from the image, as the kernel's uid
//!    with no capabilities and `no_new_privs`, one in each container's namespaces, through a
//!    pipe (`restore.rs`): a tenant's files are read and written with its own rights only, a
//!    symlink is copied as one. The destination is emptied first (a rewind).
//! 2. **Hold**: `kb_fork_request {"hold": ...}`, as on the local sandbox.
//! 3. **Dump**: the reported pid checked ([`find_fork`]), CRIU dumps it inside the parent's
//!    namespaces as the kernel's uid with `CAP_CHECKPOINT_RESTORE` and `CAP_SYS_ADMIN`
//!    only, into a directory in `<data_dir>/copies-docker` (root's, 0700); the images are
//!    then sealed (root's, read-only, regular files only).
//! 4. **Restore**: in the new container's namespaces, bwrap (root) makes a pid namespace and
//!    a mount namespace of the kernel's own (its own `/proc`, with the paths Docker masks
//!    masked again) and drops to setpriv, which runs CRIU as the kernel's uid with only
//!    `CAP_CHECKPOINT_RESTORE` and `CAP_SETPCAP`, `no_new_privs`; CRIU puts the kernel's
//!    syscall filter back on it. Its own pid namespace: the restored pid is the one it was
//!    dumped with, which in the container may be taken (a rewind restores into the
//!    session's container, beside the kernel it replaces). All of it runs in a cgroup leaf
//!    of the container entered before `nsenter` runs, with the new session's limits.
//! 5. **Wake**: once CRIU says the task runs, it is found on the host (CRIU's child, of the
//!    pid it was dumped with, of the kernel's uid), held by a pidfd and woken; it reads its
//!    connection file in the new container and builds its kernel there.
//!
//! The host programs run by descriptor through the host's loader (`criu/programs.rs`), so
//! the image needs no CRIU and nothing of it runs as root. Whatever fails, nothing of the
//! fork is left: its leaf, its session directory, its images, and a container it made.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::exec::{connection_file, endpoints_for, DockerKernel, ForkedPid, SessionFiles, LOST};
use super::restore::{copy_files, restore, restored_pid, CopyTools};
use super::running::{init_pid, ContainerInfo};
use super::watch::{register_forked, ForkedStatus};
use super::{keep, Inner, KERNEL_GID, KERNEL_UID, RUN_DIR_INSIDE};
use crate::sandbox::cgroup::{ContainerCgroup, Leaf};
use crate::sandbox::criu::{copy_failed, dump_and_seal, wake, Programs};
use crate::sandbox::fork::{find_fork, ForkError, PreparedFork};
use crate::sandbox::fsutil::{self, launch_failed, launch_step, remove_dir_logged};
use crate::sandbox::watched::KernelWatch;
use crate::sandbox::{KernelProcess, LaunchSpec, Launched, SandboxError};

/// The ends of a copy: what a copy made and must undo if it is given up.
pub(super) struct Made {
    pub container: Arc<ContainerInfo>,
    /// The container was made for this copy (not a rewind's session container).
    pub new_container: bool,
}

impl Inner {
    /// `<data_dir>/copies-docker`: root's, 0700; the copies' image directories in it.
    pub(super) fn copies_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("copies-docker")
    }

    /// Step 1 (see the module comment).
    pub(super) async fn prepare_copy(
        self: &Arc<Self>,
        parent: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let refused = |why: &str| ForkError::Unsupported(why.to_string());
        if !self.privileged {
            return Err(refused(
                "a fork of a session with a workspace of its own is a copy of its kernel made \
                 with CRIU, which the broker does only as root",
            ));
        }
        self.copy_tools().await?;
        let origin = parent
            .fork_origin()
            .ok_or_else(|| refused("its kernel cannot be copied (it ended, or it was not started by this broker as root)"))?;
        let (Some(from), Some(to)) = (origin.own_workspace, spec.own_workspace) else {
            return Err(refused("a copy needs a workspace of its own on both sides"));
        };
        if from == to || origin.uid != Some(KERNEL_UID) {
            return Err(refused(
                "a copy gets a workspace of its own, and runs as the image's kernel uid",
            ));
        }
        let kernel = origin
            .kernel
            .and_then(|k| self.kernels.get(&k))
            .filter(|k| k.watch.user == spec.user.name && !k.watch.has_exited())
            .ok_or_else(|| refused("its kernel has ended"))?;
        let room = crate::sandbox::criu::reserve_room(
            &self.copy_room,
            &self.cfg.data_dir,
            origin.host_pid,
            self.cfg.copy_reserve_bytes,
        )
        .await?;
        let dir_name = keep::session_dir(spec.session_id);
        let host_dir = self.user_run_dir(&super::own::own_slot(to)).join(&dir_name);
        // Known before anything is made: a path that cannot be a socket refuses it first.
        let endpoints = endpoints_for(&host_dir).map_err(|e| launch_failed(&spec.user, e))?;
        let made = self.copy_container(&spec).await?;
        let copied = self
            .prepare_copy_files(&kernel, &made, &spec, &host_dir, &dir_name)
            .await;
        if let Err(e) = copied {
            self.undo_copy(&spec, &made, host_dir).await;
            return Err(e);
        }
        let connection = format!("{RUN_DIR_INSIDE}/{dir_name}/connection.json");
        Ok(PreparedFork::held(
            origin,
            spec,
            host_dir,
            &connection,
            endpoints,
            room,
        ))
    }

    /// The fork's container (made as a sandbox's own is), or the session's own for a rewind.
    pub(super) async fn copy_container(
        self: &Arc<Self>,
        spec: &LaunchSpec,
    ) -> Result<Made, ForkError> {
        let target = self.target(&spec.user, spec.own_workspace)?;
        self.startup().await?;
        let docker = self.client().await?;
        let slot = self.slot(&target.slot);
        if let Some(idle) = crate::sync::lock(&slot.idle).take() {
            idle.cancel();
        }
        let mut guard = slot.container.lock().await;
        if let Some(c) = self.running_container(&docker, &mut guard).await? {
            return Ok(Made {
                container: c,
                new_container: false,
            });
        }
        let c = self.create_container(&docker, &spec.user, &target).await?;
        *guard = Some(c.clone());
        Ok(Made {
            container: c,
            new_container: true,
        })
    }

    /// The session directory and connection file in the fork's container, and the files.
    async fn prepare_copy_files(
        &self,
        kernel: &DockerKernel,
        made: &Made,
        spec: &LaunchSpec,
        host_dir: &Path,
        dir_name: &str,
    ) -> Result<(), ForkError> {
        let user = &spec.user;
        let files = SessionFiles {
            dir: host_dir.to_path_buf(),
            privileged: self.privileged,
            connection: Some(connection_file(spec, dir_name)),
        };
        tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| launch_step(user, "preparing the copy's files", e))??;
        let docker = self.client().await?;
        let (from, to) = (
            init_pid(&docker, &kernel.container).await,
            init_pid(&docker, &made.container).await,
        );
        let (Some(from), Some(to)) = (from, to) else {
            return Err(copy_failed("a container of the copy does not run"));
        };
        let tools = self.copy_tools().await?;
        let started = Instant::now();
        copy_files(&tools, from, to).await?;
        tracing::debug!(session = %spec.session_id, ms = started.elapsed().as_millis() as u64, "workspace copied into a container of its own");
        Ok(())
    }

    /// What a failed copy made goes: its session directory, and its container with its
    /// workspace if the copy made them (never a rewind's session container).
    async fn undo_copy(&self, spec: &LaunchSpec, made: &Made, host_dir: PathBuf) {
        remove_dir_logged(host_dir).await;
        if let (true, Some(key)) = (made.new_container, spec.own_workspace) {
            self.remove_own(&spec.user, key).await;
        }
    }

    /// A prepared copy given up (the kernel refused or never answered).
    pub(super) async fn discard_copy(&self, prepared: PreparedFork) {
        let key = prepared.spec.own_workspace;
        let new_container = !self.kernels.any(|k| k.container.own == key);
        remove_dir_logged(prepared.dir).await;
        if let (true, Some(key)) = (new_container, prepared.spec.own_workspace) {
            self.remove_own(&prepared.spec.user, key).await;
        }
    }

    /// Steps 3 to 5 for the held child `pid` the kernel reported.
    pub(super) async fn adopt_copy(
        self: &Arc<Self>,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<Launched, ForkError> {
        let images = self.copies_dir().join(prepared.spec.session_id.to_string());
        let made = self.dump_and_restore(&prepared, &images, pid).await;
        remove_dir_logged(images).await;
        if made.is_err() {
            self.discard_copy(prepared).await;
        }
        made
    }

    async fn dump_and_restore(
        self: &Arc<Self>,
        prepared: &PreparedFork,
        images_dir: &Path,
        pid: i64,
    ) -> Result<Launched, ForkError> {
        let PreparedFork {
            origin, spec, dir, ..
        } = prepared;
        let tools = self.copy_tools().await?;
        let (host, held) =
            find_fork(origin, pid).map_err(|why| ForkError::NotItsChild { pid, why })?;
        let ids = (KERNEL_UID, KERNEL_GID);
        let images = {
            let (copies, made) = (self.copies_dir(), images_dir.to_path_buf());
            tokio::task::spawn_blocking(move || -> Result<OwnedFd, SandboxError> {
                fsutil::create_private_dir(&copies, Some(0o700))?;
                let parent = fsutil::open_tree_root(&copies)
                    .map_err(fsutil::io_err("cannot open the copies' directory", &copies))?;
                let name = made.file_name().map(PathBuf::from).unwrap_or_default();
                fsutil::make_dir_at(std::os::fd::AsFd::as_fd(&parent), &name, 0o700, Some(ids))
                    .map_err(fsutil::io_err("cannot create the copy's directory", &made))?;
                fsutil::open_tree_root(&made)
                    .map_err(fsutil::io_err("cannot open the copy's directory", &made))
            })
            .await
            .map_err(|e| copy_failed(format!("the copy task failed: {e}")))??
        };
        let programs = tools.programs()?;
        let held = (host, held, pid);
        let dumped = dump_and_seal(
            &tools.criu,
            &programs,
            held,
            ids,
            Some(ids.1),
            &images,
            false,
        )
        .await?;

        let key = spec.own_workspace.unwrap_or_default();
        let container = self
            .own_container(key)
            .await
            .ok_or_else(|| copy_failed("the copy's container is gone"))?;
        let docker = self.client().await?;
        let init = init_pid(&docker, &container)
            .await
            .ok_or_else(|| copy_failed("the copy's container does not run"))?;
        let (cgroup, leaf) = {
            let (limits, name) = (spec.limits, spec.session_id.to_string());
            tokio::task::spawn_blocking(move || -> Result<_, ForkError> {
                let cgroup = ContainerCgroup::of_process(init)
                    .map_err(|e| copy_failed(format!("no cgroup for the copy: {e}")))?;
                let leaf = cgroup.create_leaf(&name, &limits)?;
                Ok((cgroup, leaf))
            })
            .await
            .map_err(|e| copy_failed(format!("the leaf task failed: {e}")))??
        };
        let started_restore = Instant::now();
        let restored = self
            .restore_in(&tools, &programs, init, &leaf, &images, pid)
            .await;
        let (host_pid, fd) = match restored {
            Ok(woken) => woken,
            Err(e) => {
                ContainerCgroup::remove_leaf(&leaf).await;
                return Err(e);
            }
        };
        let launched = self
            .adopt_restored(spec, dir, container, (host_pid, fd), cgroup, leaf)
            .await;
        if launched.is_ok() {
            tracing::info!(session = %spec.session_id, pid = host_pid, dump_ms = dumped.as_millis() as u64, restore_ms = started_restore.elapsed().as_millis() as u64, "kernel copied into a container of its own");
        }
        launched
    }

    /// Restores the images into container `init`'s namespaces, in `leaf`, and wakes the
    /// kernel; returns its host pid and the pidfd it was woken through.
    pub(super) async fn restore_in(
        &self,
        tools: &CopyTools,
        programs: &Programs,
        init: i32,
        leaf: &Leaf,
        images: &OwnedFd,
        pid: i64,
    ) -> Result<(i32, OwnedFd), ForkError> {
        let procs: Vec<std::fs::File> = leaf
            .dirs()
            .iter()
            .map(|d| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(d.join("cgroup.procs"))
            })
            .collect::<std::io::Result<_>>()
            .map_err(|e| copy_failed(format!("cannot open the copy's cgroup: {e}")))?;
        let procs: Vec<RawFd> = procs.iter().map(AsRawFd::as_raw_fd).collect::<Vec<_>>();
        let helper = restore(
            tools,
            programs,
            init,
            &procs,
            images,
            (KERNEL_UID, KERNEL_GID),
        )
        .await?;
        let host = restored_pid(helper, pid, KERNEL_UID);
        wake(host, KERNEL_UID)
    }

    /// The restored kernel, registered and watched as a fork is (`fork.rs`); if it cannot
    /// be, its leaf goes, and the kernel with it.
    pub(super) async fn adopt_restored(
        self: &Arc<Self>,
        spec: &LaunchSpec,
        dir: &Path,
        container: Arc<ContainerInfo>,
        (host_pid, fd): (i32, OwnedFd),
        cgroup: ContainerCgroup,
        leaf: Leaf,
    ) -> Result<Launched, ForkError> {
        let user = &spec.user;
        let session = spec.session_id;
        let lost = |e: std::io::Error| copy_failed(format!("the restored kernel is lost: {e}"));
        let ready = || -> Result<_, ForkError> {
            // The pidfd it was woken through: if the signal ended it, its watcher sees that.
            let watch_fd = fd.try_clone().map_err(lost)?;
            // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the
            // AsyncFd that owns it drops it.
            let watch_fd = unsafe { AsyncFd::register_with_interest(watch_fd, Interest::READABLE) }
                .map_err(|e| lost(e.into_parts().1))?;
            let endpoints = endpoints_for(dir).map_err(|e| launch_failed(user, e))?;
            let docker = self.client.get().map(|(d, _)| d.clone());
            let docker = docker.ok_or_else(|| copy_failed("the daemon's client is gone"))?;
            Ok((watch_fd, endpoints, docker))
        };
        let (watch_fd, endpoints, docker) = match ready() {
            Ok(ready) => ready,
            Err(e) => {
                ContainerCgroup::remove_leaf(&leaf).await;
                return Err(e);
            }
        };
        let (watch, exit) = KernelWatch::new(session, user.name.clone(), LOST);
        let freezer = Some(cgroup.freezer(&leaf));
        // Its own workspace, or its user's (a resumed kernel that shares its user's).
        let workspace = match self.target(user, spec.own_workspace) {
            Ok(target) => target.workspace,
            Err(e) => {
                ContainerCgroup::remove_leaf(&leaf).await;
                return Err(e.into());
            }
        };
        let shared = Arc::new(DockerKernel {
            watch,
            docker,
            container,
            dir: dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            host_dir: dir.to_path_buf(),
            exec_id: String::new(),
            exec_pid: None,
            forked: Some(ForkedPid {
                host_pid,
                pidfd: fd,
                cgroup,
            }),
            exec_pidfd: None,
            leaf: Some(leaf),
            freezer,
            limits: spec.limits,
            workspace,
            quota_bytes: user.limits.workspace_quota_bytes,
        });
        let zombie = ForkedStatus::Zombie;
        let handle = register_forked(self, session, shared.clone(), exit, watch_fd, zombie);
        if self.cfg.keep_kernels {
            // Written before the kernel is handed over, as a launch's ticket is: a kernel
            // that could not be kept is not made.
            if let Err(e) = self.keep_ticket(&shared).await {
                handle.terminate().await;
                return Err(copy_failed(format!(
                    "the restored kernel cannot be kept (--keep-sessions): {e}"
                )));
            }
        }
        Ok(Launched {
            endpoints,
            process: Box::new(handle),
        })
    }

    /// The running own container `key`, if this broker has it.
    pub(super) async fn own_container(&self, key: uuid::Uuid) -> Option<Arc<ContainerInfo>> {
        let slot = self.slot(&super::own::own_slot(key));
        let guard = slot.container.lock().await;
        guard.clone()
    }
}
