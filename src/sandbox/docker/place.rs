//! A process placed in its own leaf of its user's container cgroup before it runs: a
//! kernel's exec (see `exec.rs`, "Memory and processes are the kernel's own") and a
//! fork-server template (`template.rs`). The process's command waits in a shell loop
//! ([`wait_for_go`]) while the broker (root on the host) finds its host pid, makes the
//! leaf and moves it there ([`leaf_for`]), then writes the word ([`let_go`]).

use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bollard::errors::Error as DockerError;
use bollard::Docker;

use super::daemon::error_text;
use super::RUN_DIR_INSIDE;
use crate::sandbox::cgroup::{CgroupNotFound, ContainerCgroup, Leaf};
use crate::sandbox::fsutil;
use crate::sandbox::{KernelLimits, SandboxError};

/// Why a process was not placed in a leaf of its own, or not let go.
#[derive(Debug, thiserror::Error)]
pub(super) enum PlaceError {
    #[error("the broker does not run as root")]
    NotRoot,
    #[error("cannot inspect the kernel's exec: {}", error_text(.0))]
    Inspect(#[source] DockerError),
    #[error("the kernel's exec ended before it was placed")]
    ExecEnded,
    #[error("the daemon did not report the kernel exec's pid")]
    NoPid,
    #[error("{0}")]
    NoContainerCgroup(#[source] CgroupNotFound),
    /// The leaf was not made, or the process not moved into it.
    #[error("{0}")]
    Leaf(#[source] SandboxError),
    #[error("placing the kernel failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    #[error("the command's shell did not write its pid: {0}")]
    PidFile(#[source] io::Error),
    #[error("cannot let the process start ({}): {source}", path.display())]
    LetGo {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The shell loop that waits for the broker's word ([`GO_FILE`] in the session directory).
pub(super) fn wait_for_go(dir: &str) -> String {
    format!(
        "i=0; while [ ! -e {RUN_DIR_INSIDE}/{dir}/{GO_FILE} ]; do i=$((i+1)); \
         [ $i -gt {GO_ROUNDS} ] && exit {GO_TIMEOUT_EXIT}; sleep 0.02; done; "
    )
}

/// The file whose appearance lets the kernel's command start the kernel (see the module
/// comment); it waits at most [`GO_ROUNDS`] × 20 ms, then exits with [`GO_TIMEOUT_EXIT`].
const GO_FILE: &str = "go";
const GO_ROUNDS: u32 = 1500;
pub(super) const GO_TIMEOUT_EXIT: i64 = 125;

/// Places a started kernel exec into its own leaf of the container's cgroup (see the
/// module comment), then lets it go. `None`: no leaf (logged); it runs under the
/// container's limits.
pub(super) async fn place_kernel(
    docker: &Docker,
    exec_id: Option<&str>,
    host_dir: &Path,
    session: &str,
    limits: &KernelLimits,
) -> Result<Option<Leaf>, PlaceError> {
    let pid = match exec_id {
        Some(id) => exec_pid(docker, id).await,
        None => Err(PlaceError::NotRoot),
    };
    let leaf = match pid {
        Ok(pid) => {
            let session = session.to_string();
            let limits = *limits;
            tokio::task::spawn_blocking(move || leaf_for(pid, &session, &limits).map(|(_, l)| l))
                .await
                .map_err(PlaceError::Task)
                .and_then(|r| r)
        }
        Err(e) => Err(e),
    };
    let leaf = match leaf {
        Ok(leaf) => Some(leaf),
        Err(why) => {
            warn_once_unplaced(&why);
            None
        }
    };
    if let Err(e) = let_go(host_dir) {
        if let Some(leaf) = &leaf {
            ContainerCgroup::remove_leaf(leaf).await;
        }
        return Err(e);
    }
    Ok(leaf)
}

/// The pid that a command's shell writes to `pid` in its session directory (its first act,
/// before it waits for `go`): the number the sandbox's pid namespace gave it, polled for
/// up to `wait`. The directory is the kernel uid's, so another process of the user may
/// have planted `pid` as a symlink or a fifo: it is opened beneath the user's runtime
/// directory through descriptors, never following a symlink, without blocking, and read
/// only if it is a regular file; a number counts once its line is whole.
pub(super) async fn written_pid(host_dir: &Path, wait: Duration) -> Result<u32, PlaceError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let dir = host_dir.to_path_buf();
        let read = tokio::task::spawn_blocking(move || read_pid_file(&dir))
            .await
            .map_err(PlaceError::Task)?;
        match read {
            Ok(Some(pid)) => return Ok(pid),
            Ok(None) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Ok(None) => return Err(PlaceError::PidFile(io::ErrorKind::TimedOut.into())),
            Err(e) => return Err(PlaceError::PidFile(e)),
        }
    }
}

/// One look at `pid` (see [`written_pid`]): `None` while it is absent or its line unfinished.
fn read_pid_file(host_dir: &Path) -> io::Result<Option<u32>> {
    use std::io::Read;
    let (Some(parent), Some(name)) = (host_dir.parent(), host_dir.file_name()) else {
        return Err(io::ErrorKind::InvalidInput.into());
    };
    let parent = fsutil::open_tree_root(parent)?;
    let name = std::ffi::CString::new(name.as_bytes()).map_err(io::Error::other)?;
    let dir = fsutil::open_subdir(parent.as_fd(), &name)?;
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
    let fd = match fsutil::open_beneath(&dir, Path::new("pid"), flags, 0) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut file = std::fs::File::from(fd);
    if !file.metadata()?.file_type().is_file() {
        return Err(io::Error::other("pid is not a regular file"));
    }
    let mut text = String::new();
    (&mut file).take(32).read_to_string(&mut text)?;
    let Some(line) = text.strip_suffix('\n') else {
        return Ok(None);
    };
    line.parse()
        .map(Some)
        .map_err(|_| io::Error::other(format!("pid holds {line:?}, not a pid")))
}

/// Writes the word a command waiting in [`wait_for_go`] waits for.
///
/// The session directory is the kernel's (its uid owns it, and its name shows in the
/// waiting shell's argv): a kernel of the user may plant `go` as a symlink to any host file
/// before the broker writes it. So the directory is opened beneath the user's runtime
/// directory (the broker's) without following any symlink, and `go` is created in that
/// descriptor with `O_CREAT | O_EXCL | O_NOFOLLOW`: a planted `go` fails the launch instead
/// of being followed (docs/SECURITY.md).
pub(super) fn let_go(host_dir: &Path) -> Result<(), PlaceError> {
    let fail = |source: io::Error| PlaceError::LetGo {
        path: host_dir.join(GO_FILE),
        source,
    };
    let (Some(parent), Some(name)) = (host_dir.parent(), host_dir.file_name()) else {
        return Err(fail(std::io::ErrorKind::InvalidInput.into()));
    };
    let parent = fsutil::open_tree_root(parent).map_err(fail)?;
    let name = std::ffi::CString::new(name.as_bytes()).map_err(|e| fail(e.into()))?;
    let dir = fsutil::open_subdir(parent.as_fd(), &name).map_err(fail)?;
    fsutil::write_new_file_at(
        dir.as_fd(),
        Path::new(GO_FILE),
        b"",
        fsutil::FileMode::Exact(0o644),
        None,
    )
    .map_err(fail)
}

/// Makes a leaf named `name` with `limits` in the container cgroup of host process `pid`
/// (not yet in a leaf) and moves `pid` into it; also returns the container's cgroup.
pub(super) fn leaf_for(
    pid: i32,
    name: &str,
    limits: &KernelLimits,
) -> Result<(ContainerCgroup, Leaf), PlaceError> {
    let cgroup = ContainerCgroup::of_process(pid).map_err(PlaceError::NoContainerCgroup)?;
    let leaf = enter_new_leaf(&cgroup, name, limits, pid).map_err(PlaceError::Leaf)?;
    Ok((cgroup, leaf))
}

/// Makes a leaf named `name` with `limits` in `cgroup` and moves host process `pid` into
/// it (a template's child, a live kernel's fork); if the move fails, the leaf goes.
pub(super) fn enter_new_leaf(
    cgroup: &ContainerCgroup,
    name: &str,
    limits: &KernelLimits,
    pid: i32,
) -> Result<Leaf, SandboxError> {
    let leaf = cgroup.create_leaf(name, limits)?;
    if let Err(e) = ContainerCgroup::enter(&leaf, pid) {
        for dir in leaf.dirs() {
            let _ = std::fs::remove_dir(dir);
        }
        return Err(e);
    }
    Ok(leaf)
}

/// The host pid of an exec's first process (the daemon knows it once the exec started).
pub(super) async fn exec_pid(docker: &Docker, exec_id: &str) -> Result<i32, PlaceError> {
    // An attached exec's start returns once the streams are attached, maybe before its
    // process runs: until then the daemon reports it neither running nor exited.
    for _ in 0..250 {
        let exec = docker
            .inspect_exec(exec_id)
            .await
            .map_err(PlaceError::Inspect)?;
        match exec.pid.and_then(|p| i32::try_from(p).ok()) {
            Some(pid) if pid > 0 => return Ok(pid),
            _ if exec.running == Some(false) && exec.exit_code.is_some() => {
                return Err(PlaceError::ExecEnded)
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    Err(PlaceError::NoPid)
}

/// Kernels without a leaf of their own are worth one warning, not one per launch.
fn warn_once_unplaced(why: &PlaceError) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            reason = %why,
            "docker kernels run WITHOUT memory and process limits of their own (only the \
             user's container limits): the broker cannot give them a cgroup leaf"
        );
    });
    tracing::debug!(reason = %why, "kernel not placed in a cgroup leaf");
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn session_dir() -> (tempfile::TempDir, PathBuf) {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("c0123456789ab");
        std::fs::create_dir(&dir).unwrap();
        (base, dir)
    }

    #[test]
    fn a_pid_counts_once_its_line_is_whole() {
        let (_base, dir) = session_dir();
        assert_eq!(read_pid_file(&dir).unwrap(), None);
        std::fs::write(dir.join("pid"), "12").unwrap();
        assert_eq!(read_pid_file(&dir).unwrap(), None);
        std::fs::write(dir.join("pid"), "123\n").unwrap();
        assert_eq!(read_pid_file(&dir).unwrap(), Some(123));
        std::fs::write(dir.join("pid"), "-1\n").unwrap();
        assert!(read_pid_file(&dir).is_err());
    }

    /// Another process of the user plants `pid` before the shell writes it: a symlink to a
    /// file of the host, or a fifo that nobody writes (which would hold a reader forever).
    #[test]
    fn a_planted_pid_is_neither_followed_nor_waited_on() {
        let (base, dir) = session_dir();
        std::fs::write(base.path().join("secret"), "4242\n").unwrap();
        symlink(base.path().join("secret"), dir.join("pid")).unwrap();
        assert!(read_pid_file(&dir).is_err());
        std::fs::remove_file(dir.join("pid")).unwrap();
        let fifo = std::ffi::CString::new(dir.join("pid").as_os_str().as_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
        let started = std::time::Instant::now();
        assert!(read_pid_file(&dir).is_err());
        assert!(started.elapsed() < Duration::from_secs(5));
        // The session directory itself swapped for a symlink.
        std::fs::remove_dir_all(&dir).unwrap();
        let elsewhere = base.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("pid"), "77\n").unwrap();
        symlink(&elsewhere, &dir).unwrap();
        assert!(read_pid_file(&dir).is_err());
    }

    #[tokio::test]
    async fn a_shell_that_never_writes_its_pid_fails_the_launch_in_time() {
        let (_base, dir) = session_dir();
        let err = written_pid(&dir, Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("did not write its pid"), "{err}");
    }
}
