//! A kernel's launch: its container found or made (the user's, or its sandbox's own),
//! then the kernel forked from the user's template or started plainly, registered,
//! watched and (with `--keep-sessions`) ticketed.

use std::sync::Arc;
use std::time::Instant;

use super::exec::{connection_file, endpoints_for, DockerKernel, SessionFiles, LOST};
use super::place::place_kernel;
use super::watch::watch_kernel;
use super::{keep, Inner, EXEC_TIMEOUT, TERMINATE_TIMEOUT};
use crate::sandbox::fsutil::{launch_err, launch_failed, launch_step, remove_dir_logged};
use crate::sandbox::watched::{KernelWatch, WatchedKernel};
use crate::sandbox::{KernelProcess, LaunchRefusal, LaunchSpec, Launched, SandboxError};
use crate::sync::lock;

impl Inner {
    /// Starts a kernel in its container (made first if it does not run): the user's, or
    /// its sandbox's own (`own.rs`).
    pub(super) async fn launch(
        self: &Arc<Self>,
        spec: LaunchSpec,
    ) -> Result<Launched, SandboxError> {
        let user = spec.user.clone();
        let other = spec.kernel_name != "python3";
        if other && self.other_kernel(&spec.kernel_name).is_none() {
            return Err(launch_err(
                &user,
                LaunchRefusal::KernelNotInImage(spec.kernel_name.clone()),
            ));
        }
        let target = self.target(&user, spec.own_workspace)?;
        self.startup().await?;
        let docker = self.client().await?;
        let slot = self.slot(&target.slot);
        if let Some(idle) = lock(&slot.idle).take() {
            idle.cancel();
        }

        let started = Instant::now();
        let mut guard = slot.container.lock().await;
        if self.shutdown.is_cancelled() {
            return Err(launch_err(&user, LaunchRefusal::ShuttingDown));
        }
        let (container, cold) = match self.running_container(&docker, &mut guard).await? {
            Some(c) => (c, false),
            None => {
                let c = self.create_container(&docker, &user, &target).await?;
                *guard = Some(c.clone());
                (c, true)
            }
        };
        let container_ready = started.elapsed();

        // Forked from the user's template when one works (`template.rs`); registered as a
        // kernel before the lock goes, as a plain start is below.
        // A sandbox's own container starts its kernels plainly (`own.rs`).
        // Other languages start plainly: the fork server is Python's.
        if target.own.is_none() && !other {
            if let Some(launched) = self.launch_forked(&docker, &container, &spec).await {
                return Ok(launched);
            }
        }

        let dir = keep::session_dir(spec.session_id);
        let host_dir = self.user_run_dir(&target.slot).join(&dir);
        let endpoints = endpoints_for(&host_dir).map_err(|e| launch_failed(&user, e))?;
        let files = SessionFiles {
            dir: host_dir.clone(),
            privileged: self.privileged,
            connection: Some(connection_file(&spec, &dir)),
        };
        tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| launch_step(&user, "preparing files failed", e))??;

        let exec_id = match self.start_kernel(&docker, &container, &spec, &dir).await {
            Ok(id) => id,
            Err(e) => {
                remove_dir_logged(host_dir).await;
                return Err(launch_failed(&user, e));
            }
        };
        let session = spec.session_id.to_string();
        let exec_pidfd = self.exec_pidfd(&docker, &exec_id).await;
        // A sandbox's own kernel is copied from its exec's process (`copy.rs`), as root.
        let exec_pid = match (target.own, self.privileged) {
            (Some(_), true) => super::place::exec_pid(&docker, &exec_id).await.ok(),
            _ => None,
        };
        // Only root writes the container's cgroup (see `exec.rs`).
        let placeable = self.privileged.then_some(exec_id.as_str());
        let leaf = match place_kernel(&docker, placeable, &host_dir, &session, &spec.limits).await {
            Ok(leaf) => leaf,
            Err(e) => {
                // The kernel waits for a word that cannot come: it ends by itself; the
                // reaper of a later end, or the container's removal, takes what is left.
                remove_dir_logged(host_dir).await;
                return Err(launch_failed(&user, e));
            }
        };

        let (watch, exit) = KernelWatch::new(spec.session_id, user.name.clone(), LOST);
        let shared = Arc::new(DockerKernel {
            watch,
            docker: docker.clone(),
            container,
            dir,
            host_dir,
            exec_id,
            exec_pid,
            forked: None,
            exec_pidfd,
            leaf,
            freezer: None,
            limits: spec.limits,
            workspace: target.workspace,
            quota_bytes: user.limits.workspace_quota_bytes,
        });
        self.kernels.insert(spec.session_id, shared.clone());
        tokio::spawn(watch_kernel(self.clone(), shared.clone(), exit));
        // Registered: an idle removal waiting for the lock will now see a live kernel.
        drop(guard);
        let process: Box<dyn KernelProcess> = Box::new(WatchedKernel::new(
            shared.clone(),
            TERMINATE_TIMEOUT + EXEC_TIMEOUT,
        ));
        if self.cfg.keep_kernels {
            // Written before the launch answers, so the kernel is kept even if the broker
            // is killed right after; a kernel that could not be kept is not launched.
            if let Err(e) = self.keep_ticket(&shared).await {
                process.terminate().await;
                return Err(launch_failed(&user, e));
            }
        }
        tracing::info!(
            session = %spec.session_id,
            user = %user.name,
            container = %shared.container.name,
            cold,
            container_ms = container_ready.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "kernel launched"
        );
        Ok(Launched { endpoints, process })
    }
}
