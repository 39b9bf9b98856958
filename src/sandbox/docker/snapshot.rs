//! Snapshots on the Docker sandbox (issue 37; the session layer's book is
//! `session/snapshot.rs`): a pause's images that are kept and restored as often as asked,
//! each time into a new container. A session with a container of its own keeps its files
//! in two places, its workspace (`/home/user`, a host directory) and its `/tmp` (a tmpfs
//! inside the container); a snapshot needs no container of its own, so both are archived
//! with the images:
//!
//! - **Taking one** (the kernel idle): the directory `<data_dir>/snapshots-docker/<id>` is
//!   made (beneath a root-only directory, the kernel uid's for CRIU to write in); the
//!   container's `/home/user` and `/tmp` are archived into [`FILES`] there by `tar`, run in
//!   the container's namespaces as the kernel's uid with no capabilities (`restore.rs`),
//!   writing to a file the broker opened (it never reads a path of the kernel's), at most
//!   the user's workspace quota and the `/tmp` size; then the kernel holds a child, which
//!   CRIU dumps into the same directory as a pause's (`pause.rs`); everything is sealed
//!   (root's, read-only), listed with CRC-32s and recorded. The kernel goes on.
//! - **Starting a session from one**: the files checked against their list (the archive
//!   with them: a damaged one starts nothing); a new container made as a sandbox's own is;
//!   the archive unpacked into it by `tar` as the kernel's uid with no capabilities; the
//!   images restored into it as the kernel's uid (never root), as a resume does. The
//!   snapshot is only ever read.
//!
//! A snapshot outlives the broker (its record beside its images); a session started from
//! one is not kept by `--keep-sessions` (a copy into a container of its own is not), so
//! that option refuses it.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::copy::Made;
use super::exec::{connection_file, SessionFiles};
use super::restore::{pack_files, unpack_files, Carried};
use super::running::{init_pid, ContainerInfo};
use super::{keep, Inner, TMPFS_BYTES};
use crate::sandbox::criu::copy_failed;
use crate::sandbox::fork::{ForkError, PreparedFork};
use crate::sandbox::fsutil::{self, launch_step, remove_dir_logged};
use crate::sandbox::pause::{open_checked, PausedImage};
use crate::sandbox::{KernelProcess, LaunchSpec, Launched};

/// The archive of the container's files in a snapshot's (or a pause's) directory.
pub(super) const FILES: &str = "files.tar";

/// Room past the archived directories' own bounds for `tar`'s headers (512 bytes a file).
pub(super) const TAR_SLACK: u64 = 64 << 20;

impl Inner {
    /// `<data_dir>/snapshots-docker`: root's, 0700; each snapshot's images in it.
    pub(super) fn snapshots_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("snapshots-docker")
    }

    /// Makes the snapshot's directory and archives the container's files into it; the
    /// held child is then dumped there by [`Inner::dump_paused`].
    pub(super) async fn prepare_snapshot(
        self: &Arc<Self>,
        kernel: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let (origin, _, live) = self.own_origin(kernel, &spec, "snapshotted").await?;
        if spec.own_workspace != Some(spec.session_id) {
            return Err(ForkError::Unsupported(
                "a snapshot is named by its own id".into(),
            ));
        }
        let limit = spec.user.limits.workspace_quota_bytes + TMPFS_BYTES + TAR_SLACK;
        let parent = self.snapshots_dir();
        self.prepare_kept_dump(
            origin,
            &live,
            spec,
            parent,
            Some((Carried::HomeAndTmp, limit)),
        )
        .await
    }

    /// A new kernel for `spec` in a new container of its own, from the snapshot `image`.
    pub(super) async fn start_from_snapshot(
        self: &Arc<Self>,
        image: &PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, ForkError> {
        let refused = |why: &str| ForkError::Unsupported(why.to_string());
        if !self.privileged {
            return Err(refused(
                "a session starts from a snapshot with CRIU, which the broker runs only as root",
            ));
        }
        match (image.own_workspace, spec.own_workspace) {
            (Some(from), Some(to)) if from != to => {}
            _ => {
                return Err(refused(
                    "a session from a snapshot gets a container of its own",
                ))
            }
        }
        // Checked before anything is made: a damaged snapshot makes nothing.
        let images = open_checked(image).await?;
        let made = self.copy_container(&spec).await?;
        let started = self
            .restore_into(&spec, image, &images, &made, Some(Carried::HomeAndTmp))
            .await;
        if let (Err(_), true, Some(key)) = (&started, made.new_container, spec.own_workspace) {
            self.remove_own(&spec.user, key).await;
        }
        started
    }

    /// The `carried` directories of `container` archived into [`FILES`] in the images'
    /// directory `dir` (made just now), at most `limit` bytes.
    pub(super) async fn archive_files(
        &self,
        container: &ContainerInfo,
        dir: &Path,
        carried: Carried,
        limit: u64,
    ) -> Result<(), ForkError> {
        let tools = self.copy_tools().await?;
        let docker = self.client().await?;
        let init = init_pid(&docker, container)
            .await
            .ok_or_else(|| copy_failed("the session's container does not run"))?;
        let archive = new_archive(dir).await?;
        pack_files(&tools, (init, carried), archive, limit).await
    }

    /// Restores `image` (its checked directory `images`) into `made`'s container for
    /// `spec`: the session directory named by the image's kernel id and its connection file
    /// written, the image's archive of the `carried` directories unpacked (if any), the
    /// images restored and the kernel woken. On error its session directory goes (the
    /// container is the caller's to undo).
    pub(super) async fn restore_into(
        self: &Arc<Self>,
        spec: &LaunchSpec,
        image: &PausedImage,
        images: &OwnedFd,
        made: &Made,
        carried: Option<Carried>,
    ) -> Result<Launched, ForkError> {
        let dir_name = keep::session_dir(image.kernel_id);
        let host_dir = self.user_run_dir(&self.slot_of(spec)?).join(&dir_name);
        let restored = async {
            let files = SessionFiles {
                dir: host_dir.clone(),
                privileged: self.privileged,
                connection: Some(connection_file(spec, &dir_name)),
            };
            let user = spec.user.clone();
            tokio::task::spawn_blocking(move || files.write())
                .await
                .map_err(|e| launch_step(&user, "preparing the restore's files", e))??;
            let docker = self.client().await?;
            let init = init_pid(&docker, &made.container)
                .await
                .ok_or_else(|| copy_failed("the session's container does not run"))?;
            if let Some(carried) = carried {
                let tools = self.copy_tools().await?;
                let archive = open_archive(images).await?;
                unpack_files(&tools, (init, carried), archive).await?;
            }
            self.restore_paused(spec, &host_dir, made.container.clone(), init, images, image)
                .await
        }
        .await;
        if restored.is_err() {
            remove_dir_logged(host_dir).await;
        }
        restored
    }

    /// The slot (and runtime directory name) of the container `spec` runs in: its own, or
    /// its user's.
    pub(super) fn slot_of(&self, spec: &LaunchSpec) -> Result<String, ForkError> {
        Ok(self.target(&spec.user, spec.own_workspace)?.slot)
    }
}

/// [`FILES`], made in the snapshot's directory `dir` (root's, beneath the root-only
/// snapshots' directory; made just now) by descriptor: root's, 0600, never an existing file.
async fn new_archive(dir: &Path) -> Result<std::fs::File, ForkError> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || -> std::io::Result<std::fs::File> {
        use rustix::fs::{Mode, OFlags};
        let parent = fsutil::open_tree_root(&dir)?;
        let fd = rustix::fs::openat(
            parent.as_fd(),
            FILES,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(std::fs::File::from(fd))
    })
    .await
    .map_err(|e| copy_failed(format!("the archive's task failed: {e}")))?
    .map_err(|e| copy_failed(format!("cannot create the snapshot's archive: {e}")))
}

/// [`FILES`] of the checked images' directory `images`, opened for reading by descriptor.
async fn open_archive(images: &OwnedFd) -> Result<std::fs::File, ForkError> {
    let images = images.try_clone().map_err(|e| copy_failed(e.to_string()))?;
    tokio::task::spawn_blocking(move || -> std::io::Result<std::fs::File> {
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::openat(
            images.as_fd(),
            FILES,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(std::fs::File::from(fd))
    })
    .await
    .map_err(|e| copy_failed(format!("the archive's task failed: {e}")))?
    .map_err(|e| copy_failed(format!("the snapshot's archive cannot be opened: {e}")))
}
