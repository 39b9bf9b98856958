//! Router tests without a socket (axum's `oneshot`): authentication, the owned-session
//! extractor, the JSON body extractor, the fallback, and that every route of the document
//! is served. The registry runs on a fake sandbox whose launches fail: these tests are of
//! the api layer alone (real kernels are in tests/it/sessions.rs).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use serde_json::Value;
use tower::ServiceExt;
use uuid::Uuid;

use super::{router, ApiLimits, AppState};
use crate::api::auth::User;
use crate::kernel::spec::KernelSpecs;
use crate::session::testing::NoKernels;
use crate::session::{NoRecorder, Registry, SessionConfig, UserLimits};

const ALICE: &str = "alice-token";

fn user(name: &str, token: &str, index: u32) -> Arc<User> {
    Arc::new(User {
        name: name.into(),
        token: token.into(),
        index,
        limits: UserLimits::default(),
        max_sessions: 2,
        checkpoints: Default::default(),
        pause: Default::default(),
        secrets: Default::default(),
    })
}

fn state() -> AppState {
    let specs = Arc::new(KernelSpecs::builtin_python3(&std::env::temp_dir()));
    AppState {
        registry: Registry::new(
            Arc::new(NoKernels),
            SessionConfig::default(),
            specs.names(),
            Arc::new(NoRecorder),
        ),
        users: Arc::new(super::auth::Users::new([
            user("alice", ALICE, 0),
            user("bob", "bob-token", 1),
        ])),
        limits: Arc::new(ApiLimits {
            max_code_bytes: 100,
            max_file_bytes: 1000,
            execution_timeout: Duration::from_secs(5),
            max_execution_timeout: Duration::from_secs(10),
            clients: Default::default(),
        }),
        started: std::time::Instant::now(),
        kernelspecs: specs,
        jupyter_clients: Default::default(),
        recording: None,
        metrics: Arc::new(super::metrics::Metrics::new("local")),
        user_load: Arc::new(super::user_load::UserLoad::new(0, 0)),
        auth_failures: Arc::new(super::auth_failures::AuthFailures::new(0)),
        stopping: Default::default(),
        egress: None,
        cluster: None,
        uploads: Arc::new(super::extract::upload_budgets(1000)),
    }
}

/// One request through a fresh router: the status, the content type and the body (JSON when
/// it parses, else a string).
async fn call(
    method: Method,
    uri: &str,
    token: Option<&str>,
    body: impl Into<Body>,
) -> (StatusCode, String, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = req.body(body.into()).unwrap();
    let resp = router(state()).oneshot(req).await.unwrap();
    let status = resp.status();
    let content_type = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, content_type, body)
}

#[tokio::test]
async fn a_request_without_a_valid_token_is_401() {
    let id = Uuid::new_v4();
    for (method, uri) in [
        (Method::GET, "/v1/sessions".to_string()),
        (Method::POST, "/v1/sessions".to_string()),
        (Method::GET, format!("/v1/sessions/{id}")),
        (Method::POST, format!("/v1/sessions/{id}/execute")),
        (Method::GET, format!("/v1/sessions/{id}/stream")),
        (Method::GET, format!("/api/kernels/{id}")),
        (Method::GET, "/metrics".to_string()),
    ] {
        for token in [None, Some("wrong")] {
            let (status, _, body) = call(method.clone(), &uri, token, "{}").await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri}");
            assert_eq!(body["error"]["code"], "unauthorized", "{method} {uri}");
            // The Jupyter API answers a bad token with the plain body, as before.
            assert!(body.get("reason").is_none(), "{method} {uri}");
        }
    }
    let (status, _, _) = call(Method::GET, "/healthz", None, "").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_session_that_is_not_the_callers_is_404() {
    let missing = Uuid::new_v4().to_string();
    for id in [missing.as_str(), "not-a-uuid"] {
        for (method, path) in [
            (Method::GET, ""),
            (Method::POST, "/interrupt"),
            (Method::POST, "/restart"),
            (Method::GET, "/files"),
            (Method::GET, "/files/a/b.txt"),
            (Method::PUT, "/files/a.txt"),
            (Method::GET, "/stream"),
            (Method::DELETE, ""),
        ] {
            let uri = format!("/v1/sessions/{id}{path}");
            let (status, _, body) = call(method.clone(), &uri, Some(ALICE), "").await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{method} {uri}");
            assert_eq!(body["error"]["code"], "session_not_found", "{method} {uri}");
        }
        // The lookup comes before the body: an oversized body to a missing session is 404.
        let uri = format!("/v1/sessions/{id}/execute");
        let (status, _, _) = call(Method::POST, &uri, Some(ALICE), vec![b' '; 1 << 20]).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        // The Jupyter API: same status and code, with Jupyter's fields.
        for (method, path) in [
            (Method::GET, ""),
            (Method::DELETE, ""),
            (Method::POST, "/interrupt"),
            (Method::POST, "/restart"),
            (Method::GET, "/channels"),
        ] {
            let uri = format!("/api/kernels/{id}{path}");
            let (status, _, body) = call(method.clone(), &uri, Some(ALICE), "").await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{method} {uri}");
            assert_eq!(body["error"]["code"], "session_not_found", "{method} {uri}");
            assert_eq!(body["reason"], "Not Found", "{method} {uri}");
            assert_eq!(body["message"], body["error"]["message"]);
        }
    }
    let (_, _, body) = call(Method::GET, "/v1/sessions/nope", Some(ALICE), "").await;
    assert_eq!(
        body["error"]["message"],
        "no session \"nope\" (session ids are UUIDs)"
    );
    let (_, _, body) = call(Method::GET, "/api/kernels/nope", Some(ALICE), "").await;
    assert_eq!(body["message"], "no kernel \"nope\"");
}

#[tokio::test]
async fn json_bodies_are_checked_before_anything_runs() {
    for (body, needle) in [
        (&b"{"[..], "invalid JSON in the request body"),
        (br#"{"kernal": "python3"}"#, "unknown field `kernal`"),
        (
            b"{\"kernel\": \"\xff\"}",
            "invalid JSON in the request body",
        ),
        (
            br#"{"idle_timeout_seconds": -1}"#,
            "invalid JSON in the request body",
        ),
    ] {
        let (status, _, v) = call(Method::POST, "/v1/sessions", Some(ALICE), body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["code"], "bad_request");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
    }
    let (status, _, v) = call(
        Method::POST,
        "/v1/sessions",
        Some(ALICE),
        vec![b' '; 65 << 10],
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(v["error"]["code"], "payload_too_large");
    assert_eq!(
        v["error"]["message"],
        "the request body is larger than the limit of 65536 bytes"
    );
    // The Jupyter API's body limit, in Jupyter's error body.
    let (status, _, v) = call(
        Method::POST,
        "/api/kernels",
        Some(ALICE),
        vec![b' '; 300 << 10],
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(v["reason"], "Payload Too Large");
    let (status, _, v) = call(Method::POST, "/api/kernels", Some(ALICE), "{").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["reason"], "Bad Request");
    // An unknown kernel spec is refused before anything is launched.
    let body = r#"{"name": "cobol"}"#;
    let (status, _, v) = call(Method::POST, "/api/kernels", Some(ALICE), body).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(v["message"].as_str().unwrap().contains("no kernel spec"));
}

#[tokio::test]
async fn operations_answer() {
    let (status, content_type, body) = call(Method::GET, "/healthz", None, "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(content_type.starts_with("application/json"));
    assert_eq!(
        body,
        serde_json::json!({"status": "ok", "sandbox": "local", "sessions": 0, "pooled_kernels": 0})
    );
    let (status, content_type, body) = call(Method::GET, "/metrics", Some(ALICE), "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(content_type, super::metrics::PROMETHEUS_CONTENT_TYPE);
    let text = body.as_str().unwrap();
    assert!(
        text.contains("kernel_broker_sessions{state=\"idle\"} 0"),
        "{text}"
    );
    assert!(text.contains("kernel_broker_kernel_deaths_total{backend=\"local\"} 0"));
    // A scraper that asks for OpenMetrics gets that content type, and the same body.
    let req = Request::builder()
        .uri("/metrics")
        .header(header::AUTHORIZATION, format!("Bearer {ALICE}"))
        .header(
            header::ACCEPT,
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        )
        .body(Body::empty())
        .unwrap();
    let resp = router(state()).oneshot(req).await.unwrap();
    assert_eq!(
        resp.headers()[header::CONTENT_TYPE],
        super::metrics::CONTENT_TYPE
    );
    let (status, _, body) = call(Method::GET, "/openapi.json", None, "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body,
        serde_json::from_str::<Value>(super::openapi::document_json()).unwrap()
    );
    let (status, _, body) = call(Method::GET, "/nowhere", Some(ALICE), "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        body["error"]["message"],
        "no such endpoint; see /openapi.json"
    );
}

/// `GET /` leads a browser to the session browser, with or without a token, keeping the
/// query (`?token=`); other methods on `/` and other unknown paths are still 404/405. The
/// page's scripts are served by name, and only they.
#[tokio::test]
async fn the_root_redirects_to_the_session_browser() {
    for (uri, token, to) in [
        ("/", None, "/ui/"),
        ("/", Some(ALICE), "/ui/"),
        ("/?token=alice-token", None, "/ui/?token=alice-token"),
        ("/ui", None, "/ui/"),
        // A hostile query stays a query of the page: encoded as it came, never a new
        // header line or another site.
        (
            "/?q=%0d%0aSet-Cookie:%20x=1&next=//evil.example",
            None,
            "/ui/?q=%0d%0aSet-Cookie:%20x=1&next=//evil.example",
        ),
    ] {
        let mut req = Request::builder().uri(uri);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let resp = router(state())
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::TEMPORARY_REDIRECT, "{uri}");
        assert_eq!(resp.headers()[header::LOCATION], to, "{uri}");
    }
    let (status, _, _) = call(Method::POST, "/", Some(ALICE), "").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    let (status, _, body) = call(Method::GET, "/index.html", Some(ALICE), "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "not_found");
    // The page's scripts are served without a token; nothing else under their route.
    for name in ["common.js", "events.js", "list.js", "timeline.js", "app.js"] {
        let (status, content_type, _) = call(Method::GET, &format!("/ui/{name}"), None, "").await;
        assert_eq!(status, StatusCode::OK, "{name}");
        assert!(content_type.starts_with("text/javascript"), "{name}");
    }
    for name in ["nope.js", "login.html", "..%2Fapp.js", "app.js.map"] {
        let (status, _, _) = call(Method::GET, &format!("/ui/{name}"), None, "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{name}");
    }
}

/// Every operation of the document reaches a handler (not the fallback, not 405).
#[tokio::test]
async fn every_documented_route_is_served() {
    let doc: Value = serde_json::from_str(super::openapi::document_json()).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 29, "{} paths", paths.len());
    let id = Uuid::new_v4().to_string();
    for (path, item) in paths {
        let uri = path
            .replace("{id}", &id)
            .replace("{path}", "a/b.txt")
            .replace("{name}", "python3")
            .replace("{resource}", "logo-64x64.png");
        for method in item.as_object().unwrap().keys() {
            let m = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let (status, _, body) = call(m, &uri, None, "").await;
            assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            assert_ne!(
                body["error"]["message"], "no such endpoint; see /openapi.json",
                "{method} {path} is documented but not routed"
            );
        }
    }
}

/// Every source file under `src/api` but this one, with its text.
fn api_sources() -> Vec<(PathBuf, String)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/api");
    let mut stack = vec![PathBuf::from(dir)];
    let mut out = Vec::new();
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.file_name().is_some_and(|n| n == "router_tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((path, text));
        }
    }
    assert!(out.len() > 10);
    out
}

/// The other direction: a route can only be added with its documentation, because every
/// file registers routes through `utoipa_axum::routes!`. A plain axum `.route(` would be
/// served without being documented.
#[test]
fn routes_are_only_registered_with_their_documentation() {
    for (path, text) in api_sources() {
        for needle in [".route(", ".route_service(", ".nest(", "routing::get"] {
            assert!(
                !text.contains(needle),
                "{} uses `{needle}`: register routes with `.routes(routes!(handler))` so they are documented",
                path.display()
            );
        }
    }
}

/// The front doors reach sessions only through the session layer: no file of the api
/// layer names the sandbox (what it needs, the session layer offers or re-exports).
#[test]
fn the_api_layer_never_names_the_sandbox() {
    let needle = ["crate", "::sandbox"].concat();
    for (path, text) in api_sources() {
        assert!(
            !text.contains(&needle),
            "{} names `{needle}`: go through the session layer (`crate::session`)",
            path.display()
        );
    }
}
