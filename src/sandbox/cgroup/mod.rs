//! Control groups for the local sandbox: per-user limits and one leaf per kernel.
//!
//! This module owns the broker's subtree of the cgroup hierarchy (named `kernel-broker`
//! unless configured otherwise) and nothing outside it. Layout, under each hierarchy used:
//!
//! ```text
//! kernel-broker/               created on startup, removed on shutdown when empty
//!   <user>/                    the user's totals: memory, CPU, processes (a backstop)
//!     <session-uuid>/          one leaf per kernel, with the kernel's own memory and
//!                              process limits; the kernel's processes live only here
//! ```
//!
//! Memory is divided, not pooled: each leaf has its own `memory.max`, so when a kernel
//! allocates past it, the OOM killer of that leaf picks among that kernel's processes only.
//! The session layer admits kernels so that their limits add up to at most the user's
//! total; the user's own limit is then never the one reached (but stays, as a backstop).
//! The docker backend puts the same leaves inside a user's container (`nested.rs`).
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
//!
//! Layout: this file holds [`Cgroups`] (finding the hierarchies, the broker's tree, users'
//! directories and leaves); `leaf.rs` a kernel's [`Leaf`] (joining, OOM counter, killing);
//! `limits.rs` how [`UserLimits`] and [`KernelLimits`] become v1 and v2 files;
//! `mountinfo.rs` finding the hierarchies; `nested.rs` leaves inside a container's cgroup;
//! `fs.rs` the few file operations on the cgroup file system; `user_dir.rs` a user's
//! directory alone (the docker backend's per-user parent of her containers).
//!
//! Why hand-written and not the `cgroups-rs` crate (0.5, maintained by the Kata Containers
//! project; v1 and v2, builders for memory/pids/cpu, `memory.events`): the launch joins a
//! leaf between `fork` and `exec`, which needs the `cgroup.procs` paths ready as C strings
//! and async-signal-safe writes, not the crate's allocating `add_task`; the unprivileged
//! case needs the broker's own delegated v2 cgroup and stepping out of it (EBUSY), which
//! the crate does not model; and what is used here (three limits, one counter, a kill loop,
//! a sweep) is a few hundred lines against a dependency of several thousand.

mod freezer;
mod fs;
mod leaf;
mod limits;
mod mountinfo;
mod nested;
#[cfg(test)]
mod tests;
mod user_dir;

pub use freezer::{set_oom_score_adj, Freezer};
pub use leaf::CpuClock;
pub use nested::{CgroupNotFound, ContainerCgroup};

use std::collections::HashSet;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use uuid::Uuid;

use self::fs::{
    cgroup_err, cgroup_io_err, enable_controllers, is_path_component, mkdir, move_all_processes,
    read_trimmed, rmdir_if_unused, rmdir_retrying, subdirs,
};
use self::mountinfo::{join_cgroup_path, parse_mountinfo, read_own_cgroup_v2};
use super::{KernelLimits, SandboxError, UserLimits};
use crate::sync::lock;

/// A number in a cgroup file (`memory.current` and the like); `None` once it is gone.
pub fn read_counter(file: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

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

/// Why [`Cgroups::detect`] found no hierarchy to use.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    #[error("the cgroup name {0:?} is not a single directory name")]
    NameNotADirectory(String),
    #[error("cannot read /proc/self/mountinfo: {0}")]
    MountInfo(#[source] std::io::Error),
    #[error("cannot find the broker's own cgroup in /proc/self/cgroup")]
    OwnCgroupUnknown,
    #[error("the host uses cgroup v1, which cannot be delegated to an unprivileged broker")]
    V1Unprivileged,
    #[error(
        "no cgroup hierarchy offers the memory, cpu and pids controllers \
         (neither a cgroup2 mount with all three nor cgroup v1 mounts of each)"
    )]
    ControllersMissing,
}

impl Cgroups {
    /// Finds the hierarchies to use, without writing anything. `name` is the directory the
    /// broker's tree lives in (`kernel-broker`); `privileged` is whether the broker runs as
    /// root (unprivileged brokers need a delegated v2 cgroup).
    pub fn detect(name: &str, privileged: bool) -> Result<Self, DetectError> {
        if !is_path_component(name) {
            return Err(DetectError::NameNotADirectory(name.to_string()));
        }
        let mountinfo =
            std::fs::read_to_string("/proc/self/mountinfo").map_err(DetectError::MountInfo)?;
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
                    let own = read_own_cgroup_v2().ok_or(DetectError::OwnCgroupUnknown)?;
                    // Already stepped aside into the leaf (by an earlier broker of this
                    // service, or another one sharing its cgroup): the delegated cgroup is
                    // the one above.
                    let own = own.strip_suffix(&format!("/{SELF_LEAF}")).unwrap_or(&own);
                    join_cgroup_path(&m.mount_point, &m.root, own)
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
            (Some(_), Some(_), Some(_)) => Err(DetectError::V1Unprivileged),
            _ => Err(DetectError::ControllersMissing),
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
                // processes. The broker's delegated cgroup holds the broker and whatever
                // else its service runs (a wrapper, the test runner): all of it steps aside
                // into one leaf, the way systemd's own delegation expects, and the enabling
                // is tried again (a process forked meanwhile lands beside it: a few rounds).
                if e.raw_os_error() != Some(libc::EBUSY) {
                    return Err(cgroup_err(
                        parent,
                        format!(
                            "cannot enable the memory, cpu and pids controllers: {e} \
                             (the cgroup must be delegated to the broker)"
                        ),
                    ));
                }
                let own_leaf = parent.join(SELF_LEAF);
                mkdir(&own_leaf)?;
                let mut last = Some(e);
                for _ in 0..5 {
                    let others = move_all_processes(parent, &own_leaf)
                        .map_err(|e| cgroup_io_err(&own_leaf, e.to_string(), e))?;
                    tracing::info!(cgroup = %own_leaf.display(), others, "moved the broker's processes into their own leaf cgroup");
                    last = enable_controllers(parent).err();
                    if last.is_none() {
                        break;
                    }
                }
                if let Some(e) = last {
                    return Err(cgroup_err(
                        parent,
                        format!(
                            "cannot enable the memory, cpu and pids controllers: {e} \
                             (the cgroup holds processes the broker cannot move: it must be \
                             delegated to the broker's user and hold only the broker's processes)"
                        ),
                    ));
                }
            }
        }
        for base in &self.bases {
            mkdir(base)?;
            if self.version == CgroupVersion::V2 {
                enable_controllers(base).map_err(|e| cgroup_io_err(base, e.to_string(), e))?;
            }
        }
        Ok(())
    }

    /// Creates (or updates) the user's directory with `limits` and a leaf for `session`
    /// with the kernel's own `kernel` limits. Limits are written on every launch so that
    /// configuration changes take effect.
    pub fn create_leaf(
        &self,
        user: &str,
        limits: &UserLimits,
        kernel: &KernelLimits,
        session: Uuid,
    ) -> Result<Leaf, SandboxError> {
        if !is_path_component(user) {
            return Err(cgroup_err(
                &self.bases[0],
                format!("the user name {user:?} is not a single directory name"),
            ));
        }
        let session = session.to_string();
        let _tree = lock(&self.tree_lock);
        let mut dirs = Vec::with_capacity(self.bases.len());
        for base in &self.bases {
            let user_dir = base.join(user);
            mkdir(&user_dir)?;
            if self.version == CgroupVersion::V2 {
                enable_controllers(&user_dir)
                    .map_err(|e| cgroup_io_err(&user_dir, e.to_string(), e))?;
            }
            dirs.push((user_dir.clone(), user_dir.join(&session)));
        }
        limits::apply(
            self.version,
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
        if let Err(e) = limits::apply_kernel(self.version, &leaf.dirs, kernel) {
            // Empty and never joined: a plain rmdir removes them.
            for dir in &leaf.dirs {
                rmdir_if_unused(dir);
            }
            return Err(e);
        }
        Ok(leaf)
    }

    /// Makes the leaf of a process placed ahead of need (a fork-server stem) the leaf of
    /// `session`: renamed after it (in every hierarchy, or in none) and given `kernel`'s
    /// limits. The user's limits are on the directory above since the leaf was made.
    /// cgroup v1 only: v2 does not rename cgroups.
    pub fn claim_leaf(
        &self,
        leaf: &mut Leaf,
        session: Uuid,
        kernel: &KernelLimits,
    ) -> Result<(), SandboxError> {
        let name = session.to_string();
        let _tree = lock(&self.tree_lock);
        let mut renamed: Vec<(PathBuf, PathBuf)> = Vec::with_capacity(leaf.dirs.len());
        for dir in &leaf.dirs {
            let to = dir.with_file_name(&name);
            if let Err(e) = std::fs::rename(dir, &to) {
                for (from, to) in renamed.iter().rev() {
                    let _ = std::fs::rename(to, from);
                }
                return Err(cgroup_io_err(
                    dir,
                    format!("cannot rename it to {name}: {e}"),
                    e,
                ));
            }
            renamed.push((dir.clone(), to));
        }
        let mut procs_files = Vec::with_capacity(renamed.len());
        for (_, to) in &renamed {
            let procs = to.join("cgroup.procs");
            procs_files.push(
                CString::new(procs.as_os_str().as_bytes())
                    .map_err(|_| cgroup_err(to, "the path contains a NUL byte"))?,
            );
        }
        leaf.dirs = renamed.into_iter().map(|(_, to)| to).collect();
        leaf.procs_files = procs_files;
        limits::apply_kernel(self.version, &leaf.dirs, kernel)
    }

    /// Kills what is left in `leaf`, removes it, and removes the user's directory when no
    /// other leaf is left in it.
    pub async fn remove_leaf(&self, leaf: &Leaf) {
        leaf.kill_all().await;
        for dir in &leaf.dirs {
            rmdir_retrying(dir).await;
        }
        let _tree = lock(&self.tree_lock);
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
        let _tree = lock(&self.tree_lock);
        for base in &self.bases {
            rmdir_if_unused(&base.join(user));
        }
    }

    /// Removes the base directories if they are empty (broker shutdown).
    pub fn remove_base_if_unused(&self) {
        let _tree = lock(&self.tree_lock);
        for base in &self.bases {
            rmdir_if_unused(base);
        }
    }

    /// The leaf an earlier run made for `session` of `user`, if it is still there (a kept
    /// kernel's, `--keep-sessions`).
    pub fn existing_leaf(&self, user: &str, session: Uuid) -> Option<Leaf> {
        if !is_path_component(user) {
            return None;
        }
        let session = session.to_string();
        let dirs: Vec<PathBuf> = self
            .bases
            .iter()
            .map(|b| b.join(user).join(&session))
            .filter(|d| d.is_dir())
            .collect();
        if dirs.is_empty() {
            return None;
        }
        let procs_files = dirs
            .iter()
            .filter_map(|d| CString::new(d.join("cgroup.procs").as_os_str().as_bytes()).ok())
            .collect();
        Some(Leaf {
            version: self.version,
            dirs,
            procs_files,
        })
    }

    /// At shutdown, once the kernels are gone: every leaf left under the base (a command the
    /// shutdown ended, whose reaper has not removed its leaf yet: a terminal, a command
    /// blocked on unread output) is killed and removed, then the base.
    pub async fn remove_all(&self) {
        let swept = self.sweep_stale(&std::collections::HashSet::new()).await;
        if swept > 0 {
            tracing::info!(
                leaves = swept,
                "removed the leaves of commands ended by the shutdown"
            );
        }
        self.remove_base_if_unused();
    }

    /// Kills and removes every leaf under the base but those of the sessions in `keep`
    /// (kept kernels, `--keep-sessions`): at startup, before this run has launched anything,
    /// what an earlier run of the broker left behind; at shutdown, after the kernels are
    /// gone, what commands ended by it left.
    pub async fn sweep_stale(&self, keep: &std::collections::HashSet<Uuid>) -> usize {
        let mut removed = 0;
        // The same leaf appears once per hierarchy on v1; handle it as one leaf.
        let mut leaves: Vec<(String, String)> = Vec::new();
        for base in &self.bases {
            for user in subdirs(base) {
                for session in subdirs(&base.join(&user)) {
                    let kept = Uuid::parse_str(&session).is_ok_and(|id| keep.contains(&id));
                    if !kept && !leaves.contains(&(user.clone(), session.clone())) {
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
            // A checkpoint's leaf is frozen (a broker killed while it held one), and a
            // frozen process does not die of SIGKILL until thawed (v1).
            if let Err(e) = leaf.freezer().set(false) {
                tracing::warn!(user, session, error = %e, "cannot thaw a leaf left frozen");
            }
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
}
