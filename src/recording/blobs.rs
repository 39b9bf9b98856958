//! Large images kept apart from the events that carry them. A chart appears in a
//! `display_data` message, and again wherever it is shown again (or in the Execution of an
//! `execution_done` stored whole); every event then refers to one row of `blobs`, keyed by
//! the SHA-256 of the base64 text.
//!
//! In a stored document a blob is the object `{"$blob": "<sha256 hex>"}` in place of the
//! string. Only image values (`image/*` keys whose value is a string, except SVG, which is
//! text) are taken out; the object cannot occur there in a real message, since the Jupyter
//! protocol makes those values strings. Pure functions, no I/O.

use base64::Engine;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// A string taken out of a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    /// SHA-256 of the original string, lowercase hex.
    pub sha256: String,
    /// The decoded bytes when `base64` is true (a quarter smaller), else the string's bytes.
    pub data: Vec<u8>,
    /// Whether `data` is decoded base64 that encodes back to exactly the original string.
    pub base64: bool,
}

impl Blob {
    fn of(text: &str) -> Blob {
        let sha256 = hex::encode(Sha256::digest(text.as_bytes()));
        let engine = base64::engine::general_purpose::STANDARD;
        match engine.decode(text) {
            Ok(bytes) if engine.encode(&bytes) == text => Blob {
                sha256,
                data: bytes,
                base64: true,
            },
            _ => Blob {
                sha256,
                data: text.as_bytes().to_vec(),
                base64: false,
            },
        }
    }

    /// The original string.
    pub fn text(&self) -> String {
        Self::text_of(&self.data, self.base64)
    }

    /// The original string of stored `data`.
    pub fn text_of(data: &[u8], base64: bool) -> String {
        if base64 {
            base64::engine::general_purpose::STANDARD.encode(data)
        } else {
            String::from_utf8_lossy(data).into_owned()
        }
    }
}

const KEY: &str = "$blob";

fn is_image_key(k: &str) -> bool {
    (k.starts_with("image/") && k != "image/svg+xml") || k == FILE_CONTENT_KEY
}

/// The key of a written file's content in a `file_written` event (base64, as images are).
const FILE_CONTENT_KEY: &str = "content_base64";

/// Take every image string of at least `threshold` bytes out of `doc`, leaving a reference.
/// Returns the blobs, one per distinct image.
pub fn extract(doc: &mut Value, threshold: usize) -> Vec<Blob> {
    let mut out: Vec<Blob> = Vec::new();
    walk_extract(doc, threshold, &mut out);
    out
}

fn walk_extract(v: &mut Value, threshold: usize, out: &mut Vec<Blob>) {
    match v {
        Value::Object(map) => {
            for (k, child) in map.iter_mut() {
                match child {
                    Value::String(s) if is_image_key(k) && s.len() >= threshold => {
                        let blob = Blob::of(s);
                        *child = reference(&blob.sha256);
                        if !out.iter().any(|b| b.sha256 == blob.sha256) {
                            out.push(blob);
                        }
                    }
                    _ => walk_extract(child, threshold, out),
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                walk_extract(item, threshold, out);
            }
        }
        _ => {}
    }
}

fn reference(sha256: &str) -> Value {
    let mut m = Map::new();
    m.insert(KEY.into(), Value::String(sha256.into()));
    Value::Object(m)
}

/// The blob a value refers to, if it is a reference.
fn referred(v: &Value) -> Option<&str> {
    match v {
        Value::Object(m) if m.len() == 1 => m.get(KEY)?.as_str(),
        _ => None,
    }
}

/// Every blob `doc` refers to.
pub fn references(doc: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk_refs(doc, &mut out);
    out
}

fn walk_refs(v: &Value, out: &mut Vec<String>) {
    if let Some(sha) = referred(v) {
        out.push(sha.to_string());
        return;
    }
    match v {
        Value::Object(m) => m.values().for_each(|c| walk_refs(c, out)),
        Value::Array(a) => a.iter().for_each(|c| walk_refs(c, out)),
        _ => {}
    }
}

/// Put the blobs back: `lookup` gives the original string of a SHA-256. A missing blob
/// becomes an empty string (the document stays valid).
pub fn reassemble(doc: &mut Value, lookup: &mut impl FnMut(&str) -> Option<String>) {
    if let Some(sha) = referred(doc) {
        *doc = Value::String(lookup(sha).unwrap_or_default());
        return;
    }
    match doc {
        Value::Object(m) => m.values_mut().for_each(|c| reassemble(c, lookup)),
        Value::Array(a) => a.iter_mut().for_each(|c| reassemble(c, lookup)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn png(n: usize) -> String {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    #[test]
    fn images_are_taken_out_once_and_put_back() {
        let img = png(3000);
        let original = json!({
            "data": {"image/png": img, "text/plain": "<Figure size 640x480 with 1 Axes>"},
            "metadata": {"image/png": {"width": 640}},
            "execution": {"results": [{"data": {"image/png": img}}]},
        });
        let mut doc = original.clone();
        let blobs = extract(&mut doc, 1024);
        assert_eq!(blobs.len(), 1);
        assert!(blobs[0].base64);
        assert_eq!(blobs[0].data.len(), 3000);
        assert_eq!(blobs[0].text(), img);
        assert_eq!(doc["data"]["image/png"]["$blob"], blobs[0].sha256.as_str());
        assert_eq!(doc["metadata"]["image/png"]["width"], 640);
        assert_eq!(references(&doc).len(), 2);
        let mut lookup = |sha: &str| (sha == blobs[0].sha256).then(|| blobs[0].text());
        reassemble(&mut doc, &mut lookup);
        assert_eq!(doc, original);
    }

    #[test]
    fn small_svg_and_odd_base64_are_handled() {
        let cases = [
            (json!({"image/png": "iVBORw0KGgo="}), 0, true),
            (json!({"image/svg+xml": "x".repeat(5000)}), 0, true),
            (json!({"image/png": "a\nb".repeat(1000)}), 1, false),
            (json!({"text/plain": "y".repeat(5000)}), 0, true),
        ];
        for (original, n, _) in cases {
            let mut doc = original.clone();
            let blobs = extract(&mut doc, 1024);
            assert_eq!(blobs.len(), n, "{original}");
            for b in &blobs {
                assert!(!b.base64);
            }
            let mut lookup = |sha: &str| blobs.iter().find(|b| b.sha256 == sha).map(Blob::text);
            reassemble(&mut doc, &mut lookup);
            assert_eq!(doc, original);
        }
    }

    #[test]
    fn a_missing_blob_becomes_empty() {
        let mut doc = json!({"data": {"image/png": {"$blob": "00"}}});
        reassemble(&mut doc, &mut |_| None);
        assert_eq!(doc, json!({"data": {"image/png": ""}}));
    }
}
