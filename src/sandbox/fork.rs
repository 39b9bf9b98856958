//! Forking a live kernel (issue 36): what the session layer and a backend exchange.
//!
//! The kernel forks itself (`kernels/kernel_broker_fork.py`, the `kb_fork_request` shell
//! message) into a new kernel listening on ipc sockets the broker names. The sandbox's part
//! is on both sides of that message: before it, [`Sandbox::prepare_fork`] makes the
//! child's runtime directory (inside the parent's sandbox, by descriptor: the kernel can
//! write there) and the connection the request carries; after it,
//! [`Sandbox::adopt_fork`] takes the pid the kernel reported, which is untrusted: it is
//! used only if it is a direct child of the parent kernel's host process, of the kernel's
//! uid, held through a pidfd and checked again after opening it; the child is then moved
//! into a cgroup leaf of its own with the new session's limits and watched through that
//! pidfd like any kernel. Whatever fails, nothing of the child is left.
//!
//! [`Sandbox::prepare_fork`]: super::Sandbox::prepare_fork
//! [`Sandbox::adopt_fork`]: super::Sandbox::adopt_fork

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use uuid::Uuid;

use super::procfs::{child_with_namespace_pid, namespace_pid, parent_of, uids_of};
use super::{pidfd, LaunchSpec, SandboxError};
use crate::kernel::KernelEndpoints;

/// Where a live kernel can be forked: its host process and the directory its forks' runtime
/// directories go in. Known to the backend that launched the kernel; opaque above.
#[derive(Debug, Clone)]
pub struct ForkOrigin {
    /// The kernel's host pid (the process that forks).
    pub(crate) host_pid: i32,
    /// The uid the kernel runs as on the host (`None`: the broker's own, unprivileged).
    pub(crate) uid: Option<u32>,
    /// The host directory the forks' runtime directories are made in (the kernel's fork
    /// root, `KERNEL_BROKER_FORK_ROOT` inside).
    pub(crate) dir: PathBuf,
    /// The same directory as the kernel sees it.
    pub(crate) inside: String,
    /// The pid namespace a fork must be in (`/proc/<pid>/ns/pid`'s link text); `None`: the
    /// parent kernel's. The Docker backend names its container init's.
    pub(crate) pid_namespace: Option<OsString>,
    /// The backend's own name for the parent kernel (Docker: its entry in the kernel table,
    /// the session it was launched for); `None` where the backend needs none.
    pub(crate) kernel: Option<Uuid>,
    /// The parent kernel's own workspace (a session with a workspace of its own): its forks
    /// are copied into sandboxes of their own with a copy of it (`local/copy.rs`,
    /// `docker/copy.rs`), not
    /// forked beside it. `None`: forks live in the parent's sandbox.
    pub(crate) own_workspace: Option<Uuid>,
}

/// A fork about to be asked for: the connection to put in `kb_fork_request`, and what the
/// backend needs to adopt the child or to clean up.
#[derive(Debug)]
pub struct PreparedFork {
    /// The content of the `kb_fork_request` to send: `{"connection": ...}` (ipc transport,
    /// the child's socket prefix inside the sandbox, ports, the new session's key), or
    /// `{"hold": ...}` for a copy into a sandbox of its own (the child is held until it is
    /// restored there, and reads its connection then).
    pub request: serde_json::Value,
    pub(crate) origin: ForkOrigin,
    pub(crate) spec: LaunchSpec,
    /// The child's runtime directory on the host (removed if the fork is given up).
    pub(crate) dir: PathBuf,
    /// Where the broker reaches the child's sockets (in `dir`): known before the child
    /// exists, so the broker connects while the kernel forks and rebuilds.
    pub endpoints: KernelEndpoints,
    /// A copy's room on the data file system for its images (`criu/room.rs`), held until
    /// the fork is adopted or given up.
    pub(crate) room: Option<super::criu::room::Reserved>,
    /// A pause's (`pause.rs`): its held child is dumped into `dir` and kept there, not
    /// restored; given up, only `dir` goes.
    pub(crate) pause: bool,
    /// A held checkpoint's (`held.rs`): the control socket its child connects to.
    pub(crate) control: Option<super::held::ControlListener>,
}

/// A held checkpoint (`held.rs`): the held child, watched, and the broker's end of its
/// control socket (dropping it ends the checkpoint).
pub struct HeldCheckpoint {
    pub process: Box<dyn super::KernelProcess>,
    pub control: super::held::HeldControl,
}

impl PreparedFork {
    /// The fork of `origin` for `spec`, its runtime directory `dir` made (on the host), its
    /// sockets `ipc://<origin.inside>/<name>/k-<port>` as the child sees them.
    pub(crate) fn new(
        origin: ForkOrigin,
        spec: LaunchSpec,
        dir: PathBuf,
        name: &str,
        endpoints: KernelEndpoints,
    ) -> Self {
        // A launched kernel's connection file, without the kernel name a fork does not read.
        let mut connection =
            super::fsutil::connection_file(&spec, &format!("{}/{name}/k", origin.inside));
        if let Some(fields) = connection.as_object_mut() {
            fields.remove("kernel_name");
        }
        Self {
            request: serde_json::json!({ "connection": connection }),
            origin,
            spec,
            dir,
            endpoints,
            room: None,
            pause: false,
            control: None,
        }
    }

    /// A fork of `origin` into a sandbox of its own for `spec`: the kernel holds its child,
    /// which reads its connection from `connection_file` (inside the new sandbox) once woken
    /// there. `dir` is the broker's directory for the copy (removed if it is given up);
    /// `endpoints` where the new sandbox's kernel will listen; `room` what its images may
    /// take.
    pub(crate) fn held(
        origin: ForkOrigin,
        spec: LaunchSpec,
        dir: PathBuf,
        connection_file: &str,
        endpoints: KernelEndpoints,
        room: super::criu::room::Reserved,
    ) -> Self {
        Self {
            request: serde_json::json!({ "hold": { "connection_file": connection_file } }),
            origin,
            spec,
            dir,
            endpoints,
            room: Some(room),
            pause: false,
            control: None,
        }
    }

    /// A pause of `origin` (`pause.rs`): the kernel holds a child, dumped into `dir` and
    /// kept; once restored it reads its connection from `connection_file` (inside the
    /// sandbox it is resumed in). `room` is what its images may take until they are made.
    pub(crate) fn paused(
        origin: ForkOrigin,
        spec: LaunchSpec,
        dir: PathBuf,
        connection_file: &str,
        endpoints: KernelEndpoints,
        room: super::criu::room::Reserved,
    ) -> Self {
        Self {
            pause: true,
            ..Self::held(origin, spec, dir, connection_file, endpoints, room)
        }
    }
}

/// Why a live kernel was not forked.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// This kernel cannot be forked here; the text says why and what would allow it.
    #[error("{0}")]
    Unsupported(String),
    /// The pid the kernel reported is not a process it forked.
    #[error("the kernel reported pid {pid} for its fork, which is not a child it forked: {why}")]
    NotItsChild { pid: i64, why: &'static str },
    /// The kernel could not be copied into a sandbox of its own (`local/copy.rs`,
    /// `docker/copy.rs`).
    #[error("the kernel could not be copied into a sandbox of its own: {0}")]
    Copy(String),
    /// The data directory's file system has no room for the copy's images
    /// (`criu/room.rs`); nothing was made.
    #[error("the kernel was not copied into a sandbox of its own: {0}")]
    NoRoom(String),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}

/// The pid namespace of host process `pid`, as the link `/proc/<pid>/ns/pid` names it.
pub(crate) fn pid_namespace_of(pid: i32) -> Option<OsString> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(PathBuf::into_os_string)
}

/// The host pid of the parent's child that is `pid` in the kernel's pid namespace, with a
/// pidfd held on it and the checks done again after opening it; or why not. Both backends
/// find a fork so (the pid is the kernel's word, untrusted).
pub(crate) fn find_fork(origin: &ForkOrigin, pid: i64) -> Result<(i32, OwnedFd), &'static str> {
    let inner = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 1)
        .ok_or("not a pid a forked process can have")?;
    let host = child_with_namespace_pid(origin.host_pid, inner)
        .ok_or("no child of the parent kernel has that pid")?;
    let fd = pidfd::open(host).map_err(|_| "it ended before it could be held")?;
    if namespace_pid(host) != Some(inner) || parent_of(host) != Some(origin.host_pid) {
        return Err("it is no longer the parent kernel's child");
    }
    if let Some(uid) = origin.uid {
        if uids_of(host) != Some([uid; 4]) {
            return Err("it does not run as the kernel's uid");
        }
    }
    // In the sandbox's pid namespace (its pid there is the one the kernel named), not one
    // of its own.
    let expected = match &origin.pid_namespace {
        Some(ns) => Some(ns.clone()),
        None => pid_namespace_of(origin.host_pid),
    };
    if expected.is_none() || pid_namespace_of(host) != expected {
        return Err("it is not in the parent kernel's pid namespace");
    }
    // A fresh fork is still in its parent's cgroups; an earlier fork (a session's kernel
    // now, in a leaf of its own) is the parent's child too, and is not taken from its
    // session.
    let cgroups_of = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok();
    if cgroups_of(host).is_none() || cgroups_of(host) != cgroups_of(origin.host_pid) {
        return Err("it is not in the parent kernel's cgroup (an earlier fork's kernel?)");
    }
    Ok((host, fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shell as the parent kernel (single-threaded: its main thread forks, as a kernel's
    /// does), a `sleep` it starts as the fork: `(shell, origin, the sleep's pid)`.
    fn parent_and_fork() -> (std::process::Child, ForkOrigin, i64) {
        use std::io::BufRead;
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(shell.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let origin = ForkOrigin {
            host_pid: shell.id() as i32,
            // SAFETY: getuid has no preconditions.
            uid: Some(unsafe { libc::getuid() }),
            dir: PathBuf::from("/nonexistent"),
            inside: String::new(),
            pid_namespace: None,
            kernel: None,
            own_workspace: None,
        };
        (shell, origin, line.trim().parse().unwrap())
    }

    #[test]
    fn a_fork_is_the_parents_child_in_its_pid_namespace_and_nothing_else() {
        let (mut shell, origin, pid) = parent_and_fork();
        let (host, _fd) = find_fork(&origin, pid).unwrap();
        assert_eq!(i64::from(host), pid);
        // A named pid namespace: the fork must be in it.
        let there = ForkOrigin {
            pid_namespace: pid_namespace_of(std::process::id() as i32),
            ..origin.clone()
        };
        assert!(find_fork(&there, pid).is_ok());
        let elsewhere = ForkOrigin {
            pid_namespace: Some("pid:[1]".into()),
            ..origin.clone()
        };
        assert_eq!(
            find_fork(&elsewhere, pid).unwrap_err(),
            "it is not in the parent kernel's pid namespace"
        );
        // Another uid.
        let other_uid = ForkOrigin {
            uid: origin.uid.map(|u| u.wrapping_add(1)),
            ..origin.clone()
        };
        assert!(find_fork(&other_uid, pid).is_err());
        // Not the parent's child (itself, this process, pid 1); not a pid at all.
        let own = i64::from(std::process::id());
        let parent = i64::from(origin.host_pid);
        for bad in [
            1,
            0,
            -5,
            own,
            parent,
            i64::from(u32::MAX) + 7,
            i64::from(i32::MAX),
        ] {
            assert!(find_fork(&origin, bad).is_err(), "{bad}");
        }
        let not_parent = ForkOrigin {
            host_pid: 1,
            ..origin.clone()
        };
        assert!(find_fork(&not_parent, pid).is_err());
        // The sleep first, while the shell (which reaps it) still holds its pid; the shell
        // then ends by itself.
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        shell.wait().unwrap();
    }
}
