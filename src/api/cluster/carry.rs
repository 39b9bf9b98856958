//! Paused sessions carried through the cluster's database (`--carry-paused`): the glue
//! between the session layer's [`Carrier`] (`session/carry.rs`: when), the cluster's copies
//! (`cluster/copies.rs`: the database, and who holds a session) and the sandbox's intake
//! (`sandbox/carry.rs`: the files). A request about a paused session whose node is not live
//! takes it over here ([`take_over`]); at start-up this node takes in what it had claimed
//! before it stopped, and lets go of what others took over meanwhile ([`start`]).
//!
//! A copy is sealed under a key every node derives from `--carry-key-file`, or else from
//! the cluster's key (each node's own `secrets.key` seals its local records): its head
//! (the record, the images' lengths and CRC-32s) bound to the session, each piece of its
//! files bound to the session, to that head (a fresh nonce each store) and to its file and
//! offset, and a manifest of how many pieces each file has. The database holds nothing of a paused kernel's memory or files
//! in the clear, and a copy altered there (a piece changed, moved, taken out, or brought
//! from another copy) is refused by the node that would take it over.

use std::collections::BTreeMap;
use std::sync::Arc;

use sha2::Digest;
use uuid::Uuid;

use crate::api::auth::User;
use crate::cluster::{Cluster, CopyFile, PieceSeal, StoredCopy, MANIFEST};
use crate::secrets::seal::Sealer;
use crate::session::carry::{Carrier, CarryError, CopyHead, CopyOut, CopyToTake};
use crate::session::{Registry, SessionRecord};

/// What a copy's sealing key is derived for (with `Cluster::carry_secret`).
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

/// What a copy's head is sealed with: bound to its session.
fn head_aad(id: Uuid) -> Vec<u8> {
    let mut aad = b"kernel-broker copy head\0".to_vec();
    aad.extend_from_slice(id.as_bytes());
    aad
}

/// What binds a copy's pieces to it: its session, and its sealed head (whose nonce is new
/// at each store, so no piece of an earlier copy of the session fits).
fn binding(id: Uuid, sealed_head: &[u8]) -> Vec<u8> {
    let mut b = b"kernel-broker copy piece\0".to_vec();
    b.extend_from_slice(id.as_bytes());
    b.extend_from_slice(&sha2::Sha256::digest(sealed_head)[..16]);
    b
}

/// What piece `at` of file `name` is sealed with.
fn piece_aad(binding: &[u8], name: &str, at: u64) -> Vec<u8> {
    let mut aad = binding.to_vec();
    aad.extend_from_slice(name.as_bytes());
    aad.push(0);
    aad.extend_from_slice(&at.to_be_bytes());
    aad
}

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
        let head = serde_json::to_vec(&copy.head).map_err(|e| CarryError(e.to_string()))?;
        let head = self.shared.seal_bytes(&head_aad(record.id), &head);
        let bind = binding(record.id, &head);
        let sealer = self.shared.clone();
        let seal = PieceSeal(Arc::new(move |name: &str, at: u64, data: &[u8]| {
            sealer.seal_bytes(&piece_aad(&bind, name, at), data)
        }));
        let stored = StoredCopy {
            session: record.id,
            user: record.user.clone(),
            kernel: record.kernel.clone(),
            created_at: record.created_at.timestamp_micros(),
            uid: copy.uid,
            head,
            seal,
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

/// The key copies in the database are sealed with: derived from `--carry-key-file` when
/// given, else from the cluster's key.
fn copies_sealer(cluster: &Cluster) -> Sealer {
    Sealer::derived(PURPOSE, cluster.carry_secret())
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
        shared: copies_sealer(cluster),
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
    // the option) or with one in the clear (stored before copies were sealed): carried
    // now, in the background, each as at its pause.
    let shared = copies_sealer(cluster);
    let sealed_copy = |id: Uuid| {
        claimed
            .iter()
            .any(|(c, _, head)| *c == id && shared.open_bytes(&head_aad(id), head).is_some())
    };
    let uncarried: Vec<_> = all
        .iter()
        .filter(|s| {
            s.state() == crate::session::SessionState::Paused
                && !taken.contains(&s.id)
                && !sealed_copy(s.id)
        })
        .cloned()
        .collect();
    tokio::spawn(async move {
        for session in uncarried {
            session.carry_paused().await;
        }
    });
    for (id, name, _) in claimed {
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

/// A copy in the cluster's database, to be taken over from node `from`: its pieces opened
/// with the cluster's copies' key (`shared`) as they are read, and counted against its
/// manifest.
struct DbCopy<'a> {
    cluster: &'a Cluster,
    id: Uuid,
    user: &'a str,
    from: &'a str,
    shared: &'a Sealer,
    /// [`binding`] of its sealed head.
    binding: Vec<u8>,
    manifest: tokio::sync::OnceCell<BTreeMap<String, u64>>,
    /// Pieces read so far, by file.
    read: std::sync::Mutex<BTreeMap<String, u64>>,
}

impl DbCopy<'_> {
    /// How many pieces each file of the copy has, as its node stored them.
    async fn manifest(&self) -> Result<&BTreeMap<String, u64>, CarryError> {
        self.manifest
            .get_or_try_init(|| async {
                let rows = self
                    .cluster
                    .copy_chunks(self.id, MANIFEST, 0, 1)
                    .await
                    .map_err(|e| CarryError(e.to_string()))?;
                rows.first()
                    .and_then(|(at, sealed)| {
                        let plain = self
                            .shared
                            .open_bytes(&piece_aad(&self.binding, MANIFEST, *at), sealed)?;
                        serde_json::from_slice(&plain).ok()
                    })
                    .ok_or_else(|| {
                        CarryError(
                            "its copy is altered: its manifest is missing or does not open".into(),
                        )
                    })
            })
            .await
    }
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
        let stored = self.manifest().await?.get(name).copied().unwrap_or(0);
        let rows = self
            .cluster
            .copy_chunks(self.id, name, from, PAGE)
            .await
            .map_err(|e| CarryError(e.to_string()))?;
        let (sealer, binding, file) = (self.shared.clone(), self.binding.clone(), name.to_string());
        let pieces = tokio::task::spawn_blocking(move || {
            rows.into_iter()
                .map(|(at, sealed)| {
                    sealer
                        .open_bytes(&piece_aad(&binding, &file, at), &sealed)
                        .map(|plain| (at, plain))
                        .ok_or_else(|| {
                            CarryError(format!(
                                "its copy is altered: piece {at} of {file:?} does not open"
                            ))
                        })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| CarryError(e.to_string()))??;
        let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let count = read.entry(name.to_string()).or_insert(0);
        *count += pieces.len() as u64;
        if pieces.is_empty() && *count != stored {
            return Err(CarryError(format!(
                "its copy is altered: {name:?} has {count} pieces, and its node stored {stored}"
            )));
        }
        Ok(pieces)
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
    let shared = copies_sealer(cluster);
    let opened = shared
        .open_bytes(&head_aad(id), &copy.head)
        .ok_or_else(|| {
            NotTaken(
            "its copy does not open with this cluster's key: altered in the database, or stored \
             by a broker before copies were sealed (its node carries it again at its next start)"
                .into(),
        )
        })?;
    let mut head: CopyHead = serde_json::from_slice(&opened)?;
    if head.record.id != id || head.record.user != user.name {
        return Err(NotTaken("its copy is another session's".into()));
    }
    reseal(&mut head.record, &shared, &node)?;
    let source = DbCopy {
        cluster,
        id,
        user: &user.name,
        from,
        shared: &shared,
        binding: binding(id, &copy.head),
        manifest: tokio::sync::OnceCell::new(),
        read: Default::default(),
    };
    let taken = registry
        .take_over_copy(head, copy.uid, &user.sandbox_user(), &source)
        .await?;
    if let Some(session) = taken {
        session.set_pause_policy(user.pause);
    }
    Ok(())
}
