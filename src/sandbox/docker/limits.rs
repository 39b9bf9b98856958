//! The check, inside a newly started container, that its cgroup enforces the memory, pids
//! and CPU limits the engine was asked for ([`verify_limits`]), and the Docker settings
//! those limits map to ([`resource_limits`]).

use bollard::Docker;
use tokio::time::timeout;

use super::daemon::error_text;
use super::running::exec_output;
use super::EXEC_TIMEOUT;
use crate::sandbox::UserLimits;

/// Why [`verify_limits`] could not confirm the container's limits.
#[derive(Debug, thiserror::Error)]
pub(super) enum LimitsUnverified {
    #[error("reading them took longer than {0:?}")]
    ReadTimedOut(std::time::Duration),
    #[error("cannot read them: {}", error_text(.0))]
    ReadFailed(#[source] bollard::errors::Error),
    #[error("cannot read them (exit {code}): {output}")]
    ReadExited { code: i64, output: String },
    #[error(transparent)]
    NotInForce(#[from] NotInForce),
}

/// The limits the container's cgroup does not enforce, each as `<name> <found> (asked ..)`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("in force: {}", .0.join(", "))]
pub(super) struct NotInForce(Vec<String>);

/// The engine accepted a user's limits for a container but does not enforce them.
#[derive(Debug, thiserror::Error)]
#[error(
    "the engine did not apply the user's limits to the container {container}: {source}; a \
     rootless engine on cgroup v1, or one without a cgroup it may write, cannot \
     (docs/HOSTS-podman.md, --docker-cgroup-parent); require_limits = false runs kernels \
     without them"
)]
pub(super) struct LimitsNotApplied {
    pub container: String,
    #[source]
    pub source: LimitsUnverified,
}

/// Docker's resource settings for a user's limits (0 means unlimited).
pub(super) struct ResourceLimits {
    pub memory: Option<i64>,
    pub nano_cpus: Option<i64>,
    pub pids: Option<i64>,
}

pub(super) fn resource_limits(limits: &UserLimits) -> ResourceLimits {
    let positive = |v: i64| (v > 0).then_some(v);
    ResourceLimits {
        memory: positive(i64::try_from(limits.memory_bytes).unwrap_or(i64::MAX)),
        nano_cpus: positive((limits.cpus * 1e9).round() as i64),
        pids: positive(i64::try_from(limits.pids).unwrap_or(i64::MAX)),
    }
}

/// Checks, inside the started container, that its cgroup enforces the memory, pids and CPU
/// limits the engine was asked for: an engine may accept them and apply none (rootless
/// Podman on cgroup v1 only logs that it ignores them). `Err` says which limit is missing.
pub(super) async fn verify_limits(
    docker: &Docker,
    container: &str,
    limits: &UserLimits,
) -> Result<(), LimitsUnverified> {
    let wanted = resource_limits(limits);
    if wanted.memory.is_none() && wanted.pids.is_none() && wanted.nano_cpus.is_none() {
        return Ok(());
    }
    let (code, out) = timeout(
        EXEC_TIMEOUT,
        exec_output(docker, container, &["sh", "-c", ENFORCED_LIMITS_SCRIPT]),
    )
    .await
    .map_err(|_| LimitsUnverified::ReadTimedOut(EXEC_TIMEOUT))?
    .map_err(LimitsUnverified::ReadFailed)?;
    if code != 0 {
        return Err(LimitsUnverified::ReadExited {
            code,
            output: out.trim().to_string(),
        });
    }
    Ok(check_enforced(&out, &wanted)?)
}

/// Prints `memory <limit>`, `pids <limit>` and `cpu <quota> <period>` as the container's own
/// cgroup has them (v2, else v1; `max`/`-1` for none).
const ENFORCED_LIMITS_SCRIPT: &str = "\
    if [ -e /sys/fs/cgroup/cgroup.controllers ]; then \
      echo memory $(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo none); \
      echo pids $(cat /sys/fs/cgroup/pids.max 2>/dev/null || echo none); \
      echo cpu $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none); \
    else \
      echo memory $(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || echo none); \
      echo pids $(cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || echo none); \
      echo cpu $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || echo none) \
        $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us 2>/dev/null || echo none); \
    fi";

/// Compares what [`ENFORCED_LIMITS_SCRIPT`] printed with the limits asked for. The kernel
/// rounds a memory limit down to a page; a limit tighter than asked is in force too.
pub(super) fn check_enforced(out: &str, wanted: &ResourceLimits) -> Result<(), NotInForce> {
    let field = |key: &str| -> Vec<&str> {
        out.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
            .map(|rest| rest.split_whitespace().collect())
            .unwrap_or_default()
    };
    let number = |v: Option<&&str>| v.and_then(|v| v.parse::<i64>().ok());
    let mut missing = Vec::new();
    for (key, want) in [("memory", wanted.memory), ("pids", wanted.pids)] {
        let Some(want) = want else { continue };
        let have = field(key);
        match number(have.first()) {
            Some(n) if n > 0 && n <= want => {}
            _ => missing.push(format!("{key} {} (asked {want})", have.join(" "))),
        }
    }
    if let Some(want) = wanted.nano_cpus {
        let have = field("cpu");
        match (number(have.first()), number(have.get(1))) {
            // quota/period in CPUs, against nanoCPUs (1 µs of slack for rounding).
            (Some(quota), Some(period)) if quota > 0 && period > 0 => {
                if quota.saturating_mul(1_000_000_000) > want.saturating_mul(period) + period {
                    missing.push(format!("cpu {} (asked {want} nanoCPUs)", have.join(" ")));
                }
            }
            _ => missing.push(format!("cpu {} (asked {want} nanoCPUs)", have.join(" "))),
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(NotInForce(missing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_map_to_docker_settings() {
        let l = resource_limits(&UserLimits {
            memory_bytes: 1 << 30,
            cpus: 1.5,
            pids: 256,
            ..UserLimits::default()
        });
        assert_eq!(l.memory, Some(1 << 30));
        assert_eq!(l.nano_cpus, Some(1_500_000_000));
        assert_eq!(l.pids, Some(256));
        let none = resource_limits(&UserLimits {
            memory_bytes: 0,
            cpus: 0.0,
            pids: 0,
            ..UserLimits::default()
        });
        assert_eq!((none.memory, none.nano_cpus, none.pids), (None, None, None));
    }

    #[test]
    fn enforced_limits_are_checked_against_those_asked_for() {
        let wanted = ResourceLimits {
            memory: Some(1 << 30),
            nano_cpus: Some(500_000_000),
            pids: Some(256),
        };
        // cgroup v2 and v1, as the script prints them.
        let v2 = "memory 1073741824\npids 256\ncpu 50000 100000\n";
        assert_eq!(check_enforced(v2, &wanted), Ok(()));
        let v1 = "memory 1073741824\npids 256\ncpu 50000 100000\n";
        assert_eq!(check_enforced(v1, &wanted), Ok(()));
        // Rounded down to a page, or tighter: in force.
        assert_eq!(
            check_enforced("memory 1073737728\npids 100\ncpu 25000 100000", &wanted),
            Ok(())
        );
        // Accepted but not applied (rootless Podman on cgroup v1): each one is named.
        let ignored = "memory 9223372036854771712\npids max\ncpu -1 100000\n";
        let err = check_enforced(ignored, &wanted).unwrap_err().to_string();
        assert!(err.contains("memory 9223372036854771712"), "{err}");
        assert!(err.contains("pids max"), "{err}");
        assert!(err.contains("cpu -1 100000"), "{err}");
        let err = check_enforced("memory max\npids 256\ncpu max 100000", &wanted)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("memory max") && err.contains("cpu max"),
            "{err}"
        );
        assert!(!err.contains("pids"), "{err}");
        // Unreadable files, or a looser CPU quota.
        assert!(check_enforced("memory none\npids none\ncpu none", &wanted).is_err());
        assert!(check_enforced("", &wanted).is_err());
        let err = check_enforced("memory 1073741824\npids 256\ncpu 100000 100000", &wanted)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("in force: cpu 100000 100000"), "{err}");
        // Nothing asked, nothing checked.
        let none = ResourceLimits {
            memory: None,
            nano_cpus: None,
            pids: None,
        };
        assert_eq!(check_enforced("", &none), Ok(()));
    }
}
