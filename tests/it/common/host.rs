//! What the tests' own process is on this host: its uid, and the cgroup v2 subtree delegated
//! to it when it is not root.

use std::path::{Path, PathBuf};

pub fn euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail.
    unsafe { libc::geteuid() }
}

pub fn is_root() -> bool {
    euid() == 0
}

/// The test process's own cgroup v2 directory, the one an unprivileged sandbox's tree hangs
/// off (its delegated cgroup). Once the sandbox enables controllers there it moves itself
/// into a `broker` leaf below it: the directory above that leaf is meant then.
pub fn delegated_cgroup() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let own = text.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let own = own.strip_suffix("/broker").unwrap_or(own);
    Some(Path::new("/sys/fs/cgroup").join(own.trim_start_matches('/')))
}
