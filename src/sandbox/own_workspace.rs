//! A session's own workspace (`"workspace": "own"`; every E2B sandbox): E2B's sandbox shape,
//! a home of its own that no other session sees, and a `/tmp` its kernels and commands
//! share, both gone when the session ends.
//!
//! On the host it is `<data_dir>/sandboxes/<key>` (the key is the owning session's id; an
//! E2B sandbox's contexts and commands use their sandbox's), holding `home` (the kernel's
//! uid, 0700: `/home/user` and `/workspace` inside) and `tmp` (1777: `/tmp` inside). As
//! root, `<key>` is the mount point of an ext4 image of its own
//! (`<data_dir>/sandboxes-images/<key>.img`, sparse, [`WorkspaceImages`]) of the user's
//! `workspace_quota_bytes`: home and `/tmp` together cannot grow past it. Without root (or
//! with a quota of 0) it is a plain directory, with no quota, as the shared workspace is.
//!
//! Every directory on the way to `home` and `tmp` is root's (`<key>` is the file system's
//! root, owned by root, 0755), so root's paths there follow nothing a kernel chose: a
//! kernel sees `home` and `tmp` only as the roots of its mounts, which it cannot rename or
//! replace. Removal is `umount` and the unlink of the image; what is left (a plain
//! directory, or an emptied mount point) goes with `std::fs::remove_dir_all`, which opens
//! each directory with `O_NOFOLLOW` and unlinks symlinks as themselves, never following
//! one (docs/SECURITY.md, "Root file operations").

use std::collections::HashSet;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use uuid::Uuid;

use super::fsutil::{self, current_ids, io_err};
use super::workspace_fs::WorkspaceImages;
use super::SandboxError;

/// The home (and working directory) of an own workspace's kernels, as E2B's sandboxes have.
pub const HOME_INSIDE: &str = "/home/user";
/// The login name of an own workspace's kernels (E2B's sandbox user).
pub const LOGIN: &str = "user";

/// The host directories of one own workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnDirs {
    /// `<data_dir>/sandboxes/<key>`: root's (the mount point of its file system).
    pub root: PathBuf,
    /// The kernels' home: `/home/user` and `/workspace` inside.
    pub home: PathBuf,
    /// The sandbox's `/tmp`, shared by its kernels and commands.
    pub tmp: PathBuf,
}

/// The own workspaces of one backend.
#[derive(Debug)]
pub(crate) struct OwnWorkspaces {
    /// `<data_dir>/sandboxes`.
    dir: PathBuf,
    images: WorkspaceImages,
}

impl OwnWorkspaces {
    pub(crate) fn new(backend: &'static str, data_dir: &Path, privileged: bool) -> Self {
        Self::in_dir(backend, data_dir.join("sandboxes"), privileged)
    }

    /// The own workspaces kept in `dir` (the Docker backend's `<data_dir>/sandboxes-docker`).
    pub(crate) fn in_dir(backend: &'static str, dir: PathBuf, privileged: bool) -> Self {
        Self {
            images: WorkspaceImages::new(backend, &dir, privileged),
            dir,
        }
    }

    /// Where the own workspace `key` is (made or not).
    pub(crate) fn dirs(&self, key: Uuid) -> OwnDirs {
        let root = self.dir.join(key.to_string());
        OwnDirs {
            home: root.join("home"),
            tmp: root.join("tmp"),
            root,
        }
    }

    /// Makes the own workspace `key` ready: its file system of `quota` bytes (0: a plain
    /// directory) mounted, `home` given to `ids` (the kernel's uid and gid; `None`: the
    /// broker's), `tmp` world-writable and sticky. An existing one is used as it is (a
    /// context of a sandbox, a restart, a session kept across a broker restart). Blocking.
    pub(crate) fn prepare(
        &self,
        key: Uuid,
        quota: u64,
        ids: Option<(u32, u32)>,
    ) -> Result<OwnDirs, SandboxError> {
        let dirs = self.dirs(key);
        fsutil::create_private_dir(&self.dir, Some(0o711))?;
        match std::fs::DirBuilder::new().create(&dirs.root) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("cannot create an own workspace", &dirs.root)(e)),
        }
        self.images.ensure(&dirs.root, quota, current_ids())?;
        let root = fsutil::open_tree_root(&dirs.root)
            .map_err(io_err("cannot open an own workspace", &dirs.root))?;
        rustix::fs::fchmod(&root, rustix::fs::Mode::from_raw_mode(0o755))
            .map_err(|e| io_err("cannot set an own workspace's mode", &dirs.root)(e.into()))?;
        for (name, mode, owner) in [("home", 0o700, ids), ("tmp", 0o1777, ids)] {
            let cname = std::ffi::CString::new(name).map_err(|e| {
                io_err("a directory name", &dirs.root)(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    e,
                ))
            })?;
            match fsutil::open_subdir(root.as_fd(), &cname) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fsutil::make_dir_at(root.as_fd(), Path::new(name), mode, owner).map_err(
                        io_err("cannot create an own workspace", &dirs.root.join(name)),
                    )?;
                }
                Err(e) => {
                    return Err(io_err(
                        "an own workspace's directory is not one",
                        &dirs.root.join(name),
                    )(e))
                }
            }
        }
        Ok(dirs)
    }

    /// Removes the own workspace `key` with all in it. Blocking; a missing one is fine.
    pub(crate) fn remove(&self, key: Uuid) -> Result<(), SandboxError> {
        let dirs = self.dirs(key);
        self.images.discard(&dirs.root)?;
        match std::fs::remove_dir_all(&dirs.root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("cannot remove an own workspace", &dirs.root)(e)),
        }
    }

    /// Removes the own workspaces an earlier run left whose key is not in `keep` (the
    /// sessions kept with `--keep-sessions`); returns how many. Blocking.
    pub(crate) fn sweep(&self, keep: &HashSet<Uuid>) -> usize {
        let mut keys: HashSet<Uuid> = self
            .images
            .image_names()
            .iter()
            .filter_map(|n| Uuid::parse_str(n).ok())
            .collect();
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            keys.extend(
                entries
                    .filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str().and_then(|n| Uuid::parse_str(n).ok())),
            );
        }
        let mut removed = 0;
        for key in keys.into_iter().filter(|k| !keep.contains(k)) {
            match self.remove(key) {
                Ok(()) => removed += 1,
                Err(e) => {
                    tracing::warn!(%key, error = %e, "cannot remove an own workspace left by an earlier run")
                }
            }
        }
        removed
    }

    /// Start-up: [`Self::sweep`] in a blocking task, logging how many were removed.
    pub(crate) async fn sweep_at_startup(self: &Arc<Self>, keep: HashSet<Uuid>) {
        let own = Arc::clone(self);
        let swept = tokio::task::spawn_blocking(move || own.sweep(&keep))
            .await
            .unwrap_or(0);
        if swept > 0 {
            tracing::info!(
                count = swept,
                "removed own workspaces left by an earlier run"
            );
        }
    }

    /// The own workspace `key`'s file system image (made or not) and its directory.
    pub(crate) fn image_of(&self, key: Uuid) -> Option<(PathBuf, PathBuf)> {
        self.images.image_of(&self.dirs(key).root)
    }

    /// Unmounts the own workspace `key`, keeping its image (`WorkspaceImages::unmount`).
    /// Blocking.
    pub(crate) fn unmount(&self, key: Uuid) -> Result<(), SandboxError> {
        self.images.unmount(&self.dirs(key).root)
    }

    /// Leaves the mounted ones mounted (`--keep-sessions`: their sessions are kept).
    pub(crate) fn keep_mounted(&self) {
        self.images.keep_mounted();
    }

    /// Unmounts what this run mounted (broker shutdown, sessions not kept: they ended and
    /// removed theirs already). Blocking.
    pub(crate) fn unmount_all(&self) {
        self.images.unmount_all();
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    #[test]
    fn an_own_workspace_is_made_then_removed_without_following_a_planted_symlink() {
        let data = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("precious"), b"x").unwrap();
        let root = current_ids().0 == 0;
        let own = OwnWorkspaces::new("local", data.path(), root);
        let key = Uuid::new_v4();
        let ids = root.then_some((4242, 4242));
        let quota = if root { 32 << 20 } else { 0 };
        let dirs = own.prepare(key, quota, ids).unwrap();
        assert_eq!(dirs, own.dirs(key));
        let tmp_mode = std::fs::metadata(&dirs.tmp).unwrap().permissions().mode();
        assert_eq!(tmp_mode & 0o7777, 0o1777);
        if root {
            assert_eq!(std::fs::metadata(&dirs.home).unwrap().uid(), 4242);
            assert_eq!(std::fs::metadata(&dirs.root).unwrap().uid(), 0);
        }
        // Made again (a context, a restart): kept as it is.
        std::fs::write(dirs.home.join("kept"), b"1").unwrap();
        own.prepare(key, quota, ids).unwrap();
        assert!(dirs.home.join("kept").exists());
        // A kernel plants symlinks to a host directory and a host file.
        std::os::unix::fs::symlink(outside.path(), dirs.home.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("precious"), dirs.tmp.join("f")).unwrap();
        own.remove(key).unwrap();
        assert!(!dirs.root.exists());
        assert!(outside.path().join("precious").exists());
        assert!(!data
            .path()
            .join("sandboxes-images")
            .join(format!("{key}.img"))
            .exists());
        // Removing it again is fine.
        own.remove(key).unwrap();
    }

    #[test]
    fn the_sweep_spares_kept_sessions() {
        let data = tempfile::tempdir().unwrap();
        let own = OwnWorkspaces::new("local", data.path(), false);
        let (kept, stale) = (Uuid::new_v4(), Uuid::new_v4());
        own.prepare(kept, 0, None).unwrap();
        own.prepare(stale, 0, None).unwrap();
        std::fs::create_dir(data.path().join("sandboxes/not-a-session")).unwrap();
        assert_eq!(own.sweep(&HashSet::from([kept])), 1);
        assert!(own.dirs(kept).home.exists());
        assert!(!own.dirs(stale).root.exists());
        assert!(data.path().join("sandboxes/not-a-session").exists());
    }
}
