//! The local sandbox's startup, done once before the first launch: its directories made,
//! what an earlier run left swept (runtime directories, own workspaces, cgroup leaves,
//! unfinished copies) except what is kept (kernels kept with `--keep-sessions`, paused
//! kernels and snapshots with their records), and the cgroup tree set up.

use std::collections::HashSet;
use std::sync::Arc;

use super::{keep, sweep_run_base, unavailable, unavailable_by, Cgroups, LocalSandbox, BACKEND};
use crate::sandbox::{fsutil, SandboxError};

impl LocalSandbox {
    /// Does the startup work once: creates the directories, removes runtime directories and
    /// cgroup leaves an earlier run left behind, sets up the cgroup tree.
    pub(super) async fn startup(&self) -> Result<Option<Arc<Cgroups>>, SandboxError> {
        self.started
            .get_or_try_init(|| async {
                // Kept kernels (`--keep-sessions`) are spared by the sweeps: the session
                // layer adopts them, and discards what it does not adopt.
                let keep = match &self.kept {
                    Some(kept) => {
                        let kept = kept.clone();
                        tokio::task::spawn_blocking(move || kept.load())
                            .await
                            .map_err(|e| unavailable_by(format!("startup task failed: {e}"), e))?
                            .map_err(|e| unavailable_by(format!("cannot read the kept kernels: {e}"), e))?
                    }
                    None => {
                        // This run does not keep kernels: the sweeps below end what an
                        // earlier run kept, and its tickets go with them.
                        keep::KeptKernels::forget_all(&self.cfg.data_dir);
                        HashSet::new()
                    }
                };
                if !keep.is_empty() {
                    tracing::info!(count = keep.len(), "kernels kept by an earlier run");
                }
                let spared = keep.clone();
                fsutil::prepare_state_dirs(
                    BACKEND,
                    &self.cfg.data_dir,
                    &self.workspaces,
                    &self.run_base,
                    move |base| sweep_run_base(base, &spared),
                )
                .await?;

                // Paused kernels and snapshots with their record stay, and so do their
                // own workspaces.
                let (paused, snapshots) = (self.keep_paused().await, self.keep_snapshots().await);
                let mut spared = keep.clone();
                let own = paused.iter().chain(&snapshots).filter_map(|p| p.own_workspace);
                spared.extend(own);
                // Kept kernels' own workspaces, by their key (a resumed kernel's ticket is
                // under its kernel id).
                if let Some(kept) = &self.kept {
                    spared.extend(kept.own_workspaces());
                }
                self.found.set(paused, snapshots);
                self.prepare_tools_and_sweep_own(&spared).await?;
                self.sweep_copies();

                let cgroups = match &self.cgroups {
                    Ok(cgroups) => match cgroups.setup() {
                        Ok(()) => {
                            let stale = cgroups.sweep_stale(&keep).await;
                            if stale > 0 {
                                tracing::info!(count = stale, "removed kernel cgroups left by an earlier run");
                            }
                            tracing::info!(version = ?cgroups.version(), bases = ?cgroups.bases(), "kernel limits enforced with cgroups");
                            Some(cgroups.clone())
                        }
                        Err(e) => self.without_limits(e.to_string())?,
                    },
                    Err(reason) => self.without_limits(reason.to_string())?,
                };
                Ok(cgroups)
            })
            .await
            .cloned()
    }

    fn without_limits(&self, reason: String) -> Result<Option<Arc<Cgroups>>, SandboxError> {
        if self.cfg.require_limits {
            Err(unavailable(format!(
                "cannot enforce memory, CPU and process limits with cgroups: {reason}. \
                 Run the broker as root, or give it a delegated cgroup v2 subtree \
                 (systemd: Delegate=yes), or set require_limits = false to run kernels \
                 without limits"
            )))
        } else {
            tracing::warn!(%reason, "running kernels WITHOUT memory, CPU and process limits (require_limits = false)");
            Ok(None)
        }
    }
}
