//! A sandbox with a workspace of its own ([`LaunchSpec::own_workspace`]; every E2B sandbox)
//! on Docker: E2B's model, a sandbox is a machine, so it gets a container of its own.
//!
//! The container is keyed by the own-workspace key (the sandbox's session id): its
//! contexts' kernels and its commands and terminals go into it. It is made as a user's
//! container is (`container.rs`: the same lock-down and the user's limits), with:
//! - its own workspace, `<data_dir>/sandboxes-docker/<key>/home` ([`OwnWorkspaces`]: empty,
//!   the kernel uid's, every directory above it root's, so no root path there follows a
//!   kernel's symlink; as root an ext4 image of the user's disk quota), bound at
//!   `/home/user` and `/workspace`;
//! - its own `/tmp` (the container's tmpfs) and runtime directory
//!   (`<run_base>/+<31 hex digits of the key>`: no user name holds a `+`);
//! - `/etc/passwd` and `/etc/group` naming the kernel uid `user` (E2B's sandbox user), files
//!   the broker writes into its tools directory, bound read-only (no image rebuild);
//! - kernels started plainly (no fork-server template: a template per sandbox would cost a
//!   process and its memory for each, for one or two kernels), with `HOME` and working
//!   directory `/home/user`, their caches in the `/home/kernel` tmpfs;
//! - named `kernel-broker-<hash>-sandbox-<key>`, labelled with the user and
//!   [`LABEL_SANDBOX`]`=<key>`.
//!
//! It is removed, with its workspace and runtime directory, when the last session in it
//! ends ([`Inner::remove_own`]), and with every container of this broker on shutdown. With
//! `--keep-sessions` it is kept as a user's container is (its kernels' tickets name its key,
//! `keep/`): the next run adopts them in it; one none of whose kernels is adopted is removed
//! with its workspace (`discard_unadopted`), and workspaces no ticket names are swept.
//!
//! Limits: each such container gets the user's limits (memory, CPUs, processes) as her own
//! container has them, and sits with her other containers under one parent cgroup holding
//! those limits once (`parent.rs`), so together they never exceed them.

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use uuid::Uuid;

use super::{Inner, KERNEL_GID, KERNEL_UID};
use crate::sandbox::fsutil::{io_err, remove_dir_logged};
use crate::sandbox::own_workspace::{OwnDirs, OwnWorkspaces, HOME_INSIDE, LOGIN};
use crate::sandbox::{SandboxError, SandboxUser};
use crate::sync::lock;

#[cfg(doc)]
use crate::sandbox::LaunchSpec;

/// Label holding the own-workspace key of a sandbox's own container.
pub const LABEL_SANDBOX: &str = "org.kernel-broker.sandbox";

/// Where the caches of an own container's kernels go (the image user's tmpfs home), so the
/// sandbox's `/home/user` holds only what its code writes.
const CACHE_INSIDE: &str = "/home/kernel";

/// Where a kernel or command runs: the user's container, or its sandbox's own.
pub(super) struct Target {
    /// Its slot in `Inner::users` and its runtime directory's name under the run base: the
    /// user's name, or [`own_slot`] of the key.
    pub slot: String,
    /// The host directory at `/workspace` (own: also at `/home/user`).
    pub workspace: PathBuf,
    /// The own-workspace key; `None`: the user's container.
    pub own: Option<Uuid>,
}

/// The slot and runtime directory name of the own container `key`: `+` and 31 hex digits
/// (no user name holds a `+`; 32 bytes, the room the run base leaves a user name).
pub(super) fn own_slot(key: Uuid) -> String {
    let hex = key.simple().to_string();
    format!("+{}", &hex[..31])
}

/// The environment an own container's kernels and commands get: E2B's user and home.
pub(super) fn own_env() -> Vec<String> {
    vec![
        format!("HOME={HOME_INSIDE}"),
        format!("USER={LOGIN}"),
        format!("LOGNAME={LOGIN}"),
        format!("IPYTHONDIR={CACHE_INSIDE}/ipython"),
        format!("MPLCONFIGDIR={CACHE_INSIDE}/matplotlib"),
        format!("XDG_CACHE_HOME={CACHE_INSIDE}/cache"),
        format!("XDG_CONFIG_HOME={CACHE_INSIDE}/config"),
    ]
}

/// `/etc/passwd` of an own container: the kernel uid is `user`, at home in `/home/user`.
fn passwd() -> String {
    format!(
        "root:x:0:0:root:/root:/bin/bash\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n\
         {LOGIN}:x:{KERNEL_UID}:{KERNEL_GID}::{HOME_INSIDE}:/bin/bash\n"
    )
}

/// `/etc/group` of an own container.
fn group() -> String {
    format!("root:x:0:\nnogroup:x:65534:\n{LOGIN}:x:{KERNEL_GID}:\n")
}

/// Writes `passwd` and `group` into the tools directory (root's, made by `sudo::install`;
/// no kernel writes there), each to a new file renamed into place. Blocking.
pub(super) fn install_accounts(tools: &Path) -> Result<(), SandboxError> {
    let _writing = lock(&crate::sandbox::sudo::TOOLS_WRITE);
    for (name, text) in [("passwd", passwd()), ("group", group())] {
        let path = tools.join(name);
        let temp = tools.join(format!(".{name}.new"));
        let _ = std::fs::remove_file(&temp);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&temp)
            .and_then(|mut f| io::Write::write_all(&mut f, text.as_bytes()))
            .and_then(|()| std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o644)))
            .and_then(|()| std::fs::rename(&temp, &path))
            .map_err(io_err("cannot write the sandbox's accounts", &path))?;
    }
    Ok(())
}

/// Makes the own workspace `key` ready for its container: the kernel uid's home (without
/// root, which cannot give it away, world-writable as the shared workspace is). Blocking.
pub(super) fn prepare_own(
    own: &OwnWorkspaces,
    key: Uuid,
    quota: u64,
    privileged: bool,
) -> Result<OwnDirs, SandboxError> {
    let ids = privileged.then_some((KERNEL_UID, KERNEL_GID));
    let dirs = own.prepare(key, quota, ids)?;
    if !privileged {
        // `home`'s parent is the broker's: no kernel can have put a symlink there.
        std::fs::set_permissions(&dirs.home, std::fs::Permissions::from_mode(0o777)).map_err(
            io_err("cannot open an own workspace to the kernel", &dirs.home),
        )?;
    }
    Ok(dirs)
}

impl Inner {
    /// Where a launch or command of `user` with the own workspace `own` runs.
    pub(super) fn target(
        &self,
        user: &SandboxUser,
        own: Option<Uuid>,
    ) -> Result<Target, SandboxError> {
        // Checked for both: the user's name is a label and a path component.
        let workspace = self.workspace_path(user)?;
        Ok(match own {
            None => Target {
                slot: user.name.clone(),
                workspace,
                own: None,
            },
            Some(key) => Target {
                slot: own_slot(key),
                workspace: self.own_workspaces.dirs(key).home,
                own: Some(key),
            },
        })
    }

    /// The name of the own container `key`.
    pub(super) fn own_container_name(&self, key: Uuid) -> String {
        format!("kernel-broker-{}-sandbox-{key}", self.hash)
    }

    /// The host directory of the own workspace `key` (made by its session's launch).
    pub(super) fn own_home(&self, key: Uuid) -> Result<PathBuf, SandboxError> {
        let dirs = self.own_workspaces.dirs(key);
        if !dirs.root.is_dir() {
            return Err(SandboxError::Io {
                what: "the session's own workspace is gone",
                path: dirs.root,
                source: io::ErrorKind::NotFound.into(),
            });
        }
        Ok(dirs.home)
    }

    /// Removes the own container `key`, its runtime directory and its workspace (the last
    /// session in it ended). Nothing is left running: the container goes whole.
    pub(super) async fn remove_own(&self, user: &SandboxUser, key: Uuid) {
        let slot_name = own_slot(key);
        let slot = lock(&self.users).remove(&slot_name);
        let container = match slot {
            Some(slot) => slot.container.lock().await.take(),
            None => None,
        };
        self.remove_own_container(&user.name, key, container).await;
        remove_dir_logged(self.user_run_dir(&slot_name)).await;
        let own = self.own_workspaces.clone();
        match tokio::task::spawn_blocking(move || own.remove(key)).await {
            Ok(Ok(())) => {
                tracing::info!(user = %user.name, %key, "sandbox container and workspace removed")
            }
            Ok(Err(e)) => {
                tracing::warn!(user = %user.name, %key, error = %e, "cannot remove an own workspace")
            }
            Err(e) => tracing::warn!(%key, error = %e, "removing an own workspace failed"),
        }
    }

    /// Removes a sandbox's own container: `registered` (its slot's, taken by the caller, who
    /// holds what must wait for it), and by name too (one a crashed launch left, or one never
    /// registered); then the user's parent cgroup if no container of theirs is left.
    pub(super) async fn remove_own_container(
        &self,
        user: &str,
        key: Uuid,
        registered: Option<std::sync::Arc<super::running::ContainerInfo>>,
    ) {
        let Ok(docker) = self.client().await else {
            return;
        };
        if let Some(c) = registered {
            self.remove_container(&docker, &c.id).await;
        }
        self.remove_container(&docker, &self.own_container_name(key))
            .await;
        self.parents.remove_if_unused(user).await;
    }

    /// Start-up: removes the own workspaces an earlier run left but those in `keep` (their
    /// kernels were kept, `--keep-sessions`). Blocking work in a task.
    pub(super) async fn sweep_own(&self, keep: HashSet<Uuid>) {
        self.own_workspaces.sweep_at_startup(keep).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_slots_fit_the_user_name_budget_and_are_no_user_name() {
        let key = Uuid::new_v4();
        let slot = own_slot(key);
        assert_eq!(slot.len(), super::super::USER_NAME_BUDGET);
        assert!(!super::super::is_container_safe(&slot));
        assert_ne!(own_slot(Uuid::new_v4()), slot);
    }

    #[test]
    fn the_accounts_name_the_kernel_uid_user() {
        let dir = tempfile::tempdir().unwrap();
        install_accounts(dir.path()).unwrap();
        // Installed again over the old ones (a restart).
        install_accounts(dir.path()).unwrap();
        let passwd = std::fs::read_to_string(dir.path().join("passwd")).unwrap();
        assert!(passwd.contains("\nuser:x:1000:1000::/home/user:/bin/bash\n"));
        assert!(!passwd.contains("kernel"));
        let group = std::fs::read_to_string(dir.path().join("group")).unwrap();
        assert!(group.ends_with("\nuser:x:1000:\n"));
    }

    #[test]
    fn concurrent_account_installs_all_succeed() {
        // Launches of different users prepare their directories at the same time.
        let dir = tempfile::tempdir().unwrap();
        std::thread::scope(|s| {
            let writers: Vec<_> = (0..8)
                .map(|_| s.spawn(|| (0..50).try_for_each(|_| install_accounts(dir.path()))))
                .collect();
            for w in writers {
                w.join().unwrap().unwrap();
            }
        });
    }
}
