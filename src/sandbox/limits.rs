//! What one user's kernels, and one kernel, may use: [`UserLimits`], [`KernelLimits`].

use serde::{Deserialize, Serialize};

/// Resource limits of one user: the totals of all of that user's kernels together, and
/// what one kernel (one session) gets by default.
///
/// Memory is divided, not shared: every kernel has its own limit
/// ([`KernelLimits::memory_bytes`]), so a kernel that allocates past it is the one the OOM
/// killer picks, never an idle neighbour. The user's total (`memory_bytes`) is what the
/// session layer admits kernels against (the sum of their limits), and the backends also
/// set it on the user's cgroup or container as a backstop.
///
/// The defaults agree with each other: 20 sessions (the default per user) of 256 MiB fill
/// the 5 GiB total, and 20 kernels of at most 64 processes and threads fit in 1,280. And
/// within one kernel the pids limit acts before the memory limit (see
/// [`UserLimits::memory_for_pids`]): a fork bomb meets `EAGAIN` and the kernel survives,
/// instead of the OOM killer ending the kernel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UserLimits {
    /// Memory in bytes of all the user's kernels together (RAM; swap is not granted on top).
    pub memory_bytes: u64,
    /// CPU time in cores (1.5 = one and a half cores).
    pub cpus: f64,
    /// Maximum number of processes and threads of all the user's kernels together.
    pub pids: u64,
    /// Size of the user's workspace file system in bytes (writes past it fail with
    /// `ENOSPC`); 0: no quota, a plain directory.
    pub workspace_quota_bytes: u64,
    /// Memory of one kernel when its session does not ask for another value.
    pub session_memory_bytes: u64,
    /// Processes and threads of one kernel.
    pub session_pids: u64,
}

/// Default memory of one session: the data stack (pandas, numpy, matplotlib) takes about
/// 125 MB, which leaves room for about as much data.
pub const DEFAULT_SESSION_MEMORY: u64 = 256 << 20;
/// Default processes and threads of one session: an idle kernel has 11 to 13, one with
/// the data stack imported about 20 (BLAS threads are capped at the CPU limit), which
/// leaves room for a pool of worker processes. It is as many as the default memory pays
/// for (see [`UserLimits::memory_for_pids`]): with 128, a fork bomb in a kernel forked from
/// a template with the data stack ran out of its 256 MiB at about 100 children, so the OOM
/// killer ended the kernel before the pids limit stopped the bomb.
pub const DEFAULT_SESSION_PIDS: u64 = 64;
/// What one more process of a kernel costs its memory limit, rounded up: a child that a
/// Python kernel forks (and that only sleeps) dirties pages (reference counts, the fork
/// handlers) and needs page tables of its own, 1.8 to 2.1 MiB from a plain ipykernel and
/// 2.2 to 2.7 MiB from a kernel forked from a template with numpy, pandas and matplotlib
/// (measured through each kernel's memory cgroup, both backends alike).
pub const PROCESS_MEMORY: u64 = 3 << 20;
/// What a kernel's memory cgroup holds before its code does anything, with room: 23 MiB
/// for a kernel forked from a template (the template's pages are charged to the
/// template), 36 MiB for a plain ipykernel.
pub const KERNEL_BASE_MEMORY: u64 = 64 << 20;
/// Sessions per user by default (the session layer's quota; here for the defaults below).
pub const DEFAULT_MAX_SESSIONS: u64 = 20;

impl Default for UserLimits {
    fn default() -> Self {
        Self {
            memory_bytes: DEFAULT_MAX_SESSIONS * DEFAULT_SESSION_MEMORY,
            cpus: 1.0,
            pids: DEFAULT_MAX_SESSIONS * DEFAULT_SESSION_PIDS,
            workspace_quota_bytes: 1 << 30,
            session_memory_bytes: DEFAULT_SESSION_MEMORY,
            session_pids: DEFAULT_SESSION_PIDS,
        }
    }
}

impl UserLimits {
    /// The memory one kernel needs so that its pids limit, not its memory limit, stops a
    /// fork bomb, when the session memory limit is below it: `None` when the limits keep
    /// that order. The defaults meet it exactly (64 MiB + 64 × 3 MiB = 256 MiB). A kernel
    /// that holds much data of its own (a plain kernel that imported the data stack holds
    /// about 125 MB) has less room for children, so this is a floor, not a promise.
    pub fn memory_for_pids(&self) -> Option<u64> {
        let needed =
            KERNEL_BASE_MEMORY.saturating_add(self.session_pids.saturating_mul(PROCESS_MEMORY));
        (needed > self.session_memory_bytes).then_some(needed)
    }

    /// The limits of one of this user's kernels asking for `memory_bytes` (`None`: the
    /// user's default), each capped by the user's total.
    pub fn kernel(&self, memory_bytes: Option<u64>) -> KernelLimits {
        let cap = |v: u64, total: u64| if total == 0 { v } else { v.min(total) };
        KernelLimits {
            memory_bytes: cap(
                memory_bytes.unwrap_or(self.session_memory_bytes),
                self.memory_bytes,
            ),
            pids: cap(self.session_pids, self.pids),
        }
    }
}

/// Environment that caps the thread pools of numeric libraries (OpenBLAS, OpenMP, MKL,
/// numexpr) at the user's CPU limit. They default to one thread per host core: on a large
/// host, `import numpy` alone would start more threads than a kernel's pids limit allows
/// (and more than its CPU share can use).
pub fn thread_env(limits: &UserLimits) -> Vec<(String, String)> {
    let threads = if limits.cpus.is_finite() && limits.cpus >= 1.0 {
        (limits.cpus.ceil() as u64).min(64)
    } else {
        1
    };
    [
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "NUMEXPR_MAX_THREADS",
    ]
    .iter()
    .map(|k| (k.to_string(), threads.to_string()))
    .collect()
}

/// What the language runtimes read to stay within a kernel's memory instead of meeting the
/// OOM killer: a JVM's heap (half of the limit: `-XX:MaxRAM` makes it size itself from the
/// kernel's limit, not the host's memory, which it cannot see through a v1 cgroup; past it
/// Java answers `OutOfMemoryError` and the kernel lives), R's vector heap (three quarters:
/// past it R answers "vector memory exhausted" as an error), and the limit itself for
/// kernels that size their own budgets (`KERNEL_BROKER_MEMORY_LIMIT`, read by the SQL
/// kernel's DuckDB). V8 (Deno) is left alone: it cannot survive its heap's exhaustion
/// either way, and the OOM killer's end is the one the broker explains. Nothing without a
/// limit.
pub fn runtime_env(kernel: &KernelLimits, user: &UserLimits) -> Vec<(String, String)> {
    let bytes = kernel.memory_bytes;
    if bytes == 0 {
        return Vec::new();
    }
    let mib = (bytes >> 20).max(1);
    let cpus = if user.cpus.is_finite() && user.cpus >= 1.0 {
        (user.cpus.ceil() as u64).min(64)
    } else {
        1
    };
    vec![
        ("KERNEL_BROKER_MEMORY_LIMIT".into(), bytes.to_string()),
        (
            "JAVA_TOOL_OPTIONS".into(),
            format!("-XX:MaxRAM={bytes} -XX:MaxRAMPercentage=50 -XX:ActiveProcessorCount={cpus}"),
        ),
        ("R_MAX_VSIZE".into(), format!("{}Mb", (mib * 3 / 4).max(16))),
    ]
}

/// The `oom_score_adj` of every kernel process. When the host as a whole runs out of memory
/// (more is admitted across users than the host has), its OOM killer picks by this score
/// plus each process's share of RAM: with +500 it kills kernels, the biggest first, before
/// the broker or anything else on the host (whose scores stay near 0). Raising one's own
/// score needs no privilege.
pub const KERNEL_OOM_SCORE_ADJ: i64 = 500;

/// Limits of one kernel, inside its user's: its own cgroup (local) or its own cgroup inside
/// the user's container (docker). 0 means none of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelLimits {
    /// RAM in bytes (no swap on top); past it the OOM killer ends this kernel only.
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_are_sized_from_the_kernels_limit() {
        let user = UserLimits {
            cpus: 1.5,
            ..UserLimits::default()
        };
        let env: std::collections::HashMap<String, String> = runtime_env(
            &KernelLimits {
                memory_bytes: 256 << 20,
                pids: 64,
            },
            &user,
        )
        .into_iter()
        .collect();
        assert_eq!(
            env["KERNEL_BROKER_MEMORY_LIMIT"],
            (256u64 << 20).to_string()
        );
        assert_eq!(
            env["JAVA_TOOL_OPTIONS"],
            "-XX:MaxRAM=268435456 -XX:MaxRAMPercentage=50 -XX:ActiveProcessorCount=2"
        );
        assert!(!env.contains_key("DENO_V8_FLAGS"));
        assert_eq!(env["R_MAX_VSIZE"], "192Mb");
        assert!(runtime_env(
            &KernelLimits {
                memory_bytes: 0,
                pids: 64
            },
            &user
        )
        .is_empty());
    }

    #[test]
    fn the_pids_limit_acts_before_the_memory_limit_by_default() {
        // (session memory MiB, session pids, memory needed or None when in order)
        let cases = [
            (256, DEFAULT_SESSION_PIDS, None),
            (256, 65, Some(64 + 65 * 3)),
            // The limits before issue 32: memory ran out first.
            (256, 128, Some(64 + 128 * 3)),
            (1024, 128, None),
            (64, 1, Some(67)),
        ];
        for (mib, pids, want) in cases {
            let limits = UserLimits {
                session_memory_bytes: mib << 20,
                session_pids: pids,
                ..UserLimits::default()
            };
            assert_eq!(
                limits.memory_for_pids(),
                want.map(|m: u64| m << 20),
                "{mib} MiB, {pids} pids"
            );
        }
        assert_eq!(UserLimits::default().memory_for_pids(), None);
        assert_eq!(UserLimits::default().pids, 20 * 64);
    }
}
