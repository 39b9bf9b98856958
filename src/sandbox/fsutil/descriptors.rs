//! Descriptor-based file operations: what root may do inside a directory a kernel can
//! write (docs/SECURITY.md, "Root file operations"). Each walks or creates through open
//! directory descriptors with `O_NOFOLLOW` / `RESOLVE_BENEATH`, so a symlink or a swapped
//! directory planted by the kernel fails the operation instead of redirecting it.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::current_ids;

/// How deep [`chown_tree`] goes: one descriptor is open per level, so this also bounds the
/// descriptors a walk holds.
const CHOWN_MAX_DEPTH: usize = 256;

/// `chown -R` through directory descriptors: never follows a symlink, whatever the kernel
/// swaps in while it runs (see [`walk_tree`]). Symlinks and other entries are given away
/// themselves (`AT_SYMLINK_NOFOLLOW`), directories through the descriptor that was walked.
pub(crate) fn chown_tree(dir: &Path, uid: u32, gid: u32) -> io::Result<()> {
    use rustix::fs::{chownat, fchown, AtFlags, Gid, Uid};
    let (owner, group) = (Uid::from_raw(uid), Gid::from_raw(gid));
    let root = open_tree_root(dir)?;
    fchown(&root, Some(owner), Some(group))?;
    let limits = WalkLimits {
        max_entries: usize::MAX,
        max_depth: CHOWN_MAX_DEPTH,
    };
    let complete = walk_tree(&root, limits, |entry| {
        match entry.dir {
            Some(fd) => fchown(fd, Some(owner), Some(group))?,
            None => chownat(
                entry.parent,
                entry.name,
                Some(owner),
                Some(group),
                AtFlags::SYMLINK_NOFOLLOW,
            )?,
        }
        Ok(())
    })?;
    if !complete {
        tracing::warn!(dir = %dir.display(), max_depth = CHOWN_MAX_DEPTH, "workspace deeper than the chown walk goes; deeper entries keep their owner");
    }
    Ok(())
}

/// Opens the root of a tree the broker walks: a directory, not a symlink.
pub(crate) fn open_tree_root(path: &Path) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    Ok(rustix::fs::open(path, flags, Mode::empty())?)
}

/// Opens the directory `name` (one path component) of the open directory `parent`:
/// `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` with `O_DIRECTORY | O_NOFOLLOW`, so a
/// symlink swapped in for the directory fails (`ELOOP`) instead of being followed.
pub(crate) fn open_subdir(parent: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    Ok(rustix::fs::openat2(
        parent,
        name,
        flags,
        Mode::empty(),
        resolve,
    )?)
}

/// `openat2` beneath `root` with no symlinks anywhere on the way (`flags`: `O_*`, with
/// `O_CLOEXEC` added).
pub(crate) fn open_beneath(
    root: &OwnedFd,
    rel: &Path,
    flags: i32,
    mode: u32,
) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let flags = OFlags::from_bits_retain(flags as u32) | OFlags::CLOEXEC;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    Ok(rustix::fs::openat2(
        root,
        rel,
        flags,
        Mode::from_raw_mode(mode),
        resolve,
    )?)
}

/// Bounds of a [`walk_tree`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct WalkLimits {
    /// Entries (of any type) looked at before the walk stops.
    pub max_entries: usize,
    /// Directory levels below the root the walk descends; one descriptor is open per level.
    pub max_depth: usize,
}

/// One entry a [`walk_tree`] visits.
pub(crate) struct WalkEntry<'a> {
    /// Path relative to the root.
    pub rel: &'a Path,
    /// The directory holding the entry, as walked (not as named now).
    pub parent: BorrowedFd<'a>,
    /// The entry's name in `parent`.
    pub name: &'a CStr,
    /// `fstatat(parent, name, AT_SYMLINK_NOFOLLOW)`; for a directory, `fstat` of `dir`.
    pub stat: &'a rustix::fs::Stat,
    /// For a directory: the descriptor the walk opened and descends through.
    pub dir: Option<BorrowedFd<'a>>,
}

impl WalkEntry<'_> {
    /// Whether this is a regular file (not a symlink, fifo, socket or device).
    pub fn is_file(&self) -> bool {
        rustix::fs::FileType::from_raw_mode(self.stat.st_mode) == rustix::fs::FileType::RegularFile
    }
}

/// Walks the tree under the open directory `root` depth-first through directory
/// descriptors, calling `visit` for every entry (not the root itself).
///
/// The tree is written by a kernel that may be hostile and may swap entries while the walk
/// runs, so nothing here resolves a path: entries are read from the directory's own
/// descriptor (getdents), looked at with `fstatat(AT_SYMLINK_NOFOLLOW)` relative to it, and
/// a directory is entered only through [`open_subdir`] relative to its parent's descriptor.
/// A symlink swapped in for a directory makes that open fail and the entry is skipped;
/// symlinks and other special files are visited as themselves, never followed. An entry
/// that vanishes meanwhile is skipped.
///
/// Returns `Ok(true)` when the whole tree was walked, `Ok(false)` when `limits` cut it short.
pub(crate) fn walk_tree(
    root: &OwnedFd,
    limits: WalkLimits,
    mut visit: impl FnMut(&WalkEntry<'_>) -> io::Result<()>,
) -> io::Result<bool> {
    use rustix::fs::{fstat, statat, AtFlags, Dir, FileType};
    use rustix::io::Errno;
    let mut stack: Vec<(PathBuf, Dir)> = vec![(PathBuf::new(), Dir::read_from(root)?)];
    let mut seen = 0usize;
    let mut complete = true;
    loop {
        let depth = stack.len();
        let Some((rel, dir)) = stack.last_mut() else {
            break;
        };
        let Some(entry) = dir.read() else {
            stack.pop();
            continue;
        };
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        seen += 1;
        if seen > limits.max_entries {
            complete = false;
            break;
        }
        let parent = dir.fd()?;
        let child_rel = rel.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
        let stat = match statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
            visit(&WalkEntry {
                rel: &child_rel,
                parent,
                name,
                stat: &stat,
                dir: None,
            })?;
            continue;
        }
        if depth > limits.max_depth {
            complete = false;
            continue;
        }
        let fd = match open_subdir(parent, name) {
            Ok(fd) => fd,
            // Swapped for a symlink or something else, or gone, since the stat: skip.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ELOOP | libc::ENOENT | libc::ENOTDIR | libc::EXDEV)
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        // What was opened may differ from what was stat'ed: describe what is walked.
        let stat = fstat(&fd)?;
        visit(&WalkEntry {
            rel: &child_rel,
            parent,
            name,
            stat: &stat,
            dir: Some(fd.as_fd()),
        })?;
        let sub = Dir::new(fd)?;
        stack.push((child_rel, sub));
    }
    Ok(complete)
}

/// The permissions [`write_new_file`] gives a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FileMode {
    /// This mode as the process umask narrows it.
    Masked(u32),
    /// Exactly this mode, whatever the umask.
    Exact(u32),
}

/// Creates the file `name` (one component) in the open directory `dir`, writes `contents`
/// and, with `owner`, gives it to that uid and gid through its descriptor.
///
/// `O_CREAT | O_EXCL | O_NOFOLLOW`: whatever a kernel planted under that name (a symlink to
/// a host file, a file of its own) makes this fail instead of being followed or written,
/// and the owner and mode are set on what was opened, never on a path looked up again.
/// This is how root writes into a directory a kernel can write (docs/SECURITY.md).
pub(crate) fn write_new_file_at(
    dir: BorrowedFd<'_>,
    name: &Path,
    contents: &[u8],
    mode: FileMode,
    owner: Option<(u32, u32)>,
) -> io::Result<()> {
    use rustix::fs::{fchmod, fchown, openat, Gid, Mode, OFlags, Uid};
    use std::io::Write;
    let (FileMode::Masked(bits) | FileMode::Exact(bits)) = mode;
    let fd = openat(
        dir,
        one_component(name)?,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(bits),
    )?;
    if let Some((uid, gid)) = owner {
        fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    }
    if let FileMode::Exact(bits) = mode {
        // The umask may have narrowed the mode.
        fchmod(&fd, Mode::from_raw_mode(bits))?;
    }
    std::fs::File::from(fd).write_all(contents)
}

/// Makes the directory `name` (one component) in the open directory `parent` and returns it
/// opened, with `mode` exactly and, with `owner`, given to that uid and gid through the
/// descriptor. What is opened must be the directory this call made: one a kernel swapped
/// in meanwhile (a symlink, or a directory of its own) is refused, so nothing of the kernel's
/// choosing is chowned or written into.
pub(crate) fn make_dir_at(
    parent: BorrowedFd<'_>,
    name: &Path,
    mode: u32,
    owner: Option<(u32, u32)>,
) -> io::Result<OwnedFd> {
    use rustix::fs::{fchmod, fchown, fstat, mkdirat, Gid, Mode, Uid};
    let name = one_component(name)?;
    mkdirat(parent, name, Mode::from_raw_mode(mode))?;
    let cname = std::ffi::CString::new(name.as_os_str().as_bytes())?;
    let dir = open_subdir(parent, &cname)?;
    let (euid, _) = current_ids();
    if fstat(&dir)?.st_uid != euid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} was replaced by a directory the broker did not make",
                name.display()
            ),
        ));
    }
    fchmod(&dir, Mode::from_raw_mode(mode))?;
    if let Some((uid, gid)) = owner {
        fchown(&dir, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    }
    Ok(dir)
}

/// `name` if it is one plain path component (no `/`, not `.` or `..`).
fn one_component(name: &Path) -> io::Result<&Path> {
    let mut parts = name.components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(_)), None) => Ok(name),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not one path component", name.display()),
        )),
    }
}

/// Clears close-on-exec on `fd` so the exec'd program inherits it. Runs between fork and
/// exec: async-signal-safe calls only.
pub(crate) fn inherit_fd(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl(2) with F_SETFD has no memory-safety preconditions.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Has `cmd`'s child inherit `fds` (opened before the spawn, close-on-exec as every
/// descriptor of the broker is): [`inherit_fd`] on each between fork and exec.
pub(crate) fn inherit_in_child(cmd: &mut tokio::process::Command, fds: Vec<RawFd>) {
    // SAFETY: the closure runs between fork and exec and calls only fcntl (async-signal-safe)
    // on descriptors numbered before the fork; iterating the Vec does not allocate.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &fds {
                inherit_fd(*fd)?;
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn chown_tree_does_not_follow_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/f"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("sub/link")).unwrap();
        let (me, _) = current_ids();
        // As root, give the tree away for real; otherwise chown to ourselves (a no-op that
        // still walks the tree).
        let (uid, gid) = if me == 0 { (4242, 4242) } else { current_ids() };
        chown_tree(dir.path(), uid, gid).unwrap();
        assert_eq!(
            std::fs::symlink_metadata(dir.path().join("sub/f"))
                .unwrap()
                .uid(),
            uid
        );
        assert_eq!(
            std::fs::symlink_metadata(dir.path().join("sub/link"))
                .unwrap()
                .uid(),
            uid
        );
        assert_eq!(std::fs::metadata(outside.path()).unwrap().uid(), me);
    }
}
