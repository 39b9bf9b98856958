//! The few file operations on the cgroup file system, with errors that say which cgroup:
//! creating and removing directories (retrying while the last processes exit), writing
//! values, enabling v2 controllers, reading flat keyed counters.

use std::collections::HashSet;
use std::io;
use std::path::Path;
use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::RMDIR_TIMEOUT;
use crate::sandbox::SandboxError;

pub(super) fn cgroup_err(path: &Path, reason: impl std::fmt::Display) -> SandboxError {
    SandboxError::Cgroup {
        path: path.to_path_buf(),
        reason: reason.to_string(),
        source: None,
    }
}

/// [`cgroup_err`] because of the I/O error `source`, kept as the error's source.
pub(super) fn cgroup_io_err(
    path: &Path,
    reason: impl std::fmt::Display,
    source: io::Error,
) -> SandboxError {
    SandboxError::Cgroup {
        path: path.to_path_buf(),
        reason: reason.to_string(),
        source: Some(source),
    }
}

pub(super) fn is_path_component(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains('/') && !s.contains('\0')
}

pub(super) fn mkdir(dir: &Path) -> Result<(), SandboxError> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(cgroup_io_err(
            dir,
            format!("cannot create the cgroup: {e}"),
            e,
        )),
    }
}

pub(super) fn write_file(path: &Path, value: &str) -> Result<(), SandboxError> {
    std::fs::write(path, value)
        .map_err(|e| cgroup_io_err(path, format!("cannot write {value:?}: {e}"), e))
}

pub(super) fn write_limit(path: &Path, value: &str) -> Result<(), SandboxError> {
    write_file(path, value)
}

pub(super) fn read_trimmed(path: &Path) -> io::Result<String> {
    Ok(std::fs::read_to_string(path)?.trim().to_string())
}

/// Enables `+memory +cpu +pids` for the children of `dir` (v2).
pub(super) fn enable_controllers(dir: &Path) -> io::Result<()> {
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

/// Moves every process of the cgroup `from` into `to` (v2), this process first; says how
/// many others there were. A process that ended meanwhile is skipped; one that cannot be
/// moved (another uid's) stays, and enabling controllers then fails as before.
pub(super) fn move_all_processes(from: &Path, to: &Path) -> io::Result<usize> {
    let procs = to.join("cgroup.procs");
    std::fs::write(&procs, "0")?;
    let me = std::process::id().to_string();
    let mut others = 0;
    for pid in std::fs::read_to_string(from.join("cgroup.procs"))?.lines() {
        let pid = pid.trim();
        if pid.is_empty() || pid == me {
            continue;
        }
        match std::fs::write(&procs, pid) {
            Ok(()) => others += 1,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => {
                tracing::warn!(pid, cgroup = %from.display(), error = %e, "cannot move a process of the broker's cgroup into its leaf")
            }
        }
    }
    Ok(others)
}

/// `rmdir` of a leaf whose processes were just killed: the kernel may need a moment to let
/// the last of them go.
pub(super) async fn rmdir_retrying(dir: &Path) {
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
pub(super) fn rmdir_if_unused(dir: &Path) {
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

pub(super) fn subdirs(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect()
}

/// Parses `key N` out of a flat keyed file (`memory.events`, `memory.oom_control`).
pub(super) fn parse_keyed_counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some(key))
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn rejects_names_that_are_not_one_component() {
        for bad in ["", ".", "..", "a/b", "/x"] {
            assert!(!is_path_component(bad), "{bad:?}");
        }
        assert!(is_path_component("alice.smith-2"));
    }
}
