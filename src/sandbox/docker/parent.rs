//! A user's parent cgroup: all of one user's containers (her shared container and every
//! sandbox's own, `own.rs`) are created under one cgroup that holds her limits (memory,
//! CPU quota, processes), so that together they never exceed them, however many sandboxes
//! she opens. Each container keeps its own limits too (the same ones: no container can
//! exceed the user's).
//!
//! ```text
//! <hierarchy>[/<--docker-cgroup-parent>]/
//!   kernel-broker-docker-<data dir hash>/   this broker's, made on first use
//!     u<16 hex digits of sha256(user)>/     the user's limits (`cgroup::Cgroups::create_user`)
//!       <the engine's container cgroups>    each with the user's limits again
//! ```
//!
//! The broker makes and limits the parent with the local backend's cgroup code (v1 and v2,
//! the same limit files) and passes its path as the container's `CgroupParent`; that is how
//! the engine's **cgroupfs** driver (Docker's and Podman's) reads it. The user's part of
//! the name is a hash, so no user name (nor a sandbox id, which never appears in it) can
//! make another path. With the engine's **systemd** driver the parent would be a slice the
//! engine makes; that is not done yet: there, the user's shared container runs as before
//! (its own limits) and a sandbox's own container is refused (see [`ParentNotApplied`]),
//! since it would add the user's limits again. So it is where no parent can be made at all
//! (a broker that is not root, a host without the controllers).
//!
//! After a container starts, its cgroup (from its init's `/proc/<pid>/cgroup`, checked to
//! be plainly beneath the parent: the path comes from the engine) and the limits in force
//! on the parent are checked, as `limits.rs` checks the container's own; an engine that
//! ignored the parent fails the launch (`require_limits`). The parent goes when the user's
//! last container goes (an `rmdir`, which fails while any container is left; with the empty
//! cgroups an engine leaves in it: Podman runs its `conmon` monitors in `<parent>/conmon`,
//! which so count against the user's limits too), and every unused parent at start-up and
//! shutdown. Making a container and removing the parent are
//! serialised per user, so a removal never takes the parent from under a launch.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use bollard::models::SystemInfoCgroupDriverEnum;
use bollard::Docker;
use sha2::{Digest, Sha256};
use tokio::sync::{OnceCell, OwnedMutexGuard};

use super::daemon::error_text;
use super::limits::{check_enforced, resource_limits, NotInForce};
use super::Inner;
use crate::sandbox::cgroup::{CgroupNotFound, Cgroups, ContainerCgroup};
use crate::sandbox::fsutil::launch_failed;
use crate::sandbox::{SandboxError, SandboxUser};
use crate::sync::lock;

/// The users' parents of one broker (see the module comment).
pub(super) struct Parents {
    /// The directory of this broker's parents: `kernel-broker-docker-<hash>`.
    name: String,
    /// `--docker-cgroup-parent`, under which the parents go.
    under: Option<String>,
    /// Found on first use: the tree, or why there is none.
    tree: OnceCell<Result<Cgroups, String>>,
    /// One lock per user's parent (see the module comment).
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Where a new container goes: the engine's `CgroupParent`, and the user's parent while
/// the container is made (its lock held).
pub(super) struct Placement {
    pub cgroup_parent: Option<String>,
    parent: Option<(String, OwnedMutexGuard<()>)>,
}

/// Why a user's container does not sit under her parent cgroup.
#[derive(Debug, thiserror::Error)]
pub(super) enum ParentError {
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    NotMade(#[source] SandboxError),
    #[error("the engine reported no process of the container")]
    NoPid,
    #[error("{0}")]
    NotFound(#[source] CgroupNotFound),
    #[error("the container's cgroup {} is not beneath {}: the engine ignored the parent", found.display(), parent.display())]
    NotBeneath { found: PathBuf, parent: PathBuf },
    #[error("the parent's limits are not in force: {0}")]
    NotInForce(#[source] NotInForce),
}

/// A user's container could not be put under her parent cgroup.
#[derive(Debug, thiserror::Error)]
#[error(
    "the user's containers cannot share one cgroup holding her limits ({container}): \
     {source}; without it each sandbox's container would add her limits again. The parent \
     is made by a root broker with the engine's cgroupfs driver (docs/HOSTS.md); \
     require_limits = false runs containers without it"
)]
pub(super) struct ParentNotApplied {
    pub container: String,
    #[source]
    pub source: ParentError,
}

impl Parents {
    pub fn new(hash: &str, under: Option<&str>) -> Self {
        Self {
            name: format!("kernel-broker-docker-{hash}"),
            under: under.map(str::to_string),
            tree: OnceCell::new(),
            locks: Mutex::new(HashMap::new()),
        }
    }

    /// The tree of parents, made on first use (`Err`: why there is none; a daemon that
    /// does not answer is asked again next time).
    async fn tree(&self, docker: &Docker) -> Result<&Result<Cgroups, String>, SandboxError> {
        self.tree
            .get_or_try_init(|| async {
                let info = docker.info().await.map_err(|e| {
                    super::unavailable(format!(
                        "cannot ask the engine for its cgroup driver: {}",
                        error_text(&e)
                    ))
                })?;
                if info.cgroup_driver == Some(SystemInfoCgroupDriverEnum::SYSTEMD) {
                    return Ok(Err(
                        "the engine uses the systemd cgroup driver, under which the \
                                   broker does not make users' parent cgroups yet"
                            .to_string(),
                    ));
                }
                let under = self.under.as_deref().unwrap_or("/");
                let made = Cgroups::detect_under(under, &self.name)
                    .and_then(|tree| tree.setup().map(|()| tree));
                Ok(made.map_err(|e| e.to_string()))
            })
            .await
    }

    fn user_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.locks)
            .entry(key.to_string())
            .or_default()
            .clone()
    }

    /// Makes (or updates) `user`'s parent and says where her new container goes. Without a
    /// tree of parents the user's own container goes where it always did, and a sandbox's
    /// own container (`own`) is refused unless `require_limits` is off.
    pub async fn place(
        &self,
        docker: &Docker,
        user: &SandboxUser,
        own: bool,
        require_limits: bool,
    ) -> Result<Placement, ParentError> {
        let unplaced = Placement {
            cgroup_parent: self.under.clone(),
            parent: None,
        };
        let tree = match self.tree(docker).await {
            Ok(Ok(tree)) => tree,
            Ok(Err(why)) => {
                if own && require_limits {
                    return Err(ParentError::Unavailable(why.clone()));
                }
                warn_once_unparented(why);
                return Ok(unplaced);
            }
            Err(e) => return Err(ParentError::NotMade(e)),
        };
        let key = user_key(&user.name);
        let guard = self.user_lock(&key).lock_owned().await;
        if let Err(e) = tree.create_user(&key, &user.limits) {
            if require_limits {
                return Err(ParentError::NotMade(e));
            }
            tracing::warn!(user = %user.name, error = %e, "the user's container goes WITHOUT her parent cgroup (require_limits = false)");
            return Ok(unplaced);
        }
        let under = self.under.as_deref().unwrap_or("").trim_end_matches('/');
        Ok(Placement {
            cgroup_parent: Some(format!("{under}/{}/{key}", self.name)),
            parent: Some((key, guard)),
        })
    }

    /// Checks that the started container whose init is host process `pid` sits beneath the
    /// parent it was placed under, and that the parent enforces the user's limits.
    pub fn verify(
        &self,
        placement: &Placement,
        pid: Option<i32>,
        user: &SandboxUser,
    ) -> Result<(), ParentError> {
        let (Some((key, _)), Some(Ok(tree))) = (&placement.parent, self.tree.get()) else {
            return Ok(());
        };
        let pid = pid.ok_or(ParentError::NoPid)?;
        let container = ContainerCgroup::of_process(pid).map_err(ParentError::NotFound)?;
        let parents = tree.user_dirs(key);
        for dir in container.dirs() {
            if !parents.iter().any(|p| plainly_beneath(dir, p)) {
                return Err(ParentError::NotBeneath {
                    found: dir.clone(),
                    parent: parents.first().cloned().unwrap_or_default(),
                });
            }
        }
        let in_force = tree.user_limits_in_force(key);
        check_enforced(&in_force, &resource_limits(&user.limits)).map_err(ParentError::NotInForce)
    }

    /// Removes `user`'s parent if none of her containers is left in it.
    pub async fn remove_if_unused(&self, user: &str) {
        let Some(Ok(tree)) = self.tree.get() else {
            return;
        };
        let key = user_key(user);
        let _guard = self.user_lock(&key).lock_owned().await;
        tree.remove_user_everywhere(&key);
    }

    /// Removes every parent no container uses, and the broker's directory if it is empty
    /// (start-up, after the containers of an earlier run went; shutdown).
    pub async fn sweep(&self, docker: &Docker) {
        if let Ok(Ok(tree)) = self.tree(docker).await {
            tree.remove_unused_users();
        }
    }
}

impl Inner {
    /// Where the container `name` of `user` goes (`own`: a sandbox's own container); an
    /// error refuses the container.
    pub(super) async fn place_container(
        &self,
        docker: &Docker,
        user: &SandboxUser,
        name: &str,
        own: bool,
    ) -> Result<Placement, SandboxError> {
        self.parents
            .place(docker, user, own, self.cfg.require_limits)
            .await
            .map_err(|source| {
                launch_failed(
                    user,
                    ParentNotApplied {
                        container: name.to_string(),
                        source,
                    },
                )
            })
    }

    /// After the container `id` started: [`Parents::verify`]; on failure (and with
    /// `require_limits`) the container is removed and the launch refused.
    pub(super) async fn verify_placement(
        &self,
        docker: &Docker,
        placement: &Placement,
        (id, name): (&str, &str),
        user: &SandboxUser,
    ) -> Result<(), SandboxError> {
        if placement.parent.is_none() {
            return Ok(());
        }
        let pid = match docker.inspect_container(id, None).await {
            Ok(info) => info
                .state
                .and_then(|s| s.pid)
                .and_then(|p| i32::try_from(p).ok())
                .filter(|p| *p > 0),
            Err(_) => None,
        };
        let Err(source) = self.parents.verify(placement, pid, user) else {
            return Ok(());
        };
        if !self.cfg.require_limits {
            tracing::warn!(container = %name, why = %source, "the container runs WITHOUT the user's parent cgroup (require_limits = false)");
            return Ok(());
        }
        self.remove_container(docker, id).await;
        Err(launch_failed(
            user,
            ParentNotApplied {
                container: name.to_string(),
                source,
            },
        ))
    }
}

/// The user's part of her parent's name: `u` and 16 hex digits of the SHA-256 of her name
/// (a plain directory name and slice-safe whatever the name holds).
pub(super) fn user_key(user: &str) -> String {
    format!("u{}", hex::encode(&Sha256::digest(user.as_bytes())[..8]))
}

/// Whether `dir` is strictly beneath `parent`, by plain components only.
fn plainly_beneath(dir: &Path, parent: &Path) -> bool {
    dir != parent
        && dir.starts_with(parent)
        && dir
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

/// Users' containers without a parent are worth one warning, not one per container.
fn warn_once_unparented(why: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            reason = %why,
            "users' containers get no shared parent cgroup: each runs with the user's full \
             limits, and sandboxes' own containers are refused (require_limits)"
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_keys_are_plain_names_whatever_the_user() {
        let k = user_key("alice");
        assert_eq!(k.len(), 17);
        assert!(k.starts_with('u'));
        assert!(k[1..].chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(user_key("alice"), user_key("bob"));
        for hostile in ["../../etc", "a/b", "", "x.slice", "a-b-c", "\0"] {
            let k = user_key(hostile);
            assert_eq!(k.len(), 17, "{hostile:?}");
            assert!(k.chars().all(|c| c.is_ascii_alphanumeric()), "{hostile:?}");
        }
    }

    #[test]
    fn a_container_cgroup_must_be_plainly_beneath_the_parent() {
        let parent = Path::new("/sys/fs/cgroup/memory/kb/u1");
        assert!(plainly_beneath(&parent.join("abc"), parent));
        assert!(plainly_beneath(
            &parent.join("libpod-abc/container"),
            parent
        ));
        assert!(!plainly_beneath(parent, parent));
        assert!(!plainly_beneath(&parent.join(".."), parent));
        assert!(!plainly_beneath(&parent.join("abc/../../u2/x"), parent));
        assert!(!plainly_beneath(
            Path::new("/sys/fs/cgroup/memory/docker/abc"),
            parent
        ));
        assert!(!plainly_beneath(
            Path::new("/sys/fs/cgroup/memory/kb/u10/abc"),
            parent
        ));
    }
}
