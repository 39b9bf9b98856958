//! Carrying a paused kernel to another node and taking one in, on the local sandbox
//! (`sandbox/carry.rs`). Out: the sealed images of `<data_dir>/paused/<kernel id>` and the
//! own workspace's image `<data_dir>/sandboxes-images/<key>.img`, unmounted, each opened
//! without following a symlink (both directories are root's and no kernel enters them).
//! In: the same two places on this node, every file created anew.
//!
//! An own workspace without a file system image (no quota: a plain directory, as in the
//! container deployments, which cannot attach loop devices) travels as an archive of its
//! `home` and `tmp`: made by `tar` as the kernel's uid with no capabilities, in namespaces
//! showing it only those two directories (read-only) and `/usr`, into an unlinked file of
//! the broker's; unpacked on the taking node the same way into the session's new
//! directories (writable, nothing else), only the members `home` and `tmp`. Whatever the
//! archive holds, it is written with the kernel's rights where its kernel could write.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use rustix::fs::{Mode, OFlags};
use uuid::Uuid;

use super::bwrap::{workspace_tool_args, HostRoot};
use super::LocalSandbox;
use crate::sandbox::carry::{
    carried, create_in, Carried, CarriedFile, Intake, SandboxCarry, TakenWorkspace,
    WORKSPACE_ARCHIVE,
};
use crate::sandbox::criu::{copy_failed, run_workspace_tool};
use crate::sandbox::fork::ForkError;
use crate::sandbox::fsutil;
use crate::sandbox::own_workspace::OwnDirs;
use crate::sandbox::pause::{make_images_dir, PausedImage};
use crate::sandbox::SandboxUser;

/// Where a carried workspace's `home` and `tmp` are inside the sandbox of the `tar` that
/// packs or unpacks them.
const ARCHIVE_ROOT: &str = "/carry";

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
        let ids = self.copy_ids(user)?;
        let uid = ids.0;
        let own = self.own_workspaces.clone();
        let image = image.clone();
        let paused = image.dir.parent().map(Path::to_path_buf);
        let mut carried_out = tokio::task::spawn_blocking(move || -> Result<Carried, ForkError> {
            let (workspace, _) = own
                .image_of(key)
                .ok_or_else(|| copy_failed("its workspace has no image path"))?;
            own.unmount(key).map_err(|e| {
                ForkError::Unsupported(format!(
                    "its workspace cannot be let go (another kernel or command of its sandbox \
                     may still use it): {e}"
                ))
            })?;
            // No image: a plain directory (no quota), packed below.
            let opened = match open_nofollow(&workspace) {
                Ok(f) => Some(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(copy_failed(format!("its workspace's image: {e}"))),
            };
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
            if let Some(opened) = opened {
                let len = regular_len(&opened)?;
                files.push(
                    carried(crate::sandbox::carry::WORKSPACE.into(), opened, len)
                        .map_err(io_failed)?,
                );
            }
            Ok(Carried { uid, files })
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))??;
        let has_image = carried_out
            .files
            .iter()
            .any(|f| f.name == crate::sandbox::carry::WORKSPACE);
        if !has_image {
            let paused = paused.ok_or_else(|| copy_failed("its images have no directory"))?;
            carried_out
                .files
                .push(self.pack_own(key, ids, paused).await?);
        }
        Ok(carried_out)
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
        let quota = user.limits.workspace_quota_bytes;
        let (opts, bwrap) = (self.bwrap_opts.clone(), self.bwrap.clone());
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
        let dir = make_images_dir(paused.clone(), name, (0, 0)).await?;
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
            if quota == 0 {
                // A plain directory, made empty, for the archive.
                let dirs = own.prepare(key, 0, Some(ids))?;
                let unpack = archive_args(&opts, &dirs, ids, false)?;
                return Ok(Intake {
                    image,
                    dir: fd,
                    files,
                    workspace: TakenWorkspace::Archive {
                        root: dirs.root,
                        file: unlinked_in(&paused)?,
                        unpack: (bwrap, unpack),
                    },
                });
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
                workspace: TakenWorkspace::Image {
                    path,
                    file: workspace,
                },
            })
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))?
    }
}

impl LocalSandbox {
    /// The archive of own workspace `key`'s files (a plain directory), made by `tar` as the
    /// kernel's uid `ids` into an unlinked file in `paused` (the paused kernels' directory,
    /// root's), as a carried file.
    async fn pack_own(
        &self,
        key: Uuid,
        ids: (u32, u32),
        paused: PathBuf,
    ) -> Result<CarriedFile, ForkError> {
        let dirs = self.own_workspaces.dirs(key);
        let opts = self.bwrap_opts.clone();
        let (args, archive) = tokio::task::spawn_blocking(move || {
            Ok::<_, ForkError>((
                archive_args(&opts, &dirs, ids, true)?,
                unlinked_in(&paused)?,
            ))
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))??;
        let out = archive.try_clone().map_err(io_failed)?;
        run_workspace_tool(&self.bwrap, &args, Stdio::null(), out.into(), "packed").await?;
        tokio::task::spawn_blocking(move || {
            let len = archive.metadata().map_err(io_failed)?.len();
            carried(WORKSPACE_ARCHIVE.into(), archive, len).map_err(io_failed)
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))?
    }
}

/// bwrap's arguments for `tar` packing (`pack`: to its standard output, `dirs` read-only)
/// or unpacking (from its standard input, `dirs` writable) own workspace `dirs`' `home`
/// and `tmp`, as the kernel's uid `ids` with no capabilities. Blocking (probes the host).
fn archive_args(
    opts: &super::bwrap::BwrapOptions,
    dirs: &OwnDirs,
    ids: (u32, u32),
    pack: bool,
) -> Result<Vec<OsString>, ForkError> {
    let root = Path::new(ARCHIVE_ROOT);
    let binds = [
        (dirs.home.as_path(), root.join("home"), !pack),
        (dirs.tmp.as_path(), root.join("tmp"), !pack),
    ];
    let directory = format!("--directory={ARCHIVE_ROOT}");
    let command: Vec<&str> = if pack {
        let how = ["--create", "--file=-", "--numeric-owner", "--sparse"];
        ["/bin/tar"].into_iter().chain(how).collect()
    } else {
        // Only `home` and `tmp` are taken from it; `..` and absolute names are refused by
        // tar itself, and nothing else is writable here.
        let how = [
            "--extract",
            "--file=-",
            "--preserve-permissions",
            "--no-same-owner",
        ];
        ["/bin/tar"].into_iter().chain(how).collect()
    };
    let command: Vec<OsString> = command
        .into_iter()
        .chain([directory.as_str(), "home", "tmp"])
        .map(OsString::from)
        .collect();
    workspace_tool_args(opts, &HostRoot::probe(&[]), &binds, ids, &command)
        .ok_or_else(|| copy_failed("setpriv is missing"))
}

/// A new unlinked file (`O_TMPFILE`) in the broker's directory `dir`, for reading and
/// writing. Blocking.
fn unlinked_in(dir: &Path) -> Result<File, ForkError> {
    let fd = rustix::fs::open(
        dir,
        OFlags::RDWR | OFlags::TMPFILE | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| {
        copy_failed(format!(
            "cannot make a file for the workspace's archive: {e}"
        ))
    })?;
    Ok(File::from(fd))
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
