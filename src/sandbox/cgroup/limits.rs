//! How a user's [`UserLimits`] and a kernel's [`KernelLimits`] become cgroup files:
//! `memory.max`, `cpu.max`, `pids.max` (and no swap) on v2; `memory.limit_in_bytes` with
//! `memsw`, `cpu.cfs_quota_us`, `pids.max` on v1. The user's files go on the user's
//! directory (the totals, a backstop), a kernel's on its leaf (its own share, so that the
//! OOM killer of a leaf only ever picks that kernel). The value formatting is pure, and the
//! writes are tested below against a temporary directory laid out like cgroupfs (v2 cannot
//! be run on every test host).

use std::path::{Path, PathBuf};

use super::fs::write_limit;
use super::CgroupVersion;
use crate::sandbox::{KernelLimits, SandboxError, UserLimits};

/// The CFS period used for CPU limits (100 ms, the kernel's default).
const CPU_PERIOD_US: u64 = 100_000;

/// Writes `limits` into the user's directories (v2: one; v1: one per hierarchy, each
/// taking the files it has).
pub(super) fn apply(
    version: CgroupVersion,
    user_dirs: &[PathBuf],
    limits: &UserLimits,
) -> Result<(), SandboxError> {
    match version {
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

/// Writes a kernel's own `limits` into its leaf directories (v2: one; v1: one per
/// hierarchy, each taking the files it has). CPU stays the user's, shared.
pub(super) fn apply_kernel(
    version: CgroupVersion,
    leaf_dirs: &[PathBuf],
    limits: &KernelLimits,
) -> Result<(), SandboxError> {
    match version {
        CgroupVersion::V2 => {
            let Some(dir) = leaf_dirs.first() else {
                return Ok(());
            };
            write_limit(&dir.join("memory.max"), &v2_max(limits.memory_bytes))?;
            let swap = dir.join("memory.swap.max");
            if swap.exists() {
                write_limit(&swap, "0")?;
            }
            write_limit(&dir.join("pids.max"), &v2_max(limits.pids))?;
        }
        CgroupVersion::V1 => {
            for dir in leaf_dirs {
                if dir.join("memory.limit_in_bytes").exists() {
                    set_v1_memory(dir, limits.memory_bytes)?;
                }
                if dir.join("pids.max").exists() {
                    write_limit(&dir.join("pids.max"), &v2_max(limits.pids))?;
                }
            }
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory with the given (empty) control files, as cgroupfs shows them.
    fn fake_cgroup(root: &Path, name: &str, files: &[&str]) -> PathBuf {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in files {
            std::fs::write(dir.join(f), "").unwrap();
        }
        dir
    }

    fn read(dir: &Path, file: &str) -> String {
        std::fs::read_to_string(dir.join(file)).unwrap()
    }

    #[test]
    fn a_kernel_leaf_gets_its_own_memory_and_pids_on_v2() {
        let tmp = tempfile::tempdir().unwrap();
        let leaf = fake_cgroup(
            tmp.path(),
            "leaf",
            &["memory.max", "memory.swap.max", "pids.max", "cpu.max"],
        );
        let limits = KernelLimits {
            memory_bytes: 256 << 20,
            pids: 128,
        };
        apply_kernel(CgroupVersion::V2, std::slice::from_ref(&leaf), &limits).unwrap();
        assert_eq!(read(&leaf, "memory.max"), "268435456");
        assert_eq!(read(&leaf, "memory.swap.max"), "0");
        assert_eq!(read(&leaf, "pids.max"), "128");
        assert_eq!(read(&leaf, "cpu.max"), "", "CPU stays the user's");
        // No limit of its own: `max`.
        let none = KernelLimits {
            memory_bytes: 0,
            pids: 0,
        };
        apply_kernel(CgroupVersion::V2, std::slice::from_ref(&leaf), &none).unwrap();
        assert_eq!(read(&leaf, "memory.max"), "max");
        assert_eq!(read(&leaf, "pids.max"), "max");
    }

    #[test]
    fn a_kernel_leaf_gets_its_own_memory_and_pids_on_v1() {
        let tmp = tempfile::tempdir().unwrap();
        let memory = fake_cgroup(
            tmp.path(),
            "memory/leaf",
            &["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"],
        );
        let pids = fake_cgroup(tmp.path(), "pids/leaf", &["pids.max"]);
        let cpu = fake_cgroup(tmp.path(), "cpu/leaf", &["cpu.cfs_quota_us"]);
        let limits = KernelLimits {
            memory_bytes: 64 << 20,
            pids: 32,
        };
        apply_kernel(
            CgroupVersion::V1,
            &[memory.clone(), cpu.clone(), pids.clone()],
            &limits,
        )
        .unwrap();
        assert_eq!(read(&memory, "memory.limit_in_bytes"), "67108864");
        assert_eq!(read(&memory, "memory.memsw.limit_in_bytes"), "67108864");
        assert_eq!(read(&pids, "pids.max"), "32");
        assert_eq!(read(&cpu, "cpu.cfs_quota_us"), "");
    }

    #[test]
    fn the_user_directory_gets_the_totals_on_v2() {
        let tmp = tempfile::tempdir().unwrap();
        let user = fake_cgroup(
            tmp.path(),
            "alice",
            &["memory.max", "memory.swap.max", "pids.max", "cpu.max"],
        );
        apply(
            CgroupVersion::V2,
            std::slice::from_ref(&user),
            &UserLimits::default(),
        )
        .unwrap();
        assert_eq!(read(&user, "memory.max"), (5u64 << 30).to_string());
        assert_eq!(read(&user, "pids.max"), "1280");
        assert_eq!(read(&user, "cpu.max"), "100000 100000");
        assert_eq!(read(&user, "memory.swap.max"), "0");
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
}
