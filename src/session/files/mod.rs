//! Files in a user's workspace, read and written by the broker on the API's behalf.
//!
//! The workspace is writable by the user's kernels, which may plant symlinks pointing
//! anywhere on the host. The broker may run as root, so every path is resolved with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`: nothing outside the workspace can be
//! read or written through it, whatever the kernel did.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use super::error::SessionError;
use crate::sandbox::fsutil::{self, open_beneath, WalkLimits};
use rustix::fs::{Mode, OFlags};

mod change;
pub use change::{remove, rename};
mod entries;
pub use entries::{list_dir, make_dir, stat, Entry, EntryKind};
pub mod metadata;
pub use metadata::Metadata;
mod tree;
pub mod watch;
pub use change::rename_over;
pub use tree::remove_all;

/// One file of a listing.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub modified: chrono::DateTime<chrono::Utc>,
}

/// Validate a client's relative path: no absolute paths, no `..`, no NUL, not empty.
pub fn clean_relative(path: &str) -> Result<PathBuf, SessionError> {
    let bad = |why: &'static str| SessionError::InvalidPath {
        path: path.to_string(),
        why,
    };
    if path.is_empty() || path.len() > 4096 || path.contains('\0') {
        return Err(bad("empty, too long, or contains NUL"));
    }
    let mut out = PathBuf::new();
    for c in Path::new(path).components() {
        match c {
            // A name longer than the filesystem takes (NAME_MAX) is the client's mistake, not
            // an I/O failure of the broker's.
            Component::Normal(part) if part.len() > 255 => {
                return Err(bad("has a name longer than 255 bytes"))
            }
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            _ => {
                return Err(bad(
                    "must be relative to the workspace and must not contain '..'",
                ))
            }
        }
    }
    if out.as_os_str().is_empty() {
        return Err(bad("names no file"));
    }
    Ok(out)
}

fn io_err(op: &'static str, path: &Path, e: std::io::Error) -> SessionError {
    let path = path.to_path_buf();
    match e.kind() {
        std::io::ErrorKind::NotFound => SessionError::NoSuchFile { path },
        _ if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::EXDEV) => {
            SessionError::ThroughSymlink { path }
        }
        _ if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
            SessionError::WorkspaceFull { path }
        }
        _ if e.raw_os_error() == Some(libc::EISDIR) => SessionError::IsDirectory { path },
        _ => SessionError::FileIo {
            op,
            path,
            source: e,
        },
    }
}

fn open_root(workspace: &Path) -> Result<OwnedFd, SessionError> {
    fsutil::open_tree_root(workspace).map_err(|e| io_err("open", workspace, e))
}

fn chown_fd(fd: &OwnedFd, owner: Option<(u32, u32)>) {
    use std::os::fd::AsRawFd;
    if let Some((uid, gid)) = owner {
        // SAFETY: plain syscall on a descriptor we own.
        unsafe {
            libc::fchown(fd.as_raw_fd(), uid, gid);
        }
    }
}

/// How the temporary file of an upload in progress is named (beside its target).
pub const UPLOAD_TEMP_PREFIX: &str = ".kb-upload-";

/// Write `data` to `rel` in the workspace, creating parent directories.
pub fn write(
    workspace: &Path,
    rel: &str,
    data: &[u8],
    owner: Option<(u32, u32)>,
) -> Result<(), SessionError> {
    write_with_metadata(workspace, rel, data, owner, None)
}

/// [`write`], storing `meta` on the new file (see [`metadata`]) before it takes the
/// target's place: the file that replaces an old one carries exactly this metadata, as
/// envd's uploads do.
pub fn write_with_metadata(
    workspace: &Path,
    rel: &str,
    data: &[u8],
    owner: Option<(u32, u32)>,
    meta: Option<&Metadata>,
) -> Result<(), SessionError> {
    let rel = clean_relative(rel)?;
    let root = open_root(workspace)?;
    let parent = make_parents(&root, workspace, &rel, owner)?;
    let name = rel
        .file_name()
        .ok_or_else(|| SessionError::NamesNoFile { path: rel.clone() })?;
    // A symlink in the target's place is refused, as everywhere in this API (were one
    // swapped in after this check, the rename replaces the link itself: still harmless).
    if let Ok(st) = rustix::fs::statat(&parent, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
        if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink {
            return Err(io_err(
                "write",
                &rel,
                std::io::Error::from_raw_os_error(libc::ELOOP),
            ));
        }
    }
    // Into a new file beside the target, renamed over it once complete: a write that fails
    // (the quota is full, say) leaves the old file as it was and no partial file behind.
    let temp = format!("{UPLOAD_TEMP_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(&parent, temp.as_str(), flags, Mode::from_raw_mode(0o644))
        .map_err(|e| io_err("write", &rel, e.into()))?;
    chown_fd(&fd, owner);
    let tagged = match meta {
        Some(m) => metadata::write(&fd, m),
        None => Ok(()),
    };
    let written = tagged
        .and_then(|()| std::fs::File::from(fd).write_all(data))
        .and_then(|()| Ok(rustix::fs::renameat(&parent, temp.as_str(), &parent, name)?));
    if let Err(e) = written {
        let _ = rustix::fs::unlinkat(&parent, temp.as_str(), rustix::fs::AtFlags::empty());
        return Err(io_err("write", &rel, e));
    }
    Ok(())
}

/// Opens the directory that holds `rel`, creating the missing directories on the way (each
/// made with `mkdirat` in its parent's descriptor and given to `owner`, so the kernel can
/// write, rename and delete in them). Returns the parent's descriptor.
pub(super) fn make_parents(
    root: &OwnedFd,
    workspace: &Path,
    rel: &Path,
    owner: Option<(u32, u32)>,
) -> Result<OwnedFd, SessionError> {
    use std::os::fd::AsRawFd;
    let mut dir = PathBuf::new();
    let parents: Vec<_> = rel
        .parent()
        .map(|p| p.components().collect())
        .unwrap_or_default();
    for part in parents {
        dir.push(part);
        match open_beneath(root, &dir, libc::O_DIRECTORY | libc::O_RDONLY, 0) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let parent_fd = match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                    Some(p) => open_beneath(root, p, libc::O_DIRECTORY | libc::O_RDONLY, 0)
                        .map_err(|e| io_err("open", p, e))?,
                    None => root.try_clone().map_err(|e| io_err("open", workspace, e))?,
                };
                let name =
                    CString::new(dir.file_name().unwrap_or_default().as_bytes()).map_err(|_| {
                        SessionError::InvalidPath {
                            path: dir.display().to_string(),
                            why: "contains NUL",
                        }
                    })?;
                // SAFETY: valid dirfd and NUL-terminated name.
                let rc = unsafe { libc::mkdirat(parent_fd.as_raw_fd(), name.as_ptr(), 0o755) };
                if rc != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::AlreadyExists {
                        return Err(io_err("create directory", &dir, e));
                    }
                }
                let made = open_beneath(root, &dir, libc::O_DIRECTORY | libc::O_RDONLY, 0)
                    .map_err(|e| io_err("open", &dir, e))?;
                chown_fd(&made, owner);
            }
            Err(e) => return Err(io_err("open", &dir, e)),
        }
    }
    match rel.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => open_beneath(root, p, libc::O_DIRECTORY | libc::O_RDONLY, 0)
            .map_err(|e| io_err("open", p, e)),
        None => root.try_clone().map_err(|e| io_err("open", workspace, e)),
    }
}

/// Open `rel` in the workspace for reading, refusing what is not a regular file and files
/// larger than `max`. Returns the file and its size at the time of opening (the kernel may
/// change it after; readers read at most that many bytes).
pub fn open_for_read(
    workspace: &Path,
    rel: &str,
    max: usize,
) -> Result<(std::fs::File, u64), SessionError> {
    let rel = clean_relative(rel)?;
    let root = open_root(workspace)?;
    let fd = open_beneath(&root, &rel, libc::O_RDONLY | libc::O_NONBLOCK, 0)
        .map_err(|e| io_err("read", &rel, e))?;
    let f = std::fs::File::from(fd);
    let meta = f.metadata().map_err(|e| io_err("read", &rel, e))?;
    if meta.is_dir() {
        return Err(SessionError::IsDirectory { path: rel });
    }
    if !meta.is_file() {
        return Err(SessionError::NotRegularFile { path: rel });
    }
    if meta.size() > max as u64 {
        return Err(SessionError::FileTooLarge {
            path: rel,
            size: meta.size(),
            max,
        });
    }
    Ok((f, meta.size()))
}

/// Read `rel` from the workspace, refusing files larger than `max`.
pub fn read(workspace: &Path, rel: &str, max: usize) -> Result<Vec<u8>, SessionError> {
    let (f, size) = open_for_read(workspace, rel, max)?;
    let mut buf = Vec::with_capacity(size as usize);
    f.take(size)
        .read_to_end(&mut buf)
        .map_err(|e| io_err("read", Path::new(rel), e))?;
    Ok(buf)
}

/// How far a listing looks: entries of any kind examined, and directory levels entered.
/// A kernel can create millions of files; the broker's work and memory stay bounded.
pub const LIST_MAX_ENTRIES: usize = 100_000;
pub const LIST_MAX_DEPTH: usize = 64;

/// A workspace listing, sorted by path.
#[derive(Debug, Clone, PartialEq)]
pub struct Listing {
    pub files: Vec<FileEntry>,
    /// Set when a bound (`limit` files, [`LIST_MAX_ENTRIES`] entries examined,
    /// [`LIST_MAX_DEPTH`] levels) cut the listing short.
    pub truncated: bool,
}

/// The regular files under the workspace, at most `limit`.
///
/// The walk goes through directory descriptors (see `fsutil::walk_tree`): the kernel may
/// swap a directory for a symlink to another user's workspace or a host directory while
/// this runs, and nothing is ever followed. Symlinks, fifos, sockets and devices are not
/// listed; nor is the root's `lost+found` of a workspace file system.
pub fn list(workspace: &Path, limit: usize) -> Result<Listing, SessionError> {
    let root = fsutil::open_tree_root(workspace).map_err(|e| io_err("list", workspace, e))?;
    let mut files = Vec::new();
    let limits = WalkLimits {
        max_entries: LIST_MAX_ENTRIES,
        max_depth: LIST_MAX_DEPTH,
    };
    let mut full = false;
    let mut mkfs_lost_and_found = false;
    let complete = fsutil::walk_tree(&root, limits, |entry| {
        if files.len() >= limit {
            full = true;
            return Err(std::io::Error::other("listing limit reached"));
        }
        if entry.rel == Path::new(LOST_AND_FOUND) && entry.dir.is_some() {
            // Only root makes a root-owned directory: that one is mkfs's, not the user's.
            mkfs_lost_and_found = entry.stat.st_uid == 0;
        }
        if !entry.is_file() || (mkfs_lost_and_found && entry.rel.starts_with(LOST_AND_FOUND)) {
            return Ok(());
        }
        let modified = chrono::DateTime::from_timestamp(
            entry.stat.st_mtime,
            u32::try_from(entry.stat.st_mtime_nsec).unwrap_or(0),
        )
        .unwrap_or_default();
        files.push(FileEntry {
            path: entry.rel.to_string_lossy().into_owned(),
            size: entry.stat.st_size.max(0) as u64,
            modified,
        });
        Ok(())
    });
    let complete = match complete {
        Ok(complete) => complete,
        Err(_) if full => false,
        Err(e) => return Err(io_err("list", workspace, e)),
    };
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Listing {
        files,
        truncated: !complete,
    })
}

/// Where `e2fsck` puts what it recovers, on a workspace that is its own file system; made by
/// mkfs, owned by root, not the user's.
const LOST_AND_FOUND: &str = "lost+found";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_cleaned() {
        assert_eq!(clean_relative("a/b.csv").unwrap(), PathBuf::from("a/b.csv"));
        assert_eq!(clean_relative("./a").unwrap(), PathBuf::from("a"));
        let long_name = format!("a/{}", "n".repeat(256));
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a\0b",
            ".",
            &long_name,
        ] {
            assert!(clean_relative(bad).is_err(), "{bad:?}");
        }
        let longest = "n".repeat(255);
        assert!(clean_relative(&longest).is_ok());
        let e = clean_relative(&long_name).unwrap_err().to_string();
        assert!(e.contains("longer than 255 bytes"), "{e}");
    }

    #[test]
    fn write_read_list_and_symlinks_refused() {
        let ws = tempfile::tempdir().unwrap();
        write(ws.path(), "data/in.csv", b"a,b\n1,2\n", None).unwrap();
        assert_eq!(read(ws.path(), "data/in.csv", 100).unwrap(), b"a,b\n1,2\n");
        assert!(matches!(
            read(ws.path(), "data/in.csv", 3),
            Err(SessionError::FileTooLarge { .. })
        ));
        assert!(matches!(
            read(ws.path(), "nope", 3),
            Err(SessionError::NoSuchFile { .. })
        ));
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"s").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), ws.path().join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), ws.path().join("dirlink")).unwrap();
        assert!(read(ws.path(), "link", 100).is_err());
        assert!(read(ws.path(), "dirlink/secret", 100).is_err());
        assert!(write(ws.path(), "dirlink/new", b"x", None).is_err());
        assert!(write(ws.path(), "link", b"x", None).is_err());
        assert!(!outside.path().join("new").exists());
        assert_eq!(std::fs::read(outside.path().join("secret")).unwrap(), b"s");
        let listed = list(ws.path(), 100).unwrap().files;
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].path, "data/in.csv");
        assert_eq!(listed[0].size, 8);
    }

    #[test]
    fn listings_are_bounded_and_say_so() {
        let ws = tempfile::tempdir().unwrap();
        let mut deep = ws.path().to_path_buf();
        for _ in 0..LIST_MAX_DEPTH + 2 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("too-deep.txt"), b"x").unwrap();
        std::fs::write(ws.path().join("top.txt"), b"x").unwrap();
        let listing = list(ws.path(), 100).unwrap();
        assert!(listing.truncated);
        assert_eq!(listing.files.len(), 1);
        assert_eq!(listing.files[0].path, "top.txt");

        let ws = tempfile::tempdir().unwrap();
        for i in 0..5 {
            std::fs::write(ws.path().join(format!("f{i}")), b"x").unwrap();
        }
        let listing = list(ws.path(), 3).unwrap();
        assert!(listing.truncated);
        assert_eq!(listing.files.len(), 3);
        let listing = list(ws.path(), 5).unwrap();
        assert!(!listing.truncated);
        assert_eq!(listing.files.len(), 5);
    }

    #[test]
    fn a_workspace_file_systems_lost_and_found_is_not_listed() {
        let ws = tempfile::tempdir().unwrap();
        std::fs::create_dir(ws.path().join(LOST_AND_FOUND)).unwrap();
        std::fs::write(ws.path().join("lost+found/#12"), b"x").unwrap();
        let owned_by_root = fsutil::current_ids().0 == 0;
        let listing = list(ws.path(), 100).unwrap();
        // Root made it (as mkfs does): hidden. Anyone else: the user's own directory.
        assert_eq!(listing.files.is_empty(), owned_by_root);
    }
}
