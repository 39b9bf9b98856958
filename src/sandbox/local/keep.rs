//! Kernels that outlive the broker (`--keep-sessions`), local backend: what a launch leaves
//! behind so that the next run can find, verify and watch the kernel again.
//!
//! Per kept kernel, in `<data_dir>/kept-local/` (0700, the broker's alone: no kernel sees
//! it), two files:
//! - `<session>.json`, the [`Ticket`]: who the kernel is for and the host pids of bwrap and
//!   of the sandbox's init, each with its start time (`/proc/<pid>/stat` field 22), so a pid
//!   reused by another process after the kernel ended is never taken for it;
//! - `<session>.status`, bwrap's `--json-status-fd` output: bwrap writes `{"exit-code": N}`
//!   there when the sandbox's command ends, whoever its parent is by then. That is how an
//!   adopted kernel's end (which this broker cannot `waitpid`: it is not its child) is still
//!   told apart as an exit code or a signal.
//!
//! An adopted kernel is watched through a pidfd of its bwrap process (readable once it has
//! ended); the runtime directory and cgroup leaf are found where the launch put them.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::private_file;
use crate::sandbox::procfs;
use crate::sync::lock;

/// The largest ticket or status file read back (they are a few hundred bytes; anything
/// bigger was not written by the broker or bwrap).
const MAX_FILE: u64 = 64 << 10;

/// What the next run needs to find a kept kernel again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Ticket {
    pub session: Uuid,
    pub user: String,
    /// Host pid of bwrap and its start time in clock ticks since boot.
    pub bwrap_pid: i32,
    pub bwrap_start: u64,
    /// Host pid of the sandbox's init (pid 1 inside) and its start time.
    pub init_pid: i32,
    pub init_start: u64,
    /// A kernel CRIU restored in the sandbox (a resume, a copy, a session from a
    /// snapshot): its host pid and start time. The sandbox's command is CRIU then, which
    /// waits for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<(i32, u64)>,
    /// The workspace of its own the kernel works in: the start-up sweep spares it (a
    /// resumed kernel is kept under a kernel id of its own, not its session's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_workspace: Option<Uuid>,
}

/// The kept kernels' files, and the tickets found at start-up not yet adopted.
pub(super) struct KeptKernels {
    dir: PathBuf,
    found: Mutex<HashMap<Uuid, Ticket>>,
}

impl KeptKernels {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.join("kept-local"),
            found: Mutex::default(),
        }
    }

    /// Creates the directory and reads the tickets an earlier run left; returns their
    /// sessions (whose runtime directories and leaves the start-up sweep must spare).
    /// Unreadable tickets are removed. Blocking.
    pub fn load(&self) -> io::Result<HashSet<Uuid>> {
        crate::sandbox::fsutil::create_private_dir(&self.dir, Some(0o700))
            .map_err(|e| io::Error::other(e.to_string()))?;
        let mut found = lock(&self.found);
        for entry in std::fs::read_dir(&self.dir)?.filter_map(Result::ok) {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            match read_small(&path).and_then(|bytes| {
                serde_json::from_slice::<Ticket>(&bytes).map_err(io::Error::other)
            }) {
                Ok(t) if path.file_stem() == Some(t.session.to_string().as_ref()) => {
                    found.insert(t.session, t);
                }
                Ok(_) | Err(_) => {
                    tracing::warn!(path = %path.display(), "removing an unreadable kept-kernel ticket");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(found.keys().copied().collect())
    }

    /// Removes every ticket of `data_dir` (a run that does not keep kernels ends them).
    pub fn forget_all(data_dir: &Path) {
        let dir = data_dir.join("kept-local");
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the kept kernels' tickets")
            }
        }
    }

    /// Where bwrap reports the end of `session`'s kernel.
    pub fn status_path(&self, session: Uuid) -> PathBuf {
        self.dir.join(format!("{session}.status"))
    }

    /// A fresh status file for a launch, for bwrap's `--json-status-fd`.
    pub fn open_status(&self, session: Uuid) -> io::Result<OwnedFd> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(self.status_path(session))?;
        Ok(file.into())
    }

    /// Writes `ticket` (atomically: a run that dies half-way leaves the old or none).
    /// Blocking.
    pub fn write(&self, ticket: &Ticket) -> io::Result<()> {
        let bytes = serde_json::to_vec(ticket).map_err(io::Error::other)?;
        private_file::write_atomic(&self.dir, &format!("{}.json", ticket.session), &bytes)
    }

    /// Removes `session`'s files: its kernel has ended and is reclaimed. Blocking.
    pub fn forget(&self, session: Uuid) {
        lock(&self.found).remove(&session);
        for name in [format!("{session}.json"), format!("{session}.status")] {
            match std::fs::remove_file(self.dir.join(&name)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(file = %name, error = %e, "cannot remove a kept-kernel file")
                }
            }
        }
    }

    /// The ticket of `session`, once (adoption takes it).
    pub fn take(&self, session: Uuid) -> Option<Ticket> {
        lock(&self.found).remove(&session)
    }

    /// The workspaces of their own the kernels found at start-up work in (an earlier run's
    /// tickets, which did not say, name none: a kernel kept under its session's id works in
    /// the workspace of that key, if any).
    pub fn own_workspaces(&self) -> HashSet<Uuid> {
        lock(&self.found)
            .values()
            .flat_map(|t| [t.own_workspace, Some(t.session)])
            .flatten()
            .collect()
    }

    /// The tickets no session adopted.
    pub fn take_all(&self) -> Vec<Ticket> {
        lock(&self.found).drain().map(|(_, t)| t).collect()
    }
}

fn read_small(path: &Path) -> io::Result<Vec<u8>> {
    private_file::read_capped(path, MAX_FILE)
}

/// The exit status bwrap reported in `status` (its last `exit-code`), if it did.
pub(super) fn reported_exit(status: &Path) -> Option<ExitStatus> {
    let bytes = read_small(status).ok()?;
    serde_json::Deserializer::from_slice(&bytes)
        .into_iter::<serde_json::Value>()
        .map_while(Result::ok)
        .filter_map(|v| v.get("exit-code")?.as_i64())
        .last()
        .and_then(|code| i32::try_from(code).ok())
        .filter(|code| (0..=255).contains(code))
        .map(|code| ExitStatus::from_raw(code << 8))
}

/// Writes the kept kernel's ticket: bwrap's and the sandbox init's pids with their start
/// times, read now that both exist.
pub(super) async fn write_ticket(
    kept: &std::sync::Arc<KeptKernels>,
    session: uuid::Uuid,
    user: &str,
    bwrap_pid: Option<i32>,
    init_pid: i32,
    own_workspace: Option<Uuid>,
) -> io::Result<()> {
    let bwrap_pid = bwrap_pid.ok_or_else(|| io::Error::other("bwrap's pid is unknown"))?;
    let started = |pid| {
        procfs::start_time(pid).ok_or_else(|| io::Error::other(format!("process {pid} is gone")))
    };
    let ticket = Ticket {
        session,
        user: user.to_string(),
        bwrap_pid,
        bwrap_start: started(bwrap_pid)?,
        init_pid,
        init_start: started(init_pid)?,
        restored: None,
        own_workspace,
    };
    let kept = kept.clone();
    tokio::task::spawn_blocking(move || kept.write(&ticket))
        .await
        .map_err(io::Error::other)?
}

/// Adds to `session`'s ticket the kernel CRIU restored in its sandbox (host pid `pid`, its
/// start time read now): what adoption takes for the kernel, not CRIU.
pub(super) async fn mark_restored(
    kept: &std::sync::Arc<KeptKernels>,
    session: uuid::Uuid,
    pid: i32,
) -> io::Result<()> {
    let start = procfs::start_time(pid)
        .ok_or_else(|| io::Error::other(format!("the restored kernel {pid} is gone")))?;
    let kept = kept.clone();
    tokio::task::spawn_blocking(move || {
        let path = kept.dir.join(format!("{session}.json"));
        let mut ticket: Ticket =
            serde_json::from_slice(&read_small(&path)?).map_err(io::Error::other)?;
        ticket.restored = Some((pid, start));
        kept.write(&ticket)
    })
    .await
    .map_err(io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_round_trip_and_junk_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let kept = KeptKernels::new(dir.path());
        assert!(kept.load().unwrap().is_empty());
        let ticket = Ticket {
            session: Uuid::new_v4(),
            user: "alice".into(),
            bwrap_pid: 10,
            bwrap_start: 20,
            init_pid: 11,
            init_start: 21,
            restored: None,
            own_workspace: None,
        };
        kept.write(&ticket).unwrap();
        // A restored kernel's ticket: its process marked on the ticket written at launch.
        let restored = Ticket {
            session: Uuid::new_v4(),
            own_workspace: Some(Uuid::new_v4()),
            ..ticket.clone()
        };
        kept.write(&restored).unwrap();
        let me = std::process::id() as i32;
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(mark_restored(
            &std::sync::Arc::new(kept),
            restored.session,
            me,
        ))
        .unwrap();
        let junk = dir
            .path()
            .join("kept-local")
            .join(format!("{}.json", Uuid::new_v4()));
        std::fs::write(&junk, b"{not json").unwrap();
        // A ticket under another session's name is not trusted either.
        let renamed = dir
            .path()
            .join("kept-local")
            .join(format!("{}.json", Uuid::new_v4()));
        std::fs::write(&renamed, serde_json::to_vec(&ticket).unwrap()).unwrap();

        let again = KeptKernels::new(dir.path());
        let sessions = HashSet::from([ticket.session, restored.session]);
        assert_eq!(again.load().unwrap(), sessions);
        // The sweep spares the workspaces of their own, and those a session's id names.
        let own = restored.own_workspace.unwrap();
        let spared = HashSet::from([ticket.session, restored.session, own]);
        assert_eq!(again.own_workspaces(), spared);
        assert!(!junk.exists() && !renamed.exists());
        let marked = again.take(restored.session).unwrap();
        assert_eq!(marked.restored, Some((me, procfs::start_time(me).unwrap())));
        assert_eq!(again.take(ticket.session), Some(ticket.clone()));
        assert_eq!(again.take(ticket.session), None);
        again.forget(ticket.session);
        again.forget(restored.session);
        assert!(KeptKernels::new(dir.path()).load().unwrap().is_empty());
    }

    #[test]
    fn the_exit_bwrap_reports_is_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.status");
        std::fs::write(&path, "{ \"child-pid\": 5 }\n").unwrap();
        assert_eq!(reported_exit(&path), None);
        std::fs::write(&path, "{ \"child-pid\": 5 }\n{ \"exit-code\": 137 }\n").unwrap();
        assert_eq!(reported_exit(&path).and_then(|s| s.code()), Some(137));
        std::fs::write(&path, "{ \"exit-code\": 99999 }\n").unwrap();
        assert_eq!(reported_exit(&path), None);
        assert_eq!(reported_exit(&dir.path().join("missing")), None);
    }
}
