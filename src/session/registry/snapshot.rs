//! Snapshots (issue 37; `session/snapshot.rs` is the book of them): taken of a session by
//! its actor, listed and deleted by their user, started from by a create that names one,
//! and taken back at start-up with their images. Another user's snapshot answers as a
//! missing one everywhere.

use std::sync::Arc;

use chrono::Utc;
use tokio::time::timeout;
use uuid::Uuid;

use super::{CreateOptions, Registry};
use crate::sandbox::SandboxUser;
use crate::session::command::Command;
use crate::session::config::WorkspaceChoice;
use crate::session::error::SessionError;
use crate::session::handle::Session;
use crate::session::launch::{connect_kernel, Live};
use crate::session::snapshot::{check_name, Snapshot, SnapshotInfo};
use crate::wire::Signer;

impl Registry {
    /// Takes a snapshot of the caller's session `id`, named `name`; the session goes on as
    /// it was. Answered once the snapshot's record is on disk.
    pub async fn snapshot(
        &self,
        user: &str,
        id: Uuid,
        name: Option<String>,
    ) -> Result<SnapshotInfo, SessionError> {
        if let Some(name) = &name {
            check_name(name)?;
        }
        let session = self.get(user, id)?;
        if let Some(why) = self.config().copy_refusal(&session.kernel_name) {
            return Err(SessionError::SnapshotRefused { session: id, why });
        }
        if !session.secrets.is_empty() {
            return Err(SessionError::SnapshotRefused {
                session: id,
                why: "the session has secrets, and a snapshot (kept for any later session to \
                      start from) would hold them in its kernel's memory image"
                    .into(),
            });
        }
        if session.own_workspace.is_none() {
            return Err(SessionError::SnapshotRefused {
                session: id,
                why: "a snapshot of a session that shares its user's workspace is not built \
                      yet; a session made with \"workspace\": \"own\" (every E2B sandbox) \
                      can be snapshotted"
                    .into(),
            });
        }
        let book = &self.inner.snapshots;
        book.take_place(user)?;
        let taken = self.take_snapshot(&session, name).await;
        book.untake(user);
        taken
    }

    async fn take_snapshot(
        &self,
        session: &Arc<Session>,
        name: Option<String>,
    ) -> Result<SnapshotInfo, SessionError> {
        let snapshot_id = Uuid::new_v4();
        let mut spec = session.launch_spec(Signer::random_key());
        spec.session_id = snapshot_id;
        spec.own_workspace = Some(snapshot_id);
        let (image, execution_count) =
            Self::ask(session, |done| Command::Snapshot { spec, done }).await??;
        let info = SnapshotInfo {
            snapshot_id,
            name,
            session_id: session.id,
            kernel: session.kernel_name.clone(),
            execution_count,
            created_at: Utc::now(),
            memory_limit_bytes: session.limits.memory_bytes,
            image_bytes: image.bytes,
        };
        let snapshot = Snapshot {
            user: session.user.name.clone(),
            info: info.clone(),
            image,
            in_use: tokio::sync::RwLock::new(false),
        };
        if let Err((e, image)) = self.inner.snapshots.insert(snapshot).await {
            self.inner.sandbox.discard_snapshot(image).await;
            return Err(SessionError::SnapshotFailed {
                what: format!("a snapshot of session {}", session.id),
                why: format!("its record cannot be written: {e}"),
                source: None,
            });
        }
        tracing::info!(session = %session.id, user = %session.user.name, snapshot = %snapshot_id, image_bytes = info.image_bytes, "snapshot taken");
        Ok(info)
    }

    /// The caller's snapshots, oldest first; of session `of` only, if given.
    pub fn snapshots(&self, user: &str, of: Option<Uuid>) -> Vec<SnapshotInfo> {
        let mut all = self.inner.snapshots.list(user);
        if let Some(of) = of {
            all.retain(|s| s.session_id == of);
        }
        all
    }

    /// The caller's snapshot `id`.
    pub fn snapshot_info(&self, user: &str, id: Uuid) -> Result<SnapshotInfo, SessionError> {
        Ok(self.inner.snapshots.get(user, id)?.info.clone())
    }

    /// The caller's snapshot called `name_or_id` (its id, or the newest of that name).
    pub fn find_snapshot(&self, user: &str, name_or_id: &str) -> Option<SnapshotInfo> {
        let book = &self.inner.snapshots;
        match Uuid::parse_str(name_or_id) {
            Ok(id) => book.get(user, id).ok(),
            Err(_) => book.named(user, name_or_id),
        }
        .map(|s| s.info.clone())
    }

    /// Deletes the caller's snapshot `id` once the sessions starting from it have their
    /// copies; sessions started from it go on.
    pub async fn delete_snapshot(&self, user: &str, id: Uuid) -> Result<(), SessionError> {
        let snapshot = self.inner.snapshots.remove(user, id).await?;
        let mut deleted = snapshot.in_use.write().await;
        *deleted = true;
        self.inner
            .sandbox
            .discard_snapshot(snapshot.image.clone())
            .await;
        tracing::info!(%user, snapshot = %id, "snapshot deleted");
        Ok(())
    }

    /// A create naming a snapshot: the snapshot (the caller's), `opts` made to match it
    /// (its kernel, a workspace of the session's own, its memory limit unless another is
    /// asked), or why they cannot.
    pub(super) fn snapshot_to_start(
        &self,
        user: &str,
        opts: &mut CreateOptions,
    ) -> Result<Option<Arc<Snapshot>>, SessionError> {
        let Some(id) = opts.snapshot else {
            return Ok(None);
        };
        let snapshot = self.inner.snapshots.get(user, id)?;
        let info = &snapshot.info;
        match &opts.kernel {
            Some(k) if *k != info.kernel => {
                return Err(SessionError::SnapshotMismatch(format!(
                    "snapshot {id} is of a {} kernel, not {k}",
                    info.kernel
                )))
            }
            _ => opts.kernel = Some(info.kernel.clone()),
        }
        if let WorkspaceChoice::OwnOf(_) = opts.workspace {
            return Err(SessionError::SnapshotMismatch(
                "a session from a snapshot has a workspace of its own (a copy of the \
                 snapshot's), not another session's"
                    .into(),
            ));
        }
        opts.workspace = WorkspaceChoice::Own;
        opts.memory_limit_bytes = opts.memory_limit_bytes.or(Some(info.memory_limit_bytes));
        Ok(Some(snapshot))
    }

    /// `session`'s kernel, from `snapshot`: restored, connected and ready, its execution
    /// count the snapshot's.
    pub(super) async fn start_from_snapshot(
        &self,
        session: &Arc<Session>,
        snapshot: &Snapshot,
    ) -> Result<Live, SessionError> {
        let in_use = snapshot.in_use.read().await;
        if *in_use {
            return Err(SessionError::SnapshotNotFound(snapshot.info.snapshot_id));
        }
        let sandbox = &self.inner.sandbox;
        let key = Signer::random_key();
        let spec = session.launch_spec(key.clone());
        let limit = sandbox.launch_timeout();
        let failed = |why: String| SessionError::SnapshotFailed {
            what: format!(
                "starting session {} from snapshot {}",
                session.id, snapshot.info.snapshot_id
            ),
            why,
            source: None,
        };
        let launched =
            match timeout(limit, sandbox.start_from_snapshot(&snapshot.image, spec)).await {
                Ok(Ok(launched)) => launched,
                Ok(Err(crate::sandbox::fork::ForkError::NoRoom(why))) => {
                    return Err(SessionError::NoRoomForSnapshot {
                        session: session.id,
                        why,
                    })
                }
                Ok(Err(e)) => return Err(failed(e.to_string())),
                Err(_) => return Err(failed(format!("it did not start within {limit:?}"))),
            };
        drop(in_use);
        let live = connect_kernel(
            launched,
            key,
            &session.user.name,
            self.inner.config.kernel,
            limit,
        )
        .await
        .map_err(|e| failed(e.to_string()))?;
        session.set_execution_count(snapshot.info.execution_count);
        Ok(live)
    }

    /// Takes back the snapshots an earlier run left (their records and images); a record
    /// whose images or user are gone goes, and so do images without a record. Returns how
    /// many came back.
    pub async fn adopt_snapshots(&self, users: &[SandboxUser]) -> usize {
        let book = &self.inner.snapshots;
        let records = book.load_all().await;
        let mut images = self.inner.sandbox.snapshot_images().await;
        let mut adopted = 0;
        for record in records {
            let id = record.info.snapshot_id;
            let image = images
                .iter()
                .position(|i| i.kernel_id == id)
                .map(|i| images.swap_remove(i));
            match image {
                Some(image) if users.iter().any(|u| u.name == record.user) => {
                    book.adopt(Snapshot {
                        user: record.user,
                        info: record.info,
                        image,
                        in_use: tokio::sync::RwLock::new(false),
                    });
                    adopted += 1;
                }
                image => {
                    tracing::warn!(snapshot = %id, user = %record.user, "a snapshot's images or user are gone: it is not taken back");
                    book.forget_record(id).await;
                    if let Some(image) = image {
                        self.inner.sandbox.discard_snapshot(image).await;
                    }
                }
            }
        }
        for image in images {
            self.inner.sandbox.discard_snapshot(image).await;
        }
        if adopted > 0 {
            tracing::info!(count = adopted, "snapshots taken back");
        }
        adopted
    }
}
