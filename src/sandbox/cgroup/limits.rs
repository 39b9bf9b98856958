//! How a user's [`UserLimits`] become cgroup files: `memory.max`, `cpu.max`, `pids.max`
//! (and no swap) on v2; `memory.limit_in_bytes` with `memsw`, `cpu.cfs_quota_us`,
//! `pids.max` on v1. The value formatting is pure and tested below.

use std::path::{Path, PathBuf};

use super::fs::write_limit;
use super::CgroupVersion;
use crate::sandbox::{SandboxError, UserLimits};

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
