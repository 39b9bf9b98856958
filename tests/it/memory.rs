//! Memory and the other resources a user's sessions share, through the API, on both
//! backends: a user's memory total is admission control (a create that does not fit is
//! refused with 429, and every session told `ok` stays alive), a session past its own limit
//! dies alone with a clear reason, a kernel that cannot start says which resource ran out,
//! and the default limits let a user reach the default number of sessions with the data
//! stack imported (issue 20).

use crate::common;

on_both_backends!(
    more_sessions_than_the_memory_total_allows_end_alive_or_refused,
    a_session_past_its_own_limit_dies_alone_with_a_clear_reason,
    a_kernel_that_cannot_start_names_the_resource_that_ran_out,
    the_default_limits_reach_the_default_number_of_sessions_with_the_data_stack,
);

use common::*;
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;

/// The data stack, and `n_mb` MB of data held in a variable.
fn data_stack_with(n_mb: u64) -> String {
    format!(
        "import numpy as np, pandas as pd, matplotlib\nmatplotlib.use('Agg')\n\
         import matplotlib.pyplot as plt\n\
         data = np.ones({n_mb} * 1000 * 1000, dtype=np.uint8)\n\
         df = pd.DataFrame({{'x': range(1000)}})\nprint(int(data.sum()) // 1000000, len(df))"
    )
}

async fn session(api: &Api, id: &str) -> Value {
    let (status, s) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 200, "{s}");
    s
}

/// The scenario, scaled: fourteen creates, one after another, each importing the
/// data stack and holding 80 MB, against a user total that fits four sessions (with the
/// warm pool on, so pooled kernels count too). Every create is either told `ok` and stays
/// alive to the end, or refused with 429 and a message saying what is in use.
async fn more_sessions_than_the_memory_total_allows_end_alive_or_refused(sb: &'static str) {
    let broker = Broker::start(sb, |a| {
        a.memory_limit = Some(1024 * MIB);
        a.session_memory_limit = Some(224 * MIB);
        a.pool_size = Some(1);
    })
    .await;
    let api = broker.api(ALICE);
    let mut alive = Vec::new();
    let mut refused = Vec::new();
    for i in 0..14 {
        let (status, s) = api.post("/v1/sessions", json!({})).await;
        match status {
            201 => {
                let id = s["id"].as_str().unwrap().to_string();
                assert_eq!(s["memory_limit_bytes"], 224 * MIB, "{s}");
                let x = api.execute(&id, &data_stack_with(80)).await;
                assert_eq!(x["status"], "ok", "create {i}: {x}");
                assert_eq!(x["stdout"], "80 1000\n", "{x}");
                let used = session(&api, &id).await["memory_used_bytes"].as_u64();
                eprintln!("session {i}: data stack + 80 MB uses {used:?} bytes");
                if let Some(used) = used {
                    assert!(used > 80 * MIB && used <= 224 * MIB, "{used}");
                }
                alive.push(id);
            }
            429 => {
                assert_eq!(s["error"]["code"], "quota_exceeded", "{s}");
                let msg = s["error"]["message"].as_str().unwrap();
                assert!(
                    msg.contains("alice's 4 sessions use 896 MiB of 1024 MiB")
                        && msg.contains("this one asks for 224 MiB"),
                    "{msg}"
                );
                refused.push(i);
            }
            other => panic!("create {i}: {other} {s}"),
        }
    }
    assert_eq!(alive.len(), 4, "refused: {refused:?}");
    assert_eq!(refused, (4..14).collect::<Vec<_>>());
    // Everything told ok is still alive, with its data; the first ones idled all along.
    for id in &alive {
        let s = session(&api, id).await;
        assert_eq!(s["state"], "idle", "{s}");
        let x = api.execute(id, "print(int(data.sum()) // 1000000)").await;
        assert_eq!(x["stdout"], "80\n", "{x}");
    }
    // A session that asks for less fits where a default one does not.
    let (status, s) = api
        .post("/v1/sessions", json!({"memory_limit_bytes": 128 * MIB}))
        .await;
    assert_eq!(status, 201, "{s}");
    assert_eq!(s["memory_limit_bytes"], 128 * MIB);
    // Room comes back when a session goes.
    let (status, _) = api.delete(&format!("/v1/sessions/{}", alive[0])).await;
    assert_eq!(status, 204);
    let (status, s) = api.post("/v1/sessions", json!({})).await;
    assert_eq!(status, 201, "{s}");
    // Bob's total is his own.
    let (status, s) = broker.api(BOB).post("/v1/sessions", json!({})).await;
    assert_eq!(status, 201, "{s}");
    // A limit over the user's total, or under 16 MiB, is a bad request.
    for bad in [2048 * MIB, MIB] {
        let (status, e) = api
            .post("/v1/sessions", json!({"memory_limit_bytes": bad}))
            .await;
        assert_eq!(status, 400, "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("memory_limit_bytes must be between 16 MiB and alice's memory limit"),
            "{e}"
        );
    }
    broker.stop().await;
}

/// A session that allocates past its own limit is the one that dies, and says why; its
/// neighbour, idle with data, lives on.
async fn a_session_past_its_own_limit_dies_alone_with_a_clear_reason(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.memory_limit = Some(1024 * MIB)).await;
    let api = broker.api(ALICE);
    let idle = api.create().await;
    let x = api.execute(&idle, &data_stack_with(80)).await;
    assert_eq!(x["status"], "ok", "{x}");
    let (status, s) = api
        .post("/v1/sessions", json!({"memory_limit_bytes": 192 * MIB}))
        .await;
    assert_eq!(status, 201, "{s}");
    let hog = s["id"].as_str().unwrap().to_string();
    let x = api
        .execute_with(
            &hog,
            json!({"code": "blocks = []\nwhile True: blocks.append(b'x' * (16 << 20))", "timeout_seconds": 120}),
        )
        .await;
    assert_eq!(x["status"], "dead", "{x}");
    let evalue = x["error"]["evalue"].as_str().unwrap();
    assert!(
        evalue.contains("ran out of memory (limit 192 MiB)"),
        "{evalue}"
    );
    let s = session(&api, &hog).await;
    assert_eq!(s["state"], "dead", "{s}");
    assert_eq!(s["memory_used_bytes"], Value::Null, "{s}");
    assert!(
        s["dead_reason"]
            .as_str()
            .unwrap()
            .contains("ran out of memory (limit 192 MiB)"),
        "{s}"
    );
    let s = session(&api, &idle).await;
    assert_eq!(s["state"], "idle", "{s}");
    assert_eq!(s["dead_reason"], Value::Null);
    let x = api
        .execute(&idle, "print(int(data.sum()) // 1000000)")
        .await;
    assert_eq!(x["stdout"], "80\n", "{x}");
    // /metrics shows each of the caller's sessions' limit and use; Bob sees only totals.
    let (_, text) = api.get("/metrics").await;
    let text = text.as_str().unwrap().to_string();
    let limit = format!("kernel_broker_session_memory_limit_bytes{{session=\"{idle}\"}} 268435456");
    assert!(text.lines().any(|l| l == limit), "{text}");
    let used = format!("kernel_broker_session_memory_used_bytes{{session=\"{idle}\"}} ");
    assert!(text.lines().any(|l| l.starts_with(&used)), "{text}");
    let reserved = "kernel_broker_memory_reserved_bytes{holder=\"sessions\"} 469762048";
    assert!(text.lines().any(|l| l == reserved), "{text}");
    let (_, text) = broker.api(BOB).get("/metrics").await;
    assert!(!text.as_str().unwrap().contains(&idle), "{text}");
    broker.stop().await;
}

/// Memory and processes too small for a kernel to start: the create's error says which. A
/// full workspace does not stop a kernel from starting (measured: ipykernel starts on a full
/// disk), so the disk case is a kernel that fails while its workspace is full.
async fn a_kernel_that_cannot_start_names_the_resource_that_ran_out(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.session_pids_limit = Some(6)).await;
    let api = broker.api(ALICE);
    let (status, e) = api.post("/v1/sessions", json!({})).await;
    assert_eq!(status, 503, "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("it reached its limit of 6 processes and threads (pids)"),
        "{msg}"
    );
    broker.stop().await;

    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let (status, e) = api
        .post("/v1/sessions", json!({"memory_limit_bytes": 16 * MIB}))
        .await;
    assert_eq!(status, 503, "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("ran out of memory (limit 16 MiB) before it was ready"),
        "{msg}"
    );
    broker.stop().await;

    let broker = Broker::start(sb, |a| a.workspace_quota = Some(32 * MIB)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let fill = "n = 0\ntry:\n    with open('/workspace/fill', 'wb') as f:\n        \
                while True:\n            f.write(b'x' * (1 << 20)); f.flush(); n += 1\n\
                except OSError as e:\n    print(e.strerror)";
    let x = api.execute(&id, fill).await;
    assert_eq!(x["stdout"], "No space left on device\n", "{x}");
    let x = api.execute(&id, "import os; os._exit(1)").await;
    assert_eq!(x["status"], "dead", "{x}");
    let evalue = x["error"]["evalue"].as_str().unwrap();
    assert!(
        evalue.contains("exited with code 1: the workspace is full (disk quota 32 MiB)"),
        "{evalue}"
    );
    broker.stop().await;
}

/// With every limit at its default, a user reaches the default number of sessions (20),
/// each with pandas and matplotlib imported; the next create is refused for the count.
async fn the_default_limits_reach_the_default_number_of_sessions_with_the_data_stack(
    sb: &'static str,
) {
    let broker = Broker::start(sb, |a| a.pool_size = None).await;
    let api = broker.api(ALICE);
    let mut ids = Vec::new();
    for i in 0..20 {
        let (status, s) = api.post("/v1/sessions", json!({})).await;
        assert_eq!(status, 201, "session {i}: {s}");
        let id = s["id"].as_str().unwrap().to_string();
        let x = api.execute(&id, &data_stack_with(1)).await;
        assert_eq!(x["status"], "ok", "session {i}: {x}");
        ids.push(id);
    }
    let used: Vec<Option<u64>> = futures_used(&api, &ids).await;
    eprintln!("memory per idle kernel with the data stack imported: {used:?}");
    for id in &ids {
        let x = api.execute(id, "print(len(df))").await;
        assert_eq!(x["stdout"], "1000\n", "{x}");
    }
    let (status, e) = api.post("/v1/sessions", json!({})).await;
    assert_eq!(status, 429, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("20 sessions"),
        "{e}"
    );
    broker.stop().await;
}

async fn futures_used(api: &Api, ids: &[String]) -> Vec<Option<u64>> {
    let mut used = Vec::new();
    for id in ids {
        used.push(session(api, id).await["memory_used_bytes"].as_u64());
    }
    used
}
