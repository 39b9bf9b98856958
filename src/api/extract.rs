//! The extractors every handler shares, so authentication, the session lookup and request
//! bodies are answered the same way everywhere (axum's custom-extractor pattern):
//!
//! - [`OwnedSession`]: the caller and the session `{id}` of the path, checked once: a bad
//!   token is `401`, an id that is not a UUID, another user's session or a missing one is
//!   `404 session_not_found` (a foreign session answers exactly as a missing one), an
//!   expired one `410`. [`OwnedKernel`] is the same for the Jupyter API, with its error body.
//! - [`JsonBody`]: a JSON request body read up to the limit its type declares
//!   ([`BodyLimit`]): `413` past it, `400` for malformed JSON, unknown fields or bytes that
//!   are not UTF-8; an empty body is `{}`.
//!
//! Also the small helpers the handlers of several files need ([`read_limited`] and
//! [`collect_limited`]).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, RawPathParams, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::auth::Caller;
use super::error::{ApiError, ApiResult, JupyterError};
use super::output_budget::ByteBudgets;
use super::AppState;
use crate::session::Session;

/// A session id from a path: anything but a UUID is a session that does not exist.
pub fn session_id(id: &str) -> ApiResult<Uuid> {
    Uuid::parse_str(id).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "session_not_found",
            format!("no session {id:?} (session ids are UUIDs)"),
        )
    })
}

/// The `{id}` segment of the matched route. Every route that uses the extractors names it
/// `id`; a route without one is a programming error answered as a missing session.
pub(super) async fn path_id(parts: &mut Parts, state: &AppState) -> ApiResult<String> {
    let params = RawPathParams::from_request_parts(parts, state)
        .await
        .map_err(|e| ApiError::internal("path parameters", e.body_text()))?;
    params
        .iter()
        .find(|(name, _)| *name == "id")
        .map(|(_, value)| value.to_string())
        .ok_or_else(|| ApiError::internal("path parameters", "the route has no {id}"))
}

/// The authenticated caller and their session `{id}`.
pub struct OwnedSession {
    pub caller: Caller,
    pub session: Arc<Session>,
}

impl FromRequestParts<AppState> for OwnedSession {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> ApiResult<Self> {
        let caller = Caller::from_request_parts(parts, state).await?;
        let id = session_id(&path_id(parts, state).await?)?;
        let session = state.registry.get(&caller.0.name, id)?;
        Ok(Self { caller, session })
    }
}

/// [`OwnedSession`] for the Jupyter kernels API: a kernel is a session, and errors carry
/// Jupyter's body (`message`, `reason`) too.
pub struct OwnedKernel {
    pub caller: Caller,
    pub session: Arc<Session>,
}

impl FromRequestParts<AppState> for OwnedKernel {
    /// A bad token answers with the plain error body, as every other `401`; a lookup
    /// failure with Jupyter's.
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        let caller = Caller::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let lookup = async {
            let id = path_id(parts, state).await?;
            let uuid = Uuid::parse_str(&id).map_err(|_| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "session_not_found",
                    format!("no kernel {id:?}"),
                )
            })?;
            Ok::<_, ApiError>(state.registry.get(&caller.0.name, uuid)?)
        };
        let session = lookup.await.map_err(|e| JupyterError(e).into_response())?;
        Ok(Self { caller, session })
    }
}

/// How many bytes of request body a JSON type accepts.
pub trait BodyLimit {
    fn body_limit(state: &AppState) -> usize;
}

/// A JSON request body of type `T`, read within `T`'s [`BodyLimit`].
pub struct JsonBody<T>(pub T);

impl<T> FromRequest<AppState> for JsonBody<T>
where
    T: DeserializeOwned + BodyLimit,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> ApiResult<Self> {
        let bytes = read_limited(req.into_body(), T::body_limit(state), "request body").await?;
        parse_json(&bytes, "request body").map(JsonBody)
    }
}

/// Read a whole body, refusing more than `limit` bytes with 413 (as soon as they arrive).
pub async fn read_limited(body: Body, limit: usize, what: &str) -> ApiResult<Bytes> {
    let chunks = body.into_data_stream().map_err(|e| {
        // A body cut short (the client left, a malformed chunk) is the client's doing.
        ApiError::bad_request(format!("reading the request body failed: {e}"))
    });
    collect_limited(chunks, limit, what).await
}

/// Gather a stream of chunks (a body, a multipart field) into one buffer, refusing the
/// first byte past `limit` with 413 as it arrives: what is held never exceeds `limit`,
/// whatever the client sends or claims in a `Content-Length`. The one place request bytes
/// are gathered before a size check.
pub async fn collect_limited<S>(chunks: S, limit: usize, what: &str) -> ApiResult<Bytes>
where
    S: Stream<Item = Result<Bytes, ApiError>>,
{
    collect(chunks, limit, what, None).await
}

async fn collect<S>(
    chunks: S,
    limit: usize,
    what: &str,
    mut budget: Option<&mut UploadBudget>,
) -> ApiResult<Bytes>
where
    S: Stream<Item = Result<Bytes, ApiError>>,
{
    let mut chunks = std::pin::pin!(chunks);
    let mut out = BytesMut::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        if chunk.len() > limit - out.len() {
            return Err(ApiError::too_large(format!(
                "the {what} is larger than the limit of {limit} bytes"
            )));
        }
        if let Some(b) = budget.as_deref_mut() {
            b.take(chunk.len())?;
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

/// The per-user budgets of upload bytes in the broker's memory: room for two uploads of the
/// largest file at once per user.
pub fn upload_budgets(max_file_bytes: usize) -> ByteBudgets {
    ByteBudgets::new(max_file_bytes.saturating_mul(2))
}

/// What one request's uploaded bytes hold of its user's upload budget, until it is dropped
/// (after the files are written). Each upload is bounded by the file limit; this bounds
/// what all of a user's uploads in progress hold together, so parallel uploads cannot add
/// up to more than a few files' worth of the broker's memory. Past it the upload is
/// refused (429) rather than made to wait: waiting uploads could hold the budget between
/// them with none able to finish.
pub struct UploadBudget {
    budget: Arc<tokio::sync::Semaphore>,
    held: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl UploadBudget {
    pub fn of(state: &AppState, user: &str) -> Self {
        Self {
            budget: state.uploads.of(user),
            held: None,
        }
    }

    fn take(&mut self, bytes: usize) -> ApiResult<()> {
        let n = u32::try_from(bytes).unwrap_or(u32::MAX);
        let permit = self.budget.clone().try_acquire_many_owned(n).map_err(|_| {
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "quota_exceeded",
                "the user's uploads in progress hold all the memory the broker gives them; \
                 retry once one has finished",
            )
        })?;
        match &mut self.held {
            Some(h) => h.merge(permit),
            None => self.held = Some(permit),
        }
        Ok(())
    }
}

/// [`read_limited`] for an upload: also within the user's [`UploadBudget`].
pub async fn read_upload(body: Body, limit: usize, budget: &mut UploadBudget) -> ApiResult<Bytes> {
    let chunks = body
        .into_data_stream()
        .map_err(|e| ApiError::bad_request(format!("reading the request body failed: {e}")));
    collect(chunks, limit, "file", Some(budget)).await
}

/// [`collect_limited`] for an upload's part: also within the user's [`UploadBudget`].
pub async fn collect_upload<S>(
    chunks: S,
    limit: usize,
    budget: &mut UploadBudget,
) -> ApiResult<Bytes>
where
    S: Stream<Item = Result<Bytes, ApiError>>,
{
    collect(chunks, limit, "file", Some(budget)).await
}

/// Parse JSON, answering 400 with serde's explanation. A body of only white space is `{}`,
/// so a client may send nothing for "all defaults".
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8], what: &str) -> ApiResult<T> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return serde_json::from_slice(b"{}")
            .map_err(|e| ApiError::bad_request(format!("{what}: {e}")));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON in the {what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug, Default)]
    #[serde(deny_unknown_fields)]
    struct CreateBody {
        kernel: Option<String>,
    }

    #[test]
    fn json_errors_are_the_projects() {
        let ok: CreateBody = parse_json(b"  \n", "request body").unwrap();
        assert!(ok.kernel.is_none());
        let ok: CreateBody = parse_json(br#"{"kernel": "python3"}"#, "request body").unwrap();
        assert_eq!(ok.kernel.as_deref(), Some("python3"));
        for (bad, needle) in [
            (&b"{"[..], "invalid JSON in the request body"),
            (br#"{"kernal": "x"}"#, "unknown field `kernal`"),
            (
                b"{\"kernel\": \"\xff\"}",
                "invalid JSON in the request body",
            ),
            (b"[]", "invalid JSON in the request body"),
        ] {
            let e = parse_json::<CreateBody>(bad, "request body").unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.code, "bad_request");
            assert!(e.message.contains(needle), "{}", e.message);
        }
    }

    #[test]
    fn session_ids_are_uuids() {
        let e = session_id("nope").unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.code, "session_not_found");
        assert!(session_id(&Uuid::new_v4().to_string()).is_ok());
    }

    #[tokio::test]
    async fn bodies_past_the_limit_are_413() {
        let e = read_limited(Body::from(vec![b'x'; 11]), 10, "file")
            .await
            .unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(e.message, "the file is larger than the limit of 10 bytes");
        let ok = read_limited(Body::from(vec![b'x'; 10]), 10, "file").await;
        assert_eq!(ok.unwrap().len(), 10);
    }

    #[tokio::test]
    async fn a_stream_is_refused_at_the_first_byte_past_the_limit() {
        // An endless stream: the refusal cannot wait for its end.
        let endless = futures::stream::repeat_with(|| Ok(Bytes::from_static(b"abcd")));
        let e = collect_limited(endless, 10, "file").await.unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let parts = futures::stream::iter([b"abcd", b"efgh"].map(|c| Ok(Bytes::from_static(c))));
        assert_eq!(
            &collect_limited(parts, 8, "file").await.unwrap()[..],
            b"abcdefgh"
        );
        let parts = futures::stream::iter([b"abcd", b"efgh"].map(|c| Ok(Bytes::from_static(c))));
        let e = collect_limited(parts, 7, "file").await.unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let broken = futures::stream::iter([Err(ApiError::bad_request("cut short"))]);
        let e = collect_limited(broken, 7, "file").await.unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}
