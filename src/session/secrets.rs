//! A session's secrets (issue 39): the values its kernels get as environment variables,
//! and the [`Masker`] every message from its kernel passes through before anything else
//! sees it (the recording, the clients, the execution's result). The masker also holds the
//! broker's credentials, the credential patterns and the HMAC key of the session's kernel
//! now (a kernel can read its own connection file).
//!
//! Secrets are set at create (the request's, the user's from the users file) and can be
//! added later (E2B's `envs` of names the sandbox declared secret); none is ever removed.
//! The kept record holds them sealed ([`crate::secrets::seal`]).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::secrets::{seal::Sealer, Masker, SecretBook, SecretRefused};
use crate::sync::lock;

/// The kernel keys a masker holds: the kernel now and the few before it (a late message
/// of a replaced kernel, a fork's parent).
const KERNEL_KEYS: usize = 4;

/// What masks one session's output, and the secrets behind it.
pub struct SessionSecrets {
    /// The broker's credentials, and where every live session's secrets are listed (for
    /// the kernels' own output in the log).
    book: Arc<SecretBook>,
    id: uuid::Uuid,
    sealer: Option<Sealer>,
    inner: Mutex<Inner>,
}

struct Inner {
    values: Arc<BTreeMap<String, String>>,
    kernel_keys: VecDeque<String>,
    masker: Arc<Masker>,
}

impl SessionSecrets {
    /// Session `id`'s secrets, listed in `book` while this lives.
    pub fn new(
        book: Arc<SecretBook>,
        sealer: Option<Sealer>,
        id: uuid::Uuid,
        values: Arc<BTreeMap<String, String>>,
    ) -> Self {
        let masker = Arc::new(book.credentials().masker(&values, &[]));
        book.set(id, &values);
        Self {
            book,
            id,
            sealer,
            inner: Mutex::new(Inner {
                values,
                kernel_keys: VecDeque::new(),
                masker,
            }),
        }
    }

    /// The masker now (cheap: an `Arc`).
    pub fn masker(&self) -> Arc<Masker> {
        lock(&self.inner).masker.clone()
    }

    /// The secrets' values (for the kernel's environment and a fork's).
    pub fn values(&self) -> Arc<BTreeMap<String, String>> {
        lock(&self.inner).values.clone()
    }

    /// The secrets' names (what the API shows of them).
    pub fn names(&self) -> Vec<String> {
        lock(&self.inner).values.keys().cloned().collect()
    }

    pub fn is_empty(&self) -> bool {
        lock(&self.inner).values.is_empty()
    }

    /// Adds `more` (a value given again under a name replaces the old one, which stays
    /// masked under that name too: output can still hold it).
    pub fn add(&self, more: &BTreeMap<String, String>) -> Result<(), SecretRefused> {
        if more.is_empty() {
            return Ok(());
        }
        let mut inner = lock(&self.inner);
        let mut values = (*inner.values).clone();
        for (k, v) in more {
            if let Some(old) = values.insert(k.clone(), v.clone()) {
                if old != *v {
                    // Kept under a name of its own so both stay masked.
                    values.insert(format!("{k}_PREVIOUS"), old);
                }
            }
        }
        crate::secrets::check(&values)?;
        self.book.set(self.id, &values);
        inner.values = Arc::new(values);
        self.rebuild(&mut inner);
        Ok(())
    }

    /// The session's kernel is now one with HMAC key `key`.
    pub fn kernel_key(&self, key: &str) {
        let mut inner = lock(&self.inner);
        if key.is_empty() || inner.kernel_keys.iter().any(|k| k == key) {
            return;
        }
        if inner.kernel_keys.len() == KERNEL_KEYS {
            inner.kernel_keys.pop_front();
        }
        inner.kernel_keys.push_back(key.to_string());
        self.rebuild(&mut inner);
    }

    fn rebuild(&self, inner: &mut Inner) {
        let keys: Vec<String> = inner.kernel_keys.iter().cloned().collect();
        inner.masker = Arc::new(self.book.credentials().masker(&inner.values, &keys));
    }

    /// The secrets sealed for the session's kept record (`None`: none, or nothing to seal
    /// them with).
    pub fn sealed(&self) -> Option<String> {
        let values = self.values();
        if values.is_empty() {
            return None;
        }
        self.sealer.as_ref().map(|s| s.seal(self.id, &values))
    }

    /// What `sealed` (a kept record's) holds for session `id`; empty when it does not unseal,
    /// which is logged.
    pub fn unseal(
        sealer: Option<&Sealer>,
        id: uuid::Uuid,
        sealed: Option<&str>,
    ) -> BTreeMap<String, String> {
        let Some(sealed) = sealed else {
            return BTreeMap::new();
        };
        match sealer.and_then(|s| s.unseal(id, sealed)) {
            Some(v) => v,
            None => {
                tracing::error!(session = %id, "the kept record's secrets could not be unsealed: its output is masked by the credentials and patterns only");
                BTreeMap::new()
            }
        }
    }
}

impl Drop for SessionSecrets {
    fn drop(&mut self) {
        self.book.set(self.id, &BTreeMap::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secrets::{Credentials, Named};

    #[test]
    fn added_secrets_and_new_kernel_keys_are_masked_and_replaced_values_stay_masked() {
        let book = Arc::new(SecretBook::new(Credentials {
            values: vec![Named {
                name: "broker-token".into(),
                value: "token-123456".into(),
            }],
            ..Default::default()
        }));
        let s = SessionSecrets::new(
            book.clone(),
            None,
            uuid::Uuid::new_v4(),
            Arc::new([("A".to_string(), "alpha-1".to_string())].into()),
        );
        assert_eq!(
            s.masker().mask_str("alpha-1 token-123456"),
            "[secret:A] [secret:broker-token]"
        );
        s.add(&[("A".to_string(), "alpha-2".to_string())].into())
            .unwrap();
        assert_eq!(
            s.masker().mask_str("alpha-1 alpha-2"),
            "[secret:A_PREVIOUS] [secret:A]"
        );
        assert!(s.add(&[("B".to_string(), "x".to_string())].into()).is_err());
        s.kernel_key("deadbeefcafe");
        assert_eq!(s.masker().mask_str("deadbeefcafe"), "[secret:kernel-key]");
        for k in ["k1-aaaaaa", "k2-aaaaaa", "k3-aaaaaa", "k4-aaaaaa"] {
            s.kernel_key(k);
        }
        assert_eq!(
            s.masker().mask_str("deadbeefcafe"),
            "deadbeefcafe",
            "only the last keys"
        );
        assert_eq!(s.names(), ["A", "A_PREVIOUS"]);
        assert!(s.sealed().is_none(), "nothing to seal with");
        assert_eq!(book.mask_line("alpha-2"), "[secret:A]");
        drop(s);
        assert_eq!(
            book.mask_line("alpha-2"),
            "alpha-2",
            "gone with its session"
        );
    }
}
