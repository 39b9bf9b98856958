//! What ran out: turning how a kernel process ended into the resource that ended it.
//!
//! A kernel that cannot get memory, a process or a thread, or disk rarely says so itself:
//! it exits with code 1 ("cannot start a new thread" in a traceback nobody reads), aborts
//! (signal 6) or is SIGKILLed. Both backends read the same evidence after the end (the
//! kernel's cgroup counters, the workspace's free space) and call [`explain`], so the
//! session's `dead` reason and a failed create name the resource: "... it reached its limit
//! of 128 processes and threads", "the workspace is full", "the host ran out of memory".

use std::path::Path;

use super::{ExitReason, KernelLimits};

/// What was observed about a kernel after it ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evidence {
    /// The kernel's memory use reached its own limit (an OOM kill was the kernel's own).
    pub reached_memory_limit: bool,
    /// Processes or threads refused at the pids limit.
    pub pids_refused: u64,
    /// The workspace had (almost) no free space left.
    pub disk_full: bool,
}

/// Names the resource behind `reason`, where the evidence shows one.
pub fn explain(
    reason: ExitReason,
    evidence: Evidence,
    limits: &KernelLimits,
    quota_bytes: u64,
) -> ExitReason {
    match reason {
        ExitReason::OutOfMemory { limit_bytes } if !evidence.reached_memory_limit => {
            ExitReason::HostOutOfMemory { limit_bytes }
        }
        // An error exit or an abort (a thread that could not be created aborts some
        // libraries); not a kill, which has its own cause.
        ExitReason::Exited(code) if code != 0 => with_cause(reason, evidence, limits, quota_bytes),
        ExitReason::Signaled(sig) if sig == libc::SIGABRT || sig == libc::SIGSEGV => {
            with_cause(reason, evidence, limits, quota_bytes)
        }
        other => other,
    }
}

fn with_cause(
    reason: ExitReason,
    evidence: Evidence,
    limits: &KernelLimits,
    quota_bytes: u64,
) -> ExitReason {
    if evidence.pids_refused > 0 {
        ExitReason::OutOfPids {
            limit: limits.pids,
            exit: Box::new(reason),
        }
    } else if evidence.disk_full {
        ExitReason::DiskFull {
            quota_bytes,
            exit: Box::new(reason),
        }
    } else {
        reason
    }
}

/// Whether the file system holding `dir` has less than 1 MiB (or 1%) free for unprivileged
/// writers: what a kernel's start needs (IPython's profile, history, caches) is more.
pub fn disk_full(dir: &Path) -> bool {
    match rustix::fs::statvfs(dir) {
        Ok(st) => {
            let free = st.f_bavail.saturating_mul(st.f_frsize);
            let size = st.f_blocks.saturating_mul(st.f_frsize);
            free < (1 << 20) || free < size / 100
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: KernelLimits = KernelLimits {
        memory_bytes: 256 << 20,
        pids: 128,
    };

    #[test]
    fn names_the_resource_that_ran_out() {
        let oom = ExitReason::OutOfMemory {
            limit_bytes: 256 << 20,
        };
        let own = Evidence {
            reached_memory_limit: true,
            ..Evidence::default()
        };
        assert_eq!(explain(oom.clone(), own, &LIMITS, 0), oom);
        let host = explain(oom, Evidence::default(), &LIMITS, 0);
        assert_eq!(
            host,
            ExitReason::HostOutOfMemory {
                limit_bytes: 256 << 20
            }
        );
        assert!(
            host.to_string().contains("the host ran out of memory"),
            "{host}"
        );

        let pids = Evidence {
            pids_refused: 3,
            disk_full: true,
            ..Evidence::default()
        };
        let r = explain(ExitReason::Exited(1), pids, &LIMITS, 1 << 30);
        assert_eq!(
            r.to_string(),
            "the kernel process exited with code 1: it reached its limit of 128 processes \
             and threads (pids)"
        );
        let r = explain(ExitReason::Signaled(6), pids, &LIMITS, 1 << 30);
        assert!(
            r.to_string().contains("killed by signal 6: it reached"),
            "{r}"
        );

        let disk = Evidence {
            disk_full: true,
            ..Evidence::default()
        };
        let r = explain(ExitReason::Exited(1), disk, &LIMITS, 1 << 30);
        assert_eq!(
            r.to_string(),
            "the kernel process exited with code 1: the workspace is full (disk quota 1024 MiB)"
        );

        // Clean exits, kills and terminations keep their own reason.
        for plain in [
            ExitReason::Exited(0),
            ExitReason::Signaled(9),
            ExitReason::Terminated,
        ] {
            assert_eq!(explain(plain.clone(), pids, &LIMITS, 0), plain);
        }
    }

    #[test]
    fn a_roomy_directory_is_not_full() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(!disk_full(tmp.path()));
        assert!(!disk_full(Path::new("/no/such/dir")));
    }
}
