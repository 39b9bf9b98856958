//! A kernel's own leaf inside its user's container cgroup (the docker backend).
//!
//! A user's kernels share one container, whose cgroup carries the user's totals. Docker
//! has no per-exec limits, so the broker (root on the host) makes a leaf per kernel below
//! the container's cgroup, with the kernel's own memory and process limits, and moves the
//! kernel's first process into it before that process starts the kernel (the kernel's
//! command waits for the broker's word; see `docker/exec.rs`). Everything the kernel forks
//! stays in the leaf, so the OOM killer of that leaf only ever picks this kernel.
//!
//! ```text
//! <container's cgroup>/        the user's totals (set by Docker)
//!   init/                      v2 only: the container's own processes (tini, sleep, execs)
//!   <session-uuid>/            one leaf per kernel
//! ```
//!
//! - **v1**: the container's directories in the `memory` and `pids` hierarchies; a leaf is a
//!   directory in each.
//! - **v2**: a cgroup may hand memory and pids to children only when it holds no processes
//!   itself ("no internal processes"), so the container's processes are first moved into
//!   `init/` and the controllers enabled. `docker exec` keeps working: runc joins the
//!   container's init process's cgroup when the container's own one refuses processes
//!   (EBUSY; runc since 1.0, opencontainers/runc#2416).
//!
//! The container's cgroup is found from the kernel process's `/proc/<pid>/cgroup` and the
//! broker's mounts. The file layout is tested against a temporary directory laid out like
//! cgroupfs (below), since a test host runs only one of the two versions.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::fs::{
    cgroup_err, cgroup_io_err, is_path_component, mkdir, read_trimmed, rmdir_retrying, subdirs,
    write_file,
};
use super::mountinfo::{join_cgroup_path, parse_mountinfo, Mount};
use super::{limits, CgroupVersion, Leaf};
use crate::sandbox::{KernelLimits, SandboxError};

/// The leaf holding a v2 container's own processes.
const INIT_LEAF: &str = "init";
/// How often enabling the v2 controllers is retried while execs keep arriving.
const ENABLE_ATTEMPTS: usize = 20;

/// Why the container cgroup of a process was not found.
#[derive(Debug, thiserror::Error)]
pub enum CgroupNotFound {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the process is in no cgroup v2 and in no v1 memory and pids cgroups")]
    NotInCgroup,
    #[error("no cgroup2 file system is mounted")]
    NoCgroup2Mount,
}

/// A container's cgroup directories (v1: memory then pids; v2: one). Never empty: only
/// [`ContainerCgroup::from_texts`] makes one, with one or two directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerCgroup {
    version: CgroupVersion,
    dirs: Vec<PathBuf>,
    /// v1: the container's directory in the `freezer` hierarchy, when one is mounted (its
    /// leaves' processes are frozen in a directory beneath it: `freezer.rs`).
    v1_freezer: Option<PathBuf>,
}

impl ContainerCgroup {
    /// The cgroup of host process `pid` (a process of the container).
    pub fn of_process(pid: i32) -> Result<Self, CgroupNotFound> {
        let read = |path: PathBuf| {
            std::fs::read_to_string(&path).map_err(|source| CgroupNotFound::Read { path, source })
        };
        let own = read(PathBuf::from(format!("/proc/{pid}/cgroup")))?;
        let mounts = read(PathBuf::from("/proc/self/mountinfo"))?;
        Self::from_texts(&own, &parse_mountinfo(&mounts))
    }

    /// The directories of the cgroup that `/proc/<pid>/cgroup` (`proc_cgroup`) names, under
    /// the mounts given. v1 when both `memory` and `pids` hierarchies are mounted; else v2.
    fn from_texts(proc_cgroup: &str, mounts: &[Mount]) -> Result<Self, CgroupNotFound> {
        let v1_dir = |ctrl: &str| -> Option<PathBuf> {
            let path = proc_cgroup.lines().find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
                ctrls.split(',').any(|c| c == ctrl).then_some(path)
            })?;
            let m = mounts
                .iter()
                .find(|m| m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == ctrl))?;
            Some(join_cgroup_path(&m.mount_point, &m.root, path))
        };
        if let (Some(memory), Some(pids)) = (v1_dir("memory"), v1_dir("pids")) {
            return Ok(Self {
                version: CgroupVersion::V1,
                dirs: vec![memory, pids],
                v1_freezer: v1_dir("freezer"),
            });
        }
        let path = proc_cgroup
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or(CgroupNotFound::NotInCgroup)?;
        let m = mounts
            .iter()
            .find(|m| m.fs_type == "cgroup2")
            .ok_or(CgroupNotFound::NoCgroup2Mount)?;
        let mut dir = join_cgroup_path(&m.mount_point, &m.root, path);
        // A process already moved into our v2 `init/` leaf names that leaf.
        if dir.file_name().is_some_and(|n| n == INIT_LEAF) {
            if let Some(parent) = dir.parent() {
                dir = parent.to_path_buf();
            }
        }
        Ok(Self {
            version: CgroupVersion::V2,
            dirs: vec![dir],
            v1_freezer: None,
        })
    }

    /// Creates the leaf of `session` with the kernel's `limits` (on v2, first moving the
    /// container's processes into `init/` and enabling the controllers).
    pub fn create_leaf(&self, session: &str, kernel: &KernelLimits) -> Result<Leaf, SandboxError> {
        if !is_path_component(session) {
            return Err(cgroup_err(
                self.dir(),
                format!("{session:?} is not a single directory name"),
            ));
        }
        if self.version == CgroupVersion::V2 {
            self.delegate_v2()?;
        }
        let mut leaf = Leaf {
            version: self.version,
            dirs: Vec::with_capacity(self.dirs.len()),
            procs_files: Vec::with_capacity(self.dirs.len()),
        };
        for dir in &self.dirs {
            let leaf_dir = dir.join(session);
            mkdir(&leaf_dir)?;
            let procs = CString::new(leaf_dir.join("cgroup.procs").as_os_str().as_bytes())
                .map_err(|_| cgroup_err(&leaf_dir, "the path contains a NUL byte"))?;
            leaf.procs_files.push(procs);
            leaf.dirs.push(leaf_dir);
        }
        if let Err(e) = limits::apply_kernel(self.version, &leaf.dirs, kernel) {
            for dir in &leaf.dirs {
                let _ = std::fs::remove_dir(dir);
            }
            return Err(e);
        }
        Ok(leaf)
    }

    /// v2: moves the container's processes into `init/` and enables `memory` and `pids` for
    /// its children. Execs may arrive meanwhile (the enable then fails with EBUSY): moved too,
    /// and tried again.
    fn delegate_v2(&self) -> Result<(), SandboxError> {
        let dir = self.dir();
        let control = dir.join("cgroup.subtree_control");
        let enabled = read_trimmed(&control).unwrap_or_default();
        let has = |c: &str| enabled.split_whitespace().any(|e| e == c);
        if has("memory") && has("pids") {
            return Ok(());
        }
        let init = dir.join(INIT_LEAF);
        mkdir(&init)?;
        let mut last = String::new();
        for _ in 0..ENABLE_ATTEMPTS {
            move_all(dir, &init)?;
            match std::fs::write(&control, "+memory +pids") {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(cgroup_err(
            &control,
            format!("cannot enable memory and pids for the kernels' cgroups: {last}"),
        ))
    }

    /// What freezes `leaf` (one of this container's): v2 the leaf's `cgroup.freeze`; v1 a
    /// directory of the leaf's name beneath the container's own in the `freezer`
    /// hierarchy, so a thawed process goes back to the container's freezer cgroup.
    pub fn freezer(&self, leaf: &Leaf) -> super::Freezer {
        super::Freezer::beneath(leaf, self.v1_freezer.clone())
    }

    /// Thaws every leaf of this container frozen as a checkpoint's (a broker killed while
    /// it held one): a frozen process does not die until thawed (v1), so the engine could
    /// not remove the container. Only the cgroup file system is written.
    pub fn thaw_all(&self) {
        let frozen: Vec<(PathBuf, &str, &str)> = match (&self.v1_freezer, self.version) {
            (Some(home), CgroupVersion::V1) => subdirs(home)
                .into_iter()
                .map(|d| (home.join(d), "freezer.state", "THAWED"))
                .collect(),
            (_, CgroupVersion::V2) => subdirs(self.dir())
                .into_iter()
                .map(|d| (self.dir().join(d), "cgroup.freeze", "0"))
                .collect(),
            _ => Vec::new(),
        };
        for (dir, file, value) in frozen {
            let path = dir.join(file);
            if path.exists() {
                if let Err(e) = write_file(&path, value) {
                    tracing::warn!(cgroup = %dir.display(), error = %e, "cannot thaw a container's leaf");
                }
            }
        }
    }

    /// The container's directories (v1: memory, then pids; v2: one).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The first directory (the memory hierarchy's on v1).
    fn dir(&self) -> &Path {
        self.dirs.first().map_or(Path::new("/"), PathBuf::as_path)
    }

    /// Moves host process `pid` into `leaf` (every hierarchy's directory).
    pub fn enter(leaf: &Leaf, pid: i32) -> Result<(), SandboxError> {
        for dir in leaf.dirs() {
            write_file(&dir.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// Kills what is left in `leaf` and removes it.
    pub async fn remove_leaf(leaf: &Leaf) {
        leaf.kill_all().await;
        for dir in leaf.dirs() {
            rmdir_retrying(dir).await;
        }
    }
}

/// Moves every process listed in `from/cgroup.procs` into `to`. A process that exited
/// meanwhile (ESRCH) is no error.
fn move_all(from: &Path, to: &Path) -> Result<(), SandboxError> {
    let procs = std::fs::read_to_string(from.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().map(str::trim).filter(|p| !p.is_empty()) {
        if let Err(e) = std::fs::write(to.join("cgroup.procs"), pid) {
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(cgroup_io_err(
                    to,
                    format!("cannot move the container's process {pid}: {e}"),
                    e,
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(fs_type: &str, point: &Path, opts: &str) -> Mount {
        Mount {
            root: "/".into(),
            mount_point: point.to_path_buf(),
            fs_type: fs_type.into(),
            super_options: opts.split(',').map(str::to_string).collect(),
        }
    }

    #[test]
    fn finds_a_containers_directories_on_v1_and_v2() {
        let root = Path::new("/sys/fs/cgroup");
        let v1 = [
            mount("cgroup", &root.join("memory"), "rw,memory"),
            mount("cgroup", &root.join("pids"), "rw,pids"),
            mount("cgroup", &root.join("cpu,cpuacct"), "rw,cpu,cpuacct"),
        ];
        let proc_v1 =
            "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n";
        let c = ContainerCgroup::from_texts(proc_v1, &v1).unwrap();
        assert_eq!(c.version, CgroupVersion::V1);
        assert_eq!(
            c.dirs,
            [root.join("memory/docker/abc"), root.join("pids/docker/abc")]
        );

        let v2 = [mount("cgroup2", root, "rw,nsdelegate")];
        let proc_v2 = "0::/system.slice/docker-abc.scope\n";
        let c = ContainerCgroup::from_texts(proc_v2, &v2).unwrap();
        assert_eq!(c.version, CgroupVersion::V2);
        assert_eq!(c.dirs, [root.join("system.slice/docker-abc.scope")]);
        // An exec that runc put into our init leaf names the container's cgroup too.
        let c =
            ContainerCgroup::from_texts("0::/system.slice/docker-abc.scope/init\n", &v2).unwrap();
        assert_eq!(c.dirs, [root.join("system.slice/docker-abc.scope")]);

        assert!(ContainerCgroup::from_texts("0::/x\n", &[]).is_err());
    }

    #[test]
    fn a_v2_container_hands_its_processes_to_init_and_gets_kernel_leaves() {
        let tmp = tempfile::tempdir().unwrap();
        let c = tmp.path().join("docker-abc.scope");
        std::fs::create_dir(&c).unwrap();
        std::fs::write(c.join("cgroup.procs"), "1\n7\n").unwrap();
        std::fs::write(c.join("cgroup.subtree_control"), "").unwrap();
        let cg = ContainerCgroup {
            version: CgroupVersion::V2,
            dirs: vec![c.clone()],
            v1_freezer: None,
        };
        let limits = KernelLimits {
            memory_bytes: 128 << 20,
            pids: 64,
        };
        let session = "0f1e2d3c-0000-4000-8000-000000000000";
        let leaf = cg.create_leaf(session, &limits).unwrap();
        // The container's processes went to init/ (a plain file here keeps the last
        // write), and the controllers were enabled for the children.
        assert_eq!(
            std::fs::read_to_string(c.join("init/cgroup.procs")).unwrap(),
            "7"
        );
        assert_eq!(
            std::fs::read_to_string(c.join("cgroup.subtree_control")).unwrap(),
            "+memory +pids"
        );
        let dir = c.join(session);
        assert_eq!(leaf.dirs(), std::slice::from_ref(&dir));
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.max")).unwrap(),
            "134217728"
        );
        assert_eq!(std::fs::read_to_string(dir.join("pids.max")).unwrap(), "64");
        ContainerCgroup::enter(&leaf, 4242).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("cgroup.procs")).unwrap(),
            "4242"
        );
        assert_eq!(
            leaf.memory_usage_file(),
            None,
            "no memory.current in a plain directory"
        );
    }

    #[test]
    fn a_v1_container_gets_a_kernel_leaf_in_memory_and_pids() {
        let tmp = tempfile::tempdir().unwrap();
        let memory = tmp.path().join("memory/docker/abc");
        let pids = tmp.path().join("pids/docker/abc");
        for d in [&memory, &pids] {
            std::fs::create_dir_all(d).unwrap();
        }
        let cg = ContainerCgroup {
            version: CgroupVersion::V1,
            dirs: vec![memory.clone(), pids.clone()],
            v1_freezer: None,
        };
        // cgroupfs creates the control files with the directory; here, by hand.
        let session = "s1";
        for (d, f) in [
            (&memory, "memory.limit_in_bytes"),
            (&memory, "memory.memsw.limit_in_bytes"),
            (&pids, "pids.max"),
        ] {
            std::fs::create_dir_all(d.join(session)).unwrap();
            std::fs::write(d.join(session).join(f), "").unwrap();
        }
        let limits = KernelLimits {
            memory_bytes: 96 << 20,
            pids: 50,
        };
        let leaf = cg.create_leaf(session, &limits).unwrap();
        assert_eq!(leaf.dirs(), [memory.join(session), pids.join(session)]);
        assert_eq!(
            std::fs::read_to_string(memory.join("s1/memory.limit_in_bytes")).unwrap(),
            (96u64 << 20).to_string()
        );
        assert_eq!(
            std::fs::read_to_string(pids.join("s1/pids.max")).unwrap(),
            "50"
        );
    }
}
