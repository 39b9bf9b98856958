//! Secrets (issue 39): values a session's kernel sees as environment variables and that
//! nothing the broker returns or writes holds verbatim; `[secret:NAME]` stands in their
//! place. docs/SECURITY.md ("Secrets and masking") says what is masked, where, and the
//! limits.
//!
//! - [`forms`]: the encodings of a value that are masked too.
//! - [`mask`]: [`Masker`], which finds and replaces them (and the credential patterns).
//! - [`patterns`]: credentials recognised by their shape.
//! - [`stream`]: a stream's chunks held back just long enough that a value split between
//!   two is masked whole.
//! - [`book`]: every live session's secrets together, for the kernels' own stdout and
//!   stderr in the broker's log.
//! - [`seal`]: a session's secrets as its kept record holds them (sealed, not verbatim).

pub mod book;
pub mod forms;
pub mod mask;
pub mod patterns;
pub mod seal;
pub mod stream;

use std::collections::BTreeMap;

pub use book::SecretBook;
pub use mask::{Masker, Named};
pub use patterns::Patterns;

/// The most secrets a session may have.
pub const MAX_SECRETS: usize = 32;
/// The shortest value accepted: a shorter one would mask ordinary output.
pub const MIN_VALUE: usize = 4;
/// The longest value accepted (a PEM private key fits).
pub const MAX_VALUE: usize = 4 << 10;
/// The most bytes a session's values may take together. Each value is masked in about 25
/// forms, in two automata of about 12 bytes a pattern byte: a session at this bound holds
/// about 1.8 MB of them in the broker's memory (a typical one, a few API keys, 100 KB).
pub const MAX_TOTAL: usize = 8 << 10;

/// What stands in a masked value's place.
pub fn marker(name: &str) -> String {
    format!("[secret:{name}]")
}

/// Why a set of secrets was refused (a 400 at every front door).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretRefused {
    #[error("secrets: {0}")]
    Env(#[from] crate::sandbox::environ::EnvRefused),
    #[error("secrets: the value of {name} is shorter than {MIN_VALUE} bytes (it would mask ordinary output)")]
    TooShort { name: String },
    #[error("secrets: the value of {name} is longer than {MAX_VALUE} bytes")]
    TooLong { name: String },
    #[error("secrets: {count} secrets are more than the {MAX_SECRETS} allowed")]
    TooMany { count: usize },
    #[error(
        "secrets: their values take {bytes} bytes together, more than the {MAX_TOTAL} allowed"
    )]
    TooLarge { bytes: usize },
}

/// Checks a session's secrets: names and values as any tenant variable's, and lengths.
pub fn check(secrets: &BTreeMap<String, String>) -> Result<(), SecretRefused> {
    if secrets.len() > MAX_SECRETS {
        return Err(SecretRefused::TooMany {
            count: secrets.len(),
        });
    }
    crate::sandbox::environ::check_user_env(secrets.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    let bytes: usize = secrets.values().map(String::len).sum();
    if bytes > MAX_TOTAL {
        return Err(SecretRefused::TooLarge { bytes });
    }
    for (name, value) in secrets {
        if value.len() < MIN_VALUE {
            return Err(SecretRefused::TooShort { name: name.clone() });
        }
        if value.len() > MAX_VALUE {
            return Err(SecretRefused::TooLong { name: name.clone() });
        }
    }
    Ok(())
}

/// What every session's masker holds besides its own secrets: the broker's credentials
/// (its users' tokens, under one name) and the patterns.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub values: Vec<Named>,
    pub patterns: std::sync::Arc<Patterns>,
}

impl Default for Credentials {
    fn default() -> Self {
        Self {
            values: Vec::new(),
            patterns: std::sync::Arc::new(Patterns::none()),
        }
    }
}

impl Credentials {
    /// The masker for a session with `secrets` whose kernel's HMAC key is `kernel_key`.
    pub fn masker(&self, secrets: &BTreeMap<String, String>, kernel_keys: &[String]) -> Masker {
        let mut values: Vec<Named> = secrets
            .iter()
            .map(|(name, value)| Named {
                name: name.clone(),
                value: value.clone(),
            })
            .collect();
        values.extend(self.values.iter().cloned());
        values.extend(kernel_keys.iter().filter(|k| !k.is_empty()).map(|k| Named {
            name: "kernel-key".into(),
            value: k.clone(),
        }));
        Masker::new(&values, self.patterns.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn secrets_are_checked_like_variables_and_by_length() {
        assert!(check(&map(&[("API_KEY", "abcd1234")])).is_ok());
        assert!(matches!(
            check(&map(&[("K", "abc")])),
            Err(SecretRefused::TooShort { .. })
        ));
        assert!(matches!(
            check(&map(&[("LD_PRELOAD", "/tmp/x.so")])),
            Err(SecretRefused::Env(_))
        ));
        assert!(check(&map(&[("1BAD", "abcdef")])).is_err());
        assert!(check(&map(&[("K", "a\0bcdef")])).is_err());
        let big: BTreeMap<String, String> = (0..3)
            .map(|i| (format!("K{i}"), "y".repeat(MAX_VALUE)))
            .collect();
        assert!(matches!(check(&big), Err(SecretRefused::TooLarge { .. })));
        let long = "x".repeat(MAX_VALUE + 1);
        assert!(matches!(
            check(&map(&[("K", &long)])),
            Err(SecretRefused::TooLong { .. })
        ));
        let many: BTreeMap<String, String> = (0..=MAX_SECRETS)
            .map(|i| (format!("K{i}"), "abcdef".to_string()))
            .collect();
        assert!(matches!(check(&many), Err(SecretRefused::TooMany { .. })));
    }

    #[test]
    fn a_session_masker_holds_its_secrets_the_credentials_and_the_kernel_key() {
        let creds = Credentials {
            values: vec![Named {
                name: "broker-token".into(),
                value: "tok-0123456789".into(),
            }],
            patterns: std::sync::Arc::new(Patterns::none()),
        };
        let m = creds.masker(&map(&[("DB", "hunter2hunter2")]), &["f00dfeedbeef".into()]);
        assert_eq!(
            m.mask_str("hunter2hunter2 tok-0123456789 f00dfeedbeef"),
            "[secret:DB] [secret:broker-token] [secret:kernel-key]"
        );
    }
}
