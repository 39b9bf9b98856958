//! Room on the data directory's file system for the images of copies in the making.
//!
//! A copy's images hold its kernel's memory (up to the kernel's memory limit), written to
//! `<data_dir>/copies` (`copies-docker`) until the copy is restored. Without a bound, forks
//! of large kernels, several sessions at once, could fill the file system the broker keeps
//! its recordings, kept sessions and workspaces on, failing every user's writes. So a copy
//! reserves what its images will take, the kernel's resident memory, before anything is
//! made, and is refused (`507`) when the file system's free space, less what copies under
//! way have reserved, would fall under the operator's reserve (`--copy-reserve-bytes`).

use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::sandbox::procfs;

/// Why no room was reserved.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RoomError {
    /// The file system has too little room free: the text says what was needed and what is.
    #[error("{0}")]
    NoRoom(String),
    /// The kernel's memory or the free space could not be read.
    #[error("{0}")]
    Unknown(String),
}

/// What a copy leaves free on the data directory's file system unless the operator says
/// (`--copy-reserve-bytes`).
pub const DEFAULT_COPY_RESERVE: u64 = 1 << 30;

/// What CRIU writes besides the pages: descriptors, the memory map, the core files.
const IMAGE_OVERHEAD: u64 = 16 << 20;

/// The reservations of one sandbox's copies under way.
#[derive(Debug, Default)]
pub(crate) struct CopyRoom {
    reserved: Mutex<u64>,
}

/// Room held for one copy's images; given back when dropped (the images removed by then).
#[derive(Debug)]
pub(crate) struct Reserved {
    room: Arc<CopyRoom>,
    bytes: u64,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let mut reserved = self.room.reserved.lock().unwrap_or_else(|e| e.into_inner());
        *reserved = reserved.saturating_sub(self.bytes);
    }
}

impl CopyRoom {
    /// Reserves room in `dir` (a directory on the file system the images go to) for a copy
    /// of the kernel `host_pid`, leaving `keep_free` bytes free; or the refusal, saying what
    /// was needed and what there is. Blocking (`statvfs`, procfs).
    pub(crate) fn reserve_for(
        self: &Arc<Self>,
        dir: &Path,
        host_pid: i32,
        keep_free: u64,
    ) -> Result<Reserved, RoomError> {
        let resident = procfs::resident_bytes(host_pid).ok_or_else(|| {
            RoomError::Unknown("the kernel's memory could not be read (has it ended?)".into())
        })?;
        let free = free_bytes(dir).map_err(|e| {
            RoomError::Unknown(format!(
                "cannot read the free space of {}: {e}",
                dir.display()
            ))
        })?;
        self.reserve(resident.saturating_add(IMAGE_OVERHEAD), free, keep_free)
    }

    fn reserve(
        self: &Arc<Self>,
        need: u64,
        free: u64,
        keep_free: u64,
    ) -> Result<Reserved, RoomError> {
        let mut reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let left = free.saturating_sub(*reserved).saturating_sub(keep_free);
        if need > left {
            return Err(RoomError::NoRoom(format!(
                "its images need about {} MiB on the broker's data file system, which has {} MiB \
                 free, {} MiB of it held for copies under way and {} MiB kept free \
                 (--copy-reserve-bytes); try again when other copies are done, or ask the \
                 operator for room",
                mib(need),
                mib(free),
                mib(*reserved),
                mib(keep_free)
            )));
        }
        *reserved += need;
        Ok(Reserved {
            room: self.clone(),
            bytes: need,
        })
    }
}

fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

/// Bytes an unprivileged writer could still write: root's own reserve is not counted, so
/// the broker leaves it to the system.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let st = rustix::fs::statvfs(dir)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_add_up_and_are_given_back() {
        let room = Arc::new(CopyRoom::default());
        let a = room.reserve(40, 100, 10).unwrap();
        // 100 free, 40 held, 10 kept: 50 left.
        let err = room.reserve(51, 100, 10).unwrap_err().to_string();
        assert!(err.contains("held for copies under way"), "{err}");
        let b = room.reserve(50, 100, 10).unwrap();
        assert!(room.reserve(1, 100, 10).is_err());
        drop(a);
        drop(b);
        assert!(room.reserve(90, 100, 10).is_ok());
    }

    #[test]
    fn a_copy_of_a_real_process_needs_its_resident_memory() {
        let dir = tempfile::tempdir().unwrap();
        let room = Arc::new(CopyRoom::default());
        let me = std::process::id() as i32;
        let held = room.reserve_for(dir.path(), me, 0).unwrap();
        let resident = procfs::resident_bytes(me).unwrap();
        assert!(held.bytes >= resident + IMAGE_OVERHEAD / 2, "{held:?}");
        // Keeping all the file system's space free refuses, saying why.
        let free = free_bytes(dir.path()).unwrap();
        let err = room.reserve_for(dir.path(), me, free).unwrap_err();
        assert!(matches!(err, RoomError::NoRoom(_)), "{err}");
        // A process that is gone is a failure, not a room question.
        assert!(matches!(
            room.reserve_for(dir.path(), i32::MAX, 0),
            Err(RoomError::Unknown(_))
        ));
    }
}
