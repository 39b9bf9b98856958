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
        let file = std::fs::File::from(fd);
        let (crc32, len) = if st.st_size as u64 >= SPLIT_ABOVE {
            crc_in_parts(&file, st.st_size as u64)?
        } else {
            crc_read(&file, &mut buf)?
        };
        files.push(ImageFile { name, len, crc32 });
    }
    Ok(files)
}

/// An image file at least this long is read by [`crc_in_parts`].
const SPLIT_ABOVE: u64 = 16 << 20;

/// `file`'s CRC-32 and length, read to its end.
fn crc_read(mut file: &std::fs::File, buf: &mut [u8]) -> io::Result<(u32, u64)> {
    let (mut crc, mut len) = (crc32fast::Hasher::new(), 0u64);
    loop {
        let n = file.read(buf)?;
        if n == 0 {
            return Ok((crc.finalize(), len));
        }
        crc.update(&buf[..n]);
        len += n as u64;
    }
}

/// `file`'s CRC-32 and length as [`crc_read`] gives them, its `size` bytes read in parts
/// on as many threads as the machine has cores (up to 4), the parts' CRCs combined: the
/// pages of a paused kernel are hundreds of megabytes, read on a pause's and a resume's
/// path. A file cut short meanwhile reads shorter; one that grew, as far as `size`.
fn crc_in_parts(file: &std::fs::File, size: u64) -> io::Result<(u32, u64)> {
    use std::os::unix::fs::FileExt;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4)) as u64;
    let part = size.div_ceil(threads);
    let parts: Vec<io::Result<(crc32fast::Hasher, u64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let (start, end) = (i * part, ((i + 1) * part).min(size));
                scope.spawn(move || {
                    let mut buf = vec![0u8; 1 << 20];
                    let (mut crc, mut at) = (crc32fast::Hasher::new(), start);
                    while at < end {
                        let want = ((end - at) as usize).min(buf.len());
                        let n = file.read_at(&mut buf[..want], at)?;
                        if n == 0 {
                            break;
                        }
                        crc.update(&buf[..n]);
                        at += n as u64;
                    }
                    Ok((crc, at - start))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("an image's reader panicked")))
            })
            .collect()
    });
    let (mut crc, mut len) = (crc32fast::Hasher::new(), 0u64);
    for (i, got) in parts.into_iter().enumerate() {
        let (part_crc, n) = got?;
        let expected = part.min(size.saturating_sub(i as u64 * part));
        crc.combine(&part_crc);
        len += n;
        if n < expected {
            // Cut short here: what follows is not the file's.
            break;
        }
    }
    Ok((crc.finalize(), len))
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
    let (images, check) = open_checking(image)?;
    check.passed().await?;
    Ok(images)
}

/// The images' directory of `image`, opened, and their check ([`check_inventory`]) begun
/// on a thread of its own: a resume restores them meanwhile (CRIU reads them as the
/// kernel's uid, with no more than the kernel's rights) and uses the kernel it made only
/// once [`ImagesCheck::passed`]; one made from damaged images is dropped, so ended.
pub(crate) fn open_checking(image: &PausedImage) -> Result<(OwnedFd, ImagesCheck), ForkError> {
    let images = crate::sandbox::fsutil::open_tree_root(&image.dir)
        .map_err(|e| copy_failed(format!("its images cannot be opened: {e}")))?;
    let (checked, files) = (
        images.try_clone().map_err(|e| copy_failed(e.to_string()))?,
        image.files.clone(),
    );
    let check = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let checked = check_inventory(&checked, &files);
        tracing::debug!(
            ms = started.elapsed().as_millis() as u64,
            "paused images checked"
        );
        checked
    });
    Ok((images, ImagesCheck(check)))
}

/// A check of a paused kernel's images under way ([`open_checking`]).
pub(crate) struct ImagesCheck(tokio::task::JoinHandle<Result<(), ImagesDamaged>>);

impl ImagesCheck {
    /// Whether the images were as they were sealed; else why not.
    pub(crate) async fn passed(self) -> Result<(), ForkError> {
        self.0
            .await
            .map_err(|e| copy_failed(format!("the images' task failed: {e}")))?
            .map_err(|e| copy_failed(e.to_string()))
    }
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
    fn a_large_image_read_in_parts_has_the_crc_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pages-1.img");
        let size = SPLIT_ABOVE as usize + 4099;
        let mut bytes: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let whole = crc32fast::hash(&bytes);
        assert_eq!(
            crc_in_parts(&file, size as u64).unwrap(),
            (whole, size as u64)
        );
        let mut buf = vec![0u8; 1 << 20];
        assert_eq!(crc_read(&file, &mut buf).unwrap(), (whole, size as u64));
        // The last byte changed: told by its part.
        bytes[size - 1] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let (crc, _) = crc_in_parts(&std::fs::File::open(&path).unwrap(), size as u64).unwrap();
        assert_ne!(crc, whole);
        // Cut short after its size was read: shorter, with the CRC of what is left.
        std::fs::write(&path, &bytes[..size / 3]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        assert_eq!(
            crc_in_parts(&file, size as u64).unwrap(),
            (crc32fast::hash(&bytes[..size / 3]), (size / 3) as u64)
        );
    }

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
