//! Paused sessions carried to storage every node of a cluster reaches (`--carry-paused`,
//! issue 37): what the session layer asks of whoever carries them (the cluster layer,
//! through the api layer's glue), so that a paused session resumes on any node while its
//! own is not live. The actor hands a copy over as it pauses (its workspace let go before
//! the pause is answered, the bytes stored after, meanwhile) and asks before every resume
//! whether the session is still this node's; a copy that cannot be made leaves the
//! session paused here only, as without the option.

use std::sync::{Arc, OnceLock};

use uuid::Uuid;

use super::kept::SessionRecord;
use crate::sandbox::carry::Carried;
use crate::sandbox::pause::PausedImage;

/// Why a copy could not be stored, or a resume's check not made.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CarryError(pub String);

/// What a copy holds besides the kernel's files: what the taking node restores the session
/// from (the record's secrets sealed under a key every node of the cluster has).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CopyHead {
    pub record: SessionRecord,
    pub image: PausedImage,
    /// Each file's name and length.
    pub files: Vec<(String, u64)>,
}

/// One file of a copy to store, open: its data is at `extents` (offset, length).
#[derive(Debug)]
pub struct OutFile {
    pub name: String,
    pub file: std::fs::File,
    pub extents: Vec<(u64, u64)>,
}

/// A copy of a paused session to store.
#[derive(Debug)]
pub struct CopyOut {
    /// Its record's secrets are sealed by this node.
    pub head: CopyHead,
    /// The uid its kernel ran as.
    pub uid: u32,
    pub files: Vec<OutFile>,
    /// True while the session is paused with these images (false once it resumes or ends:
    /// the copy is then not stored, or dropped by the resume's check).
    pub current: Arc<std::sync::atomic::AtomicBool>,
}

impl CopyOut {
    /// The copy of the paused session `record`, whose kernel is `image`, its files
    /// `carried`.
    pub(crate) fn new(
        record: SessionRecord,
        image: PausedImage,
        carried: Carried,
        current: Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        Self {
            current,
            head: CopyHead {
                record,
                image,
                files: carried
                    .files
                    .iter()
                    .map(|f| (f.name.clone(), f.len))
                    .collect(),
            },
            uid: carried.uid,
            files: carried
                .files
                .into_iter()
                .map(|f| OutFile {
                    name: f.name,
                    file: f.file,
                    extents: f.extents,
                })
                .collect(),
        }
    }
}

/// A stored copy this node may take over: [`CopyToTake::claim`] is the fence (after it,
/// no other node resumes the session), [`CopyToTake::chunks`] its files' bytes.
#[async_trait::async_trait]
pub trait CopyToTake: Send + Sync {
    /// Makes it this node's; `false` if it is not to be taken (another node took it first,
    /// or its own node is back).
    async fn claim(&self) -> Result<bool, CarryError>;
    /// Gives it back (it could not be taken in here).
    async fn unclaim(&self);
    /// Pieces of file `name` from offset `from` on: (offset, bytes), in order; empty past
    /// its end.
    async fn chunks(&self, name: &str, from: u64) -> Result<Vec<(u64, Vec<u8>)>, CarryError>;
}

/// Whoever carries paused sessions to the other nodes.
#[async_trait::async_trait]
pub trait Carrier: Send + Sync {
    /// Stores `copy`; the bytes stored.
    async fn store(&self, copy: CopyOut) -> Result<u64, CarryError>;
    /// Before this node resumes its paused session `id`: `true` if it still holds it (its
    /// copy then goes), `false` if another node took it over.
    async fn before_resume(&self, id: Uuid) -> Result<bool, CarryError>;
    /// The paused session `id` ended here: its copy goes.
    async fn forget(&self, id: Uuid);
}

/// Where the carrier is, once the cluster is joined (after the registry is made).
#[derive(Clone, Default)]
pub struct CarrierSlot(Arc<OnceLock<Arc<dyn Carrier>>>);

impl std::fmt::Debug for CarrierSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "CarrierSlot(set)"
        } else {
            "CarrierSlot(empty)"
        })
    }
}

impl CarrierSlot {
    pub fn set(&self, carrier: Arc<dyn Carrier>) {
        let _ = self.0.set(carrier);
    }

    pub fn get(&self) -> Option<&Arc<dyn Carrier>> {
        self.0.get()
    }
}

impl super::handle::Session {
    /// Cluster mode with `--carry-paused`, at start: this paused session is carried to the
    /// other nodes, as at its pause (its copy was cut short by this node's stop, or the
    /// option is new). One that is not paused, or not to be carried, stays as it is.
    pub async fn carry_paused(&self) {
        self.tell_actor(|done| super::command::Command::CarryPaused { done })
            .await;
    }
}
