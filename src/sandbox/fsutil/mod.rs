//! Host-side file system helpers both sandbox backends share, and the error constructors
//! they use. `descriptors.rs` holds the descriptor-based operations root uses in
//! kernel-writable directories; `connection.rs` the kernel's sockets and connection file.
//!
//! This module owns the parts of a backend's host directories that do not depend on how the
//! kernel is isolated: the broker's private state directories (created, checked to be the
//! broker's own, swept on startup), the choice of a runtime base short enough for unix
//! socket paths, a user's workspace and who owns it, files created exactly once, and the
//! kernel's `ipc://` socket layout and connection file. [`super::local`] and
//! [`super::docker`] call these with their own names, limits and owners; what differs
//! between them is a parameter here, so each keeps its behaviour exactly.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{LaunchRefusal, SandboxError, SandboxUser, StepFailed};

mod connection;
mod descriptors;

pub(crate) use connection::*;
pub(crate) use descriptors::*;

/// The backend cannot work here; `reason` tells the operator what to do.
pub(crate) fn unavailable(backend: &'static str, reason: impl Into<String>) -> SandboxError {
    SandboxError::Unavailable {
        backend,
        reason: reason.into(),
        source: None,
    }
}

/// [`unavailable`] because of `source`, kept as the error's source.
pub(crate) fn unavailable_by(
    backend: &'static str,
    reason: impl Into<String>,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> SandboxError {
    SandboxError::Unavailable {
        backend,
        reason: reason.into(),
        source: Some(source.into()),
    }
}

/// A launch for `user` was ruled out.
pub(crate) fn launch_err(user: &SandboxUser, reason: LaunchRefusal) -> SandboxError {
    SandboxError::Launch {
        user: user.name.clone(),
        reason,
    }
}

/// A launch step for `user` failed: `step` says which, its error is kept as the source.
pub(crate) fn launch_step(
    user: &SandboxUser,
    step: impl Into<std::borrow::Cow<'static, str>>,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> SandboxError {
    launch_failed(
        user,
        StepFailed {
            step: step.into(),
            source: source.into(),
        },
    )
}

/// [`SandboxError::LaunchFailed`] for `user`, keeping the step's error as the source.
pub(crate) fn launch_failed(
    user: &SandboxUser,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> SandboxError {
    SandboxError::LaunchFailed {
        user: user.name.clone(),
        source: source.into(),
    }
}

/// Wraps an I/O error as [`SandboxError::Io`] saying what failed where (for `map_err`).
pub(crate) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SandboxError {
    let path = path.to_path_buf();
    move |source| SandboxError::Io { what, path, source }
}

/// The broker's effective uid and gid.
pub(crate) fn current_ids() -> (u32, u32) {
    (
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    )
}

/// `path` made absolute against the current directory (not resolving symlinks).
pub(crate) fn absolute(path: &Path) -> Result<PathBuf, SandboxError> {
    std::path::absolute(path).map_err(io_err("cannot make the path absolute", path))
}

/// Short hash of a data directory: tells brokers on one host (and their containers and
/// fallback runtime directories) apart.
pub(crate) fn data_dir_hash(data_dir: &Path) -> String {
    hex::encode(&Sha256::digest(data_dir.as_os_str().as_encoded_bytes())[..4])
}

/// Creates `dir` (and parents) if missing; with `mode`, also makes sure it is a real
/// directory owned by the broker with that mode (it may live in a shared place like /tmp).
pub(crate) fn create_private_dir(dir: &Path, mode: Option<u32>) -> Result<(), SandboxError> {
    let err = |what: &'static str| io_err(what, dir);
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    if let Some(mode) = mode {
        builder.mode(mode);
    }
    builder
        .create(dir)
        .map_err(err("cannot create directory"))?;
    let Some(mode) = mode else { return Ok(()) };
    let meta = std::fs::symlink_metadata(dir).map_err(err("cannot inspect directory"))?;
    let (euid, _) = current_ids();
    if !meta.is_dir() || meta.uid() != euid {
        return Err(SandboxError::Io {
            what: "refusing to use a directory not owned by the broker",
            path: dir.to_path_buf(),
            source: io::Error::from(io::ErrorKind::PermissionDenied),
        });
    }
    if meta.mode() & 0o7777 != mode {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(err("cannot set the directory's permissions"))?;
    }
    Ok(())
}

/// The startup work on the host, once per broker: creates the data directory, and the
/// workspaces directory and the runtime base as private (0700) directories; then `sweep`
/// removes what an earlier run left in the runtime base (it returns how many it removed).
/// Runs off the async runtime.
pub(crate) async fn prepare_state_dirs(
    backend: &'static str,
    data_dir: &Path,
    workspaces: &Path,
    run_base: &Path,
    sweep: impl FnOnce(&Path) -> Result<usize, SandboxError> + Send + 'static,
) -> Result<(), SandboxError> {
    let dirs = [
        (data_dir.to_path_buf(), None),
        (workspaces.to_path_buf(), Some(0o700)),
        (run_base.to_path_buf(), Some(0o700)),
    ];
    let base = run_base.to_path_buf();
    let swept = tokio::task::spawn_blocking(move || {
        for (dir, mode) in &dirs {
            create_private_dir(dir, *mode)?;
        }
        sweep(&base)
    })
    .await
    .map_err(|e| unavailable_by(backend, format!("startup task failed: {e}"), e))??;
    if swept > 0 {
        tracing::info!(count = swept, dir = %run_base.display(), "removed runtime directories left by an earlier run");
    }
    Ok(())
}

/// How a backend lays out its runtime base, for [`choose_run_base`].
pub(crate) struct RunBaseLayout<'a> {
    pub backend: &'static str,
    pub data_dir: &'a Path,
    /// The configured `run_dir`: used if short enough, refused otherwise.
    pub run_dir: Option<&'a Path>,
    /// The default base's name inside `data_dir` (`run`).
    pub default_name: &'static str,
    /// The fallback bases' name (`kernel-broker`): `/run/<name>-<hash>` as root, else
    /// `$XDG_RUNTIME_DIR/<name>-<hash>` or `/tmp/<name>-<euid>-<hash>`.
    pub fallback_name: &'static str,
    /// Bytes the longest socket path adds to the base (`/<uuid>/k-5`: 41).
    pub room: usize,
    /// Socket paths must be shorter than this.
    pub max_socket_path: usize,
}

/// Picks the runtime base directory: the configured one, else the default inside the data
/// directory, else (when socket paths there would be too long) the first short enough
/// fallback. `hash` (of the data directory) tells several brokers' fallbacks apart.
pub(crate) fn choose_run_base(
    layout: &RunBaseLayout<'_>,
    hash: &str,
    privileged: bool,
    euid: u32,
) -> Result<PathBuf, SandboxError> {
    let RunBaseLayout {
        backend,
        data_dir,
        run_dir,
        default_name,
        fallback_name,
        room,
        max_socket_path,
    } = *layout;
    let fits = |base: &Path| {
        base.to_str()
            .is_some_and(|b| b.len() + room < max_socket_path)
    };
    if let Some(dir) = run_dir {
        return if fits(dir) {
            Ok(dir.to_path_buf())
        } else {
            Err(unavailable(
                backend,
                format!(
                    "run_dir {} is too long (or not UTF-8) for the kernels' socket paths; \
                     use a path of at most {} bytes",
                    dir.display(),
                    max_socket_path - room - 1
                ),
            ))
        };
    }
    let default = data_dir.join(default_name);
    if fits(&default) {
        return Ok(default);
    }
    let mut candidates = Vec::new();
    if privileged {
        candidates.push(PathBuf::from(format!("/run/{fallback_name}-{hash}")));
    } else {
        if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR") {
            candidates.push(PathBuf::from(xdg).join(format!("{fallback_name}-{hash}")));
        }
        candidates.push(PathBuf::from(format!("/tmp/{fallback_name}-{euid}-{hash}")));
    }
    let chosen = candidates.into_iter().find(|c| fits(c)).ok_or_else(|| {
        unavailable(
            backend,
            "no short enough directory for the kernels' sockets; set run_dir",
        )
    })?;
    tracing::info!(
        data_dir = %data_dir.display(),
        run_dir = %chosen.display(),
        "socket paths under the data directory would be too long; using a shorter runtime directory"
    );
    Ok(chosen)
}

/// Removes a runtime directory off the async runtime; a missing one is fine, failures are
/// logged.
pub(crate) async fn remove_dir_logged(dir: PathBuf) {
    let result = tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err((dir, e)),
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err((dir, e))) => {
            tracing::warn!(path = %dir.display(), error = %e, "cannot remove the runtime directory");
        }
        Err(e) => tracing::warn!(error = %e, "removing a runtime directory failed"),
    }
}

/// `name` in `$PATH`, then in `/usr/bin` and `/usr/sbin`.
pub(crate) fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}
