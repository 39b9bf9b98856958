//! A file's user-defined metadata, stored as E2B's envd stores it: one extended attribute
//! per key, named `user.e2b.<key>`, its value the bytes of the value. Keys and values are
//! printable US-ASCII, a key at most 246 bytes (the system's 255 for a whole name, less
//! the prefix), all of a file's names and values together at most 4096 bytes (what ext4
//! keeps on an inode): envd's `ValidateMetadata`.
//!
//! Only the `user.` namespace is ever named, and only through a descriptor: written on the
//! new file an upload creates (`O_CREAT | O_EXCL | O_NOFOLLOW`, before it is renamed into
//! place), read from a file or directory opened beneath the workspace with `O_NOFOLLOW`.
//! A kernel can set any `user.e2b.*` attribute itself (`setfattr`): what is read back is
//! bounded ([`MAX_LIST`] of names, values past [`MAX_TOTAL`] in all left out) and entries
//! that are not UTF-8 are skipped, as envd skips them.

use std::collections::BTreeMap;
use std::os::fd::AsFd;

use rustix::fs::XattrFlags;
use rustix::io::Errno;

/// Keys and values of one file.
pub type Metadata = BTreeMap<String, String>;

/// The attribute names' prefix.
pub const PREFIX: &str = "user.e2b.";
/// A key's bytes at most.
pub const MAX_KEY: usize = 255 - PREFIX.len();
/// Every stored name (prefix and key) and value of one file together, at most.
pub const MAX_TOTAL: usize = 4096;
/// Bytes of attribute names listed from one file at most (the system's own limit).
const MAX_LIST: usize = 64 << 10;

/// Metadata that may not be stored: which key is wrong and why (envd's words).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidMetadata(String);

/// Whether `metadata` may be stored: envd's rules (see the module comment).
pub fn validate(metadata: &Metadata) -> Result<(), InvalidMetadata> {
    check(metadata).map_err(InvalidMetadata)
}

fn check(metadata: &Metadata) -> Result<(), String> {
    let mut total = 0usize;
    for (k, v) in metadata {
        if k.is_empty() {
            return Err("metadata key must not be empty".into());
        }
        if k.len() > MAX_KEY {
            return Err(format!("metadata key {k:?} exceeds {MAX_KEY} bytes"));
        }
        printable("key", k, k)?;
        printable("value for key", k, v)?;
        total += PREFIX.len() + k.len() + v.len();
    }
    if total > MAX_TOTAL {
        return Err(format!(
            "total metadata size {total} exceeds {MAX_TOTAL} bytes"
        ));
    }
    Ok(())
}

fn printable(label: &str, key: &str, s: &str) -> Result<(), String> {
    match s.bytes().position(|c| !(0x20..=0x7e).contains(&c)) {
        None => Ok(()),
        Some(at) => Err(format!(
            "metadata {label} {key:?} contains non-printable-ASCII byte 0x{:02x} at offset {at}",
            s.as_bytes()[at]
        )),
    }
}

/// Stores `metadata` on the open file `fd` (validated first). A file system that keeps no
/// extended attributes stores nothing and says so in the log, as envd does.
pub fn write(fd: impl AsFd, metadata: &Metadata) -> std::io::Result<()> {
    validate(metadata).map_err(|why| std::io::Error::new(std::io::ErrorKind::InvalidInput, why))?;
    for (k, v) in metadata {
        let name = format!("{PREFIX}{k}");
        match rustix::fs::fsetxattr(&fd, name.as_str(), v.as_bytes(), XattrFlags::empty()) {
            Ok(()) => {}
            Err(Errno::OPNOTSUPP) => {
                tracing::warn!("the workspace's file system keeps no extended attributes; file metadata not stored");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The metadata stored on the open file `fd`; `None` when there is none (or the file system
/// keeps no attributes). Bounded: see the module comment.
pub fn read(fd: impl AsFd) -> Option<Metadata> {
    let mut names = vec![0u8; MAX_LIST];
    let n = rustix::fs::flistxattr(&fd, &mut names[..]).ok()?;
    let mut out = Metadata::new();
    let mut total = 0usize;
    let mut value = vec![0u8; MAX_TOTAL];
    for name in names[..n.min(MAX_LIST)].split(|b| *b == 0) {
        let Some(key) = name.strip_prefix(PREFIX.as_bytes()) else {
            continue;
        };
        let Ok(key) = std::str::from_utf8(key) else {
            continue;
        };
        // Values larger than the whole budget (ERANGE) are skipped.
        let Ok(len) = rustix::fs::fgetxattr(&fd, name, &mut value[..]) else {
            continue;
        };
        let Ok(v) = std::str::from_utf8(&value[..len]) else {
            continue;
        };
        total += name.len() + len;
        if total > MAX_TOTAL * 4 {
            break;
        }
        out.insert(key.to_string(), v.to_string());
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_are_checked_as_envd_checks_them() {
        let ok: Metadata = [("owner".to_string(), "data team".to_string())].into();
        assert!(validate(&ok).is_ok());
        for (k, v, needle) in [
            ("", "x", "must not be empty"),
            ("k\u{7f}", "x", "non-printable"),
            ("k", "line\nbreak", "non-printable"),
            ("k", "é", "non-printable"),
        ] {
            let m: Metadata = [(k.to_string(), v.to_string())].into();
            let e = validate(&m).unwrap_err().to_string();
            assert!(e.contains(needle), "{k:?}={v:?}: {e}");
        }
        let long: Metadata = [("k".repeat(MAX_KEY + 1), "v".to_string())].into();
        assert!(validate(&long).unwrap_err().to_string().contains("exceeds"));
        let big: Metadata = (0..20)
            .map(|i| (format!("k{i}"), "v".repeat(250)))
            .collect();
        assert!(validate(&big)
            .unwrap_err()
            .to_string()
            .contains("total metadata size"));
    }

    #[test]
    fn metadata_round_trips_through_a_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(dir.path().join("f")).unwrap();
        let m: Metadata = [
            ("a".to_string(), "1".to_string()),
            ("owner".to_string(), "x y".to_string()),
        ]
        .into();
        write(&f, &m).unwrap();
        // A file system without user attributes stores nothing: then there is nothing to read.
        if let Some(back) = read(&f) {
            assert_eq!(back, m);
        }
        // Other namespaces' and other prefixes' attributes are not metadata.
        let _ = rustix::fs::fsetxattr(&f, "user.other", b"z", XattrFlags::empty());
        if let Some(back) = read(&f) {
            assert_eq!(back, m);
        }
    }
}
