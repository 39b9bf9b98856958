//! The session API against real kernels in the real local sandbox: persistence, outputs,
//! charts, input(), interrupt, timeouts, restart, death, limits, isolation, expiry, bad input.

use crate::common;

on_both_backends!(
    warm_pool_hands_over_prestarted_kernels,
    state_persists_and_outputs_are_returned,
    matplotlib_charts_arrive_as_png,
    interrupt_stops_running_code_and_keeps_state,
    an_interrupt_asked_before_the_code_begins_still_stops_it,
    timeout_interrupts_then_restarts_a_stubborn_kernel,
    restart_clears_state,
    kernel_death_marks_the_session_dead_until_restart,
    memory_limit_kills_the_kernel_with_a_clear_error,
    the_sandbox_has_no_network_and_no_host_files,
    users_cannot_see_or_touch_each_others_sessions,
    idle_sessions_expire_and_release_everything,
    long_output_is_cut_and_endless_output_is_bounded,
    files_move_between_api_and_kernel,
    listing_files_never_follows_a_swapped_in_symlink,
    the_workspace_quota_stops_writes_and_uploads,
    quotas_are_enforced,
    shutdown_closes_every_kernel,
    a_frozen_kernel_is_declared_dead_by_its_heartbeat,
);

// What the session layer and the API do alike whatever runs the kernel (ownership and
// validation at the API, the actor's queue, the stream, the idle timer) runs once, on the
// local sandbox; the sandbox's own behaviour runs on both above.
on_one_backend!(
    proposed_kernel_ids_of_other_sessions_are_refused,
    notebook_and_agent_share_a_kernel,
    websocket_streams_output_input_and_errors,
    activity_postpones_expiry,
    bad_input_gets_clear_errors,
    executions_run_one_at_a_time_in_order,
);

use std::time::Duration;

use base64::Engine;
use common::*;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};

fn main_result(exec: &Value) -> &Value {
    exec["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["is_main_result"] == true)
        .unwrap_or_else(|| panic!("no main result in {exec}"))
}

async fn state_persists_and_outputs_are_returned(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;

    let (_, s) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(s["state"], "idle");
    assert_eq!(s["user"], "alice");
    assert_eq!(s["kernel"], "python3");
    assert!(s["expires_at"].is_string());

    let x = api
        .execute(
            &id,
            "import pandas as pd\ndf = pd.DataFrame({'price': [1, 2, 3]})\nx = 41",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    let x = api
        .execute(
            &id,
            "print('out'); import sys; print('err', file=sys.stderr); x + 1",
        )
        .await;
    assert_eq!(x["status"], "ok");
    assert_eq!(x["stdout"], "out\n");
    assert_eq!(x["stderr"], "err\n");
    assert_eq!(main_result(&x)["data"]["text/plain"], "42");
    assert_eq!(x["execution_count"], 2);
    assert!(x["error"].is_null());
    assert_eq!(x["truncated"], false);
    assert!(x["duration_ms"].as_f64().unwrap() > 0.0);

    let x = api.execute(&id, "df['prices'].sum()").await;
    assert_eq!(x["status"], "error");
    assert_eq!(x["error"]["ename"], "KeyError");
    assert_eq!(x["error"]["evalue"], "'prices'");
    let tb = x["error"]["traceback"].as_array().unwrap();
    assert!(!tb.is_empty());
    assert!(
        tb.iter().all(|l| !l.as_str().unwrap().contains('\u{1b}')),
        "ANSI left in {tb:?}"
    );

    // The fix in the next step sees the earlier state.
    let x = api.execute(&id, "int(df['price'].sum())").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "6");
    let (_, s) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(s["execution_count"], 4);

    let (status, _) = api.delete(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 204);
    let (status, e) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 404);
    assert_eq!(e["error"]["code"], "session_not_found");
    broker.stop().await;
}

async fn matplotlib_charts_arrive_as_png(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let code = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('shown')\nplt.show()\nfig = plt.figure()\nplt.bar(['a', 'b'], [1, 2])";
    let x = api.execute(&id, code).await;
    assert_eq!(x["status"], "ok", "{x}");
    let pngs: Vec<_> = x["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["data"]["image/png"].as_str())
        .collect();
    assert_eq!(pngs.len(), 2, "one shown figure and one left open: {x}");
    for png in pngs {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.trim())
            .unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 1000);
    }
    broker.stop().await;
}

async fn websocket_streams_output_input_and_errors(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let mut ws = ws_connect(&broker, &id, ALICE).await;
    let first = ws_next(&mut ws).await;
    assert_eq!(first, json!({"type": "status", "state": "idle"}));

    ws_send(
        &mut ws,
        json!({"type": "execute", "id": "c1", "code": "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.05)\nname = input('name? ')\nprint('hello', name)\n7*6"}),
    )
    .await;
    let mut frames = Vec::new();
    loop {
        let f = ws_next(&mut ws).await;
        if f["type"] == "input_request" {
            assert_eq!(f["id"], "c1");
            assert_eq!(f["prompt"], "name? ");
            assert_eq!(f["password"], false);
            ws_send(
                &mut ws,
                json!({"type": "input_reply", "id": "c1", "value": "ada"}),
            )
            .await;
        }
        let done = f["type"] == "done";
        frames.push(f);
        if done {
            break;
        }
    }
    let stdout: Vec<_> = frames.iter().filter(|f| f["type"] == "stdout").collect();
    assert!(stdout.len() >= 2, "output streamed in pieces: {frames:?}");
    assert!(frames
        .iter()
        .any(|f| f["type"] == "result" && f["data"]["text/plain"] == "42"));
    let done = frames.last().unwrap();
    assert_eq!(done["execution"]["status"], "ok");
    assert!(done["execution"]["stdout"]
        .as_str()
        .unwrap()
        .contains("hello ada"));
    assert!(frames
        .iter()
        .any(|f| f["type"] == "status" && f["state"] == "busy"));

    // Errors stream too.
    ws_send(&mut ws, json!({"type": "execute", "id": 2, "code": "1/0"})).await;
    let frames = ws_until_done_any(&mut ws, json!(2)).await;
    let err = frames
        .iter()
        .find(|f| f["type"] == "error")
        .expect("error frame");
    assert_eq!(err["ename"], "ZeroDivisionError");
    assert_eq!(frames.last().unwrap()["execution"]["status"], "error");

    // Bad frames get a protocol_error and the connection stays usable.
    ws.send(tokio_tungstenite::tungstenite::Message::Text(
        "{not json".into(),
    ))
    .await
    .unwrap();
    assert_eq!(next_non_status(&mut ws).await["type"], "protocol_error");
    ws_send(&mut ws, json!({"type": "launch_rockets"})).await;
    assert_eq!(next_non_status(&mut ws).await["type"], "protocol_error");
    ws.send(tokio_tungstenite::tungstenite::Message::Binary(
        vec![1, 2, 3].into(),
    ))
    .await
    .unwrap();
    assert_eq!(next_non_status(&mut ws).await["type"], "protocol_error");
    ws_send(
        &mut ws,
        json!({"type": "execute", "id": "c3", "code": "'still here'"}),
    )
    .await;
    let frames = ws_until_done(&mut ws, "c3").await;
    assert_eq!(frames.last().unwrap()["execution"]["status"], "ok");
    broker.stop().await;
}

async fn next_non_status(ws: &mut Ws) -> Value {
    loop {
        let f = ws_next(ws).await;
        if f["type"] != "status" {
            return f;
        }
    }
}

async fn ws_until_done_any(ws: &mut Ws, id: Value) -> Vec<Value> {
    let mut frames = Vec::new();
    loop {
        let f = ws_next(ws).await;
        let done = f["type"] == "done" && f["id"] == id;
        frames.push(f);
        if done {
            return frames;
        }
    }
}

/// Interrupts session `id`'s running execution `exec_id` (watched on `ws`): asked with
/// 204, it ends `interrupted`, well before its code would have.
async fn interrupt_and_see_it_end(api: &Api, id: &str, ws: &mut Ws, exec_id: &str) {
    let (status, _) = api
        .post(&format!("/v1/sessions/{id}/interrupt"), json!({}))
        .await;
    assert_eq!(status, 204);
    let frames = ws_until_done(ws, exec_id).await;
    let exec = &frames.last().unwrap()["execution"];
    assert_eq!(exec["status"], "interrupted", "{exec}");
    assert!(exec["duration_ms"].as_f64().unwrap() < 30_000.0, "{exec}");
}

async fn interrupt_stops_running_code_and_keeps_state(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    api.execute(&id, "kept = 'yes'").await;
    let mut ws = ws_connect(&broker, &id, ALICE).await;
    ws_send(&mut ws, json!({"type": "execute", "id": "long", "code": "import time\nprint('start', flush=True)\ntime.sleep(60)"})).await;
    loop {
        let f = ws_next(&mut ws).await;
        if f["type"] == "stdout" {
            break;
        }
    }
    interrupt_and_see_it_end(&api, &id, &mut ws, "long").await;
    let x = api.execute(&id, "kept").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "'yes'");
    broker.stop().await;
}

/// ipykernel ignores SIGINT between messages and puts its handler in place only as it
/// begins an execution: an interrupt that reaches it in between was lost, and the code ran
/// on to its timeout. The broker holds a client's interrupt until the kernel announces the
/// execution (`execute_input`). Here the kernel takes half a second between taking the
/// execution (its busy status) and beginning it.
async fn an_interrupt_asked_before_the_code_begins_still_stops_it(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let v = api
        .execute(
            &id,
            "import time\nk = get_ipython().kernel\nbegin = k.pre_handler_hook\n\
             k.pre_handler_hook = lambda: (time.sleep(0.5), begin())",
        )
        .await;
    assert_eq!(v["status"], "ok", "{v}");
    let mut ws = ws_connect(&broker, &id, ALICE).await;
    ws_send(
        &mut ws,
        json!({"type": "execute", "id": "late", "code": "time.sleep(60)"}),
    )
    .await;
    loop {
        let f = ws_next(&mut ws).await;
        if f["type"] == "status" && f["state"] == "busy" {
            break;
        }
    }
    interrupt_and_see_it_end(&api, &id, &mut ws, "late").await;
    broker.stop().await;
}

async fn timeout_interrupts_then_restarts_a_stubborn_kernel(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.interrupt_grace = Some(1.0)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    api.execute(&id, "kept = 1").await;

    // An ordinary loop stops at the interrupt: state survives.
    let x = api
        .execute_with(
            &id,
            json!({"code": "import time\nwhile True: time.sleep(0.1)", "timeout_seconds": 1}),
        )
        .await;
    assert_eq!(x["status"], "timeout", "{x}");
    assert!(
        x["error"]["evalue"]
            .as_str()
            .unwrap()
            .contains("interrupted"),
        "{x}"
    );
    let x = api.execute(&id, "kept").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "1");

    // Code that swallows KeyboardInterrupt: the kernel is restarted after the grace period.
    let stubborn = "import time\nwhile True:\n    try:\n        time.sleep(0.1)\n    except KeyboardInterrupt:\n        pass";
    let x = api
        .execute_with(&id, json!({"code": stubborn, "timeout_seconds": 1}))
        .await;
    assert_eq!(x["status"], "timeout", "{x}");
    assert!(
        x["error"]["evalue"].as_str().unwrap().contains("restarted"),
        "{x}"
    );
    let x = api.execute(&id, "'kept' in globals()").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "False");
    let (_, s) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(s["state"], "idle");

    // The metrics counted what happened, under this backend's label.
    let (status, metrics) = api.get("/metrics").await;
    assert_eq!(status, 200);
    let metrics = metrics.as_str().unwrap();
    for line in [
        format!("kernel_broker_execution_timeouts_total{{backend=\"{sb}\"}} 2"),
        format!("kernel_broker_kernel_restarts_total{{backend=\"{sb}\"}} 1"),
        format!("kernel_broker_executions_total{{backend=\"{sb}\",status=\"timeout\"}} 2"),
        format!("kernel_broker_executions_total{{backend=\"{sb}\",status=\"ok\"}} 3"),
        // The first kernel and the restart's.
        format!("kernel_broker_kernel_start_seconds_count{{backend=\"{sb}\"}} 2"),
        format!("kernel_broker_execution_queue_wait_seconds_count{{backend=\"{sb}\"}} 5"),
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no {line:?} in\n{metrics}"
        );
    }
    broker.stop().await;
}

async fn restart_clears_state(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    api.execute(&id, "secret = 5").await;
    let (status, s) = api
        .post(&format!("/v1/sessions/{id}/restart"), json!({}))
        .await;
    assert_eq!(status, 200, "{s}");
    assert_eq!(s["execution_count"], 0);
    assert_eq!(s["state"], "idle");
    let x = api.execute(&id, "secret").await;
    assert_eq!(x["status"], "error");
    assert_eq!(x["error"]["ename"], "NameError");
    broker.stop().await;
}

async fn kernel_death_marks_the_session_dead_until_restart(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api.execute(&id, "import os\nos._exit(3)").await;
    assert_eq!(x["status"], "dead", "{x}");
    assert!(
        x["error"]["evalue"].as_str().unwrap().contains("code 3"),
        "{x}"
    );
    let (_, s) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(s["state"], "dead");
    let x = api.execute(&id, "1").await;
    assert_eq!(x["status"], "dead");
    assert!(
        x["error"]["evalue"].as_str().unwrap().contains("restart"),
        "{x}"
    );
    let (status, _) = api
        .post(&format!("/v1/sessions/{id}/restart"), json!({}))
        .await;
    assert_eq!(status, 200);
    let x = api.execute(&id, "2+2").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "4");
    broker.stop().await;
}

async fn memory_limit_kills_the_kernel_with_a_clear_error(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.memory_limit = Some(256 << 20)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api
        .execute_with(&id, json!({"code": "blocks = []\nwhile True: blocks.append(b'x' * (32 << 20))", "timeout_seconds": 60}))
        .await;
    assert!(
        x["status"] == "dead" || (x["status"] == "error" && x["error"]["ename"] == "MemoryError"),
        "{x}"
    );
    if x["status"] == "dead" {
        assert!(
            x["error"]["evalue"].as_str().unwrap().contains("memory"),
            "{x}"
        );
    }
    broker.stop().await;
}

async fn the_sandbox_has_no_network_and_no_host_files(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let port = broker.addr.port();
    let code = format!(
        r#"import socket, os
names = [n for _, n in socket.if_nameindex()]
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    reached = True
except OSError:
    reached = False
try:
    socket.getaddrinfo("deb.debian.org", 80)
    resolved = True
except OSError:
    resolved = False
def readable(p):
    try:
        open(p, "rb").read(1)
        return True
    except OSError:
        return False
print(names, reached, resolved, readable("/etc/shadow"), os.path.exists("/root/.ssh"), os.path.exists("{repo}/src"), os.getuid() != 0)"#,
        repo = repo().display()
    );
    let x = api.execute(&id, &code).await;
    assert_eq!(
        x["stdout"], "['lo'] False False False False False True\n",
        "{x}"
    );
    broker.stop().await;
}

async fn users_cannot_see_or_touch_each_others_sessions(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let alice = broker.api(ALICE);
    let bob = broker.api(BOB);
    let id = alice.create().await;
    alice
        .execute(&id, "open('alice.txt', 'w').write('private')")
        .await;

    for (method, path) in [
        (reqwest::Method::GET, format!("/v1/sessions/{id}")),
        (reqwest::Method::POST, format!("/v1/sessions/{id}/execute")),
        (
            reqwest::Method::POST,
            format!("/v1/sessions/{id}/interrupt"),
        ),
        (reqwest::Method::POST, format!("/v1/sessions/{id}/restart")),
        (reqwest::Method::DELETE, format!("/v1/sessions/{id}")),
        (reqwest::Method::GET, format!("/v1/sessions/{id}/files")),
        (
            reqwest::Method::GET,
            format!("/v1/sessions/{id}/files/alice.txt"),
        ),
    ] {
        let (status, e) = bob.call(method, &path, Some(json!({"code": "1"}))).await;
        assert_eq!(status, 404, "{path}");
        assert_eq!(e["error"]["code"], "session_not_found");
    }
    let (_, list) = bob.get("/v1/sessions").await;
    assert_eq!(list, json!([]));
    let ws = tokio_tungstenite::connect_async(format!(
        "ws://{}/v1/sessions/{id}/stream?token={BOB}",
        broker.addr
    ))
    .await;
    assert!(ws.is_err(), "bob must not attach to alice's stream");

    // Bob's own kernel cannot see alice's workspace.
    let bid = bob.create().await;
    let x = bob
        .execute(
            &bid,
            "import os\nprint(os.path.exists('alice.txt'), os.getcwd(), sorted(os.listdir('/')))",
        )
        .await;
    assert!(
        x["stdout"]
            .as_str()
            .unwrap()
            .starts_with("False /workspace"),
        "{x}"
    );
    let x = alice.execute(&id, "print(open('alice.txt').read())").await;
    assert_eq!(x["stdout"], "private\n");
    broker.stop().await;
}

async fn idle_sessions_expire_and_release_everything(sb: &'static str) {
    // The user's fork-server template goes as soon as the user is idle (docker: with the
    // user's container).
    let broker = Broker::start(sb, |a| a.container_idle = Some(0)).await;
    let api = broker.api(ALICE);
    let (status, s) = api
        .post("/v1/sessions", json!({"idle_timeout_seconds": 2}))
        .await;
    assert_eq!(status, 201);
    let id = s["id"].as_str().unwrap().to_string();
    api.execute(&id, "x = 1").await;
    let pid_code = "import os; print(os.getpid())";
    let _ = api.execute(&id, pid_code).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (status, e) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 410, "{e}");
    assert_eq!(e["error"]["code"], "session_expired");
    let (status, _) = api
        .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "x"}))
        .await;
    assert_eq!(status, 410);
    let (_, list) = api.get("/v1/sessions").await;
    assert_eq!(list, json!([]));
    assert_eq!(broker.runtime_dirs(), 0, "runtime dirs reclaimed");
    broker.stop().await;
}

async fn activity_postpones_expiry(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let (_, s) = api
        .post("/v1/sessions", json!({"idle_timeout_seconds": 3}))
        .await;
    let id = s["id"].as_str().unwrap().to_string();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let x = api.execute(&id, "1").await;
        assert_eq!(x["status"], "ok");
    }
    // A long execution is not expired mid-way.
    let x = api
        .execute_with(
            &id,
            json!({"code": "import time; time.sleep(5); 'done'", "timeout_seconds": 20}),
        )
        .await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "'done'");
    let (status, _) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 200);
    broker.stop().await;
}

async fn bad_input_gets_clear_errors(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.max_code_bytes = Some(1000)).await;
    let api = broker.api(ALICE);
    let http = reqwest::Client::new();

    let r = http.get(broker.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    for auth in [
        None,
        Some("Bearer nope-nope"),
        Some("Basic abc"),
        Some("token"),
    ] {
        let mut req = http.get(broker.url("/v1/sessions"));
        if let Some(a) = auth {
            req = req.header("Authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "unauthorized");
    }
    for form in [format!("token {ALICE}"), format!("Bearer {ALICE}")] {
        let r = http
            .get(broker.url("/v1/sessions"))
            .header("Authorization", form)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let r = http
        .get(broker.url(&format!("/v1/sessions?token={ALICE}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let r = http
        .post(broker.url("/v1/sessions"))
        .bearer_auth(ALICE)
        .header("content-type", "application/json")
        .body("{\"kernel\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "bad_request");
    let (status, _) = api.post("/v1/sessions", json!({"kernel": "cobol"})).await;
    assert_eq!(status, 400);
    let (status, _) = api.post("/v1/sessions", json!({"kernal": "python3"})).await;
    assert_eq!(status, 400);

    let (status, e) = api
        .get("/v1/sessions/00000000-0000-0000-0000-000000000000")
        .await;
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (404, Some("session_not_found"))
    );
    let (status, _) = api.get("/v1/sessions/not-a-uuid").await;
    assert_eq!(status, 404);

    let id = api.create().await;
    let (status, e) = api
        .post(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "x = '".to_string() + &"a".repeat(5000) + "'"}),
        )
        .await;
    assert_eq!(status, 413, "{e}");
    assert_eq!(e["error"]["code"], "payload_too_large");
    let (status, _) = api
        .post(&format!("/v1/sessions/{id}/execute"), json!({"cod": "1"}))
        .await;
    assert_eq!(status, 400);
    let (status, _) = api
        .post(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "1", "timeout_seconds": -1}),
        )
        .await;
    assert_eq!(status, 400);
    let r = http
        .post(broker.url(&format!("/v1/sessions/{id}/execute")))
        .bearer_auth(ALICE)
        .body(vec![0xffu8; 10])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Nothing was lost: the session still works.
    let x = api.execute(&id, "1+1").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "2");
    broker.stop().await;
}

async fn long_output_is_cut_and_endless_output_is_bounded(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api.execute(&id, "print('a' * 50000)").await;
    assert_eq!(x["stdout"].as_str().unwrap().chars().count(), 10_000);
    assert_eq!(x["truncated"], true);

    let rss = || {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find(|l| l.starts_with("VmRSS"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .unwrap()
    };
    let before = rss();
    let x = api
        .execute_with(
            &id,
            json!({"code": "while True: print('y' * 1000)", "timeout_seconds": 5}),
        )
        .await;
    // The flood backs up into the kernel's own iopub queue when the broker reads slower
    // than the kernel prints (a loaded host): then the kernel may reach its own memory
    // limit first and die alone, which is the kernel's cost, not the broker's. Either way
    // the broker holds at most the output limit.
    match x["status"].as_str() {
        Some("timeout") => {}
        Some("dead") => {
            let error = x["error"]["evalue"].as_str().unwrap_or_default();
            assert!(error.contains("ran out of memory"), "{x}");
            let (status, _) = api
                .post(&format!("/v1/sessions/{id}/restart"), json!({}))
                .await;
            assert_eq!(status, 200);
        }
        other => panic!("endless output ended as {other:?}: {x}"),
    }
    assert_eq!(x["stdout"].as_str().unwrap().chars().count(), 10_000);
    let grown_kib = rss().saturating_sub(before);
    assert!(
        grown_kib < 200 * 1024,
        "broker grew by {grown_kib} KiB on endless output"
    );
    let x = api.execute(&id, "'alive'").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "'alive'");
    broker.stop().await;
}

async fn files_move_between_api_and_kernel(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let r = api
        .http
        .put(broker.url(&format!("/v1/sessions/{id}/files/data/sales.csv")))
        .bearer_auth(ALICE)
        .body("region,price\nnorth,3\nsouth,4\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let x = api
        .execute(&id, "import pandas as pd\ndf = pd.read_csv('data/sales.csv')\ndf.to_csv('out.csv', index=False)\nint(df.price.sum())")
        .await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "7", "{x}");
    let r = api
        .http
        .get(broker.url(&format!("/v1/sessions/{id}/files/out.csv")))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "region,price\nnorth,3\nsouth,4\n");
    let (_, list) = api.get(&format!("/v1/sessions/{id}/files")).await;
    let paths: Vec<_> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"data/sales.csv") && paths.contains(&"out.csv"),
        "{list}"
    );
    // A symlink the kernel plants does not lead the broker out of the workspace.
    api.execute(&id, "import os\nos.symlink('/etc/hostname', 'escape')")
        .await;
    let (status, _) = api.get(&format!("/v1/sessions/{id}/files/escape")).await;
    assert_eq!(status, 400);
    let (status, _) = api
        .get(&format!("/v1/sessions/{id}/files/..%2F..%2Fetc%2Fpasswd"))
        .await;
    assert!(status == 400 || status == 404, "{status}");
    let (status, _) = api
        .get(&format!("/v1/sessions/{id}/files/missing.txt"))
        .await;
    assert_eq!(status, 404);
    broker.stop().await;
}

async fn executions_run_one_at_a_time_in_order(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = std::sync::Arc::new(broker.api(ALICE));
    let id = api.create().await;
    api.execute(&id, "log = []").await;
    let mut handles = Vec::new();
    for i in 0..5 {
        let api = api.clone();
        let id = id.clone();
        handles.push(tokio::spawn(async move {
            api.execute(
                &id,
                &format!("import time; time.sleep(0.05); log.append({i})"),
            )
            .await
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for h in handles {
        assert_eq!(h.await.unwrap()["status"], "ok");
    }
    let x = api.execute(&id, "log").await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "[0, 1, 2, 3, 4]");
    broker.stop().await;
}

async fn quotas_are_enforced(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.max_sessions_per_user = Some(1)).await;
    let api = broker.api(ALICE);
    let _id = api.create().await;
    let (status, e) = api.post("/v1/sessions", json!({})).await;
    assert_eq!(status, 429);
    assert_eq!(e["error"]["code"], "quota_exceeded");
    // Bob has his own quota.
    let _ = broker.api(BOB).create().await;
    broker.stop().await;
}

async fn shutdown_closes_every_kernel(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api.execute(&id, "import os; print(os.getpid())").await;
    assert_eq!(x["status"], "ok");
    assert!(broker.runtime_dirs() >= 1);
    let data_dir = broker.data_dir.clone();
    broker.stop().await;
    assert_eq!(runtime_dirs(sb, &data_dir), 0);
}

async fn a_frozen_kernel_is_declared_dead_by_its_heartbeat(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    // SIGSTOP freezes the whole kernel, heartbeat thread included; the process still exists.
    let x = api
        .execute_with(&id, json!({"code": "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", "timeout_seconds": 120}))
        .await;
    assert_eq!(x["status"], "dead", "{x}");
    assert!(
        x["error"]["evalue"].as_str().unwrap().contains("heartbeat"),
        "{x}"
    );
    let (_, s) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(s["state"], "dead");
    broker.stop().await;
}

/// The warm pool hands over kernels started ahead of demand, for the right user only.
async fn warm_pool_hands_over_prestarted_kernels(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.pool_size = Some(1)).await;
    let api = broker.api(ALICE);
    let first = api.create().await;
    api.execute(&first, "open('mine.txt', 'w').write('alice')")
        .await;
    // The first create is cold and starts filling alice's pool.
    let pooled = || async {
        let (_, h) = api.get("/healthz").await;
        h["pooled_kernels"].as_u64().unwrap()
    };
    within(60, "pool refill", async {
        while pooled().await < 1 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = api.create().await;
    let age = "import psutil, time, os\nprint(round(time.time() - psutil.Process().create_time()), os.getuid(), open('mine.txt').read())";
    let x = api.execute(&second, age).await;
    let out = x["stdout"].as_str().unwrap().trim().to_string();
    let fields: Vec<_> = out.split(' ').collect();
    assert!(
        fields[0].parse::<u64>().unwrap() >= 2,
        "the kernel was started before the request: {out}"
    );
    assert_eq!(
        fields[2], "alice",
        "the pooled kernel sees its user's workspace: {out}"
    );
    let x = api.execute(&first, "import os; print(os.getuid())").await;
    assert_eq!(
        x["stdout"].as_str().unwrap().trim(),
        fields[1],
        "same uid as a cold kernel of alice"
    );
    // Bob gets nothing of alice's pool.
    let bid = broker.api(BOB).create().await;
    let x = broker
        .api(BOB)
        .execute(&bid, "import os; print(os.path.exists('mine.txt'))")
        .await;
    assert_eq!(x["stdout"], "False\n");
    // A pooled kernel is never reused: the pool refills with a new one.
    within(60, "pool refill", async {
        while pooled().await < 2 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    broker.stop().await;
}

/// A notebook client on `/api/kernels/{id}/channels` and an agent on the stream share one
/// kernel: the agent sees the notebook's output (as external frames), the notebook gets its
/// reply and sees the agent's output on iopub.
async fn notebook_and_agent_share_a_kernel(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let mut agent = ws_connect(&broker, &id, ALICE).await;
    assert_eq!(ws_next(&mut agent).await["type"], "status");
    let mut nb = jupyter_channels(&broker, &id, "nb-1").await;
    let code = "shared = 7\nprint('from the notebook')";
    let content = json!({"code": code, "silent": false, "store_history": true,
                         "user_expressions": {}, "allow_stdin": false});
    let msg_id = jupyter_send(&mut nb, "nb-1", ("shell", "execute_request"), content).await;
    // The notebook gets its execute_reply.
    within(30, "execute_reply", async {
        loop {
            let m = nb.next().await.unwrap().unwrap();
            if let tokio_tungstenite::tungstenite::Message::Text(t) = m {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["msg_type"] == "execute_reply" {
                    assert_eq!(v["channel"], "shell");
                    assert_eq!(v["parent_header"]["msg_id"], msg_id.as_str());
                    assert_eq!(v["content"]["status"], "ok");
                    return;
                }
            }
        }
    })
    .await;
    // The agent saw the notebook's output.
    let seen = within(30, "external stdout", async {
        loop {
            let f = ws_next(&mut agent).await;
            if f["type"] == "stdout" {
                return f;
            }
        }
    })
    .await;
    assert_eq!(seen["text"], "from the notebook\n");
    assert_eq!(seen["external"], true);
    let (_, info) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(
        info["execution_count"], 1,
        "the notebook's execution counts: {info}"
    );
    assert!(seen["id"].is_null());
    // And the agent's next step sees the notebook's variable; the notebook sees its output.
    ws_send(
        &mut agent,
        json!({"type": "execute", "id": "a1", "code": "print(shared * 6)"}),
    )
    .await;
    let frames = ws_until_done(&mut agent, "a1").await;
    assert_eq!(frames.last().unwrap()["execution"]["stdout"], "42\n");
    within(30, "agent output on the notebook's iopub", async {
        loop {
            let m = nb.next().await.unwrap().unwrap();
            if let tokio_tungstenite::tungstenite::Message::Text(t) = m {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["msg_type"] == "stream" && v["content"]["text"] == "42\n" {
                    return;
                }
            }
        }
    })
    .await;
    broker.stop().await;
}

/// A kernel id proposed through the Jupyter API that another user's session holds is
/// refused with 409 (ids are never reused, issue 32 item 7), and the session stays its
/// owner's: the proposer still cannot reach it.
async fn proposed_kernel_ids_of_other_sessions_are_refused(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let alice_id = broker.api(ALICE).create().await;
    let bob = broker.api(BOB);
    let (status, k) = bob
        .post(
            "/api/kernels",
            json!({"name": "python3", "env": {"KERNEL_ID": alice_id}}),
        )
        .await;
    assert_eq!(status, 409, "{k}");
    assert_eq!(k["error"]["code"], "session_exists", "{k}");
    let (status, _) = bob.get(&format!("/api/kernels/{alice_id}")).await;
    assert_eq!(status, 404);
    let fresh = uuid::Uuid::new_v4().to_string();
    let (status, k) = bob
        .post(
            "/api/kernels",
            json!({"name": "python3", "env": {"KERNEL_ID": fresh}}),
        )
        .await;
    assert_eq!(status, 201);
    assert_eq!(k["id"], fresh.as_str(), "a free proposed id is used");
    broker.stop().await;
}

/// Red-team attack 3: Alice's kernel swaps a directory and a symlink to Bob's workspace
/// (and one to /etc) with `renameat2(RENAME_EXCHANGE)` in a tight loop while the broker
/// lists her files; a listing that checks a path and then opens it by path follows the
/// symlink some of the time. Nothing of Bob's or the host's may ever be listed.
async fn listing_files_never_follows_a_swapped_in_symlink(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let bob = broker.api(BOB);
    let bob_id = bob.create().await;
    let r = bob
        .http
        .put(broker.url(&format!("/v1/sessions/{bob_id}/files/bob-secret-plans.txt")))
        .bearer_auth(BOB)
        .body("mine")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let workspaces = match sb {
        "docker" => "workspaces-docker",
        _ => "workspaces",
    };
    let bob_host = broker.data_dir.join(workspaces).join("bob");
    assert!(bob_host.join("bob-secret-plans.txt").exists());

    let api = broker.api(ALICE);
    let id = api.create().await;
    let swapper = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS_renameat2, AT_FDCWD, RENAME_EXCHANGE = 316, -100, 2
d, l = sys.argv[1].encode(), sys.argv[2].encode()
while True:
    libc.syscall(SYS_renameat2, AT_FDCWD, d, AT_FDCWD, l, RENAME_EXCHANGE)
"#;
    let code = format!(
        r#"
import os, subprocess, sys
os.makedirs('attack', exist_ok=True)
os.chdir('attack')
procs = []
for name, target in [('bob', {bob:?}), ('etc', '/etc')]:
    os.makedirs(name + '-dir', exist_ok=True)
    open(name + '-dir/alice-own.txt', 'w').write('a')
    if not os.path.lexists(name + '-link'):
        os.symlink(target, name + '-link')
    procs.append(subprocess.Popen([sys.executable, '-c', {swapper:?}, name + '-dir', name + '-link']))
os.chdir('..')
len(procs)
"#,
        bob = bob_host.to_str().unwrap(),
    );
    let x = api.execute(&id, &code).await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "2", "{x}");

    let mut own_seen = 0;
    for _ in 0..300 {
        let (status, list) = api.get(&format!("/v1/sessions/{id}/files")).await;
        assert_eq!(status, 200, "{list}");
        for f in list.as_array().unwrap() {
            let path = f["path"].as_str().unwrap();
            assert!(
                !path.contains("bob-secret") && !path.contains("passwd"),
                "the listing showed a file that is not Alice's: {path}"
            );
            if path.starts_with("attack/") {
                assert!(
                    path.ends_with("/alice-own.txt"),
                    "the listing showed a file that is not Alice's: {path}"
                );
                own_seen += 1;
            }
        }
    }
    // The swap did run under the listings: Alice's own files were seen through both names.
    assert!(own_seen > 0);
    let x = api
        .execute(
            &id,
            "[p.kill() for p in procs]; [p.wait() for p in procs]; 'ok'",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    broker.stop().await;
}

/// Red-team attack 4a: a kernel filled the host disk through its workspace. Each user's
/// workspace is now a file system of its quota: the kernel's own writes fail with ENOSPC,
/// another user's workspace is not touched, and an upload past the quota is refused with
/// 413 without losing the file it would have replaced.
async fn the_workspace_quota_stops_writes_and_uploads(sb: &'static str) {
    let broker = Broker::start(sb, |a| a.workspace_quota = Some(64 << 20)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let put = |path: &str, body: Vec<u8>| {
        api.http
            .put(broker.url(&format!("/v1/sessions/{id}/files/{path}")))
            .bearer_auth(ALICE)
            .body(body)
            .send()
    };
    assert_eq!(put("keep.txt", b"v1".to_vec()).await.unwrap().status(), 201);
    let x = api
        .execute(
            &id,
            r#"
import errno, os
n, err = 0, None
chunk = b'x' * (1 << 20)
try:
    with open('big.bin', 'wb') as f:
        while n < (200 << 20):
            f.write(chunk)
            f.flush()
            n += len(chunk)
        os.fsync(f.fileno())
except OSError as e:
    err = e.errno
st = os.statvfs('.')
(err in (errno.ENOSPC, errno.EDQUOT), os.path.getsize('big.bin'), st.f_blocks * st.f_frsize)
"#,
        )
        .await;
    let text = main_result(&x)["data"]["text/plain"]
        .as_str()
        .unwrap()
        .to_string();
    let parts: Vec<&str> = text
        .trim_matches(|c| c == '(' || c == ')')
        .split(", ")
        .collect();
    assert_eq!(
        parts[0], "True",
        "the kernel's writes did not hit ENOSPC: {x}"
    );
    let written: u64 = parts[1].parse().unwrap();
    let size: u64 = parts[2].parse().unwrap();
    assert!(written < 64 << 20, "{written} bytes written past the quota");
    assert!(written > 32 << 20, "only {written} bytes fit in 64 MiB");
    assert!(size <= 64 << 20, "the workspace is {size} bytes");

    // An upload past the quota: 413, and the file it would replace is intact.
    let r = put("keep.txt", vec![7u8; 8 << 20]).await.unwrap();
    assert_eq!(r.status(), 413);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "payload_too_large", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("quota"),
        "{e}"
    );
    let r = api
        .http
        .get(broker.url(&format!("/v1/sessions/{id}/files/keep.txt")))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "v1");
    let (_, list) = api.get(&format!("/v1/sessions/{id}/files")).await;
    assert!(!list.to_string().contains("kb-upload"), "{list}");

    // Bob's workspace is his own file system: Alice's full one does not stop him.
    let bob = broker.api(BOB);
    let bob_id = bob.create().await;
    let x = bob
        .execute(
            &bob_id,
            "with open('b.bin', 'wb') as f:\n    f.write(b'y' * (32 << 20))\nimport os; os.path.getsize('b.bin')",
        )
        .await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "33554432", "{x}");

    // Space Alice frees is hers again.
    let x = api
        .execute(
            &id,
            "os.remove('big.bin')\nopen('small.bin', 'wb').write(b'z' * (8 << 20))",
        )
        .await;
    assert_eq!(main_result(&x)["data"]["text/plain"], "8388608", "{x}");
    broker.stop().await;
}
