//! Token authentication. A token names a user; three forms are accepted:
//! `Authorization: Bearer TOKEN`, `Authorization: token TOKEN` (Jupyter's) and `?token=TOKEN`
//! (for WebSocket clients that cannot set headers). Tokens are compared in constant time.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use subtle::ConstantTimeEq;

use super::error::ApiError;
use super::AppState;
use crate::sandbox::UserLimits;

/// One user of the broker: a name, its token, its limits (read from the users file or the
/// environment by `config`).
#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub token: String,
    /// Its position in the users file: the local sandbox's uid offset.
    pub index: u32,
    pub limits: UserLimits,
    pub max_sessions: usize,
}

/// The authenticated caller.
#[derive(Clone, Debug)]
pub struct Caller(pub Arc<User>);

/// The token a request carries, if any.
pub fn token_of(parts: &Parts) -> Option<String> {
    if let Some(v) = parts.headers.get(axum::http::header::AUTHORIZATION) {
        let v = v.to_str().ok()?.trim();
        let (scheme, rest) = v.split_once(' ')?;
        if scheme.eq_ignore_ascii_case("bearer") || scheme.eq_ignore_ascii_case("token") {
            return Some(rest.trim().to_string());
        }
        return None;
    }
    let query = parts.uri.query()?;
    url_query(query, "token")
}

/// One parameter of a query string, percent-decoded.
pub fn url_query(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
        }
        out.push(if b == b'+' { b' ' } else { b });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl AppState {
    pub fn authenticate(&self, token: &str) -> Option<Arc<User>> {
        let mut found = None;
        for u in self.users.iter() {
            if bool::from(u.token.as_bytes().ct_eq(token.as_bytes())) {
                found = Some(u.clone());
            }
        }
        found
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = token_of(parts).ok_or_else(ApiError::unauthorized)?;
        state
            .authenticate(&token)
            .map(Caller)
            .ok_or_else(ApiError::unauthorized)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        assert_eq!(
            url_query("a=1&token=ab%2Fc", "token").as_deref(),
            Some("ab/c")
        );
        assert_eq!(url_query("token=x+y", "token").as_deref(), Some("x y"));
        assert_eq!(url_query("tok=1", "token"), None);
        assert_eq!(url_query("token=%zz%", "token").as_deref(), Some("%zz%"));
    }
}
