//! The host files of one launch: the runtime directory (connection file, the sandbox's
//! `/etc/passwd`, `group` and `hosts`), the workspace, and the runtime base they live in;
//! and the guard that removes them if a launch fails before its reaper owns them.
//!
//! `/proc/self/mountinfo` shows where each bind came from on the host, so as root the
//! runtime directories live under `/run`, not in the data directory (see
//! [`LocalSandboxConfig::run_dir`]).

use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use uuid::Uuid;

use super::python::{PYVENV_CFG, PYVENV_CFG_NAME};
use super::{LocalSandboxConfig, BACKEND, CONNECTION_FILE_INSIDE, HOSTNAME, IPC_BASE_INSIDE};
use crate::sandbox::cgroup::{Cgroups, Leaf};
use crate::sandbox::fsutil::{
    self, current_ids, io_err, write_new_file_at, FileMode, SocketPathError,
};
use crate::sandbox::workspace_fs::WorkspaceImages;
use crate::sandbox::workspace_fs::{prepare_workspace, WorkspaceOwner};
use crate::sandbox::{KernelEndpoints, LaunchSpec, SandboxError};

/// Longest socket path we create; `sun_path` holds 108 bytes including the NUL, and some
/// libraries are stricter.
const MAX_SOCKET_PATH: usize = 100;

/// Removes a launch's runtime directory and cgroup leaf if the launch does not get as far
/// as handing them to its reaper (an error, or the launch future dropped). Nothing runs in
/// them yet, so plain `rmdir`s do; they are quick enough for `drop`.
pub(super) struct LaunchGuard {
    pub rundir: Option<PathBuf>,
    pub leaf: Option<(Arc<Cgroups>, Leaf)>,
}

impl LaunchGuard {
    /// The leaf and its cgroups, for the reaper that owns them (and the runtime directory)
    /// from now on: the guard removes nothing any more.
    pub fn disarm(&mut self) -> (Option<Arc<Cgroups>>, Option<Leaf>) {
        self.rundir = None;
        self.leaf
            .take()
            .map_or((None, None), |(c, l)| (Some(c), Some(l)))
    }
}

impl Drop for LaunchGuard {
    fn drop(&mut self) {
        if let Some((cgroups, leaf)) = self.leaf.take() {
            for dir in leaf.dirs() {
                if let Err(e) = std::fs::remove_dir(dir) {
                    tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove the cgroup of a failed launch");
                }
            }
            if let Some(user) = leaf
                .dirs()
                .first()
                .and_then(|d| d.parent())
                .and_then(|p| p.file_name())
                .and_then(|n| n.to_str())
            {
                cgroups.remove_user_if_unused(user);
            }
        }
        if let Some(dir) = self.rundir.take() {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!(path = %dir.display(), error = %e, "cannot remove the runtime directory of a failed launch");
            }
        }
    }
}

/// The files a launch writes on the host before bwrap starts.
pub(super) struct LaunchFiles {
    pub workspace: PathBuf,
    pub rundir: PathBuf,
    pub ids: Option<(u32, u32)>,
    pub login: String,
    /// The login's home in the sandbox's `/etc/passwd`.
    pub home: &'static str,
    /// The connection file's JSON (`Null`: write none).
    pub connection: serde_json::Value,
    /// The workspace's file system and its size (`None`: a scratch workspace).
    pub quota: Option<(Arc<WorkspaceImages>, u64)>,
}

impl LaunchFiles {
    /// Writes everything; on failure removes the runtime directory if it created it.
    pub fn write(&self) -> Result<(), SandboxError> {
        let err = |what| io_err(what, &self.rundir);
        let (Some(base), Some(name)) = (self.rundir.parent(), self.rundir.file_name()) else {
            return Err(err("the runtime directory has no parent")(
                std::io::ErrorKind::InvalidInput.into(),
            ));
        };
        // Through descriptors (docs/SECURITY.md): the directory is made in the broker's
        // runtime base, given to the kernel's uid through its descriptor, and every file is
        // created in that descriptor, never by a path looked up again.
        let base = fsutil::open_tree_root(base).map_err(err("cannot open the runtime base"))?;
        let dir = fsutil::make_dir_at(base.as_fd(), Path::new(name), 0o700, self.ids)
            .map_err(err("cannot create the runtime directory"))?;
        let result = self.write_in_rundir(dir.as_fd());
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&self.rundir);
        }
        result
    }

    fn write_in_rundir(&self, dir: BorrowedFd<'_>) -> Result<(), SandboxError> {
        // After the runtime directory: `check` puts its scratch workspace inside it.
        let quota = self.quota.as_ref().map(|(fs, bytes)| (&**fs, *bytes));
        prepare_workspace(&self.workspace, workspace_owner(self.ids), quota)?;
        let (uid, gid) = self.ids.unwrap_or_else(current_ids);
        let (login, home) = (&self.login, self.home);
        let passwd = format!(
            "root:x:0:0:root:/root:/usr/sbin/nologin\n\
             {login}:x:{uid}:{gid}:{login}:{home}:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        );
        let group = format!("root:x:0:\n{login}:x:{gid}:\nnogroup:x:65534:\n");
        let hosts =
            format!("127.0.0.1 localhost\n::1 localhost ip6-localhost\n127.0.1.1 {HOSTNAME}\n");
        let pyvenv = PYVENV_CFG.to_string();
        for (name, text) in [
            ("passwd", passwd),
            ("group", group),
            ("hosts", hosts),
            (PYVENV_CFG_NAME, pyvenv),
        ] {
            write_new_file_at(
                dir,
                Path::new(name),
                text.as_bytes(),
                FileMode::Masked(0o644),
                None,
            )
            .map_err(io_err(
                "cannot write a sandbox /etc file",
                &self.rundir.join(name),
            ))?;
        }
        if !self.connection.is_null() {
            fsutil::write_connection_file(
                dir,
                &self.rundir,
                &self.connection,
                FileMode::Masked(0o600),
                self.ids,
            )?;
        }
        Ok(())
    }
}

/// The connection file the kernel reads (`ipc` transport; sockets `/run/kernel/k-<port>`).
pub(super) fn connection_file(spec: &LaunchSpec) -> serde_json::Value {
    fsutil::connection_file(spec, IPC_BASE_INSIDE)
}

/// The host-side endpoints for a runtime directory; fails if a socket path would be too long.
pub(super) fn endpoints_for(rundir: &Path) -> Result<KernelEndpoints, SocketPathError> {
    fsutil::ipc_endpoints(rundir, MAX_SOCKET_PATH, "configure a shorter run_dir")
}

/// Picks the runtime base directory (see [`LocalSandboxConfig::run_dir`]).
pub(super) fn choose_run_base(
    cfg: &LocalSandboxConfig,
    privileged: bool,
    euid: u32,
) -> Result<PathBuf, SandboxError> {
    // Several brokers may share a fallback on one host: tell them apart by their data
    // directory.
    let hash = fsutil::data_dir_hash(&cfg.data_dir);
    // A bind mount's source shows in the sandbox's mountinfo (the `root` field: the path
    // inside its file system), and /proc cannot be masked per process; a runtime directory
    // outside the data directory keeps that path from pointing at the workspaces. Root only:
    // /run is root's.
    let preferred = (privileged && cfg.run_dir.is_none())
        .then(|| PathBuf::from(format!("/run/kernel-broker-{hash}")));
    let layout = fsutil::RunBaseLayout {
        backend: BACKEND,
        data_dir: &cfg.data_dir,
        run_dir: cfg.run_dir.as_deref().or(preferred.as_deref()),
        default_name: "run",
        fallback_name: "kernel-broker",
        // `/<uuid>/k-5`
        room: 1 + 36 + 4,
        max_socket_path: MAX_SOCKET_PATH,
    };
    fsutil::choose_run_base(&layout, &hash, privileged, euid)
}

/// Removes the runtime directories an earlier run left in `run_base` (named by session id,
/// or `check-...`), but those of the sessions in `keep` (kept kernels, `--keep-sessions`).
pub(super) fn sweep_run_base(
    run_base: &Path,
    keep: &std::collections::HashSet<Uuid>,
) -> Result<usize, SandboxError> {
    let entries = std::fs::read_dir(run_base).map_err(|source| SandboxError::Io {
        what: "cannot list the runtime directory",
        path: run_base.to_path_buf(),
        source,
    })?;
    let mut removed = 0;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if Uuid::parse_str(name).is_ok_and(|id| keep.contains(&id)) {
            continue;
        }
        let ours = Uuid::parse_str(name).is_ok()
            || name
                .strip_prefix("check-")
                .is_some_and(|id| Uuid::parse_str(id).is_ok());
        if !ours {
            continue;
        }
        match std::fs::remove_dir_all(entry.path()) {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(path = %entry.path().display(), error = %e, "cannot remove a stale runtime directory")
            }
        }
    }
    Ok(removed)
}

/// A user name as a login name in the sandbox's /etc/passwd.
pub(super) fn login_name(user: &str) -> String {
    let name: String = user
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "kernel".to_string()
    } else {
        name
    }
}

pub(super) fn is_safe_component(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

/// Who owns a workspace: the kernel's uid as root, else the broker.
pub(super) fn workspace_owner(ids: Option<(u32, u32)>) -> WorkspaceOwner {
    ids.map_or(WorkspaceOwner::Broker, |(uid, gid)| {
        WorkspaceOwner::Kernel { uid, gid }
    })
}

impl super::LocalSandbox {
    /// Replaces `python`/`python3` as the program and `{python}`, `{prefix}` (the kernels'
    /// environment), `{connection_file}` and `{resource_dir}` anywhere.
    pub(super) fn substitute_argv(
        &self,
        argv: &[String],
        resource_dir: Option<&Path>,
    ) -> Vec<String> {
        let python = self.venv.interpreter_inside(&self.cfg.python);
        let python = python.to_string_lossy();
        let prefix = self.venv.prefix_inside();
        let resource_dir = resource_dir.map(|d| d.to_string_lossy());
        crate::sandbox::boot::substitute_argv(
            argv,
            &python,
            &prefix.to_string_lossy(),
            resource_dir.as_deref(),
            CONNECTION_FILE_INSIDE,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_use_ipc_paths_in_the_runtime_directory() {
        let id = Uuid::nil();
        let ep = endpoints_for(&Path::new("/var/lib/kb/run").join(id.to_string())).unwrap();
        assert_eq!(ep.shell, format!("ipc:///var/lib/kb/run/{id}/k-1"));
        assert_eq!(ep.iopub, format!("ipc:///var/lib/kb/run/{id}/k-2"));
        assert_eq!(ep.stdin, format!("ipc:///var/lib/kb/run/{id}/k-3"));
        assert_eq!(ep.control, format!("ipc:///var/lib/kb/run/{id}/k-4"));
        assert_eq!(ep.hb, format!("ipc:///var/lib/kb/run/{id}/k-5"));
        let long = Path::new("/").join("x".repeat(60)).join(id.to_string());
        assert!(endpoints_for(&long)
            .unwrap_err()
            .to_string()
            .contains("too long"));
    }

    #[test]
    fn run_dirs_stay_out_of_the_data_dir_as_root_and_short_unprivileged() {
        let short = LocalSandboxConfig::new("/var/lib/kernel-broker", "/opt/kb/kernels");
        let hash = fsutil::data_dir_hash(Path::new("/var/lib/kernel-broker"));
        assert_eq!(
            choose_run_base(&short, true, 0).unwrap(),
            PathBuf::from(format!("/run/kernel-broker-{hash}"))
        );
        assert_eq!(
            choose_run_base(&short, false, 1000).unwrap(),
            PathBuf::from("/var/lib/kernel-broker/run")
        );
        let long = LocalSandboxConfig::new(format!("/srv/{}", "d".repeat(80)), "/k");
        let base = choose_run_base(&long, true, 0).unwrap();
        assert!(
            base.starts_with("/run") && base.to_str().unwrap().starts_with("/run/kernel-broker-")
        );
        assert!(!choose_run_base(&long, false, 1000)
            .unwrap()
            .starts_with(&long.data_dir));
        let mut explicit = long.clone();
        explicit.run_dir = Some(PathBuf::from(format!("/{}", "r".repeat(70))));
        assert!(choose_run_base(&explicit, true, 0).is_err());
    }

    #[test]
    fn login_names_are_safe_for_passwd() {
        assert_eq!(login_name("alice"), "alice");
        assert_eq!(login_name("a:b\nc"), "a_b_c");
        assert_eq!(login_name(""), "kernel");
    }

    #[test]
    fn connection_file_uses_ipc() {
        let spec = LaunchSpec::example();
        let c = connection_file(&spec);
        assert_eq!(c["transport"], "ipc");
        assert_eq!(c["ip"], "/run/kernel/k");
        assert_eq!(c["hb_port"], 5);
        assert_eq!(c["key"], "abc");
        assert_eq!(c["signature_scheme"], "hmac-sha256");
    }
}
