//! Checkpoints and rewind (issue 36, item 2), local sandbox, real kernels forked from
//! their user's template, through the REST API: a checkpoint is the frozen former live
//! kernel; a rewind makes a fork of it the live kernel; the bounds drop the oldest; a
//! checkpoint's processes do not run; nothing is left once the session ends; a checkpoint
//! kernel that lies about its fork gets nothing adopted.

use crate::common;

use common::forked::out;
use common::*;
use serde_json::{json, Value};

fn forking(a: &mut kernel_broker::config::ServeArgs) {
    a.fork_server = Some(true);
    a.preload = Some("numpy".into());
}

async fn take(api: &Api, id: &str) -> Value {
    let (status, v) = api
        .post(&format!("/v1/sessions/{id}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 201, "{v}");
    v
}

async fn list(api: &Api, id: &str) -> Value {
    let (status, v) = api.get(&format!("/v1/sessions/{id}/checkpoints")).await;
    assert_eq!(status, 200, "{v}");
    v
}

async fn rewind(api: &Api, id: &str, cp: &str) -> (u16, Value) {
    api.post(
        &format!("/v1/sessions/{id}/rewind"),
        json!({ "checkpoint": cp }),
    )
    .await
}

/// `user`'s cgroup leaves (pids hierarchy), sorted.
fn leaves(broker: &Broker, user: &str) -> Vec<String> {
    let dir = pids_cgroup_base(broker.cgroup_name()).join(user);
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The host pids in leaf `leaf` of `user`.
fn leaf_pids(broker: &Broker, user: &str, leaf: &str) -> Vec<i32> {
    std::fs::read_to_string(
        pids_cgroup_base(broker.cgroup_name())
            .join(user)
            .join(leaf)
            .join("cgroup.procs"),
    )
    .unwrap_or_default()
    .lines()
    .filter_map(|l| l.trim().parse().ok())
    .collect()
}

async fn broker_events(api: &Api, id: &str) -> Vec<Value> {
    let (status, v) = api
        .get(&format!("/v1/sessions/{id}/events?channel=broker"))
        .await;
    assert_eq!(status, 200, "{v}");
    v["events"].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_rewind_brings_back_the_checkpoints_state_again_and_again() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1; import random; random.seed(5)").await;
    let started = std::time::Instant::now();
    let cp = take(&api, &a).await;
    let take_ms = started.elapsed().as_millis();
    let cp_id = cp["id"].as_str().unwrap().to_string();
    assert_eq!(cp["session"], a.as_str(), "{cp}");
    assert_eq!(cp["execution_count"], 1, "{cp}");
    assert!(cp["memory_bytes"].as_u64().unwrap() > 0, "{cp}");
    // The session goes on, with the state it had.
    let draw = out(&api, &a, "print(random.random())").await;
    out(&api, &a, "x = 2; y = 3\ndef g(): pass").await;
    out(&api, &a, "random.random(); random.random()").await;
    for round in 0..2 {
        let started = std::time::Instant::now();
        let (status, s) = rewind(&api, &a, &cp_id).await;
        let rewind_ms = started.elapsed().as_millis();
        assert_eq!(status, 200, "{s}");
        assert_eq!(s["id"], a.as_str(), "{s}");
        assert_eq!(s["execution_count"], 1, "{s}");
        assert_eq!(s["state"], "idle", "{s}");
        let v = api
            .execute(&a, "print(x, 'y' in dir(), 'g' in dir(), random.random())")
            .await;
        assert_eq!(v["status"], "ok", "{v}");
        assert_eq!(v["execution_count"], 2, "{v}");
        assert_eq!(
            v["stdout"].as_str().unwrap().trim(),
            format!("1 False False {draw}"),
            "round {round}"
        );
        out(&api, &a, "x = 99; z = 1").await;
        eprintln!("checkpoint take: {take_ms} ms; rewind: {rewind_ms} ms");
    }
    // The recording tells it.
    let events = broker_events(&api, &a).await;
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"checkpoint_taken"), "{kinds:?}");
    let rewound: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "session_rewound")
        .collect();
    assert_eq!(rewound.len(), 2, "{kinds:?}");
    assert_eq!(rewound[0]["detail"]["checkpoint"], cp_id.as_str());
    assert_eq!(rewound[0]["detail"]["execution_count"], 1);
    let l = list(&api, &a).await;
    assert_eq!(l["checkpoints"].as_array().unwrap().len(), 1, "{l}");
    assert_eq!(l["budget"]["count"], 1, "{l}");
    broker.stop().await;
}
