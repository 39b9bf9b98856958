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
use axum::routing::get;
use axum::Router;

use super::auth::Caller;
use super::error::ApiError;
use super::AppState;

const INDEX: &str = include_str!("../../ui/index.html");
const LOGIN: &str = include_str!("../../ui/login.html");
const APP_JS: &str = include_str!("../../ui/app.js");
const STYLE: &str = include_str!("../../ui/style.css");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ui", get(to_slash))
        .route("/ui/", get(index))
        .route("/ui/index.html", get(index))
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/ui/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

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

async fn index(caller: Result<Caller, ApiError>) -> Response {
    match caller {
        Ok(_) => page(StatusCode::OK, INDEX),
        Err(_) => page(StatusCode::UNAUTHORIZED, LOGIN),
    }
}
