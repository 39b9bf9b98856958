//! Pausing a kernel to disk and resuming it on the local sandbox (issue 37; the exchange
//! is `sandbox/pause.rs`): the two halves of a copy (`copy.rs`) apart in time. The images
//! go in `<data_dir>/paused/<kernel id>`, beneath a directory only root can enter; they
//! are made by CRIU as the kernel's uid and sealed (root's, read-only) before anything
//! else reads them, and restored by CRIU as the kernel's uid into a new sandbox over the
//! session's own workspace, which stays where it is meanwhile.
//!
//! Each paused kernel's record (`sandbox/pause.rs`: its pid, own workspace, image files)
//! is written beside its images once they are sealed; at startup the directories with one
//! are kept for the session layer (`Sandbox::paused_images`) and the rest removed.
//!
//! A kernel with a workspace of its own has everything its files can be on disk
//! (`/home/user` and `/tmp` are both its workspace's). A kernel sharing its user's
//! workspace runs in its user's template sandbox, whose `/tmp`, home and `/dev/shm` are
//! memory that ends with that sandbox: it resumes in a plain sandbox of its own over the
//! user's workspace, and its held child refuses when it holds anything in those
//! ([`SANDBOX_PRIVATE`]; `kernels/kernel_broker_fork.py`).

use std::path::PathBuf;

use super::files::endpoints_for;
use super::{LocalSandbox, CONNECTION_FILE_INSIDE};
use crate::sandbox::fork::{ForkError, PreparedFork};
use crate::sandbox::fsutil;
use crate::sandbox::pause::{
    keep_recorded, list_images, make_images_dir, open_checking, record, PausedImage,
};
use crate::sandbox::{KernelProcess, LaunchSpec, Launched};

/// What a kernel's sandbox has of its own, in memory, gone with it: its `/tmp`, its home
/// (a kernel sharing its user's workspace) and `/dev/shm`.
const SANDBOX_PRIVATE: [&str; 3] = ["/tmp", "/home/kernel", "/dev/shm"];

/// Where `kernel` holds a child for CRIU to dump (a pause, a snapshot: `done` says which),
/// or why it cannot.
pub(super) fn held_origin(
    kernel: &dyn KernelProcess,
    done: &str,
) -> Result<crate::sandbox::fork::ForkOrigin, ForkError> {
    kernel.fork_origin().ok_or_else(|| {
        ForkError::Unsupported(format!(
            "this kernel cannot be {done}: it ended, or it was not started by this broker \
             (a kernel adopted after a restart holds no child for CRIU to dump; restart the \
             session)"
        ))
    })
}

impl LocalSandbox {
    pub(super) async fn prepare_kernel_pause(
        &self,
        kernel: &dyn KernelProcess,
        spec: LaunchSpec,
    ) -> Result<PreparedFork, ForkError> {
        let origin = held_origin(kernel, "paused")?;
        if spec.own_workspace != origin.own_workspace {
            return Err(ForkError::Unsupported(
                "a paused kernel resumes over its own workspace, not another".into(),
            ));
        }
        self.copy_tools().await?;
        let ids = self.kernel_ids(&spec.user)?.ok_or_else(|| {
            ForkError::Unsupported(
                "pausing a kernel to disk is a dump made with CRIU, which the broker does only \
                 as root"
                    .into(),
            )
        })?;
        let room = crate::sandbox::criu::reserve_room(
            &self.copy_room,
            &self.cfg.data_dir,
            origin.host_pid,
            self.cfg.copy_reserve_bytes,
        )
        .await?;
        let endpoints = endpoints_for(&self.run_base.join(spec.session_id.to_string()))
            .map_err(|e| fsutil::launch_failed(&spec.user, e))?;
        let dir = make_images_dir(self.paused_dir(), spec.session_id.to_string(), ids).await?;
        let shared = origin.own_workspace.is_none();
        let mut prepared =
            PreparedFork::paused(origin, spec, dir, CONNECTION_FILE_INSIDE, endpoints, room);
        if shared {
            // A kernel sharing its user's workspace resumes in a sandbox of its own, whose
            // /tmp, home and /dev/shm are new: it must hold nothing there.
            prepared.request["hold"]["private"] = serde_json::json!(SANDBOX_PRIVATE);
        }
        Ok(prepared)
    }

    pub(super) async fn dump_kernel_paused(
        &self,
        prepared: PreparedFork,
        pid: i64,
    ) -> Result<PausedImage, ForkError> {
        let PreparedFork {
            origin,
            spec,
            dir,
            room,
            ..
        } = prepared;
        let dumped = self.dump_held(&origin, &spec, &dir, pid).await;
        // The images are made (or not): what they take is on the file system now.
        drop(room);
        let listed = match dumped {
            Ok((images, dump_time)) => list_images(images)
                .await
                .map(|(files, images)| (files, images, dump_time)),
            Err(e) => Err(e),
        };
        let recorded = match listed {
            Ok((files, images, dump_time)) => {
                let image = PausedImage::new(dir.clone(), pid, &spec, files, dump_time);
                // Its record beside the images: the paused kernel outlives the broker.
                record(images, image).await
            }
            Err(e) => Err(e),
        };
        if recorded.is_err() {
            fsutil::remove_dir_logged(dir).await;
        }
        recorded
    }

    pub(super) async fn resume_kernel(
        &self,
        image: &PausedImage,
        spec: LaunchSpec,
    ) -> Result<Launched, ForkError> {
        if spec.own_workspace != image.own_workspace {
            return Err(ForkError::Unsupported(
                "a paused kernel resumes over its own workspace, not another".into(),
            ));
        }
        // Restored while checked: a kernel made from damaged images ends before anything
        // connects to it.
        let (images, check) = open_checking(image)?;
        self.restore_images(spec, &images, image.pid, image.dump_time, Some(check))
            .await
    }

    /// `<data_dir>/paused`: root's, 0700; each paused kernel's images in it.
    fn paused_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("paused")
    }

    /// At startup: the paused kernels an earlier run left with their records are kept (a
    /// session of theirs resumes them, or the session layer discards them); anything else
    /// in the paused directory (a pause cut short, before its record) goes. Their images
    /// hold kernels' memory.
    pub(super) async fn keep_paused(&self) -> Vec<PausedImage> {
        keep_recorded(self.paused_dir(), "paused kernels").await
    }
}
