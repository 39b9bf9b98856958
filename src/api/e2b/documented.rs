//! What the E2B routes' documentation shares, so each thing is written once: the error
//! answers every route of a plane can give ([`ControlErrors`] for the control plane,
//! [`SandboxErrors`] for envd, the code interpreter and the Connect services), added after
//! a route's own answers with `responses((status = 200, ...), ControlErrors)`; and E2B's
//! `/v2` aliases of control-plane routes ([`v2`]), served by the same handlers and
//! documented from the route they repeat.

use std::collections::BTreeMap;

use utoipa::openapi::path::Operation;
use utoipa::openapi::schema::SchemaType;
use utoipa::openapi::{ContentBuilder, ObjectBuilder, RefOr, Response, ResponseBuilder};
use utoipa_axum::router::UtoipaMethodRouter;

/// Answers with an E2B JSON body (`{code, message}` for errors), by status.
fn json_answers(answers: &[(u16, &str)]) -> BTreeMap<String, RefOr<Response>> {
    answers
        .iter()
        .map(|(status, description)| {
            let body = ContentBuilder::new()
                .schema(Some(ObjectBuilder::new().schema_type(SchemaType::AnyValue)))
                .build();
            let response = ResponseBuilder::new()
                .description(*description)
                .content("application/json", body)
                .build();
            (status.to_string(), RefOr::T(response))
        })
        .collect()
}

/// The error answers of the control plane (`/e2b/sandboxes`, `X-API-KEY`).
pub(super) struct ControlErrors;

impl utoipa::IntoResponses for ControlErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        json_answers(&[
            (400, "E2B error `{code, message}`"),
            (401, "no or unknown X-API-KEY"),
            (404, "no such sandbox of the caller's"),
            (413, "body too large"),
            (429, "too many failed authentications, or a quota"),
            (501, "not supported, said so"),
            (503, "the kernel could not start"),
        ])
    }
}

/// The error answers of the sandbox's own routes (envd, the code interpreter, Connect).
pub(super) struct SandboxErrors;

impl utoipa::IntoResponses for SandboxErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        json_answers(&[
            (400, "E2B error `{code, message}` (Connect's on RPC routes)"),
            (401, "no access token"),
            (
                404,
                "no such sandbox (or a token that is not its), file or context",
            ),
            (409, "already exists"),
            (413, "too large"),
            (429, "a quota"),
            (501, "not supported, said so"),
            (503, "the kernel could not start"),
        ])
    }
}

/// `routes` again under E2B's `/e2b/v2/`: the same handlers; each operation documented as
/// the one it repeats, its id followed by `_v2` and its summary's `(E2B)` become
/// `(E2B, v2)`.
pub(super) fn v2<S>(routes: UtoipaMethodRouter<S>) -> UtoipaMethodRouter<S> {
    let (schemas, mut paths, method_router) = routes;
    paths.paths = std::mem::take(&mut paths.paths)
        .into_iter()
        .map(|(path, mut item)| {
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ];
            for operation in operations.into_iter().flatten() {
                rename_v2(operation);
            }
            (path.replacen("/e2b/", "/e2b/v2/", 1), item)
        })
        .collect();
    (schemas, paths, method_router)
}

fn rename_v2(operation: &mut Operation) {
    if let Some(id) = &mut operation.operation_id {
        id.push_str("_v2");
    }
    if let Some(summary) = &mut operation.summary {
        *summary = summary.replace("(E2B)", "(E2B, v2)");
    }
}
