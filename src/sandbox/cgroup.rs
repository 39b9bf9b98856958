//! Control groups for the local sandbox: per-user limits and one leaf per kernel.
//!
//! This module owns the broker's subtree of the cgroup hierarchy (named `kernel-broker`
//! unless configured otherwise) and nothing outside it. Layout, under each hierarchy used:
//!
//! ```text
//! kernel-broker/               created on startup, removed on shutdown when empty
//!   <user>/                    the user's limits: memory, CPU, processes (all kernels together)
//!     <session-uuid>/          one leaf per kernel; the kernel's processes live only here
//! ```
//!
//! Both cgroup versions are supported, because hosts still run both:
//!
//! - **v1** (separate hierarchies): the `memory`, `cpu` and `pids` controllers are found in
//!   `/proc/self/mountinfo`; the tree above is created in each of them.
//! - **v2** (unified): one tree; the controllers are enabled with `cgroup.subtree_control`
//!   on every level above the leaves. As root the tree hangs off the hierarchy's root; as an
//!   unprivileged user it hangs off the broker's own (delegated) cgroup, and the broker
//!   moves itself into a sibling leaf first, since v2 allows no processes in inner nodes.
//!
//! A kernel enters its leaf before it can fork: [`Leaf::procs_files`] hands the launcher
//! the `cgroup.procs` paths as C strings, which the child writes `0` (itself) to between
//! `fork` and `exec`, so no process of a kernel ever runs outside its limits.
//!
//! Everything here is a few small reads and writes on a pseudo file system, which the kernel
//! answers without blocking on disk, so these calls are made directly on async tasks.

use std::collections::HashSet;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::{sleep, Instant};
use uuid::Uuid;

use super::{SandboxError, UserLimits};

/// The CFS period used for CPU limits (100 ms, the kernel's default).
const CPU_PERIOD_US: u64 = 100_000;
/// How long to keep killing a leaf's processes before giving up.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to retry `rmdir` of a leaf whose last processes are still exiting.
const RMDIR_TIMEOUT: Duration = Duration::from_secs(3);
/// The v2 leaf the broker moves itself into when its own cgroup must become an inner node.
const SELF_LEAF: &str = "broker";

/// Which cgroup interface the host offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// The broker's part of the cgroup tree, and the operations on it.
#[derive(Debug)]
pub struct Cgroups {
    version: CgroupVersion,
    /// The broker's base directory in every hierarchy used (v1: memory first, then cpu and
    /// pids; v2: exactly one). Memory first matters: OOM counters are read there.
    bases: Vec<PathBuf>,
    /// v2 only: the directory the base hangs off, where controllers must be enabled.
    v2_parent: Option<PathBuf>,
    /// Serialises creating and removing user directories, so a launch never finds the user
    /// directory removed between creating it and creating its leaf. Held only around a few
    /// quick syscalls, never across an `.await`, hence a std mutex.
    tree_lock: Mutex<()>,
}

/// One kernel's leaf cgroup (one directory per hierarchy).
#[derive(Debug)]
pub struct Leaf {
    version: CgroupVersion,
    dirs: Vec<PathBuf>,
    procs_files: Vec<CString>,
}

/// A cgroup mount found in `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    /// The mount's root inside the hierarchy (`/` unless a sub-tree is mounted).
    root: String,
    mount_point: PathBuf,
    /// `cgroup` (v1) or `cgroup2`.
    fs_type: String,
    /// The super block options (v1: the controllers bound to this hierarchy).
    super_options: Vec<String>,
}

impl Cgroups {
    /// Finds the hierarchies to use, without writing anything. `name` is the directory the
    /// broker's tree lives in (`kernel-broker`); `privileged` is whether the broker runs as
    /// root (unprivileged brokers need a delegated v2 cgroup).
    pub fn detect(name: &str, privileged: bool) -> Result<Self, String> {
        if !is_path_component(name) {
            return Err(format!(
                "the cgroup name {name:?} is not a single directory name"
            ));
        }
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let mounts = parse_mountinfo(&mountinfo);

        // v2 when the unified hierarchy carries all three controllers.
        if let Some(m) = mounts.iter().find(|m| m.fs_type == "cgroup2") {
            let controllers =
                read_trimmed(&m.mount_point.join("cgroup.controllers")).unwrap_or_default();
            let have: HashSet<&str> = controllers.split_whitespace().collect();
            if ["memory", "cpu", "pids"].iter().all(|c| have.contains(c)) {
                let parent = if privileged {
                    m.mount_point.clone()
                } else {
                    let own = read_own_cgroup_v2()
                        .ok_or("cannot find the broker's own cgroup in /proc/self/cgroup")?;
                    join_cgroup_path(&m.mount_point, &m.root, &own)
                };
                return Ok(Self {
                    version: CgroupVersion::V2,
                    bases: vec![parent.join(name)],
                    v2_parent: Some(parent),
                    tree_lock: Mutex::new(()),
                });
            }
        }

        let v1 = |ctrl: &str| {
            mounts
                .iter()
                .find(|m| m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == ctrl))
                .map(|m| m.mount_point.clone())
        };
        match (v1("memory"), v1("cpu"), v1("pids")) {
            (Some(memory), Some(cpu), Some(pids)) if privileged => Ok(Self {
                version: CgroupVersion::V1,
                bases: vec![memory.join(name), cpu.join(name), pids.join(name)],
                v2_parent: None,
                tree_lock: Mutex::new(()),
            }),
            (Some(_), Some(_), Some(_)) => Err(
                "the host uses cgroup v1, which cannot be delegated to an unprivileged broker"
                    .to_string(),
            ),
            _ => Err(
                "no cgroup hierarchy offers the memory, cpu and pids controllers \
                 (neither a cgroup2 mount with all three nor cgroup v1 mounts of each)"
                    .to_string(),
            ),
        }
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The broker's base directories (one per hierarchy), for logs and messages.
    pub fn bases(&self) -> &[PathBuf] {
        &self.bases
    }

    /// Creates the broker's base directories and, on v2, enables the controllers down to
    /// them. Safe to call again.
    pub fn setup(&self) -> Result<(), SandboxError> {
        if let Some(parent) = &self.v2_parent {
            if let Err(e) = enable_controllers(parent) {
                // v2 forbids enabling controllers for children of a cgroup that holds
                // processes. If the only process there is the broker itself (a delegated
                // service cgroup), step aside into a leaf and try again.
                if e.raw_os_error() == Some(libc::EBUSY) && holds_only_this_process(parent) {
                    let own_leaf = parent.join(SELF_LEAF);
                    mkdir(&own_leaf)?;
                    write_file(&own_leaf.join("cgroup.procs"), "0")?;
                    tracing::info!(cgroup = %own_leaf.display(), "moved the broker into its own leaf cgroup");
                    enable_controllers(parent).map_err(|e| cgroup_err(parent, e))?;
                } else {
                    return Err(cgroup_err(
                        parent,
                        format!(
                            "cannot enable the memory, cpu and pids controllers: {e} \
                             (the cgroup must be delegated to the broker and hold no other processes)"
                        ),
                    ));
                }
            }
        }
        for base in &self.bases {
            mkdir(base)?;
            if self.version == CgroupVersion::V2 {
                enable_controllers(base).map_err(|e| cgroup_err(base, e))?;
            }
        }
        Ok(())
    }

    /// Creates (or updates) the user's directory with `limits` and a leaf for `session`.
    /// Limits are written on every launch so that configuration changes take effect.
    pub fn create_leaf(
        &self,
        user: &str,
        limits: &UserLimits,
        session: Uuid,
    ) -> Result<Leaf, SandboxError> {
        if !is_path_component(user) {
            return Err(cgroup_err(
                &self.bases[0],
                format!("the user name {user:?} is not a single directory name"),
            ));
        }
        let session = session.to_string();
        let _tree = self.lock_tree();
        let mut dirs = Vec::with_capacity(self.bases.len());
        for base in &self.bases {
            let user_dir = base.join(user);
            mkdir(&user_dir)?;
            if self.version == CgroupVersion::V2 {
                enable_controllers(&user_dir).map_err(|e| cgroup_err(&user_dir, e))?;
            }
            dirs.push((user_dir.clone(), user_dir.join(&session)));
        }
        self.apply_limits(
            &dirs.iter().map(|(u, _)| u.clone()).collect::<Vec<_>>(),
            limits,
        )?;
        let mut leaf = Leaf {
            version: self.version,
            dirs: Vec::with_capacity(dirs.len()),
            procs_files: Vec::with_capacity(dirs.len()),
        };
        for (_, leaf_dir) in dirs {
            mkdir(&leaf_dir)?;
            let procs = leaf_dir.join("cgroup.procs");
            let procs = CString::new(procs.as_os_str().as_bytes())
                .map_err(|_| cgroup_err(&leaf_dir, "the path contains a NUL byte"))?;
            leaf.procs_files.push(procs);
            leaf.dirs.push(leaf_dir);
        }
        Ok(leaf)
    }

    fn apply_limits(&self, user_dirs: &[PathBuf], limits: &UserLimits) -> Result<(), SandboxError> {
        match self.version {
            CgroupVersion::V2 => {
                let dir = &user_dirs[0];
                write_limit(&dir.join("memory.max"), &v2_max(limits.memory_bytes))?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    write_limit(&swap, "0")?;
                }
                write_limit(&dir.join("cpu.max"), &v2_cpu_max(limits.cpus))?;
                write_limit(&dir.join("pids.max"), &v2_max(limits.pids))?;
            }
            CgroupVersion::V1 => {
                for dir in user_dirs {
                    if dir.join("memory.limit_in_bytes").exists() {
                        set_v1_memory(dir, limits.memory_bytes)?;
                    }
                    if dir.join("cpu.cfs_quota_us").exists() {
                        write_limit(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                        write_limit(&dir.join("cpu.cfs_quota_us"), &v1_cpu_quota(limits.cpus))?;
                    }
                    if dir.join("pids.max").exists() {
                        write_limit(&dir.join("pids.max"), &v2_max(limits.pids))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Kills what is left in `leaf`, removes it, and removes the user's directory when no
    /// other leaf is left in it.
    pub async fn remove_leaf(&self, leaf: &Leaf) {
        leaf.kill_all().await;
        for dir in &leaf.dirs {
            rmdir_retrying(dir).await;
        }
        let _tree = self.lock_tree();
        for dir in &leaf.dirs {
            if let Some(user_dir) = dir.parent() {
                rmdir_if_unused(user_dir);
            }
        }
    }

    /// Removes the user's directory if none of the user's kernels is left.
    pub fn remove_user_if_unused(&self, user: &str) {
        if !is_path_component(user) {
            return;
        }
        let _tree = self.lock_tree();
        for base in &self.bases {
            rmdir_if_unused(&base.join(user));
        }
    }

    /// Removes the base directories if they are empty (broker shutdown).
    pub fn remove_base_if_unused(&self) {
        let _tree = self.lock_tree();
        for base in &self.bases {
            rmdir_if_unused(base);
        }
    }

    /// Kills and removes every leaf under the base: what an earlier run of the broker left
    /// behind. Only for startup, before this run has launched anything.
    pub async fn sweep_stale(&self) -> usize {
        let mut removed = 0;
        // The same leaf appears once per hierarchy on v1; handle it as one leaf.
        let mut leaves: Vec<(String, String)> = Vec::new();
        for base in &self.bases {
            for user in subdirs(base) {
                for session in subdirs(&base.join(&user)) {
                    if !leaves.contains(&(user.clone(), session.clone())) {
                        leaves.push((user.clone(), session));
                    }
                }
            }
        }
        for (user, session) in leaves {
            let leaf = Leaf {
                version: self.version,
                dirs: self
                    .bases
                    .iter()
                    .map(|b| b.join(&user).join(&session))
                    .filter(|d| d.is_dir())
                    .collect(),
                procs_files: Vec::new(),
            };
            tracing::info!(
                user,
                session,
                "removing a kernel cgroup left by an earlier run"
            );
            self.remove_leaf(&leaf).await;
            removed += 1;
        }
        for base in &self.bases {
            for user in subdirs(base) {
                rmdir_if_unused(&base.join(user));
            }
        }
        removed
    }

    fn lock_tree(&self) -> std::sync::MutexGuard<'_, ()> {
        // The guarded data is `()`, so a panic elsewhere cannot have left it inconsistent.
        crate::sync::lock(&self.tree_lock)
    }
}

impl Leaf {
    /// The `cgroup.procs` file of every hierarchy's leaf, for the child to write `0` to
    /// between `fork` and `exec`.
    pub fn procs_files(&self) -> &[CString] {
        &self.procs_files
    }

    /// The leaf's directories (one per hierarchy).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// How many processes the kernel's OOM killer has killed in this leaf, if the host says.
    /// v1 counts a kill in the victim's own memory cgroup; v2 counts it hierarchically, so in
    /// both the leaf's counter covers exactly this kernel.
    pub fn oom_kills(&self) -> Option<u64> {
        let dir = self.dirs.first()?;
        let (file, key) = match self.version {
            CgroupVersion::V2 => ("memory.events", "oom_kill"),
            CgroupVersion::V1 => ("memory.oom_control", "oom_kill"),
        };
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        parse_keyed_counter(&text, key)
    }

    /// The processes in the leaf (host pids).
    pub fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for dir in &self.dirs {
            if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    if !pids.contains(&pid) {
                        pids.push(pid);
                    }
                }
            }
        }
        pids
    }

    /// SIGKILLs every process in the leaf until none is left (or a timeout passes). Uses
    /// `cgroup.kill` where the kernel has it; otherwise kills the listed processes in rounds,
    /// which also catches processes forked while a round was running.
    pub async fn kill_all(&self) {
        if self.version == CgroupVersion::V2 {
            if let Some(dir) = self.dirs.first() {
                let kill = dir.join("cgroup.kill");
                if kill.exists() {
                    if let Err(e) = write_file(&kill, "1") {
                        tracing::warn!(error = %e, "cgroup.kill failed; killing processes one by one");
                    }
                }
            }
        }
        let deadline = Instant::now() + KILL_TIMEOUT;
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                tracing::error!(
                    cgroup = %self.dirs.first().map(|d| d.display().to_string()).unwrap_or_default(),
                    ?pids,
                    "processes survived SIGKILL for {KILL_TIMEOUT:?}"
                );
                return;
            }
            for pid in pids {
                if pid > 0 {
                    // SAFETY: kill(2) has no memory-safety preconditions.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            sleep(Duration::from_millis(10)).await;
        }
    }
}

fn cgroup_err(path: &Path, reason: impl std::fmt::Display) -> SandboxError {
    SandboxError::Cgroup {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn is_path_component(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains('/') && !s.contains('\0')
}

fn mkdir(dir: &Path) -> Result<(), SandboxError> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(cgroup_err(dir, format!("cannot create the cgroup: {e}"))),
    }
}

fn write_file(path: &Path, value: &str) -> Result<(), SandboxError> {
    std::fs::write(path, value)
        .map_err(|e| cgroup_err(path, format!("cannot write {value:?}: {e}")))
}

fn write_limit(path: &Path, value: &str) -> Result<(), SandboxError> {
    write_file(path, value)
}

fn read_trimmed(path: &Path) -> io::Result<String> {
    Ok(std::fs::read_to_string(path)?.trim().to_string())
}

/// v1 memory: RAM, and RAM+swap at the same value so no swap is granted on top. The two
/// must stay ordered (memsw >= limit) at every step, so the order of the writes depends on
/// whether the limit goes up or down.
fn set_v1_memory(dir: &Path, bytes: u64) -> Result<(), SandboxError> {
    let value = if bytes == 0 {
        "-1".to_string()
    } else {
        bytes.to_string()
    };
    let limit = dir.join("memory.limit_in_bytes");
    let memsw = dir.join("memory.memsw.limit_in_bytes");
    if !memsw.exists() {
        // No swap accounting: at least ask the kernel not to swap this group out.
        let _ = std::fs::write(dir.join("memory.swappiness"), "0");
        return write_limit(&limit, &value);
    }
    if write_limit(&limit, &value).is_ok() {
        write_limit(&memsw, &value)
    } else {
        // Raising the limit above the current memsw limit: memsw first.
        write_limit(&memsw, &value)?;
        write_limit(&limit, &value)
    }
}

/// A v2 `*.max` value: `max` for unlimited (0).
fn v2_max(n: u64) -> String {
    if n == 0 {
        "max".to_string()
    } else {
        n.to_string()
    }
}

/// A v2 `cpu.max` value for `cpus` cores (`max` when not positive).
fn v2_cpu_max(cpus: f64) -> String {
    if cpus.is_finite() && cpus > 0.0 {
        format!("{} {CPU_PERIOD_US}", cpu_quota_us(cpus))
    } else {
        format!("max {CPU_PERIOD_US}")
    }
}

/// A v1 `cpu.cfs_quota_us` value for `cpus` cores (`-1` when not positive).
fn v1_cpu_quota(cpus: f64) -> String {
    if cpus.is_finite() && cpus > 0.0 {
        cpu_quota_us(cpus).to_string()
    } else {
        "-1".to_string()
    }
}

fn cpu_quota_us(cpus: f64) -> u64 {
    // The kernel's minimum quota is 1 ms.
    ((cpus * CPU_PERIOD_US as f64).round() as u64).max(1000)
}

/// Enables `+memory +cpu +pids` for the children of `dir` (v2).
fn enable_controllers(dir: &Path) -> io::Result<()> {
    let path = dir.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&path)?;
    let enabled: HashSet<&str> = enabled.split_whitespace().collect();
    for ctrl in ["memory", "cpu", "pids"] {
        if !enabled.contains(ctrl) {
            std::fs::write(&path, format!("+{ctrl}"))?;
        }
    }
    Ok(())
}

fn holds_only_this_process(dir: &Path) -> bool {
    let me = std::process::id().to_string();
    match std::fs::read_to_string(dir.join("cgroup.procs")) {
        Ok(text) => text.lines().all(|l| l.trim() == me),
        Err(_) => false,
    }
}

/// `rmdir` of a leaf whose processes were just killed: the kernel may need a moment to let
/// the last of them go.
async fn rmdir_retrying(dir: &Path) {
    let deadline = Instant::now() + RMDIR_TIMEOUT;
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) if Instant::now() >= deadline => {
                tracing::error!(cgroup = %dir.display(), error = %e, "cannot remove the kernel's cgroup");
                return;
            }
            Err(_) => sleep(Duration::from_millis(20)).await,
        }
    }
}

/// `rmdir` that expects to fail while the directory still has children or processes.
fn rmdir_if_unused(dir: &Path) {
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EBUSY) | Some(libc::ENOTEMPTY) | Some(libc::ENOENT)
            ) => {}
        Err(e) => tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove cgroup"),
    }
}

fn subdirs(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect()
}

fn read_own_cgroup_v2() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
}

/// The directory of cgroup `path` (as `/proc/self/cgroup` shows it) under a mount of the
/// hierarchy whose root is `mount_root`.
fn join_cgroup_path(mount_point: &Path, mount_root: &str, path: &str) -> PathBuf {
    let rel = path
        .strip_prefix(mount_root)
        .unwrap_or(path)
        .trim_start_matches('/');
    if rel.is_empty() {
        mount_point.to_path_buf()
    } else {
        mount_point.join(rel)
    }
}

/// Parses `key N` out of a flat keyed file (`memory.events`, `memory.oom_control`).
fn parse_keyed_counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some(key))
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            // id parent major:minor root mount_point options [optional fields...] - type source super_options
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            if left.len() < 5 || right.len() < 3 {
                return None;
            }
            Some(Mount {
                root: unescape_mountinfo(left[3]),
                mount_point: PathBuf::from(unescape_mountinfo(left[4])),
                fs_type: right[0].to_string(),
                super_options: right[2].split(',').map(str::to_string).collect(),
            })
        })
        .filter(|m| m.fs_type == "cgroup" || m.fs_type == "cgroup2")
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space and so on).
fn unescape_mountinfo(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cgroup_mounts_from_mountinfo() {
        let text = "\
25 30 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755
26 25 0:23 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
28 25 0:25 /sub /sys/fs/cgroup/unified\\040x rw - cgroup2 cgroup2 rw,nsdelegate
";
        let mounts = parse_mountinfo(text);
        assert_eq!(mounts.len(), 3);
        assert_eq!(
            mounts[0].mount_point,
            PathBuf::from("/sys/fs/cgroup/memory")
        );
        assert_eq!(mounts[0].super_options, vec!["rw", "memory"]);
        assert!(mounts[1].super_options.iter().any(|o| o == "cpu"));
        assert_eq!(mounts[2].fs_type, "cgroup2");
        assert_eq!(mounts[2].root, "/sub");
        assert_eq!(
            mounts[2].mount_point,
            PathBuf::from("/sys/fs/cgroup/unified x")
        );
    }

    #[test]
    fn joins_own_cgroup_under_the_mount() {
        let m = Path::new("/sys/fs/cgroup");
        assert_eq!(
            join_cgroup_path(m, "/", "/"),
            PathBuf::from("/sys/fs/cgroup")
        );
        assert_eq!(
            join_cgroup_path(m, "/", "/user.slice/app.service"),
            PathBuf::from("/sys/fs/cgroup/user.slice/app.service")
        );
        assert_eq!(
            join_cgroup_path(m, "/ns", "/ns/app"),
            PathBuf::from("/sys/fs/cgroup/app")
        );
    }

    #[test]
    fn reads_oom_kill_counters() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_keyed_counter(v1, "oom_kill"), Some(3));
        let v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(parse_keyed_counter(v2, "oom_kill"), Some(1));
        assert_eq!(parse_keyed_counter(v2, "oom"), Some(2));
        assert_eq!(
            parse_keyed_counter("oom_kill_disable 0\n", "oom_kill"),
            None
        );
    }

    #[test]
    fn formats_limits() {
        assert_eq!(v2_max(0), "max");
        assert_eq!(v2_max(64 << 20), "67108864");
        assert_eq!(v2_cpu_max(1.5), "150000 100000");
        assert_eq!(v2_cpu_max(0.0), "max 100000");
        assert_eq!(v2_cpu_max(f64::NAN), "max 100000");
        assert_eq!(v1_cpu_quota(0.25), "25000");
        assert_eq!(v1_cpu_quota(0.001), "1000");
        assert_eq!(v1_cpu_quota(-1.0), "-1");
    }

    #[test]
    fn rejects_names_that_are_not_one_component() {
        for bad in ["", ".", "..", "a/b", "/x"] {
            assert!(!is_path_component(bad), "{bad:?}");
        }
        assert!(is_path_component("alice.smith-2"));
    }
}
