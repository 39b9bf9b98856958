//! Freezing a leaf's processes (a checkpoint's kernel, issue 36): they keep their memory and
//! sockets but run no instruction until thawed.
//!
//! Three ways, the first the host offers: v2 `cgroup.freeze` in the leaf itself; v1 the
//! `freezer` controller when it is mounted (the broker's leaves are not in that hierarchy,
//! so the leaf's processes are moved into a directory of the same name under the broker's
//! base there, frozen, and moved back out and the directory removed when thawed); else
//! SIGSTOP to every process of the leaf. The cgroup ways cannot be undone from inside the
//! sandbox; SIGSTOP can (another kernel of the same user may send SIGCONT), so it is the
//! last resort and said so in the log.
//!
//! A v1-frozen process does not die of SIGKILL until thawed: [`Freezer::set`]`(false)`
//! comes before a checkpoint's kernel is ended.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::fs::{read_trimmed, write_file};
use super::mountinfo::parse_mountinfo;
use super::{CgroupVersion, Leaf};
use crate::sandbox::SandboxError;

/// Whether the unprivileged broker's lack of `oom_score_adj` was said (once).
static UNPRIVILEGED_OOM_SAID: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// How long a freeze may take to settle before it is reported as failed.
const SETTLE: Duration = Duration::from_secs(2);

/// What freezes one leaf's processes (paths only; cheap to clone).
#[derive(Debug, Clone)]
pub struct Freezer {
    version: CgroupVersion,
    /// The leaf's directories (the first is where v2 freezes and where pids are listed).
    dirs: Vec<PathBuf>,
    /// v1: the freezer cgroup the leaf's processes are in and go back to when thawed (a
    /// container's); `None`: the hierarchy's root, the frozen directory under the broker's
    /// base there.
    v1_home: Option<PathBuf>,
}

impl Leaf {
    /// What freezes this leaf's processes.
    pub fn freezer(&self) -> Freezer {
        Freezer::beneath(self, None)
    }
}

impl Freezer {
    /// What freezes `leaf`, on v1 in a directory of its name beneath `v1_home` (a
    /// container's freezer cgroup), or under the broker's base when `None`.
    pub(super) fn beneath(leaf: &Leaf, v1_home: Option<PathBuf>) -> Self {
        Self {
            version: leaf.version,
            dirs: leaf.dirs.clone(),
            v1_home,
        }
    }

    /// Freezes (`true`) or thaws (`false`) every process of the leaf; waits until the
    /// cgroup says it is done.
    pub fn set(&self, frozen: bool) -> Result<(), SandboxError> {
        let Some(dir) = self.dirs.first() else {
            return Ok(());
        };
        if self.version == CgroupVersion::V2 && dir.join("cgroup.freeze").exists() {
            write_file(&dir.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
            let want = if frozen { "frozen 1" } else { "frozen 0" };
            return settle(dir, |d| {
                read_trimmed(&d.join("cgroup.events"))
                    .map(|t| t.lines().any(|l| l == want))
                    .unwrap_or(false)
            });
        }
        if let Some((home, fdir)) = self.v1_freezer_dir() {
            return if frozen {
                self.v1_freeze(&home, &fdir)
            } else {
                v1_thaw(&home, &fdir, self.v1_home.is_none())
            };
        }
        if frozen {
            tracing::warn!(cgroup = %dir.display(), "no cgroup freezer here: the checkpoint is stopped with SIGSTOP, which another kernel of its user could undo");
            self.signal_all(libc::SIGSTOP);
        } else {
            self.continue_all();
        }
        Ok(())
    }

    /// Sends SIGCONT to every process of the leaf (`KernelProcess::continue_stopped`). A
    /// v1-frozen process stays frozen; the stop it had pending is dropped, so it runs once
    /// thawed.
    pub fn continue_all(&self) {
        self.signal_all(libc::SIGCONT);
    }

    fn signal_all(&self, signal: i32) {
        for pid in self.pids() {
            if pid > 0 {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe { libc::kill(pid, signal) };
            }
        }
    }

    /// Sets `oom_score_adj` of every process of the leaf (1000: a checkpoint, the OOM
    /// killer's first choice; the kernels' own value: a live kernel again).
    ///
    /// An unprivileged broker cannot: a kernel is not dumpable, so its `/proc` files are
    /// the host root's, and not even the kernel may write its own (making it dumpable for
    /// the write would let the user's other processes attach to it). There checkpoints are
    /// kept without the preference (said once in the log; docs/HOSTS.md): the user's
    /// cgroup stays the backstop, and its OOM killer weighs a checkpoint like a kernel.
    pub fn set_oom_score_adj(&self, adj: i32) -> Result<(), SandboxError> {
        for pid in self.pids() {
            set_oom_score_adj(pid, adj)?;
        }
        Ok(())
    }

    fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for dir in &self.dirs {
            if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// v1 with a freezer hierarchy: where the leaf's processes are (`home`) and the
    /// directory they are frozen in: `<container's freezer cgroup>/<leaf>`, or
    /// `<freezer mount>/<broker base>/<leaf>` (home: the mount, the hierarchy's root).
    fn v1_freezer_dir(&self) -> Option<(PathBuf, PathBuf)> {
        if self.version != CgroupVersion::V1 {
            return None;
        }
        let leaf = self.dirs.first()?;
        let leaf_name = leaf.file_name()?;
        if let Some(home) = &self.v1_home {
            return Some((home.clone(), home.join(leaf_name)));
        }
        let base_name = leaf.parent()?.parent()?.file_name()?;
        let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let mount = parse_mountinfo(&text)
            .into_iter()
            .find(|m| m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == "freezer"))?;
        let fdir = mount.mount_point.join(base_name).join(leaf_name);
        Some((mount.mount_point, fdir))
    }

    fn v1_freeze(&self, home: &Path, fdir: &Path) -> Result<(), SandboxError> {
        let own_base = self.v1_home.is_none();
        // Another checkpoint's thaw may remove the base between the two: try again.
        let mut made = Ok(());
        for _ in 0..3 {
            if let (true, Some(base)) = (own_base, fdir.parent()) {
                super::fs::mkdir(base)?;
            }
            made = super::fs::mkdir(fdir);
            if made.is_ok() {
                break;
            }
        }
        made?;
        for pid in self.pids() {
            // A process that ended meanwhile cannot be moved; the others must be.
            if let Err(e) = write_file(&fdir.join("cgroup.procs"), &pid.to_string()) {
                if Path::new(&format!("/proc/{pid}")).exists() {
                    let _ = v1_thaw(home, fdir, own_base);
                    return Err(e);
                }
            }
        }
        write_file(&fdir.join("freezer.state"), "FROZEN")?;
        settle(fdir, |d| {
            read_trimmed(&d.join("freezer.state")).is_ok_and(|s| s == "FROZEN")
        })
    }
}

/// Thaws a v1 freezer directory, moves its processes back `home` (the hierarchy's root,
/// or a container's freezer cgroup) and removes it; with `own_base`, the broker's base
/// directory above it too once empty (never a container's directory).
fn v1_thaw(home: &Path, fdir: &Path, own_base: bool) -> Result<(), SandboxError> {
    if !fdir.exists() {
        return Ok(());
    }
    write_file(&fdir.join("freezer.state"), "THAWED")?;
    settle(fdir, |d| {
        read_trimmed(&d.join("freezer.state")).is_ok_and(|s| s == "THAWED")
    })?;
    if let Ok(text) = std::fs::read_to_string(fdir.join("cgroup.procs")) {
        for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = write_file(&home.join("cgroup.procs"), &pid.to_string());
        }
    }
    super::fs::rmdir_if_unused(fdir);
    if let (true, Some(base)) = (own_base, fdir.parent()) {
        super::fs::rmdir_if_unused(base);
    }
    Ok(())
}

/// Waits (briefly, polling: a freeze settles in microseconds to milliseconds) until
/// `done(dir)`.
fn settle(dir: &Path, done: impl Fn(&Path) -> bool) -> Result<(), SandboxError> {
    let start = std::time::Instant::now();
    while !done(dir) {
        if start.elapsed() > SETTLE {
            return Err(super::fs::cgroup_err(
                dir,
                format!("the freezer did not settle within {SETTLE:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Sets `oom_score_adj` of host process `pid` (see [`Freezer::set_oom_score_adj`]: an
/// unprivileged broker cannot, said once, and that is no failure; neither is a process
/// that ended meanwhile).
pub fn set_oom_score_adj(pid: i32, adj: i32) -> Result<(), SandboxError> {
    let file = PathBuf::from(format!("/proc/{pid}/oom_score_adj"));
    if let Err(e) = std::fs::write(&file, adj.to_string()) {
        if e.kind() == std::io::ErrorKind::PermissionDenied
            && crate::sandbox::fsutil::current_ids().0 != 0
        {
            if !UNPRIVILEGED_OOM_SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    "checkpoints are not made the OOM killer's first choice: an \
                     unprivileged broker cannot set a kernel's oom_score_adj"
                );
            }
            return Ok(());
        }
        if Path::new(&format!("/proc/{pid}")).exists() {
            return Err(SandboxError::Io {
                what: "cannot set a checkpoint's oom_score_adj",
                path: file,
                source: e,
            });
        }
    }
    Ok(())
}
