//! A user's directory alone, without kernel leaves: the docker backend's per-user parent
//! cgroup (`docker/parent.rs`), under which the engine creates all of the user's containers,
//! so that together they stay within her limits. The same directory and limits files as the
//! local backend's user directory (`limits::apply`), made, read back and removed here.

use std::path::{Path, PathBuf};

use super::fs::{cgroup_err, cgroup_io_err, enable_controllers, is_path_component, mkdir};
use super::fs::{read_trimmed, rmdir_if_unused, subdirs};
use super::mountinfo::parse_mountinfo;
use super::{limits, CgroupVersion, Cgroups};
use crate::sandbox::{SandboxError, UserLimits};
use crate::sync::lock;

impl Cgroups {
    /// The broker's tree at `parent` (a cgroup path as `/proc/<pid>/cgroup` shows it, e.g.
    /// a delegated `/system.slice/kernel-broker.service/containers`) `/name` in the
    /// hierarchies [`Cgroups::detect`] finds, instead of at the hierarchies' roots. `parent`
    /// must be an absolute path of plain components (no `.` or `..`).
    pub fn detect_under(parent: &str, name: &str) -> Result<Self, SandboxError> {
        let detected = Self::detect(name, true)
            .map_err(|e| cgroup_err(Path::new(name), format!("no cgroup hierarchy to use: {e}")))?;
        let rel = plain_relative(parent).ok_or_else(|| {
            cgroup_err(
                Path::new(parent),
                "not an absolute cgroup path of plain directory names",
            )
        })?;
        let rebase = |base: &PathBuf| -> PathBuf {
            let mount = base.parent().unwrap_or(Path::new("/"));
            mount.join(&rel).join(name)
        };
        let bases: Vec<PathBuf> = detected.bases.iter().map(rebase).collect();
        let v2_parent = match detected.version {
            CgroupVersion::V2 => bases[0].parent().map(Path::to_path_buf),
            CgroupVersion::V1 => None,
        };
        Ok(Self {
            version: detected.version,
            bases,
            v2_parent,
            tree_lock: std::sync::Mutex::new(()),
        })
    }

    /// Creates (or updates) the directory of `user` with her `limits` and, on v2, the
    /// controllers enabled for the cgroups below it. Returns its directories (one per
    /// hierarchy). Written on every call, so that configuration changes take effect.
    pub fn create_user(
        &self,
        user: &str,
        limits: &UserLimits,
    ) -> Result<Vec<PathBuf>, SandboxError> {
        if !is_path_component(user) {
            return Err(cgroup_err(
                &self.bases[0],
                format!("the user name {user:?} is not a single directory name"),
            ));
        }
        let _tree = lock(&self.tree_lock);
        let dirs: Vec<PathBuf> = self.bases.iter().map(|b| b.join(user)).collect();
        // The base too: a sweep removes it whenever no user is left in it.
        for dir in self.bases.iter().chain(&dirs) {
            mkdir(dir)?;
            if self.version == CgroupVersion::V2 {
                enable_controllers(dir).map_err(|e| cgroup_io_err(dir, e.to_string(), e))?;
            }
        }
        limits::apply(self.version, &dirs, limits)?;
        Ok(dirs)
    }

    /// The directories of `user` (whether or not they exist).
    pub fn user_dirs(&self, user: &str) -> Vec<PathBuf> {
        self.bases.iter().map(|b| b.join(user)).collect()
    }

    /// The limits in force on the directory of `user`, as lines `memory <limit>`,
    /// `pids <limit>` and `cpu <quota> <period>` (`none` for a file that cannot be read).
    pub fn user_limits_in_force(&self, user: &str) -> String {
        let dirs = self.user_dirs(user);
        let read = |file: &str| -> String {
            dirs.iter()
                .map(|d| d.join(file))
                .find(|f| f.exists())
                .and_then(|f| read_trimmed(&f).ok())
                .unwrap_or_else(|| "none".to_string())
        };
        match self.version {
            CgroupVersion::V2 => format!(
                "memory {}\npids {}\ncpu {}\n",
                read("memory.max"),
                read("pids.max"),
                read("cpu.max")
            ),
            CgroupVersion::V1 => format!(
                "memory {}\npids {}\ncpu {} {}\n",
                read("memory.limit_in_bytes"),
                read("pids.max"),
                read("cpu.cfs_quota_us"),
                read("cpu.cfs_period_us")
            ),
        }
    }

    /// Removes the directory of `user` if nothing is left in it, in every hierarchy: on v1
    /// an engine's cgroupfs driver makes a container's parents in each hierarchy mounted,
    /// not only in those holding the limits, and leaves them. Empty cgroups an engine left
    /// in it go first (Podman's `conmon`, where its monitors run); `rmdir` fails on any
    /// cgroup that holds a process or a child, so nothing in use goes.
    pub fn remove_user_everywhere(&self, user: &str) {
        if !is_path_component(user) {
            return;
        }
        let _tree = lock(&self.tree_lock);
        for base in self.bases_everywhere() {
            remove_with_empty_children(&base.join(user));
        }
    }

    /// Removes every user directory under the base that holds nothing any more, then the
    /// base itself if it is empty, in every hierarchy (as [`Self::remove_user_everywhere`]).
    /// Never kills: what is still in use stays.
    pub fn remove_unused_users(&self) {
        let _tree = lock(&self.tree_lock);
        for base in self.bases_everywhere() {
            for user in subdirs(&base) {
                remove_with_empty_children(&base.join(user));
            }
            rmdir_if_unused(&base);
        }
    }

    /// The base in every hierarchy: v2, the one; v1, the base's place in each cgroup mount.
    fn bases_everywhere(&self) -> Vec<PathBuf> {
        let mut all = self.bases.clone();
        if self.version == CgroupVersion::V2 {
            return all;
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .map(|t| parse_mountinfo(&t))
            .unwrap_or_default();
        // A hybrid host's empty cgroup2 mount too: the engine makes them there as well.
        let v1: Vec<&Path> = mounts
            .iter()
            .filter(|m| m.fs_type == "cgroup" || m.fs_type == "cgroup2")
            .map(|m| m.mount_point.as_path())
            .collect();
        let rel = v1
            .iter()
            .find_map(|mp| self.bases[0].strip_prefix(mp).ok())
            .map(Path::to_path_buf);
        if let Some(rel) = rel.filter(|r| !r.as_os_str().is_empty()) {
            for mp in v1 {
                let base = mp.join(&rel);
                if !all.contains(&base) {
                    all.push(base);
                }
            }
        }
        all
    }
}

/// Removes `dir`'s empty child cgroups, then `dir` if it is unused.
fn remove_with_empty_children(dir: &Path) {
    for child in subdirs(dir) {
        rmdir_if_unused(&dir.join(child));
    }
    rmdir_if_unused(dir);
}

/// `parent` without its leading `/`, if it is absolute and made of plain components.
fn plain_relative(parent: &str) -> Option<PathBuf> {
    let rest = parent.strip_prefix('/')?;
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() {
        return Some(PathBuf::new());
    }
    rest.split('/')
        .all(is_path_component)
        .then(|| PathBuf::from(rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parent_must_be_absolute_and_plain() {
        assert_eq!(plain_relative("/"), Some(PathBuf::new()));
        assert_eq!(
            plain_relative("/system.slice/kb.service/containers/"),
            Some(PathBuf::from("system.slice/kb.service/containers"))
        );
        for bad in ["", "relative", "/a/../b", "/a/./b", "/a//b"] {
            assert_eq!(plain_relative(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_user_directory_gets_her_limits_and_reads_them_back() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("kb");
        let cg = Cgroups {
            version: CgroupVersion::V2,
            bases: vec![base.clone()],
            v2_parent: None,
            tree_lock: std::sync::Mutex::new(()),
        };
        // cgroupfs makes the control files with the directory; here, ahead of it.
        let dir = base.join("u1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(base.join("cgroup.subtree_control"), "").unwrap();
        for f in [
            "memory.max",
            "pids.max",
            "cpu.max",
            "cgroup.subtree_control",
        ] {
            std::fs::write(dir.join(f), "").unwrap();
        }
        let limits = UserLimits {
            memory_bytes: 512 << 20,
            cpus: 0.5,
            pids: 64,
            ..UserLimits::default()
        };
        assert_eq!(
            cg.create_user("u1", &limits).unwrap(),
            std::slice::from_ref(&dir)
        );
        assert_eq!(
            cg.user_limits_in_force("u1"),
            "memory 536870912\npids 64\ncpu 50000 100000\n"
        );
        assert_eq!(
            cg.user_limits_in_force("nobody"),
            "memory none\npids none\ncpu none\n"
        );
        for bad in ["", "..", "a/b"] {
            assert!(cg.create_user(bad, &limits).is_err(), "{bad:?}");
        }
        // Still holding files (a plain directory here): kept, as a busy cgroup is.
        cg.remove_unused_users();
        assert!(dir.exists());
        std::fs::create_dir(base.join("empty")).unwrap();
        cg.remove_unused_users();
        assert!(!base.join("empty").exists());
    }
}
