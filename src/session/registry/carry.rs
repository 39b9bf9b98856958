//! Paused sessions carried between nodes (`--carry-paused`, `session/carry.rs`): one taken
//! over here from its copy, and those of this node another node took over while this one
//! was not live, whose paused state here goes.

use std::sync::Arc;

use uuid::Uuid;

use super::keep::Outcome;
use super::Registry;
use crate::sandbox::carry::Intake;
use crate::sandbox::pause::PausedImage;
use crate::sandbox::SandboxUser;
use crate::session::carry::{CarryError, CopyHead, CopyToTake};
use crate::session::front_door::EndedBy;
use crate::session::handle::Session;
use crate::session::kept::SessionRecord;
use crate::session::state::SessionState;

/// Pieces of a file written at once.
const PAGE_BYTES: usize = 16 << 20;

impl Registry {
    /// Takes over the paused session of `user` whose copy is `copy` (`head` read from it,
    /// its record's secrets sealed by this node; its kernel ran as `uid`): this node's
    /// sandbox makes room for its files, the copy is claimed (the fence), its files are
    /// written (a workspace that came as an archive unpacked), sealed and checked, and it becomes a paused session here whose next use
    /// resumes it. On any failure after the claim, what was written goes and the claim is
    /// given back. `None` if a session of that id is here already.
    pub async fn take_over_copy(
        &self,
        head: CopyHead,
        uid: u32,
        user: &SandboxUser,
        copy: &dyn CopyToTake,
    ) -> Result<Option<Arc<Session>>, CarryError> {
        let failed = |e: &dyn std::fmt::Display| CarryError(e.to_string());
        let started = std::time::Instant::now();
        let sandbox = self.sandbox().carry().ok_or_else(|| {
            CarryError("this node's sandbox cannot take in paused kernels".into())
        })?;
        let intake = sandbox
            .take_in(head.image.clone(), user, uid)
            .await
            .map_err(|e| failed(&e))?;
        let claimed = copy.claim().await;
        if !matches!(claimed, Ok(true)) {
            let _ = tokio::task::spawn_blocking(move || intake.abandon()).await;
            return Err(claimed.err().unwrap_or_else(|| {
                CarryError("another node took it over first, or its node is back".into())
            }));
        }
        let intake = Arc::new(intake);
        let claimed_ms = started.elapsed().as_millis() as u64;
        let filled = match fill(&intake, &head, copy).await {
            Ok(()) => intake.unpack().await.map_err(|e| failed(&e)),
            Err(e) => Err(e),
        };
        let read_ms = started.elapsed().as_millis() as u64 - claimed_ms;
        let taken = match filled {
            Ok(()) => {
                let i = intake.clone();
                tokio::task::spawn_blocking(move || i.finish())
                    .await
                    .map_err(|e| failed(&e))
                    .and_then(|r| r.map_err(|e| failed(&e)))
            }
            Err(e) => Err(e),
        };
        match taken {
            Ok(image) => {
                tracing::info!(session = %head.record.id, claimed_ms, read_ms, total_ms = started.elapsed().as_millis() as u64, "paused session's copy taken in");
                Ok(self.take_over(head.record, image, user).await)
            }
            Err(e) => {
                if let Ok(intake) = Arc::try_unwrap(intake) {
                    let _ = tokio::task::spawn_blocking(move || intake.abandon()).await;
                }
                copy.unclaim().await;
                Err(e)
            }
        }
    }

    /// Takes over the paused session `record` of `user`, whose paused kernel this node's
    /// sandbox took in as `image`: a paused session of the same id here, whose next use
    /// resumes it; its record kept, so that it outlives this broker too. `None` if a
    /// session of that id is here already.
    async fn take_over(
        &self,
        mut record: SessionRecord,
        image: PausedImage,
        user: &SandboxUser,
    ) -> Option<Arc<Session>> {
        if self.table().sessions.contains_key(&record.id) {
            return None;
        }
        record.dead_reason = None;
        record.paused_kernel = Some(image.kernel_id);
        if let Some(store) = &self.inner.paused_records {
            store.save(record.clone()).await;
        }
        let session = self.restore(record, user, Outcome::Paused(image)).await;
        tracing::info!(session = %session.id, user = %user.name, "paused session taken over from another node");
        Some(session)
    }

    /// Of `ids`, this node's paused sessions that another node took over: each one's
    /// paused state here goes (images, record, own workspace), nothing is recorded (the
    /// recording goes on there). A session of these ids that runs here is left alone (it
    /// cannot be: a resume here checks first) and logged.
    pub async fn let_go(&self, ids: &[Uuid]) {
        for id in ids {
            let session = {
                let mut table = self.table();
                match table.sessions.get(id) {
                    Some(s) if s.state() == SessionState::Paused => table.sessions.remove(id),
                    Some(_) => {
                        tracing::error!(session = %id, "another node holds a session that runs here: left alone");
                        None
                    }
                    None => None,
                }
            };
            let Some(session) = session else {
                continue;
            };
            session.taken_over().await;
            session.release_memory();
            self.release_own_workspace(&session).await;
            tracing::warn!(session = %id, "paused session let go: another node took it over while this one was not live");
        }
    }

    /// This node learnt that the cluster declared it lost: its sessions end (the cluster
    /// answered them dead), but the paused ones the cluster kept (`kept`: their state is on
    /// this node's disk; one resumed since is not what was kept), and those another node
    /// took over (`taken`), which are let go.
    pub async fn end_declared_lost(&self, kept: &[Uuid], taken: &[Uuid]) {
        self.let_go(taken).await;
        let sessions: Vec<_> = self
            .all()
            .into_iter()
            .filter(|s| {
                let kept = kept.contains(&s.id) && s.state() == SessionState::Paused;
                !(kept || taken.contains(&s.id))
            })
            .collect();
        futures::future::join_all(
            sessions
                .iter()
                .map(|s| self.delete(&s.user.name, s.id, EndedBy::NodeLost)),
        )
        .await;
        tracing::warn!(
            sessions = sessions.len(),
            "cluster: this node's sessions ended (the cluster had declared them dead)"
        );
    }
}

/// Writes the files of `copy`, as `head` lists them, into `intake`.
async fn fill(
    intake: &Arc<Intake>,
    head: &CopyHead,
    copy: &dyn CopyToTake,
) -> Result<(), CarryError> {
    let failed = |e: &dyn std::fmt::Display| CarryError(e.to_string());
    let expected = intake.expected();
    if expected.len() != head.files.len() || !head.files.iter().all(|(n, _)| expected.contains(n)) {
        let names: Vec<String> = head.files.iter().map(|(n, _)| n.clone()).collect();
        return Err(CarryError(
            intake
                .workspace_mismatch(&names)
                .unwrap_or_else(|| "its copy's files are not those of its record".into()),
        ));
    }
    for (name, len) in &head.files {
        let (i, n, l) = (intake.clone(), name.clone(), *len);
        tokio::task::spawn_blocking(move || i.set_len(&n, l))
            .await
            .map_err(|e| failed(&e))?
            .map_err(|e| failed(&e))?;
        let mut from = 0u64;
        let mut page: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut chunks = copy.chunks(name, from).await?;
        loop {
            let done = chunks.is_empty();
            for (at, data) in chunks {
                if at < from || at + data.len() as u64 > *len {
                    return Err(CarryError(format!(
                        "its copy of {name:?} is not in order or runs past its length"
                    )));
                }
                from = at + data.len().max(1) as u64;
                page.push((at, data));
            }
            if done {
                write_page(intake, name, page).await?;
                break;
            }
            // A full page is written while the next pieces are read (and opened).
            if page.iter().map(|p| p.1.len()).sum::<usize>() >= PAGE_BYTES {
                let written = write_page(intake, name, std::mem::take(&mut page));
                let (written, next) = tokio::join!(written, copy.chunks(name, from));
                written?;
                chunks = next?;
            } else {
                chunks = copy.chunks(name, from).await?;
            }
        }
    }
    Ok(())
}

/// Writes `page` (pieces of file `name`: offset, bytes) into `intake`, on a blocking thread.
async fn write_page(
    intake: &Arc<Intake>,
    name: &str,
    page: Vec<(u64, Vec<u8>)>,
) -> Result<(), CarryError> {
    if page.is_empty() {
        return Ok(());
    }
    let (i, n) = (intake.clone(), name.to_string());
    tokio::task::spawn_blocking(move || {
        page.iter()
            .try_for_each(|(at, data)| i.write(&n, *at, data))
    })
    .await
    .map_err(|e| CarryError(e.to_string()))?
    .map_err(|e| CarryError(e.to_string()))
}
