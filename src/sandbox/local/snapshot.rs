//! Snapshots on the local sandbox (issue 37): a copy of a live kernel (`copy.rs`) whose
//! restore waits, as often as asked. Taking one is a copy's first half: the session's own
//! workspace copied into the snapshot's (`<data_dir>/sandboxes/<snapshot id>`, mounted by
//! no sandbox), the kernel's held child dumped by CRIU as the kernel's uid into
//! `<data_dir>/snapshots/<snapshot id>` (beneath a root-only directory), the images sealed
//! and listed, and the record written beside them; the kernel goes on as it was. Starting a
//! session from one is the second half, done again for each: the new session's own
//! workspace filled with a copy of the snapshot's, the images checked against their list
//! and restored as the kernel's uid (never root) into a new sandbox. The snapshot itself is
//! only ever read.
//!
//! Built for sessions with a workspace of their own, as a pause is (`pause.rs` says why).

use std::path::PathBuf;

use super::LocalSandbox;
use crate::sandbox::criu::copy_failed;
use crate::sandbox::fork::{ForkError, PreparedFork};
use crate::sandbox::fsutil;
use crate::sandbox::pause::{keep_recorded, open_checked, PausedImage};
use crate::sandbox::{KernelProcess, LaunchSpec, Launched};

impl LocalSandbox {
    /// `<data_dir>/snapshots`: root's, 0700; each snapshot's images in it.
    fn snapshots_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("snapshots")
    }

    pub(super) async fn prepare_kernel_snapshot(
        &self,
        kernel: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let origin = super::pause::held_origin(kernel, "snapshotted")?;
        if origin.own_workspace.is_none() {
            return Err(ForkError::Unsupported(
                "a snapshot of a session that shares its user's workspace is not built yet \
                 (its /tmp lives only as long as its user's sandbox); a session made with \
                 \"workspace\": \"own\" can be snapshotted"
                    .into(),
            ));
        }
        if spec.own_workspace != Some(spec.session_id) {
            return Err(ForkError::Unsupported(
                "a snapshot's workspace is named by the snapshot".into(),
            ));
        }
        self.prepare_copy_in(origin, spec, self.snapshots_dir())
            .await
    }

    /// The held child dumped as a snapshot's (or a pause's) images; a snapshot that failed
    /// leaves nothing, its copy of the workspace included.
    pub(super) async fn dump_kernel_held(
        &self,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<PausedImage, ForkError> {
        let snapshot = (!prepared.pause).then(|| prepared.spec.clone());
        let dumped = self.dump_kernel_paused(prepared, pid).await;
        if let (Err(_), Some(spec)) = (&dumped, snapshot) {
            if let Some(key) = spec.own_workspace {
                self.remove_unused_own(&spec.user, key).await;
            }
        }
        dumped
    }

    pub(super) async fn start_kernel_from_snapshot(
        &self,
        image: &PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, ForkError> {
        let (Some(from), Some(to)) = (image.own_workspace, spec.own_workspace) else {
            return Err(ForkError::Unsupported(
                "a session starts from a snapshot only with a workspace of its own".into(),
            ));
        };
        if from == to {
            return Err(ForkError::Unsupported(
                "a session from a snapshot gets a workspace of its own, not the snapshot's".into(),
            ));
        }
        let user = spec.user.clone();
        // Checked before anything is made: a damaged snapshot makes nothing.
        let images = open_checked(image).await?;
        // The snapshot's workspace mounted (again, after a restart), never made anew.
        let (own, ids) = (self.own_workspaces.clone(), self.copy_ids(&user)?);
        let quota = user.limits.workspace_quota_bytes;
        tokio::task::spawn_blocking(move || {
            let root = own.dirs(from).root;
            if !root.is_dir() {
                return Err(copy_failed(format!(
                    "the snapshot's workspace is gone ({})",
                    root.display()
                )));
            }
            own.prepare(from, quota, Some(ids))
                .map_err(ForkError::Sandbox)
        })
        .await
        .map_err(|e| copy_failed(format!("the task failed: {e}")))??;
        let started = match self.copy_own(&user, from, to).await {
            Ok(()) => {
                self.restore_images(spec, &images, image.pid, image.dump_time, None)
                    .await
            }
            Err(e) => Err(e),
        };
        if started.is_err() {
            self.remove_unused_own(&user, to).await;
        }
        started
    }

    pub(super) async fn discard_kernel_snapshot(&self, image: PausedImage) {
        fsutil::remove_dir_logged(image.dir).await;
        if let Some(key) = image.own_workspace {
            let own = self.own_workspaces.clone();
            match tokio::task::spawn_blocking(move || own.remove(key)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(%key, error = %e, "cannot remove a snapshot's workspace")
                }
                Err(e) => {
                    tracing::warn!(%key, error = %e, "removing a snapshot's workspace failed")
                }
            }
        }
    }

    /// At startup: the snapshots an earlier run left with their records; anything else in
    /// the snapshots' directory (one cut short) goes.
    pub(super) async fn keep_snapshots(&self) -> Vec<PausedImage> {
        keep_recorded(self.snapshots_dir(), "snapshots").await
    }
}
