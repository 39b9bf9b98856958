//! Token authentication. A token names a user; three forms are accepted:
//! `Authorization: Bearer TOKEN`, `Authorization: token TOKEN` (Jupyter's) and `?token=TOKEN`
//! (for WebSocket clients that cannot set headers).
//!
//! Tokens are compared in constant time: both sides are hashed (SHA-256) first, so neither
//! a token's bytes nor its length shows in the time a comparison takes, and every user's
//! token is compared whichever matches.
//!
//! [`authenticate`] is a middleware over every route: a request with a token from an address
//! blocked for failed authentications gets a 429 (`auth_failures.rs`); a valid token becomes
//! the request's [`Caller`] and holds one of its user's request places (`user_load.rs`)
//! until the response body is sent. The [`Caller`] extractor rejects the rest with a 401 and
//! counts the failure.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::{ApiError, JupyterError};
use super::metrics::Refused;
use super::user_load::Kind;
use super::AppState;
use crate::session::{
    CheckpointPolicy, CreateOptions, CreateRequest, PausePolicy, SandboxUser, UserLimits,
};

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
    /// The bounds of the user's checkpoints, and whether sessions take one after every
    /// successful execution unless they say otherwise.
    pub checkpoints: CheckpointPolicy,
    /// When the user's idle sessions pause by themselves, and how long they stay paused.
    pub pause: PausePolicy,
    /// Secrets every session of the user gets (the users file's `secrets`); a session's
    /// own of the same name win.
    pub secrets: std::collections::BTreeMap<String, String>,
}

impl User {
    /// The user as the sandbox knows them (name, uid slot, limits).
    pub fn sandbox_user(&self) -> SandboxUser {
        SandboxUser {
            name: self.name.clone(),
            index: self.index,
            limits: self.limits.clone(),
        }
    }

    /// A session for this user, with what the client asked for.
    pub fn create_request(&self, mut options: CreateOptions) -> CreateRequest {
        if !self.secrets.is_empty() && options.snapshot.is_none() {
            let own = std::mem::take(&mut options.secrets);
            options.secrets = self.secrets.clone();
            options.secrets.extend(own);
        }
        CreateRequest {
            user: self.sandbox_user(),
            max_sessions: self.max_sessions,
            options,
            checkpoints: self.checkpoints,
            pause: self.pause,
        }
    }
}

/// Every user with the SHA-256 of its token, computed once: each authentication compares
/// the offered token's digest with all of them.
#[derive(Debug)]
pub struct Users(Vec<([u8; 32], Arc<User>)>);

impl Users {
    pub fn new(users: impl IntoIterator<Item = Arc<User>>) -> Self {
        Self(
            users
                .into_iter()
                .map(|u| (Sha256::digest(u.token.as_bytes()).into(), u))
                .collect(),
        )
    }
}

impl Users {
    /// The user named `name` (E2B's sandbox routes find a sandbox's owner by its session).
    pub fn by_name(&self, name: &str) -> Option<Arc<User>> {
        self.0
            .iter()
            .find(|(_, u)| u.name == name)
            .map(|(_, u)| u.clone())
    }

    /// The first user `pred` holds for (the cluster finds an E2B sandbox token's user).
    pub fn find(&self, pred: impl Fn(&User) -> bool) -> Option<Arc<User>> {
        self.0.iter().find(|(_, u)| pred(u)).map(|(_, u)| u.clone())
    }
}

/// The authenticated caller.
#[derive(Clone, Debug)]
pub struct Caller(pub Arc<User>);

/// The token a request carries, if any.
pub fn token_of(parts: &Parts) -> Option<String> {
    token_in(&parts.headers, &parts.uri)
}

pub fn token_in(headers: &axum::http::HeaderMap, uri: &axum::http::Uri) -> Option<String> {
    if let Some(v) = headers.get(axum::http::header::AUTHORIZATION) {
        let v = v.to_str().ok()?.trim();
        let (scheme, rest) = v.split_once(' ')?;
        if scheme.eq_ignore_ascii_case("bearer") || scheme.eq_ignore_ascii_case("token") {
            return Some(rest.trim().to_string());
        }
        return None;
    }
    url_query(uri.query()?, "token")
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
        let offered: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for (known, u) in &self.users.0 {
            if bool::from(known.ct_eq(&offered)) {
                found = Some(u.clone());
            }
        }
        found
    }
}

/// The client's address, when the request came through the listener.
pub(super) fn peer(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
}

/// Set on a request whose failed authentication was counted, so a handler with two
/// extractors that both authenticate counts it once.
#[derive(Clone, Copy)]
struct FailureCounted;

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if let Some(caller) = parts.extensions.get::<Caller>() {
            return Ok(caller.clone());
        }
        let token = token_of(parts).ok_or_else(ApiError::unauthorized)?;
        if let Some(user) = state.authenticate(&token) {
            return Ok(Caller(user));
        }
        if parts.extensions.insert(FailureCounted).is_none() {
            state.metrics.auth_failed();
            if let Some(ip) = peer(&parts.extensions) {
                state.auth_failures.failed(ip, Instant::now());
            }
        }
        Err(ApiError::unauthorized())
    }
}

/// Middleware over every route (see the module comment).
pub async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let Some(token) = token_in(req.headers(), req.uri()) else {
        return next.run(req).await;
    };
    let jupyter = req.uri().path().starts_with("/api/");
    if let Some(ip) = peer(req.extensions()) {
        if let Err(left) = state.auth_failures.check(ip, Instant::now()) {
            state.metrics.request_refused(Refused::AuthFailures);
            let e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_auth_failures",
                format!(
                    "too many failed authentications from {ip}; try again in {} s",
                    left.as_secs() + 1
                ),
            );
            return with_retry_after(refusal(e, jupyter), left.as_secs() + 1);
        }
    }
    let Some(user) = state.authenticate(&token) else {
        // The handler's extractor answers 401 and counts the failure; routes that need no
        // token carry on.
        return next.run(req).await;
    };
    let name: Arc<str> = user.name.as_str().into();
    let Some(held) = state.user_load.try_hold(&name, Kind::Request) else {
        state.metrics.request_refused(Refused::RequestsPerUser);
        let max = state.user_load.cap(Kind::Request);
        let e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            format!("user {name} already has {max} requests in progress (the limit); wait for some to finish"),
        );
        return with_retry_after(refusal(e, jupyter), 1);
    };
    req.extensions_mut().insert(Caller(user));
    let response = next.run(req).await;
    // The place is held until the body is sent: a slow reader of a large body still counts.
    response.map(|body| {
        Body::new(http_body_util::BodyExt::map_frame(body, move |frame| {
            let _held = &held;
            frame
        }))
    })
}

fn refusal(e: ApiError, jupyter: bool) -> Response {
    if jupyter {
        JupyterError(e).into_response()
    } else {
        e.into_response()
    }
}

fn with_retry_after(mut response: Response, secs: u64) -> Response {
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
    response
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

    #[test]
    fn a_users_secrets_reach_her_sessions_and_the_sessions_own_win() {
        let user = User {
            name: "alice".into(),
            token: "alice-token".into(),
            index: 0,
            limits: Default::default(),
            max_sessions: 2,
            checkpoints: Default::default(),
            pause: Default::default(),
            secrets: [("A", "users-a"), ("B", "users-b")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
        };
        let own = CreateOptions {
            secrets: [("B".to_string(), "own-b".to_string())].into(),
            ..Default::default()
        };
        let got = user.create_request(own).options.secrets;
        assert_eq!(got["A"], "users-a");
        assert_eq!(got["B"], "own-b");
        // A session from a snapshot takes none (its kernel is the snapshot's).
        let from_snapshot = CreateOptions {
            snapshot: Some(uuid::Uuid::nil()),
            ..Default::default()
        };
        assert!(user
            .create_request(from_snapshot)
            .options
            .secrets
            .is_empty());
    }
}
