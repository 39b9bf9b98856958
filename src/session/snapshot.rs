//! Snapshots (issue 37): a named, persistent copy of a session's state that any number of
//! new sessions of the same user start from. The sandbox keeps the images and the copy of
//! the workspace (`sandbox/local/snapshot.rs`); this is the session layer's book of them:
//! whose each is, its name, the session and execution it was taken at, and its record in
//! `<data_dir>/snapshot-records/<id>.json` (root's, 0700), from which the next run takes it
//! back with its images.
//!
//! A session starting from a snapshot holds it for reading (its images are restored, its
//! workspace copied); a delete waits for those starts, then removes it.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::error::SessionError;
use crate::private_file;
use crate::sandbox::pause::PausedImage;
use crate::sync::lock;

/// The most snapshots one user may keep (each is a kernel's memory and a workspace on disk).
pub const MAX_SNAPSHOTS_PER_USER: usize = 32;
/// The longest snapshot name.
pub const MAX_NAME_LEN: usize = 128;
/// The largest record read back (they are well under 1 KiB).
const MAX_RECORD: u64 = 64 << 10;

/// What is known of a snapshot (the API shows it as `api/snapshots.rs`'s `SnapshotJson`),
/// and what its record keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// The snapshot's id: a session starts from it (`"snapshot"` of a create).
    pub snapshot_id: Uuid,
    /// The name it was given (several snapshots may share one; the newest answers to it).
    pub name: Option<String>,
    /// The session it was taken of.
    pub session_id: Uuid,
    /// The kernel spec its sessions run.
    pub kernel: String,
    /// The execution count it was taken at: its sessions go on from it.
    pub execution_count: u64,
    pub created_at: DateTime<Utc>,
    /// The memory limit of the session it was taken of: its sessions' default.
    pub memory_limit_bytes: u64,
    /// What its images take on disk (its copy of the workspace not counted).
    pub image_bytes: u64,
}

/// A snapshot's record: its owner and what the API says of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SnapshotRecord {
    /// Whose it is: only they see it and start sessions from it.
    pub user: String,
    #[serde(flatten)]
    pub info: SnapshotInfo,
}

/// A snapshot the broker holds.
pub(crate) struct Snapshot {
    pub user: String,
    pub info: SnapshotInfo,
    pub image: PausedImage,
    /// Held for reading by each session starting from it; for writing by its delete.
    pub in_use: tokio::sync::RwLock<bool>,
}

impl Snapshot {
    /// Where a session started from it comes from (its recording says so).
    pub fn lineage(&self) -> super::lifecycle::ForkedFrom {
        super::lifecycle::ForkedFrom {
            session: self.info.session_id,
            execution_count: self.info.execution_count,
            checkpoint: None,
        }
    }
}

/// Every user's snapshots, and their records' directory.
pub(crate) struct Snapshots {
    map: Mutex<HashMap<Uuid, Arc<Snapshot>>>,
    /// Snapshots being taken, per user (counted against the limit).
    taking: Mutex<HashMap<String, usize>>,
    dir: Option<PathBuf>,
}

impl Snapshots {
    /// The book, its records kept in `dir` (made 0700; `None`: snapshots end with the
    /// broker).
    pub fn open(dir: Option<&Path>) -> Self {
        let dir = dir.and_then(|d| {
            std::fs::create_dir_all(d)
                .and_then(|()| {
                    std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                })
                .inspect_err(|e| tracing::error!(dir = %d.display(), error = %e, "cannot keep snapshots' records: snapshots will NOT survive a restart"))
                .ok()
                .map(|()| d.to_path_buf())
        });
        Self {
            map: Mutex::default(),
            taking: Mutex::default(),
            dir,
        }
    }

    /// `user`'s snapshot `id`.
    pub fn get(&self, user: &str, id: Uuid) -> Result<Arc<Snapshot>, SessionError> {
        lock(&self.map)
            .get(&id)
            .filter(|s| s.user == user)
            .cloned()
            .ok_or(SessionError::SnapshotNotFound(id))
    }

    /// `user`'s newest snapshot named `name`.
    pub fn named(&self, user: &str, name: &str) -> Option<Arc<Snapshot>> {
        lock(&self.map)
            .values()
            .filter(|s| s.user == user && s.info.name.as_deref() == Some(name))
            .max_by_key(|s| s.info.created_at)
            .cloned()
    }

    /// `user`'s snapshots, oldest first.
    pub fn list(&self, user: &str) -> Vec<SnapshotInfo> {
        let mut all: Vec<SnapshotInfo> = lock(&self.map)
            .values()
            .filter(|s| s.user == user)
            .map(|s| s.info.clone())
            .collect();
        all.sort_by_key(|s| (s.created_at, s.snapshot_id));
        all
    }

    /// A place among `user`'s snapshots for one being taken, or the limit's error. Given
    /// back by [`Self::untake`].
    pub fn take_place(&self, user: &str) -> Result<(), SessionError> {
        let map = lock(&self.map);
        let mut taking = lock(&self.taking);
        let held = map.values().filter(|s| s.user == user).count();
        let pending = taking.entry(user.to_string()).or_default();
        if held + *pending >= MAX_SNAPSHOTS_PER_USER {
            return Err(SessionError::TooManySnapshots {
                user: user.to_string(),
                max: MAX_SNAPSHOTS_PER_USER,
            });
        }
        *pending += 1;
        Ok(())
    }

    pub fn untake(&self, user: &str) {
        let mut taking = lock(&self.taking);
        if let Some(n) = taking.get_mut(user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                taking.remove(user);
            }
        }
    }

    /// Adds `snapshot`, its record written (synced) first: a snapshot that is answered
    /// outlives the broker. If the record cannot be written, its images come back.
    pub async fn insert(&self, snapshot: Snapshot) -> Result<(), (io::Error, PausedImage)> {
        if let Some(dir) = self.dir.clone() {
            let record = SnapshotRecord {
                user: snapshot.user.clone(),
                info: snapshot.info.clone(),
            };
            let written = tokio::task::spawn_blocking(move || {
                let bytes = serde_json::to_vec(&record).map_err(io::Error::other)?;
                let name = format!("{}.json", record.info.snapshot_id);
                private_file::write_atomic(&dir, &name, &bytes)
            })
            .await
            .map_err(io::Error::other)
            .and_then(|r| r);
            if let Err(e) = written {
                return Err((e, snapshot.image));
            }
        }
        self.adopt(snapshot);
        Ok(())
    }

    /// Adds `snapshot` as it is (taken back at startup).
    pub fn adopt(&self, snapshot: Snapshot) {
        lock(&self.map).insert(snapshot.info.snapshot_id, Arc::new(snapshot));
    }

    /// Takes `user`'s snapshot `id` out of the book, its record removed.
    pub async fn remove(&self, user: &str, id: Uuid) -> Result<Arc<Snapshot>, SessionError> {
        let removed = {
            let mut map = lock(&self.map);
            match map.get(&id) {
                Some(s) if s.user == user => map.remove(&id),
                _ => None,
            }
        }
        .ok_or(SessionError::SnapshotNotFound(id))?;
        self.forget_record(id).await;
        Ok(removed)
    }

    /// Every record an earlier run left; unreadable ones are reported and removed.
    pub async fn load_all(&self) -> Vec<SnapshotRecord> {
        let Some(dir) = self.dir.clone() else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || load_records(&dir))
            .await
            .unwrap_or_default()
    }

    /// Removes the record of `id` (its images are gone), in a blocking task.
    pub async fn forget_record(&self, id: Uuid) {
        let Some(dir) = self.dir.clone() else {
            return;
        };
        let _ = tokio::task::spawn_blocking(move || {
            match std::fs::remove_file(dir.join(format!("{id}.json"))) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(snapshot = %id, error = %e, "cannot remove the snapshot's record")
                }
            }
        })
        .await;
    }
}

/// The records in `dir`; unreadable ones are reported and removed. Blocking.
fn load_records(dir: &Path) -> Vec<SnapshotRecord> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut records = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if private_file::is_leftover(&name) {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let stem = name.strip_suffix(".json").unwrap_or_default();
        let read = private_file::read_capped(&path, MAX_RECORD)
            .ok()
            .and_then(|b| serde_json::from_slice::<SnapshotRecord>(&b).ok());
        match read {
            Some(r) if r.info.snapshot_id.to_string() == stem => records.push(r),
            _ => {
                tracing::warn!(path = %path.display(), "removing an unreadable snapshot record");
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    records
}

/// A snapshot name as given, or why it is refused: 1 to [`MAX_NAME_LEN`] letters, digits
/// and `-_.:/` (E2B's `project/name:tag` fits).
pub fn check_name(name: &str) -> Result<(), SessionError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(SessionError::SnapshotMismatch(format!(
            "a snapshot name is 1 to {MAX_NAME_LEN} letters, digits and -_.:/ characters"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_and_plain() {
        for good in [
            "a",
            "my-snapshot",
            "team/data:v2",
            &"x".repeat(MAX_NAME_LEN),
        ] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "a b",
            "../x\n",
            "é",
            &"x".repeat(MAX_NAME_LEN + 1),
            "a\0b",
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_limit_counts_snapshots_being_taken_and_records_are_read_back_checked() {
        let dir = tempfile::tempdir().unwrap();
        let book = Snapshots::open(Some(dir.path()));
        for _ in 0..MAX_SNAPSHOTS_PER_USER {
            book.take_place("alice").unwrap();
        }
        assert!(matches!(
            book.take_place("alice"),
            Err(SessionError::TooManySnapshots { .. })
        ));
        assert!(book.take_place("bob").is_ok());
        book.untake("alice");
        assert!(book.take_place("alice").is_ok());

        let id = Uuid::new_v4();
        let info = SnapshotInfo {
            snapshot_id: id,
            name: Some("n".into()),
            session_id: Uuid::new_v4(),
            kernel: "python3".into(),
            execution_count: 3,
            created_at: Utc::now(),
            memory_limit_bytes: 1 << 28,
            image_bytes: 10,
        };
        let record = SnapshotRecord {
            user: "alice".into(),
            info,
        };
        let bytes = serde_json::to_vec(&record).unwrap();
        private_file::write_atomic(dir.path(), &format!("{id}.json"), &bytes).unwrap();
        // A record under another id's name, and one that is not JSON, go.
        let other = Uuid::new_v4();
        private_file::write_atomic(dir.path(), &format!("{other}.json"), &bytes).unwrap();
        std::fs::write(dir.path().join(format!("{}.json", Uuid::new_v4())), b"{").unwrap();
        let loaded = load_records(dir.path());
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0], record);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
