//! The session option `"workspace": "shared" | "own"` of `POST /v1/sessions`: an own
//! workspace is empty, seen at /home/user (home and working directory) and /workspace,
//! reached by the files API, kept across a restart of the kernel, private to the session,
//! and removed when the session ends (nothing outside it removed with it, whatever the
//! kernel planted). Bad values are a 400. On Docker (one container per user) it is the
//! user's workspace, also at /home/user.

use crate::common;

on_both_backends!(an_own_workspace_is_the_sessions_alone_and_goes_with_it);
on_one_backend!(bad_workspace_values_are_refused);

use common::*;
use serde_json::{json, Value};

fn stdout(exec: &Value) -> String {
    exec["stdout"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_string()
}

async fn an_own_workspace_is_the_sessions_alone_and_goes_with_it(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let (status, own) = api.post("/v1/sessions", json!({"workspace": "own"})).await;
    assert_eq!(status, 201, "{own}");
    let own = own["id"].as_str().unwrap().to_string();
    let (status, shared) = api
        .post("/v1/sessions", json!({"workspace": "shared"}))
        .await;
    assert_eq!(status, 201, "{shared}");
    let shared = shared["id"].as_str().unwrap().to_string();

    let r = api
        .http
        .put(broker.url(&format!("/v1/sessions/{own}/files/mine.txt")))
        .bearer_auth(ALICE)
        .body("only mine")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let seen = api
        .execute(
            &own,
            "print(open('/home/user/mine.txt').read() == open('/workspace/mine.txt').read() == 'only mine')",
        )
        .await;
    assert_eq!(stdout(&seen), "True", "{seen}");
    // The shared workspace does not have it (Docker: the session's kernel is in a container
    // of its own).
    let (status, _) = api
        .get(&format!("/v1/sessions/{shared}/files/mine.txt"))
        .await;
    assert_eq!(status, 404);

    // The rest on the host's side, for the local sandbox (Docker's: sandbox_docker_own).
    if sb == "local" {
        // Its own: the kernel starts there, and a restart keeps what it holds.
        let cwd = api
            .execute(&own, "import os\nprint(os.getcwd(), os.environ['HOME'])")
            .await;
        assert_eq!(stdout(&cwd), "/home/user /home/user", "{cwd}");
        let (status, _) = api
            .post(&format!("/v1/sessions/{own}/restart"), json!({}))
            .await;
        assert_eq!(status, 200);
        let kept = api.execute(&own, "print(open('mine.txt').read())").await;
        assert_eq!(stdout(&kept), "only mine", "{kept}");
        // On the host: its own directory, which the kernel plants symlinks in.
        let root = broker.data_dir.join("sandboxes").join(&own);
        assert!(root.join("home/mine.txt").exists());
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("precious"), "keep").unwrap();
        api.execute(
            &own,
            &format!(
                "import os\nos.symlink({0:?}, 'dir-link')\nos.symlink({0:?} + '/precious', '/tmp/file-link')",
                outside.path().to_str().unwrap()
            ),
        )
        .await;
        let (status, _) = api.delete(&format!("/v1/sessions/{own}")).await;
        assert_eq!(status, 204);
        assert!(!root.exists(), "the own workspace outlived its session");
        assert_eq!(
            std::fs::read_to_string(outside.path().join("precious")).unwrap(),
            "keep"
        );
    } else {
        let (status, _) = api.delete(&format!("/v1/sessions/{own}")).await;
        assert_eq!(status, 204);
    }
    // Another user's session never reaches it.
    let (status, _) = broker
        .api(BOB)
        .get(&format!("/v1/sessions/{shared}/files"))
        .await;
    assert_eq!(status, 404);
    broker.stop().await;
}

async fn bad_workspace_values_are_refused(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    for bad in [
        json!("bogus"),
        json!(""),
        json!("OWN"),
        json!(1),
        json!(["own"]),
        json!({"own": true}),
        json!("own\u{0}"),
    ] {
        let (status, body) = api.post("/v1/sessions", json!({"workspace": bad})).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, _) = api.get("/v1/sessions").await;
    assert_eq!(status, 200);
    let (_, list) = api.get("/v1/sessions").await;
    assert_eq!(
        list.as_array().unwrap().len(),
        0,
        "a refused create made a session"
    );
    broker.stop().await;
}
