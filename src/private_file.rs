//! Small files only the broker reads and writes, kept across its restarts (`--keep-sessions`
//! records and tickets): written atomically, read back without following a link and only
//! up to a size.
//!
//! Written as a temporary file (0600, `O_NOFOLLOW`), synced, renamed over the name, and
//! the directory synced: a broker killed half-way leaves the old file or the new one, never
//! a torn one, and a renamed file survives a crash of the host too.

use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Writes `bytes` as `dir/name` atomically (see the module comment). Blocking.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, dir.join(name))?;
    std::fs::File::open(dir)?.sync_all()
}

/// Reads `path` if it is a regular file (not a link) owned by this process's user and at
/// most `max` bytes. Blocking.
pub fn read_capped(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let meta = file.metadata()?;
    // SAFETY: geteuid(2) cannot fail and has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if !meta.is_file() || meta.uid() != euid || meta.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a file of the broker's, or too large",
        ));
    }
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Whether `name` is a temporary file [`write_atomic`] leaves when it is cut short.
pub fn is_leftover(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_whole_and_read_back_within_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        write_atomic(dir.path(), "a.json", b"{\"x\": 1}").unwrap();
        write_atomic(dir.path(), "a.json", b"{\"x\": 2}").unwrap();
        let path = dir.path().join("a.json");
        assert_eq!(read_capped(&path, 100).unwrap(), b"{\"x\": 2}");
        assert!(read_capped(&path, 3).is_err(), "past the cap");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // A link is never followed.
        std::os::unix::fs::symlink(&path, dir.path().join("link")).unwrap();
        assert!(read_capped(&dir.path().join("link"), 100).is_err());
        assert!(is_leftover(".a.json.tmp") && !is_leftover("a.json"));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }
}
