//! Pausing a kernel to disk and resuming it (issue 37): what the session layer and a
//! backend exchange.
//!
//! A pause is the first half of a copy into a sandbox of its own (`local/copy.rs`,
//! `docs/CRIU.md`) kept on disk: the kernel is asked for a held child
//! (`kb_fork_request {"hold": ...}`), the sandbox checks the pid it reports as a fork's,
//! CRIU dumps that child into a directory of the broker's beneath a root-only one, and
//! the images are sealed (root's, read-only, regular files with one link). The live kernel
//! then ends. A resume is the second half: a new sandbox of the session's (its workspace,
//! its limits) whose command is CRIU restoring those images as the kernel's uid, never as
//! root; the restored process is woken, reads that sandbox's connection file and builds
//! its kernel there. Until the resume has the kernel running, the images stay: a resume
//! that fails may be asked again, and nothing acknowledged is lost.

use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use rustix::fs::{Mode, OFlags};
use uuid::Uuid;

use crate::sandbox::criu::copy_failed;
use crate::sandbox::fork::ForkError;

/// A kernel paused to disk: where its images are and what they hold. Kept beside the
/// images as [`RECORD_NAME`] (the local sandbox), so a paused session outlives the broker.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PausedImage {
    /// The images' directory on the host (root's, beneath a root-only directory).
    pub(crate) dir: PathBuf,
    /// The held child's pid in its pid namespace: CRIU restores it under the same one.
    pub(crate) pid: i64,
    /// The own workspace its files are in (`None`: the user's shared one).
    pub(crate) own_workspace: Option<Uuid>,
    /// The kernel id it was paused under, which its resume takes again (the Docker
    /// sandbox's held child reads its connection file in that id's session directory).
    pub kernel_id: Uuid,
    /// What the images take on disk, in bytes.
    pub bytes: u64,
    /// How long the dump took.
    #[serde(with = "millis")]
    pub dump_time: std::time::Duration,
    /// Each image file as it was sealed: checked before a restore, so a damaged image is
    /// refused with a clear error (CRIU restoring a truncated one was measured to spin in
    /// its restorer until its time ran out).
    pub(crate) files: Vec<ImageFile>,
}

impl PausedImage {
    /// The image of the held child `pid` dumped for `spec` into `dir`, made of `files`
    /// (as sealed) in `dump_time`.
    pub(crate) fn new(
        dir: PathBuf,
        pid: i64,
        spec: &crate::sandbox::LaunchSpec,
        files: Vec<ImageFile>,
        dump_time: std::time::Duration,
    ) -> Self {
        PausedImage {
            dir,
            pid,
            own_workspace: spec.own_workspace,
            kernel_id: spec.session_id,
            bytes: files.iter().map(|f| f.len).sum(),
            dump_time,
            files,
        }
    }
}

/// One image file of a paused kernel, as sealed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ImageFile {
    pub name: String,
    pub len: u64,
    pub crc32: u32,
}

/// The files of the sealed images' directory `dir`, each read whole. Blocking.
pub(crate) fn inventory(dir: &OwnedFd) -> io::Result<Vec<ImageFile>> {
    let mut names = Vec::new();
    let mut entries = rustix::fs::Dir::read_from(dir)?;
    while let Some(entry) = entries.read() {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name != "." && name != ".." && name != RECORD_NAME {
            names.push(name);
        }
    }
    names.sort();
    let mut files = Vec::with_capacity(names.len());
    let mut buf = vec![0u8; 1 << 20];
    for name in names {
        let fd = rustix::fs::openat(
            dir,
            name.as_str(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_nlink != 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{name:?} is not an image file"),
            ));
        }
        let mut file = std::fs::File::from(fd);
        let (mut crc, mut len) = (crc32fast::Hasher::new(), 0u64);
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            crc.update(&buf[..n]);
            len += n as u64;
        }
        files.push(ImageFile {
            name,
            len,
            crc32: crc.finalize(),
        });
    }
    Ok(files)
}

/// A paused kernel's images are not as they were sealed; the text says how.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ImagesDamaged(String);

/// Whether `dir` holds exactly the files `sealed` lists, as they were; else what differs.
/// Blocking.
pub(crate) fn check_inventory(dir: &OwnedFd, sealed: &[ImageFile]) -> Result<(), ImagesDamaged> {
    let now =
        inventory(dir).map_err(|e| ImagesDamaged(format!("its images cannot be read: {e}")))?;
    if now == sealed {
        return Ok(());
    }
    let changed: Vec<&str> = sealed
        .iter()
        .filter(|f| !now.contains(f))
        .map(|f| f.name.as_str())
        .chain(
            now.iter()
                .filter(|f| !sealed.iter().any(|s| s.name == f.name))
                .map(|f| f.name.as_str()),
        )
        .take(4)
        .collect();
    Err(ImagesDamaged(format!(
        "its images are not as they were written (changed, missing or added: {})",
        changed.join(", ")
    )))
}

/// The images' directory of `image`, opened, once its files are checked to be as they were
/// sealed ([`check_inventory`]): what a resume hands CRIU.
pub(crate) async fn open_checked(image: &PausedImage) -> Result<OwnedFd, ForkError> {
    let images = crate::sandbox::fsutil::open_tree_root(&image.dir)
        .map_err(|e| copy_failed(format!("its images cannot be opened: {e}")))?;
    let (checked, files) = (
        images.try_clone().map_err(|e| copy_failed(e.to_string()))?,
        image.files.clone(),
    );
    tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let checked = check_inventory(&checked, &files);
        tracing::debug!(
            ms = started.elapsed().as_millis() as u64,
            "paused images checked"
        );
        checked
    })
    .await
    .map_err(|e| copy_failed(format!("the images' task failed: {e}")))?
    .map_err(|e| copy_failed(e.to_string()))?;
    Ok(images)
}

/// The inventory of the sealed images in `images` ([`inventory`]), in a blocking task;
/// with the directory back.
pub(crate) async fn list_images(images: OwnedFd) -> Result<(Vec<ImageFile>, OwnedFd), ForkError> {
    tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let listed = inventory(&images);
        tracing::debug!(
            ms = started.elapsed().as_millis() as u64,
            "paused images listed"
        );
        listed.map(|files| (files, images))
    })
    .await
    .map_err(|e| copy_failed(format!("the images' task failed: {e}")))?
    .map_err(|e| copy_failed(format!("its images cannot be read: {e}")))
}

/// Makes the directory `<parent>/<name>` for a paused kernel's images (`parent` root's,
/// 0700; the directory the kernel's `ids`', for CRIU to write in, sealed root's after).
pub(crate) async fn make_images_dir(
    parent: PathBuf,
    name: String,
    ids: (u32, u32),
) -> Result<PathBuf, ForkError> {
    tokio::task::spawn_blocking(move || -> Result<PathBuf, ForkError> {
        use std::os::fd::AsFd;
        let made = parent.join(&name);
        crate::sandbox::fsutil::create_private_dir(&parent, Some(0o700))?;
        let dir = crate::sandbox::fsutil::open_tree_root(&parent).map_err(
            crate::sandbox::fsutil::io_err("cannot open the images' parent directory", &parent),
        )?;
        crate::sandbox::fsutil::make_dir_at(
            dir.as_fd(),
            std::path::Path::new(&name),
            0o700,
            Some(ids),
        )
        .map_err(crate::sandbox::fsutil::io_err(
            "cannot create the images' directory",
            &made,
        ))?;
        Ok(made)
    })
    .await
    .unwrap_or_else(|e| Err(copy_failed(format!("the task failed: {e}"))))
}

/// At startup: the images' directories in `dir` an earlier run left with their records
/// (`what` names them in the log); anything else there (a dump cut short, before its
/// record) goes: it holds a kernel's memory. Only root can enter `dir`.
pub(crate) async fn keep_recorded(dir: PathBuf, what: &'static str) -> Vec<PausedImage> {
    tokio::task::spawn_blocking(move || {
        let mut kept = Vec::new();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return kept;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            match is_dir.then(|| read_record(&path, &name)).flatten() {
                Some(image) => kept.push(image),
                None => {
                    // A CRIU an earlier run started may still be writing in it (the broker
                    // was killed mid-dump, CRIU was not): tried again for a few seconds.
                    let mut removed = Ok(());
                    for attempt in 0..10 {
                        if attempt > 0 {
                            std::thread::sleep(std::time::Duration::from_millis(300));
                        }
                        removed = if is_dir {
                            std::fs::remove_dir_all(&path)
                        } else {
                            std::fs::remove_file(&path)
                        };
                        if removed.is_ok() {
                            break;
                        }
                    }
                    if let Err(e) = removed {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove what an unfinished dump left");
                    }
                }
            }
        }
        if !kept.is_empty() {
            tracing::info!(count = kept.len(), "{what} kept by an earlier run");
        }
        kept
    })
    .await
    .unwrap_or_default()
}

/// Which of an earlier run's kept images: paused kernels or snapshots.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Found {
    Paused = 0,
    Snapshots = 1,
}

/// What a sandbox's start-up found of an earlier run's paused kernels and snapshots (with
/// their records, `keep_recorded`), until the session layer takes each list, once
/// (`Sandbox::paused_images`, `Sandbox::snapshot_images`).
#[derive(Debug, Default)]
pub(crate) struct FoundImages(std::sync::Mutex<[Vec<PausedImage>; 2]>);

impl FoundImages {
    /// Start-up's finds.
    pub(crate) fn set(&self, paused: Vec<PausedImage>, snapshots: Vec<PausedImage>) {
        *crate::sync::lock(&self.0) = [paused, snapshots];
    }

    /// One list, once, after `started` (the sandbox's start-up, which finds them).
    pub(crate) async fn take_after<T>(
        &self,
        started: impl std::future::Future<Output = Result<T, crate::sandbox::SandboxError>>,
        which: Found,
    ) -> Vec<PausedImage> {
        if let Err(e) = started.await {
            tracing::warn!(error = %e, "the sandbox did not start: no paused kernels or snapshots found");
        }
        std::mem::take(&mut crate::sync::lock(&self.0)[which as usize])
    }
}

/// The broker's record of a paused kernel, in its images' directory (not an image: left out
/// of the inventory).
pub(crate) const RECORD_NAME: &str = "broker.json";

/// Writes `image`'s record into its sealed images' directory `dir` (root's), by descriptor.
/// Blocking.
pub(crate) fn write_record(dir: &OwnedFd, image: &PausedImage) -> io::Result<()> {
    use std::io::Write;
    let text = serde_json::to_vec(image).map_err(io::Error::other)?;
    let fd = rustix::fs::openat(
        dir,
        RECORD_NAME,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    let mut file = std::fs::File::from(fd);
    file.write_all(&text)?;
    file.sync_all()?;
    rustix::fs::fsync(dir)?;
    Ok(())
}

/// [`write_record`] in a blocking task: `image` once its record is on disk.
pub(crate) async fn record(images: OwnedFd, image: PausedImage) -> Result<PausedImage, ForkError> {
    tokio::task::spawn_blocking(move || write_record(&images, &image).map(|()| image))
        .await
        .map_err(|e| copy_failed(format!("the record task failed: {e}")))?
        .map_err(|e| copy_failed(format!("its record cannot be written: {e}")))
}

/// The record of the paused kernel whose images are in `dir` (a directory of the broker's
/// whose parent only root can enter), if it has a good one for `name` (the directory's
/// name, the kernel id). Blocking.
pub(crate) fn read_record(dir: &std::path::Path, name: &str) -> Option<PausedImage> {
    let fd = crate::sandbox::fsutil::open_tree_root(dir).ok()?;
    let file = rustix::fs::openat(
        &fd,
        RECORD_NAME,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .ok()?;
    let mut text = Vec::new();
    std::fs::File::from(file)
        .take(1 << 20)
        .read_to_end(&mut text)
        .ok()?;
    let mut image: PausedImage = serde_json::from_slice(&text).ok()?;
    if image.kernel_id.to_string() != name {
        return None;
    }
    image.dir = dir.to_path_buf();
    Some(image)
}

mod millis {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let ms: u64 = serde::Deserialize::deserialize(d)?;
        Ok(Duration::from_millis(ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_truncated_missing_or_added_image_file_is_told() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        std::fs::write(p("core-1.img"), b"core").unwrap();
        std::fs::write(p("pages-1.img"), vec![7u8; 3 << 20]).unwrap();
        let open = || crate::sandbox::fsutil::open_tree_root(dir.path()).unwrap();
        let sealed = inventory(&open()).unwrap();
        assert_eq!(sealed.len(), 2);
        assert_eq!(sealed[1].len, 3 << 20);
        check_inventory(&open(), &sealed).unwrap();

        // One byte changed, the same length.
        let mut pages = std::fs::read(p("pages-1.img")).unwrap();
        pages[12345] = 8;
        std::fs::write(p("pages-1.img"), &pages).unwrap();
        let e = check_inventory(&open(), &sealed).unwrap_err().to_string();
        assert!(e.contains("pages-1.img"), "{e}");
        pages[12345] = 7;
        std::fs::write(p("pages-1.img"), &pages).unwrap();
        check_inventory(&open(), &sealed).unwrap();
        // Truncated.
        std::fs::write(p("pages-1.img"), &pages[..1000]).unwrap();
        assert!(check_inventory(&open(), &sealed).is_err());
        std::fs::write(p("pages-1.img"), &pages).unwrap();
        // Added, then missing.
        std::fs::write(p("extra.img"), b"x").unwrap();
        assert!(check_inventory(&open(), &sealed)
            .unwrap_err()
            .to_string()
            .contains("extra.img"));
        std::fs::remove_file(p("extra.img")).unwrap();
        std::fs::remove_file(p("core-1.img")).unwrap();
        assert!(check_inventory(&open(), &sealed)
            .unwrap_err()
            .to_string()
            .contains("core-1.img"));
        // A symlink in its place is never followed.
        std::os::unix::fs::symlink("/etc/hostname", p("core-1.img")).unwrap();
        assert!(check_inventory(&open(), &sealed).is_err());
    }
}
