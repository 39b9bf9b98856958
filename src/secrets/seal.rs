//! A session's secrets in its kept record (`--keep-sessions`, paused sessions): sealed with
//! ChaCha20-Poly1305 under a key the broker keeps in `<data_dir>/secrets.key` (0600, made
//! at first use), so the record holds no value verbatim and a record copied without the key
//! gives none. The next run unseals them to mask the adopted kernel's output again. A
//! record that does not unseal (another data directory's, altered) adopts the session
//! without them: its output is then masked by the credentials and patterns only, which the
//! broker logs as an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use rand::RngCore;

/// The key file's name in the data directory.
pub const KEY_FILE: &str = "secrets.key";

/// Seals and unseals with one key.
#[derive(Clone)]
pub struct Sealer {
    cipher: ChaCha20Poly1305,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer")
    }
}

impl Sealer {
    /// The sealer of the key in `dir` (made, 0600, when there is none). Blocking.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let path: PathBuf = dir.join(KEY_FILE);
        let key = match crate::private_file::read_capped(&path, 64) {
            Ok(k) if k.len() == 32 => k,
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is not a 32-byte key", path.display()),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut k = vec![0u8; 32];
                rand::thread_rng().fill_bytes(&mut k);
                crate::private_file::write_atomic(dir, KEY_FILE, &k)?;
                k
            }
            Err(e) => return Err(e),
        };
        Ok(Self::with_key(&key))
    }

    /// The sealer of a key derived from `secret` for `purpose` (a cluster's copies of
    /// paused sessions: every node of the cluster derives the same from its key).
    pub fn derived(purpose: &str, secret: &[u8]) -> Self {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(purpose.as_bytes());
        h.update([0u8]);
        h.update(secret);
        Self::with_key(&h.finalize())
    }

    fn with_key(key: &[u8]) -> Self {
        Self {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key)),
        }
    }

    /// `secrets` sealed for `session` (base64 of nonce and ciphertext); the session id is
    /// bound in, so one session's sealed secrets do not unseal as another's.
    pub fn seal(&self, session: uuid::Uuid, secrets: &BTreeMap<String, String>) -> String {
        let plain = serde_json::to_vec(secrets).unwrap_or_default();
        base64::engine::general_purpose::STANDARD
            .encode(self.seal_bytes(session.as_bytes(), &plain))
    }

    /// What [`Self::seal`] sealed for `session`, or `None`.
    pub fn unseal(&self, session: uuid::Uuid, sealed: &str) -> Option<BTreeMap<String, String>> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(sealed)
            .ok()?;
        let plain = self.open_bytes(session.as_bytes(), &bytes)?;
        serde_json::from_slice(&plain).ok()
    }

    /// `plain` sealed, bound to `aad` (which it does not hold): a fresh nonce, then the
    /// ciphertext with its tag.
    pub fn seal_bytes(&self, aad: &[u8], plain: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; 12];
        rand::thread_rng().fill_bytes(&mut nonce);
        let payload = chacha20poly1305::aead::Payload { msg: plain, aad };
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), payload)
            .expect("sealing in memory cannot fail");
        let mut out = Vec::with_capacity(12 + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// What [`Self::seal_bytes`] sealed with this key and `aad`, or `None` (another key,
    /// another `aad`, or a byte changed).
    pub fn open_bytes(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < 12 {
            return None;
        }
        let (nonce, body) = sealed.split_at(12);
        let payload = chacha20poly1305::aead::Payload { msg: body, aad };
        self.cipher.decrypt(Nonce::from_slice(nonce), payload).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_secrets_hold_no_value_and_unseal_only_for_their_session_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let s = Sealer::open(dir.path()).unwrap();
        let secrets: BTreeMap<String, String> =
            [("API_KEY".to_string(), "s3cret-value".to_string())].into();
        let id = uuid::Uuid::new_v4();
        let sealed = s.seal(id, &secrets);
        assert!(!sealed.contains("s3cret"));
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&sealed)
            .unwrap();
        assert!(!raw.windows(6).any(|w| w == b"s3cret"));
        assert_eq!(s.unseal(id, &sealed).unwrap(), secrets);
        assert!(
            s.unseal(uuid::Uuid::new_v4(), &sealed).is_none(),
            "bound to its session"
        );
        // The same directory's key again; another directory's key does not unseal.
        assert_eq!(
            Sealer::open(dir.path())
                .unwrap()
                .unseal(id, &sealed)
                .unwrap(),
            secrets
        );
        let other = tempfile::tempdir().unwrap();
        assert!(Sealer::open(other.path())
            .unwrap()
            .unseal(id, &sealed)
            .is_none());
        let mode = std::fs::metadata(dir.path().join(KEY_FILE)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        assert!(s.unseal(id, "not base64!").is_none());
        assert!(s.unseal(id, "AAAA").is_none());
    }

    #[test]
    fn a_key_file_that_is_a_link_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, [7u8; 32]).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(KEY_FILE)).unwrap();
        assert!(Sealer::open(dir.path()).is_err());
    }

    #[test]
    fn a_key_file_that_is_not_a_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        crate::private_file::write_atomic(dir.path(), KEY_FILE, b"short").unwrap();
        assert!(Sealer::open(dir.path()).is_err());
    }
}
