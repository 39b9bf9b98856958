//! The workspace files of a session's user under `/v1/sessions/{id}/files`: list, download,
//! upload, delete, move. Every path goes through the session's [`Workspace`](crate::session::Workspace),
//! which resolves it beneath the workspace with no symlink followed; what is created belongs
//! to the user's kernel identity, so the kernel can overwrite, move and delete it.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::error::ApiResult;
use super::extract::{read_upload, BodyLimit, JsonBody, OwnedSession, UploadBudget};
use super::shapes::{ErrorBody, ErrorResponse, FileJson};
use super::AppState;
use crate::session::files;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_files))
        .routes(routes!(get_file, put_file, delete_file, move_file))
        .layer(axum::extract::DefaultBodyLimit::disable())
}

/// Response header of `GET /v1/sessions/{id}/files`: `true` when the listing was cut short.
const FILES_TRUNCATED: &str = "x-files-truncated";

/// Files in the user's workspace
///
/// At most 10,000 files; a listing cut short says so in the `x-files-truncated` header.
#[utoipa::path(get, operation_id = "list_files", path = "/v1/sessions/{id}/files", tag = "files", params(("id" = uuid::Uuid, Path)),
    responses((status = 200, description = "ok", body = Vec<FileJson>,
            headers(("x-files-truncated" = String, description = "`true` when the listing was cut short"))),
        (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse),
        (status = 410, response = ErrorResponse)))]
async fn list_files(State(state): State<AppState>, owned: OwnedSession) -> ApiResult<Response> {
    let session = owned.session;
    session.touch();
    let listing = state.registry.workspace(&session)?.list(10_000).await?;
    // The body stays a plain array (compatible); a cut-short listing says so in a header.
    let truncated = if listing.truncated { "true" } else { "false" };
    let body: Vec<FileJson> = listing.files.into_iter().map(FileJson::from).collect();
    Ok(([(FILES_TRUNCATED, truncated)], Json(body)).into_response())
}

/// Download a workspace file
#[utoipa::path(get, operation_id = "get_file", path = "/v1/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = uuid::Uuid, Path), ("path" = String, Path, description = "relative to the workspace; no `..`, no symlinks")),
    responses((status = 200, description = "raw bytes", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 413, response = ErrorResponse)))]
async fn get_file(
    State(state): State<AppState>,
    owned: OwnedSession,
    Path((_, path)): Path<(String, String)>,
) -> ApiResult<Response> {
    let session = owned.session;
    session.touch();
    let (file, size) = state
        .registry
        .workspace(&session)?
        .open_for_read(&path, state.limits.max_file_bytes)
        .await?;
    // Streamed from the file as the client reads: a slow reader holds a chunk of memory,
    // not the whole file. The size read at opening is all that is sent, whatever the kernel
    // appends meanwhile.
    let chunks = tokio_util::io::ReaderStream::new(tokio::io::AsyncReadExt::take(
        tokio::fs::File::from_std(file),
        size,
    ));
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        Body::from_stream(chunks),
    )
        .into_response())
}

/// Upload a workspace file
#[utoipa::path(put, operation_id = "put_file", path = "/v1/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = uuid::Uuid, Path), ("path" = String, Path, description = "relative to the workspace; directories are created")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, description = "written"),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse), (status = 413, response = ErrorResponse),
        (status = 429, description = "the user's uploads in progress hold all the memory the broker gives them (twice `--max-file-bytes`); retry once one has finished", body = ErrorBody)))]
async fn put_file(
    State(state): State<AppState>,
    owned: OwnedSession,
    Path((_, path)): Path<(String, String)>,
    body: Body,
) -> ApiResult<StatusCode> {
    let session = owned.session;
    files::clean_relative(&path)?;
    let mut budget = UploadBudget::of(&state, &session.user.name);
    let data = read_upload(body, state.limits.max_file_bytes, &mut budget).await?;
    session.touch();
    state
        .registry
        .workspace(&session)?
        .write(&path, data)
        .await?;
    Ok(StatusCode::CREATED)
}

/// Delete a workspace file or empty directory
///
/// A symlink is deleted as the link it is (its target is not touched); a directory that is
/// not empty is refused with 409.
#[utoipa::path(delete, operation_id = "delete_file", path = "/v1/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = uuid::Uuid, Path), ("path" = String, Path, description = "relative to the workspace; no `..`, no symlinks on the way")),
    responses((status = 204, description = "deleted"),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse),
        (status = 409, description = "a directory that is not empty", body = ErrorBody),
        (status = 410, response = ErrorResponse)))]
async fn delete_file(
    State(state): State<AppState>,
    owned: OwnedSession,
    Path((_, path)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let session = owned.session;
    files::clean_relative(&path)?;
    session.touch();
    state.registry.workspace(&session)?.remove(&path).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The body of `PATCH /v1/sessions/{id}/files/{path}`: where the entry goes (the same
/// shape as the Jupyter contents API's rename).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveBody {
    /// The new path, relative to the workspace; missing directories are created.
    path: String,
}

impl BodyLimit for MoveBody {
    fn body_limit(_: &AppState) -> usize {
        16 << 10
    }
}

/// Move or rename a workspace file or directory
///
/// Never replaces: an existing destination answers 409. Missing directories of the
/// destination are created, owned by the kernel's identity as uploads are.
#[utoipa::path(patch, operation_id = "move_file", path = "/v1/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = uuid::Uuid, Path), ("path" = String, Path, description = "the entry to move, relative to the workspace")),
    request_body = MoveBody,
    responses((status = 200, description = "moved; the entry at its new path", body = MovedJson),
        (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse),
        (status = 404, response = ErrorResponse),
        (status = 409, description = "the destination exists", body = ErrorBody),
        (status = 410, response = ErrorResponse), (status = 413, response = ErrorResponse)))]
async fn move_file(
    State(state): State<AppState>,
    owned: OwnedSession,
    Path((_, path)): Path<(String, String)>,
    JsonBody(body): JsonBody<MoveBody>,
) -> ApiResult<Json<MovedJson>> {
    let session = owned.session;
    files::clean_relative(&path)?;
    let to = files::clean_relative(&body.path)?;
    session.touch();
    let workspace = state.registry.workspace(&session)?;
    workspace.rename(&path, &body.path).await?;
    Ok(Json(MovedJson {
        path: to.to_string_lossy().into_owned(),
    }))
}

/// The answer of a move.
#[derive(serde::Serialize, ToSchema)]
#[schema(as = MovedFile)]
pub struct MovedJson {
    /// The entry's new path, relative to the workspace (cleaned: no `./`).
    path: String,
}
