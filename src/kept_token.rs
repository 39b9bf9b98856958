//! The generated token, kept. With no users file and no `KERNEL_BROKER_TOKEN` the broker
//! makes a token the first time it runs on a data directory and keeps it there
//! (`<data dir>/token`, mode 0600, written atomically); later runs on that directory use it
//! again, so a restart does not break the session browser's open tabs, MCP hosts' settings
//! or an `E2B_API_KEY` that hold it. `kernel-broker token` prints it.
//!
//! The file is read the way the broker reads its other kept files (`private_file`): not
//! through a link, only if it is the broker's own and small. A file that is there but not
//! usable (a link, another user's, readable by others, not a token) stops the broker with
//! what to do rather than being replaced: it may be somebody's mistake worth seeing.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::private_file;

/// The token's file name in the data directory.
pub const TOKEN_FILE: &str = "token";

/// A kept token is at most this long (a generated one is 48 hex digits).
const MAX_BYTES: u64 = 256;

/// Why the kept token cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("cannot read the kept token {path}: {source} (it must be a file of the broker's user, mode 0600; remove it to have a new token made)")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the kept token {path} is readable by others; `chmod 600` it, or remove it to have a new token made")]
    Exposed { path: PathBuf },
    #[error("{path} holds no token (16 to 256 printable ASCII characters, no spaces); remove it to have a new token made")]
    NotAToken { path: PathBuf },
    #[error("cannot keep the token in {dir}: {source}")]
    Write {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The token kept in `data_dir`, if there is one. Blocking.
pub fn kept_token(data_dir: &Path) -> Result<Option<String>, TokenFileError> {
    let path = data_dir.join(TOKEN_FILE);
    let read_error = |source| TokenFileError::Read {
        path: path.clone(),
        source,
    };
    let bytes = match private_file::read_capped(&path, MAX_BYTES) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read_error(e)),
    };
    let mode = std::fs::symlink_metadata(&path).map_err(read_error)?.mode();
    if mode & 0o077 != 0 {
        return Err(TokenFileError::Exposed { path });
    }
    let token = String::from_utf8(bytes)
        .ok()
        .map(|t| t.trim_end_matches('\n').to_string())
        .filter(|t| is_token(t))
        .ok_or_else(|| TokenFileError::NotAToken { path: path.clone() })?;
    Ok(Some(token))
}

/// The kept token of `data_dir`, or `fresh` kept there now (then `true`). Blocking.
pub fn keep_or_reuse(data_dir: &Path, fresh: &str) -> Result<(String, bool), TokenFileError> {
    if let Some(token) = kept_token(data_dir)? {
        return Ok((token, false));
    }
    private_file::write_atomic(data_dir, TOKEN_FILE, format!("{fresh}\n").as_bytes()).map_err(
        |source| TokenFileError::Write {
            dir: data_dir.to_path_buf(),
            source,
        },
    )?;
    Ok((fresh.to_string(), true))
}

fn is_token(t: &str) -> bool {
    (16..=MAX_BYTES as usize).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const FRESH: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn made_once_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(kept_token(dir.path()).unwrap().is_none());
        assert_eq!(
            keep_or_reuse(dir.path(), FRESH).unwrap(),
            (FRESH.to_string(), true)
        );
        let mode = std::fs::metadata(dir.path().join(TOKEN_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let other = "ffffffffffffffffffffffffffffffff";
        assert_eq!(
            keep_or_reuse(dir.path(), other).unwrap(),
            (FRESH.to_string(), false)
        );
        assert_eq!(kept_token(dir.path()).unwrap().as_deref(), Some(FRESH));
    }

    #[test]
    fn a_planted_link_or_foreign_file_is_refused_not_followed_or_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, FRESH).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        let token = dir.path().join(TOKEN_FILE);
        std::os::unix::fs::symlink(&target, &token).unwrap();
        let e = keep_or_reuse(dir.path(), FRESH).unwrap_err();
        assert!(matches!(e, TokenFileError::Read { .. }), "{e}");
        assert!(std::fs::symlink_metadata(&token)
            .unwrap()
            .file_type()
            .is_symlink());

        std::fs::remove_file(&token).unwrap();
        std::fs::write(&token, FRESH).unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = keep_or_reuse(dir.path(), FRESH).unwrap_err();
        assert!(matches!(e, TokenFileError::Exposed { .. }), "{e}");

        // Another user's file (as root, the tests can make one).
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&token, Some(12345), None).unwrap();
            let e = keep_or_reuse(dir.path(), FRESH).unwrap_err();
            assert!(matches!(e, TokenFileError::Read { .. }), "{e}");
        }
    }

    #[test]
    fn what_is_not_a_token_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for bad in [
            "short",
            "has a space in it 0123456789",
            "\u{1b}[31m0123456789abcdef",
        ] {
            private_file::write_atomic(dir.path(), TOKEN_FILE, bad.as_bytes()).unwrap();
            let e = kept_token(dir.path()).unwrap_err();
            assert!(matches!(e, TokenFileError::NotAToken { .. }), "{bad}: {e}");
        }
        let long = "x".repeat(300);
        private_file::write_atomic(dir.path(), TOKEN_FILE, long.as_bytes()).unwrap();
        assert!(kept_token(dir.path()).is_err());
    }
}
