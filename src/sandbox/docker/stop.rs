//! The sandbox's shutdown: kernels kept for the next run (`--keep-sessions`) or ended with
//! their containers, their leaves, directories and workspace file systems.

use std::sync::Arc;

use super::{Inner, UserSlot, EXEC_TIMEOUT, TERMINATE_TIMEOUT};
use crate::sandbox::watched::KernelTable;
use crate::sync::lock;

impl Inner {
    pub(super) async fn shutdown(&self) {
        self.shutdown.cancel();
        // Wait for launches in flight (they hold their user's lock, and give up once they
        // get it after this point), so no container is created behind our back.
        let slots: Vec<Arc<UserSlot>> = lock(&self.users).values().cloned().collect();
        for slot in slots {
            slot.container.lock().await.take();
        }
        if self.cfg.keep_kernels {
            // Released, not ended: their watchers stop, and the next run adopts them.
            let count = self.kernels.release_all();
            self.workspace_images.keep_mounted();
            self.own_workspaces.keep_mounted();
            tracing::info!(
                kernels = count,
                "left the kernels, their containers and workspaces running for the next run \
                 (--keep-sessions)"
            );
            return;
        }
        let kernels = self.kernels.terminate_all();
        if let Some((docker, _)) = self.client.get() {
            match self.our_containers(docker).await {
                Ok(ids) => {
                    futures::future::join_all(
                        ids.iter().map(|id| self.remove_container(docker, id)),
                    )
                    .await;
                    if !ids.is_empty() {
                        tracing::info!(count = ids.len(), "removed the user containers");
                    }
                    self.parents.sweep(docker).await;
                }
                Err(e) => {
                    tracing::error!(error = %self.advice(&e), "cannot list the kernel containers to remove them")
                }
            }
        }
        KernelTable::wait_all(&kernels, TERMINATE_TIMEOUT + EXEC_TIMEOUT).await;
        // Their processes went with the containers; their leaves and directories go now.
        self.templates.end_all(None).await;
        // The containers are removed, so nothing holds the workspace file systems.
        let images = self.workspace_images.clone();
        let own = self.own_workspaces.clone();
        let unmount = move || {
            images.unmount_all();
            own.unmount_all();
        };
        if let Err(e) = tokio::task::spawn_blocking(unmount).await {
            tracing::warn!(error = %e, "unmounting the workspaces failed");
        }
    }
}
