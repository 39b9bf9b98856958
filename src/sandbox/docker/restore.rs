//! The processes of a copy into a container of its own (`copy.rs` says the whole): the
//! files' copy, a `tar` pair through a pipe, and CRIU's restore under bwrap, each started
//! by `nsenter` in a container's namespaces with the host's programs run by descriptor
//! (`criu/programs.rs`).

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use tokio::time::timeout;

use super::{Inner, KERNEL_GID, KERNEL_UID};
use crate::sandbox::criu::{
    self, copy_failed, finished, groups_arg, log_pipe, restore_result, Loader, Programs,
    STEP_TIMEOUT,
};
use crate::sandbox::fork::ForkError;
use crate::sandbox::fsutil::{find_program, inherit_fd, inherit_in_child};
use crate::sandbox::procfs::{children_of, namespace_pid, uids_of};

/// The programs a copy into a container runs, found once.
#[derive(Debug)]
pub(super) struct CopyTools {
    pub criu: criu::CopyTools,
    loader: Loader,
    setpriv: PathBuf,
    bwrap: PathBuf,
}

impl CopyTools {
    /// CRIU 4 and nsenter (`criu::find_tools`), setpriv, bwrap and the host's loader for
    /// them; or why a copy cannot be made here. Blocking.
    fn find(configured: Option<&Path>) -> Result<Self, String> {
        let criu = criu::find_tools(configured).map_err(|e| e.to_string())?;
        let missing = |name: &str, package: &str| {
            format!("copying a kernel into a container of its own needs {name} ({package})")
        };
        let setpriv = find_program("setpriv").ok_or_else(|| missing("setpriv", "util-linux"))?;
        let bwrap = find_program("bwrap").ok_or_else(|| missing("bwrap", "bubblewrap"))?;
        let loader = Loader::find(&[&criu.criu, &setpriv, &bwrap])
            .map_err(|e| format!("cannot find the host's loader for CRIU: {e}"))?;
        Ok(Self {
            criu,
            loader,
            setpriv,
            bwrap,
        })
    }

    /// The programs opened for one copy.
    pub(super) fn programs(&self) -> Result<Programs, ForkError> {
        Programs::loaded(&self.loader, &self.criu.criu, &self.setpriv, &self.bwrap)
            .map_err(|e| copy_failed(format!("cannot open the copy's programs: {e}")))
    }
}

impl Inner {
    /// The copy's tools, or why it cannot be made (the answer is kept).
    pub(super) async fn copy_tools(&self) -> Result<Arc<CopyTools>, ForkError> {
        let configured = self.cfg.criu.clone();
        let found = self
            .copy_tools
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || CopyTools::find(configured.as_deref()))
                    .await
                    .unwrap_or_else(|e| Err(format!("looking for CRIU failed: {e}")))
                    .map(Arc::new)
            })
            .await;
        found.clone().map_err(ForkError::Unsupported)
    }
}

/// setpriv's arguments for the kernel's uid and group with no capability at all.
fn unprivileged(ids: (u32, u32)) -> Vec<OsString> {
    [
        format!("--reuid={}", ids.0),
        format!("--regid={}", ids.1),
        groups_arg(Some(ids.1)),
        "--inh-caps=-all".into(),
        "--bounding-set=-all".into(),
        "--no-new-privs".into(),
        "--".into(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect()
}

/// Which of a container's directories a copy carries: a copy's and a snapshot's, both; a
/// pause's, `/tmp` only (its workspace stays where it is, on the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Carried {
    HomeAndTmp,
    Tmp,
}

impl Carried {
    /// The directories, relative to `/`.
    fn dirs(self) -> &'static [&'static str] {
        match self {
            Carried::HomeAndTmp => &["home/user", "tmp"],
            Carried::Tmp => &["tmp"],
        }
    }

    /// What the source's `sh` runs: the entries of the directories archived (not the
    /// directories, whose owner and mode are the container's), symlinks as symlinks.
    fn pack(self) -> String {
        format!(
            "cd / && find {} -mindepth 1 -maxdepth 1 -print0 | tar --null --files-from=- -cf -",
            self.dirs().join(" ")
        )
    }

    /// What the destination's `sh` runs: the old files go (a rewind), all or none
    /// ([`criu::emptied_check`]), and the archive is unpacked.
    fn unpack(self) -> String {
        let dirs: Vec<String> = self.dirs().iter().map(|d| format!("/{d}")).collect();
        let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
        format!(
            "set -e; {}; find {} -mindepth 1 -delete; exec tar -C / -xf -",
            criu::emptied_check(&dirs),
            dirs.join(" ")
        )
    }
}

/// `argv` in the namespaces of the container whose init is host process `init`, as the
/// kernel's uid with no capabilities and `no_new_privs`, the host's programs by descriptor.
fn in_container(
    tools: &CopyTools,
    programs: &Programs,
    init: i32,
    argv: &[&str],
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&tools.criu.nsenter);
    cmd.arg(format!("--target={init}"))
        .args(["--all", "--"])
        .args(&programs.setpriv)
        .args(unprivileged((KERNEL_UID, KERNEL_GID)))
        .args(argv)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .current_dir("/")
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    inherit_in_child(&mut cmd, programs.fds.clone());
    cmd
}

fn spawn_failed(e: std::io::Error) -> ForkError {
    copy_failed(format!("cannot start the copy: {e}"))
}

/// Copies container `from`'s `/home/user` and `/tmp` over container `to`'s (init host
/// pids): `tar` in each container's namespaces as the kernel's uid with no capabilities,
/// through a pipe, for at most [`STEP_TIMEOUT`].
pub(super) async fn copy_files(tools: &CopyTools, from: i32, to: i32) -> Result<(), ForkError> {
    let programs = tools.programs()?;
    let carried = Carried::HomeAndTmp;
    let mut pack = in_container(tools, &programs, from, &["sh", "-c", &carried.pack()]);
    let mut pack = pack
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(spawn_failed)?;
    let pipe: Stdio = pack
        .stdout
        .take()
        .ok_or_else(|| copy_failed("the copy has no pipe"))?
        .try_into()
        .map_err(spawn_failed)?;
    let unpack = in_container(tools, &programs, to, &["sh", "-c", &carried.unpack()])
        .stdin(pipe)
        .stdout(Stdio::null())
        .spawn()
        .map_err(spawn_failed)?;
    let both = async { tokio::join!(finished(pack), finished(unpack)) };
    match timeout(STEP_TIMEOUT, both).await {
        Ok((Ok(()), Ok(()))) => Ok(()),
        // The writer's failure first: the reader then dies of the closed pipe.
        Ok((_, Err(why))) => Err(copy_failed(format!(
            "the workspace could not be written ({why})"
        ))),
        Ok((Err(why), _)) => Err(copy_failed(format!(
            "the workspace could not be read ({why})"
        ))),
        Err(_) => Err(took_too_long()),
    }
}

fn took_too_long() -> ForkError {
    copy_failed(format!(
        "the workspace copy took more than {} s",
        STEP_TIMEOUT.as_secs()
    ))
}

/// Archives the `carried` directories of container `from` into `archive` (a new file of the
/// broker's, opened for writing, handed to `tar` as its output): as [`copy_files`] reads
/// them, and at most `limit` bytes (`RLIMIT_FSIZE`: past it `tar` is stopped).
pub(super) async fn pack_files(
    tools: &CopyTools,
    (from, carried): (i32, Carried),
    archive: std::fs::File,
    limit: u64,
) -> Result<(), ForkError> {
    let programs = tools.programs()?;
    let mut cmd = in_container(tools, &programs, from, &["sh", "-c", &carried.pack()]);
    cmd.stdin(Stdio::null()).stdout(archive);
    // SAFETY: the closure runs between fork and exec and calls only setrlimit
    // (async-signal-safe) on a value made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let bound = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &bound) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let pack = cmd.spawn().map_err(spawn_failed)?;
    match timeout(STEP_TIMEOUT, finished(pack)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(copy_failed(format!(
            "the workspace could not be archived (at most {limit} bytes: its quota and /tmp; {why})"
        ))),
        Err(_) => Err(took_too_long()),
    }
}

/// Unpacks `archive` (the broker's file, opened for reading) over the `carried`
/// directories of container `to`, emptied first, as [`copy_files`] writes them.
pub(super) async fn unpack_files(
    tools: &CopyTools,
    (to, carried): (i32, Carried),
    archive: std::fs::File,
) -> Result<(), ForkError> {
    let programs = tools.programs()?;
    let unpack = in_container(tools, &programs, to, &["sh", "-c", &carried.unpack()])
        .stdin(archive)
        .stdout(Stdio::null())
        .spawn()
        .map_err(spawn_failed)?;
    match timeout(STEP_TIMEOUT, finished(unpack)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(copy_failed(format!(
            "the workspace could not be written ({why})"
        ))),
        Err(_) => Err(took_too_long()),
    }
}

/// Files of `/proc` that Docker hides from a container (its default masked paths that
/// are files), hidden again in the restored kernel's own `/proc`.
const MASKED_FILES: [&str; 6] = [
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
];
/// Directories of `/proc` Docker hides (an empty read-only tmpfs over each).
const MASKED_DIRS: [&str; 2] = ["/proc/acpi", "/proc/scsi"];
/// Paths of `/proc` Docker makes read-only.
const READ_ONLY: [&str; 5] = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// bwrap's arguments around the restore (root, in the container's namespaces): a pid and a
/// mount namespace of the kernel's own over the container's whole tree, its own `/proc`
/// masked as Docker masks a container's, and only the capabilities setpriv needs to
/// become the kernel's uid with the two a restore needs.
fn bwrap_args() -> Vec<OsString> {
    let mut args: Vec<String> = ["--unshare-pid", "--dev-bind", "/", "/", "--proc", "/proc"]
        .map(String::from)
        .to_vec();
    // The host's /proc tells which exist (the same kernel).
    for file in MASKED_FILES.iter().filter(|f| Path::new(f).exists()) {
        args.extend(["--ro-bind".into(), "/dev/null".into(), file.to_string()]);
    }
    for dir in MASKED_DIRS.iter().filter(|d| Path::new(d).is_dir()) {
        args.extend([
            "--tmpfs".into(),
            dir.to_string(),
            "--remount-ro".into(),
            dir.to_string(),
        ]);
    }
    for path in READ_ONLY.iter().filter(|p| Path::new(p).exists()) {
        args.extend(["--ro-bind".into(), path.to_string(), path.to_string()]);
    }
    args.extend(["--cap-drop".into(), "ALL".into()]);
    for cap in [
        "CAP_SETUID",
        "CAP_SETGID",
        "CAP_SETPCAP",
        "CAP_CHECKPOINT_RESTORE",
    ] {
        args.extend(["--cap-add".into(), cap.into()]);
    }
    args.extend([
        "--new-session".into(),
        "--die-with-parent".into(),
        "--".into(),
    ]);
    args.into_iter().map(OsString::from).collect()
}

/// Restores the sealed `images` in the namespaces of the container whose init is host
/// process `init`: the helper enters the cgroup leaf whose `cgroup.procs` are `procs`
/// before it runs; CRIU runs as `ids` with `CAP_CHECKPOINT_RESTORE` and `CAP_SETPCAP`
/// only. Returns the helper's host pid once CRIU says the task runs.
pub(super) async fn restore(
    tools: &CopyTools,
    programs: &Programs,
    init: i32,
    procs: &[RawFd],
    images: &OwnedFd,
    ids: (u32, u32),
) -> Result<i32, ForkError> {
    let (log_read, log_write) = log_pipe(ids)?;
    let fd = |f: RawFd| format!("/proc/self/fd/{f}");
    let mut cmd = tokio::process::Command::new(&tools.criu.nsenter);
    cmd.arg(format!("--target={init}"))
        .args(["--all", "--"])
        .args(&programs.bwrap)
        .args(bwrap_args())
        .args(&programs.setpriv)
        .arg(format!("--reuid={}", ids.0))
        .arg(format!("--regid={}", ids.1))
        .arg(groups_arg(Some(ids.1)))
        .args([
            "--inh-caps=-all,+checkpoint_restore,+setpcap",
            "--ambient-caps=+checkpoint_restore,+setpcap",
            "--bounding-set=-all,+checkpoint_restore,+setpcap",
            "--no-new-privs",
            "--",
        ])
        .args(&programs.criu)
        .args([
            "restore",
            "--unprivileged",
            "--shell-job",
            "--manage-cgroups=ignore",
        ])
        .arg(format!("--images-dir={}", fd(images.as_raw_fd())))
        .arg(format!("--log-file={}", fd(log_write.as_raw_fd())))
        .arg("-v3")
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut inherited = programs.fds.clone();
    inherited.extend([images.as_raw_fd(), log_write.as_raw_fd()]);
    let procs = procs.to_vec();
    // SAFETY: the closure runs between fork and exec and calls only write and fcntl
    // (async-signal-safe) on descriptors numbered before the fork.
    unsafe {
        cmd.pre_exec(move || {
            // Into the copy's leaf before anything runs ("0": the writing process).
            for fd in &procs {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for fd in &inherited {
                inherit_fd(*fd)?;
            }
            Ok(())
        });
    }
    // Not killed on drop: the helper is the restored kernel's ancestor (its leaf's removal
    // ends them all); Tokio reaps it when it ends.
    let child = cmd
        .spawn()
        .map_err(|e| copy_failed(format!("cannot start CRIU: {e}")))?;
    drop(log_write);
    let helper = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| copy_failed("CRIU ended at once"))?;
    restore_result(log_read).await?;
    Ok(helper)
}

/// The restored kernel on the host: the descendant of the restore's helper that has pid
/// `pid` in its pid namespace and runs as `uid` (CRIU, its parent, has pid 2 there).
pub(super) fn restored_pid(helper: i32, pid: i64, uid: u32) -> Option<i32> {
    let inner = i32::try_from(pid).ok().filter(|p| *p > 2)?;
    let mut level = vec![helper];
    // nsenter, bwrap, bwrap's init in the new namespace, CRIU, the kernel.
    for _ in 0..6 {
        let next: Vec<i32> = level.iter().flat_map(|p| children_of(*p)).collect();
        if let Some(found) = next
            .iter()
            .copied()
            .find(|p| namespace_pid(*p) == Some(inner) && uids_of(*p) == Some([uid; 4]))
        {
            return Some(found);
        }
        level = next;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_carries_tmp_alone_and_a_copy_both() {
        assert_eq!(
            Carried::HomeAndTmp.pack(),
            "cd / && find home/user tmp -mindepth 1 -maxdepth 1 -print0 | tar --null --files-from=- -cf -"
        );
        let tmp = Carried::Tmp.unpack();
        assert!(tmp.contains("find /tmp -mindepth 1 -delete"), "{tmp}");
        assert!(!tmp.contains("/home/user"), "{tmp}");
        assert!(Carried::HomeAndTmp
            .unpack()
            .contains("find /home/user /tmp -mindepth 1 -delete"));
    }

    #[test]
    fn the_restore_masks_what_docker_masks_and_keeps_four_capabilities() {
        let args: Vec<String> = bwrap_args()
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let joined = args.join(" ");
        assert!(joined.starts_with("--unshare-pid --dev-bind / / --proc /proc"));
        if Path::new("/proc/timer_list").exists() {
            assert!(joined.contains("--ro-bind /dev/null /proc/timer_list"));
        }
        assert!(joined.contains("--ro-bind /proc/sys /proc/sys"));
        let caps: Vec<&String> = args
            .windows(2)
            .filter(|w| w[0] == "--cap-add")
            .map(|w| &w[1])
            .collect();
        assert_eq!(caps.len(), 4);
        assert_eq!(args.last().unwrap(), "--");
    }
}
