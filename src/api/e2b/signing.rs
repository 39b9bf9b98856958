//! Signed file URLs, as E2B's SDKs make them (`files.download_url` / `upload_url`, the SDKs'
//! `signature.py` / `signature.ts`) and envd checks them (envd's `api/auth.go`):
//! `signature = "v1_" + base64(sha256("PATH:OPERATION:USER:ENVD_ACCESS_TOKEN[:EXPIRATION]"))`
//! without padding, where OPERATION is `read` (download) or `write` (upload), USER is the
//! `username` parameter or empty, and EXPIRATION the `signature_expiration` parameter
//! (Unix seconds). A URL so signed needs no header: it is usable with a plain HTTP client.
//!
//! With `E2B_SANDBOX_URL` the SDKs put such a URL at that URL's origin (`/files?...`), with
//! nothing naming the sandbox, so the broker finds the sandbox whose access token makes the
//! signature (one hash per live session, compared in constant time); a request that also
//! names its sandbox (`E2b-Sandbox-Id`) is checked against that one only. Wrong signatures
//! count as failed authentications of the client's address, like a wrong token.

use std::sync::Arc;

use axum::http::request::Parts;
use axum::http::StatusCode;
use base64::Engine;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::auth::{
    access_token, client_ip, count_failure, not_locked_out, SandboxCaller, TokenKind,
};
use super::{E2bError, E2bState};
use crate::api::AppState;

/// What a signed URL allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// A request's signature parameters.
pub struct Signed<'a> {
    pub path: &'a str,
    pub user: Option<&'a str>,
    pub signature: &'a str,
    pub expiration: Option<i64>,
}

/// The signature E2B's SDKs compute for `path`, `operation`, `user` and `token`.
pub fn signature(
    path: &str,
    operation: Operation,
    user: Option<&str>,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut raw = format!(
        "{path}:{}:{}:{token}",
        operation.as_str(),
        user.unwrap_or("")
    );
    if let Some(exp) = expiration {
        raw.push_str(&format!(":{exp}"));
    }
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

fn unauthorized(message: &str) -> E2bError {
    E2bError::new(StatusCode::UNAUTHORIZED, message)
}

/// The sandbox whose envd access token makes `signed`'s signature for `operation` (only
/// `named`, when the request names one), checked not to have expired. Errors are envd's:
/// `401` "invalid signature" / "signature is already expired".
pub fn verify(
    state: &AppState,
    e2b: &Arc<E2bState>,
    parts: &Parts,
    named: Option<&str>,
    signed: &Signed<'_>,
    operation: Operation,
) -> Result<SandboxCaller, E2bError> {
    let ip = client_ip(parts);
    not_locked_out(state, ip)?;
    let named = named.and_then(|n| uuid::Uuid::parse_str(n).ok());
    let found = state
        .registry
        .all()
        .into_iter()
        .filter(|s| named.is_none_or(|n| n == s.id))
        .find_map(|session| {
            let user = state.users.by_name(&session.user.name)?;
            let token = access_token(&user.token, session.id, TokenKind::Envd);
            let want = signature(
                signed.path,
                operation,
                signed.user,
                &token,
                signed.expiration,
            );
            let ok: bool = want.as_bytes().ct_eq(signed.signature.as_bytes()).into();
            ok.then_some((user, session))
        });
    let Some((user, session)) = found else {
        count_failure(state, ip);
        return Err(unauthorized("invalid signature"));
    };
    if let Some(exp) = signed.expiration {
        if exp < chrono::Utc::now().timestamp() {
            return Err(unauthorized("signature is already expired"));
        }
    }
    Ok(SandboxCaller {
        user,
        session,
        e2b: e2b.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_the_sdks() {
        // Computed with e2b 2.63.0's `e2b.sandbox.signature.get_signature`.
        assert_eq!(
            signature("/home/user/a.txt", Operation::Read, None, "tok", None),
            "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY"
        );
        assert_eq!(
            signature(
                "a.txt",
                Operation::Write,
                Some("user"),
                "tok",
                Some(1700000000)
            ),
            "v1_9+DkakjhnozxjEbjkZlIEI0EDQwzTOs9j7zwttKb3pE"
        );
        let a = signature("p", Operation::Read, None, "t", None);
        assert_ne!(a, signature("p", Operation::Write, None, "t", None));
        assert_ne!(a, signature("q", Operation::Read, None, "t", None));
        assert_ne!(a, signature("p", Operation::Read, None, "u", None));
        assert_ne!(a, signature("p", Operation::Read, None, "t", Some(1)));
    }
}
