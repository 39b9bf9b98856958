//! A request about one session (or one E2B sandbox) of the caller's: served here if it is
//! here, else forwarded to the node that holds it (the session directory says which, else
//! the peers themselves); a session of a lost node is answered so, and a paused one whose
//! node is not live is away.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use uuid::Uuid;

use super::forward::forward;
use super::lost::{lost_answer, lost_session, micros};
use super::owner::find_owner;
use super::peer::Node;
use super::Routed;
use crate::api::auth::User;
use crate::api::e2b::{sandbox_headers, token_matches};
use crate::api::AppState;
use crate::cluster::Directory;
use crate::session::SessionError;

/// A request about session `id` of the caller's: served here if it is here, else by the
/// node that holds it; a session of a lost node answers so.
pub(super) async fn session(
    state: &AppState,
    cluster: &Node,
    caller: &Routed,
    id: Uuid,
    req: Request,
    next: Next,
) -> Response {
    if !matches!(
        state.registry.get(&caller.user.name, id),
        Err(SessionError::NotFound(_))
    ) {
        return next.run(req).await;
    }
    let cached = match cluster.owner_cached(id) {
        Some(url) if cluster.is_live(&url).await => Some(url),
        Some(_) => {
            cluster.forget_owner(id);
            None
        }
        None => None,
    };
    // The session directory first; the peers themselves for a session made since its
    // node last wrote the directory (or when the database does not answer).
    let listed = match cached {
        Some(url) => Directory::At(url),
        None => cluster
            .directory(id, &caller.user.name)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cluster: the session directory did not answer");
                Directory::Unknown
            }),
    };
    let owner = match &listed {
        Directory::At(url) => {
            cluster.remember_owner(id, url.clone());
            Some(url.clone())
        }
        Directory::Lost { .. } | Directory::Away { .. } => None,
        Directory::Unknown => find_owner(cluster, id, &caller.user).await,
    };
    if let Some(url) = owner {
        return forward(state, cluster, Some(id), &url, caller.e2b, req).await;
    }
    if let Directory::Away { node, carried } = &listed {
        if *carried {
            match super::carry::take_over(&state.registry, cluster, &caller.user, id, node).await {
                Ok(()) => return next.run(req).await,
                Err(why) => {
                    return super::refuse(
                        caller.e2b,
                        StatusCode::SERVICE_UNAVAILABLE,
                        "session_away",
                        format!(
                            "session {id} is paused on node {node}, which is not running now, \
                             and could not be taken over here: {why} (try again later)"
                        ),
                    )
                }
            }
        }
        return super::refuse(
            caller.e2b,
            StatusCode::SERVICE_UNAVAILABLE,
            "session_away",
            format!(
                "session {id} is paused on node {node}, which is not running now: its state is \
                 on that node's disk, and it resumes once that node is back (try again later)"
            ),
        );
    }
    if caller.e2b {
        // E2B has no dead sandboxes: one that is gone is not found (answered here).
        return next.run(req).await;
    }
    let get_whole = req.method() == Method::GET
        && req.uri().path().trim_end_matches('/') == format!("/v1/sessions/{id}");
    if let Some(answer) = lost_session(state, &caller.user.name, id, get_whole).await {
        return answer;
    }
    match listed {
        Directory::Lost {
            kernel,
            created_at,
            lost_at,
        } => lost_answer(
            id,
            &caller.user.name,
            kernel,
            micros(created_at),
            micros(lost_at),
            0,
            get_whole,
        ),
        _ => next.run(req).await,
    }
}

/// Whether the sandbox an E2B in-sandbox request names is held here (its handler then
/// checks the token).
pub(super) fn sandbox_is_here(state: &AppState, req: &Request) -> bool {
    let id = sandbox_headers(req.headers())
        .0
        .and_then(|v| Uuid::parse_str(v).ok());
    id.is_some_and(|id| state.registry.all().iter().any(|s| s.id == id))
}

/// The sandbox an E2B in-sandbox request names and the user whose access token it carries:
/// the token is an HMAC of the sandbox id keyed by the owner's broker token, so it is
/// checked against each user's (never forwarded unchecked).
pub(super) fn sandbox_owner(
    state: &AppState,
    headers: &axum::http::HeaderMap,
) -> Option<(Uuid, Arc<User>)> {
    let (id, token) = sandbox_headers(headers);
    let id = Uuid::parse_str(id?).ok()?;
    let (token, kind) = token?;
    let user = state
        .users
        .find(|u| token_matches(&u.token, id, kind, token))?;
    Some((id, user))
}
