//! The programs a copy of a kernel into a sandbox of its own runs, for both backends (the
//! local sandbox's `local/copy.rs` and the Docker sandbox's `docker/copy.rs` say the
//! whole): CRIU's dump inside the kernel's sandbox and the reading of its restore's log,
//! the images sealed between the two, the workspace copy's process, and the wake signal.
//! Each runs with a bound in time; each error says what CRIU said.
//!
//! The host programs (setpriv, CRIU, bwrap) run inside a sandbox's mount namespace. The
//! local sandbox shows the host's `/usr` there; a container does not, so there they run
//! through the host's dynamic loader with the host's library directories, all by
//! descriptor ([`Programs::loaded`]): nothing of the container's files is run as root, and
//! the image needs no CRIU.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use rustix::fs::{Mode, OFlags};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::time::timeout;

use crate::sandbox::fork::ForkError;
use crate::sandbox::fsutil::{find_program, inherit_in_child};
use crate::sandbox::pidfd;
use crate::sandbox::procfs::uids_of;

mod caps;
mod programs;
pub(crate) mod room;

pub(crate) use programs::{Loader, Programs};
pub(crate) use room::{CopyRoom, DEFAULT_COPY_RESERVE};

/// Room for the images of a copy of the kernel `host_pid` (`room.rs`), reserved in a
/// blocking task; its refusal is the fork's.
pub(crate) async fn reserve_room(
    room: &std::sync::Arc<CopyRoom>,
    dir: &Path,
    host_pid: i32,
    keep_free: u64,
) -> Result<room::Reserved, ForkError> {
    let (room, dir) = (room.clone(), dir.to_path_buf());
    let reserved = tokio::task::spawn_blocking(move || room.reserve_for(&dir, host_pid, keep_free))
        .await
        .map_err(|e| copy_failed(format!("the room check failed: {e}")))?;
    reserved.map_err(|e| match e {
        room::RoomError::NoRoom(why) => ForkError::NoRoom(why),
        room::RoomError::Unknown(why) => copy_failed(why),
    })
}

/// What wakes a held child (`WAKE_SIGNAL` in `kernels/kernel_broker_fork.py`: SIGRTMIN+6
/// with glibc).
const WAKE_SIGNAL: i32 = 40;
/// How long a workspace copy, a dump or a restore may take.
pub(crate) const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// What CRIU writes once the restored tasks run.
const RESTORED: &str = "Restore finished successfully";
/// The CRIU versions that work: 3.x cannot dump on current kernels (its vdso handling).
const MIN_CRIU_MAJOR: u32 = 4;
/// Where CRIU is looked for when `--criu` does not say.
const CRIU_PLACES: [&str; 3] = [
    "/usr/local/sbin/criu",
    "/usr/sbin/criu",
    "/usr/local/bin/criu",
];

/// The programs a copy runs, found once.
#[derive(Debug, Clone)]
pub(crate) struct CopyTools {
    pub criu: PathBuf,
    pub nsenter: PathBuf,
}

/// Why a copy cannot be made here (no CRIU 4, no nsenter): said as the fork's refusal.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub(crate) struct NoCopyTools(String);

impl From<String> for NoCopyTools {
    fn from(why: String) -> Self {
        Self(why)
    }
}

/// CRIU (`configured`, else the first of [`CRIU_PLACES`] that is 4.0 or later) and
/// `nsenter`, with the capabilities to hand CRIU; or why a copy cannot be made here. Blocking (runs `criu --version`).
pub(crate) fn find_tools(configured: Option<&Path>) -> Result<CopyTools, NoCopyTools> {
    let candidates: Vec<PathBuf> = match configured {
        Some(path) => vec![path.to_path_buf()],
        None => CRIU_PLACES.iter().map(PathBuf::from).collect(),
    };
    let mut seen = Vec::new();
    let mut criu = None;
    for path in candidates.into_iter().filter(|p| p.is_file()) {
        match criu_version(&path) {
            Some((major, _)) if major >= MIN_CRIU_MAJOR => {
                criu = Some(path);
                break;
            }
            Some((major, minor)) => seen.push(format!("{major}.{minor} at {}", path.display())),
            None => seen.push(format!("an unknown version at {}", path.display())),
        }
    }
    let criu = criu.ok_or_else(|| {
        NoCopyTools({
            let found = match seen.is_empty() {
                true => "none was found".to_string(),
                false => format!("found {}", seen.join(", ")),
            };
            format!(
            "copying a kernel into a sandbox of its own needs CRIU {MIN_CRIU_MAJOR}.0 or later \
             ({found}); `scripts/setup-criu` installs CRIU 4.1.1, or name one with --criu"
        )
        })
    })?;
    let nsenter = find_program("nsenter")
        .ok_or_else(|| NoCopyTools("nsenter (util-linux) is not installed".into()))?;
    if let Some(why) = caps::missing(caps::permitted()) {
        return Err(NoCopyTools(why));
    }
    Ok(CopyTools { criu, nsenter })
}

/// `criu --version`'s major and minor.
fn criu_version(path: &Path) -> Option<(u32, u32)> {
    let out = std::process::Command::new(path)
        .arg("--version")
        .env_clear()
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    parse_criu_version(&String::from_utf8_lossy(&out.stdout))
}

fn parse_criu_version(text: &str) -> Option<(u32, u32)> {
    let version = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim();
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().unwrap_or("0").parse().ok()?;
    Some((major, minor))
}

/// Why a copy failed, said once for the API.
pub(crate) fn copy_failed(why: impl Into<String>) -> ForkError {
    ForkError::Copy(why.into())
}

/// Runs the workspace copy (`program` with `args`: the local sandbox's bwrap with
/// `copy_args`), for at most [`STEP_TIMEOUT`].
pub(crate) async fn copy_workspace(program: &Path, args: &[OsString]) -> Result<(), ForkError> {
    run_workspace_tool(program, args, Stdio::null(), Stdio::null(), "copied").await
}

/// Runs a tool over a workspace (`program` with `args`: the local sandbox's bwrap around
/// it), its standard input and output `stdin` and `stdout`, for at most [`STEP_TIMEOUT`];
/// `what` the workspace is being (said in the error).
pub(crate) async fn run_workspace_tool(
    program: &Path,
    args: &[OsString],
    stdin: Stdio,
    stdout: Stdio,
    what: &str,
) -> Result<(), ForkError> {
    let child = tokio::process::Command::new(program)
        .args(args)
        .env_clear()
        .current_dir("/")
        .stdin(stdin)
        .stdout(stdout)
        .stderr(Stdio::piped())
        // bwrap's --die-with-parent takes the tool along.
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| copy_failed(format!("the workspace cannot be {what}: {e}")))?;
    match timeout(STEP_TIMEOUT, finished(child)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(copy_failed(format!(
            "the workspace could not be {what} ({why})"
        ))),
        Err(_) => Err(copy_failed(format!(
            "the workspace took more than {} s to be {what}",
            STEP_TIMEOUT.as_secs()
        ))),
    }
}

/// How a copy's process failed: its status and the first 2 KiB of its standard error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ProcessFailed(String);

/// Waits for `child` to end while reading all its standard error (a process with many
/// errors must not stall on a full pipe).
pub(crate) async fn finished(mut child: tokio::process::Child) -> Result<(), ProcessFailed> {
    let stderr = child.stderr.take();
    let errors = async move {
        let mut kept = Vec::new();
        if let Some(mut stderr) = stderr {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut buf).await {
                let room = 2048usize.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
        String::from_utf8_lossy(&kept).trim().to_string()
    };
    match tokio::join!(child.wait(), errors) {
        (Ok(status), _) if status.success() => Ok(()),
        (Ok(status), err) => Err(ProcessFailed(format!("{status}: {err}"))),
        (Err(e), _) => Err(ProcessFailed(e.to_string())),
    }
}

/// CRIU dumps the held child (`pid` inside, `host` on the host) into `images`, run in the
/// sandbox's namespaces as the kernel's uid (and its one group, where it has one) with the
/// capabilities a dump needs ([`dump_caps`]).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn dump(
    tools: &CopyTools,
    programs: &Programs,
    host: i32,
    pid: i64,
    ids: (u32, u32),
    groups: Option<u32>,
    images: &OwnedFd,
    non_dumpable: bool,
) -> Result<(), ForkError> {
    let fd = |f: RawFd| format!("/proc/self/fd/{f}");
    let mut cmd = tokio::process::Command::new(&tools.nsenter);
    cmd.arg(format!("--target={host}"))
        .arg("--all")
        .arg("--")
        .args(&programs.setpriv)
        .arg(format!("--reuid={}", ids.0))
        .arg(format!("--regid={}", ids.1))
        .arg(groups_arg(groups))
        .args(dump_caps(non_dumpable))
        .args(["--no-new-privs", "--"])
        .args(&programs.criu)
        .args([
            "dump",
            "--unprivileged",
            "--shell-job",
            "--manage-cgroups=ignore",
        ])
        .arg(format!("--tree={pid}"))
        .arg(format!("--images-dir={}", fd(images.as_raw_fd())))
        .args(["--log-file=dump.log", "-v2"])
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut inherited = programs.fds.clone();
    inherited.push(images.as_raw_fd());
    inherit_in_child(&mut cmd, inherited);
    let status = match timeout(STEP_TIMEOUT, async { cmd.status().await }).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return Err(copy_failed(format!("cannot start CRIU: {e}"))),
        Err(_) => {
            return Err(copy_failed(format!(
                "CRIU did not dump it within {} s",
                STEP_TIMEOUT.as_secs()
            )))
        }
    };
    if status.success() {
        return Ok(());
    }
    let log = read_log(images, "dump.log");
    Err(copy_failed(format!(
        "CRIU could not dump it ({status}): {log}"
    )))
}

/// The capabilities a dump runs with (setpriv's arguments). `CAP_CHECKPOINT_RESTORE`, and
/// `CAP_SYS_ADMIN` (reading a process's seccomp filter asks it); a kernel that is not
/// dumpable (one sharing its user's workspace: its key kept from the user's other kernels,
/// `kernels/kernel_broker_boot.py`) is also traced with `CAP_SYS_PTRACE` and its `/proc`
/// files, root's then, read with `CAP_DAC_READ_SEARCH`. Still as the kernel's uid, in its
/// sandbox's namespaces (nothing of the host or of another user is there), under
/// `no_new_privs`.
fn dump_caps(non_dumpable: bool) -> [String; 3] {
    let caps = if non_dumpable {
        "checkpoint_restore,+sys_admin,+sys_ptrace,+dac_read_search"
    } else {
        "checkpoint_restore,+sys_admin"
    };
    [
        format!("--inh-caps=-all,+{caps}"),
        format!("--ambient-caps=+{caps}"),
        format!("--bounding-set=-all,+{caps}"),
    ]
}

/// [`dump`] of the held child `(host pid, its pidfd, pid inside)`, then its images sealed
/// ([`seal`]); returns how long the dump took.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn dump_and_seal(
    tools: &CopyTools,
    programs: &Programs,
    held: (i32, OwnedFd, i64),
    ids: (u32, u32),
    groups: Option<u32>,
    images: &OwnedFd,
    non_dumpable: bool,
) -> Result<Duration, ForkError> {
    let (host, pidfd, pid) = held;
    let started = std::time::Instant::now();
    dump(
        tools,
        programs,
        host,
        pid,
        ids,
        groups,
        images,
        non_dumpable,
    )
    .await?;
    // The dump ended it: its pidfd is no longer needed.
    drop(pidfd);
    let dumped = started.elapsed();
    let sealed = images.try_clone().map_err(|e| copy_failed(e.to_string()))?;
    tokio::task::spawn_blocking(move || seal(sealed))
        .await
        .map_err(|e| copy_failed(format!("the seal task failed: {e}")))?
        .map_err(|e| copy_failed(format!("the dump's images are not as made: {e}")))?;
    Ok(dumped)
}

/// The pipe CRIU's restore logs into: the write end given to the kernel's uid `ids` (CRIU
/// opens its log by path, `/proc/self/fd/N`, as that uid).
pub(crate) fn log_pipe(ids: (u32, u32)) -> Result<(io::PipeReader, io::PipeWriter), ForkError> {
    let (read, write) =
        io::pipe().map_err(|e| copy_failed(format!("cannot create a pipe: {e}")))?;
    rustix::fs::fchown(
        &write,
        Some(rustix::fs::Uid::from_raw(ids.0)),
        Some(rustix::fs::Gid::from_raw(ids.1)),
    )
    .map_err(|e| copy_failed(format!("cannot give CRIU its log: {e}")))?;
    Ok((read, write))
}

/// The errors of a CRIU log in `dir` (its last ones, bounded), for a message.
fn read_log(dir: &OwnedFd, name: &str) -> String {
    let file = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    );
    let Ok(file) = file else {
        return "no log".into();
    };
    let mut text = String::new();
    {
        use std::io::Read;
        let _ = std::fs::File::from(file)
            .take(1 << 20)
            .read_to_string(&mut text);
    }
    errors_of(text.lines())
}

/// The error lines of a CRIU log, the last three, each cut at 300 bytes.
fn errors_of<'a>(lines: impl Iterator<Item = &'a str>) -> String {
    let errors: Vec<&str> = lines.filter(|l| l.contains("Error")).collect();
    let last: Vec<String> = errors
        .iter()
        .rev()
        .take(3)
        .rev()
        .map(|l| {
            let mut l = l.trim().to_string();
            l.truncate(l.floor_char_boundary(300));
            l
        })
        .collect();
    match last.is_empty() {
        true => "no error in its log".into(),
        false => last.join(" | "),
    }
}

/// Makes the dump's images root's and read-only: each entry of `dir` must be a regular
/// file with one link (nothing CRIU does not make), opened without following anything.
pub(crate) fn seal(dir: OwnedFd) -> io::Result<()> {
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut entries = rustix::fs::Dir::read_from(&dir)?;
    let mut names = Vec::new();
    while let Some(entry) = entries.read() {
        let entry = entry?;
        let name = entry.file_name().to_owned();
        if name.as_bytes() != b"." && name.as_bytes() != b".." {
            names.push(name);
        }
    }
    for name in names {
        let file = rustix::fs::openat(
            &dir,
            name.as_c_str(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
        )
        .map_err(|e| bad(format!("{name:?}: {e}")))?;
        let st = rustix::fs::fstat(&file)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_nlink != 1 {
            return Err(bad(format!("{name:?} is not a file of the dump's")));
        }
        rustix::fs::fchown(
            &file,
            Some(rustix::fs::Uid::ROOT),
            Some(rustix::fs::Gid::ROOT),
        )?;
        rustix::fs::fchmod(&file, Mode::from_raw_mode(0o644))?;
    }
    rustix::fs::fchown(
        &dir,
        Some(rustix::fs::Uid::ROOT),
        Some(rustix::fs::Gid::ROOT),
    )?;
    rustix::fs::fchmod(&dir, Mode::from_raw_mode(0o755))?;
    Ok(())
}

/// Reads CRIU's restore log until it says the tasks run (`Ok`), or ends without (its
/// errors), for at most [`STEP_TIMEOUT`].
pub(crate) async fn restore_result(log: io::PipeReader) -> Result<(), ForkError> {
    match timeout(STEP_TIMEOUT, read_restore_log(log)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(copy_failed(format!("CRIU could not restore it: {why}"))),
        Err(_) => Err(copy_failed(format!(
            "CRIU did not restore it within {} s",
            STEP_TIMEOUT.as_secs()
        ))),
    }
}

async fn read_restore_log(log: io::PipeReader) -> Result<(), String> {
    let log = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(log))
        .map_err(|e| format!("its log cannot be read: {e}"))?;
    let mut lines = BufReader::new(log).lines();
    let mut errors: Vec<String> = Vec::new();
    loop {
        match lines.next_line().await {
            Ok(Some(line)) if line.contains(RESTORED) => return Ok(()),
            Ok(Some(line)) => {
                if line.contains("Error") {
                    errors.push(line);
                    if errors.len() > 3 {
                        errors.remove(0);
                    }
                }
            }
            Ok(None) | Err(_) => return Err(errors_of(errors.iter().map(String::as_str))),
        }
    }
}

/// Wakes the restored process, host pid `host`, if it runs as uid `uid`. Returns `host` and
/// the pidfd it was woken through, opened before the signal: what the signal does to it
/// (a process that was not held ends of it) is then seen through that pidfd as its end,
/// never as a pid that cannot be found.
pub(crate) fn wake(host: Option<i32>, uid: u32) -> Result<(i32, OwnedFd), ForkError> {
    let lost = |why: &str| copy_failed(format!("the restored kernel cannot be woken: {why}"));
    let host = host.ok_or_else(|| lost("it is not running"))?;
    let fd = pidfd::open(host).map_err(|_| lost("it ended"))?;
    if uids_of(host) != Some([uid; 4]) {
        return Err(lost("it does not run as the kernel's uid"));
    }
    // SAFETY: pidfd_send_signal(2) on a pidfd this function owns, with no siginfo (the
    // kernel fills in SI_USER) and no flags.
    let sent = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            WAKE_SIGNAL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if sent != 0 {
        return Err(lost(&io::Error::last_os_error().to_string()));
    }
    Ok((host, fd))
}

/// setpriv's argument for the copy's groups: none, or the kernel's one.
pub(crate) fn groups_arg(groups: Option<u32>) -> String {
    match groups {
        Some(gid) => format!("--groups={gid}"),
        None => "--clear-groups".into(),
    }
}

/// A shell test that `dirs` can be emptied by the kernel's uid it runs as (every
/// directory below them writable), else a message on stderr and a failure: a rewind
/// replaces the session's files only if all of them can go, never half of them.
pub(crate) fn emptied_check(dirs: &[&str]) -> String {
    format!(
        "ro=$(find {} -mindepth 1 -type d ! -writable -print -quit) && \
         if [ -n \"$ro\" ]; then echo \"its files cannot be replaced: the kernel cannot \
         write the directory $ro\" >&2; exit 1; fi",
        dirs.join(" ")
    )
}

/// Removes the copies' directory `dir` an earlier run left (it stopped mid-copy): the
/// images hold a kernel's memory. Blocking.
pub(crate) fn sweep_copies(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {
            tracing::info!(path = %dir.display(), "removed the copies an earlier run left")
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %dir.display(), error = %e, "cannot remove the copies an earlier run left")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::fsutil;

    #[test]
    fn criu_versions_are_read_from_its_banner() {
        assert_eq!(parse_criu_version("Version: 4.1.1\n"), Some((4, 1)));
        assert_eq!(
            parse_criu_version("Version: 3.17.1\nGitID: x\n"),
            Some((3, 17))
        );
        assert_eq!(parse_criu_version("Version: 5\n"), Some((5, 0)));
        assert_eq!(parse_criu_version("criu 4.1\n"), None);
        assert_eq!(parse_criu_version(""), None);
    }

    #[test]
    fn a_log_says_its_last_errors_only() {
        let log = "(00.1) Warn: x\n(00.2) Error (criu/a.c:1): one\n(00.3) Error (b): two\n\
                   (00.4) Error (c): three\n(00.5) Error (d): four\n";
        assert_eq!(
            errors_of(log.lines()),
            "(00.3) Error (b): two | (00.4) Error (c): three | (00.5) Error (d): four"
        );
        assert_eq!(errors_of("all fine".lines()), "no error in its log");
        let long = format!("Error {}", "é".repeat(400));
        assert!(errors_of(std::iter::once(long.as_str())).len() <= 300);
    }

    #[test]
    fn a_dump_directory_with_anything_but_its_files_is_not_sealed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("core-3.img"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", dir.path().join("pages-1.img")).unwrap();
        let fd = fsutil::open_tree_root(dir.path()).unwrap();
        assert!(seal(fd).is_err());
        std::fs::remove_file(dir.path().join("pages-1.img")).unwrap();
        std::fs::hard_link(dir.path().join("core-3.img"), dir.path().join("mm-3.img")).unwrap();
        let fd = fsutil::open_tree_root(dir.path()).unwrap();
        assert!(seal(fd).is_err(), "a second link to a file is refused");
        std::fs::remove_file(dir.path().join("mm-3.img")).unwrap();
        let fd = fsutil::open_tree_root(dir.path()).unwrap();
        if rustix::process::geteuid().is_root() {
            seal(fd).unwrap();
            let st = std::fs::metadata(dir.path().join("core-3.img")).unwrap();
            use std::os::unix::fs::MetadataExt;
            assert_eq!((st.uid(), st.mode() & 0o777), (0, 0o644));
        }
    }
}
