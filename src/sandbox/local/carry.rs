//! Carrying a paused kernel to another node and taking one in, on the local sandbox
//! (`sandbox/carry.rs`). Out: the sealed images of `<data_dir>/paused/<kernel id>` and the
//! own workspace's image `<data_dir>/sandboxes-images/<key>.img`, unmounted, each opened
//! without following a symlink (both directories are root's and no kernel enters them).
//! In: the same two places on this node, every file created anew.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use rustix::fs::{Mode, OFlags};

use super::LocalSandbox;
use crate::sandbox::carry::{carried, create_in, Carried, Intake, SandboxCarry};
use crate::sandbox::criu::copy_failed;
use crate::sandbox::fork::ForkError;
use crate::sandbox::fsutil;
use crate::sandbox::pause::{make_images_dir, PausedImage};
use crate::sandbox::SandboxUser;

/// Why a kernel that shares its user's workspace is not carried.
const SHARED: &str = "it shares its user's workspace, whose files are on this node: only a \
                      session with a workspace of its own is carried to other nodes";

#[async_trait::async_trait]
impl SandboxCarry for LocalSandbox {
    async fn carry_out(
        &self,
        image: &PausedImage,
        user: &SandboxUser,
    ) -> Result<Carried, ForkError> {
        let key = image
            .own_workspace
            .ok_or_else(|| ForkError::Unsupported(SHARED.into()))?;
        let (uid, _) = self.copy_ids(user)?;
        let own = self.own_workspaces.clone();
        let image = image.clone();
        tokio::task::spawn_blocking(move || -> Result<Carried, ForkError> {
            let (workspace, _) = own
                .image_of(key)
                .ok_or_else(|| copy_failed("its workspace has no image path"))?;
            own.unmount(key).map_err(|e| {
                ForkError::Unsupported(format!(
                    "its workspace cannot be let go (another kernel or command of its sandbox \
                     may still use it): {e}"
                ))
            })?;
            let opened = open_nofollow(&workspace).map_err(|e| {
                ForkError::Unsupported(format!(
                    "its workspace has no file system image ({e}): it is a plain directory, \
                     without a quota"
                ))
            })?;
            let dir = fsutil::open_tree_root(&image.dir)
                .map_err(|e| copy_failed(format!("its images cannot be opened: {e}")))?;
            let mut files = Vec::with_capacity(image.files.len() + 1);
            for sealed in &image.files {
                let fd = rustix::fs::openat(
                    &dir,
                    sealed.name.as_str(),
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| copy_failed(format!("image {:?}: {e}", sealed.name)))?;
                let file = File::from(fd);
                let len = regular_len(&file)?;
                if len != sealed.len {
                    return Err(copy_failed(format!(
                        "image {:?} is not as it was sealed",
                        sealed.name
                    )));
                }
                files.push(carried(sealed.name.clone(), file, len).map_err(io_failed)?);
            }
            let len = regular_len(&opened)?;
            files.push(
                carried(crate::sandbox::carry::WORKSPACE.into(), opened, len).map_err(io_failed)?,
            );
            Ok(Carried { uid, files })
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))?
    }

    async fn take_in(
        &self,
        mut image: PausedImage,
        user: &SandboxUser,
        uid: u32,
    ) -> Result<Intake, ForkError> {
        let ids = self.copy_ids(user)?;
        if ids.0 != uid {
            return Err(ForkError::Unsupported(format!(
                "its kernel ran as uid {uid} on the node that paused it, and {user}'s kernels run \
                 as uid {} here: give every node the same --uid-base and users file",
                ids.0,
                user = user.name
            )));
        }
        let key = image
            .own_workspace
            .ok_or_else(|| ForkError::Unsupported(SHARED.into()))?;
        let own = self.own_workspaces.clone();
        let paused = self.cfg.data_dir.join("paused");
        let name = image.kernel_id.to_string();
        // What an earlier intake of this kernel left (a node stopped halfway) goes first.
        let (stale, leftover) = (paused.join(&name), own.clone());
        tokio::task::spawn_blocking(move || {
            let _ = std::fs::remove_dir_all(&stale);
            leftover.remove(key)
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))?
        .map_err(ForkError::Sandbox)?;
        let dir = make_images_dir(paused, name, (0, 0)).await?;
        image.dir = dir.clone();
        tokio::task::spawn_blocking(move || -> Result<Intake, ForkError> {
            let fd = fsutil::open_tree_root(&dir)
                .map_err(|e| copy_failed(format!("the images' directory: {e}")))?;
            let mut files = BTreeMap::new();
            for f in &image.files {
                files.insert(
                    f.name.clone(),
                    create_in(&fd, &f.name, 0o644)
                        .map_err(|e| copy_failed(format!("image {:?}: {e}", f.name)))?,
                );
            }
            let (path, images) = own
                .image_of(key)
                .ok_or_else(|| copy_failed("its workspace has no image path"))?;
            fsutil::create_private_dir(&images, Some(0o700))?;
            let images_fd = fsutil::open_tree_root(&images)
                .map_err(|e| copy_failed(format!("the workspace images' directory: {e}")))?;
            let file_name = path
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| copy_failed("its workspace image has no name"))?;
            let workspace = create_in(&images_fd, file_name, 0o600)
                .map_err(|e| copy_failed(format!("its workspace image: {e}")))?;
            Ok(Intake {
                image,
                dir: fd,
                files,
                workspace: (path, workspace),
            })
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))?
    }
}

fn io_failed(e: std::io::Error) -> ForkError {
    copy_failed(e.to_string())
}

fn open_nofollow(path: &Path) -> std::io::Result<File> {
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    Ok(File::from(fd))
}

/// The length of `file`, a regular file with one link.
fn regular_len(file: &File) -> Result<u64, ForkError> {
    let st = rustix::fs::fstat(file).map_err(|e| copy_failed(e.to_string()))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_nlink != 1 {
        return Err(copy_failed(
            "a carried file is not a regular file of its own",
        ));
    }
    Ok(st.st_size as u64)
}
