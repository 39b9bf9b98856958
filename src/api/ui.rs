//! The replay UI: `GET /ui/`, a page to browse the caller's recorded sessions and step
//! through one, following it live. Plain HTML, CSS and JavaScript from `ui/`, built into
//! the binary with `include_str!` (no build step, nothing to deploy beside the binary).
//!
//! The page itself needs a token (`?token=`, or a header); without one it answers 401 with a
//! small form that asks for it. The page keeps the token in `sessionStorage`, drops it from
//! the address bar, and sends it as an `Authorization` header to the JSON APIs it reads. The
//! script and style sheet are code without data and are served without a token. A strict
//! Content-Security-Policy keeps kernel output from running script: the page inserts output
//! as text, images as `data:` URLs only.

use axum::extract::RawQuery;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Caller;
use super::error::ApiError;
use super::AppState;

const INDEX: &str = include_str!("../../ui/index.html");
const LOGIN: &str = include_str!("../../ui/login.html");
const APP_JS: &str = include_str!("../../ui/app.js");
const STYLE: &str = include_str!("../../ui/style.css");

/// `connect-src` also names loopback servers: "Open in JupyterLab" calls a Jupyter server on
/// this machine (another port, hence another origin). Nothing else leaves the page.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self' http://127.0.0.1:* http://localhost:*; \
                   base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(to_slash))
        .routes(routes!(index))
        .routes(routes!(index_html))
        .routes(routes!(app_js))
        .routes(routes!(style_css))
}

/// The session browser's address without its slash
#[utoipa::path(get, operation_id = "ui_redirect", path = "/ui", tag = "ui", security(()),
    responses((status = 307, description = "to `/ui/`, keeping the query")))]
async fn to_slash(RawQuery(query): RawQuery) -> Redirect {
    match query {
        Some(q) => Redirect::temporary(&format!("/ui/?{q}")),
        None => Redirect::temporary("/ui/"),
    }
}

fn page(status: StatusCode, html: &'static str) -> Response {
    let mut r = (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        html,
    )
        .into_response();
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = ([(header::CONTENT_TYPE, content_type)], body).into_response();
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

/// The session browser's script (no token: code without data)
#[utoipa::path(get, operation_id = "ui_script", path = "/ui/app.js", tag = "ui", security(()),
    responses((status = 200, description = "JavaScript", content_type = "text/javascript", body = String)))]
async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

/// The session browser's style sheet (no token)
#[utoipa::path(get, operation_id = "ui_style", path = "/ui/style.css", tag = "ui", security(()),
    responses((status = 200, description = "CSS", content_type = "text/css", body = String)))]
async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

/// The debugging view (HTML)
///
/// Without a token it answers 401 with a page that asks for one.
#[utoipa::path(get, operation_id = "ui_index", path = "/ui/", tag = "ui",
    responses((status = 200, description = "the page", content_type = "text/html", body = String),
        (status = 401, description = "a page asking for the token", content_type = "text/html", body = String)))]
async fn index(caller: Result<Caller, ApiError>) -> Response {
    page_for(caller)
}

/// The debugging view (HTML), by its file name
#[utoipa::path(get, operation_id = "ui_index_html", path = "/ui/index.html", tag = "ui",
    responses((status = 200, description = "the page", content_type = "text/html", body = String),
        (status = 401, description = "a page asking for the token", content_type = "text/html", body = String)))]
async fn index_html(caller: Result<Caller, ApiError>) -> Response {
    page_for(caller)
}

fn page_for(caller: Result<Caller, ApiError>) -> Response {
    match caller {
        Ok(_) => page(StatusCode::OK, INDEX),
        Err(_) => page(StatusCode::UNAUTHORIZED, LOGIN),
    }
}
