//! The API document, generated: every route is registered through `utoipa_axum`'s
//! `OpenApiRouter` with the `routes!` macro, which adds the handler's `#[utoipa::path]`
//! (summary, parameters, bodies, responses) to the document as it adds the route to axum,
//! so a route cannot be served without being documented. This file adds what no handler
//! says: the title, the security schemes (bearer, Jupyter's `token`, `?token=`), the shared
//! error response, and the tags.
//!
//! `docs/openapi.json` is this document, committed so it can be read without running the
//! broker; a test fails when it differs. To regenerate it:
//! `KB_WRITE_OPENAPI=1 cargo nextest run --lib openapi` (or `cargo test --lib openapi`).

use std::sync::OnceLock;

use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;

use super::shapes::{ErrorBody, ErrorDetail, ErrorResponse};
use super::AppState;

struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("Authorization: Bearer TOKEN"))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "jupyterToken",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "Authorization",
                "token TOKEN (Jupyter's form)",
            ))),
        );
        components.add_security_scheme(
            "queryToken",
            SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::with_description(
                "token",
                "?token=TOKEN, for WebSocket clients that cannot set headers",
            ))),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "kernel-broker",
        description = "Long-lived, sandboxed IPython sessions for agents and notebook frontends. \
                       See docs/API.md. Generated from the handlers (src/api/openapi.rs). \
                       Any request with a token may be answered 429 `too_many_requests` (the \
                       user's requests in progress are capped) or `too_many_auth_failures` (its \
                       address failed to authenticate too often), with `Retry-After`."
    ),
    security(("bearer" = []), ("jupyterToken" = []), ("queryToken" = [])),
    components(schemas(ErrorBody, ErrorDetail), responses(ErrorResponse)),
    modifiers(&SecuritySchemes),
    tags(
        (name = "sessions", description = "The agent API: sessions, executions, the agent stream"),
        (name = "checkpoints", description = "Checkpoints of a session: take, list, rewind to, fork from (docs/API.md)"),
        (name = "snapshots", description = "Snapshots: a session's state kept on disk, which new sessions start from (docs/API.md)"),
        (name = "files", description = "The user's workspace"),
        (name = "recordings", description = "Recorded sessions: events, notebooks, replay"),
        (name = "jupyter", description = "The Jupyter Server / Kernel Gateway kernels API"),
        (name = "ui", description = "The session browser"),
        (name = "operations", description = "Health, metrics, this document"),
        (name = "e2b", description = "E2B compatibility: E2B's SDKs with E2B_API_URL=BASE/e2b, E2B_SANDBOX_URL=BASE/e2b/sandbox, E2B_API_KEY=TOKEN (docs/API.md)"),
        (name = "mcp", description = "Model Context Protocol over Streamable HTTP (docs/API.md, MCP)"),
    )
)]
struct ApiDoc;

/// The routes with their documentation, before state (shared by the router and the document).
pub fn documented_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi()).merge(super::routes())
}

/// An axum path as OpenAPI writes it: a catch-all `{*path}` is the parameter `{path}`.
pub fn openapi_path(axum_path: &str) -> String {
    axum_path.replace("{*", "{")
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = documented_routes().into_openapi();
    doc.paths.paths = std::mem::take(&mut doc.paths.paths)
        .into_iter()
        .map(|(path, item)| (openapi_path(&path), item))
        .collect();
    doc
}

/// The document as served and committed: pretty JSON with a final newline. Built once.
pub fn document_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| match document().to_pretty_json() {
        Ok(mut s) => {
            s.push('\n');
            s
        }
        // Serialising a tree of strings and maps cannot fail; answer something valid anyway.
        Err(e) => serde_json::json!({"error": e.to_string()}).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json");

    #[test]
    fn the_committed_document_is_the_generated_one() {
        let generated = document_json();
        if std::env::var_os("KB_WRITE_OPENAPI").is_some() {
            std::fs::write(COMMITTED, generated).unwrap();
            return;
        }
        let committed = std::fs::read_to_string(COMMITTED).unwrap_or_default();
        assert!(
            committed == generated,
            "docs/openapi.json differs from the document the handlers generate; \
             regenerate it with `KB_WRITE_OPENAPI=1 cargo nextest run --lib openapi` and commit it"
        );
    }

    #[test]
    fn the_document_keeps_what_clients_and_readers_use() {
        let v: serde_json::Value = serde_json::from_str(document_json()).unwrap();
        assert!(v["openapi"].as_str().unwrap().starts_with("3.1"));
        let schemes = &v["components"]["securitySchemes"];
        for s in ["bearer", "jupyterToken", "queryToken"] {
            assert!(schemes[s].is_object(), "security scheme {s}");
        }
        assert_eq!(
            v["paths"]["/healthz"]["get"]["security"],
            serde_json::json!([{}])
        );
        let execute = &v["paths"]["/v1/sessions/{id}/execute"]["post"];
        assert_eq!(
            execute["responses"]["200"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/Execution"
        );
        assert_eq!(
            execute["responses"]["401"]["$ref"],
            "#/components/responses/Error"
        );
        assert!(execute["summary"].as_str().unwrap().starts_with("Run code"));
        assert!(v["paths"]["/v1/sessions/{id}/files/{path}"]["put"].is_object());
        let mut ids: Vec<&str> = v["paths"]
            .as_object()
            .unwrap()
            .values()
            .flat_map(|item| item.as_object().unwrap().values())
            .map(|op| op["operationId"].as_str().unwrap())
            .collect();
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), n, "operationIds must be unique");
        for schema in ["Session", "Execution", "Error", "FileEntry", "Kernel"] {
            assert!(
                v["components"]["schemas"][schema].is_object(),
                "schema {schema}"
            );
        }
    }
}
