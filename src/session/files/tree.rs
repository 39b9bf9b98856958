//! Removing a whole tree, as E2B's envd removes (Go's `os.RemoveAll`): a missing path is
//! nothing to do, a directory goes with everything in it. Root does this in a directory the
//! kernel writes, while the kernel may swap any entry for a symlink to a host directory, so
//! nothing here resolves a path: each directory is entered through its parent's descriptor
//! (`fsutil::open_subdir`, `O_NOFOLLOW` beneath it), its entries are looked at with
//! `fstatat(AT_SYMLINK_NOFOLLOW)` and removed with `unlinkat` relative to that descriptor,
//! which never follows the last component. A symlink anywhere in the tree is removed as the
//! link it is; what it points to is never entered.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{statat, unlinkat, AtFlags, Dir, FileType};
use rustix::io::Errno;

use super::change::{last_component, open_parent};
use super::{clean_relative, io_err, open_root};
use crate::sandbox::fsutil::open_subdir;
use crate::session::error::SessionError;

/// Directory levels a removal descends (one descriptor is open per level).
pub const REMOVE_MAX_DEPTH: usize = 256;

/// Names read from a directory before they are removed; a directory is read again until it
/// is empty.
const BATCH: usize = 4096;

/// Rounds of [`BATCH`] a single directory may take: a kernel that keeps adding entries
/// while the broker removes them cannot keep a request going forever.
const MAX_ROUNDS: usize = 1024;

/// Removes what is at `rel`: a file or symlink, or a directory with everything in it.
/// Returns whether there was anything (a missing path, or one whose parent is missing, is
/// `Ok(false)`). A path through a symlinked directory is refused
/// ([`SessionError::ThroughSymlink`]), as everywhere in the files API.
pub fn remove_all(workspace: &Path, rel: &str) -> Result<bool, SessionError> {
    let rel = clean_relative(rel)?;
    let root = open_root(workspace)?;
    let parent = match open_parent(&root, workspace, &rel) {
        Ok(p) => p,
        Err(SessionError::NoSuchFile { .. }) => return Ok(false),
        Err(SessionError::FileIo { source, .. })
            if source.raw_os_error() == Some(libc::ENOTDIR) =>
        {
            return Ok(false)
        }
        Err(e) => return Err(e),
    };
    let name =
        CString::new(last_component(&rel)?.as_bytes()).map_err(|_| SessionError::InvalidPath {
            path: rel.display().to_string(),
            why: "contains NUL",
        })?;
    remove_entry(parent.as_fd(), &name, &rel, 0)
}

/// Removes `name` in `parent`, and below it if it is a directory; `false` if it was gone.
fn remove_entry(
    parent: BorrowedFd<'_>,
    name: &CStr,
    rel: &Path,
    depth: usize,
) -> Result<bool, SessionError> {
    let failed = |e: Errno| io_err("delete", rel, e.into());
    let st = match statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(false),
        Err(e) => return Err(failed(e)),
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return unlink(parent, name, AtFlags::empty()).map_err(failed);
    }
    let dir: OwnedFd = match open_subdir(parent, name) {
        Ok(fd) => fd,
        // Swapped for a symlink (ELOOP) or a file since the stat: remove that, as itself.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
            return unlink(parent, name, AtFlags::empty()).map_err(failed);
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(false),
        Err(e) => return Err(io_err("delete", rel, e)),
    };
    if depth >= REMOVE_MAX_DEPTH {
        return Err(io_err(
            "delete",
            rel,
            std::io::Error::other(format!(
                "the tree is more than {REMOVE_MAX_DEPTH} directories deep"
            )),
        ));
    }
    empty_dir(&dir, rel, depth)?;
    drop(dir);
    unlink(parent, name, AtFlags::REMOVEDIR).map_err(|e| match e {
        // The kernel added entries after the directory was emptied.
        Errno::NOTEMPTY | Errno::EXIST => SessionError::DirectoryNotEmpty {
            path: rel.to_path_buf(),
        },
        e => failed(e),
    })
}

/// `unlinkat`; `Ok(false)` when the name was gone already.
fn unlink(parent: BorrowedFd<'_>, name: &CStr, flags: AtFlags) -> Result<bool, Errno> {
    match unlinkat(parent, name, flags) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes every entry of the open directory `dir` (at `rel`), through its descriptor.
fn empty_dir(dir: &OwnedFd, rel: &Path, depth: usize) -> Result<(), SessionError> {
    for _ in 0..MAX_ROUNDS {
        let mut names: Vec<CString> = Vec::new();
        let entries = Dir::read_from(dir).map_err(|e| io_err("delete", rel, e.into()))?;
        for item in entries {
            let item = item.map_err(|e| io_err("delete", rel, e.into()))?;
            let name = item.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            names.push(name.to_owned());
            if names.len() == BATCH {
                break;
            }
        }
        if names.is_empty() {
            return Ok(());
        }
        for name in names {
            let child = rel.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
            remove_entry(dir.as_fd(), &name, &child, depth + 1)?;
        }
    }
    Err(SessionError::DirectoryNotEmpty {
        path: rel.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::write;
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn removes_trees_and_missing_paths_are_nothing() {
        let ws = tempfile::tempdir().unwrap();
        write(ws.path(), "d/a.csv", b"1", None).unwrap();
        write(ws.path(), "d/e/f/g.txt", b"2", None).unwrap();
        write(ws.path(), "keep.txt", b"k", None).unwrap();
        assert!(remove_all(ws.path(), "d").unwrap());
        assert!(!ws.path().join("d").exists());
        assert!(ws.path().join("keep.txt").exists());
        assert!(!remove_all(ws.path(), "d").unwrap());
        assert!(!remove_all(ws.path(), "nope/deeper/x").unwrap());
        // A file's "child" is nothing either.
        assert!(!remove_all(ws.path(), "keep.txt/x").unwrap());
        assert!(remove_all(ws.path(), "keep.txt").unwrap());
        for bad in ["", ".", "..", "/etc", "a/../../x"] {
            assert!(
                matches!(
                    remove_all(ws.path(), bad),
                    Err(SessionError::InvalidPath { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_symlink_in_the_tree_is_removed_as_a_link_and_never_followed() {
        let ws = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        std::fs::create_dir(host.path().join("sub")).unwrap();
        std::fs::write(host.path().join("precious"), b"p").unwrap();
        std::fs::write(host.path().join("sub/also"), b"a").unwrap();
        write(ws.path(), "t/inner/x.txt", b"x", None).unwrap();
        symlink(host.path(), ws.path().join("t/inner/to-host")).unwrap();
        symlink(host.path().join("precious"), ws.path().join("t/file-link")).unwrap();
        symlink(host.path(), ws.path().join("top-link")).unwrap();
        assert!(remove_all(ws.path(), "t").unwrap());
        assert!(!ws.path().join("t").exists());
        // Through a symlinked directory: refused, as every other call.
        assert!(matches!(
            remove_all(ws.path(), "top-link/precious"),
            Err(SessionError::ThroughSymlink { .. })
        ));
        // The link itself goes; its target stays.
        assert!(remove_all(ws.path(), "top-link").unwrap());
        assert_eq!(std::fs::read(host.path().join("precious")).unwrap(), b"p");
        assert_eq!(std::fs::read(host.path().join("sub/also")).unwrap(), b"a");
    }

    #[test]
    fn a_tree_too_deep_is_refused_not_followed() {
        let ws = tempfile::tempdir().unwrap();
        let mut deep = ws.path().join("d");
        for _ in 0..REMOVE_MAX_DEPTH + 1 {
            deep.push("n");
        }
        std::fs::create_dir_all(&deep).unwrap();
        assert!(remove_all(ws.path(), "d").is_err());
    }
}
