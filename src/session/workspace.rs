//! [`Workspace`]: a session's workspace files as the front doors reach them, async. Every
//! operation resolves its path beneath the workspace with no symlink followed
//! (`session::files`), runs on the blocking pool, and creates what it creates as the user's
//! kernel identity (`Sandbox::workspace_owner`), so the kernel can overwrite, move and
//! delete it. The REST files API, E2B's envd and MCP's tools and resources all go through
//! it; none of them names the sandbox. What it changes (written, removed, moved) is reported
//! to the recording as the session's events, as its kernel's own messages are.

use std::path::PathBuf;
use std::sync::Arc;

use super::error::SessionError;
use super::files::{self, Entry, Listing};
use super::handle::Session;
use super::lifecycle::LifecycleEvent;
use super::registry::Registry;

/// The workspace of one session's user.
#[derive(Clone)]
pub struct Workspace {
    root: Arc<PathBuf>,
    /// Who owns what the broker creates here (the kernel's uid and gid); `None`: as it falls.
    owner: Option<(u32, u32)>,
    /// Where changes are reported: the registry, for the session they were made through.
    registry: Registry,
    session: Arc<Session>,
}

impl Registry {
    /// The workspace of `session`: its own, if it has one the sandbox made, else its
    /// user's shared one.
    pub fn workspace(&self, session: &Arc<Session>) -> Result<Workspace, SessionError> {
        let sandbox = self.sandbox();
        let unavailable = |source| SessionError::WorkspaceUnavailable {
            user: session.user.name.clone(),
            source,
        };
        let own = match session.own_workspace {
            Some(key) => sandbox
                .own_workspace(&session.user, key)
                .map_err(unavailable)?,
            None => None,
        };
        let root = match own {
            Some(root) => root,
            None => sandbox.workspace(&session.user).map_err(unavailable)?,
        };
        Ok(Workspace {
            root: Arc::new(root),
            owner: sandbox.workspace_owner(&session.user),
            registry: self.clone(),
            session: session.clone(),
        })
    }
}

/// Runs `work` on the blocking pool; a task that did not finish (it panicked) is
/// [`SessionError::TaskFailed`].
async fn blocking<T: Send + 'static>(
    op: &'static str,
    work: impl FnOnce() -> Result<T, SessionError> + Send + 'static,
) -> Result<T, SessionError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|source| SessionError::TaskFailed { op, source })?
}

/// The file system a workspace is on: what it holds and what it can hold, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    pub used: u64,
    pub total: u64,
}

impl Workspace {
    /// The workspace's file system, as `df` counts it (used: all blocks but those free to
    /// users): with a quota its own file system of the quota's size, else the host's.
    pub async fn disk_usage(&self) -> Result<DiskUsage, SessionError> {
        let root = self.root.clone();
        blocking("measure the workspace", move || {
            let st = rustix::fs::statvfs(root.as_path()).map_err(|e| SessionError::FileIo {
                op: "measure",
                path: PathBuf::from("."),
                source: e.into(),
            })?;
            let total = st.f_blocks.saturating_mul(st.f_frsize);
            let free = st.f_bavail.saturating_mul(st.f_frsize);
            Ok(DiskUsage {
                used: total.saturating_sub(free),
                total,
            })
        })
        .await
    }

    /// The regular files under the workspace, at most `limit` (see [`files::list`]).
    pub async fn list(&self, limit: usize) -> Result<Listing, SessionError> {
        let root = self.root.clone();
        blocking("list files", move || files::list(&root, limit)).await
    }

    /// `rel` opened for reading, with its size at opening; refused past `max` bytes.
    pub async fn open_for_read(
        &self,
        rel: &str,
        max: usize,
    ) -> Result<(std::fs::File, u64), SessionError> {
        let (root, rel) = (self.root.clone(), rel.to_string());
        blocking("read file", move || files::open_for_read(&root, &rel, max)).await
    }

    /// The bytes of `rel`; refused past `max` bytes.
    pub async fn read(&self, rel: &str, max: usize) -> Result<Vec<u8>, SessionError> {
        let (root, rel) = (self.root.clone(), rel.to_string());
        blocking("read file", move || files::read(&root, &rel, max)).await
    }

    /// Writes `data` to `rel`, creating its parent directories.
    pub async fn write(
        &self,
        rel: &str,
        data: impl AsRef<[u8]> + Send + 'static,
    ) -> Result<(), SessionError> {
        let (root, path, owner) = (self.root.clone(), rel.to_string(), self.owner);
        let bytes = data.as_ref().len() as u64;
        let content = self.kept_content(data.as_ref());
        blocking("write file", move || {
            files::write(&root, &path, data.as_ref(), owner)
        })
        .await?;
        self.report(LifecycleEvent::FileWritten {
            path: rel.to_string(),
            bytes,
            content,
        });
        Ok(())
    }

    /// [`Self::write`], with `metadata` stored on the file (`files::metadata`).
    pub async fn write_with_metadata(
        &self,
        rel: &str,
        data: impl AsRef<[u8]> + Send + 'static,
        metadata: files::Metadata,
    ) -> Result<(), SessionError> {
        let (root, path, owner) = (self.root.clone(), rel.to_string(), self.owner);
        let bytes = data.as_ref().len() as u64;
        let content = self.kept_content(data.as_ref());
        blocking("write file", move || {
            files::write_with_metadata(&root, &path, data.as_ref(), owner, Some(&metadata))
        })
        .await?;
        self.report(LifecycleEvent::FileWritten {
            path: rel.to_string(),
            bytes,
            content,
        });
        Ok(())
    }

    /// Deletes what is at `rel`, a directory with everything in it (never following a
    /// symlink: `files::remove_all`); `false` when there was nothing.
    pub async fn remove_all(&self, rel: &str) -> Result<bool, SessionError> {
        let (root, path) = (self.root.clone(), rel.to_string());
        let removed = blocking("delete", move || files::remove_all(&root, &path)).await?;
        if removed {
            self.report(LifecycleEvent::FileRemoved {
                path: rel.to_string(),
            });
        }
        Ok(removed)
    }

    /// Moves `from` to `to`, replacing what `rename(2)` replaces (`files::rename_over`).
    pub async fn rename_over(&self, from: &str, to: &str) -> Result<(), SessionError> {
        let (root, owner) = (self.root.clone(), self.owner);
        let (from, to) = (from.to_string(), to.to_string());
        let (f, t) = (from.clone(), to.clone());
        blocking("move file", move || {
            files::rename_over(&root, &f, &t, owner)
        })
        .await?;
        self.report(LifecycleEvent::FileRenamed { from, to });
        Ok(())
    }

    /// A watch on directory `rel` (and below it, if `recursive`): `files::watch`.
    pub async fn watch(
        &self,
        rel: &str,
        recursive: bool,
    ) -> Result<files::watch::DirWatch, SessionError> {
        let (root, rel) = (self.root.clone(), rel.to_string());
        blocking("watch a directory", move || {
            files::watch::DirWatch::new(&root, &rel, recursive)
        })
        .await
    }

    /// The name of the account `id` (a uid or a gid of an entry here) as the session's
    /// sandbox names it: a session with a workspace of its own names its kernel's uid and
    /// gid `user` (E2B's sandbox user, `sandbox/own_workspace.rs`); 0 is `root`; any other id
    /// stays a number.
    pub fn account_name(&self, id: u32) -> String {
        let kernel = self.owner.is_some_and(|(uid, gid)| id == uid || id == gid);
        match id {
            0 => "root".to_string(),
            _ if kernel && self.session.own_workspace.is_some() => {
                crate::sandbox::OWN_WORKSPACE_LOGIN.to_string()
            }
            _ => id.to_string(),
        }
    }

    /// What the recording keeps of a file written: its bytes, for a session with a
    /// workspace of its own (which ends with it: a replay writes them again), up to
    /// [`RECORDED_FILE_MAX`]; nothing for the shared workspace, which outlives the session.
    fn kept_content(&self, data: &[u8]) -> Option<std::sync::Arc<[u8]>> {
        (self.session.own_workspace.is_some() && data.len() <= RECORDED_FILE_MAX)
            .then(|| std::sync::Arc::from(data))
    }

    fn report(&self, event: LifecycleEvent) {
        self.registry.report(&self.session, &event);
    }

    /// Deletes the file, symlink or empty directory at `rel`.
    pub async fn remove(&self, rel: &str) -> Result<(), SessionError> {
        let (root, path) = (self.root.clone(), rel.to_string());
        blocking("delete file", move || files::remove(&root, &path)).await?;
        self.report(LifecycleEvent::FileRemoved {
            path: rel.to_string(),
        });
        Ok(())
    }

    /// Moves `from` to `to`, never replacing; `to`'s missing directories are created.
    pub async fn rename(&self, from: &str, to: &str) -> Result<(), SessionError> {
        let (root, owner) = (self.root.clone(), self.owner);
        let (from, to) = (from.to_string(), to.to_string());
        let (f, t) = (from.clone(), to.clone());
        blocking("move file", move || files::rename(&root, &f, &t, owner)).await?;
        self.report(LifecycleEvent::FileRenamed { from, to });
        Ok(())
    }

    /// The entries under the directory `rel`, `depth` levels down, and whether a bound cut
    /// the listing short.
    pub async fn list_dir(
        &self,
        rel: &str,
        depth: usize,
    ) -> Result<(Vec<Entry>, bool), SessionError> {
        let (root, rel) = (self.root.clone(), rel.to_string());
        blocking("list a directory", move || {
            files::list_dir(&root, &rel, depth)
        })
        .await
    }

    /// The entry at `rel` ("" is the workspace itself).
    pub async fn stat(&self, rel: &str) -> Result<Entry, SessionError> {
        let (root, rel) = (self.root.clone(), rel.to_string());
        blocking("stat", move || files::stat(&root, &rel)).await
    }

    /// Makes the directory `rel` and its parents; `false` when it already was there.
    pub async fn make_dir(&self, rel: &str) -> Result<bool, SessionError> {
        let (root, rel, owner) = (self.root.clone(), rel.to_string(), self.owner);
        blocking("make a directory", move || {
            files::make_dir(&root, &rel, owner)
        })
        .await
    }
}

/// The largest file written through the API whose content a recording keeps (a session
/// with a workspace of its own): 2 MiB. Within the recording's own per-session bounds.
pub const RECORDED_FILE_MAX: usize = 2 << 20;
