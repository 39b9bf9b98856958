//! Host-side file system helpers both sandbox backends share, and the error constructors
//! they use.
//!
//! This module owns the parts of a backend's host directories that do not depend on how the
//! kernel is isolated: the broker's private state directories (created, checked to be the
//! broker's own, swept on startup), the choice of a runtime base short enough for unix
//! socket paths, a user's workspace and who owns it, files created exactly once, and the
//! kernel's `ipc://` socket layout and connection file. [`super::local`] and
//! [`super::docker`] call these with their own names, limits and owners; what differs
//! between them is a parameter here, so each keeps its behaviour exactly.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{KernelEndpoints, LaunchSpec, SandboxError, SandboxUser};

/// Ports of the kernel's five channels; their sockets are `k-1` .. `k-5`.
pub(crate) const SHELL_PORT: u16 = 1;
pub(crate) const IOPUB_PORT: u16 = 2;
pub(crate) const STDIN_PORT: u16 = 3;
pub(crate) const CONTROL_PORT: u16 = 4;
pub(crate) const HB_PORT: u16 = 5;

/// The backend cannot work here; `reason` tells the operator what to do.
pub(crate) fn unavailable(backend: &'static str, reason: impl Into<String>) -> SandboxError {
    SandboxError::Unavailable {
        backend,
        reason: reason.into(),
    }
}

/// A launch for `user` failed.
pub(crate) fn launch_err(user: &SandboxUser, reason: impl Into<String>) -> SandboxError {
    SandboxError::Launch {
        user: user.name.clone(),
        reason: reason.into(),
    }
}

/// Wraps an I/O error as [`SandboxError::Io`] saying what failed where (for `map_err`).
pub(crate) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SandboxError {
    let path = path.to_path_buf();
    move |source| SandboxError::Io { what, path, source }
}

/// The broker's effective uid and gid.
pub(crate) fn current_ids() -> (u32, u32) {
    // SAFETY: geteuid(2) and getegid(2) cannot fail and have no preconditions.
    unsafe { (libc::geteuid(), libc::getegid()) }
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
    .map_err(|e| unavailable(backend, format!("startup task failed: {e}")))??;
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

/// How deep [`chown_tree`] goes: one descriptor is open per level, so this also bounds the
/// descriptors a walk holds.
const CHOWN_MAX_DEPTH: usize = 256;

/// `chown -R` through directory descriptors: never follows a symlink, whatever the kernel
/// swaps in while it runs (see [`walk_tree`]). Symlinks and other entries are given away
/// themselves (`AT_SYMLINK_NOFOLLOW`), directories through the descriptor that was walked.
pub(crate) fn chown_tree(dir: &Path, uid: u32, gid: u32) -> io::Result<()> {
    use rustix::fs::{chownat, fchown, AtFlags, Gid, Uid};
    let (owner, group) = (Uid::from_raw(uid), Gid::from_raw(gid));
    let root = open_tree_root(dir)?;
    fchown(&root, Some(owner), Some(group))?;
    let limits = WalkLimits {
        max_entries: usize::MAX,
        max_depth: CHOWN_MAX_DEPTH,
    };
    let complete = walk_tree(&root, limits, |entry| {
        match entry.dir {
            Some(fd) => fchown(fd, Some(owner), Some(group))?,
            None => chownat(
                entry.parent,
                entry.name,
                Some(owner),
                Some(group),
                AtFlags::SYMLINK_NOFOLLOW,
            )?,
        }
        Ok(())
    })?;
    if !complete {
        tracing::warn!(dir = %dir.display(), max_depth = CHOWN_MAX_DEPTH, "workspace deeper than the chown walk goes; deeper entries keep their owner");
    }
    Ok(())
}

/// Opens the root of a tree the broker walks: a directory, not a symlink.
pub(crate) fn open_tree_root(path: &Path) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    Ok(rustix::fs::open(path, flags, Mode::empty())?)
}

/// Opens the directory `name` (one path component) of the open directory `parent`:
/// `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` with `O_DIRECTORY | O_NOFOLLOW`, so a
/// symlink swapped in for the directory fails (`ELOOP`) instead of being followed.
pub(crate) fn open_subdir(parent: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    Ok(rustix::fs::openat2(
        parent,
        name,
        flags,
        Mode::empty(),
        resolve,
    )?)
}

/// `openat2` beneath `root` with no symlinks anywhere on the way (`flags`: `O_*`, with
/// `O_CLOEXEC` added).
pub(crate) fn open_beneath(
    root: &OwnedFd,
    rel: &Path,
    flags: i32,
    mode: u32,
) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let flags = OFlags::from_bits_retain(flags as u32) | OFlags::CLOEXEC;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    Ok(rustix::fs::openat2(
        root,
        rel,
        flags,
        Mode::from_raw_mode(mode),
        resolve,
    )?)
}

/// Bounds of a [`walk_tree`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct WalkLimits {
    /// Entries (of any type) looked at before the walk stops.
    pub max_entries: usize,
    /// Directory levels below the root the walk descends; one descriptor is open per level.
    pub max_depth: usize,
}

/// One entry a [`walk_tree`] visits.
pub(crate) struct WalkEntry<'a> {
    /// Path relative to the root.
    pub rel: &'a Path,
    /// The directory holding the entry, as walked (not as named now).
    pub parent: BorrowedFd<'a>,
    /// The entry's name in `parent`.
    pub name: &'a CStr,
    /// `fstatat(parent, name, AT_SYMLINK_NOFOLLOW)`; for a directory, `fstat` of `dir`.
    pub stat: &'a rustix::fs::Stat,
    /// For a directory: the descriptor the walk opened and descends through.
    pub dir: Option<BorrowedFd<'a>>,
}

impl WalkEntry<'_> {
    /// Whether this is a regular file (not a symlink, fifo, socket or device).
    pub fn is_file(&self) -> bool {
        rustix::fs::FileType::from_raw_mode(self.stat.st_mode) == rustix::fs::FileType::RegularFile
    }
}

/// Walks the tree under the open directory `root` depth-first through directory
/// descriptors, calling `visit` for every entry (not the root itself).
///
/// The tree is written by a kernel that may be hostile and may swap entries while the walk
/// runs, so nothing here resolves a path: entries are read from the directory's own
/// descriptor (getdents), looked at with `fstatat(AT_SYMLINK_NOFOLLOW)` relative to it, and
/// a directory is entered only through [`open_subdir`] relative to its parent's descriptor.
/// A symlink swapped in for a directory makes that open fail and the entry is skipped;
/// symlinks and other special files are visited as themselves, never followed. An entry
/// that vanishes meanwhile is skipped.
///
/// Returns `Ok(true)` when the whole tree was walked, `Ok(false)` when `limits` cut it short.
pub(crate) fn walk_tree(
    root: &OwnedFd,
    limits: WalkLimits,
    mut visit: impl FnMut(&WalkEntry<'_>) -> io::Result<()>,
) -> io::Result<bool> {
    use rustix::fs::{fstat, statat, AtFlags, Dir, FileType};
    use rustix::io::Errno;
    let mut stack: Vec<(PathBuf, Dir)> = vec![(PathBuf::new(), Dir::read_from(root)?)];
    let mut seen = 0usize;
    let mut complete = true;
    loop {
        let depth = stack.len();
        let Some((rel, dir)) = stack.last_mut() else {
            break;
        };
        let Some(entry) = dir.read() else {
            stack.pop();
            continue;
        };
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        seen += 1;
        if seen > limits.max_entries {
            complete = false;
            break;
        }
        let parent = dir.fd()?;
        let child_rel = rel.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
        let stat = match statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
            visit(&WalkEntry {
                rel: &child_rel,
                parent,
                name,
                stat: &stat,
                dir: None,
            })?;
            continue;
        }
        if depth > limits.max_depth {
            complete = false;
            continue;
        }
        let fd = match open_subdir(parent, name) {
            Ok(fd) => fd,
            // Swapped for a symlink or something else, or gone, since the stat: skip.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ELOOP | libc::ENOENT | libc::ENOTDIR | libc::EXDEV)
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        // What was opened may differ from what was stat'ed: describe what is walked.
        let stat = fstat(&fd)?;
        visit(&WalkEntry {
            rel: &child_rel,
            parent,
            name,
            stat: &stat,
            dir: Some(fd.as_fd()),
        })?;
        let sub = Dir::new(fd)?;
        stack.push((child_rel, sub));
    }
    Ok(complete)
}

/// The permissions [`write_new_file`] gives a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FileMode {
    /// This mode as the process umask narrows it.
    Masked(u32),
    /// Exactly this mode, whatever the umask.
    Exact(u32),
}

/// Creates the file `name` (one component) in the open directory `dir`, writes `contents`
/// and, with `owner`, gives it to that uid and gid through its descriptor.
///
/// `O_CREAT | O_EXCL | O_NOFOLLOW`: whatever a kernel planted under that name (a symlink to
/// a host file, a file of its own) makes this fail instead of being followed or written,
/// and the owner and mode are set on what was opened, never on a path looked up again.
/// This is how root writes into a directory a kernel can write (docs/SECURITY.md).
pub(crate) fn write_new_file_at(
    dir: BorrowedFd<'_>,
    name: &Path,
    contents: &[u8],
    mode: FileMode,
    owner: Option<(u32, u32)>,
) -> io::Result<()> {
    use rustix::fs::{fchmod, fchown, openat, Gid, Mode, OFlags, Uid};
    use std::io::Write;
    let (FileMode::Masked(bits) | FileMode::Exact(bits)) = mode;
    let fd = openat(
        dir,
        one_component(name)?,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(bits),
    )?;
    if let Some((uid, gid)) = owner {
        fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    }
    if let FileMode::Exact(bits) = mode {
        // The umask may have narrowed the mode.
        fchmod(&fd, Mode::from_raw_mode(bits))?;
    }
    std::fs::File::from(fd).write_all(contents)
}

/// Makes the directory `name` (one component) in the open directory `parent` and returns it
/// opened, with `mode` exactly and, with `owner`, given to that uid and gid through the
/// descriptor. What is opened must be the directory this call made: one a kernel swapped
/// in meanwhile (a symlink, or a directory of its own) is refused, so nothing of the kernel's
/// choosing is chowned or written into.
pub(crate) fn make_dir_at(
    parent: BorrowedFd<'_>,
    name: &Path,
    mode: u32,
    owner: Option<(u32, u32)>,
) -> io::Result<OwnedFd> {
    use rustix::fs::{fchmod, fchown, fstat, mkdirat, Gid, Mode, Uid};
    let name = one_component(name)?;
    mkdirat(parent, name, Mode::from_raw_mode(mode))?;
    let cname = std::ffi::CString::new(name.as_os_str().as_bytes())?;
    let dir = open_subdir(parent, &cname)?;
    let (euid, _) = current_ids();
    if fstat(&dir)?.st_uid != euid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} was replaced by a directory the broker did not make",
                name.display()
            ),
        ));
    }
    fchmod(&dir, Mode::from_raw_mode(mode))?;
    if let Some((uid, gid)) = owner {
        fchown(&dir, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    }
    Ok(dir)
}

/// `name` if it is one plain path component (no `/`, not `.` or `..`).
fn one_component(name: &Path) -> io::Result<&Path> {
    let mut parts = name.components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(_)), None) => Ok(name),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not one path component", name.display()),
        )),
    }
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

/// The connection file the kernel reads: `ipc` transport, sockets `<ip>-<port>` (ipykernel
/// binds `ipc://{ip}-{port}`), HMAC-SHA256 with the launch's key.
pub(crate) fn connection_file(spec: &LaunchSpec, ip: &str) -> serde_json::Value {
    serde_json::json!({
        "transport": "ipc",
        "ip": ip,
        "shell_port": SHELL_PORT,
        "iopub_port": IOPUB_PORT,
        "stdin_port": STDIN_PORT,
        "control_port": CONTROL_PORT,
        "hb_port": HB_PORT,
        "key": spec.key,
        "signature_scheme": "hmac-sha256",
        "kernel_name": spec.kernel_name,
    })
}

/// Writes `connection` as `connection.json` (a new file) in the open directory `dir`, which
/// is `path` (for errors).
pub(crate) fn write_connection_file(
    dir: BorrowedFd<'_>,
    path: &Path,
    connection: &serde_json::Value,
    mode: FileMode,
    owner: Option<(u32, u32)>,
) -> Result<(), SandboxError> {
    let path = path.join("connection.json");
    let text = serde_json::to_vec_pretty(connection).map_err(|e| SandboxError::Io {
        what: "cannot encode the connection file",
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    write_new_file_at(dir, Path::new("connection.json"), &text, mode, owner)
        .map_err(io_err("cannot write the connection file", &path))
}

/// The host-side endpoints of the sockets `<rundir>/k-<port>`. Fails if `rundir` is not
/// UTF-8, or with `too_long(<the longest socket path>)` if that path is not shorter than
/// `max_socket_path`.
pub(crate) fn ipc_endpoints(
    rundir: &Path,
    max_socket_path: usize,
    too_long: impl FnOnce(&str) -> String,
) -> Result<KernelEndpoints, String> {
    let dir = rundir
        .to_str()
        .ok_or_else(|| format!("the runtime directory {} is not UTF-8", rundir.display()))?;
    let longest = format!("{dir}/k-{HB_PORT}");
    if longest.len() >= max_socket_path {
        return Err(too_long(&longest));
    }
    let ep = |port: u16| format!("ipc://{dir}/k-{port}");
    Ok(KernelEndpoints {
        shell: ep(SHELL_PORT),
        iopub: ep(IOPUB_PORT),
        stdin: ep(STDIN_PORT),
        control: ep(CONTROL_PORT),
        hb: ep(HB_PORT),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chown_tree_does_not_follow_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/f"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("sub/link")).unwrap();
        let (me, _) = current_ids();
        // As root, give the tree away for real; otherwise chown to ourselves (a no-op that
        // still walks the tree).
        let (uid, gid) = if me == 0 { (4242, 4242) } else { current_ids() };
        chown_tree(dir.path(), uid, gid).unwrap();
        assert_eq!(
            std::fs::symlink_metadata(dir.path().join("sub/f"))
                .unwrap()
                .uid(),
            uid
        );
        assert_eq!(
            std::fs::symlink_metadata(dir.path().join("sub/link"))
                .unwrap()
                .uid(),
            uid
        );
        assert_eq!(std::fs::metadata(outside.path()).unwrap().uid(), me);
    }
}
