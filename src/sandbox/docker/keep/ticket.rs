//! A kept kernel's ticket: what it holds, how it is checked against what the broker derives
//! itself, its file (written atomically, read with a size cap), and the runtime sweep that
//! spares what the tickets name.

use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::sandbox::docker::{is_container_safe, SESSION_DIR_LEN};

/// A ticket is a few hundred bytes; anything much larger is not one of ours.
const MAX_TICKET_BYTES: u64 = 16 * 1024;
pub(crate) const TICKET_VERSION: u32 = 1;

/// What the next run needs to adopt one kernel (see the module comment).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Ticket {
    pub version: u32,
    pub session_id: Uuid,
    pub user: String,
    pub container_id: String,
    pub container_name: String,
    pub exec_id: String,
    /// The exec's first process, as the daemon reports it (a host pid); `None`: unknown.
    pub exec_pid: Option<i64>,
    /// `/run/kernel/<session_dir>` inside, `<run_base>/<user>/<session_dir>` outside.
    pub session_dir: String,
    /// The kernel's cgroup leaf directories (empty: it had none).
    pub leaf: Vec<PathBuf>,
    pub memory_bytes: u64,
    pub pids: u64,
    /// The container's memory limit (the OOM fallback of a kernel without a leaf).
    pub container_memory_bytes: u64,
    pub quota_bytes: u64,
    /// The own-workspace key of a sandbox's own container (`own.rs`); `None`: the user's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own: Option<Uuid>,
    /// A kernel CRIU restored into its container (a resume, a copy, a session from a
    /// snapshot), which has no exec of its own (`exec_id` and `exec_pid` empty then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<RestoredPid>,
}

/// A restored kernel's process: its host pid and that process's start time
/// (`procfs::start_time`), which together name it and no later holder of the pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RestoredPid {
    pub host_pid: i32,
    pub start: u64,
}

/// Why a file in the tickets directory is not a usable ticket (it is then removed).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TicketRefused {
    #[error("not a ticket's name")]
    NotATicketName,
    #[error("{0}")]
    Unreadable(#[source] io::Error),
    #[error("{0}")]
    NotJson(#[source] serde_json::Error),
    #[error("unknown ticket version {0}")]
    UnknownVersion(u32),
    #[error("the ticket names another session than its file")]
    OtherSession,
    #[error("{0:?} is not a user name")]
    NotAUserName(String),
    #[error("{0:?} is not the user's container")]
    NotTheUsersContainer(String),
    #[error("{0:?} is not the session's directory")]
    NotTheSessionsDirectory(String),
    #[error("a container or exec id is not hexadecimal")]
    IdNotHexadecimal,
    #[error("a ticket names an exec or a restored process, one of them")]
    NotOneKernel,
    #[error("{0:?} are not the session's cgroup leaf")]
    NotTheSessionsLeaf(Vec<PathBuf>),
}

impl Ticket {
    /// The kernel's container slot and runtime directory name (`own.rs`).
    pub(crate) fn slot(&self) -> String {
        match self.own {
            Some(key) => super::super::own::own_slot(key),
            None => self.user.clone(),
        }
    }

    /// Checks a ticket read from `<session>.json` against what the broker derives itself
    /// (`container_name` of a user, or of a sandbox's own container).
    fn check(
        &self,
        session: Uuid,
        container_name: &dyn Fn(&str, Option<Uuid>) -> String,
    ) -> Result<(), TicketRefused> {
        let id_ok = |id: &str| {
            !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_hexdigit())
        };
        let session_text = self.session_id.to_string();
        let leaf_ok = |dir: &PathBuf| {
            dir.is_absolute()
                && dir.file_name().is_some_and(|n| *n == *session_text)
                && dir.components().all(|c| {
                    matches!(
                        c,
                        std::path::Component::RootDir | std::path::Component::Normal(_)
                    )
                })
        };
        if self.version != TICKET_VERSION {
            Err(TicketRefused::UnknownVersion(self.version))
        } else if self.session_id != session {
            Err(TicketRefused::OtherSession)
        } else if !is_container_safe(&self.user) {
            Err(TicketRefused::NotAUserName(self.user.clone()))
        } else if self.container_name != container_name(&self.user, self.own) {
            Err(TicketRefused::NotTheUsersContainer(
                self.container_name.clone(),
            ))
        } else if !self.session_dir_ok(session) {
            Err(TicketRefused::NotTheSessionsDirectory(
                self.session_dir.clone(),
            ))
        } else if !id_ok(&self.container_id) {
            Err(TicketRefused::IdNotHexadecimal)
        } else if let Some(restored) = self.restored {
            if !self.exec_id.is_empty() || self.exec_pid.is_some() || restored.host_pid <= 0 {
                Err(TicketRefused::NotOneKernel)
            } else {
                self.check_leaf(leaf_ok)
            }
        } else if !id_ok(&self.exec_id) {
            Err(TicketRefused::IdNotHexadecimal)
        } else {
            self.check_leaf(leaf_ok)
        }
    }

    /// A launched kernel's session directory is named by its session; a restored one's by
    /// the kernel its images hold (a session from a snapshot runs in the snapshot's), a
    /// name of the same form.
    fn session_dir_ok(&self, session: Uuid) -> bool {
        match self.restored {
            Some(_) => {
                self.session_dir.len() == SESSION_DIR_LEN
                    && self
                        .session_dir
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            }
            None => self.session_dir == session_dir(session),
        }
    }

    fn check_leaf(&self, leaf_ok: impl Fn(&PathBuf) -> bool) -> Result<(), TicketRefused> {
        if self.leaf.len() > 2 || !self.leaf.iter().all(leaf_ok) {
            Err(TicketRefused::NotTheSessionsLeaf(self.leaf.clone()))
        } else {
            Ok(())
        }
    }
}

/// Whether `dir` is a directory of a cgroup file system (v1 or v2): a ticket's leaf is
/// removed only there (where a directory holding processes or children cannot be removed).
pub(crate) fn is_cgroup_dir(dir: &Path) -> bool {
    const CGROUP_SUPER_MAGIC: u64 = 0x0027_e0eb;
    const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;
    // `f_type` is a signed word on some targets; the magic numbers fit either way.
    rustix::fs::statfs(dir)
        .is_ok_and(|st| matches!(st.f_type as u64, CGROUP_SUPER_MAGIC | CGROUP2_SUPER_MAGIC))
}

/// The name of a session's directory in its user's runtime directory.
pub(crate) fn session_dir(session: Uuid) -> String {
    session.simple().to_string()[..SESSION_DIR_LEN].to_string()
}

pub(crate) fn ticket_path(dir: &Path, session: Uuid) -> PathBuf {
    dir.join(format!("{session}.json"))
}

/// Writes `ticket` atomically (temporary file, fsync, rename), 0600. Blocking.
pub(crate) fn write_ticket(dir: &Path, ticket: &Ticket) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(ticket).map_err(io::Error::other)?;
    crate::private_file::write_atomic(dir, &format!("{}.json", ticket.session_id), &bytes)
}

/// Reads one ticket: a regular file of the broker's, at most [`MAX_TICKET_BYTES`]. Blocking.
fn read_ticket(path: &Path) -> Result<Ticket, TicketRefused> {
    let bytes = crate::private_file::read_capped(path, MAX_TICKET_BYTES)
        .map_err(TicketRefused::Unreadable)?;
    serde_json::from_slice(&bytes).map_err(TicketRefused::NotJson)
}

/// Every ticket in `dir`, checked; what is not a valid ticket is removed (logged).
/// Blocking.
pub(crate) fn load_tickets(
    dir: &Path,
    container_name: &dyn Fn(&str, Option<Uuid>) -> String,
) -> HashMap<Uuid, Ticket> {
    let mut tickets = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return tickets;
    };
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let session = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .and_then(|n| Uuid::parse_str(n).ok());
        let checked = match session {
            Some(session) => {
                read_ticket(&path).and_then(|t| t.check(session, container_name).map(|()| t))
            }
            None => Err(TicketRefused::NotATicketName),
        };
        match checked {
            Ok(ticket) => {
                tickets.insert(ticket.session_id, ticket);
            }
            Err(why) => {
                tracing::warn!(path = %path.display(), reason = %why, "removing an unusable kept-kernel ticket");
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    tickets
}

/// Removes what an earlier run left in the runtime base except the user directories in
/// `users` (mounted into running containers) and, inside them, the session directories in
/// `sessions`. Returns how many entries it removed. Blocking.
pub(crate) fn sweep_runtime(
    run_base: &Path,
    users: &HashSet<String>,
    sessions: &HashSet<(String, String)>,
) -> usize {
    let remove = |path: &Path, is_dir: bool| {
        let result = if is_dir {
            std::fs::remove_dir_all(path)
        } else {
            std::fs::remove_file(path)
        };
        if let Err(e) = &result {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale runtime entry");
        }
        usize::from(result.is_ok())
    };
    let entries = |dir: &Path| -> Vec<(String, PathBuf, bool)> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| {
                let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
                (
                    e.file_name().to_string_lossy().into_owned(),
                    e.path(),
                    is_dir,
                )
            })
            .collect()
    };
    let mut removed = 0;
    for (user, path, is_dir) in entries(run_base) {
        if !(is_dir && users.contains(&user)) {
            removed += remove(&path, is_dir);
            continue;
        }
        for (dir, inner, is_dir) in entries(&path) {
            if !(is_dir && sessions.contains(&(user.clone(), dir))) {
                removed += remove(&inner, is_dir);
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn ticket(session: Uuid) -> Ticket {
        let s = session.to_string();
        Ticket {
            version: TICKET_VERSION,
            session_id: session,
            user: "alice".into(),
            container_id: "ab12".repeat(16),
            container_name: "kernel-broker-h-alice".into(),
            exec_id: "cd34".repeat(16),
            exec_pid: Some(4242),
            session_dir: session_dir(session),
            leaf: vec![
                PathBuf::from(format!("/sys/fs/cgroup/memory/docker/x/{s}")),
                PathBuf::from(format!("/sys/fs/cgroup/pids/docker/x/{s}")),
            ],
            memory_bytes: 256 << 20,
            pids: 128,
            container_memory_bytes: 5 << 30,
            quota_bytes: 1 << 30,
            own: None,
            restored: None,
        }
    }

    /// The ticket of a kernel CRIU restored: no exec, a process.
    fn restored(session: Uuid) -> Ticket {
        Ticket {
            exec_id: String::new(),
            exec_pid: None,
            restored: Some(RestoredPid {
                host_pid: 4343,
                start: 123_456,
            }),
            ..ticket(session)
        }
    }

    fn name(user: &str, own: Option<Uuid>) -> String {
        match own {
            Some(key) => format!("kernel-broker-h-sandbox-{key}"),
            None => format!("kernel-broker-h-{user}"),
        }
    }

    #[test]
    fn a_ticket_is_written_privately_and_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let session = Uuid::new_v4();
        let t = ticket(session);
        write_ticket(tmp.path(), &t).unwrap();
        let path = ticket_path(tmp.path(), session);
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        // Written again (a rewrite replaces it whole).
        write_ticket(tmp.path(), &t).unwrap();
        let loaded = load_tickets(tmp.path(), &name);
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[&session], t);
        // No temporary file is left.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        // A restored kernel's ticket too; an exec's is written without the field, as the
        // broker wrote it before there were restored ones (and reads back the same).
        let other = Uuid::new_v4();
        write_ticket(tmp.path(), &restored(other)).unwrap();
        assert_eq!(load_tickets(tmp.path(), &name)[&other], restored(other));
        let text = std::fs::read_to_string(ticket_path(tmp.path(), session)).unwrap();
        assert!(!text.contains("restored"), "{text}");
    }

    #[test]
    fn tickets_that_do_not_check_out_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let good = ticket(Uuid::new_v4());
        write_ticket(tmp.path(), &good).unwrap();
        type Spoil = Box<dyn Fn(&mut Ticket)>;
        let mut cases: Vec<(&str, Spoil)> = vec![
            ("version", Box::new(|t| t.version = 2)),
            ("user", Box::new(|t| t.user = "../x".into())),
            ("container", Box::new(|t| t.container_name = "other".into())),
            (
                "the user's container claimed for a sandbox",
                Box::new(|t| t.own = Some(Uuid::new_v4())),
            ),
            ("dir", Box::new(|t| t.session_dir = "..".into())),
            ("exec id", Box::new(|t| t.exec_id = "x;rm".into())),
            (
                "leaf outside cgroupfs",
                Box::new(|t| t.leaf = vec!["/etc/x".into()]),
            ),
            (
                "leaf of another session",
                Box::new(|t| t.leaf = vec!["/sys/fs/cgroup/memory/x/other".into()]),
            ),
            (
                "leaf with ..",
                Box::new(|t| {
                    let s = t.session_id;
                    t.leaf = vec![format!("/sys/fs/cgroup/../../etc/{s}").into()]
                }),
            ),
        ];
        // A restored kernel's ticket names no exec, and a process that can be one.
        let mut of_restored: Vec<(&str, Spoil)> = vec![
            (
                "restored, with an exec",
                Box::new(|t| t.exec_id = "cd34".repeat(16)),
            ),
            (
                "restored, with an exec pid",
                Box::new(|t| t.exec_pid = Some(9)),
            ),
            (
                "restored, no pid",
                Box::new(|t| t.restored.as_mut().unwrap().host_pid = 0),
            ),
            (
                "restored, leaf elsewhere",
                Box::new(|t| t.leaf = vec!["/etc/x".into()]),
            ),
            (
                "restored, dir outside",
                Box::new(|t| t.session_dir = "..".into()),
            ),
            (
                "restored, dir of another form",
                Box::new(|t| t.session_dir = "A".repeat(SESSION_DIR_LEN)),
            ),
        ];
        for (what, spoil) in of_restored.drain(..) {
            let mut t = restored(Uuid::new_v4());
            assert!(t.check(t.session_id, &name).is_ok(), "{what}");
            spoil(&mut t);
            assert!(t.check(t.session_id, &name).is_err(), "{what}");
            write_ticket(tmp.path(), &t).unwrap();
        }
        // A restored kernel's directory may be another session's (a snapshot's kernel's).
        let mut t = restored(Uuid::new_v4());
        t.session_dir = session_dir(Uuid::new_v4());
        assert!(t.check(t.session_id, &name).is_ok());
        // An exec's ticket without its exec id (a restored one's without its process).
        let mut t = ticket(Uuid::new_v4());
        t.exec_id = String::new();
        assert!(t.check(t.session_id, &name).is_err());
        write_ticket(tmp.path(), &t).unwrap();
        for (what, spoil) in cases.drain(..) {
            let mut t = ticket(Uuid::new_v4());
            spoil(&mut t);
            assert!(t.check(t.session_id, &name).is_err(), "{what}");
            write_ticket(tmp.path(), &t).unwrap();
        }
        // A ticket under another session's name, one too large, one not JSON, a stray file.
        let moved = ticket(Uuid::new_v4());
        let bytes = serde_json::to_vec(&moved).unwrap();
        std::fs::write(ticket_path(tmp.path(), Uuid::new_v4()), &bytes).unwrap();
        std::fs::write(
            ticket_path(tmp.path(), Uuid::new_v4()),
            vec![b' '; MAX_TICKET_BYTES as usize + 1],
        )
        .unwrap();
        std::fs::write(ticket_path(tmp.path(), Uuid::new_v4()), b"{").unwrap();
        std::fs::write(tmp.path().join("notes.txt"), b"hi").unwrap();
        let loaded = load_tickets(tmp.path(), &name);
        assert_eq!(loaded.keys().collect::<Vec<_>>(), [&good.session_id]);
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn only_cgroup_directories_are_cgroup_directories() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(!is_cgroup_dir(tmp.path()));
        assert!(!is_cgroup_dir(&tmp.path().join("missing")));
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2") {
                assert!(is_cgroup_dir(Path::new(f[1])), "{line}");
            }
        }
    }

    #[test]
    fn the_runtime_sweep_keeps_only_kept_users_and_sessions() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path();
        for dir in ["alice/aaa", "alice/bbb", "bob/ccc"] {
            std::fs::create_dir_all(base.join(dir)).unwrap();
        }
        std::fs::write(base.join("alice/stray"), b"").unwrap();
        std::fs::write(base.join("stray"), b"").unwrap();
        let users = HashSet::from(["alice".to_string()]);
        let sessions = HashSet::from([("alice".to_string(), "aaa".to_string())]);
        assert_eq!(sweep_runtime(base, &users, &sessions), 4);
        assert!(base.join("alice/aaa").is_dir());
        assert!(!base.join("alice/bbb").exists());
        assert!(!base.join("alice/stray").exists());
        assert!(!base.join("bob").exists());
        assert!(!base.join("stray").exists());
    }
}
