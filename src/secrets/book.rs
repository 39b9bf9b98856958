//! [`SecretBook`]: every live session's secrets and the broker's credentials together, for
//! what cannot tell whose output it is reading: the kernels' own stdout and stderr, which
//! the local sandbox forwards to the broker's log (a user's forked kernels write theirs
//! through their template, shared by all of that user's sessions). The values themselves
//! only, not their encodings: the book holds every session's secrets at once, and its
//! automaton's memory grows with them (about 12 bytes a byte of secret).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use uuid::Uuid;

use super::{Credentials, Masker, Named};
use crate::sync::lock;

/// The credentials, and each live session's secrets by session.
#[derive(Default)]
pub struct SecretBook {
    credentials: Credentials,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_session: HashMap<Uuid, Vec<Named>>,
    /// The masker of all of them, made again at the first use after a change.
    masker: Option<Arc<Masker>>,
}

impl std::fmt::Debug for SecretBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretBook")
    }
}

impl SecretBook {
    pub fn new(credentials: Credentials) -> Self {
        Self {
            credentials,
            inner: Mutex::default(),
        }
    }

    /// What every session's masker holds besides its own secrets.
    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// Session `id`'s secrets are now `values` (none: it has none, or has ended).
    pub fn set(&self, id: Uuid, values: &BTreeMap<String, String>) {
        let mut inner = lock(&self.inner);
        if values.is_empty() {
            if inner.by_session.remove(&id).is_none() {
                return;
            }
        } else {
            let named = values
                .iter()
                .map(|(name, value)| Named {
                    name: name.clone(),
                    value: value.clone(),
                })
                .collect();
            inner.by_session.insert(id, named);
        }
        inner.masker = None;
    }

    /// The masker of every live session's secrets and the credentials.
    pub fn masker(&self) -> Arc<Masker> {
        let mut inner = lock(&self.inner);
        if let Some(m) = &inner.masker {
            return m.clone();
        }
        let mut values: Vec<Named> = inner.by_session.values().flatten().cloned().collect();
        values.extend(self.credentials.values.iter().cloned());
        let m = Arc::new(Masker::plain(&values, self.credentials.patterns.clone()));
        inner.masker = Some(m.clone());
        m
    }

    /// A kernel's output line, masked of everything in the book.
    pub fn mask_line(&self, line: &str) -> String {
        self.masker().mask_str(line).into_owned()
    }

    /// [`Self::mask_line`] as the local sandbox's filter of kernel output lines.
    pub fn log_filter(self: &Arc<Self>) -> crate::sandbox::LogFilter {
        let book = self.clone();
        crate::sandbox::LogFilter(Arc::new(move |line| book.mask_line(line)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_book_masks_every_live_sessions_secrets_until_they_go() {
        let book = SecretBook::new(Credentials {
            values: vec![Named {
                name: "broker-token".into(),
                value: "token-abcdef".into(),
            }],
            ..Default::default()
        });
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        book.set(a, &[("A".to_string(), "alpha-secret".to_string())].into());
        book.set(b, &[("B".to_string(), "bravo-secret".to_string())].into());
        assert_eq!(
            book.mask_line("alpha-secret bravo-secret token-abcdef"),
            "[secret:A] [secret:B] [secret:broker-token]"
        );
        book.set(a, &BTreeMap::new());
        assert_eq!(
            book.mask_line("alpha-secret bravo-secret"),
            "alpha-secret [secret:B]"
        );
    }
}
