//! The replay UI: `GET /ui/`, a page to browse the caller's recorded sessions and step
//! through one, following it live (`GET /` leads there: a browser user who opens the
//! broker's address expects it). Plain HTML, CSS and JavaScript from `ui/`, built into
//! the binary with `include_str!` (no build step, nothing to deploy beside the binary).
//!
//! The page itself needs a token (`?token=`, or a header); without one it answers 401 with a
//! small form that asks for it. The page keeps the token in `sessionStorage`, drops it from
//! the address bar, and sends it as an `Authorization` header to the JSON APIs it reads. The
//! script and style sheet are code without data and are served without a token. A strict
//! Content-Security-Policy keeps kernel output from running script: the page inserts output
//! as text, images as `data:` URLs only.

use axum::extract::{Path, RawQuery};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Caller;
use super::error::ApiError;
use super::shapes::ErrorBody;
use super::AppState;

const INDEX: &str = include_str!("../../ui/index.html");
const LOGIN: &str = include_str!("../../ui/login.html");
/// The page's scripts by file name, in the order the page loads them: `common.js` (what the
/// others use), `events.js` (broker events described), `list.js` (search, filters, the
/// list), `timeline.js` (a session's events as cells and events), `snapshots.js` (a
/// session's snapshots), `app.js` (the page).
const SCRIPTS: [(&str, &str); 6] = [
    ("common.js", include_str!("../../ui/common.js")),
    ("events.js", include_str!("../../ui/events.js")),
    ("list.js", include_str!("../../ui/list.js")),
    ("timeline.js", include_str!("../../ui/timeline.js")),
    ("snapshots.js", include_str!("../../ui/snapshots.js")),
    ("app.js", include_str!("../../ui/app.js")),
];
const STYLE: &str = include_str!("../../ui/style.css");

/// `connect-src` also names loopback servers: "Open in JupyterLab" calls a Jupyter server on
/// this machine (another port, hence another origin). Nothing else leaves the page.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self' http://127.0.0.1:* http://localhost:*; \
                   base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(root))
        .routes(routes!(to_slash))
        .routes(routes!(index))
        .routes(routes!(index_html))
        .routes(routes!(script))
        .routes(routes!(style_css))
}

/// The broker's root: the session browser
#[utoipa::path(get, operation_id = "root_redirect", path = "/", tag = "ui", security(()),
    responses((status = 307, description = "to `/ui/`, keeping the query")))]
async fn root(RawQuery(query): RawQuery) -> Redirect {
    to_ui(query)
}

/// The session browser's address without its slash
#[utoipa::path(get, operation_id = "ui_redirect", path = "/ui", tag = "ui", security(()),
    responses((status = 307, description = "to `/ui/`, keeping the query")))]
async fn to_slash(RawQuery(query): RawQuery) -> Redirect {
    to_ui(query)
}

/// A temporary redirect to the page, with the query it came with (`?token=` among it).
fn to_ui(query: Option<String>) -> Redirect {
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

/// One of the session browser's scripts (no token: code without data)
#[utoipa::path(get, operation_id = "ui_script", path = "/ui/{script}", tag = "ui", security(()),
    params(("script" = String, Path, description = "`common.js`, `events.js`, `list.js`, `timeline.js` or `app.js`")),
    responses((status = 200, description = "JavaScript", content_type = "text/javascript", body = String),
        (status = 404, description = "no such file", body = ErrorBody)))]
async fn script(Path(name): Path<String>) -> Response {
    match SCRIPTS.iter().find(|(n, _)| *n == name) {
        Some((_, body)) => asset("text/javascript; charset=utf-8", body),
        None => ApiError::not_found("no such file of the session browser").into_response(),
    }
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
