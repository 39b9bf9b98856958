//! `--keep-sessions`: sessions outlive the broker process. The real binary is stopped
//! (SIGTERM, or SIGKILL) and started again on the same data directory; the sessions come
//! back with their kernels, variables, workspace, execution counts and idle deadlines, on
//! both backends.

use crate::common;

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};

use common::spawned::{SpawnedBroker, Stop};
use common::{Api, ALICE};

/// The kernel processes of `cgroup` (every leaf below it, memory hierarchy).
fn kernel_pids(cgroup: &str) -> usize {
    let base = std::path::Path::new("/sys/fs/cgroup/memory").join(cgroup);
    let v2 = std::path::Path::new("/sys/fs/cgroup").join(cgroup);
    let base = if base.exists() { base } else { v2 };
    walk_procs(&base)
}

fn walk_procs(dir: &std::path::Path) -> usize {
    let own = std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|t| t.lines().count())
        .unwrap_or(0);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return own;
    };
    own + entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| walk_procs(&e.path()))
        .sum::<usize>()
}

/// The extra arguments that pick `sandbox`, and those with `--keep-sessions` added.
fn keeping(sandbox: &str) -> (Vec<&'static str>, Vec<&'static str>) {
    let backend = match sandbox {
        "docker" => vec!["--sandbox", "docker"],
        _ => vec![],
    };
    let mut args = vec!["--keep-sessions"];
    args.extend_from_slice(&backend);
    (backend, args)
}

async fn session(api: &Api, id: &str) -> Value {
    let (status, s) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 200, "{s}");
    s
}

/// The broker events of a session's recording, by kind.
async fn broker_events(api: &Api, id: &str) -> Vec<Value> {
    let (status, v) = api
        .get(&format!("/v1/sessions/{id}/events?channel=broker"))
        .await;
    assert_eq!(status, 200, "{v}");
    v["events"].as_array().cloned().unwrap_or_default()
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| e["kind"].as_str().map(str::to_string))
        .collect()
}

async fn keeps_state_across(sandbox: &'static str, how: Stop) {
    let (_, args) = keeping(sandbox);
    let args = args.as_slice();
    let mut broker = SpawnedBroker::start(args, None);
    let api = broker.api(ALICE);
    let id = api.create().await;
    let v = api
        .execute(&id, "x = 41\nopen('kept.txt', 'w').write('still here')")
        .await;
    assert_eq!(v["status"], "ok", "{v}");
    let before = session(&api, &id).await;
    assert_eq!(before["execution_count"], 1);
    // An agent stream open across the restart: its connection ends (never a hang), and a
    // new one carries on.
    let stream_url =
        |b: &SpawnedBroker| format!("ws://{}/v1/sessions/{id}/stream?token={ALICE}", b.addr);
    let (mut old_stream, _) = tokio_tungstenite::connect_async(stream_url(&broker))
        .await
        .unwrap();
    // The journal refreshes records every 2 s: after a SIGKILL the count is as of then.
    tokio::time::sleep(Duration::from_millis(2500)).await;

    broker.restart(how).await;
    common::within(30, "the old stream to end", async {
        while let Some(Ok(_)) = old_stream.next().await {}
    })
    .await;
    let api = broker.api(ALICE);
    let after = session(&api, &id).await;
    assert_eq!(after["state"], "idle", "{after}");
    assert_eq!(after["user"], "alice");
    assert_eq!(after["created_at"], before["created_at"]);
    assert_eq!(after["execution_count"], 1, "{after}");
    assert_eq!(after["last_activity"], before["last_activity"]);
    let v = api.execute(&id, "x + 1").await;
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["results"][0]["data"]["text/plain"], "42", "{v}");
    assert_eq!(v["execution_count"], 2, "the count goes on: {v}");
    let bytes = api
        .http
        .get(format!("{}/v1/sessions/{id}/files/kept.txt", api.base))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(bytes, "still here");
    let (mut stream, _) = tokio_tungstenite::connect_async(stream_url(&broker))
        .await
        .unwrap();
    common::ws_send(
        &mut stream,
        json!({"type": "execute", "id": "after", "code": "x + 3"}),
    )
    .await;
    let frames = common::ws_until_done(&mut stream, "after").await;
    let done = frames.last().unwrap();
    assert_eq!(done["execution"]["status"], "ok", "{frames:?}");
    assert_eq!(
        done["execution"]["results"][0]["data"]["text/plain"], "44",
        "{frames:?}"
    );
    assert_eq!(done["execution"]["execution_count"], 3, "{frames:?}");
    drop(stream);
    // The recording goes on, with the restart marked.
    let events = kinds(&broker_events(&api, &id).await);
    let restarted = events.iter().position(|k| k == "broker_restarted");
    assert!(restarted.is_some(), "{events:?}");
    if how == Stop::Term {
        assert!(events.contains(&"session_kept".to_string()), "{events:?}");
    }
    assert!(
        !events.contains(&"broker_stopped".to_string()),
        "{events:?}"
    );
    // Deleting the adopted session ends its kernel and forgets it.
    let (status, _) = api.delete(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 204);
    assert_eq!(api.get(&format!("/v1/sessions/{id}")).await.0, 404);
    broker.stop().await;
}

async fn in_flight_execution_gets_an_answer(sandbox: &'static str) {
    let (_, args) = keeping(sandbox);
    let args = args.as_slice();
    let mut broker = SpawnedBroker::start(args, None);
    let api = broker.api(ALICE);
    let id = api.create().await;
    // Still running when the broker stops: the client gets an answer at once, and the
    // kernel finishes the code.
    let running = {
        let api = broker.api(ALICE);
        let id = id.clone();
        tokio::spawn(async move { api.execute(&id, "import time\ntime.sleep(4)\ny = 7").await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stop = tokio::spawn(async move {
        broker.restart(Stop::Term).await;
        broker
    });
    let answer = common::within(30, "the in-flight execution's answer", running)
        .await
        .unwrap();
    assert_eq!(answer["status"], "error", "{answer}");
    assert_eq!(answer["error"]["ename"], "BrokerRestarted", "{answer}");
    let broker = stop.await.unwrap();
    let api = broker.api(ALICE);
    // The kernel went on with it: `y` appears once the sleep is over (the next execution
    // waits its turn behind it in the kernel).
    let v = api
        .execute_with(&id, json!({"code": "y", "timeout_seconds": 30}))
        .await;
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["results"][0]["data"]["text/plain"], "7", "{v}");
    broker.stop().await;
}

async fn expired_while_down_is_reclaimed(sandbox: &'static str) {
    let (backend, args) = keeping(sandbox);
    let (backend, args) = (backend.as_slice(), args.as_slice());
    let cgroup_of = |b: &SpawnedBroker| b.cgroup_name().unwrap().to_string();
    let mut broker = SpawnedBroker::start(args, None);
    let api = broker.api(ALICE);
    let (status, s) = api
        .post("/v1/sessions", json!({"idle_timeout_seconds": 3}))
        .await;
    assert_eq!(status, 201, "{s}");
    let short = s["id"].as_str().unwrap().to_string();
    let long = api.create().await;
    assert_eq!(api.execute(&long, "z = 5").await["status"], "ok");
    // Down for longer than the short session's idle timeout.
    let cgroup = cgroup_of(&broker);
    broker.halt(Stop::Term).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    broker.resume();
    let api = broker.api(ALICE);
    let (status, v) = api.get(&format!("/v1/sessions/{short}")).await;
    assert_eq!(status, 410, "expired while the broker was down: {v}");
    let v = api.execute(&long, "z").await;
    assert_eq!(v["results"][0]["data"]["text/plain"], "5", "{v}");
    // Only the long session's kernel is left.
    let sessions = api.get("/v1/sessions").await.1;
    assert_eq!(sessions.as_array().unwrap().len(), 1, "{sessions}");
    if backend.is_empty() {
        let leaves = std::fs::read_dir(
            std::path::Path::new("/sys/fs/cgroup/memory")
                .join(&cgroup)
                .join("alice"),
        )
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .count();
        assert_eq!(leaves, 1, "the expired session's cgroup is reclaimed");
    }
    broker.stop().await;
}

async fn died_while_down_reads_dead(sandbox: &'static str) {
    let (_, args) = keeping(sandbox);
    let args = args.as_slice();
    let mut broker = SpawnedBroker::start(args, None);
    let api = broker.api(ALICE);
    let id = api.create().await;
    // The kernel exits by itself with code 3 while the broker is down.
    let v = api
        .execute(
            &id,
            "x = 1\nimport os, threading\nthreading.Timer(1.5, lambda: os._exit(3)).start()",
        )
        .await;
    assert_eq!(v["status"], "ok", "{v}");
    broker.halt(Stop::Term).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker.resume();
    let api = broker.api(ALICE);
    let s = session(&api, &id).await;
    assert_eq!(s["state"], "dead", "{s}");
    let reason = s["dead_reason"].as_str().unwrap_or_default();
    // Ended before the new broker looked (the usual case), or while it was reaching the
    // kernel (a loaded machine delays the kernel's timer): both tell the kernel's own exit.
    assert!(
        reason.contains("exited with code 3")
            && (reason.contains("while the broker was stopped")
                || reason.contains("as the broker restarted")),
        "{reason}"
    );
    let v = api.execute(&id, "1").await;
    assert_eq!(v["status"], "dead", "{v}");
    // A restart revives it, empty.
    let (status, r) = api
        .post(&format!("/v1/sessions/{id}/restart"), json!({}))
        .await;
    assert_eq!(status, 200, "{r}");
    let v = api.execute(&id, "x").await;
    assert_eq!(v["error"]["ename"], "NameError", "{v}");
    broker.stop().await;
}

async fn without_the_flag_sessions_end_with_the_broker(sandbox: &'static str) {
    let (backend, args) = keeping(sandbox);
    let (backend, args) = (backend.as_slice(), args.as_slice());
    let mut broker = SpawnedBroker::start(args, None);
    let api = broker.api(ALICE);
    let id = api.create().await;
    assert_eq!(api.execute(&id, "x = 1").await["status"], "ok");
    let cgroup = broker.cgroup_name().unwrap().to_string();
    // Kept by a SIGTERM, then a start without the flag ends what was kept.
    broker.restart_with(Stop::Term, backend).await;
    let api = broker.api(ALICE);
    assert_eq!(api.get(&format!("/v1/sessions/{id}")).await.0, 404);
    if backend.is_empty() {
        assert_eq!(kernel_pids(&cgroup), 0, "the kept kernel was ended");
    }
    // And a SIGTERM without the flag ends the sessions, as ever; a keeping start later
    // brings back neither (the first one's record went with the run that ended it).
    let second = api.create().await;
    broker.restart_with(Stop::Term, args).await;
    let api = broker.api(ALICE);
    assert_eq!(api.get(&format!("/v1/sessions/{second}")).await.0, 404);
    assert_eq!(api.get(&format!("/v1/sessions/{id}")).await.0, 404);
    assert_eq!(api.get("/v1/sessions").await.1, json!([]));
    broker.stop().await;
}

async fn sigterm_keeps_variables_workspace_and_count(sandbox: &'static str) {
    keeps_state_across(sandbox, Stop::Term).await;
}

async fn kill_9_keeps_variables_workspace_and_count(sandbox: &'static str) {
    keeps_state_across(sandbox, Stop::Kill).await;
}

on_both_backends!(
    sigterm_keeps_variables_workspace_and_count,
    kill_9_keeps_variables_workspace_and_count,
    in_flight_execution_gets_an_answer,
    expired_while_down_is_reclaimed,
    died_while_down_reads_dead,
    without_the_flag_sessions_end_with_the_broker,
);
