//! The local sandbox's part in E2B's sandbox shape: sessions' own workspaces
//! (`sandbox/own_workspace.rs`: made, bound at `/home/user`, `/workspace` and `/tmp` by
//! `bwrap.rs`, removed), the environment of their kernels and commands, and the tools
//! directory with the sandbox's `sudo` (`sandbox/sudo.rs`).

use std::collections::HashSet;
use std::path::PathBuf;

use uuid::Uuid;

use super::host::unavailable_by;
use super::{LocalSandbox, RUN_DIR_INSIDE};
use crate::sandbox::own_workspace::{HOME_INSIDE, LOGIN};
use crate::sandbox::{SandboxError, SandboxUser};

/// Where a launch's files go besides its runtime directory: the bootstrap script's
/// directory, if it uses the script, and the session's own workspace, if it has one.
pub(super) struct Placement {
    pub boot_dir: Option<PathBuf>,
    pub own_workspace: Option<Uuid>,
}

/// The environment of a kernel or command with a workspace of its own: E2B's sandbox user
/// and home. The kernel's own state (IPython's profile and history, matplotlib's and other
/// caches) goes to its runtime directory, as it went to its tmpfs home before: the home is
/// the workspace the user lists, and these are not hers.
pub(super) fn own_env() -> Vec<(String, String)> {
    let state = |dir: &str| format!("{RUN_DIR_INSIDE}/{dir}");
    [
        ("HOME", HOME_INSIDE.to_string()),
        ("USER", LOGIN.to_string()),
        ("LOGNAME", LOGIN.to_string()),
        ("IPYTHONDIR", state("ipython")),
        ("MPLCONFIGDIR", state("matplotlib")),
        ("XDG_CACHE_HOME", state("cache")),
        ("XDG_CONFIG_HOME", state("config")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

impl LocalSandbox {
    /// At startup: the tools directory written, and the own workspaces an earlier run
    /// left removed, except those of the sessions it kept (`keep`; adopted, or removed at
    /// the next start once their sessions are gone).
    pub(super) async fn prepare_tools_and_sweep_own(
        &self,
        keep: &HashSet<Uuid>,
    ) -> Result<(), SandboxError> {
        if let Some(tools) = self.bwrap_opts.tools_dir.clone() {
            tokio::task::spawn_blocking(move || crate::sandbox::sudo::install(&tools))
                .await
                .map_err(|e| unavailable_by(format!("startup task failed: {e}"), e))??;
        }
        self.own_workspaces.sweep_at_startup(keep.clone()).await;
        Ok(())
    }

    /// The own workspace `key` of `user`, which its session's launch made, ready (mounted
    /// again after a restart); its home's host path. One that is gone is not made again
    /// (a files request racing the session's end would leave it behind). Blocking.
    pub(super) fn prepare_own(
        &self,
        user: &SandboxUser,
        key: Uuid,
    ) -> Result<PathBuf, SandboxError> {
        let root = self.own_workspaces.dirs(key).root;
        if !root.is_dir() {
            return Err(SandboxError::Io {
                what: "the session's own workspace is gone",
                path: root,
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        let ids = self.kernel_ids(user)?;
        let dirs = self
            .own_workspaces
            .prepare(key, user.limits.workspace_quota_bytes, ids)?;
        Ok(dirs.home)
    }

    /// Removes the own workspace `key`.
    pub(super) async fn remove_own(&self, user: &SandboxUser, key: Uuid) {
        let own = self.own_workspaces.clone();
        match tokio::task::spawn_blocking(move || own.remove(key)).await {
            Ok(Ok(())) => tracing::info!(user = %user.name, %key, "own workspace removed"),
            Ok(Err(e)) => {
                tracing::warn!(user = %user.name, %key, error = %e, "cannot remove an own workspace")
            }
            Err(e) => tracing::warn!(%key, error = %e, "removing an own workspace failed"),
        }
    }
}
