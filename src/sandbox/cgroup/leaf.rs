//! One kernel's leaf cgroup: the `cgroup.procs` files the launcher joins between `fork` and
//! `exec`, the counters that say how a kernel ended (an OOM kill, at its own limit or the
//! host's; processes refused at the pids limit), its memory use, and killing everything in
//! it.

use std::ffi::CString;
use std::path::PathBuf;
use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::fs::{parse_keyed_counter, write_file};
use super::{CgroupVersion, Leaf, KILL_TIMEOUT};
use crate::sandbox::SandboxError;

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

    /// The file holding the leaf's memory use in bytes (v2 `memory.current`, v1
    /// `memory.usage_in_bytes`), to be read while the kernel lives.
    pub fn memory_usage_file(&self) -> Option<PathBuf> {
        let file = match self.version {
            CgroupVersion::V2 => "memory.current",
            CgroupVersion::V1 => "memory.usage_in_bytes",
        };
        self.dirs.iter().map(|d| d.join(file)).find(|f| f.exists())
    }

    /// What reads the CPU time of the leaf's processes (see [`CpuClock`]).
    pub fn cpu_clock(&self) -> CpuClock {
        CpuClock {
            version: self.version,
            dirs: self.dirs.clone(),
        }
    }

    /// Whether the kernel's memory use reached a limit of the broker's: the leaf's own, or
    /// the one of the directory above it (the user's, or the container's). Tells an OOM kill
    /// by a cgroup from one by the host's OOM killer: v2 counts the times a limit was hit
    /// with nothing left to reclaim (`oom` in `memory.events`, which covers the subtree);
    /// v1 has no such counter, so the peak use (`memory.max_usage_in_bytes`) is compared
    /// with the limit. When nothing can be read, a limit is assumed (the usual case).
    pub fn reached_memory_limit(&self) -> bool {
        let Some(leaf) = self.dirs.first() else {
            return true;
        };
        let dirs = [Some(leaf.as_path()), leaf.parent()];
        let mut readable = false;
        for dir in dirs.into_iter().flatten() {
            let reached = match self.version {
                CgroupVersion::V2 => std::fs::read_to_string(dir.join("memory.events"))
                    .ok()
                    .and_then(|t| parse_keyed_counter(&t, "oom"))
                    .map(|n| n > 0),
                CgroupVersion::V1 => {
                    let read = |f: &str| -> Option<u64> {
                        std::fs::read_to_string(dir.join(f))
                            .ok()?
                            .trim()
                            .parse()
                            .ok()
                    };
                    match (
                        read("memory.max_usage_in_bytes"),
                        read("memory.limit_in_bytes"),
                    ) {
                        // Within 2% of the limit: the last charges failed there.
                        (Some(peak), Some(limit)) => Some(peak + limit / 50 >= limit),
                        _ => None,
                    }
                }
            };
            match reached {
                Some(true) => return true,
                Some(false) => readable = true,
                None => {}
            }
        }
        !readable
    }

    /// How many times a process or thread could not be created in this leaf because a
    /// pids limit was reached (`max` in `pids.events`, v1 and v2).
    pub fn pids_refused(&self) -> u64 {
        self.dirs
            .iter()
            .filter_map(|d| std::fs::read_to_string(d.join("pids.events")).ok())
            .filter_map(|t| parse_keyed_counter(&t, "max"))
            .sum()
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

    /// Moves host process `pid` into this leaf (every hierarchy's directory): a kernel
    /// forked from a template leaves the template's leaf before it runs any of its own code.
    pub fn enter(&self, pid: i32) -> Result<(), SandboxError> {
        for dir in &self.dirs {
            write_file(&dir.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// SIGKILLs every process in the leaf until none is left (or a timeout passes). Uses
    /// `cgroup.kill` where the kernel has it; otherwise kills the listed processes in rounds,
    /// which also catches processes forked while a round was running.
    pub async fn kill_all(&self) {
        // A frozen process (a checkpoint's, `freezer.rs`) does not die until thawed: this
        // also frees what a broker that ended without its shutdown left frozen.
        if let Err(e) = self.freezer().set(false) {
            tracing::warn!(error = %e, "a frozen leaf could not be thawed before its end");
        }
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
        // Looked at again after 1, 2, 4, 8 ms, then every 10: a kernel holding hundreds
        // of megabytes takes a few milliseconds to give them back, and a pause, a rewind
        // and a session's end wait for it.
        let mut wait = Duration::from_millis(1);
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
            sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(10));
        }
    }
}

/// Reads the CPU time a leaf's processes used, in nanoseconds. v2: `usage_usec` of the
/// leaf's `cpu.stat`, which counts every process that ever ran in it. v1: the broker's
/// leaves are in the `cpu` hierarchy, which counts no usage without `cpuacct` (mounted
/// apart on many hosts), so it is the user and system time of the processes in the leaf now,
/// with the children they waited for, from `/proc/<pid>/stat` (a process that ended
/// meanwhile takes its time with it: a reading over an interval may come out low, never
/// high). Holds paths only; a leaf that is gone reads `None`.
#[derive(Debug, Clone)]
pub struct CpuClock {
    version: CgroupVersion,
    dirs: Vec<PathBuf>,
}

impl CpuClock {
    pub fn read_ns(&self) -> Option<u64> {
        match self.version {
            CgroupVersion::V2 => {
                let text = std::fs::read_to_string(self.dirs.first()?.join("cpu.stat")).ok()?;
                parse_keyed_counter(&text, "usage_usec").map(|us| us.saturating_mul(1000))
            }
            CgroupVersion::V1 => {
                // SAFETY: sysconf has no memory-safety preconditions.
                let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
                let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
                let mut pids = Vec::new();
                for dir in &self.dirs {
                    let text = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
                    pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
                }
                pids.sort_unstable();
                pids.dedup();
                let ticks: u64 = pids
                    .into_iter()
                    .filter_map(crate::sandbox::procfs::cpu_ticks)
                    .fold(0, u64::saturating_add);
                Some(ticks.saturating_mul(1_000_000_000) / hz)
            }
        }
    }
}
