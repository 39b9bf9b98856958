//! Who may do what on the E2B routes.
//!
//! - The control plane takes the user's broker token as E2B's API key (`X-API-KEY`, what
//!   the SDKs send); failures count against the client's address like every other failed
//!   authentication.
//! - The in-sandbox routes (code interpreter, envd) take the sandbox's access tokens
//!   (`X-Access-Token`: `envdAccessToken`; `E2B-Traffic-Access-Token`: the SDKs send only
//!   this one with context requests) for the sandbox named by `E2b-Sandbox-Id`. A token
//!   is an HMAC-SHA256 of the sandbox id keyed by the owner's broker token, so it is
//!   bound to that sandbox and user, survives a broker restart, and needs no table; a
//!   token that does not match answers as a sandbox that does not exist (another user's
//!   sandbox is absent, as everywhere in the broker).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use uuid::Uuid;

use super::{E2bError, E2bState};
use crate::api::auth::{Caller, User};
use crate::api::AppState;
use crate::session::Session;

/// Which of a sandbox's two tokens.
#[derive(Clone, Copy)]
pub enum TokenKind {
    Envd,
    Traffic,
}

/// The access token of `kind` for sandbox `id` of the user whose broker token is `key`.
pub fn access_token(key: &str, id: Uuid, kind: TokenKind) -> String {
    let label = match kind {
        TokenKind::Envd => "e2b-envd-access",
        TokenKind::Traffic => "e2b-traffic-access",
    };
    // HMAC takes a key of any length.
    let mut mac = match Hmac::<Sha256>::new_from_slice(key.as_bytes()) {
        Ok(mac) => mac,
        Err(_) => unreachable_hmac(),
    };
    mac.update(label.as_bytes());
    mac.update(b"\0");
    mac.update(id.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// What an in-sandbox request says of itself: the sandbox it names (`E2b-Sandbox-Id`, as
/// sent) and the access token it carries with its kind (`X-Access-Token`, else
/// `E2B-Traffic-Access-Token`).
pub fn sandbox_headers(headers: &HeaderMap) -> (Option<&str>, Option<(&str, TokenKind)>) {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let token = match (header("x-access-token"), header("e2b-traffic-access-token")) {
        (Some(t), _) => Some((t, TokenKind::Envd)),
        (None, Some(t)) => Some((t, TokenKind::Traffic)),
        (None, None) => None,
    };
    (header("e2b-sandbox-id"), token)
}

/// Whether `token` is the access token of `kind` for sandbox `id` of the user whose broker
/// token is `key` (compared in constant time).
pub fn token_matches(key: &str, id: Uuid, kind: TokenKind, token: &str) -> bool {
    access_token(key, id, kind)
        .as_bytes()
        .ct_eq(token.as_bytes())
        .into()
}

/// `Hmac::new_from_slice` fails only for MACs with a fixed key length; HMAC has none.
#[cold]
fn unreachable_hmac() -> ! {
    unreachable!("HMAC accepts keys of any length")
}

/// The caller of a control-plane route (`X-API-KEY`, or the broker's own forms).
pub struct ApiKeyUser(pub Caller);

impl FromRequestParts<AppState> for ApiKeyUser {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, E2bError> {
        // The sandboxes an earlier run left, known again before anything is looked up.
        if let Some(e2b) = parts.extensions.get::<Arc<E2bState>>() {
            e2b.recover(&state.registry);
        }
        let ip = client_ip(parts);
        let key = parts
            .headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| {
                E2bError::new(
                    StatusCode::UNAUTHORIZED,
                    "an API key is needed: set E2B_API_KEY to your kernel-broker token (sent as X-API-KEY)",
                )
            })?;
        not_locked_out(state, ip)?;
        match state.authenticate(key) {
            Some(user) => Ok(Self(Caller(user))),
            None => {
                count_failure(state, ip);
                Err(E2bError::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid API key: E2B_API_KEY must be a kernel-broker token",
                ))
            }
        }
    }
}

/// A verified in-sandbox request: the sandbox's session and its owner.
pub struct SandboxCaller {
    pub user: Arc<User>,
    pub session: Arc<Session>,
    pub e2b: Arc<E2bState>,
}

impl FromRequestParts<AppState> for SandboxCaller {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, E2bError> {
        let e2b = parts
            .extensions
            .get::<Arc<E2bState>>()
            .cloned()
            .ok_or_else(|| E2bError::internal("e2b state", "the E2B router has no state"))?;
        e2b.recover(&state.registry);
        let (id, token) = sandbox_headers(&parts.headers);
        let id = id.ok_or_else(|| {
            E2bError::bad_request(
                "the E2b-Sandbox-Id header is missing (set E2B_SANDBOX_URL=BASE/e2b/sandbox)",
            )
        })?;
        let absent = || E2bError::not_found(format!("sandbox {id:?} not found"));
        let (token, kind) = token.ok_or_else(|| {
            E2bError::new(
                StatusCode::UNAUTHORIZED,
                "the sandbox's access token is missing (X-Access-Token)",
            )
        })?;
        let uuid = Uuid::parse_str(id).map_err(|_| absent())?;
        let session = state
            .registry
            .all()
            .into_iter()
            .find(|s| s.id == uuid)
            .ok_or_else(absent)?;
        let user = state.users.by_name(&session.user.name).ok_or_else(absent)?;
        if !token_matches(&user.token, uuid, kind, token) {
            return Err(absent());
        }
        Ok(Self { user, session, e2b })
    }
}

/// The client's address, as the listener recorded it.
pub(super) fn client_ip(parts: &Parts) -> Option<IpAddr> {
    parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
}

/// `429` while `ip` is locked out by its failed authentications (`auth_failures`).
pub(super) fn not_locked_out(state: &AppState, ip: Option<IpAddr>) -> Result<(), E2bError> {
    let Some(ip) = ip else { return Ok(()) };
    state
        .auth_failures
        .check(ip, Instant::now())
        .map_err(|left| {
            E2bError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "too many failed authentications from {ip}; try again in {} s",
                    left.as_secs() + 1
                ),
            )
        })
}

/// Counts a failed authentication (the metric, and against `ip`).
pub(super) fn count_failure(state: &AppState, ip: Option<IpAddr>) {
    state.metrics.auth_failed();
    if let Some(ip) = ip {
        state.auth_failures.failed(ip, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_bound_to_the_sandbox_user_and_kind() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let t = access_token("alice-token", a, TokenKind::Envd);
        assert_eq!(t.len(), 64);
        assert_eq!(t, access_token("alice-token", a, TokenKind::Envd));
        assert_ne!(t, access_token("alice-token", b, TokenKind::Envd));
        assert_ne!(t, access_token("bob-token", a, TokenKind::Envd));
        assert_ne!(t, access_token("alice-token", a, TokenKind::Traffic));
    }
}
