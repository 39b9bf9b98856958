//! Sessions that outlive the broker (`--keep-sessions`): the record each session keeps in
//! `<data_dir>/sessions/<id>.json`, from which the next run adopts it.
//!
//! A record holds what the session layer alone knows: owner, kernel spec, creation time,
//! idle timeout, limits, the kernel's HMAC key, the execution count, the last activity (wall
//! clock, so that time spent down counts against the idle deadline) and why the session is
//! dead, if it is. How to find the kernel process again is the sandbox's to keep (its own
//! files, by session id).
//!
//! Records are written whenever the kernel changes (creation, restart) and at the broker's
//! stop, and refreshed every few seconds while anything else changes (execution count,
//! activity), so after a `kill -9` the adopted state is at most that old. Each write is
//! atomic (temporary file and rename) and runs on a blocking thread; a session's
//! [`RecordFile`] serialises its own writes and removal, so they land in order and nothing
//! is written after the removal.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::front_door::{FrontDoor, Metadata};
use crate::private_file;

/// The largest record read back (they are well under 1 KiB).
const MAX_RECORD: u64 = 64 << 10;

/// What the next run needs to adopt a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    pub created_at: DateTime<Utc>,
    /// `None`: never expires.
    pub idle_timeout_seconds: Option<u64>,
    pub memory_limit_bytes: u64,
    pub pids_limit: u64,
    /// The HMAC key of the session's kernel now (a restart changes it).
    pub key: String,
    pub execution_count: u64,
    pub last_activity: DateTime<Utc>,
    /// Set when the session was dead: it stays dead, with this reason, until restarted.
    pub dead_reason: Option<String>,
    /// When this record was written; with [`Self::stopped`], when the broker let go.
    pub saved_at: DateTime<Utc>,
    /// Written by the broker's orderly stop (not after a crash or `kill -9`).
    #[serde(default)]
    pub stopped: bool,
    /// The front door that made the session (records before it knew: `rest`).
    #[serde(default)]
    pub front_door: FrontDoor,
    #[serde(default)]
    pub metadata: Metadata,
    /// The own workspace its kernels work in (records before there were any: none).
    #[serde(default)]
    pub own_workspace: Option<Uuid>,
    /// Paused (issue 37): the kernel id of its images (`sandbox/pause.rs`), which the next
    /// run resumes it from. Such records are kept in `<data_dir>/paused-sessions`.
    #[serde(default)]
    pub paused_kernel: Option<Uuid>,
    /// The id the sandbox keeps the session's kernel under when it is not the session's
    /// (a kernel a resume or a rewind made): what the next run adopts.
    #[serde(default)]
    pub kernel_id: Option<Uuid>,
    /// Its secrets, sealed (`secrets::seal`): never verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<String>,
}

/// The records' directory.
pub struct KeptSessions {
    dir: PathBuf,
}

impl KeptSessions {
    /// Creates `dir` (0700) if needed.
    pub fn open(dir: &Path) -> io::Result<Arc<Self>> {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        Ok(Arc::new(Self {
            dir: dir.to_path_buf(),
        }))
    }

    fn path(&self, id: Uuid) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Writes `record` on a blocking thread and waits for it.
    pub async fn save(self: &Arc<Self>, record: SessionRecord) {
        let this = self.clone();
        let id = record.id;
        let written = tokio::task::spawn_blocking(move || this.write(&record)).await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(session = %id, error = %e, "cannot write the session's record (--keep-sessions)")
            }
            Err(e) => tracing::warn!(session = %id, error = %e, "the session record writer failed"),
        }
    }

    fn write(&self, record: &SessionRecord) -> io::Result<()> {
        let bytes = serde_json::to_vec(record).map_err(io::Error::other)?;
        private_file::write_atomic(&self.dir, &format!("{}.json", record.id), &bytes)
    }

    /// Removes `id`'s record: the session is gone for good.
    pub async fn remove(self: &Arc<Self>, id: Uuid) {
        let this = self.clone();
        let _ = tokio::task::spawn_blocking(move || match std::fs::remove_file(this.path(id)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "cannot remove the session's record")
            }
        })
        .await;
    }

    /// Every record an earlier run left; unreadable ones are reported and removed.
    /// Blocking.
    pub fn load_all(&self) -> Vec<SessionRecord> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut records = Vec::new();
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if private_file::is_leftover(&name) {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            match read_record(&path) {
                Ok(r) if r.id.to_string() == stem => records.push(r),
                Ok(_) | Err(_) => {
                    tracing::warn!(path = %path.display(), "removing an unreadable session record");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        records.sort_by_key(|r| r.created_at);
        records
    }
}

/// One session's record, as its handle writes it: writes and the removal in the order
/// they are asked for, nothing after the removal, and no write that would change nothing.
///
/// Its lock is held across each write or removal of the file: that is what it is for. Two
/// writes (an execution's count, a restart's new key) or a write and the removal must land
/// in the order they were asked for; a tokio `Mutex` is exactly that queue. It guards
/// nothing anyone else reads (the session's status and state have their own homes), so no
/// reader ever waits on a file.
pub(crate) struct RecordFile {
    kept: Arc<KeptSessions>,
    written: tokio::sync::Mutex<Written>,
}

struct Written {
    /// The last record written, to skip writes that would change nothing.
    last: Option<SessionRecord>,
    /// `true` once the record is removed for good.
    forgotten: bool,
}

impl RecordFile {
    pub fn new(kept: Arc<KeptSessions>) -> Self {
        Self {
            kept,
            written: tokio::sync::Mutex::new(Written {
                last: None,
                forgotten: false,
            }),
        }
    }

    /// Writes the record `now` makes (asked for once it is this write's turn, so it is the
    /// latest), unless it says what the last one did but for its time, or the record is
    /// removed.
    pub async fn save(&self, now: impl FnOnce() -> SessionRecord) {
        let mut written = self.written.lock().await;
        if written.forgotten {
            return;
        }
        let record = now();
        let same = written.last.as_ref().is_some_and(|l| {
            SessionRecord {
                saved_at: record.saved_at,
                ..l.clone()
            } == record
        });
        if same {
            return;
        }
        written.last = Some(record.clone());
        self.kept.save(record).await;
        drop(written);
    }

    /// Removes session `id`'s record until its next save (a paused session's kernel is
    /// gone; the session's paused record stands for it until a resume makes one again).
    pub async fn set_aside(&self, id: Uuid) {
        let mut written = self.written.lock().await;
        if written.forgotten {
            return;
        }
        written.last = None;
        self.kept.remove(id).await;
    }

    /// Removes session `id`'s record for good.
    pub async fn remove(&self, id: Uuid) {
        let mut written = self.written.lock().await;
        written.forgotten = true;
        self.kept.remove(id).await;
    }
}

fn read_record(path: &Path) -> io::Result<SessionRecord> {
    let bytes = private_file::read_capped(path, MAX_RECORD)?;
    serde_json::from_slice(&bytes).map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: Uuid, count: u64) -> SessionRecord {
        SessionRecord {
            id,
            user: "alice".into(),
            kernel: "python3".into(),
            created_at: Utc::now(),
            idle_timeout_seconds: Some(600),
            memory_limit_bytes: 256 << 20,
            pids_limit: 128,
            key: "k".into(),
            execution_count: count,
            last_activity: Utc::now(),
            dead_reason: None,
            saved_at: Utc::now(),
            stopped: false,
            front_door: FrontDoor::E2b,
            metadata: Metadata::default(),
            own_workspace: None,
            paused_kernel: None,
            kernel_id: None,
            secrets: None,
        }
    }

    #[tokio::test]
    async fn records_are_saved_loaded_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let kept = KeptSessions::open(&dir.path().join("sessions")).unwrap();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        kept.save(record(a, 1)).await;
        kept.save(record(a, 2)).await;
        kept.save(record(b, 7)).await;
        std::fs::write(dir.path().join("sessions/junk.json"), b"{").unwrap();
        std::fs::write(
            dir.path().join(format!("sessions/{}.json", Uuid::new_v4())),
            serde_json::to_vec(&record(a, 3)).unwrap(),
        )
        .unwrap();
        let loaded = kept.load_all();
        assert_eq!(loaded.len(), 2, "{loaded:?}");
        assert_eq!(
            loaded.iter().find(|r| r.id == a).unwrap().execution_count,
            2
        );
        // The junk and the record filed under another id are gone.
        assert_eq!(
            std::fs::read_dir(dir.path().join("sessions"))
                .unwrap()
                .count(),
            2
        );
        kept.remove(a).await;
        assert_eq!(kept.load_all().len(), 1);
    }

    #[tokio::test]
    async fn a_record_file_writes_changes_only_and_nothing_after_its_removal() {
        let dir = tempfile::tempdir().unwrap();
        let kept = KeptSessions::open(&dir.path().join("sessions")).unwrap();
        let id = Uuid::new_v4();
        let file = RecordFile::new(kept.clone());
        let first = record(id, 1);
        file.save(|| first.clone()).await;
        // The same record but for its time is not written again.
        std::fs::remove_file(kept.path(id)).unwrap();
        file.save(|| SessionRecord {
            saved_at: Utc::now(),
            ..first.clone()
        })
        .await;
        assert!(
            kept.load_all().is_empty(),
            "an unchanged record was written"
        );
        file.save(|| record(id, 2)).await;
        assert_eq!(kept.load_all()[0].execution_count, 2);
        file.remove(id).await;
        file.save(|| record(id, 3)).await;
        assert!(kept.load_all().is_empty(), "written after its removal");
    }
}
