//! The broker's tree on cgroup v2, against a temporary directory laid out like cgroupfs
//! (the test hosts run v1, most users v2): what a launch writes (the user's totals, the
//! kernel's own limits in its leaf) and what the broker reads back after a kernel's end.

use std::path::Path;
use std::sync::Mutex;

use uuid::Uuid;

use super::{CgroupVersion, Cgroups};
use crate::sandbox::{KernelLimits, UserLimits};

fn write(dir: &Path, file: &str, text: &str) {
    std::fs::write(dir.join(file), text).unwrap();
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap()
}

#[test]
fn a_v2_launch_writes_the_users_totals_and_the_kernels_own_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("kernel-broker");
    std::fs::create_dir(&base).unwrap();
    // cgroupfs shows these files in every directory; a plain one needs them made, and a
    // new directory has none until the test writes them.
    write(&base, "cgroup.subtree_control", "memory cpu pids");
    let user_dir = base.join("alice");
    std::fs::create_dir(&user_dir).unwrap();
    write(&user_dir, "cgroup.subtree_control", "");
    write(&user_dir, "memory.swap.max", "max");
    let cgroups = Cgroups {
        version: CgroupVersion::V2,
        bases: vec![base.clone()],
        v2_parent: Some(tmp.path().to_path_buf()),
        tree_lock: Mutex::new(()),
    };
    let user = UserLimits::default();
    let kernel = KernelLimits {
        memory_bytes: 192 << 20,
        pids: 40,
    };
    let session = Uuid::new_v4();
    let leaf = cgroups
        .create_leaf("alice", &user, &kernel, session)
        .unwrap();
    let leaf_dir = user_dir.join(session.to_string());
    assert_eq!(leaf.dirs(), std::slice::from_ref(&leaf_dir));
    // The user's totals: a backstop above the kernels' own limits.
    assert_eq!(read(&user_dir, "memory.max"), (5u64 << 30).to_string());
    assert_eq!(read(&user_dir, "memory.swap.max"), "0");
    assert_eq!(read(&user_dir, "pids.max"), "1280");
    assert_eq!(read(&user_dir, "cpu.max"), "100000 100000");
    // The controllers were handed down to the leaves.
    assert!(read(&user_dir, "cgroup.subtree_control").starts_with('+'));
    // The kernel's own.
    assert_eq!(read(&leaf_dir, "memory.max"), (192u64 << 20).to_string());
    assert_eq!(read(&leaf_dir, "pids.max"), "40");
    assert_eq!(
        leaf.procs_files()[0].to_str().unwrap(),
        leaf_dir.join("cgroup.procs").to_str().unwrap()
    );
}

#[test]
fn after_a_kernels_end_its_v2_counters_tell_what_ran_out() {
    let tmp = tempfile::tempdir().unwrap();
    let user_dir = tmp.path().join("alice");
    let leaf_dir = user_dir.join("s");
    std::fs::create_dir_all(&leaf_dir).unwrap();
    let leaf = super::Leaf {
        version: CgroupVersion::V2,
        dirs: vec![leaf_dir.clone()],
        procs_files: Vec::new(),
    };
    write(&leaf_dir, "memory.current", "99614720\n");
    assert_eq!(
        super::read_counter(&leaf.memory_usage_file().unwrap()),
        Some(99614720)
    );
    // Killed at its own limit: `oom` and `oom_kill` in its memory.events.
    write(
        &leaf_dir,
        "memory.events",
        "low 0\nhigh 0\nmax 40\noom 1\noom_kill 1\noom_group_kill 0\n",
    );
    write(
        &user_dir,
        "memory.events",
        "low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\n",
    );
    assert_eq!(leaf.oom_kills(), Some(1));
    assert!(leaf.reached_memory_limit());
    // Killed by the host's OOM killer: a kill, but no limit of the broker's was reached.
    write(
        &leaf_dir,
        "memory.events",
        "low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\n",
    );
    assert!(!leaf.reached_memory_limit());
    // The user's total reached (the sessions' limits add up to more than it): a limit too.
    write(
        &user_dir,
        "memory.events",
        "low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n",
    );
    assert!(leaf.reached_memory_limit());
    // Forks refused at the pids limit.
    assert_eq!(leaf.pids_refused(), 0);
    write(&leaf_dir, "pids.events", "max 3\n");
    assert_eq!(leaf.pids_refused(), 3);
}

#[test]
fn a_leafs_cpu_time_is_read_from_cpu_stat_on_v2_and_its_processes_on_v1() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    std::fs::create_dir_all(&dir).unwrap();
    let leaf = |version| super::Leaf {
        version,
        dirs: vec![dir.clone()],
        procs_files: Vec::new(),
    };
    write(
        &dir,
        "cpu.stat",
        "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n",
    );
    assert_eq!(
        leaf(CgroupVersion::V2).cpu_clock().read_ns(),
        Some(1_500_000)
    );
    // v1: this test process, once it has been charged two ticks of CPU (a spin of so long
    // by the clock may get less on a loaded machine), and a pid that is gone.
    let me = std::process::id();
    write(&dir, "cgroup.procs", &format!("{me}\n999999999\n"));
    let spun = std::time::Instant::now();
    while crate::sandbox::procfs::cpu_ticks(me as i32).unwrap_or(0) < 2
        && spun.elapsed() < std::time::Duration::from_secs(30)
    {
        std::hint::black_box(0u64);
    }
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let ns = leaf(CgroupVersion::V1).cpu_clock().read_ns().unwrap();
    assert!(ns >= 2 * 1_000_000_000 / hz, "{ns}");
    // A leaf that is gone reads nothing.
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(leaf(CgroupVersion::V1).cpu_clock().read_ns(), None);
    assert_eq!(leaf(CgroupVersion::V2).cpu_clock().read_ns(), None);
}
