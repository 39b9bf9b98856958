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

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::bwrap::{copy_args, HostRoot};
use super::files::endpoints_for;
use super::keep;
use super::process::{SandboxCommand, StartOptions};
use super::reaper::sandbox_command_pid;
use super::{LocalSandbox, CONNECTION_FILE_INSIDE};
use crate::sandbox::criu::{
    copy_failed, copy_workspace, dump_and_seal, find_tools, log_pipe, restore_result, wake,
    CopyTools, NoCopyTools, Programs,
};
use crate::sandbox::fork::{find_fork, ForkError, ForkOrigin, PreparedFork};
use crate::sandbox::fsutil;
use crate::sandbox::pause::{make_images_dir, ImagesCheck};
use crate::sandbox::procfs::child_with_namespace_pid;
use crate::sandbox::{LaunchSpec, Launched};

impl LocalSandbox {
    /// The tools a copy needs, or why it cannot be made (the answer is kept).
    pub(super) async fn copy_tools(&self) -> Result<CopyTools, ForkError> {
        let configured = self.cfg.criu.clone();
        let found = self
            .copy_tools
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || find_tools(configured.as_deref()))
                    .await
                    .unwrap_or_else(|e| {
                        Err(NoCopyTools::from(format!("looking for CRIU failed: {e}")))
                    })
            })
            .await;
        found
            .clone()
            .map_err(|e| ForkError::Unsupported(e.to_string()))
    }

    /// Step 1: the fork's workspace, a copy of the parent's, and the copy's directory.
    pub(super) async fn prepare_copy(
        &self,
        origin: ForkOrigin,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        self.prepare_copy_in(origin, spec, self.copies_dir()).await
    }

    /// Step 1, the copy's images to go in `<images>/<spec's session id>` (a snapshot's are
    /// kept in `<data_dir>/snapshots`).
    pub(super) async fn prepare_copy_in(
        &self,
        origin: ForkOrigin,
        spec: LaunchSpec,
        images: PathBuf,
    ) -> Result<PreparedFork, ForkError> {
        self.copy_tools().await?;
        let user = spec.user.clone();
        let ids = self.copy_ids(&user)?;
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
        let room = crate::sandbox::criu::reserve_room(
            &self.copy_room,
            &self.cfg.data_dir,
            origin.host_pid,
            self.cfg.copy_reserve_bytes,
        )
        .await?;
        let endpoints = endpoints_for(&self.run_base.join(spec.session_id.to_string()))
            .map_err(|e| fsutil::launch_failed(&user, e))?;
        let started = Instant::now();
        let dir = make_images_dir(images, spec.session_id.to_string(), ids).await?;
        if let Err(e) = self.copy_own(&user, from, to).await {
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
            room,
        ))
    }

    /// The kernel's uid and gid a copy runs as; only as root.
    pub(super) fn copy_ids(
        &self,
        user: &crate::sandbox::SandboxUser,
    ) -> Result<(u32, u32), ForkError> {
        self.kernel_ids(user)?.ok_or_else(|| {
            ForkError::Unsupported(
                "a copy of a kernel into a sandbox of its own (a fork of a session with a \
                 workspace of its own, a snapshot) is made with CRIU, which the broker does \
                 only as root"
                    .into(),
            )
        })
    }

    /// The own workspace `to` made, holding a copy of `from`'s home and `/tmp`: `cp -a` as
    /// the kernel's uid, in namespaces of its own that show nothing of the host but `/usr`.
    pub(super) async fn copy_own(
        &self,
        user: &crate::sandbox::SandboxUser,
        from: uuid::Uuid,
        to: uuid::Uuid,
    ) -> Result<(), ForkError> {
        let ids = self.copy_ids(user)?;
        let own = self.own_workspaces.clone();
        let opts = self.bwrap_opts.clone();
        let quota = user.limits.workspace_quota_bytes;
        let args = tokio::task::spawn_blocking(move || -> Result<_, ForkError> {
            let to_dirs = own.prepare(to, quota, Some(ids))?;
            copy_args(&opts, &HostRoot::probe(&[]), &own.dirs(from), &to_dirs, ids)
                .ok_or_else(|| copy_failed("setpriv is missing"))
        })
        .await
        .unwrap_or_else(|e| Err(copy_failed(format!("the copy task failed: {e}"))))?;
        copy_workspace(&self.bwrap, &args).await
    }

    /// Steps 3 to 5 for the held child `pid` the kernel reported.
    pub(super) async fn adopt_copy(
        &self,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<Launched, ForkError> {
        let PreparedFork {
            origin,
            spec,
            dir,
            room,
            ..
        } = prepared;
        let user = spec.user.clone();
        let key = spec.own_workspace;
        let made = self.dump_and_restore(origin, spec, &dir, pid).await;
        fsutil::remove_dir_logged(dir).await;
        // The images are gone: their room is free again.
        drop(room);
        if made.is_err() {
            if let Some(key) = key {
                self.remove_unused_own(&user, key).await;
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
        let images = self.dump_held(&origin, &spec, dir, pid).await?;
        self.restore_images(spec, &images.0, pid, images.1, None)
            .await
    }

    /// Step 3: the held child `pid` of `origin` (checked as a fork's) dumped into `dir`
    /// and sealed; the images' directory, opened, and how long the dump took.
    pub(super) async fn dump_held(
        &self,
        origin: &ForkOrigin,
        spec: &LaunchSpec,
        dir: &Path,
        pid: i64,
    ) -> Result<(OwnedFd, Duration), ForkError> {
        let tools = self.copy_tools().await?;
        let ids = self.kernel_ids(&spec.user)?.unwrap_or_default();
        let (host, held) =
            find_fork(origin, pid).map_err(|why| ForkError::NotItsChild { pid, why })?;
        let images = fsutil::open_tree_root(dir)
            .map_err(|e| copy_failed(format!("cannot open the copy's directory: {e}")))?;
        let programs = Programs::shown(&tools.criu)
            .map_err(|e| copy_failed(format!("cannot open CRIU: {e}")))?;
        // A kernel sharing its user's workspace is not dumpable (`criu::dump_caps`).
        let non_dumpable = origin.own_workspace.is_none();
        let dumped = dump_and_seal(
            &tools,
            &programs,
            (host, held, pid),
            ids,
            None,
            &images,
            non_dumpable,
        )
        .await?;
        Ok((images, dumped))
    }

    /// Steps 4 and 5: a sandbox for `spec` whose command is CRIU restoring `images` (the
    /// held child `pid` inside), the restored process woken there.
    pub(super) async fn restore_images(
        &self,
        spec: LaunchSpec,
        images: &OwnedFd,
        pid: i64,
        dumped: Duration,
        check: Option<ImagesCheck>,
    ) -> Result<Launched, ForkError> {
        let tools = self.copy_tools().await?;
        let cgroups = self.startup().await?;
        let ids = self.kernel_ids(&spec.user)?.unwrap_or_default();
        let programs = Programs::shown(&tools.criu)
            .map_err(|e| copy_failed(format!("cannot open CRIU: {e}")))?;

        // The restore: CRIU as the new sandbox's command, logging into a pipe read here.
        let (log_read, log_write) = log_pipe(ids)?;
        let fd = |f: RawFd| format!("/proc/self/fd/{f}");
        let mut argv: Vec<String> = programs
            .criu
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        argv.extend([
            "restore".into(),
            "--unprivileged".into(),
            "--shell-job".into(),
            "--manage-cgroups=ignore".into(),
            "-D".into(),
            fd(images.as_raw_fd()),
            "-o".into(),
            fd(log_write.as_raw_fd()),
            "-v3".into(),
        ]);
        let command = SandboxCommand {
            argv,
            env: Default::default(),
            resource_dir: None,
        };
        let options = StartOptions {
            boot_script: false,
            control: false,
            restore: Some(
                programs
                    .fds
                    .iter()
                    .copied()
                    .chain([images.as_raw_fd(), log_write.as_raw_fd()])
                    .collect(),
            ),
        };
        let session = spec.session_id;
        let started_restore = Instant::now();
        let sandbox = self.start_sandbox(spec, command, cgroups, options).await?;
        drop(log_write);
        drop(programs);
        let restored = match check {
            Some(check) => checked_restore(restore_result(log_read), check).await,
            None => restore_result(log_read).await,
        };
        let woken = restored.and_then(|()| {
            // CRIU's child, of the pid it had, in the new sandbox.
            let init = sandbox.kernel.init_pid.get().copied();
            let criu = init.and_then(sandbox_command_pid);
            let inner = i32::try_from(pid).ok();
            let host = criu
                .zip(inner)
                .and_then(|(c, p)| child_with_namespace_pid(c, p));
            let (woken, _) = wake(host, ids.0)?;
            let _ = sandbox.kernel.restored_pid.set(woken);
            Ok(woken)
        });
        // Kept (`--keep-sessions`): the ticket names the restored kernel too, before it is
        // handed over; a kernel that could not be kept is not made.
        let woken = match (woken, self.kept.clone()) {
            (Ok(host_pid), Some(kept)) => keep::mark_restored(&kept, session, host_pid)
                .await
                .map(|()| host_pid)
                .map_err(|e| copy_failed(format!("the restored kernel cannot be kept: {e}"))),
            (woken, _) => woken,
        };
        match woken {
            Ok(host_pid) => {
                tracing::info!(%session, pid = host_pid, dump_ms = dumped.as_millis() as u64, restore_ms = started_restore.elapsed().as_millis() as u64, "kernel restored into a sandbox of its own");
                Ok(sandbox.launched)
            }
            Err(e) => {
                sandbox.launched.process.terminate().await;
                Err(e)
            }
        }
    }

    /// A prepared copy given up: its directory and the fork's workspace go (not a rewind's:
    /// the session's, which its live kernel works in).
    pub(super) async fn discard_copy(&self, prepared: PreparedFork) {
        if let Some(key) = prepared.spec.own_workspace {
            self.give_up_copy(&prepared.spec.user, key, prepared.dir)
                .await;
        }
    }

    pub(super) async fn give_up_copy(
        &self,
        user: &crate::sandbox::SandboxUser,
        key: uuid::Uuid,
        dir: PathBuf,
    ) {
        fsutil::remove_dir_logged(dir).await;
        self.remove_unused_own(user, key).await;
    }

    /// Removes the own workspace `key` a failed copy made, unless a live kernel works in it
    /// (a rewind copies into its session's).
    pub(super) async fn remove_unused_own(
        &self,
        user: &crate::sandbox::SandboxUser,
        key: uuid::Uuid,
    ) {
        if !self.kernels.any(|k| k.own_workspace == Some(key)) {
            self.remove_own(user, key).await;
        }
    }

    /// `<data_dir>/copies`: root's, 0700; the copies' directories in it.
    fn copies_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("copies")
    }

    /// At startup: what an earlier run left of copies (it stopped mid-copy) goes; the
    /// images hold a kernel's memory. Blocking.
    pub(super) fn sweep_copies(&self) {
        crate::sandbox::criu::sweep_copies(&self.copies_dir());
    }
}

/// `restore` (CRIU's, reading images as the kernel's uid) beside `check` of its images:
/// done when both are, failed as soon as either is (CRIU may wait a long time on a
/// damaged image before it gives up); the check's failure is told first.
async fn checked_restore(
    restore: impl std::future::Future<Output = Result<(), ForkError>>,
    check: ImagesCheck,
) -> Result<(), ForkError> {
    let check = check.passed();
    tokio::pin!(restore, check);
    tokio::select! {
        checked = &mut check => {
            checked?;
            restore.await
        }
        restored = &mut restore => match restored {
            Ok(()) => check.await,
            Err(e) => Err(check.await.err().unwrap_or(e)),
        },
    }
}
