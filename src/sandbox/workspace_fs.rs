//! The per-user workspace quota: each user's workspace is its own ext4 file system.
//!
//! A kernel may write as much as it likes into its workspace, and the workspace outlives it,
//! so the limit has to be enforced by the kernel (the OS one) at write time: measuring usage
//! afterwards lets a kernel fill the host disk in seconds. Each workspace directory is the
//! mount point of a sparse image file `<workspaces>-images/<user>.img` holding an ext4 file
//! system of the user's `workspace_quota_bytes`, loop-mounted `nosuid,nodev` when the user's
//! workspace is first needed in a broker run and unmounted on shutdown. Writes past the size
//! fail with `ENOSPC` in the kernel and in the broker's own file API alike, and a kernel
//! cannot rename or hard-link anything across the file system's edge. Both backends
//! bind-mount that directory into the sandbox, so the quota is the same for both.
//!
//! The images live beside the workspaces directory, not in it: a user may be called
//! `alice.img`. Without root the broker cannot mount; it says so once and keeps the plain
//! directories (no quota). A plain workspace with content from before quotas is kept as it
//! is, with a warning: copying a tree a kernel wrote is a risk of its own, and the operator
//! can move its content into the image after one run.
//!
//! Quota changes take effect at the next mount (the next broker run): the image grows with
//! `resize2fs`, and shrinks only down to what is used (refused and logged otherwise).

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::fsutil::{chown_tree, current_ids, io_err, unavailable, unavailable_by};
use super::SandboxError;
use crate::sync::lock;

/// The workspace file systems of one backend.
pub(crate) struct WorkspaceImages {
    backend: &'static str,
    /// Where the images live (`<workspaces>-images`).
    images: PathBuf,
    /// Only root can mount.
    privileged: bool,
    /// Workspace directories settled in this run (mounted, or kept plain): the fast path.
    /// Held across the slow set-up, so two first uses of one workspace do not both mount.
    settled: Mutex<Settled>,
    warned_unprivileged: AtomicBool,
}

#[derive(Default)]
struct Settled {
    /// Mount points this broker mounted (or found mounted), unmounted on shutdown.
    mounted: Vec<PathBuf>,
    /// Workspaces that stay plain directories this run.
    plain: HashSet<PathBuf>,
}

impl WorkspaceImages {
    /// For the workspaces in `workspaces` (`<data_dir>/workspaces`).
    pub(crate) fn new(backend: &'static str, workspaces: &Path, privileged: bool) -> Self {
        let mut images = workspaces.as_os_str().to_owned();
        images.push("-images");
        Self {
            backend,
            images: PathBuf::from(images),
            privileged,
            settled: Mutex::new(Settled::default()),
            warned_unprivileged: AtomicBool::new(false),
        }
    }

    /// Makes `dir` (an existing directory) the mount point of its user's file system of
    /// `quota` bytes, created with its root owned by `owner`. Blocking (mkfs, mount).
    pub(crate) fn ensure(
        &self,
        dir: &Path,
        quota: u64,
        owner: (u32, u32),
    ) -> Result<(), SandboxError> {
        if quota == 0 {
            return Ok(());
        }
        if !self.privileged {
            if !self.warned_unprivileged.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    backend = self.backend,
                    "workspace quotas are NOT enforced: the broker is not root and cannot \
                     mount the workspace file systems; kernels can fill the disk"
                );
            }
            return Ok(());
        }
        let started = std::time::Instant::now();
        let mut settled = lock(&self.settled);
        if settled.plain.contains(dir) || settled.mounted.iter().any(|m| m == dir) {
            return Ok(());
        }
        if is_mount_point(dir)? {
            tracing::info!(workspace = %dir.display(), "workspace file system already mounted (left by an earlier run); using it as it is");
            settled.mounted.push(dir.to_path_buf());
            return Ok(());
        }
        let name = dir
            .file_name()
            .ok_or_else(|| unavailable(self.backend, "a workspace path has no name"))?;
        let mut file = name.to_owned();
        file.push(".img");
        let image = self.images.join(file);
        let fresh = !image.exists();
        if fresh {
            if std::fs::read_dir(dir)
                .map_err(io_err("cannot read the workspace", dir))?
                .next()
                .is_some()
            {
                tracing::warn!(workspace = %dir.display(), "this workspace predates workspace quotas and is not empty: kept as a plain directory WITHOUT a quota; move its content out and back in after a restart to put it under the quota");
                settled.plain.insert(dir.to_path_buf());
                return Ok(());
            }
            self.create_image(&image, quota, owner)?;
        } else {
            self.resize_image(&image, quota)?;
        }
        let image_str = image.as_os_str().to_owned();
        run(helper("mount")
            .args([
                "-t",
                "ext4",
                "-o",
                "loop,nosuid,nodev,noatime,noinit_itable",
            ])
            .arg(&image_str)
            .arg(dir))
        .map_err(|e| {
            unavailable_by(
                self.backend,
                format!("cannot mount the workspace {}: {e}", dir.display()),
                e,
            )
        })?;
        settled.mounted.push(dir.to_path_buf());
        if fresh {
            // mkfs's lost+found is root's, not the user's; e2fsck makes it again if needed.
            let _ = std::fs::remove_dir(dir.join("lost+found"));
        }
        tracing::info!(workspace = %dir.display(), quota_bytes = quota, fresh, elapsed_ms = started.elapsed().as_millis() as u64, "workspace file system mounted");
        Ok(())
    }

    /// A sparse image of `quota` bytes with an empty ext4 file system, its root owned by
    /// `owner`; removed again if anything fails.
    fn create_image(
        &self,
        image: &Path,
        quota: u64,
        owner: (u32, u32),
    ) -> Result<(), SandboxError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.images)
            .map_err(io_err(
                "cannot create the workspace images directory",
                &self.images,
            ))?;
        let made = (|| -> Result<(), ImageNotMade> {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(image)?;
            f.set_len(quota)?;
            drop(f);
            // -m 0: no blocks reserved for root (the kernel never is root). The image is a
            // new sparse file, which reads as zeros where nothing was written: zeroing its
            // inode tables and journal up front (33 MiB of a 1 GiB image, on the host's
            // disk for every workspace) would write what is already there. Lazy, and
            // mounted `noinit_itable` so no background thread writes them either: an image
            // takes about 0.7 MiB until its files do.
            run(helper("mkfs.ext4")
                .args(["-q", "-F", "-m", "0", "-E"])
                .arg(format!(
                    "root_owner={}:{},lazy_itable_init=1,lazy_journal_init=1",
                    owner.0, owner.1
                ))
                .arg(image))?;
            Ok(())
        })();
        made.map_err(|e| {
            let _ = std::fs::remove_file(image);
            unavailable_by(
                self.backend,
                format!(
                    "cannot create the workspace file system {} (is e2fsprogs installed?): {e}",
                    image.display()
                ),
                e,
            )
        })
    }

    /// Grows the image to `quota`, or shrinks it when what is used fits (else keeps it and
    /// logs why).
    fn resize_image(&self, image: &Path, quota: u64) -> Result<(), SandboxError> {
        let size = std::fs::metadata(image)
            .map_err(io_err("cannot inspect the workspace image", image))?
            .len();
        if size == quota {
            return Ok(());
        }
        // resize2fs wants a freshly checked file system; -p repairs only what is safe.
        // e2fsck refuses an image still in use (exit 8): a sandbox being set up at the
        // moment of the unmount holds a copy of the mount in its new namespace until it
        // pivots away from the host's root, so a refusal is tried again for a second.
        let mut check = helper("e2fsck").args(["-f", "-p"]).arg(image).output();
        for _ in 0..5 {
            match &check {
                Ok(out) if out.status.code() == Some(8) => {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    check = helper("e2fsck").args(["-f", "-p"]).arg(image).output();
                }
                _ => break,
            }
        }
        match check {
            // 0: clean, 1: errors corrected.
            Ok(out) if matches!(out.status.code(), Some(0 | 1)) => {}
            Ok(out) => {
                tracing::warn!(image = %image.display(), status = %out.status, stderr = %String::from_utf8_lossy(&out.stderr), "e2fsck found problems; the workspace keeps its old size");
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(image = %image.display(), error = %e, "cannot run e2fsck; the workspace keeps its old size");
                return Ok(());
            }
        }
        let kib = format!("{}K", quota / 1024);
        if quota > size {
            std::fs::OpenOptions::new()
                .write(true)
                .open(image)
                .and_then(|f| f.set_len(quota))
                .map_err(io_err("cannot grow the workspace image", image))?;
            if let Err(e) = run(helper("resize2fs").arg(image).arg(&kib)) {
                tracing::warn!(image = %image.display(), error = %e, "cannot grow the workspace file system; it keeps its old size");
            } else {
                tracing::info!(image = %image.display(), from = size, to = quota, "workspace quota grown");
            }
        } else if let Err(e) = run(helper("resize2fs").arg(image).arg(&kib)) {
            tracing::warn!(image = %image.display(), from = size, to = quota, error = %e, "cannot shrink the workspace below what it uses; it keeps its old size");
        } else {
            std::fs::OpenOptions::new()
                .write(true)
                .open(image)
                .and_then(|f| f.set_len(quota))
                .map_err(io_err("cannot shrink the workspace image", image))?;
            tracing::info!(image = %image.display(), from = size, to = quota, "workspace quota shrunk");
        }
        Ok(())
    }

    /// Leaves every workspace file system mounted for kernels that outlive the broker
    /// (`--keep-sessions`): the next run finds them mounted and uses them as they are
    /// (mounting an image a second time while a kernel still holds it would corrupt it).
    pub(crate) fn keep_mounted(&self) {
        let mut settled = lock(&self.settled);
        settled.mounted.clear();
        settled.plain.clear();
    }

    /// Unmounts the file system at `dir` (if this run mounted or found it) and deletes its
    /// image: what it held is gone. Blocking; nothing may use it any more. Root's part is
    /// `umount` of a mount point the broker made and the unlink of an image in its own
    /// directory: no path a kernel can write is followed.
    pub(crate) fn discard(&self, dir: &Path) -> Result<(), SandboxError> {
        let was_mounted = {
            let mut settled = lock(&self.settled);
            settled.plain.remove(dir);
            let before = settled.mounted.len();
            settled.mounted.retain(|m| m != dir);
            settled.mounted.len() != before
        };
        if was_mounted || (self.privileged && is_mount_point(dir).unwrap_or(false)) {
            if let Err(e) = run(helper("umount").arg(dir)) {
                // Still held (a process that would not die): detach it now; the image's
                // blocks are freed when the last holder goes.
                let lazy = run(helper("umount").arg("-l").arg(dir));
                tracing::warn!(dir = %dir.display(), error = %e, detached = lazy.is_ok(), "cannot unmount an own workspace");
            }
        }
        if let Some(name) = dir.file_name() {
            let mut file = name.to_owned();
            file.push(".img");
            let image = self.images.join(file);
            match std::fs::remove_file(&image) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("cannot delete a workspace image", &image)(e)),
            }
        }
        Ok(())
    }

    /// The image file of the workspace at `dir` (made or not), and the directory it is in.
    pub(crate) fn image_of(&self, dir: &Path) -> Option<(PathBuf, PathBuf)> {
        let mut file = dir.file_name()?.to_owned();
        file.push(".img");
        Some((self.images.join(file), self.images.clone()))
    }

    /// Unmounts the file system at `dir`, keeping its image (a paused kernel's workspace
    /// carried to another node: no host may hold it mounted meanwhile; its next use mounts
    /// it again). Fails, leaving it mounted, while anything holds it. Blocking.
    pub(crate) fn unmount(&self, dir: &Path) -> Result<(), SandboxError> {
        let mut settled = lock(&self.settled);
        if settled.plain.contains(dir) {
            return Err(unavailable(
                self.backend,
                "this workspace is a plain directory, not a file system image",
            ));
        }
        if is_mount_point(dir)? {
            run(helper("umount").arg(dir)).map_err(|e| {
                unavailable_by(
                    self.backend,
                    format!("cannot unmount the workspace {}: {e}", dir.display()),
                    e,
                )
            })?;
        }
        settled.mounted.retain(|m| m != dir);
        drop(settled);
        super::loop_release::wait_released(self.backend, dir, self.image_of(dir).map(|i| i.0))
    }

    /// The names (file stems) of the images in this set's images directory.
    pub(crate) fn image_names(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.images) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".img"))
                    .map(str::to_string)
            })
            .collect()
    }

    /// Unmounts every workspace file system this run mounted (after the kernels are gone).
    /// Blocking.
    pub(crate) fn unmount_all(&self) {
        let mounted = std::mem::take(&mut lock(&self.settled).mounted);
        for dir in mounted {
            if let Err(e) = run(helper("umount").arg(&dir)) {
                // Still in use (a kernel that would not die): detach it now, and the kernel
                // frees it when it goes.
                let lazy = run(helper("umount").arg("-l").arg(&dir));
                tracing::warn!(workspace = %dir.display(), error = %e, detached = lazy.is_ok(), "cannot unmount the workspace file system");
            }
        }
        lock(&self.settled).plain.clear();
    }
}

impl Drop for WorkspaceImages {
    /// A backend dropped without `shutdown` (a test, a failed start) still leaves no mounts.
    fn drop(&mut self) {
        if !self
            .settled
            .get_mut()
            .map_or(true, |s| s.mounted.is_empty())
        {
            self.unmount_all();
        }
    }
}

/// Whether `dir` is a mount point: on another device than its parent.
pub(super) fn is_mount_point(dir: &Path) -> Result<bool, SandboxError> {
    let parent = dir.parent().unwrap_or(dir);
    let own =
        std::fs::symlink_metadata(dir).map_err(io_err("cannot inspect the workspace", dir))?;
    let up = std::fs::symlink_metadata(parent)
        .map_err(io_err("cannot inspect the workspaces directory", parent))?;
    Ok(own.dev() != up.dev())
}

/// Runs a short system command; its stderr in the error.
/// A root helper (mount, mkfs, e2fsck, resize2fs, umount) with fixed inputs: no variable
/// of the broker's environment (nothing a tenant could have placed there either), `/` as its
/// working directory, and arguments the broker built from validated names
/// (docs/SECURITY.md, "Privileged helpers").
fn helper(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("LC_ALL", "C")
        .current_dir("/");
    cmd
}

/// Why a root helper did not do its job.
#[derive(Debug, thiserror::Error)]
enum HelperFailed {
    #[error("cannot run {program:?}: {source}")]
    NotRun {
        program: std::ffi::OsString,
        #[source]
        source: std::io::Error,
    },
    #[error("{program:?} failed ({status}): {stderr}")]
    Exited {
        program: std::ffi::OsString,
        status: std::process::ExitStatus,
        stderr: String,
    },
}

/// Why a workspace image could not be made: its file, or `mkfs.ext4` on it.
#[derive(Debug, thiserror::Error)]
enum ImageNotMade {
    #[error(transparent)]
    File(#[from] std::io::Error),
    #[error(transparent)]
    Mkfs(#[from] HelperFailed),
}

fn run(cmd: &mut Command) -> Result<(), HelperFailed> {
    let out = cmd.output().map_err(|source| HelperFailed::NotRun {
        program: cmd.get_program().to_owned(),
        source,
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HelperFailed::Exited {
            program: cmd.get_program().to_owned(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

impl std::fmt::Debug for WorkspaceImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkspaceImages")
            .field("images", &self.images)
            .field("privileged", &self.privileged)
            .finish_non_exhaustive()
    }
}

/// Who owns a workspace, and so which mode it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WorkspaceOwner {
    /// The broker (kernels run as the broker's uid): 0700, ownership left alone.
    Broker,
    /// The kernel's uid and gid: given to them (recursively, when the top directory's owner
    /// is wrong), 0700. Needs root.
    Kernel { uid: u32, gid: u32 },
    /// Meant for the kernel's uid and gid, but the broker cannot chown: 0700 if they own it
    /// already, else 0777 (the broker's 0700 parent keeps other host users out).
    KernelUnchowned { uid: u32, gid: u32 },
}

/// Creates the workspace (0700; parents 0700 too), mounts its file system when `quota`
/// gives one (see [`WorkspaceImages`]), and settles the owner and mode of its (mounted) root
/// as `owner` says. Ownership is fixed recursively only when the top directory's owner is
/// wrong (say, the local backend's uid_base or the user's index changed), never following
/// symlinks the kernel may have planted.
pub(crate) fn prepare_workspace(
    dir: &Path,
    owner: WorkspaceOwner,
    quota: Option<(&WorkspaceImages, u64)>,
) -> Result<(), SandboxError> {
    let err = |what: &'static str| io_err(what, dir);
    if let Some(parent) = dir.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(err("cannot create the workspaces directory"))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err("cannot create the workspace")(e)),
    }
    if let Some((images, bytes)) = quota {
        let root_owner = match owner {
            WorkspaceOwner::Kernel { uid, gid } => (uid, gid),
            WorkspaceOwner::Broker | WorkspaceOwner::KernelUnchowned { .. } => current_ids(),
        };
        images.ensure(dir, bytes, root_owner)?;
    }
    let meta = std::fs::symlink_metadata(dir).map_err(err("cannot inspect the workspace"))?;
    if !meta.is_dir() {
        return Err(err("the workspace is not a directory")(io::Error::from(
            io::ErrorKind::InvalidInput,
        )));
    }
    let owned_by = |uid: u32, gid: u32| meta.uid() == uid && meta.gid() == gid;
    let mode = match owner {
        WorkspaceOwner::Broker => 0o700,
        WorkspaceOwner::Kernel { uid, gid } => {
            if !owned_by(uid, gid) {
                tracing::info!(workspace = %dir.display(), uid, gid, "giving the workspace to the kernel uid");
                chown_tree(dir, uid, gid).map_err(err("cannot chown the workspace"))?;
            }
            0o700
        }
        WorkspaceOwner::KernelUnchowned { uid, gid } if owned_by(uid, gid) => 0o700,
        WorkspaceOwner::KernelUnchowned { .. } => 0o777,
    };
    if meta.mode() & 0o7777 != mode {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(err("cannot set the workspace's permissions"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size_of(dir: &Path) -> u64 {
        let st = rustix::fs::statvfs(dir).unwrap();
        st.f_blocks * st.f_frsize
    }

    /// Needs root (mount); skipped otherwise.
    #[test]
    fn images_grow_and_shrink_only_down_to_what_is_used() {
        if super::super::fsutil::current_ids().0 != 0 {
            eprintln!("skipping: needs root to mount");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let workspaces = tmp.path().join("workspaces");
        let ws = workspaces.join("erin");
        std::fs::create_dir_all(&ws).unwrap();
        let images = WorkspaceImages::new("local", &workspaces, true);
        images.ensure(&ws, 32 << 20, (4242, 4242)).unwrap();
        let small = size_of(&ws);
        assert!(small <= 32 << 20 && small > 16 << 20, "{small}");
        assert_eq!(std::fs::metadata(&ws).unwrap().uid(), 4242);
        assert!(!ws.join("lost+found").exists());
        std::fs::write(ws.join("kept"), vec![1u8; 20 << 20]).unwrap();
        images.unmount_all();
        assert!(!ws.join("kept").exists());

        // Grown at the next mount, content kept.
        images.ensure(&ws, 64 << 20, (4242, 4242)).unwrap();
        let grown = size_of(&ws);
        assert!(grown > 48 << 20, "{grown}");
        assert_eq!(std::fs::metadata(ws.join("kept")).unwrap().len(), 20 << 20);
        images.unmount_all();

        // Not shrunk below what is used: it keeps its size.
        images.ensure(&ws, 16 << 20, (4242, 4242)).unwrap();
        assert_eq!(size_of(&ws), grown);
        assert_eq!(std::fs::metadata(ws.join("kept")).unwrap().len(), 20 << 20);
        drop(images);
        assert!(!is_mount_point(&ws).unwrap(), "dropping unmounts");
    }

    /// A new image costs the host's disk next to nothing until files are written (it is
    /// sparse, and its inode tables and journal are not zeroed): what lets a thousand
    /// sessions with workspaces of their own fit. Needs root (mount); skipped otherwise.
    #[test]
    fn a_new_image_takes_under_a_mebibyte_of_the_hosts_disk() {
        use std::os::unix::fs::MetadataExt;
        if super::super::fsutil::current_ids().0 != 0 {
            eprintln!("skipping: needs root to mount");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let workspaces = tmp.path().join("workspaces");
        let ws = workspaces.join("erin");
        std::fs::create_dir_all(&ws).unwrap();
        let images = WorkspaceImages::new("local", &workspaces, true);
        images.ensure(&ws, 1 << 30, (4242, 4242)).unwrap();
        std::fs::write(ws.join("a"), b"a few bytes").unwrap();
        images.unmount_all();
        let image = std::fs::read_dir(tmp.path().join("workspaces-images"))
            .unwrap()
            .flatten()
            .next()
            .unwrap()
            .path();
        let meta = std::fs::metadata(&image).unwrap();
        assert_eq!(meta.len(), 1 << 30);
        let on_disk = meta.blocks() * 512;
        assert!(on_disk < 1 << 20, "{on_disk} bytes on the host's disk");
        // And it mounts again with its file.
        images.ensure(&ws, 1 << 30, (4242, 4242)).unwrap();
        assert_eq!(std::fs::read(ws.join("a")).unwrap(), b"a few bytes");
    }
}
