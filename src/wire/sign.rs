//! HMAC-SHA256 signing of the four JSON parts, as jupyter_client's `Session.sign` does:
//! hex digest over header, parent_header, metadata and content, in that order. Buffers are
//! not signed. An empty key disables signing (empty signature), as in Jupyter.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Signs and verifies messages with one kernel's key.
#[derive(Clone)]
pub struct Signer {
    mac: Option<HmacSha256>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("enabled", &self.mac.is_some())
            .finish()
    }
}

impl Signer {
    pub fn new(key: &[u8]) -> Self {
        if key.is_empty() {
            return Self { mac: None };
        }
        // HMAC accepts keys of any length, so this cannot fail.
        let mac = HmacSha256::new_from_slice(key).ok();
        Self { mac }
    }

    /// A fresh random key: 32 random bytes, hex encoded (what goes in the connection file).
    pub fn random_key() -> String {
        let bytes: [u8; 32] = rand::random();
        hex::encode(bytes)
    }

    fn digest(&self, parts: [&[u8]; 4]) -> Option<HmacSha256> {
        let mut mac = self.mac.clone()?;
        for part in parts {
            mac.update(part);
        }
        Some(mac)
    }

    /// The hex signature of the four parts ("" when signing is off).
    pub fn sign(&self, parts: [&[u8]; 4]) -> String {
        match self.digest(parts) {
            Some(mac) => hex::encode(mac.finalize().into_bytes()),
            None => String::new(),
        }
    }

    /// A signature check fed piece by piece, for a message too large to hold whole: the
    /// parts go through [`SignatureStream::update`] in order as their bytes arrive, so
    /// bytes that are discarded after being read are still signed for.
    pub fn stream(&self) -> SignatureStream {
        SignatureStream {
            mac: self.mac.clone(),
        }
    }

    /// Constant-time check of a received hex signature.
    pub fn verify(&self, signature: &[u8], parts: [&[u8]; 4]) -> bool {
        match self.digest(parts) {
            None => true,
            Some(mac) => match hex::decode(signature) {
                Ok(raw) => mac.verify_slice(&raw).is_ok(),
                Err(_) => false,
            },
        }
    }
}

/// The HMAC of a message's four parts, computed as their bytes stream in (see
/// [`Signer::stream`]).
#[derive(Clone)]
pub struct SignatureStream {
    mac: Option<HmacSha256>,
}

impl SignatureStream {
    /// More bytes of header, parent_header, metadata and content, in that order.
    pub fn update(&mut self, bytes: &[u8]) {
        if let Some(mac) = &mut self.mac {
            mac.update(bytes);
        }
    }

    /// Constant-time check of the received hex signature over everything fed.
    pub fn verify(self, signature: &[u8]) -> bool {
        match self.mac {
            None => true,
            Some(mac) => match hex::decode(signature) {
                Ok(raw) => mac.verify_slice(&raw).is_ok(),
                Err(_) => false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector_matches_python_hmac() {
        // python3: h = hmac.new(b"key", digestmod=hashlib.sha256); h.update(b"{}") x4
        let s = Signer::new(b"key");
        let sig = s.sign([b"{}", b"{}", b"{}", b"{}"]);
        assert_eq!(
            sig,
            "ca767b02c5bc061ed184a9a029e7f93a7f2f7ed4e8fe74120fc1212f0b008fa3"
        );
        assert!(s.verify(sig.as_bytes(), [b"{}", b"{}", b"{}", b"{}"]));
    }

    #[test]
    fn a_streamed_signature_equals_the_whole_one() {
        let s = Signer::new(b"secret");
        let sig = s.sign([b"header", b"parent", b"meta", b"a long content"]);
        let mut st = s.stream();
        for piece in [
            &b"head"[..],
            b"er",
            b"parentmeta",
            b"a long",
            b"",
            b" content",
        ] {
            st.update(piece);
        }
        assert!(st.clone().verify(sig.as_bytes()));
        st.update(b"!");
        assert!(!st.verify(sig.as_bytes()));
        assert!(Signer::new(b"").stream().verify(b""));
    }

    #[test]
    fn empty_key_means_empty_signature() {
        let s = Signer::new(b"");
        assert_eq!(s.sign([b"a", b"b", b"c", b"d"]), "");
        assert!(s.verify(b"", [b"a", b"b", b"c", b"d"]));
    }

    #[test]
    fn tampered_parts_and_bad_hex_fail() {
        let s = Signer::new(b"secret");
        let sig = s.sign([b"h", b"p", b"m", b"c"]);
        assert!(!s.verify(sig.as_bytes(), [b"h", b"p", b"m", b"C"]));
        assert!(!s.verify(b"zz", [b"h", b"p", b"m", b"c"]));
        assert!(!s.verify(b"", [b"h", b"p", b"m", b"c"]));
        let other = Signer::new(b"other");
        assert!(!other.verify(sig.as_bytes(), [b"h", b"p", b"m", b"c"]));
    }
}
