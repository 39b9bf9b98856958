//! Paused sessions carried through the cluster's database (`--carry-paused`): the glue
//! between the session layer's [`Carrier`] (`session/carry.rs`: when), the cluster's copies
//! (`cluster/copies.rs`: the database, and who holds a session) and the sandbox's intake
//! (`sandbox/carry.rs`: the files). A request about a paused session whose node is not live
//! takes it over here ([`take_over`]); at start-up this node takes in what it had claimed
//! before it stopped, and lets go of what others took over meanwhile ([`start`]).
//!
//! A copy's record has its secrets sealed under a key every node derives from the
//! cluster's key (each node's own `secrets.key` seals its local records).

use std::sync::Arc;

use uuid::Uuid;

use crate::api::auth::User;
use crate::cluster::{Cluster, CopyFile, StoredCopy};
use crate::secrets::seal::Sealer;
use crate::session::carry::{Carrier, CarryError, CopyHead, CopyOut, CopyToTake};
use crate::session::{Registry, SessionRecord};

/// What a copy's sealing key is derived for (with the cluster's key).
const PURPOSE: &str = "kernel-broker: paused sessions' copies";

/// Pieces of a file read from the database at once.
const PAGE: i64 = 8;

/// Why a paused session could not be taken over here.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(super) struct NotTaken(String);

macro_rules! not_taken_from {
    ($($t:ty),*) => {$(
        impl From<$t> for NotTaken {
            fn from(e: $t) -> Self {
                NotTaken(e.to_string())
            }
        }
    )*};
}
not_taken_from!(crate::cluster::ClusterError, serde_json::Error, CarryError);

/// The carrier of this node: copies in the cluster's database.
struct DbCarrier {
    cluster: Arc<Cluster>,
    node: Sealer,
    shared: Sealer,
}

/// `record`'s secrets sealed by `from`, sealed by `to` instead.
fn reseal(record: &mut SessionRecord, from: &Sealer, to: &Sealer) -> Result<(), CarryError> {
    if let Some(sealed) = &record.secrets {
        let values = from
            .unseal(record.id, sealed)
            .ok_or_else(|| CarryError("the session's secrets do not unseal".into()))?;
        record.secrets = Some(to.seal(record.id, &values));
    }
    Ok(())
}

#[async_trait::async_trait]
impl Carrier for DbCarrier {
    async fn store(&self, mut copy: CopyOut) -> Result<u64, CarryError> {
        reseal(&mut copy.head.record, &self.node, &self.shared)?;
        let record = &copy.head.record;
        let stored = StoredCopy {
            session: record.id,
            user: record.user.clone(),
            kernel: record.kernel.clone(),
            created_at: record.created_at.timestamp_micros(),
            uid: copy.uid,
            head: serde_json::to_vec(&copy.head).map_err(|e| CarryError(e.to_string()))?,
            current: copy.current,
            files: copy
                .files
                .into_iter()
                .map(|f| CopyFile {
                    name: f.name,
                    file: f.file,
                    extents: f.extents,
                })
                .collect(),
        };
        match self.cluster.store_copy(stored).await {
            Ok(Some(bytes)) => Ok(bytes),
            Ok(None) => Err(CarryError(
                "it resumed or ended before its copy was stored, or the session directory says \
                 this node does not hold it (or this node was declared lost)"
                    .into(),
            )),
            Err(e) => Err(CarryError(e.to_string())),
        }
    }

    async fn before_resume(&self, id: Uuid) -> Result<bool, CarryError> {
        self.cluster
            .fence_resume(id)
            .await
            .map_err(|e| CarryError(e.to_string()))
    }

    async fn forget(&self, id: Uuid) {
        if let Err(e) = self.cluster.drop_copy(id).await {
            tracing::warn!(session = %id, error = %e, "cluster: cannot drop an ended session's copy");
        }
    }
}

/// Start-up in cluster mode with `--carry-paused`: this node carries its paused sessions
/// from now on; the paused sessions of its own another node took over while it was away
/// go; those without a copy (cut short by its stop) are carried; the copies it claimed
/// before it stopped, and had not taken in, are taken in. Without the database, none of
/// it (the fence still holds: a resume asks the database first).
pub async fn start(registry: &Registry, cluster: &Arc<Cluster>, users: &[User]) {
    let Some(node) = registry.config().sealer.clone() else {
        tracing::warn!("cluster: paused sessions are not carried: this node keeps no records");
        return;
    };
    registry.config().carrier.set(Arc::new(DbCarrier {
        cluster: cluster.clone(),
        node,
        shared: Sealer::derived(PURPOSE, cluster.key().as_bytes()),
    }));
    let paused: Vec<Uuid> = registry
        .all()
        .iter()
        .filter(|s| s.state() == crate::session::SessionState::Paused)
        .map(|s| s.id)
        .collect();
    let taken = match cluster.held_elsewhere(&paused).await {
        Ok(taken) => taken,
        Err(e) => {
            tracing::warn!(error = %e, "cluster: cannot read which paused sessions others took over");
            return;
        }
    };
    registry.let_go(&taken).await;
    let claimed = match cluster.copies_here().await {
        Ok(claimed) => claimed,
        Err(e) => {
            tracing::warn!(error = %e, "cluster: cannot read the copies this node holds");
            return;
        }
    };
    let all = registry.all();
    // This node's paused sessions without a copy (cut short by its stop, or paused before
    // the option): carried now, in the background, each as at its pause.
    let uncarried: Vec<_> = all
        .iter()
        .filter(|s| {
            s.state() == crate::session::SessionState::Paused
                && !taken.contains(&s.id)
                && !claimed.iter().any(|(id, _)| *id == s.id)
        })
        .cloned()
        .collect();
    tokio::spawn(async move {
        for session in uncarried {
            session.carry_paused().await;
        }
    });
    for (id, name) in claimed {
        if all.iter().any(|s| s.id == id) {
            continue;
        }
        let Some(user) = users.iter().find(|u| u.name == name) else {
            continue;
        };
        let me = cluster.node_id().to_string();
        match take_over(registry, cluster, user, id, &me).await {
            Ok(()) => {
                tracing::info!(session = %id, "cluster: a paused session claimed before the stop taken in")
            }
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "cluster: cannot take in a paused session claimed before the stop")
            }
        }
    }
}

/// One takeover at a time on this node (two requests for one session must not both write
/// its files).
static TAKING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A copy in the cluster's database, to be taken over from node `from`.
struct DbCopy<'a> {
    cluster: &'a Cluster,
    id: Uuid,
    user: &'a str,
    from: &'a str,
}

#[async_trait::async_trait]
impl CopyToTake for DbCopy<'_> {
    async fn claim(&self) -> Result<bool, CarryError> {
        if self.from == self.cluster.node_id() {
            // Claimed before a stop: this node's already.
            return Ok(true);
        }
        self.cluster
            .claim_copy(self.id, self.user, self.from)
            .await
            .map_err(|e| CarryError(e.to_string()))
    }

    async fn unclaim(&self) {
        if self.from == self.cluster.node_id() {
            return;
        }
        if let Err(e) = self.cluster.unclaim_copy(self.id, self.from).await {
            tracing::warn!(session = %self.id, error = %e, "cluster: cannot give a claimed session back");
        }
    }

    async fn chunks(&self, name: &str, from: u64) -> Result<Vec<(u64, Vec<u8>)>, CarryError> {
        self.cluster
            .copy_chunks(self.id, name, from, PAGE)
            .await
            .map_err(|e| CarryError(e.to_string()))
    }
}

/// Takes `user`'s paused session `id` over from node `from` (not live): claims it, takes its
/// copy's files in, and makes it a paused session here. `from` may be this node (a claim
/// made before a stop: taken in, not claimed again).
pub(super) async fn take_over(
    registry: &Registry,
    cluster: &Cluster,
    user: &User,
    id: Uuid,
    from: &str,
) -> Result<(), NotTaken> {
    let _one = TAKING.lock().await;
    if registry.get(&user.name, id).is_ok() {
        return Ok(());
    }
    if registry.config().carrier.get().is_none() {
        return Err(NotTaken(
            "this node does not carry paused sessions (--carry-paused)".into(),
        ));
    }
    let node = registry
        .config()
        .sealer
        .clone()
        .ok_or_else(|| NotTaken("this node keeps no records".into()))?;
    let copy = cluster
        .find_copy(id, &user.name)
        .await?
        .ok_or_else(|| NotTaken("its copy is gone".into()))?;
    if copy.node != from {
        return Err(NotTaken(format!("node {} holds it now", copy.node)));
    }
    let mut head: CopyHead = serde_json::from_slice(&copy.head)?;
    if head.record.id != id || head.record.user != user.name {
        return Err(NotTaken("its copy is another session's".into()));
    }
    let shared = Sealer::derived(PURPOSE, cluster.key().as_bytes());
    reseal(&mut head.record, &shared, &node)?;
    let source = DbCopy {
        cluster,
        id,
        user: &user.name,
        from,
    };
    let taken = registry
        .take_over_copy(head, copy.uid, &user.sandbox_user(), &source)
        .await?;
    if let Some(session) = taken {
        session.set_pause_policy(user.pause);
    }
    Ok(())
}
