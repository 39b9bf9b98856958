//! What a broker leaves when its test panics before `stop()`: the test's runtime ends with
//! the server task cut off mid-shutdown, so its kernels' cgroup leaves, its containers and
//! its runtime base stay. `Broker`'s drop removes them here, synchronously (no runtime is
//! left to await anything), so a failing test does not leak into the machine.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The cgroup directories of a broker whose `--cgroup-name` is `name` (v1 and v2).
pub fn cgroup_bases(name: &str) -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    let mut found: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join(name))
        .filter(|p| p.is_dir())
        .collect();
    if root.join(name).is_dir() {
        found.push(root.join(name));
    }
    found
}

/// Kills everything in the cgroup trees named `name` and removes them, deepest first.
pub fn remove_cgroups(name: &str) {
    for _ in 0..50 {
        let bases = cgroup_bases(name);
        if bases.is_empty() {
            return;
        }
        for base in bases {
            let mut dirs = Vec::new();
            collect_dirs(&base, &mut dirs);
            dirs.sort_by_key(|d| std::cmp::Reverse(d.as_os_str().len()));
            for d in &dirs {
                let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
                for pid in procs
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: kill(2) on a pid read from the test's own cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            for d in &dirs {
                let _ = std::fs::remove_dir(d);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            collect_dirs(&entry.path(), out);
        }
    }
}

/// Removes the Docker containers a broker on `data_dir` made (labelled with it).
pub fn remove_containers(data_dir: &Path) {
    let label = format!(
        "label={}={}",
        kernel_broker::sandbox::docker::LABEL_DATA_DIR,
        data_dir.display()
    );
    let Ok(out) = super::docker_cli()
        .args(["ps", "-aq", "--filter", &label])
        .output()
    else {
        return;
    };
    for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        let _ = super::docker_cli().args(["rm", "-f", id]).output();
    }
}

/// Lazily unmounts every mount below `dir` (the workspace file systems), deepest first, so
/// that the temporary directory holding them can go.
pub fn unmount_below(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<&str> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| Path::new(p).starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        let _ = std::process::Command::new("umount")
            .args(["-l", point])
            .output();
    }
}
