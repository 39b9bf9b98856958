//! E2B's fork route (`POST /e2b/sandboxes/{id}/fork`) against a real broker: the shape of
//! its answer (one entry per fork, each a sandbox as create answers it, or the session
//! layer's refusal in E2B's shape), its validation, and that another user's sandbox or a
//! session the E2B API did not make is absent. E2B's own SDK runs the fork flow in
//! protocol-tests/test_e2b_fork.py.

use crate::common;

on_one_backend!(
    fork_requests_are_validated_and_answered_in_e2bs_shape,
    only_the_callers_own_sandboxes_can_be_forked,
);

use common::*;
use serde_json::{json, Value};

/// A control-plane request (`E2B_API_URL` is `<broker>/e2b`) with `key` as `X-API-KEY`.
async fn control(b: &Broker, path: &str, key: Option<&str>, body: Option<&str>) -> (u16, Value) {
    let mut req = reqwest::Client::new().post(b.url(&format!("/e2b{path}")));
    if let Some(k) = key {
        req = req.header("X-API-KEY", k);
    }
    if let Some(body) = body {
        req = req
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    let r = within(120, path, req.send()).await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn create(b: &Broker, key: &str) -> String {
    let (s, v) = control(b, "/sandboxes", Some(key), Some(r#"{"timeout": 120}"#)).await;
    assert_eq!(s, 201, "{v}");
    v["sandboxID"].as_str().unwrap().to_string()
}

async fn fork(b: &Broker, id: &str, key: &str, body: &str) -> (u16, Value) {
    control(b, &format!("/sandboxes/{id}/fork"), Some(key), Some(body)).await
}

/// `{"code": status, "message": <a sentence>}`, E2B's error shape.
fn e2b_error(v: &Value, status: u16) -> &str {
    assert_eq!(v["code"], json!(status), "{v}");
    let message = v["message"].as_str().unwrap_or_default();
    assert!(message.len() > 10, "a sentence: {v}");
    message
}

async fn fork_requests_are_validated_and_answered_in_e2bs_shape(sandbox: &'static str) {
    let b = Broker::start(sandbox, |_| {}).await;
    let id = create(&b, ALICE).await;
    let (s, v) = control(&b, &format!("/sandboxes/{id}/fork"), None, Some("{}")).await;
    assert_eq!(s, 401, "{v}");
    e2b_error(&v, 401);
    // Refused before anything is tried: a 400 in E2B's shape, nothing made.
    for (body, needle) in [
        ("{", "invalid JSON"),
        (r#"{"count": 0}"#, "between 1 and 8"),
        (r#"{"count": 9}"#, "E2B 20"),
        (r#"{"count": 20}"#, "between 1 and 8"),
        (r#"{"count": -1}"#, "invalid JSON"),
        (r#"{"timeout": 0}"#, "timeout"),
        (r#"{"timeout": 10000000}"#, "timeout"),
    ] {
        let (s, v) = fork(&b, &id, ALICE, body).await;
        assert_eq!(s, 400, "{body}: {v}");
        let message = e2b_error(&v, 400);
        assert!(message.contains(needle), "{body}: {message}");
    }
    let (_, listed) = b.api(ALICE).get("/v1/sessions").await;
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    // A good request: the forks, each a sandbox as create answers it (a copy of the
    // sandbox's kernel and workspace: CRIU 4, `scripts/setup-criu`).
    if !criu_ready() {
        b.stop().await;
        return;
    }
    let (s, v) = fork(&b, &id, ALICE, r#"{"count": 2, "timeout": 30}"#).await;
    assert_eq!(s, 201, "{v}");
    let entries = v.as_array().unwrap();
    assert_eq!(entries.len(), 2, "{v}");
    for entry in entries {
        let sbx = &entry["sandbox"];
        let fork_id = sbx["sandboxID"].as_str().unwrap();
        assert_ne!(fork_id, id);
        for field in ["envdAccessToken", "trafficAccessToken", "envdVersion"] {
            assert!(sbx[field].is_string(), "{field}: {entry}");
        }
        let (s, detail) = b.api(ALICE).get(&format!("/v1/sessions/{fork_id}")).await;
        assert_eq!(s, 200, "{detail}");
        assert!(detail["expires_at"].is_string(), "{detail}");
        let (s, _) = control_delete(&b, fork_id, ALICE).await;
        assert_eq!(s, 204);
    }
    b.stop().await;
}

async fn control_delete(b: &Broker, id: &str, key: &str) -> (u16, String) {
    let r = reqwest::Client::new()
        .delete(b.url(&format!("/e2b/sandboxes/{id}")))
        .header("X-API-KEY", key)
        .send();
    let r = within(60, "kill", r).await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn only_the_callers_own_sandboxes_can_be_forked(sandbox: &'static str) {
    let b = Broker::start(sandbox, |_| {}).await;
    let alices = create(&b, ALICE).await;
    // A session of Alice's that the E2B API did not make is no sandbox of hers.
    let rest = b.api(ALICE).create().await;
    for (id, key) in [
        (alices.as_str(), BOB),
        (rest.as_str(), ALICE),
        ("not-a-sandbox", ALICE),
        ("00000000-0000-4000-8000-000000000000", ALICE),
    ] {
        let (s, v) = fork(&b, id, key, r#"{"count": 1}"#).await;
        assert_eq!(s, 404, "{id}: {v}");
        let message = e2b_error(&v, 404);
        assert!(message.contains("not found"), "{message}");
    }
    // Nothing was made for anyone.
    let (_, listed) = b.api(BOB).get("/v1/sessions").await;
    assert_eq!(listed, json!([]));
    let (_, listed) = b.api(ALICE).get("/v1/sessions").await;
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
    b.stop().await;
}
