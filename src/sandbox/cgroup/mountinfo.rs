//! Finding the cgroup hierarchies: the cgroup mounts in `/proc/self/mountinfo` (v1: one per
//! controller set; v2: the unified one) and the broker's own v2 cgroup.

use std::path::{Path, PathBuf};

/// A cgroup mount found in `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mount {
    /// The mount's root inside the hierarchy (`/` unless a sub-tree is mounted).
    pub root: String,
    pub mount_point: PathBuf,
    /// `cgroup` (v1) or `cgroup2`.
    pub fs_type: String,
    /// The super block options (v1: the controllers bound to this hierarchy).
    pub super_options: Vec<String>,
}

pub(super) fn read_own_cgroup_v2() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
}

/// The directory of cgroup `path` (as `/proc/self/cgroup` shows it) under a mount of the
/// hierarchy whose root is `mount_root`.
pub(super) fn join_cgroup_path(mount_point: &Path, mount_root: &str, path: &str) -> PathBuf {
    let rel = path
        .strip_prefix(mount_root)
        .unwrap_or(path)
        .trim_start_matches('/');
    if rel.is_empty() {
        mount_point.to_path_buf()
    } else {
        mount_point.join(rel)
    }
}

pub(super) fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            // id parent major:minor root mount_point options [optional fields...] - type source super_options
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            if left.len() < 5 || right.len() < 3 {
                return None;
            }
            Some(Mount {
                root: unescape_mountinfo(left[3]),
                mount_point: PathBuf::from(unescape_mountinfo(left[4])),
                fs_type: right[0].to_string(),
                super_options: right[2].split(',').map(str::to_string).collect(),
            })
        })
        .filter(|m| m.fs_type == "cgroup" || m.fs_type == "cgroup2")
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space and so on).
fn unescape_mountinfo(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = (bytes[i] == b'\\')
            .then(|| bytes.get(i + 1..i + 4))
            .flatten()
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)))
            .and_then(|d| {
                // `\400` and above are no byte: kept as written rather than overflowing.
                let v = d.iter().fold(0u32, |v, b| v * 8 + u32::from(b - b'0'));
                u8::try_from(v).ok()
            });
        if let Some(v) = octal {
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cgroup_mounts_from_mountinfo() {
        let text = "\
25 30 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755
26 25 0:23 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
28 25 0:25 /sub /sys/fs/cgroup/unified\\040x rw - cgroup2 cgroup2 rw,nsdelegate
";
        let mounts = parse_mountinfo(text);
        assert_eq!(mounts.len(), 3);
        assert_eq!(
            mounts[0].mount_point,
            PathBuf::from("/sys/fs/cgroup/memory")
        );
        assert_eq!(mounts[0].super_options, vec!["rw", "memory"]);
        assert!(mounts[1].super_options.iter().any(|o| o == "cpu"));
        assert_eq!(mounts[2].fs_type, "cgroup2");
        assert_eq!(mounts[2].root, "/sub");
        assert_eq!(
            mounts[2].mount_point,
            PathBuf::from("/sys/fs/cgroup/unified x")
        );
    }

    #[test]
    fn unescapes_octal_escapes_only() {
        for (raw, want) in [
            (r"a\040b", "a b"),
            (r"end\040", "end "),
            (r"tab\011", "tab\t"),
            (r"short\04", r"short\04"),
            (r"not\089", r"not\089"),
            (r"big\777", r"big\777"),
            (r"\\", r"\\"),
        ] {
            assert_eq!(unescape_mountinfo(raw), want, "{raw}");
        }
    }

    #[test]
    fn joins_own_cgroup_under_the_mount() {
        let m = Path::new("/sys/fs/cgroup");
        assert_eq!(
            join_cgroup_path(m, "/", "/"),
            PathBuf::from("/sys/fs/cgroup")
        );
        assert_eq!(
            join_cgroup_path(m, "/", "/user.slice/app.service"),
            PathBuf::from("/sys/fs/cgroup/user.slice/app.service")
        );
        assert_eq!(
            join_cgroup_path(m, "/ns", "/ns/app"),
            PathBuf::from("/sys/fs/cgroup/app")
        );
    }
}
