//! The forms a secret's value takes in output: the value itself and the encodings code
//! commonly applies to it (HTML escaping, URL encoding, hex, base64), each as the text a
//! client reads and as it appears inside a JSON string.
//!
//! Base64 of a value embedded in a longer base64 text (a value inside a JSON document that
//! is then encoded, say) depends on the value's offset modulo 3: for each of the three
//! offsets, the characters that only the value's bytes determine are a form of their own
//! (at least [`MIN_FORM`] characters), so the embedded encoding is masked too.

use base64::Engine;

/// The shortest encoded form masked: shorter ones would match ordinary output.
pub const MIN_FORM: usize = 6;

/// The text forms of `value` that output can carry (deduplicated, the value first).
pub fn text_forms(value: &str) -> Vec<String> {
    let mut forms = vec![value.to_string()];
    let mut add = |f: String| {
        if f.len() >= MIN_FORM.min(value.len()) && !forms.contains(&f) {
            forms.push(f);
        }
    };
    for html in html_escaped(value) {
        add(html);
    }
    add(url_encoded(value, false));
    add(url_encoded(value, true));
    add(hex::encode(value));
    add(hex::encode_upper(value));
    let bytes = value.as_bytes();
    for engine in [
        &base64::engine::general_purpose::STANDARD,
        &base64::engine::general_purpose::URL_SAFE,
    ] {
        add(engine.encode(bytes));
        for offset in 0..3usize {
            let mut padded = vec![0u8; offset];
            padded.extend_from_slice(bytes);
            let encoded = engine.encode(&padded);
            // Characters before `start` mix in the offset's bytes; from `end` on, the bytes
            // that follow the value (or the padding).
            let start = (8 * offset).div_ceil(6);
            let end = (8 * (offset + bytes.len())) / 6;
            if end > start && end - start >= MIN_FORM {
                add(encoded[start..end].to_string());
            }
        }
    }
    forms
}

/// The forms of `text` inside a JSON string: as serde and Python's `json` (`ensure_ascii`
/// off) write it, with non-ASCII escaped (`ensure_ascii` on), and with `/` escaped.
pub fn json_forms(text: &str) -> Vec<String> {
    let plain = serde_json::to_string(text).unwrap_or_default();
    let plain = plain[1..plain.len() - 1].to_string();
    let mut forms = vec![plain.clone()];
    if !text.is_ascii() {
        let mut ascii = String::with_capacity(plain.len() * 2);
        for c in plain.chars() {
            if c.is_ascii() {
                ascii.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    ascii.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
        forms.push(ascii);
    }
    if plain.contains('/') {
        let slashed = plain.replace('/', "\\/");
        if !forms.contains(&slashed) {
            forms.push(slashed);
        }
    }
    forms
}

/// HTML-escaped as Python's `html.escape` and pandas write it (`'` two ways).
fn html_escaped(value: &str) -> Vec<String> {
    if !value.contains(['&', '<', '>', '"', '\'']) {
        return Vec::new();
    }
    let base = value
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;");
    let mut out = vec![base.replace('\'', "&#x27;")];
    if value.contains('\'') {
        out.push(base.replace('\'', "&#39;"));
    }
    out
}

/// Percent-encoded as `urllib.parse.quote` (`plus`: `quote_plus`) writes it.
fn url_encoded(value: &str, plus: bool) -> String {
    let mut out = String::with_capacity(value.len() * 3);
    for &b in value.as_bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            b' ' if plus => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    #[test]
    fn every_encoding_of_a_value_is_a_form() {
        let v = "sk-Abc/123+x y";
        let forms = text_forms(v);
        assert_eq!(forms[0], v);
        assert!(forms.contains(&hex::encode(v)));
        assert!(forms.contains(&"sk-Abc%2F123%2Bx%20y".to_string()));
        assert!(forms.contains(&"sk-Abc%2F123%2Bx+y".to_string()));
        let b64 = base64::engine::general_purpose::STANDARD.encode(v);
        assert!(forms.contains(&b64));
    }

    #[test]
    fn base64_of_a_value_inside_a_longer_text_contains_a_form_at_every_offset() {
        let v = "hunter2-very-secret";
        let forms = text_forms(v);
        for prefix in ["", "a", "ab", "abc", "{\"key\": \""] {
            for suffix in ["", "x", "\"}"] {
                let text = format!("{prefix}{v}{suffix}");
                for engine in [
                    &base64::engine::general_purpose::STANDARD,
                    &base64::engine::general_purpose::URL_SAFE,
                ] {
                    let encoded = engine.encode(&text);
                    assert!(
                        forms.iter().skip(1).any(|f| encoded.contains(f.as_str())),
                        "{encoded} holds no form"
                    );
                }
            }
        }
    }

    #[test]
    fn html_forms_are_pythons_and_pandas() {
        let forms = text_forms("a<b>&'c\"");
        assert!(forms.contains(&"a&lt;b&gt;&amp;&#x27;c&quot;".to_string()));
        assert!(forms.contains(&"a&lt;b&gt;&amp;&#39;c&quot;".to_string()));
    }

    #[test]
    fn json_forms_cover_escapes_and_ascii_output() {
        assert_eq!(json_forms("plain"), vec!["plain"]);
        let f = json_forms("qu\"o/té");
        assert!(f.contains(&"qu\\\"o/té".to_string()));
        assert!(f.contains(&"qu\\\"o/t\\u00e9".to_string()));
        assert!(f.contains(&"qu\\\"o\\/té".to_string()));
    }
}
