//! [`Masker`]: a session's secrets, the broker's credentials and the credential patterns,
//! found and replaced by `[secret:NAME]` in whatever a kernel sends.
//!
//! Two automata over the same forms ([`super::forms`]): one over the forms as they appear
//! inside a JSON string, which scans a message's content bytes as received (the common
//! case, no match, costs that one scan and the patterns' one); one over the text forms,
//! which masks the strings of a content that did match, parsed and written again.

use std::borrow::Cow;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, AhoCorasickKind, MatchKind};
use serde_json::Value;

use super::forms::{json_forms, text_forms};
use super::patterns::Patterns;

/// What masks one session's output.
#[derive(Debug, Clone)]
pub struct Masker {
    markers: Vec<String>,
    /// The text forms, and the marker each stands for.
    text: Option<AhoCorasick>,
    text_forms: Vec<String>,
    text_marker: Vec<usize>,
    /// The JSON forms (a prefilter over content bytes).
    json: Option<AhoCorasick>,
    json_marker: Vec<usize>,
    patterns: Arc<Patterns>,
}

/// A value to mask and the name its marker shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub name: String,
    pub value: String,
}

impl Masker {
    /// A masker for `values` (each with every form of it) and `patterns`.
    pub fn new(values: &[Named], patterns: Arc<Patterns>) -> Self {
        Self::with_forms(values, patterns, text_forms)
    }

    /// A masker for the values themselves only (no encodings): the log's, which holds
    /// every live session's secrets at once.
    pub fn plain(values: &[Named], patterns: Arc<Patterns>) -> Self {
        Self::with_forms(values, patterns, |v| vec![v.to_string()])
    }

    fn with_forms(
        values: &[Named],
        patterns: Arc<Patterns>,
        forms_of: impl Fn(&str) -> Vec<String>,
    ) -> Self {
        let mut markers = Vec::new();
        let (mut text_forms_all, mut text_marker) = (Vec::new(), Vec::new());
        let (mut json_all, mut json_marker) = (Vec::new(), Vec::new());
        for n in values {
            if n.value.is_empty() {
                continue;
            }
            let m = markers.len();
            markers.push(super::marker(&n.name));
            for form in forms_of(&n.value) {
                for j in json_forms(&form) {
                    json_all.push(j);
                    json_marker.push(m);
                }
                text_forms_all.push(form);
                text_marker.push(m);
            }
        }
        let build = |forms: &[String]| -> Option<AhoCorasick> {
            (!forms.is_empty()).then(|| {
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    // A few bytes per pattern byte (a DFA takes hundreds: 1.6 MiB for four
                    // 200-byte secrets), for a scan still well under a microsecond per
                    // small message (BENCHMARKS.md, "Masking").
                    .kind(Some(AhoCorasickKind::ContiguousNFA))
                    .build(forms)
                    .expect("plain literals build")
            })
        };
        let text = build(&text_forms_all);
        // Most values need no escaping in JSON: then one automaton serves both.
        let json = if json_all == text_forms_all {
            text.clone()
        } else {
            build(&json_all)
        };
        Self {
            text,
            json,
            markers,
            text_forms: text_forms_all,
            text_marker,
            json_marker,
            patterns,
        }
    }

    /// Whether this masker can change anything.
    pub fn is_empty(&self) -> bool {
        self.text.is_none() && self.patterns.is_empty()
    }

    /// `text` with every form of every value, and every pattern's match, replaced.
    pub fn mask_str<'a>(&self, text: &'a str) -> Cow<'a, str> {
        let mut out: Cow<'a, str> = Cow::Borrowed(text);
        if let Some(ac) = &self.text {
            if ac.is_match(text) {
                let mut s = String::with_capacity(text.len());
                let mut last = 0;
                for m in ac.find_iter(text) {
                    s.push_str(&text[last..m.start()]);
                    s.push_str(&self.markers[self.text_marker[m.pattern().as_usize()]]);
                    last = m.end();
                }
                s.push_str(&text[last..]);
                out = Cow::Owned(s);
            }
        }
        if let Some(replaced) = self.patterns.replace(&out) {
            out = Cow::Owned(replaced);
        }
        out
    }

    /// Whether `json` (a message part as received) holds anything to mask.
    fn json_hit(&self, json: &[u8]) -> bool {
        self.json.as_ref().is_some_and(|ac| ac.is_match(json)) || self.patterns.any(json)
    }

    /// A message part's JSON with its strings (keys too) masked; `None` when nothing in it
    /// is. A part that is not JSON has its bytes masked as they are.
    pub fn mask_json(&self, json: &[u8]) -> Option<Vec<u8>> {
        if !self.json_hit(json) {
            return None;
        }
        match serde_json::from_slice::<Value>(json) {
            Ok(mut v) => {
                self.mask_value(&mut v);
                let out = serde_json::to_vec(&v).ok()?;
                (out != json).then_some(out)
            }
            Err(_) => self.mask_bytes(json),
        }
    }

    fn mask_value(&self, v: &mut Value) {
        match v {
            Value::String(s) => {
                if let Cow::Owned(m) = self.mask_str(s) {
                    *s = m;
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|x| self.mask_value(x)),
            Value::Object(o) => {
                let entries = std::mem::take(o);
                for (k, mut x) in entries {
                    self.mask_value(&mut x);
                    o.insert(self.mask_str(&k).into_owned(), x);
                }
            }
            _ => {}
        }
    }

    /// Bytes (a binary buffer, a command's output, a part that is not JSON) with the text
    /// and JSON forms and the patterns' matches replaced; `None` when nothing is.
    pub fn mask_bytes(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        let mut out: Option<Vec<u8>> = None;
        for (ac, marker) in [
            (&self.json, &self.json_marker),
            (&self.text, &self.text_marker),
        ] {
            let Some(ac) = ac else { continue };
            let cur = out.as_deref().unwrap_or(bytes);
            if ac.is_match(cur) {
                let mut s = Vec::with_capacity(cur.len());
                let mut last = 0;
                for m in ac.find_iter(cur) {
                    s.extend_from_slice(&cur[last..m.start()]);
                    s.extend_from_slice(self.markers[marker[m.pattern().as_usize()]].as_bytes());
                    last = m.end();
                }
                s.extend_from_slice(&cur[last..]);
                out = Some(s);
            }
        }
        let cur = out.as_deref().unwrap_or(bytes);
        if self.patterns.any(cur) {
            if let Ok(text) = std::str::from_utf8(cur) {
                if let Some(r) = self.patterns.replace(text) {
                    out = Some(r.into_bytes());
                }
            }
        }
        out
    }

    /// The length in bytes of the longest end of `text` that begins a form of a value (and
    /// is not the whole form): what a stream must hold back until its next chunk shows
    /// whether the value follows. Always at a character boundary.
    pub fn held_suffix(&self, text: &str) -> usize {
        let mut best = self.held_suffix_bytes(text.as_bytes());
        while best > 0 && !text.is_char_boundary(text.len() - best) {
            best -= 1;
        }
        best
    }

    /// [`Self::held_suffix`] of bytes (no character boundary kept).
    pub fn held_suffix_bytes(&self, bytes: &[u8]) -> usize {
        let mut best = 0;
        for form in &self.text_forms {
            let f = form.as_bytes();
            let span = (f.len() - 1).min(bytes.len());
            if span <= best {
                continue;
            }
            let tail = &bytes[bytes.len() - span..];
            // The earliest start in the tail from which the rest of the text begins `f`.
            for (i, _) in tail.iter().enumerate().filter(|(_, &b)| b == f[0]) {
                let rest = &tail[i..];
                if f.starts_with(rest) {
                    best = best.max(rest.len());
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    fn masker(pairs: &[(&str, &str)]) -> Masker {
        let named: Vec<Named> = pairs
            .iter()
            .map(|(n, v)| Named {
                name: n.to_string(),
                value: v.to_string(),
            })
            .collect();
        Masker::new(&named, Arc::new(Patterns::new(&[], true).unwrap()))
    }

    #[test]
    fn values_and_their_encodings_are_masked_in_text() {
        let m = masker(&[("API_KEY", "s3cr3t-Value/42")]);
        assert_eq!(m.mask_str("key=s3cr3t-Value/42!"), "key=[secret:API_KEY]!");
        let b64 = base64::engine::general_purpose::STANDARD.encode("s3cr3t-Value/42");
        assert_eq!(m.mask_str(&b64), "[secret:API_KEY]");
        let embedded =
            base64::engine::general_purpose::STANDARD.encode("{\"k\": \"s3cr3t-Value/42\"}");
        assert!(
            m.mask_str(&embedded).contains("[secret:API_KEY]"),
            "{embedded}"
        );
        assert_eq!(
            m.mask_str(&hex::encode("s3cr3t-Value/42")),
            "[secret:API_KEY]"
        );
        assert_eq!(m.mask_str("s3cr3t-Value%2F42"), "[secret:API_KEY]");
        assert_eq!(m.mask_str("nothing here"), "nothing here");
        assert!(matches!(m.mask_str("nothing here"), Cow::Borrowed(_)));
    }

    #[test]
    fn json_is_masked_in_every_string_and_stays_json() {
        let m = masker(&[("PW", "pa\"ss<word>1")]);
        let content = serde_json::json!({
            "data": {"text/plain": "pa\"ss<word>1", "text/html": "<td>pa&quot;ss&lt;word&gt;1</td>"},
            "metadata": {"pa\"ss<word>1": 1},
            "execution_count": 3,
        });
        let bytes = serde_json::to_vec(&content).unwrap();
        let out = m.mask_json(&bytes).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["data"]["text/plain"], "[secret:PW]");
        assert_eq!(v["data"]["text/html"], "<td>[secret:PW]</td>");
        assert!(v["metadata"].get("[secret:PW]").is_some());
        assert_eq!(v["execution_count"], 3);
        assert!(m.mask_json(br#"{"text": "fine"}"#).is_none());
        // A numeric value never breaks the document: numbers are not strings.
        let n = masker(&[("N", "123456")]);
        let out = n
            .mask_json(br#"{"execution_count": 123456, "t": "x123456"}"#)
            .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["execution_count"], 123456);
        assert_eq!(v["t"], "x[secret:N]");
    }

    #[test]
    fn non_ascii_values_are_found_when_escaped() {
        let m = masker(&[("K", "clé-secrète-99")]);
        let escaped = br#"{"text": "cl\u00e9-secr\u00e8te-99"}"#;
        let out = m.mask_json(escaped).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), r#"{"text":"[secret:K]"}"#);
    }

    #[test]
    fn bytes_are_masked_without_parsing() {
        let m = masker(&[("K", "tok-abcdef")]);
        assert_eq!(
            m.mask_bytes(b"\x00\xfftok-abcdef\x01").unwrap(),
            b"\x00\xff[secret:K]\x01"
        );
        assert!(m.mask_bytes(b"plain").is_none());
    }

    #[test]
    fn the_held_suffix_is_the_start_of_a_form_at_the_end() {
        let m = masker(&[("K", "abcdef")]);
        assert_eq!(m.held_suffix("xx abc"), 3);
        assert_eq!(
            m.held_suffix("xx abcdef"),
            0,
            "a whole form is masked, not held"
        );
        assert_eq!(m.held_suffix("nothing"), 0);
        assert_eq!(m.held_suffix("a"), 1);
        assert_eq!(masker(&[("K", "éabcd")]).held_suffix("x\u{e9}"), 2);
    }
}
