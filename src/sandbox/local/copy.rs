//! Forking a kernel with a workspace of its own (issue 36): a copy of the kernel in a
//! sandbox of its own, with a copy of the workspace, made with CRIU (`docs/CRIU.md`).
//!
//! A `fork()` cannot do it: the child shares its parent's mount namespace, so it would see
//! the parent's `/home/user`, and a kernel can never change namespaces. So:
//!
//! 1. **Prepare** (the parent idle: the actor waits for this): the fork's own workspace is
//!    made and the parent's `home` and `tmp` copied into it by `cp -a` as the kernel's uid,
//!    in namespaces of its own that show nothing of the host but `/usr`
//!    ([`super::bwrap::copy_args`]); the copy's directory is made, root's, in
//!    `<data_dir>/copies`, where no kernel can reach.
//! 2. The kernel is asked for a **held** child (`kb_fork_request {"hold": ...}`,
//!    `kernels/kernel_broker_fork.py`): its files separated, every descriptor that is not a
//!    regular file closed, waiting for a signal.
//! 3. **Dump**: the pid it reports is checked as a fork's is ([`find_fork`]), and CRIU dumps
//!    that process into the copy's directory, run inside the sandbox's namespaces
//!    (`nsenter`) as the kernel's uid with only `CAP_CHECKPOINT_RESTORE` and
//!    `CAP_SYS_ADMIN` (the latter is what reading a process's seccomp filter asks;
//!    `no_new_privs`, nothing else in its bounding set). The held child ends with the dump.
//!    The images are then made root's and read-only (each a regular file with one link),
//!    so nothing but this dump's output is restored.
//! 4. **Restore**: the fork's sandbox is launched as any kernel's (its own workspace, its
//!    leaf and limits), its command CRIU restoring the images as the kernel's uid with only
//!    `CAP_CHECKPOINT_RESTORE` and `CAP_SETPCAP` and no syscall filter (CRIU puts the
//!    kernel's own back on it). Never as root: files are reopened with the kernel's rights,
//!    so a symlink a tenant put where its file was gives nothing (`docs/CRIU.md`).
//! 5. **Wake**: once CRIU says the tasks are resumed, the restored process (CRIU's child,
//!    of the kernel's uid) is sent the wake signal; it reads the new sandbox's connection
//!    file and builds its kernel there. The copy's directory is removed.
//!
//! Whatever fails, nothing of the fork is left: not its sandbox, its workspace or its
//! images. What is not carried: what a fork does not carry, and also sockets, pipes and
//! the kernel's own output (descriptors 0-2 are `/dev/null` in the copy).

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::timeout;

use super::bwrap::{copy_args, HostRoot};
use super::files::endpoints_for;
use super::host::find_program;
use super::process::{inherit_fd, SandboxCommand, StartOptions};
use super::reaper::sandbox_command_pid;
use super::{LocalSandbox, CONNECTION_FILE_INSIDE};
use crate::sandbox::fork::{find_fork, ForkError, ForkOrigin, PreparedFork};
use crate::sandbox::fsutil::{self, io_err};
use crate::sandbox::procfs::{child_with_namespace_pid, uids_of};
use crate::sandbox::{pidfd, LaunchSpec, Launched};

/// What wakes a held child (`WAKE_SIGNAL` in `kernels/kernel_broker_fork.py`: SIGRTMIN+6
/// with glibc).
const WAKE_SIGNAL: i32 = 40;
/// How long a workspace copy, a dump or a restore may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
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
pub(super) struct CopyTools {
    criu: PathBuf,
    nsenter: PathBuf,
}

/// CRIU (`configured`, else the first of [`CRIU_PLACES`] that is 4.0 or later) and
/// `nsenter`; or why a copy cannot be made here. Blocking (runs `criu --version`).
pub(super) fn find_tools(configured: Option<&Path>) -> Result<CopyTools, String> {
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
        let found = match seen.is_empty() {
            true => "none was found".to_string(),
            false => format!("found {}", seen.join(", ")),
        };
        format!(
            "copying a kernel into a sandbox of its own needs CRIU {MIN_CRIU_MAJOR}.0 or later \
             ({found}); `scripts/setup` installs CRIU 4.1.1, or name one with --criu"
        )
    })?;
    let nsenter = find_program("nsenter").ok_or("nsenter (util-linux) is not installed")?;
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
fn copy_failed(why: impl Into<String>) -> ForkError {
    ForkError::Copy(why.into())
}

impl LocalSandbox {
    /// The tools a copy needs, or why it cannot be made (the answer is kept).
    async fn copy_tools(&self) -> Result<CopyTools, ForkError> {
        let configured = self.cfg.criu.clone();
        let found = self
            .copy_tools
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || find_tools(configured.as_deref()))
                    .await
                    .unwrap_or_else(|e| Err(format!("looking for CRIU failed: {e}")))
            })
            .await;
        found.clone().map_err(ForkError::Unsupported)
    }

    /// Step 1: the fork's workspace, a copy of the parent's, and the copy's directory.
    pub(super) async fn prepare_copy(
        &self,
        origin: ForkOrigin,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        self.copy_tools().await?;
        let user = spec.user.clone();
        let ids = self.kernel_ids(&user)?.ok_or_else(|| {
            ForkError::Unsupported(
                "a fork of a session with a workspace of its own is a copy of its kernel \
                 made with CRIU, which the broker does only as root"
                    .into(),
            )
        })?;
        let (Some(from), Some(to)) = (origin.own_workspace, spec.own_workspace) else {
            return Err(ForkError::Unsupported(
                "a copy needs a workspace of its own on both sides".into(),
            ));
        };
        if from == to {
            return Err(ForkError::Unsupported(
                "a copy gets a workspace of its own, not its original's".into(),
            ));
        }
        let dir = self.copies_dir().join(spec.session_id.to_string());
        let endpoints = endpoints_for(&self.run_base.join(spec.session_id.to_string()))
            .map_err(|e| fsutil::launch_failed(&user, e))?;
        let (own, copies, made) = (self.own_workspaces.clone(), self.copies_dir(), dir.clone());
        let (bwrap, opts) = (self.bwrap.clone(), self.bwrap_opts.clone());
        let host = HostRoot::probe(&[]);
        let quota = user.limits.workspace_quota_bytes;
        let started = Instant::now();
        let copied = tokio::task::spawn_blocking(move || -> Result<(), ForkError> {
            let to_dirs = own.prepare(to, quota, Some(ids))?;
            fsutil::create_private_dir(&copies, Some(0o700))?;
            let parent = fsutil::open_tree_root(&copies)
                .map_err(io_err("cannot open the copies' directory", &copies))?;
            let name = made.file_name().map(PathBuf::from).unwrap_or_default();
            fsutil::make_dir_at(parent.as_fd(), &name, 0o700, Some(ids))
                .map_err(io_err("cannot create the copy's directory", &made))?;
            let args = copy_args(&opts, &host, &own.dirs(from), &to_dirs, ids)
                .ok_or_else(|| copy_failed("setpriv is missing"))?;
            copy_workspace(&bwrap, &args)
        })
        .await
        .unwrap_or_else(|e| Err(copy_failed(format!("the copy task failed: {e}"))));
        if let Err(e) = copied {
            self.give_up_copy(&user, to, dir).await;
            return Err(e);
        }
        tracing::debug!(session = %spec.session_id, ms = started.elapsed().as_millis() as u64, "workspace copied for a fork");
        Ok(PreparedFork::held(
            origin,
            spec,
            dir,
            CONNECTION_FILE_INSIDE,
            endpoints,
        ))
    }

    /// Steps 3 to 5 for the held child `pid` the kernel reported.
    pub(super) async fn adopt_copy(
        &self,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<Launched, ForkError> {
        let PreparedFork {
            origin, spec, dir, ..
        } = prepared;
        let user = spec.user.clone();
        let key = spec.own_workspace;
        let made = self.dump_and_restore(origin, spec, &dir, pid).await;
        fsutil::remove_dir_logged(dir).await;
        if made.is_err() {
            if let Some(key) = key {
                self.remove_own(&user, key).await;
            }
        }
        made
    }

    async fn dump_and_restore(
        &self,
        origin: ForkOrigin,
        spec: LaunchSpec,
        dir: &Path,
        pid: i64,
    ) -> Result<Launched, ForkError> {
        let tools = self.copy_tools().await?;
        let cgroups = self.startup().await?;
        let ids = self.kernel_ids(&spec.user)?.unwrap_or_default();
        let (host, held) =
            find_fork(&origin, pid).map_err(|why| ForkError::NotItsChild { pid, why })?;
        let images = fsutil::open_tree_root(dir)
            .map_err(|e| copy_failed(format!("cannot open the copy's directory: {e}")))?;
        let criu = std::fs::File::open(&tools.criu)
            .map_err(|e| copy_failed(format!("cannot open {}: {e}", tools.criu.display())))?;
        let started = Instant::now();
        dump(&tools, host, pid, ids, &criu, &images).await?;
        drop(held);
        let dumped = started.elapsed();
        let sealed = images.try_clone().map_err(|e| copy_failed(e.to_string()))?;
        tokio::task::spawn_blocking(move || seal(sealed))
            .await
            .map_err(|e| copy_failed(format!("the seal task failed: {e}")))?
            .map_err(|e| copy_failed(format!("the dump's images are not as made: {e}")))?;

        // The restore: CRIU as the new sandbox's command, logging into a pipe read here.
        let (log_read, log_write) =
            io::pipe().map_err(|e| copy_failed(format!("cannot create a pipe: {e}")))?;
        // CRIU opens its log by path (`/proc/self/fd/N`), as the kernel's uid.
        rustix::fs::fchown(
            &log_write,
            Some(rustix::fs::Uid::from_raw(ids.0)),
            Some(rustix::fs::Gid::from_raw(ids.1)),
        )
        .map_err(|e| copy_failed(format!("cannot give CRIU its log: {e}")))?;
        let fd = |f: RawFd| format!("/proc/self/fd/{f}");
        let argv = vec![
            fd(criu.as_raw_fd()),
            "restore".into(),
            "--unprivileged".into(),
            "--shell-job".into(),
            "--manage-cgroups=ignore".into(),
            "-D".into(),
            fd(images.as_raw_fd()),
            "-o".into(),
            fd(log_write.as_raw_fd()),
            "-v3".into(),
        ];
        let command = SandboxCommand {
            argv,
            env: Default::default(),
            resource_dir: None,
        };
        let options = StartOptions {
            boot_script: false,
            control: false,
            restore: Some(vec![
                criu.as_raw_fd(),
                images.as_raw_fd(),
                log_write.as_raw_fd(),
            ]),
        };
        let session = spec.session_id;
        let started_restore = Instant::now();
        let sandbox = self.start_sandbox(spec, command, cgroups, options).await?;
        drop(log_write);
        drop(criu);
        let restored = match timeout(STEP_TIMEOUT, restore_result(log_read)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(copy_failed(format!("CRIU could not restore it: {why}"))),
            Err(_) => Err(copy_failed(format!(
                "CRIU did not restore it within {} s",
                STEP_TIMEOUT.as_secs()
            ))),
        };
        let woken = restored.and_then(|()| {
            let init = sandbox.kernel.init_pid.get().copied();
            let woken = wake(init, pid, ids.0)?;
            let _ = sandbox.kernel.restored_pid.set(woken);
            Ok(woken)
        });
        match woken {
            Ok(host_pid) => {
                tracing::info!(%session, pid = host_pid, dump_ms = dumped.as_millis() as u64, restore_ms = started_restore.elapsed().as_millis() as u64, "kernel copied into a sandbox of its own");
                Ok(sandbox.launched)
            }
            Err(e) => {
                sandbox.launched.process.terminate().await;
                Err(e)
            }
        }
    }

    /// A prepared copy given up: its directory and the fork's workspace go.
    pub(super) async fn discard_copy(&self, prepared: PreparedFork) {
        if let Some(key) = prepared.spec.own_workspace {
            self.give_up_copy(&prepared.spec.user, key, prepared.dir)
                .await;
        }
    }

    async fn give_up_copy(
        &self,
        user: &crate::sandbox::SandboxUser,
        key: uuid::Uuid,
        dir: PathBuf,
    ) {
        fsutil::remove_dir_logged(dir).await;
        self.remove_own(user, key).await;
    }

    /// `<data_dir>/copies`: root's, 0700; the copies' directories in it.
    fn copies_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("copies")
    }

    /// At startup: what an earlier run left of copies (it stopped mid-copy) goes; the
    /// images hold a kernel's memory. Blocking.
    pub(super) fn sweep_copies(&self) {
        let dir = self.copies_dir();
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                tracing::info!(path = %dir.display(), "removed the copies an earlier run left")
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %dir.display(), error = %e, "cannot remove the copies an earlier run left")
            }
        }
    }
}

/// Runs the workspace copy (`args`: [`copy_args`]); blocking.
fn copy_workspace(bwrap: &Path, args: &[OsString]) -> Result<(), ForkError> {
    let mut child = std::process::Command::new(bwrap)
        .args(args)
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| copy_failed(format!("cannot start the workspace copy: {e}")))?;
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                let mut err = String::new();
                if let Some(mut stderr) = child.stderr.take() {
                    use std::io::Read;
                    let _ = (&mut stderr).take(2048).read_to_string(&mut err);
                }
                return Err(copy_failed(format!(
                    "the workspace could not be copied ({status}): {}",
                    err.trim()
                )));
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(copy_failed(format!(
                    "the workspace copy took more than {} s",
                    STEP_TIMEOUT.as_secs()
                )));
            }
        }
    }
}

/// CRIU dumps the held child (`pid` inside, `host` on the host) into `images`, run in the
/// sandbox's namespaces as the kernel's uid with the two capabilities a dump needs.
async fn dump(
    tools: &CopyTools,
    host: i32,
    pid: i64,
    ids: (u32, u32),
    criu: &std::fs::File,
    images: &OwnedFd,
) -> Result<(), ForkError> {
    let fd = |f: RawFd| format!("/proc/self/fd/{f}");
    let mut cmd = tokio::process::Command::new(&tools.nsenter);
    cmd.arg(format!("--target={host}"))
        .arg("--all")
        .arg("--")
        .arg("setpriv")
        .arg(format!("--reuid={}", ids.0))
        .arg(format!("--regid={}", ids.1))
        .args([
            "--clear-groups",
            "--inh-caps=-all,+checkpoint_restore,+sys_admin",
            "--ambient-caps=+checkpoint_restore,+sys_admin",
            "--bounding-set=-all,+checkpoint_restore,+sys_admin",
            "--no-new-privs",
            "--",
        ])
        .arg(fd(criu.as_raw_fd()))
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
    let inherited = [criu.as_raw_fd(), images.as_raw_fd()];
    // SAFETY: the closure runs between fork and exec and calls only fcntl (async-signal-safe)
    // on descriptors numbered before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for fd in inherited {
                inherit_fd(fd)?;
            }
            Ok(())
        });
    }
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
fn seal(dir: OwnedFd) -> io::Result<()> {
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
/// errors).
async fn restore_result(log: io::PipeReader) -> Result<(), String> {
    let log = tokio::fs::File::from_std(std::fs::File::from(OwnedFd::from(log)));
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

/// Wakes the restored process: CRIU's child in the new sandbox (whose init is `init`) with
/// pid `pid` there, of uid `uid`. Returns its host pid.
fn wake(init: Option<i32>, pid: i64, uid: u32) -> Result<i32, ForkError> {
    let lost = |why: &str| copy_failed(format!("the restored kernel cannot be woken: {why}"));
    let criu = init
        .and_then(sandbox_command_pid)
        .ok_or_else(|| lost("its sandbox has no command"))?;
    let inner = i32::try_from(pid).map_err(|_| lost("not a pid"))?;
    let host = child_with_namespace_pid(criu, inner).ok_or_else(|| lost("it is not running"))?;
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
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

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
