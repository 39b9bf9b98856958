//! The guard of issue 32's second rule (docs/SECURITY.md, "Root file operations"): no
//! file operation by the broker follows a path a kernel can change. Root may write, chown
//! or remove inside a kernel-writable directory only through descriptors
//! (`fsutil::make_dir_at`, `fsutil::write_new_file_at`, `fsutil::open_beneath`,
//! `fsutil::walk_tree`, `fsutil::chown_tree`). This test fails on every path-based
//! `std::fs` (or `tokio::fs`) call that writes, creates, chowns, renames or removes in the
//! sandbox and session code beyond the sites listed here, each with why a path is safe
//! there. A new one must use a descriptor, or be added below with its reason.
//!
//! Reads are held to the same rule (`READ_CALLS`, `ALLOWED_READS`): a root read by path in
//! a directory a kernel can write would follow a planted symlink (to `/etc/shadow`, to a
//! FIFO that blocks the reading thread for good). Path-based metadata through methods
//! (`Path::exists`, `Path::is_dir`, `Path::metadata`) is not counted: the names are
//! shared with descriptors' and file types' own methods.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Calls that resolve a path and change what they find there.
const PATH_CALLS: &[&str] = &[
    "fs::write(",
    "create_dir(",
    "create_dir_all(",
    "remove_file(",
    "remove_dir(",
    "remove_dir_all(",
    "fs::rename(",
    "fs::set_permissions(",
    "hard_link(",
    "fs::copy(",
    "File::create(",
    "OpenOptions::new(",
    "DirBuilder::new(",
    "fs::chown(",
    "fs::lchown(",
    "fs::symlink(",
    "remove_dir_logged(",
    "tokio::fs::",
];

/// Where path-based calls stand, how many, and why each is safe.
const ALLOWED: &[(&str, usize, &str)] = &[
    ("src/sandbox/fsutil/mod.rs", 4, "the broker's own state directories (data, workspaces, runtime base: parents the operator chose, checked to be the broker's); remove_dir_logged, whose std::fs::remove_dir_all opens the last component O_NOFOLLOW and walks by descriptor, called only on directories whose parents are the broker's"),
    ("src/sandbox/workspace_fs.rs", 10, "images and mount points in the broker's 0700 workspaces directory; lost+found removed (rmdir, never follows) right after mkfs, before any kernel; the workspace's own mode set on the mount point, whose parent is the broker's; an own workspace's image unlinked in the broker's images directory"),
    ("src/sandbox/carry.rs", 3, "an intake abandoned: its images' directory in the broker's root-only <data_dir>/paused (std's remove_dir_all opens each directory O_NOFOLLOW), and its workspace image unlinked in the broker's 0700 images directory (no kernel has run over either), or its workspace directory, in the broker's 0700 <data_dir>/sandboxes, which tar wrote into as the kernel's uid: std's remove_dir_all opens each directory O_NOFOLLOW and unlinks symlinks as themselves"),
    ("src/sandbox/local/carry.rs", 1, "an earlier intake's images' directory, removed in the broker's root-only <data_dir>/paused before a new one is made (std's remove_dir_all opens each directory O_NOFOLLOW)"),
    ("src/sandbox/own_workspace.rs", 2, "an own workspace's root made and removed in the broker's 0700 <data_dir>/sandboxes: every directory down to it is the broker's; what is inside goes with std's remove_dir_all, which opens each directory O_NOFOLLOW and unlinks symlinks as themselves"),
    ("src/sandbox/sudo.rs", 6, "the broker's tools directory (in its 0700 runtime base or data directory) and the sudo script in it: no kernel can write there (shown read-only)"),
    ("src/sandbox/docker/command.rs", 4, "remove_dir_logged of a command's session directory in the user's 0711 runtime directory"),
    ("src/sandbox/docker/container.rs", 2, "the user's runtime directory itself, in the broker's runtime base"),
    ("src/sandbox/docker/daemon.rs", 2, "the broker's own state (the daemon socket directory it made)"),
    ("src/sandbox/docker/launch.rs", 2, "remove_dir_logged of a failed launch's session directory in the user's 0711 runtime directory"),
    ("src/sandbox/docker/own.rs", 6, "passwd and group written to a new file in the broker's tools directory (root's, shown read-only) and renamed over; an own workspace's home opened to the kernel without root, its parent the broker's; remove_dir_logged of a sandbox container's runtime directory in the broker's runtime base"),
    ("src/sandbox/docker/place.rs", 1, "rmdir of a cgroup leaf the broker made (cgroupfs; kernels cannot write it)"),
    ("src/sandbox/docker/fork.rs", 1, "remove_dir_logged of a fork's session directory, made by descriptor in the user's 0711 runtime directory (the broker's; /run/kernel in the container, which kernels cannot write)"),
    ("src/sandbox/docker/template.rs", 4, "remove_dir_logged of the template's and forked kernels' session directories (in the user's 0711 runtime directory); rmdir of cgroup leaves"),
    ("src/sandbox/docker/watch.rs", 1, "remove_dir_logged of an ended kernel's session directory"),
    ("src/sandbox/docker/keep/adopt.rs", 3, "rmdir of cgroup leaves; remove_dir_logged of a session directory"),
    ("src/sandbox/docker/keep/mod.rs", 4, "the broker's 0700 ticket directory; remove_dir_logged of session directories"),
    ("src/sandbox/docker/keep/ticket.rs", 3, "the broker's 0700 ticket directory"),
    ("src/sandbox/cgroup/fs.rs", 7, "cgroupfs: the broker's hierarchy, which no kernel can write"),
    ("src/sandbox/cgroup/limits.rs", 1, "cgroupfs"),
    ("src/sandbox/cgroup/freezer.rs", 1, "procfs: /proc/<pid>/oom_score_adj of a pid listed in the broker's own leaf, or of a held checkpoint checked as a fork's and held by a pidfd (a kernel cannot make a path there a symlink)"),
    ("src/sandbox/cgroup/nested.rs", 3, "cgroupfs"),
    ("src/sandbox/local/adopt.rs", 1, "remove_dir_logged of a runtime directory in the broker's runtime base"),
    ("src/sandbox/local/check.rs", 1, "remove_dir_logged of the check's runtime directory"),
    ("src/sandbox/local/command.rs", 1, "remove_dir_logged of a command's runtime directory"),
    ("src/sandbox/local/files.rs", 4, "rmdir of cgroup leaves; remove_dir_all of runtime directories in the broker's runtime base (last component not followed)"),
    ("src/sandbox/docker/pause.rs", 2, "remove_dir_logged of a paused kernel's or a snapshot's image directory in the broker's 0700 <data_dir>/paused-docker or <data_dir>/snapshots-docker, when its archive or its dump was cut short (no kernel reaches it; CRIU as the kernel's uid and tar wrote in it only through descriptors)"),
    ("src/sandbox/docker/snapshot.rs", 1, "remove_dir_logged of a restore's session directory (a snapshot's or a resume's), made by descriptor in its container's 0711 runtime directory (the broker's; /run/kernel in the container, which kernels cannot write)"),
    ("src/sandbox/docker/mod.rs", 1, "remove_dir_logged of a pause or snapshot given up: its image directory in the broker's 0700 <data_dir>/paused-docker or <data_dir>/snapshots-docker"),
    ("src/sandbox/docker/copy.rs", 4, "remove_dir_logged of a copy's session directory, made by descriptor in its container's 0711 runtime directory (the broker's; /run/kernel in the container, which kernels cannot write), and of a copy's image directory in the broker's 0700 <data_dir>/copies-docker; cgroup.procs of the copy's leaf (cgroupfs)"),
    ("src/sandbox/criu/mod.rs", 1, "remove_dir_all of the broker's 0700 copies' directory at start-up (no kernel reaches it; std's remove_dir_all opens each directory O_NOFOLLOW and unlinks symlinks as themselves)"),
    ("src/sandbox/local/copy.rs", 2, "remove_dir_logged of a copy's directory in the broker's 0700 <data_dir>/copies (no kernel reaches it; CRIU, as the kernel's uid, wrote in it through a descriptor: std's remove_dir_all opens each directory O_NOFOLLOW and unlinks symlinks as themselves)"),
    ("src/sandbox/local/fork.rs", 1, "remove_dir_logged of a fork's directory, made by descriptor in the template's directory (the kernel's to write): std's remove_dir_all opens that last component O_NOFOLLOW and removes below it by descriptor; the directories above are the broker's"),
    ("src/sandbox/local/keep.rs", 4, "the broker's 0700 ticket directory"),
    ("src/sandbox/local/mod.rs", 4, "the broker's runtime base and its boot/ and tools/ directories (the broker's own, 0700 base), at shutdown; remove_dir_logged of a pause given up, in the broker's 0700 <data_dir>/paused"),
    ("src/sandbox/local/pause.rs", 1, "remove_dir_logged of a paused kernel's images in the broker's 0700 <data_dir>/paused (no kernel reaches it; CRIU, as the kernel's uid, wrote in it through a descriptor: std's remove_dir_all opens each directory O_NOFOLLOW and unlinks symlinks as themselves)"),
    ("src/sandbox/local/snapshot.rs", 1, "remove_dir_logged of a snapshot's images in the broker's 0700 <data_dir>/snapshots (no kernel reaches it; CRIU, as the kernel's uid, wrote in it through a descriptor: std's remove_dir_all opens each directory O_NOFOLLOW and unlinks symlinks as themselves)"),
    ("src/sandbox/pause.rs", 2, "at startup, remove_dir_all or remove_file of what a dump cut short left in the broker's 0700 <data_dir>/paused, <data_dir>/snapshots or <data_dir>/snapshots-docker (no kernel reaches them; std's remove_dir_all opens each directory O_NOFOLLOW and unlinks symlinks as themselves)"),
    ("src/session/snapshot.rs", 5, "the broker's 0700 directory of snapshots' records in the data directory"),
    ("src/sandbox/local/reaper.rs", 1, "remove_dir_logged of an ended kernel's runtime directory"),
    ("src/sandbox/local/template/mod.rs", 3, "remove_dir_logged of a stem's directory: its parent, the template's directory, is the kernel's, but std's remove_dir_all opens that last component O_NOFOLLOW and removes below it by descriptor; the directories above are the broker's"),
    ("src/session/kept.rs", 5, "the broker's 0700 directory of kept sessions in the data directory"),
];

/// Calls that resolve a path and read what they find there (or its metadata).
const READ_CALLS: &[&str] = &[
    "fs::read(",
    "fs::read_to_string(",
    "File::open(",
    "fs::read_dir(",
    "fs::metadata(",
    "fs::symlink_metadata(",
    "fs::read_link(",
    "fs::canonicalize(",
    ".read_dir(",
    ".canonicalize(",
    ".read_link(",
    ".symlink_metadata(",
];

const PROCFS: &str = "procfs (/proc/<pid>/... of a kernel's or the broker's own process, and /proc/self: the kernel makes these, a process cannot turn an entry into a link it chose)";
const CGROUPFS: &str = "cgroupfs: the broker's hierarchy (leaves it made), which no kernel can write and which holds no symlinks";

/// Where path-based reads stand, how many, and why each is safe.
const ALLOWED_READS: &[(&str, usize, &str)] = &[
    ("src/sandbox/criu/caps.rs", 1, "procfs: /proc/self/status, the broker's own capabilities"),
    ("src/sandbox/loop_release.rs", 3, "the kernel's /sys/block listing and its loop devices' backing_file (the kernel writes them), and the canonical path of a workspace image in the broker's 0700 images directory"),
    ("src/sandbox/procfs.rs", 10, PROCFS),
    ("src/sandbox/fork.rs", 2, PROCFS),
    ("src/sandbox/netns.rs", 1, PROCFS),
    ("src/sandbox/docker/engine.rs", 1, PROCFS),
    ("src/sandbox/local/keep.rs", 1, "the broker's 0700 ticket directory"),
    ("src/sandbox/docker/keep/adopt.rs", 1, "cgroupfs: the cgroup.procs of a kept kernel's leaf, reopened beneath its container's cgroup (the broker's leaf, which no kernel can write)"),
    ("src/sandbox/cgroup/mountinfo.rs", 1, PROCFS),
    ("src/sandbox/cgroup/user_dir.rs", 1, PROCFS),
    ("src/sandbox/cgroup/freezer.rs", 3, "cgroupfs (the broker's leaves and freezer directories); procfs"),
    ("src/sandbox/cgroup/fs.rs", 4, CGROUPFS),
    ("src/sandbox/cgroup/leaf.rs", 7, CGROUPFS),
    ("src/sandbox/cgroup/nested.rs", 2, "procfs (the container's pid's cgroup, /proc/self/mountinfo); a container's cgroup, which Docker shows its processes read-only"),
    ("src/sandbox/own_workspace.rs", 1, "the list of the broker's 0700 <data_dir>/sandboxes (names only)"),
    ("src/sandbox/pause.rs", 1, "the list of the broker's 0700 <data_dir>/paused, <data_dir>/snapshots or <data_dir>/snapshots-docker at startup (names only; each record is then read by descriptor, O_NOFOLLOW)"),
    ("src/session/snapshot.rs", 1, "the list of the broker's 0700 directory of snapshots' records (names only; each is read by private_file::read_capped, O_NOFOLLOW, the broker's own files only)"),
    ("src/sandbox/workspace_fs.rs", 6, "the broker's 0700 images directory and an image in it; whether a workspace directory (its parent the broker's, so not swappable by a kernel) is empty; the workspace's mount point and its parent, with symlink_metadata (the last component not followed), to check they are the broker's"),
    ("src/sandbox/fsutil/mod.rs", 1, "symlink_metadata of a directory the broker just made in its own state directory, to check it is its own (the last component not followed)"),
    ("src/sandbox/docker/daemon.rs", 1, "the broker's Docker runtime base (names only, each then removed by remove_dir_logged)"),
    ("src/sandbox/docker/keep/mod.rs", 1, "the broker's 0700 ticket directory (whether it exists)"),
    ("src/sandbox/docker/keep/ticket.rs", 2, "the broker's 0700 ticket directory; the user's 0711 runtime directory (the broker's; /run/kernel in the container, which kernels cannot write), names only"),
    ("src/sandbox/criu/programs.rs", 1, "CRIU's binary at the path the operator configured (a host file, root's)"),
    ("src/sandbox/local/bwrap.rs", 2, "the host's root directory's entries (/lib, /bin, ...: root's) and /etc's names (the JDKs' configurations: root's)"),
    ("src/sandbox/local/python.rs", 2, "the kernels' environment's bin (the operator's venv, shown read-only to kernels): its names and four bytes of each file"),
    ("src/sandbox/local/files.rs", 1, "the broker's runtime base (names only)"),
    ("src/session/kept.rs", 1, "the broker's 0700 directory of kept sessions"),
];

/// The library part of a source file: up to its test module.
fn library_part(text: &str) -> &str {
    text.find("\n#[cfg(test)]\nmod ")
        .map_or(text, |at| &text[..at])
}

fn count_path_calls(text: &str) -> usize {
    count_calls(text, PATH_CALLS)
}

fn count_calls(text: &str, calls: &[&str]) -> usize {
    library_part(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| calls.iter().map(|c| l.matches(c).count()).sum::<usize>())
        .sum()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "testing" && name != "tests" {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") && !name.ends_with("tests.rs") {
            out.push(path);
        }
    }
}

/// Every library file of the sandbox and session code, with its path from the crate root.
fn guarded_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src/sandbox", "src/session"] {
        sources(&root.join(dir), &mut files);
    }
    files
        .iter()
        .map(|path| {
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (rel, std::fs::read_to_string(path).unwrap())
        })
        .collect()
}

/// What differs between the calls found and the counts listed.
fn against_list(calls: &[&str], listed: &[(&str, usize, &str)], what: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let allowed: BTreeMap<&str, (usize, &str)> =
        listed.iter().map(|(f, n, why)| (*f, (*n, *why))).collect();
    let files = guarded_files();
    assert!(files.len() > 40, "only {} files read", files.len());
    let mut problems = Vec::new();
    for (rel, text) in &files {
        let found = count_calls(text, calls);
        let (limit, _) = allowed.get(rel.as_str()).copied().unwrap_or((0, ""));
        if found > limit {
            problems.push(format!(
                "{rel}: {found} path-based {what}, {limit} allowed: use fsutil's descriptor \
                 functions in any directory a kernel can write, or list the site here with \
                 why a path is safe"
            ));
        } else if found < limit {
            problems.push(format!(
                "{rel}: {found} path-based {what}, {limit} listed: lower the count"
            ));
        }
    }
    for file in allowed.keys() {
        if !root.join(file).exists() {
            problems.push(format!("{file} is listed but gone"));
        }
    }
    problems
}

#[test]
fn root_file_operations_by_path_stay_where_no_kernel_can_write() {
    let problems = against_list(PATH_CALLS, ALLOWED, "file operations");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn root_reads_by_path_stay_where_no_kernel_can_write() {
    let problems = against_list(READ_CALLS, ALLOWED_READS, "reads");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_guard_sees_what_it_must() {
    let code = "fn f() {\n    std::fs::write(p, b\"\")?;\n    // std::fs::write(q)\n    std::os::unix::fs::chown(d, None, None)?;\n    tokio::fs::remove_file(x).await;\n}\n#[cfg(test)]\nmod tests {\n    std::fs::write(t, b\"\");\n}\n";
    // write, chown, tokio::fs:: + remove_file; the comment and the test module are not counted.
    assert_eq!(count_path_calls(code), 4);
}

#[test]
fn the_read_guard_sees_what_it_must() {
    let code = "fn f() {\n    let t = std::fs::read_to_string(p)?;\n    let d = dir.read_dir()?;\n    let f = File::open(q)?;\n    let m = fs::symlink_metadata(r)?;\n    let n = file.metadata()?;\n    // std::fs::read(q)\n}\n#[cfg(test)]\nmod tests {\n    std::fs::read(t);\n}\n";
    // read_to_string, read_dir, File::open, symlink_metadata; a descriptor's metadata, the
    // comment and the test module are not counted.
    assert_eq!(count_calls(code, READ_CALLS), 4);
}
