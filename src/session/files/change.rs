//! Deleting and moving workspace entries on the API's behalf, under the same rules as
//! reading and writing (see the parent module): a path's directories are opened beneath the
//! workspace with no symlink followed, and the last component is acted on through its
//! parent's descriptor (`unlinkat`, `renameat2`), which never follows it either. A symlink
//! the kernel planted can be deleted or moved as the link it is; what it points to is never
//! touched.

use std::path::Path;

use rustix::fs::{AtFlags, FileType, RenameFlags};

use super::{clean_relative, io_err, make_parents, open_beneath, open_root};
use crate::session::error::SessionError;

/// Deletes the file (or symlink, or empty directory) at `rel`. A directory that is not
/// empty is refused ([`SessionError::DirectoryNotEmpty`]): the API never deletes a tree.
pub fn remove(workspace: &Path, rel: &str) -> Result<(), SessionError> {
    let rel = clean_relative(rel)?;
    let root = open_root(workspace)?;
    let parent = open_parent(&root, workspace, &rel)?;
    let name = last_component(&rel)?;
    let st = rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| io_err("delete", &rel, e.into()))?;
    let flags = if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
        AtFlags::REMOVEDIR
    } else {
        AtFlags::empty()
    };
    // Were the entry swapped between the stat and the unlink (a directory for a file, say),
    // the unlink fails (EISDIR / ENOTDIR) rather than acting on anything but this name.
    rustix::fs::unlinkat(&parent, name, flags).map_err(|e| match e {
        rustix::io::Errno::NOTEMPTY | rustix::io::Errno::EXIST => {
            SessionError::DirectoryNotEmpty { path: rel.clone() }
        }
        e => io_err("delete", &rel, e.into()),
    })
}

/// Moves (renames) `from` to `to`, both relative to the workspace; `to`'s missing parent
/// directories are created (owned by `owner`, as uploads are). An existing `to` is never
/// replaced ([`SessionError::DestinationExists`]); moving a directory into itself is refused.
pub fn rename(
    workspace: &Path,
    from: &str,
    to: &str,
    owner: Option<(u32, u32)>,
) -> Result<(), SessionError> {
    move_entry(workspace, from, to, owner, RenameFlags::NOREPLACE)
}

/// [`rename`], replacing what is at `to` as `rename(2)` does (and E2B's envd, whose `Move`
/// is Go's `os.Rename`): a file or symlink over a file or symlink, a directory over an empty
/// directory. A directory over one that is not empty is
/// [`SessionError::DestinationExists`]; a directory over a file, or a file over a
/// directory, is refused by the system (`ENOTDIR`, `EISDIR`). The replaced entry is
/// unlinked as itself: a symlink at `to` is replaced, never followed.
pub fn rename_over(
    workspace: &Path,
    from: &str,
    to: &str,
    owner: Option<(u32, u32)>,
) -> Result<(), SessionError> {
    move_entry(workspace, from, to, owner, RenameFlags::empty())
}

fn move_entry(
    workspace: &Path,
    from: &str,
    to: &str,
    owner: Option<(u32, u32)>,
    flags: RenameFlags,
) -> Result<(), SessionError> {
    let from = clean_relative(from)?;
    let to = clean_relative(to)?;
    if to.starts_with(&from) {
        return Err(SessionError::MoveIntoItself { from, to });
    }
    let root = open_root(workspace)?;
    let from_parent = open_parent(&root, workspace, &from)?;
    let from_name = last_component(&from)?;
    // The source must exist before any directory is made for the destination.
    rustix::fs::statat(&from_parent, from_name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| io_err("move", &from, e.into()))?;
    let to_parent = make_parents(&root, workspace, &to, owner)?;
    let to_name = last_component(&to)?;
    // With NOREPLACE the check for an existing destination and the move are one atomic step.
    rustix::fs::renameat_with(&from_parent, from_name, &to_parent, to_name, flags).map_err(|e| {
        match e {
            rustix::io::Errno::EXIST | rustix::io::Errno::NOTEMPTY => {
                SessionError::DestinationExists { path: to.clone() }
            }
            rustix::io::Errno::ISDIR => SessionError::IsDirectory { path: to.clone() },
            rustix::io::Errno::NOTDIR if flags.is_empty() => {
                SessionError::NotDirectory { path: to.clone() }
            }
            // The source's parent changed between the two opens and the move: its name is gone.
            e => io_err("move", &from, e.into()),
        }
    })
}

/// The directory holding `rel`, opened beneath the workspace with no symlink followed.
pub(super) fn open_parent(
    root: &std::os::fd::OwnedFd,
    workspace: &Path,
    rel: &Path,
) -> Result<std::os::fd::OwnedFd, SessionError> {
    match rel.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => open_beneath(root, p, libc::O_DIRECTORY | libc::O_RDONLY, 0)
            .map_err(|e| io_err("open", p, e)),
        None => root.try_clone().map_err(|e| io_err("open", workspace, e)),
    }
}

/// The last component of a cleaned path (never empty, never `..`: `clean_relative`).
pub(super) fn last_component(rel: &Path) -> Result<&std::ffi::OsStr, SessionError> {
    rel.file_name().ok_or_else(|| SessionError::NamesNoFile {
        path: rel.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::{list, read, write};
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn delete_removes_files_and_empty_directories_only() {
        let ws = tempfile::tempdir().unwrap();
        write(ws.path(), "d/a.csv", b"1", None).unwrap();
        assert!(matches!(
            remove(ws.path(), "d"),
            Err(SessionError::DirectoryNotEmpty { .. })
        ));
        remove(ws.path(), "d/a.csv").unwrap();
        assert!(matches!(
            remove(ws.path(), "d/a.csv"),
            Err(SessionError::NoSuchFile { .. })
        ));
        remove(ws.path(), "d").unwrap();
        assert!(!ws.path().join("d").exists());
        for bad in ["", ".", "..", "/etc/passwd", "d/../../x"] {
            assert!(
                matches!(
                    remove(ws.path(), bad),
                    Err(SessionError::InvalidPath { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn delete_and_move_never_follow_a_symlink() {
        let ws = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"s").unwrap();
        symlink(outside.path(), ws.path().join("dirlink")).unwrap();
        symlink(outside.path().join("secret"), ws.path().join("filelink")).unwrap();
        write(ws.path(), "mine.txt", b"m", None).unwrap();

        // Through a linked directory: refused, on both sides of a move.
        assert!(matches!(
            remove(ws.path(), "dirlink/secret"),
            Err(SessionError::ThroughSymlink { .. })
        ));
        assert!(rename(ws.path(), "dirlink/secret", "stolen", None).is_err());
        assert!(rename(ws.path(), "mine.txt", "dirlink/planted", None).is_err());
        assert!(rename(ws.path(), "mine.txt", "dirlink/sub/planted", None).is_err());
        assert!(outside.path().join("secret").exists());
        assert!(!outside.path().join("planted").exists());
        assert!(!outside.path().join("sub").exists());
        assert!(!ws.path().join("stolen").exists());

        // The link itself is the entry: moved and deleted as a link, its target untouched.
        rename(ws.path(), "filelink", "moved-link", None).unwrap();
        assert!(std::fs::symlink_metadata(ws.path().join("moved-link"))
            .unwrap()
            .file_type()
            .is_symlink());
        remove(ws.path(), "moved-link").unwrap();
        remove(ws.path(), "dirlink").unwrap();
        assert_eq!(std::fs::read(outside.path().join("secret")).unwrap(), b"s");
    }

    #[test]
    fn move_renames_creates_parents_and_never_replaces() {
        let ws = tempfile::tempdir().unwrap();
        write(ws.path(), "a.csv", b"a", None).unwrap();
        write(ws.path(), "b.csv", b"b", None).unwrap();
        rename(ws.path(), "a.csv", "archive/2024/a.csv", None).unwrap();
        assert_eq!(read(ws.path(), "archive/2024/a.csv", 10).unwrap(), b"a");
        assert!(matches!(
            rename(ws.path(), "b.csv", "archive/2024/a.csv", None),
            Err(SessionError::DestinationExists { .. })
        ));
        assert_eq!(read(ws.path(), "archive/2024/a.csv", 10).unwrap(), b"a");
        assert!(matches!(
            rename(ws.path(), "nope", "x/y", None),
            Err(SessionError::NoSuchFile { .. })
        ));
        // A missing source makes no directory for its destination.
        assert!(!ws.path().join("x").exists());
        assert!(matches!(
            rename(ws.path(), "archive", "archive/inner", None),
            Err(SessionError::MoveIntoItself { .. })
        ));
        rename(ws.path(), "archive", "old", None).unwrap();
        let paths: Vec<String> = list(ws.path(), 10)
            .unwrap()
            .files
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(paths, ["b.csv", "old/2024/a.csv"]);
    }
}
