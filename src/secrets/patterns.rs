//! Credentials recognised by their shape (`--secret-pattern NAME=REGEX`), masked in every
//! session's output though nobody declared them: a default set of vendor formats, on by
//! default (`--no-default-secret-patterns` turns it off).
//!
//! On by default because each default pattern is a vendor's fixed prefix and a length (an
//! AWS key id is `AKIA` and 16 capitals or digits), so ordinary output matches one only by
//! accident, while a cloud key printed once stays in a recording for good. What the
//! patterns find cannot be held back across two stream messages (their length is open):
//! one split between two prints goes out in two halves; a declared secret does not.

use regex::bytes::RegexSet;

/// The default patterns: name and expression.
pub const DEFAULT: &[(&str, &str)] = &[
    ("aws-access-key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    ("github-token", r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b"),
    ("github-token", r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b"),
    ("api-key", r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{32,255}"),
    ("slack-token", r"\bxox[abposr]-[A-Za-z0-9-]{10,255}"),
    ("google-api-key", r"\bAIza[0-9A-Za-z_-]{35}\b"),
    ("stripe-key", r"\b[rs]k_live_[0-9A-Za-z]{16,255}\b"),
    (
        "private-key",
        r"-----BEGIN [A-Z ]{0,40}PRIVATE KEY-----(?:[A-Za-z0-9+/=\s]|\\n|\\r)*?-----END [A-Z ]{0,40}PRIVATE KEY-----",
    ),
];

/// Compiled patterns: one set to find whether any matches (over JSON bytes or text), and
/// each one to replace its matches.
#[derive(Debug, Clone)]
pub struct Patterns {
    names: Vec<String>,
    set: RegexSet,
    each: Vec<regex::bytes::Regex>,
}

/// A pattern that cannot be used; the message names it.
#[derive(Debug, thiserror::Error)]
#[error("secret pattern {name:?}: {why}")]
pub struct PatternError {
    name: String,
    why: String,
}

/// The largest compiled size a pattern may take (the regex crate's own guard against
/// patterns that would blow up).
const SIZE_LIMIT: usize = 1 << 20;

impl Patterns {
    /// `given` (`NAME=REGEX` each), after the default set unless `defaults` is false.
    pub fn new(given: &[String], defaults: bool) -> Result<Self, PatternError> {
        let mut pairs: Vec<(String, String)> = if defaults {
            DEFAULT
                .iter()
                .map(|(n, r)| (n.to_string(), r.to_string()))
                .collect()
        } else {
            Vec::new()
        };
        for g in given {
            let Some((name, regex)) = g.split_once('=') else {
                return Err(PatternError {
                    name: g.clone(),
                    why: "is not NAME=REGEX".into(),
                });
            };
            if name.is_empty()
                || name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(PatternError {
                    name: name.into(),
                    why: "a name is 1 to 64 letters, digits, - and _".into(),
                });
            }
            if regex.is_empty() || regex::bytes::Regex::new(regex).is_ok_and(|r| r.is_match(b"")) {
                return Err(PatternError {
                    name: name.into(),
                    why: "matches the empty text".into(),
                });
            }
            pairs.push((name.to_string(), regex.to_string()));
        }
        let mut each = Vec::with_capacity(pairs.len());
        for (name, regex) in &pairs {
            let r = regex::bytes::RegexBuilder::new(regex)
                .size_limit(SIZE_LIMIT)
                .build()
                .map_err(|e| PatternError {
                    name: name.clone(),
                    why: e.to_string(),
                })?;
            each.push(r);
        }
        let set = regex::bytes::RegexSetBuilder::new(pairs.iter().map(|(_, r)| r))
            .size_limit(SIZE_LIMIT * pairs.len().max(1))
            .build()
            .map_err(|e| PatternError {
                name: "(all)".into(),
                why: e.to_string(),
            })?;
        Ok(Self {
            names: pairs.into_iter().map(|(n, _)| n).collect(),
            set,
            each,
        })
    }

    /// No patterns at all.
    pub fn none() -> Self {
        Self::new(&[], false).expect("the empty set compiles")
    }

    pub fn is_empty(&self) -> bool {
        self.each.is_empty()
    }

    /// Whether any pattern matches `bytes`.
    pub fn any(&self, bytes: &[u8]) -> bool {
        !self.each.is_empty() && self.set.is_match(bytes)
    }

    /// `text` with each pattern's matches replaced by `[secret:NAME]`.
    pub fn replace(&self, text: &str) -> Option<String> {
        let matched = self.set.matches(text.as_bytes());
        if !matched.matched_any() {
            return None;
        }
        let mut out = text.as_bytes().to_vec();
        for i in matched.iter() {
            let marker = super::marker(&self.names[i]);
            out = self.each[i]
                .replace_all(&out, marker.as_bytes())
                .into_owned();
        }
        // Matches are whole UTF-8 sequences of the text (the patterns match text), and the
        // markers are ASCII.
        Some(String::from_utf8_lossy(&out).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_set_masks_vendor_formats_and_leaves_prose() {
        let p = Patterns::new(&[], true).unwrap();
        let text = "id AKIAIOSFODNN7EXAMPLE and ghp_0123456789abcdefghijABCDEFGHIJ012345 ok";
        assert_eq!(
            p.replace(text).unwrap(),
            "id [secret:aws-access-key] and [secret:github-token] ok"
        );
        assert!(p
            .replace("AKIA is a prefix; ask-me-anything; sk-short")
            .is_none());
        let pem =
            "-----BEGIN RSA PRIVATE KEY-----\\nMIIBOgIBAAJBAK\\n-----END RSA PRIVATE KEY-----";
        assert_eq!(p.replace(pem).unwrap(), "[secret:private-key]");
    }

    #[test]
    fn operator_patterns_are_checked() {
        let p = Patterns::new(&["corp=CORP-[0-9]{8}".into()], false).unwrap();
        assert_eq!(p.replace("x CORP-12345678").unwrap(), "x [secret:corp]");
        assert!(Patterns::new(&["noequals".into()], false).is_err());
        assert!(Patterns::new(&["bad name=x".into()], false).is_err());
        assert!(Patterns::new(&["e=a*".into()], false).is_err());
        assert!(Patterns::new(&["e=(".into()], false).is_err());
        assert!(Patterns::none().is_empty());
    }
}
