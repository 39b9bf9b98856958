//! Watching a workspace directory for changes (E2B's `watch_dir`), with inotify on the host
//! side of the workspace.
//!
//! A kernel may swap any directory for a symlink to `/etc` or another user's workspace, so a
//! watch is never added by a path the kernel can change: each directory is opened beneath
//! the workspace with no symlink followed (`open_beneath`, or by `walk_tree` through its
//! parent's descriptor), and the watch is added on what was opened, through
//! `/proc/self/fd/N` (`IN_ONLYDIR`): a symlinked directory is never watched, nor descended
//! into. Bounded: at most [`MAX_WATCHED_DIRS`] directories per watch (more are not watched,
//! and the watch says how many), events read at most 64 KiB at a time; the kernel's own
//! queue overflowing is reported as dropped events, as inotify reports it.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use tokio::io::unix::AsyncFd;

use super::entries::open_dir;
use super::{io_err, open_beneath, UPLOAD_TEMP_PREFIX};
use crate::sandbox::fsutil::{walk_tree, WalkLimits};
use crate::session::error::SessionError;

/// Directories one watch covers at most.
pub const MAX_WATCHED_DIRS: usize = 2048;

/// What happened to an entry (envd's event types, from fsnotify's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

/// One change, its path relative to the watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub rel: PathBuf,
    pub kind: ChangeKind,
}

/// A batch of changes, and what could not be reported.
#[derive(Debug, Default)]
pub struct Changes {
    pub changes: Vec<Change>,
    /// Events the system's queue dropped (it overflowed) since the last batch.
    pub overflowed: bool,
}

/// A watch on one directory of a workspace (and its subdirectories, if recursive).
pub struct DirWatch {
    inotify: AsyncFd<OwnedFd>,
    /// The watched directory, as opened beneath the workspace.
    top: OwnedFd,
    dirs: HashMap<i32, PathBuf>,
    recursive: bool,
    /// Directories left unwatched because of [`MAX_WATCHED_DIRS`].
    pub unwatched: usize,
}

const MASK: WatchFlags = WatchFlags::CREATE
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MODIFY)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::DELETE)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::ONLYDIR)
    .union(WatchFlags::EXCL_UNLINK);

impl DirWatch {
    /// Watches directory `rel` of `workspace` ("" is the workspace itself). Blocking (it
    /// walks the tree when `recursive`): call it off the async runtime's threads, inside it.
    pub fn new(workspace: &Path, rel: &str, recursive: bool) -> Result<Self, SessionError> {
        let (top, rel) = open_dir(workspace, rel, "watch")?;
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)
            .map_err(|e| io_err("watch", &rel, e.into()))?;
        // SAFETY: the descriptor is owned by the `AsyncFd` it is moved into, which keeps it
        // open while it is registered and deregisters it before closing it.
        let inotify =
            unsafe { AsyncFd::register(fd) }.map_err(|e| io_err("watch", &rel, e.into()))?;
        let mut watch = Self {
            inotify,
            top,
            dirs: HashMap::new(),
            recursive,
            unwatched: 0,
        };
        let top = watch
            .top
            .try_clone()
            .map_err(|e| io_err("watch", &rel, e))?;
        watch
            .add(top.as_fd(), PathBuf::new())
            .map_err(|e| io_err("watch", &rel, e))?;
        if recursive {
            watch.add_below(&top, Path::new(""), None);
        }
        Ok(watch)
    }

    /// Adds a watch on the open directory `dir` (at `rel` below the top).
    fn add(&mut self, dir: BorrowedFd<'_>, rel: PathBuf) -> std::io::Result<()> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            self.unwatched += 1;
            return Ok(());
        }
        let via = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let wd = inotify::add_watch(self.inotify.get_ref(), via.as_str(), MASK)?;
        self.dirs.insert(wd, rel);
        Ok(())
    }

    /// Adds watches on every directory below the open directory `dir` (at `rel`), walked
    /// through descriptors (`walk_tree`: never through a symlink). With `found_entries`,
    /// every entry met is reported there as created: in a directory that was just made,
    /// what appeared before its watch was added.
    fn add_below(
        &mut self,
        dir: &OwnedFd,
        rel: &Path,
        mut found_entries: Option<&mut Vec<Change>>,
    ) {
        let limits = WalkLimits {
            max_entries: 100_000,
            max_depth: 64,
        };
        let mut found: Vec<(OwnedFd, PathBuf)> = Vec::new();
        let _ = walk_tree(dir, limits, |entry| {
            if let Some(out) = found_entries.as_deref_mut() {
                out.push(Change {
                    rel: rel.join(entry.rel),
                    kind: ChangeKind::Create,
                });
            }
            if let Some(d) = entry.dir {
                if found.len() + self.dirs.len() < MAX_WATCHED_DIRS {
                    found.push((d.try_clone_to_owned()?, rel.join(entry.rel)));
                } else {
                    self.unwatched += 1;
                }
            }
            Ok(())
        });
        for (fd, sub) in found {
            let _ = self.add(fd.as_fd(), sub);
        }
    }

    /// The next changes, waiting for at least one event.
    pub async fn next(&mut self) -> std::io::Result<Changes> {
        loop {
            let mut raw: Vec<(i32, ReadFlags, Option<Vec<u8>>)> = Vec::new();
            let mut guard = self.inotify.readable().await?;
            let read = guard.try_io(|fd| {
                let mut buf = [MaybeUninit::<u8>::uninit(); 64 << 10];
                let mut reader = inotify::Reader::new(fd.get_ref(), &mut buf);
                loop {
                    match reader.next() {
                        Ok(ev) => raw.push((
                            ev.wd(),
                            ev.events(),
                            ev.file_name().map(|n| n.to_bytes().to_vec()),
                        )),
                        Err(rustix::io::Errno::AGAIN) if !raw.is_empty() => return Ok(()),
                        Err(e) => return Err(std::io::Error::from(e)),
                    }
                    if reader.is_buffer_empty() {
                        return Ok(());
                    }
                }
            });
            match read {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
            let changes = self.changes(raw);
            if !changes.changes.is_empty() || changes.overflowed {
                return Ok(changes);
            }
        }
    }

    fn changes(&mut self, raw: Vec<(i32, ReadFlags, Option<Vec<u8>>)>) -> Changes {
        let mut out = Changes::default();
        for (wd, mask, name) in raw {
            if mask.contains(ReadFlags::QUEUE_OVERFLOW) {
                out.overflowed = true;
                continue;
            }
            if mask.contains(ReadFlags::IGNORED) {
                self.dirs.remove(&wd);
                continue;
            }
            let Some(dir) = self.dirs.get(&wd) else {
                continue;
            };
            let self_event = name.is_none();
            // A subdirectory's own removal or move is reported by its parent, by name.
            if self_event && !dir.as_os_str().is_empty() {
                continue;
            }
            // The broker's own uploads are written beside their target and renamed over it:
            // their temporary name is not the user's (the rename shows as the target's
            // creation).
            if name
                .as_deref()
                .is_some_and(|n| n.starts_with(UPLOAD_TEMP_PREFIX.as_bytes()))
            {
                continue;
            }
            let rel = match &name {
                Some(n) => dir.join(OsStr::from_bytes(n)),
                None => dir.clone(),
            };
            let kinds = [
                (ReadFlags::CREATE | ReadFlags::MOVED_TO, ChangeKind::Create),
                (
                    ReadFlags::MOVED_FROM | ReadFlags::MOVE_SELF,
                    ChangeKind::Rename,
                ),
                (ReadFlags::ATTRIB, ChangeKind::Chmod),
                (ReadFlags::MODIFY, ChangeKind::Write),
                (
                    ReadFlags::DELETE | ReadFlags::DELETE_SELF,
                    ChangeKind::Remove,
                ),
            ];
            for (flags, kind) in kinds {
                if mask.intersects(flags) {
                    out.changes.push(Change {
                        rel: rel.clone(),
                        kind,
                    });
                }
            }
            let new_dir = mask.contains(ReadFlags::ISDIR)
                && mask.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO);
            if self.recursive && new_dir {
                // Opened beneath the watched directory with no symlink followed: a symlink
                // swapped in meanwhile fails here and is not watched.
                if let Ok(fd) = open_beneath(&self.top, &rel, libc::O_DIRECTORY | libc::O_RDONLY, 0)
                {
                    if self.add(fd.as_fd(), rel.clone()).is_ok() {
                        self.add_below(&fd, &rel, Some(&mut out.changes));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn collect(w: &mut DirWatch, want: usize) -> Vec<Change> {
        let mut got = Vec::new();
        while got.len() < want {
            match tokio::time::timeout(Duration::from_secs(5), w.next()).await {
                Ok(Ok(c)) => got.extend(c.changes),
                _ => break,
            }
        }
        got
    }

    #[tokio::test]
    async fn changes_are_seen_recursively_and_links_are_never_watched() {
        let ws = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        std::fs::create_dir(ws.path().join("w")).unwrap();
        std::os::unix::fs::symlink(host.path(), ws.path().join("w/to-host")).unwrap();
        let mut w = DirWatch::new(ws.path(), "w", true).unwrap();
        assert_eq!(w.dirs.len(), 1);
        std::fs::write(ws.path().join("w/a.txt"), b"x").unwrap();
        std::fs::create_dir(ws.path().join("w/sub")).unwrap();
        let got = collect(&mut w, 3).await;
        assert!(got.contains(&Change {
            rel: "a.txt".into(),
            kind: ChangeKind::Create
        }));
        assert!(got.contains(&Change {
            rel: "sub".into(),
            kind: ChangeKind::Create
        }));
        // What appears in a new directory before its watch is added is reported too.
        std::fs::create_dir_all(ws.path().join("w/quick/er")).unwrap();
        std::fs::write(ws.path().join("w/quick/er/f"), b"f").unwrap();
        let got = collect(&mut w, 3).await;
        assert!(
            got.iter().any(|c| c.rel == Path::new("quick/er/f")),
            "{got:?}"
        );
        // Uploads' temporary names are not reported.
        super::super::write(ws.path(), "w/up.txt", b"u", None).unwrap();
        let got = collect(&mut w, 1).await;
        assert!(
            got.iter()
                .all(|c| !c.rel.to_string_lossy().contains(".kb-upload")),
            "{got:?}"
        );
        assert!(got.iter().any(|c| c.rel == Path::new("up.txt")), "{got:?}");
        // The new directory is watched: a file made in it is seen.
        std::fs::write(ws.path().join("w/sub/b.txt"), b"y").unwrap();
        let got = collect(&mut w, 1).await;
        assert!(
            got.iter().any(|c| c.rel == Path::new("sub/b.txt")),
            "{got:?}"
        );
        // Nothing on the host side of the link is watched.
        std::fs::write(host.path().join("secret"), b"s").unwrap();
        let got = tokio::time::timeout(Duration::from_millis(300), w.next()).await;
        assert!(got.is_err(), "{got:?}");
        // A link given as the directory to watch is refused.
        assert!(DirWatch::new(ws.path(), "w/to-host", true).is_err());
        assert!(DirWatch::new(ws.path(), "../", true).is_err());
    }
}
