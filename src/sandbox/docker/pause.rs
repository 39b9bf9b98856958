//! Pausing a kernel to disk and resuming it on the Docker sandbox (issue 37; the exchange is
//! `sandbox/pause.rs`): the two halves of a copy (`copy.rs`) apart in time, for a session
//! with a container of its own. The images go in `<data_dir>/paused-docker/<kernel id>`
//! (root's, beneath a root-only directory), made by CRIU as the kernel's uid inside the
//! container's namespaces and sealed, with the container's `/tmp` (a tmpfs inside it, which
//! the kernel may hold files in) archived beside them by an unprivileged `tar`
//! (`snapshot.rs`, [`FILES`]). The kernel ends, and so does the container once no kernel
//! runs in it (another context of the same E2B sandbox may): a paused session holds no
//! memory and no process, and outlives the broker (the images' record, `broker.json`; its
//! workspace, a host directory, is spared by the start-up sweep). A resume takes the
//! session's container, or makes a new one and unpacks the archive into its `/tmp`; writes
//! the kernel's session directory and connection file in its runtime directory; restores
//! the images into it in a cgroup leaf with the session's limits (CRIU as the kernel's
//! uid, in a pid namespace of its own: `restore.rs`); and wakes the kernel, as a copy's
//! restore does.

use std::path::PathBuf;
use std::sync::Arc;

use uuid::Uuid;

use super::exec::{endpoints_for, DockerKernel};
use super::own::own_slot;
use super::restore::Carried;
use super::snapshot::{FILES, TAR_SLACK};
use super::{keep, Inner, KERNEL_GID, KERNEL_UID, RUN_DIR_INSIDE, TMPFS_BYTES};
use crate::sandbox::cgroup::ContainerCgroup;
use crate::sandbox::criu::{copy_failed, dump_and_seal};
use crate::sandbox::fork::{find_fork, ForkError, ForkOrigin, PreparedFork};
use crate::sandbox::fsutil::{self, launch_failed, remove_dir_logged};
use crate::sandbox::pause::{list_images, make_images_dir, open_checking, record, PausedImage};
use crate::sandbox::{KernelProcess, LaunchSpec, Launched, SandboxUser};
use crate::sync::lock;

/// What a user's container has in memory, shared by the user's kernels and gone with the
/// container: a kernel sharing it may hold nothing there when it is paused.
const CONTAINER_PRIVATE: [&str; 3] = ["/tmp", "/home/kernel", "/dev/shm"];

impl Inner {
    /// `<data_dir>/paused-docker`: root's, 0700; each paused kernel's images in it.
    pub(super) fn paused_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("paused-docker")
    }

    pub(super) async fn prepare_pause(
        self: &Arc<Self>,
        kernel: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let (origin, live) = self.held_origin(kernel, &spec, "paused").await?;
        if spec.own_workspace != origin.own_workspace {
            return Err(ForkError::Unsupported(
                "a paused kernel resumes in its own container, or its user's".into(),
            ));
        }
        if origin.own_workspace.is_none() {
            if live.forked.is_none() {
                return Err(ForkError::Unsupported(
                    "a kernel sharing its user's container is paused when it was forked from \
                     the user's template (fork-server starts); this one was started plainly"
                        .into(),
                ));
            }
            // Resumed in its user's container, whose /tmp, home and /dev/shm it shares with
            // the user's other kernels for as long as the container lives: it must hold
            // nothing there (the held child checks, and refuses saying what).
            let mut prepared = self
                .prepare_kept_dump(origin, &live, spec, self.paused_dir(), None)
                .await?;
            prepared.request["hold"]["private"] = serde_json::json!(CONTAINER_PRIVATE);
            return Ok(prepared);
        }
        // Its /tmp (memory of the container's) beside the images: the container goes.
        let carried = (Carried::Tmp, TMPFS_BYTES + TAR_SLACK);
        self.prepare_kept_dump(origin, &live, spec, self.paused_dir(), Some(carried))
            .await
    }

    /// What a pause and a snapshot share: room for the images; their directory
    /// `<parent>/<spec.session_id>`; the `carried` directories of the kernel's container
    /// archived into it (at most the bytes given); and the hold request, whose child reads
    /// its connection file in the session directory named by `spec.session_id` in the
    /// runtime directory of the container it is restored into.
    pub(super) async fn prepare_kept_dump(
        self: &Arc<Self>,
        origin: ForkOrigin,
        live: &DockerKernel,
        spec: LaunchSpec,
        parent: PathBuf,
        carried: Option<(Carried, u64)>,
    ) -> Result<PreparedFork, ForkError> {
        let room = crate::sandbox::criu::reserve_room(
            &self.copy_room,
            &self.cfg.data_dir,
            origin.host_pid,
            self.cfg.copy_reserve_bytes,
        )
        .await?;
        let dir_name = keep::session_dir(spec.session_id);
        let host_dir = self.user_run_dir(&self.slot_of(&spec)?).join(&dir_name);
        let endpoints = endpoints_for(&host_dir).map_err(|e| launch_failed(&spec.user, e))?;
        let images = make_images_dir(
            parent,
            spec.session_id.to_string(),
            (KERNEL_UID, KERNEL_GID),
        )
        .await?;
        if let Some((carried, limit)) = carried {
            if let Err(e) = self
                .archive_files(&live.container, &images, carried, limit)
                .await
            {
                remove_dir_logged(images).await;
                return Err(e);
            }
        }
        let connection = format!("{RUN_DIR_INSIDE}/{dir_name}/connection.json");
        Ok(PreparedFork::paused(
            origin,
            spec,
            images,
            &connection,
            endpoints,
            room,
        ))
    }

    /// The held-child origin of `kernel` (a session with a container of its own, alive, the
    /// user's, as the image's kernel uid), its own-workspace key and its kernel; or why it
    /// cannot be `what` (paused, snapshotted). Only as root, with CRIU.
    pub(super) async fn own_origin(
        self: &Arc<Self>,
        kernel: &dyn KernelProcess,
        spec: &LaunchSpec,
        what: &str,
    ) -> Result<(ForkOrigin, uuid::Uuid, Arc<DockerKernel>), ForkError> {
        let (origin, live) = self.held_origin(kernel, spec, what).await?;
        let Some(own) = origin.own_workspace else {
            return Err(ForkError::Unsupported(format!(
                "a session that shares its user's container cannot be {what} yet; a session \
                 made with \"workspace\": \"own\" can be"
            )));
        };
        Ok((origin, own, live))
    }

    /// The held-child origin of `kernel` (alive, the user's, as the image's kernel uid) and
    /// its kernel; or why it cannot be `what`. Only as root, with CRIU.
    async fn held_origin(
        self: &Arc<Self>,
        kernel: &dyn KernelProcess,
        spec: &LaunchSpec,
        what: &str,
    ) -> Result<(ForkOrigin, Arc<DockerKernel>), ForkError> {
        let refused = |why: String| ForkError::Unsupported(why);
        if !self.privileged {
            return Err(refused(format!(
                "a kernel is {what} with a dump made with CRIU, which the broker does only as \
                 root"
            )));
        }
        self.copy_tools().await?;
        let origin = kernel.fork_origin().ok_or_else(|| {
            refused(format!("its kernel cannot be {what} (it ended, or it was not started by this broker as root)"))
        })?;
        if origin.uid != Some(KERNEL_UID) {
            return Err(refused(format!(
                "a kernel is {what} as the image's kernel uid"
            )));
        }
        let live = origin
            .kernel
            .and_then(|k| self.kernels.get(&k))
            .filter(|k| k.watch.user == spec.user.name && !k.watch.has_exited())
            .ok_or_else(|| refused("its kernel has ended".into()))?;
        Ok((origin, live))
    }

    pub(super) async fn dump_paused(
        self: &Arc<Self>,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<PausedImage, ForkError> {
        let PreparedFork {
            origin,
            spec,
            dir,
            room,
            ..
        } = prepared;
        let dumped = async {
            let tools = self.copy_tools().await?;
            let (host, held) =
                find_fork(&origin, pid).map_err(|why| ForkError::NotItsChild { pid, why })?;
            let images = fsutil::open_tree_root(&dir).map_err(|e| {
                copy_failed(format!("cannot open the paused kernel's directory: {e}"))
            })?;
            let programs = tools.programs()?;
            let ids = (KERNEL_UID, KERNEL_GID);
            // A kernel forked in its user's template is not dumpable (its key kept from the
            // user's other kernels): `criu::dump_caps` says what that adds.
            let took = dump_and_seal(
                &tools.criu,
                &programs,
                (host, held, pid),
                ids,
                Some(ids.1),
                &images,
                origin.own_workspace.is_none(),
            )
            .await?;
            let (files, images) = list_images(images).await?;
            let image = PausedImage::new(dir.clone(), pid, &spec, files, took);
            // Its record beside the images: a snapshot outlives the broker.
            record(images, image).await
        }
        .await;
        drop(room);
        if dumped.is_err() {
            remove_dir_logged(dir).await;
        }
        dumped
    }

    pub(super) async fn resume_kernel(
        self: &Arc<Self>,
        image: &PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, ForkError> {
        if spec.own_workspace != image.own_workspace || spec.session_id != image.kernel_id {
            return Err(ForkError::Unsupported(
                "a paused kernel resumes as itself, in its own container or its user's".into(),
            ));
        }
        // Checked while its container is made: the /tmp archived with it is unpacked there
        // only from images as they were sealed.
        let (images, check) = open_checking(image)?;
        // The session's container, or a new one: it went when the session paused
        // (`release_own_container`), or with the broker.
        let made = self.copy_container(&spec).await;
        let made = match check.passed().await {
            Ok(()) => made?,
            Err(e) => {
                if let (Ok(made), Some(key)) = (&made, spec.own_workspace) {
                    if made.new_container {
                        self.release_own_container(&spec.user, key).await;
                    }
                }
                return Err(e);
            }
        };
        // A new container's /tmp is empty: the pause's archive of it is unpacked there.
        let carried = (made.new_container && image.files.iter().any(|f| f.name == FILES))
            .then_some(Carried::Tmp);
        let resumed = self
            .restore_into(&spec, image, &images, &made, carried)
            .await;
        if let (Err(_), true, Some(key)) = (&resumed, made.new_container, spec.own_workspace) {
            self.release_own_container(&spec.user, key).await;
        }
        resumed
    }

    /// After the pause of a session with the own container `key`: the container goes
    /// (its workspace stays, and the images hold its `/tmp`) unless a kernel still runs in
    /// it (another context of the same sandbox). Its removal (about a second of the
    /// engine's) runs after the answer, holding the slot's lock: a launch or resume waits
    /// for it, and then makes a new container.
    pub(super) async fn release_own_container(self: &Arc<Self>, user: &SandboxUser, key: Uuid) {
        let slot = lock(&self.users).get(&own_slot(key)).cloned();
        let Some(slot) = slot else {
            return;
        };
        let mut guard = slot.container.clone().lock_owned().await;
        if self
            .kernels
            .any(|k| k.container.own == Some(key) && !k.watch.has_exited())
        {
            return;
        }
        let Some(container) = guard.take() else {
            return;
        };
        let (inner, user) = (self.clone(), user.name.clone());
        tokio::spawn(async move {
            inner
                .remove_own_container(&user, key, Some(container))
                .await;
            drop(guard);
            tracing::info!(%user, %key, "a paused sandbox's container removed (its workspace stays)");
        });
    }

    pub(super) async fn restore_paused(
        self: &Arc<Self>,
        spec: &LaunchSpec,
        host_dir: &std::path::Path,
        container: Arc<super::running::ContainerInfo>,
        init: i32,
        images: &std::os::fd::OwnedFd,
        image: &PausedImage,
    ) -> Result<Launched, ForkError> {
        let tools = self.copy_tools().await?;
        let programs = tools.programs()?;
        let (cgroup, leaf) = {
            let (limits, name) = (spec.limits, spec.session_id.to_string());
            tokio::task::spawn_blocking(move || -> Result<_, ForkError> {
                let cgroup = ContainerCgroup::of_process(init)
                    .map_err(|e| copy_failed(format!("no cgroup for the resume: {e}")))?;
                let leaf = cgroup.create_leaf(&name, &limits)?;
                Ok((cgroup, leaf))
            })
            .await
            .map_err(|e| copy_failed(format!("the leaf task failed: {e}")))??
        };
        let started = std::time::Instant::now();
        let woken = match self
            .restore_in(&tools, &programs, init, &leaf, images, image.pid)
            .await
        {
            Ok(woken) => woken,
            Err(e) => {
                ContainerCgroup::remove_leaf(&leaf).await;
                return Err(e);
            }
        };
        let host_pid = woken.0;
        let launched = self
            .adopt_restored(spec, host_dir, container, woken, cgroup, leaf)
            .await;
        if launched.is_ok() {
            tracing::info!(session = %spec.session_id, pid = host_pid, dump_ms = image.dump_time.as_millis() as u64, restore_ms = started.elapsed().as_millis() as u64, "kernel resumed in its container");
        }
        launched
    }
}
