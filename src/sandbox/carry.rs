//! A paused kernel carried to storage every node of a cluster reaches (`--carry-paused`,
//! issue 37): what a sandbox hands out of a paused kernel, and how another node's sandbox
//! takes it in. What carries the bytes (the cluster's database) is not the sandbox's
//! business: it reads the [`CarriedFile`]s and writes into an [`Intake`].
//!
//! A paused kernel is carried whole or not at all: its sealed images, and the file system
//! image of its own workspace, unmounted first (an ext4 image mounted by two hosts at once
//! is ruined; unmounted, no host holds it until a resume mounts it again, on the node that
//! holds the session then). A kernel sharing its user's workspace is not carried: its files
//! are in the workspace its user has on that node.
//!
//! The intake side writes only into directories of the broker's that no kernel can enter
//! (beneath a root-only one), creating every file anew (`O_EXCL`, `O_NOFOLLOW`); its images
//! are sealed as a dump's are and checked against the record's inventory before anything
//! uses them, so a copy altered on its way restores nothing.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use rustix::fs::{Mode, OFlags};

use super::fork::ForkError;
use super::pause::PausedImage;
use super::SandboxUser;

/// The name a paused kernel's own workspace image travels under (not an image file's name:
/// CRIU's end in `.img`, and the record's is `broker.json`).
pub const WORKSPACE: &str = "workspace";

/// The name an own workspace without a file system image of its own (a plain directory:
/// no quota) travels under: an archive of its files, made and unpacked by `tar` with the
/// kernel's rights only.
pub const WORKSPACE_ARCHIVE: &str = "workspace.tar";

/// One file of a paused kernel, open for reading: an image file by its name, or its
/// workspace's file system image ([`WORKSPACE`]) or archive ([`WORKSPACE_ARCHIVE`]).
#[derive(Debug)]
pub struct CarriedFile {
    pub name: String,
    pub file: File,
    /// Its length.
    pub len: u64,
    /// Where its data is (offset, length), holes left out: a workspace image is sparse.
    pub extents: Vec<(u64, u64)>,
}

/// What a sandbox hands out of a paused kernel.
#[derive(Debug)]
pub struct Carried {
    /// The uid its kernel ran as: the node that takes it in must run its user's kernels as
    /// the same (CRIU restores a process's credentials as they were).
    pub uid: u32,
    pub files: Vec<CarriedFile>,
}

/// A sandbox whose paused kernels can be carried to another node and taken in there.
#[async_trait::async_trait]
pub trait SandboxCarry: Send + Sync {
    /// The files of `image` (a paused kernel of `user`'s), its own workspace unmounted; or
    /// why it cannot be carried (it shares its user's workspace, its workspace is in use).
    async fn carry_out(
        &self,
        image: &PausedImage,
        user: &SandboxUser,
    ) -> Result<Carried, ForkError>;
    /// Makes room for the paused kernel `image` of `user` carried from a node where its
    /// kernel ran as `uid`: empty files, in this node's paused kernels' directory and its
    /// own workspaces', for [`Intake::write`]. Refused when this node would run `user`'s
    /// kernels as another uid.
    async fn take_in(
        &self,
        image: PausedImage,
        user: &SandboxUser,
        uid: u32,
    ) -> Result<Intake, ForkError>;
}

/// A paused kernel being taken in: its files, each written where the copy says, then
/// [`Intake::finish`]ed (sealed, checked, recorded) or [`Intake::abandon`]ed.
#[derive(Debug)]
pub struct Intake {
    pub(crate) image: PausedImage,
    /// The images' directory, open.
    pub(crate) dir: OwnedFd,
    pub(crate) files: BTreeMap<String, File>,
    pub(crate) workspace: TakenWorkspace,
}

/// The own workspace of a paused kernel being taken in, as this node keeps its users' own
/// workspaces.
#[derive(Debug)]
pub(crate) enum TakenWorkspace {
    /// A file system image (a quota): written in place at `path`.
    Image { path: PathBuf, file: File },
    /// A plain directory (`root`, made empty): its files come as an archive, written into
    /// `file` (unlinked), which `unpack` (a program and its arguments, the archive on its
    /// standard input: `tar` with the kernel's rights only) puts in place.
    Archive {
        root: PathBuf,
        file: File,
        unpack: (PathBuf, Vec<OsString>),
    },
}

impl TakenWorkspace {
    fn name(&self) -> &'static str {
        match self {
            TakenWorkspace::Image { .. } => WORKSPACE,
            TakenWorkspace::Archive { .. } => WORKSPACE_ARCHIVE,
        }
    }

    fn file(&self) -> &File {
        match self {
            TakenWorkspace::Image { file, .. } | TakenWorkspace::Archive { file, .. } => file,
        }
    }
}

impl Intake {
    /// The files the copy must bring, with their lengths: the record's images and the
    /// workspace's image.
    pub fn expected(&self) -> Vec<String> {
        let mut names: Vec<String> = self.files.keys().cloned().collect();
        names.push(self.workspace.name().to_string());
        names
    }

    /// Why a copy bringing `names` does not fit this intake, when only its workspace's form
    /// differs (nodes keeping own workspaces differently); `None` otherwise.
    pub fn workspace_mismatch(&self, names: &[String]) -> Option<String> {
        let theirs = [WORKSPACE, WORKSPACE_ARCHIVE]
            .into_iter()
            .find(|w| names.iter().any(|n| n == w))?;
        let form = |w: &str| {
            if w == WORKSPACE {
                "file system images (a workspace quota)"
            } else {
                "plain directories (no workspace quota)"
            }
        };
        (theirs != self.workspace.name()).then(|| {
            format!(
                "the node that paused it keeps own workspaces as {}, and this node as {}: give \
                 every node the same --workspace-quota",
                form(theirs),
                form(self.workspace.name())
            )
        })
    }

    fn target(&self, name: &str) -> io::Result<&File> {
        if name == self.workspace.name() {
            return Ok(self.workspace.file());
        }
        self.files.get(name).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the copy brings {name:?}, which its record does not list"),
            )
        })
    }

    /// Sets the length of file `name` (its holes stay holes). Blocking.
    pub fn set_len(&self, name: &str, len: u64) -> io::Result<()> {
        self.target(name)?.set_len(len)
    }

    /// Writes `data` at `at` in file `name`. Blocking.
    pub fn write(&self, name: &str, at: u64, data: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self.target(name)?, data, at)
    }

    /// Everything is written: a workspace that came as an archive is unpacked into its
    /// directories (by `tar`, with the kernel's rights only), for at most a copy step's
    /// time. Nothing to do for a file system image. On error [`Intake::abandon`] it.
    pub async fn unpack(&self) -> Result<(), ForkError> {
        let TakenWorkspace::Archive { file, unpack, .. } = &self.workspace else {
            return Ok(());
        };
        let failed = |e: io::Error| {
            super::criu::copy_failed(format!("the carried workspace's archive: {e}"))
        };
        let mut archive = file.try_clone().map_err(failed)?;
        io::Seek::rewind(&mut archive).map_err(failed)?;
        super::criu::run_workspace_tool(
            &unpack.0,
            &unpack.1,
            archive.into(),
            std::process::Stdio::null(),
            "unpacked",
        )
        .await
    }

    /// Everything is written and unpacked: the files synced, the images sealed as a dump's
    /// are and checked against the record's inventory, the record written beside them. The
    /// paused kernel, as this node keeps it. Blocking; on error [`Intake::abandon`] it.
    pub fn finish(&self) -> Result<PausedImage, ForkError> {
        let failed = |what: &str| {
            let what = what.to_string();
            move |e: io::Error| super::criu::copy_failed(format!("{what}: {e}"))
        };
        for file in self.files.values() {
            file.sync_all()
                .map_err(failed("cannot sync a carried file"))?;
        }
        match &self.workspace {
            TakenWorkspace::Image { file, .. } => file
                .sync_all()
                .map_err(failed("cannot sync a carried workspace"))?,
            TakenWorkspace::Archive { root, .. } => {
                let dir =
                    super::fsutil::open_tree_root(root).map_err(failed("the carried workspace"))?;
                rustix::fs::syncfs(&dir)
                    .map_err(|e| failed("cannot sync a carried workspace")(e.into()))?;
            }
        }
        let dir = self.dir.try_clone().map_err(failed("the images"))?;
        super::criu::seal(dir).map_err(failed("cannot seal the carried images"))?;
        super::pause::check_inventory(&self.dir, &self.image.files)
            .map_err(|e| super::criu::copy_failed(format!("the carried images: {e}")))?;
        super::pause::write_record(&self.dir, &self.image)
            .map_err(failed("cannot write the carried images' record"))?;
        Ok(self.image.clone())
    }

    /// Removes what was taken in. Blocking.
    pub fn abandon(self) {
        let Intake {
            image, workspace, ..
        } = self;
        if let Err(e) = std::fs::remove_dir_all(&image.dir) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(dir = %image.dir.display(), error = %e, "cannot remove a carried paused kernel's images");
            }
        }
        // A directory `tar` wrote into with the kernel's rights: `remove_dir_all` never
        // follows a symlink in it.
        let removed = match &workspace {
            TakenWorkspace::Image { path, .. } => (path, std::fs::remove_file(path)),
            TakenWorkspace::Archive { root, .. } => (root, std::fs::remove_dir_all(root)),
        };
        if let (path, Err(e)) = removed {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a carried workspace");
            }
        }
    }
}

/// A file `name` created anew in the broker's directory `dir` (0644 for an image, which
/// sealing gives root; 0600 for a workspace image). Blocking.
pub(crate) fn create_in(dir: &OwnedFd, name: &str, mode: u32) -> io::Result<File> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{name:?} is not a file name"),
        ));
    }
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    )?;
    Ok(File::from(fd))
}

/// `file` (`len` bytes) as a carried file `name`: where its data is, by `SEEK_DATA` and
/// `SEEK_HOLE`. Blocking.
pub(crate) fn carried(name: String, file: File, len: u64) -> io::Result<CarriedFile> {
    use rustix::fs::SeekFrom;
    let mut extents = Vec::new();
    let mut at = 0u64;
    while at < len {
        let start = match rustix::fs::seek(&file, SeekFrom::Data(at)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        if start >= len {
            break;
        }
        let end = rustix::fs::seek(&file, SeekFrom::Hole(start))?.min(len);
        extents.push((start, end - start));
        at = end;
    }
    Ok(CarriedFile {
        name,
        file,
        len,
        extents,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_files_extents_leave_its_holes_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let file = File::create(&path).unwrap();
        let len = 64u64 << 20;
        file.set_len(len).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &[7u8; 4096], 8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &[9u8; 4096], 40 << 20).unwrap();
        file.sync_all().unwrap();
        let c = carried("w".into(), File::open(&path).unwrap(), len).unwrap();
        let data: u64 = c.extents.iter().map(|e| e.1).sum();
        assert!((8192..4 << 20).contains(&data), "{:?}", c.extents);
        assert!(c
            .extents
            .iter()
            .any(|e| e.0 <= 8 << 20 && e.0 + e.1 > 8 << 20));
        assert!(c
            .extents
            .iter()
            .any(|e| e.0 <= 40 << 20 && e.0 + e.1 > 40 << 20));
    }

    #[test]
    fn files_are_created_anew_by_plain_names_only() {
        let dir = tempfile::tempdir().unwrap();
        let fd = crate::sandbox::fsutil::open_tree_root(dir.path()).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("planted")).unwrap();
        assert!(
            create_in(&fd, "planted", 0o600).is_err(),
            "a symlink is never followed"
        );
        for bad in ["", ".", "..", "../x", "a/b"] {
            assert!(create_in(&fd, bad, 0o600).is_err(), "{bad:?}");
        }
        create_in(&fd, "core-1.img", 0o644).unwrap();
        assert!(
            create_in(&fd, "core-1.img", 0o644).is_err(),
            "never one that exists"
        );
    }
}
