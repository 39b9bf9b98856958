//! Directory entries of a workspace, for clients that browse it like a file system (E2B's
//! `files.list`, `exists`, `get_info`, `make_dir`): stat one path, list one directory to
//! a depth, make a directory with its parents. Same rules as the rest of `files`: every
//! path resolved beneath the workspace with no symlink followed; a symlink is reported as
//! one, never entered; listings are bounded.

use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Dir, FileType};

use super::metadata::{self, Metadata};
use super::{clean_relative, io_err, make_parents, open_beneath, open_root};
use crate::session::error::SessionError;

/// One entry: a file, a directory or a symlink (never followed).
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Relative to the workspace ("" is the workspace itself).
    pub rel: PathBuf,
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits and type, as `st_mode`.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub modified: chrono::DateTime<chrono::Utc>,
    /// For a symlink: its text, as `readlink` gives it (never followed).
    pub link_target: Option<PathBuf>,
    /// For a file or directory: its user-defined metadata (`super::metadata`), if any.
    pub metadata: Option<Metadata>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Directory,
    Symlink,
    Other,
}

/// At most this many entries in one listing.
pub const MAX_ENTRIES: usize = 10_000;

/// `rel` as a clean relative path; "" (or ".") is the workspace itself.
pub(super) fn relative(rel: &str) -> Result<PathBuf, SessionError> {
    if rel.is_empty() || rel == "." {
        return Ok(PathBuf::new());
    }
    clean_relative(rel)
}

/// The directory `rel` of `workspace` ("" or "." is the workspace itself) opened beneath it
/// with no symlink followed, with its clean relative path; `op` names the operation in
/// errors (a file there is [`SessionError::NotDirectory`]).
pub(super) fn open_dir(
    workspace: &Path,
    rel: &str,
    op: &'static str,
) -> Result<(OwnedFd, PathBuf), SessionError> {
    let rel = relative(rel)?;
    let root = open_root(workspace)?;
    if rel.as_os_str().is_empty() {
        return Ok((root, rel));
    }
    let dir = open_beneath(&root, &rel, libc::O_DIRECTORY | libc::O_RDONLY, 0).map_err(|e| {
        if e.raw_os_error() == Some(libc::ENOTDIR) {
            SessionError::NotDirectory { path: rel.clone() }
        } else {
            io_err(op, &rel, e)
        }
    })?;
    Ok((dir, rel))
}

fn entry_of(rel: PathBuf, st: &rustix::fs::Stat) -> Entry {
    let kind = match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => EntryKind::File,
        FileType::Directory => EntryKind::Directory,
        FileType::Symlink => EntryKind::Symlink,
        _ => EntryKind::Other,
    };
    Entry {
        rel,
        kind,
        size: st.st_size.max(0) as u64,
        mode: st.st_mode,
        uid: st.st_uid,
        gid: st.st_gid,
        modified: chrono::DateTime::from_timestamp(
            st.st_mtime,
            u32::try_from(st.st_mtime_nsec).unwrap_or(0),
        )
        .unwrap_or_default(),
        link_target: None,
        metadata: None,
    }
}

/// [`entry_of`] for `name` in the open directory `parent`, with what only the entry itself
/// tells: a symlink's text (`readlinkat`, which never follows), a file's or directory's
/// metadata (read through a descriptor opened `O_NOFOLLOW` beneath `parent`: were the entry
/// swapped for a symlink meanwhile, the open fails and there is no metadata).
fn described(
    parent: &std::os::fd::OwnedFd,
    name: &std::ffi::OsStr,
    rel: PathBuf,
    st: &rustix::fs::Stat,
) -> Entry {
    let mut entry = entry_of(rel, st);
    match entry.kind {
        EntryKind::Symlink => {
            entry.link_target = rustix::fs::readlinkat(parent, name, Vec::new())
                .ok()
                .map(|t| PathBuf::from(std::ffi::OsStr::from_bytes(t.as_bytes())));
        }
        EntryKind::File | EntryKind::Directory => {
            let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY;
            if let Ok(fd) = open_beneath(parent, Path::new(name), flags, 0) {
                entry.metadata = metadata::read(&fd);
            }
        }
        EntryKind::Other => {}
    }
    entry
}

/// What is at `rel` (a symlink is described, not followed).
pub fn stat(workspace: &Path, rel: &str) -> Result<Entry, SessionError> {
    let rel = relative(rel)?;
    let root = open_root(workspace)?;
    let Some(name) = rel.file_name() else {
        let st = rustix::fs::fstat(&root).map_err(|e| io_err("stat", workspace, e.into()))?;
        let mut entry = entry_of(rel, &st);
        entry.metadata = metadata::read(&root);
        return Ok(entry);
    };
    let parent = match rel.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => open_beneath(&root, p, libc::O_DIRECTORY | libc::O_RDONLY, 0)
            .map_err(|e| io_err("stat", &rel, e))?,
        None => root,
    };
    let st = rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| io_err("stat", &rel, e.into()))?;
    Ok(described(&parent, name, rel.clone(), &st))
}

/// The entries of directory `rel`, and of its subdirectories down to `depth` levels
/// (1: only its own), sorted by path; symlinked directories are listed, not entered.
/// `truncated` is set past [`MAX_ENTRIES`].
pub fn list_dir(
    workspace: &Path,
    rel: &str,
    depth: usize,
) -> Result<(Vec<Entry>, bool), SessionError> {
    let (top, rel) = open_dir(workspace, rel, "list")?;
    let mut out = Vec::new();
    let mut truncated = false;
    let mut stack = vec![(top, rel.clone(), 1usize)];
    while let Some((dir_fd, dir_rel, level)) = stack.pop() {
        let dir = Dir::read_from(&dir_fd).map_err(|e| io_err("list", &dir_rel, e.into()))?;
        for item in dir {
            let item = item.map_err(|e| io_err("list", &dir_rel, e.into()))?;
            let name = item.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            if out.len() >= MAX_ENTRIES {
                truncated = true;
                break;
            }
            let name_os = std::ffi::OsStr::from_bytes(name);
            let Ok(st) = rustix::fs::statat(&dir_fd, item.file_name(), AtFlags::SYMLINK_NOFOLLOW)
            else {
                continue; // gone meanwhile
            };
            let entry = described(&dir_fd, name_os, dir_rel.join(name_os), &st);
            if entry.kind == EntryKind::Directory && level < depth {
                if let Ok(sub) = open_beneath(
                    &dir_fd,
                    Path::new(name_os),
                    libc::O_DIRECTORY | libc::O_RDONLY,
                    0,
                ) {
                    stack.push((sub, entry.rel.clone(), level + 1));
                }
            }
            out.push(entry);
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok((out, truncated))
}

/// Makes directory `rel` and its missing parents, owned by `owner`; `false` when it
/// existed already.
pub fn make_dir(
    workspace: &Path,
    rel: &str,
    owner: Option<(u32, u32)>,
) -> Result<bool, SessionError> {
    let rel = clean_relative(rel)?;
    let root = open_root(workspace)?;
    match open_beneath(&root, &rel, libc::O_DIRECTORY | libc::O_RDONLY, 0) {
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("create directory", &rel, e)),
    }
    // `make_parents` makes every directory above a file's path: a placeholder name
    // below `rel` makes `rel` and its parents, and nothing else.
    make_parents(&root, workspace, &rel.join("placeholder"), owner)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_list_and_make_dir() {
        let ws = tempfile::tempdir().unwrap();
        super::super::write(ws.path(), "a/b/c.txt", b"hello", None).unwrap();
        std::os::unix::fs::symlink("/etc", ws.path().join("a/link")).unwrap();
        let e = stat(ws.path(), "a/b/c.txt").unwrap();
        assert_eq!((e.kind, e.size), (EntryKind::File, 5));
        assert_eq!(stat(ws.path(), "a/link").unwrap().kind, EntryKind::Symlink);
        assert_eq!(stat(ws.path(), "").unwrap().kind, EntryKind::Directory);
        assert!(matches!(
            stat(ws.path(), "nope"),
            Err(SessionError::NoSuchFile { .. })
        ));
        let (one, _) = list_dir(ws.path(), "a", 1).unwrap();
        let names: Vec<_> = one.iter().map(|e| e.rel.display().to_string()).collect();
        assert_eq!(names, ["a/b", "a/link"]);
        let (two, _) = list_dir(ws.path(), "a", 2).unwrap();
        assert_eq!(two.len(), 3);
        // A symlinked directory is never entered, nor listed through.
        assert!(list_dir(ws.path(), "a/link", 1).is_err());
        assert!(make_dir(ws.path(), "x/y", None).unwrap());
        assert!(!make_dir(ws.path(), "x/y", None).unwrap());
        assert_eq!(stat(ws.path(), "x/y").unwrap().kind, EntryKind::Directory);
        assert!(list_dir(ws.path(), "../", 1).is_err());
    }
}
