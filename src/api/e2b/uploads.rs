//! envd's `/files` route: download (`GET`) and upload (`POST`, multipart or
//! `application/octet-stream`, optionally `Content-Encoding: gzip`), with user metadata
//! (`X-Metadata-<key>` headers, stored as `user.e2b.<key>` extended attributes:
//! `session::files::metadata`).
//!
//! Served at `/e2b/sandbox/files` (what the SDKs call with `E2B_SANDBOX_URL`, the sandbox
//! named by `E2b-Sandbox-Id` and its `X-Access-Token`) and at `/files`, where the SDKs'
//! signed URLs point (`E2B_SANDBOX_URL`'s origin + `/files`): a request without an access
//! token is authorised by its `signature` (`signing.rs`).
//!
//! A gzip body is decompressed as it arrives, and `--max-file-bytes` bounds what it
//! decompresses to: a small body that inflates past the limit (a gzip bomb) stops being
//! decompressed there and answers `413`, writing nothing.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::multipart::MultipartError;
use axum::extract::{FromRequest, FromRequestParts, Multipart, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{sandbox_headers, SandboxCaller};
use super::documented::SandboxErrors;
use super::signing::{self, Operation, Signed};
use super::{inside_path, workspace_relative, E2bError, E2bResult, E2bState};
use crate::api::error::ApiError;
use crate::api::extract::{collect_upload, read_upload, UploadBudget};
use crate::api::AppState;
use crate::session::files::{metadata, Metadata};
use crate::session::SessionError;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(download, upload))
        .routes(routes!(signed_download, signed_upload))
}

/// Bytes of a multipart upload beyond its files' own: boundaries, part headers, preamble.
const MULTIPART_OVERHEAD: usize = 1 << 20;

/// Files in one multipart upload at most (each costs a write and a line of the answer).
const MAX_PARTS: usize = 1000;

/// The header prefix of upload metadata (envd's `X-Metadata-`).
const METADATA_HEADER: &str = "x-metadata-";

#[derive(Deserialize)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<i64>,
}

/// The `/files` query; one that does not parse is E2B's `400`, not axum's plain text.
struct FilesQuery(FileQuery);

impl FromRequestParts<AppState> for FilesQuery {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, E2bError> {
        Query::<FileQuery>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| Self(q))
            .map_err(|e| E2bError::bad_request(e.body_text()))
    }
}

/// The sandbox a `/files` request acts in: by its access token when it carries one (and
/// names its sandbox), else by its signature.
async fn authorize(
    state: &AppState,
    parts: &mut Parts,
    q: &FileQuery,
    operation: Operation,
) -> E2bResult<SandboxCaller> {
    let (named, token) = sandbox_headers(&parts.headers);
    let named = named.map(str::to_string);
    if token.is_some() || q.signature.is_none() {
        return SandboxCaller::from_request_parts(parts, state).await;
    }
    let e2b = parts
        .extensions
        .get::<Arc<E2bState>>()
        .cloned()
        .ok_or_else(|| E2bError::internal("e2b state", "the E2B router has no state"))?;
    let signed = Signed {
        path: q.path.as_deref().unwrap_or(""),
        user: q.username.as_deref(),
        signature: q.signature.as_deref().unwrap_or(""),
        expiration: q.signature_expiration,
    };
    signing::verify(state, &e2b, parts, named.as_deref(), &signed, operation)
}

/// Download a file (envd)
#[utoipa::path(get, operation_id = "e2b_download", path = "/e2b/sandbox/files", tag = "e2b", security(()),
    params(("path" = String, Query, description = "`/home/user/...`, `/workspace/...` or relative to the workspace"),
        ("signature" = Option<String>, Query, description = "a signed URL's signature, in place of the access token"),
        ("signature_expiration" = Option<i64>, Query, description = "the signature's expiry, Unix seconds")),
    responses((status = 200, description = "raw bytes", content_type = "application/octet-stream", body = Vec<u8>), SandboxErrors))]
async fn download(
    State(state): State<AppState>,
    FilesQuery(q): FilesQuery,
    request: Request,
) -> E2bResult<Response> {
    let (mut parts, _) = request.into_parts();
    let caller = authorize(&state, &mut parts, &q, Operation::Read).await?;
    let path = q
        .path
        .ok_or_else(|| E2bError::bad_request("the path parameter is missing"))?;
    let rel = workspace_relative(&path)?;
    let ws = state.registry.workspace(&caller.session)?;
    let max = state.limits.max_file_bytes;
    caller.session.touch();
    let data = ws.read(&rel, max).await.map_err(|e| file_error(e, &path))?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

/// Download a file through a signed URL (`files.download_url`)
#[utoipa::path(get, operation_id = "e2b_signed_download", path = "/files", tag = "e2b", security(()),
    params(("path" = String, Query, description = "as signed"),
        ("signature" = String, Query, description = "`v1_...`, as E2B's SDKs sign"),
        ("signature_expiration" = Option<i64>, Query, description = "Unix seconds")),
    responses((status = 200, description = "raw bytes", content_type = "application/octet-stream", body = Vec<u8>), SandboxErrors))]
async fn signed_download(
    state: State<AppState>,
    q: FilesQuery,
    request: Request,
) -> E2bResult<Response> {
    download(state, q, request).await
}

fn file_error(e: SessionError, path: &str) -> E2bError {
    match e {
        SessionError::NoSuchFile { .. } => E2bError::not_found(format!("path {path:?} not found")),
        other => other.into(),
    }
}

/// How long a refused upload's body is read before the refusal is sent.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads and drops what is left of the body of an upload refused for its headers (at most
/// `limit` bytes, for at most [`DRAIN_TIMEOUT`]): answered unread, the connection is closed
/// while the client still writes it, and the client sees a broken pipe instead of the
/// refusal (seen with E2B's SDK and an invalid metadata header).
async fn drain(body: Body, limit: usize) {
    let mut chunks = body.into_data_stream();
    let mut seen = 0usize;
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while let Some(Ok(chunk)) = chunks.next().await {
            seen = seen.saturating_add(chunk.len());
            if seen > limit {
                break;
            }
        }
    })
    .await;
}

/// The `X-Metadata-<key>` headers as metadata (keys lowercased, as envd does), checked.
fn upload_metadata(headers: &HeaderMap) -> E2bResult<Metadata> {
    let mut out = Metadata::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else {
            continue;
        };
        let value = value.to_str().map_err(|_| {
            E2bError::bad_request(format!(
                "invalid metadata: the value for key {key:?} is not printable US-ASCII"
            ))
        })?;
        out.entry(key.to_ascii_lowercase())
            .or_insert_with(|| value.to_string());
    }
    metadata::validate(&out)
        .map_err(|why| E2bError::bad_request(format!("invalid metadata: {why}")))?;
    Ok(out)
}

/// Whether the body is gzip (`true`) or as is (`false`), from `Content-Encoding`; anything
/// else is refused as envd refuses it.
fn gzip_encoded(headers: &HeaderMap) -> E2bResult<bool> {
    let Some(v) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(false);
    };
    let raw = v.to_str().unwrap_or("");
    let coding = raw
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match coding.as_str() {
        "" | "identity" => Ok(false),
        "gzip" => Ok(true),
        _ => Err(E2bError::bad_request(format!(
            "unsupported Content-Encoding: {raw}, supported: [gzip]"
        ))),
    }
}

/// What a gzip decoder writes into: at most `cap` bytes are kept; past them `over` is set
/// and decoding stops (the caller's limit then refuses the body).
struct Capped {
    out: Vec<u8>,
    total: usize,
    cap: usize,
    over: bool,
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = self.cap.saturating_sub(self.total);
        if buf.len() > room {
            self.out.extend_from_slice(&buf[..room]);
            self.total += room;
            self.over = true;
            return Err(std::io::Error::other("decompressed past the limit"));
        }
        self.out.extend_from_slice(buf);
        self.total += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `body` decompressed as it arrives; what it decompresses to is cut after `cap` bytes (the
/// stream then ends, so a reader bounded below `cap` sees too many bytes and refuses, and
/// nothing past `cap` is ever decompressed). Not gzip, or cut short: an `InvalidData` error.
fn gunzip(body: Body, cap: usize) -> impl Stream<Item = std::io::Result<Bytes>> + Send {
    let decoder = flate2::write::MultiGzDecoder::new(Capped {
        out: Vec::new(),
        total: 0,
        cap,
        over: false,
    });
    let input = body.into_data_stream();
    futures::stream::unfold((input, Some(decoder)), |(mut input, decoder)| async move {
        let mut decoder = decoder?;
        let (step, last) = match input.next().await {
            Some(Ok(chunk)) => (decoder.write_all(&chunk), false),
            Some(Err(e)) => return Some((Err(std::io::Error::other(e)), (input, None))),
            None => (decoder.try_finish(), true),
        };
        let over = decoder.get_ref().over;
        let produced = Bytes::from(std::mem::take(&mut decoder.get_mut().out));
        let item = match step {
            Err(_) if over => Ok(produced),
            Err(e) => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the body is not valid gzip: {e}"),
            )),
            Ok(()) => Ok(produced),
        };
        let next = (item.is_ok() && !over && !last).then_some(decoder);
        Some((item, (input, next)))
    })
}

/// Upload files (envd): multipart field `file` (its file name is the path without
/// `?path=`) or one octet-stream body, optionally `Content-Encoding: gzip`
///
/// Each file is refused past `--max-file-bytes` (413) as its bytes arrive (decompressed
/// bytes, for a gzip body); a multipart body is also refused (413) past `--max-file-bytes`
/// plus 1 MiB in all (several files of one request together) or past 1000 files; 429 while
/// the user's uploads in progress hold twice `--max-file-bytes`. `X-Metadata-<key>` headers
/// are stored on every file of the upload. A refused upload writes nothing.
#[utoipa::path(post, operation_id = "e2b_upload", path = "/e2b/sandbox/files", tag = "e2b", security(()),
    params(("path" = Option<String>, Query, description = "`/home/user/...`, `/workspace/...` or relative to the workspace"),
        ("signature" = Option<String>, Query, description = "a signed URL's signature, in place of the access token"),
        ("signature_expiration" = Option<i64>, Query, description = "the signature's expiry, Unix seconds")),
    responses((status = 200, description = "`[{path, name, type, metadata?}]`", body = serde_json::Value), SandboxErrors))]
async fn upload(
    State(state): State<AppState>,
    FilesQuery(q): FilesQuery,
    request: Request,
) -> E2bResult<Json<Vec<Value>>> {
    let (mut parts, body) = request.into_parts();
    let caller = authorize(&state, &mut parts, &q, Operation::Write).await?;
    let headers = &parts.headers;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let max = state.limits.max_file_bytes;
    let checked = gzip_encoded(headers).and_then(|gzip| Ok((gzip, upload_metadata(headers)?)));
    let (gzip, meta) = match checked {
        Ok(checked) => checked,
        Err(refused) => {
            drain(body, max.saturating_add(MULTIPART_OVERHEAD)).await;
            return Err(refused);
        }
    };
    // Held until the files are written.
    let mut budget = UploadBudget::of(&state, &caller.session.user.name);
    let mut uploads: Vec<(String, Bytes)> = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        // Every part is held until the last has arrived (nothing is written unless the
        // whole upload is good), so the whole body is bounded, not only each part: part
        // headers, boundaries and preamble are buffered by the parser, and many parts
        // each within the limit would add up.
        let total = max.saturating_add(MULTIPART_OVERHEAD);
        let body = if gzip {
            Body::from_stream(gunzip(body, total.saturating_add(1)))
        } else {
            body
        };
        let limited = Request::from_parts(
            parts.clone(),
            Body::new(http_body_util::Limited::new(body, total)),
        );
        let mut form = Multipart::from_request(limited, &state)
            .await
            .map_err(|e| E2bError::bad_request(format!("invalid multipart body: {e}")))?;
        let multipart_error = move |e: MultipartError| -> ApiError {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(format!(
                    "the upload is larger than the limit of {total} bytes (the files of one \
                     request together, headers included); send large files one per request"
                ))
            } else {
                ApiError::bad_request(format!("invalid multipart body: {}", e.body_text()))
            }
        };
        while let Some(field) = form.next_field().await.map_err(multipart_error)? {
            if uploads.len() == MAX_PARTS {
                return Err(E2bError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("an upload holds at most {MAX_PARTS} files"),
                ));
            }
            let name = field.file_name().map(str::to_string);
            let path = match (&q.path, name) {
                (Some(p), _) => p.clone(),
                (None, Some(n)) => n,
                (None, None) => {
                    return Err(E2bError::bad_request(
                        "a file part has no file name and no ?path=",
                    ))
                }
            };
            // Read as it arrives, refused at the first byte past the limit: a part far
            // larger than the limit costs the limit, not its size.
            let data = collect_upload(field.map_err(multipart_error), max, &mut budget).await?;
            uploads.push((path, data));
        }
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| E2bError::bad_request("the path parameter is missing"))?;
        let body = if gzip {
            // One byte past the limit is enough for the reader to refuse it.
            Body::from_stream(gunzip(body, max.saturating_add(1)))
        } else {
            body
        };
        let data = read_upload(body, max, &mut budget).await?;
        uploads.push((path, data));
    }
    let ws = state.registry.workspace(&caller.session)?;
    caller.session.touch();
    let mut out = Vec::new();
    for (path, data) in uploads {
        let rel = workspace_relative(&path)?;
        if meta.is_empty() {
            ws.write(&rel, data).await?;
        } else {
            ws.write_with_metadata(&rel, data, meta.clone()).await?;
        }
        let name = rel.rsplit('/').next().unwrap_or(&rel).to_string();
        let mut entry = json!({"path": inside_path(&rel), "name": name, "type": "file"});
        if !meta.is_empty() {
            entry["metadata"] = json!(meta);
        }
        out.push(entry);
    }
    Ok(Json(out))
}

/// Upload a file through a signed URL (`files.upload_url`)
#[utoipa::path(post, operation_id = "e2b_signed_upload", path = "/files", tag = "e2b", security(()),
    params(("path" = Option<String>, Query, description = "as signed"),
        ("signature" = String, Query, description = "`v1_...`, as E2B's SDKs sign"),
        ("signature_expiration" = Option<i64>, Query, description = "Unix seconds")),
    responses((status = 200, description = "`[{path, name, type, metadata?}]`", body = serde_json::Value), SandboxErrors))]
async fn signed_upload(
    state: State<AppState>,
    q: FilesQuery,
    request: Request,
) -> E2bResult<Json<Vec<Value>>> {
    upload(state, q, request).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::GzEncoder;

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    async fn inflate(body: Vec<u8>, cap: usize) -> std::io::Result<Vec<u8>> {
        // In small chunks, as a network delivers it.
        let chunks: Vec<std::io::Result<Bytes>> = body
            .chunks(7)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let body = Body::from_stream(futures::stream::iter(chunks));
        let mut out = Vec::new();
        let mut s = std::pin::pin!(gunzip(body, cap));
        while let Some(item) = s.next().await {
            out.extend_from_slice(&item?);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn gzip_bodies_inflate_within_the_cap() {
        let data = b"hello gzip ".repeat(1000);
        assert_eq!(inflate(gz(&data), 1 << 20).await.unwrap(), data);
        // Two members, as `cat a.gz b.gz` makes.
        let mut two = gz(b"ab");
        two.extend(gz(b"cd"));
        assert_eq!(inflate(two, 100).await.unwrap(), b"abcd");
        // A bomb: 64 MiB of zeros in a small body stops at the cap.
        let bomb = gz(&vec![0u8; 64 << 20]);
        assert!(bomb.len() < 100 << 10);
        let out = inflate(bomb, 1001).await.unwrap();
        assert_eq!(out.len(), 1001);
        // Not gzip; cut short.
        let e = inflate(b"not gzip at all".to_vec(), 100).await.unwrap_err();
        assert!(e.to_string().contains("not valid gzip"), "{e}");
        let whole = gz(&data);
        let cut = whole[..whole.len() / 2].to_vec();
        assert!(inflate(cut, 1 << 20).await.is_err());
    }

    #[test]
    fn content_encodings_are_envds() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_ENCODING, v.parse().unwrap());
            gzip_encoded(&h)
        };
        assert!(!gzip_encoded(&HeaderMap::new()).unwrap());
        assert!(with("gzip").unwrap());
        assert!(with("GZIP").unwrap());
        assert!(!with("identity").unwrap());
        let e = with("br").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("unsupported Content-Encoding"),
            "{}",
            e.message
        );
    }

    #[test]
    fn metadata_headers_are_checked() {
        let mut h = HeaderMap::new();
        h.insert("x-metadata-Owner", "data team".parse().unwrap());
        h.insert("x-other", "x".parse().unwrap());
        let m = upload_metadata(&h).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m["owner"], "data team");
        h.insert(
            "x-metadata-bad",
            "caf\u{e9}"
                .parse::<axum::http::HeaderValue>()
                .unwrap_or_else(|_| axum::http::HeaderValue::from_bytes(b"caf\xe9").unwrap()),
        );
        let e = upload_metadata(&h).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let mut big = HeaderMap::new();
        for i in 0..20 {
            big.insert(
                axum::http::HeaderName::from_bytes(format!("x-metadata-k{i}").as_bytes()).unwrap(),
                "v".repeat(250).parse().unwrap(),
            );
        }
        assert!(upload_metadata(&big)
            .unwrap_err()
            .message
            .contains("total metadata size"));
    }
}
