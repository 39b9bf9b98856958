//! The few procfs readings the sandboxes rest on: a process's children, its parent, its
//! state letter, and its pid inside its innermost pid namespace (`NSpid`), which is what ties
//! a pid inside a sandbox to the host's.
//!
//! procfs is read by hand: the few fields needed (`task/<tid>/children`, the last `NSpid`
//! of `status`, the parent and state in `stat`) do not justify a procfs crate.

/// The children of `pid` (of its main thread): `/proc/<pid>/task/<pid>/children`, or a
/// scan of `/proc` where the kernel does not provide that file.
pub fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()
        .map(|text| {
            text.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|| children_by_scan(pid))
}

/// The host pid of the child of `parent` that is `inner` in its pid namespace, if any.
pub fn child_with_namespace_pid(parent: i32, inner: i32) -> Option<i32> {
    children_of(parent)
        .into_iter()
        .find(|pid| namespace_pid(*pid) == Some(inner))
}

/// Children of `pid` by scanning `/proc` (when `/proc/<pid>/task/<pid>/children` is missing).
fn children_by_scan(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| parent_of(*pid) == Some(parent))
        .collect()
}

/// The start time of `pid` (clock ticks since boot, `/proc/<pid>/stat` field 22); `None`
/// when there is no such process. With the pid, it names one process for good: a kept
/// kernel's ticket holds both.
pub fn start_time(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ...: comm may hold spaces and parentheses; fields resume after the
    // last ')'. starttime is field 22, the 20th after comm.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether `pid` is still the process that started at `start`.
pub fn is_same_process(pid: i32, start: u64) -> bool {
    start_time(pid) == Some(start)
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`.
pub fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_parent(&stat)
}

/// `pid (comm) state ppid ...`; comm may contain spaces and parentheses.
fn parse_parent(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The CPU time `pid` has used, its threads' and its waited-for children's, user and
/// system, in clock ticks (`/proc/<pid>/stat` fields 14 to 17).
pub fn cpu_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat)
}

fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the comm: state (field 3) is the first, so utime (14) is the twelfth.
    let fields = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .map(|f| f.parse::<u64>().ok())
        .collect::<Option<Vec<u64>>>()?;
    (fields.len() == 4).then(|| fields.iter().fold(0u64, |a, b| a.saturating_add(*b)))
}

/// The state letter of `pid` (`R`, `S`, `T` stopped, `Z` ended, ...), if it exists.
pub fn state_of(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_state(&stat)
}

fn parse_state(stat: &str) -> Option<char> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().next()?.chars().next()
}

/// The innermost pid of a process (the last `NSpid` field), if the kernel reports it.
pub fn namespace_pid(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_namespace_pid(&status)
}

fn parse_namespace_pid(status: &str) -> Option<i32> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// The resident memory of `pid` in bytes (`VmRSS:` of `status`, in kB).
pub fn resident_bytes(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_resident_bytes(&status)
}

fn parse_resident_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb.saturating_mul(1024))
}

/// The real, effective, saved and file-system uids of `pid` (`Uid:` of `status`).
pub fn uids_of(pid: i32) -> Option<[u32; 4]> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_uids(&status)
}

fn parse_uids(status: &str) -> Option<[u32; 4]> {
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    let ids: Vec<u32> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    ids.try_into().ok()
}

/// The raw wait status of `pid` while it is a zombie (ended, not yet reaped): field 52 of
/// `stat`, `exit_code`. `None` when it is not a zombie or the field is missing.
pub fn zombie_status(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_zombie_status(&stat)
}

fn parse_zombie_status(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    if fields.next()? != "Z" {
        return None;
    }
    // `rest` starts at field 3 (state): field 52 is the 50th.
    fields.nth(48)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_summed_past_a_hostile_comm() {
        let stat = "42 (a) b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 2 1 20 0 1 0 5 0 0";
        assert_eq!(parse_cpu_ticks(stat), Some(7 + 3 + 2 + 1));
        assert_eq!(parse_cpu_ticks("42 (x) S 1"), None);
        assert_eq!(
            parse_cpu_ticks("42 (x) S 1 2 3 4 5 6 7 8 9 10 z 1 1 1"),
            None
        );
    }

    #[test]
    fn uids_and_zombie_status_parse() {
        assert_eq!(
            parse_uids("Name:\tx\nUid:\t100001\t100001\t100001\t100001\n"),
            Some([100001; 4])
        );
        assert_eq!(parse_uids("Uid:\t1\t2\n"), None);
        assert_eq!(parse_uids("Name:\tx\n"), None);
        assert_eq!(
            parse_resident_bytes("VmPeak:\t  9 kB\nVmRSS:\t  2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(parse_resident_bytes("Name:\tx\n"), None);
        let tail: Vec<String> = (4..=51).map(|n| n.to_string()).collect();
        let zombie = format!("42 (a) b) Z {} 9", tail.join(" "));
        assert_eq!(parse_zombie_status(&zombie), Some(9));
        let running = format!("42 (a) S {} 9", tail.join(" "));
        assert_eq!(parse_zombie_status(&running), None);
        assert_eq!(parse_zombie_status("42 (a) Z 1 2"), None);
    }

    #[test]
    fn procfs_fields_parse() {
        assert_eq!(parse_parent("42 (a b) c) S 7 42 42 0"), Some(7));
        assert_eq!(parse_parent("garbage"), None);
        assert_eq!(parse_state("42 (a b) c) T 7 42 42 0"), Some('T'));
        assert_eq!(parse_state("garbage"), None);
        assert!(matches!(
            state_of(std::process::id() as i32),
            Some('R' | 'S')
        ));
        let status = "Name:\tpython\nNSpid:\t12345\t57\nPPid:\t3\n";
        assert_eq!(parse_namespace_pid(status), Some(57));
        assert_eq!(parse_namespace_pid("NSpid:\t9\n"), Some(9));
        assert_eq!(parse_namespace_pid("Name:\tx\n"), None);
        // This process: its own pid in its own namespace is what getpid says when the test
        // runs in the init namespace; in any case its parent is known.
        let me = std::process::id() as i32;
        assert!(namespace_pid(me).is_some());
        assert!(parent_of(me).is_some());
    }
}
