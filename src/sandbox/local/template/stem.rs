//! Stems (cgroup v1): a template's child forked and moved into a leaf of its own ahead of
//! need, waiting to be told which kernel to become (see the parent module's comment).
//! Making one ([`new_stem`], in the background after each launch: [`Template::ensure_stem`]),
//! claiming it for a session ([`claim`]: its leaf renamed and given the session's limits),
//! and discarding it (killed through its pidfd, its leaf removed).

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::task::JoinError;
use uuid::Uuid;

use super::Template;
use crate::sandbox::cgroup::{CgroupVersion, Cgroups, Leaf};
use crate::sandbox::fork_server::{find_child, ForkServer, RequestFailed};
use crate::sandbox::pidfd;
use crate::sandbox::procfs::state_of;
use crate::sandbox::{KernelLimits, SandboxError, SandboxUser};
use crate::sync::lock;

/// Why a stem could not be made or claimed.
#[derive(Debug, thiserror::Error)]
pub(super) enum StemError {
    #[error(transparent)]
    Leaf(SandboxError),
    #[error(transparent)]
    Fork(RequestFailed),
    #[error("its child {0} is not among its processes")]
    ChildNotFound(i32),
    #[error("cannot move it into its cgroup: {0}")]
    NotMoved(#[source] SandboxError),
    #[error("it has ended or is stopped")]
    Unusable,
    #[error(transparent)]
    Interrupted(JoinError),
}

/// A child of a template, in a cgroup leaf of its own, waiting to be told which kernel to
/// become. Its leaf is its own from the start: it has run nothing but the fork. Dropped
/// before it became a kernel (a launch given up half-way), it is killed and its leaf
/// removed.
pub(super) struct Stem {
    /// Its id with the template, and the name of its runtime directory once it is a kernel.
    pub(super) name: String,
    pub(super) host_pid: i32,
    /// These three are taken when it becomes a kernel (its reaper has them then); the leaf
    /// also when it is discarded.
    pub(super) pidfd: Option<OwnedFd>,
    pub(super) status: Option<oneshot::Receiver<i32>>,
    pub(super) leaf: Option<Leaf>,
    pub(super) cgroups: Arc<Cgroups>,
}

impl Stem {
    /// Kills it and removes its leaf.
    pub(super) async fn discard(mut self, server: &ForkServer) {
        self.kill();
        server.drop_child(&self.name).await;
        if let Some(leaf) = self.leaf.take() {
            self.cgroups.remove_leaf(&leaf).await;
        }
    }

    pub(super) fn kill(&self) {
        if let Some(pidfd) = &self.pidfd {
            let _ = pidfd::signal(pidfd, pidfd::Signal::KILL);
        }
    }

    /// Its pidfd, exit status and leaf, for the kernel it becomes.
    pub(super) fn into_parts(mut self) -> Option<(OwnedFd, oneshot::Receiver<i32>, Leaf)> {
        Some((self.pidfd.take()?, self.status.take()?, self.leaf.take()?))
    }

    /// Whether it cannot become a kernel: it has ended (its pidfd polls readable), or is
    /// stopped (a kernel of the same user may SIGSTOP it: released, it would never answer).
    pub(super) fn unusable(&self) -> bool {
        let Some(pidfd) = &self.pidfd else {
            return true;
        };
        if !matches!(state_of(self.host_pid), Some('R' | 'S' | 'D')) {
            return true;
        }
        // A poll that fails counts as ended: the stem is not trusted with a kernel.
        pidfd::ended(pidfd).unwrap_or(true)
    }
}

impl Drop for Stem {
    fn drop(&mut self) {
        let Some(leaf) = self.leaf.take() else { return };
        self.kill();
        let cgroups = self.cgroups.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { cgroups.remove_leaf(&leaf).await });
        }
    }
}

impl Template {
    pub(super) fn take_stem(&self) -> Option<Stem> {
        lock(&self.stem).take()
    }

    /// Makes the next stem in the background, unless there is one or one is on its way.
    /// Only on cgroup v1: a stem's leaf becomes the session's by a rename, which v2 does not
    /// allow (there a kernel is forked and moved when it is asked for).
    pub(super) fn ensure_stem(self: &Arc<Self>, user: &SandboxUser, cgroups: &Arc<Cgroups>) {
        if cgroups.version() != CgroupVersion::V1
            || self.ended.load(Ordering::SeqCst)
            || !self.server.usable()
            || lock(&self.stem).is_some()
            || self.stemming.swap(true, Ordering::SeqCst)
        {
            return;
        }
        let (template, user, cgroups) = (self.clone(), user.clone(), cgroups.clone());
        tokio::spawn(async move {
            let limits = template_limits(&user);
            match new_stem(&template, &user, Uuid::new_v4(), limits, &cgroups).await {
                Ok(stem) => {
                    *lock(&template.stem) = Some(stem);
                    // `end` sets `ended` before it takes the stem: either it took this one,
                    // or this sees it ended.
                    if template.ended.load(Ordering::SeqCst) {
                        if let Some(stem) = template.take_stem() {
                            stem.discard(&template.server).await;
                        }
                    }
                }
                Err(e) => {
                    tracing::info!(user = %user.name, error = %e, "no stem made; the next kernel is forked when asked")
                }
            }
            template.stemming.store(false, Ordering::SeqCst);
        });
    }
}

/// A child of `template` in a new leaf named `leaf_name` with `limits`.
pub(super) async fn new_stem(
    template: &Template,
    user: &SandboxUser,
    leaf_name: Uuid,
    limits: KernelLimits,
    cgroups: &Arc<Cgroups>,
) -> Result<Stem, StemError> {
    let server = &template.server;
    let leaf = {
        let (cg, name, user_limits) = (cgroups.clone(), user.name.clone(), user.limits.clone());
        tokio::task::spawn_blocking(move || cg.create_leaf(&name, &user_limits, &limits, leaf_name))
            .await
            .map_err(StemError::Interrupted)?
            .map_err(StemError::Leaf)?
    };
    let name = server.next_name();
    let child = match server.fork_stem(&name).await {
        Ok(child) => child,
        Err(e) => {
            cgroups.remove_leaf(&leaf).await;
            return Err(StemError::Fork(e));
        }
    };
    let inner_pid = child.inner_pid;
    // The child waits for `go`; until then only the broker acts on it.
    let Some((host_pid, pidfd)) = find_child(template.host_pid, inner_pid) else {
        server.drop_child(&name).await;
        server.set_broken();
        cgroups.remove_leaf(&leaf).await;
        return Err(StemError::ChildNotFound(inner_pid));
    };
    let stem = Stem {
        name,
        host_pid,
        pidfd: Some(pidfd),
        status: Some(child.status),
        leaf: Some(leaf),
        cgroups: cgroups.clone(),
    };
    // The move into the leaf waits for an RCU grace period (cgroup v1): off the runtime.
    let (stem, entered) = tokio::task::spawn_blocking(move || {
        let entered = stem
            .leaf
            .as_ref()
            .map_or(Ok(()), |l| l.enter(stem.host_pid));
        (stem, entered)
    })
    .await
    .map_err(StemError::Interrupted)?;
    if let Err(e) = entered {
        stem.discard(server).await;
        return Err(StemError::NotMoved(e));
    }
    Ok(stem)
}

/// Makes `stem` (made ahead of need) the child of `session`: alive, its leaf renamed after
/// the session and given the session's limits.
pub(super) async fn claim(
    stem: Stem,
    template: &Template,
    session: Uuid,
    limits: KernelLimits,
    cgroups: &Arc<Cgroups>,
) -> Result<Stem, StemError> {
    if stem.unusable() {
        stem.discard(&template.server).await;
        return Err(StemError::Unusable);
    }
    let cg = cgroups.clone();
    let (stem, claimed) = tokio::task::spawn_blocking(move || {
        let mut stem = stem;
        let claimed = match stem.leaf.as_mut() {
            Some(leaf) => cg.claim_leaf(leaf, session, &limits),
            None => Ok(()),
        };
        (stem, claimed)
    })
    .await
    .map_err(StemError::Interrupted)?;
    if let Err(e) = claimed {
        stem.discard(&template.server).await;
        return Err(StemError::Leaf(e));
    }
    Ok(stem)
}

/// A template's own leaf limits, which a stem has until it is claimed: no memory limit of
/// its own (the user's total binds it), one session's processes.
pub(super) fn template_limits(user: &SandboxUser) -> KernelLimits {
    KernelLimits {
        memory_bytes: 0,
        pids: user.limits.session_pids,
    }
}
