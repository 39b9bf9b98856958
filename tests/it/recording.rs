//! Recording, notebook export and replay against real kernels: every message in order with
//! directions and channels, recordings that outlive deletion and expiry, privacy, images
//! stored once, replay of deterministic and non-deterministic sessions.

use crate::common;

use std::time::Duration;

use base64::Engine;
use common::forked::out;
use common::spawned::{SpawnedBroker, Stop};
use common::*;
use serde_json::{json, Value};

async fn events(api: &Api, id: &str, query: &str) -> Vec<Value> {
    let (status, v) = api.get(&format!("/v1/sessions/{id}/events?{query}")).await;
    assert_eq!(status, 200, "{v}");
    v["events"].as_array().unwrap().clone()
}

fn position(evs: &[Value], pred: impl Fn(&Value) -> bool, what: &str) -> usize {
    evs.iter().position(pred).unwrap_or_else(|| {
        panic!(
            "no {what} in {}",
            serde_json::to_string_pretty(evs).unwrap()
        )
    })
}

#[tokio::test]
async fn every_message_is_recorded_in_order() {
    let broker = Broker::start("local", |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api.execute(&id, "print('hi')\n1+1").await;
    assert_eq!(x["status"], "ok", "{x}");

    // Acknowledged means recorded: no waiting needed.
    let evs = events(&api, &id, "").await;
    let seqs: Vec<i64> = evs.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    let times: Vec<chrono::DateTime<chrono::Utc>> = evs
        .iter()
        .map(|e| e["time"].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "times go back: {times:?}"
    );
    assert!(evs[0]["time"].as_str().unwrap().ends_with('Z'));

    assert_eq!(evs[0]["direction"], "broker");
    assert_eq!(evs[0]["kind"], "session_created");
    let req = position(
        &evs,
        |e| {
            e["direction"] == "to_kernel"
                && e["channel"] == "shell"
                && e["msg_type"] == "execute_request"
        },
        "execute_request",
    );
    let msg_id = evs[req]["msg_id"].as_str().unwrap().to_string();
    assert_eq!(evs[req]["content"]["code"], "print('hi')\n1+1");
    assert_eq!(evs[req]["header"]["msg_id"], msg_id.as_str());
    let started = position(
        &evs,
        |e| e["kind"] == "execution_started",
        "execution_started",
    );
    assert_eq!(evs[started]["detail"]["msg_id"], msg_id.as_str());
    assert_eq!(evs[started]["detail"]["code"], "print('hi')\n1+1");
    let child = |t: &'static str| {
        let m = msg_id.clone();
        move |e: &Value| {
            e["direction"] == "from_kernel"
                && e["msg_type"] == t
                && e["parent_msg_id"] == m.as_str()
        }
    };
    let busy = position(
        &evs,
        |e| child("status")(e) && e["content"]["execution_state"] == "busy",
        "busy",
    );
    let input = position(&evs, child("execute_input"), "execute_input");
    let stream = position(&evs, child("stream"), "stream");
    let result = position(&evs, child("execute_result"), "execute_result");
    let idle = position(
        &evs,
        |e| child("status")(e) && e["content"]["execution_state"] == "idle",
        "idle",
    );
    let reply = position(&evs, child("execute_reply"), "execute_reply");
    let done = position(&evs, |e| e["kind"] == "execution_done", "execution_done");
    assert!(req < busy && busy < input && input < stream && stream < result && result < idle);
    assert!(req < started && reply < done && idle < done);
    for i in [busy, input, stream, result, idle] {
        assert_eq!(evs[i]["channel"], "iopub");
    }
    assert_eq!(evs[reply]["channel"], "shell");
    assert_eq!(evs[reply]["parent_header"]["msg_id"], msg_id.as_str());
    // Kernel messages carry the request's header as their parent header.
    assert_eq!(evs[result]["parent_header"], evs[req]["header"]);
    assert_eq!(evs[reply]["parent_header"], evs[req]["header"]);
    assert_eq!(evs[stream]["content"]["text"], "hi\n");
    assert_eq!(evs[result]["content"]["data"]["text/plain"], "2");
    assert_eq!(evs[done]["detail"]["execution"]["stdout"], "hi\n");
    assert_eq!(evs[done]["detail"]["execution"]["status"], "ok");
    assert_eq!(done, evs.len() - 1, "execution_done is the last event");

    // Filters.
    let streams = events(&api, &id, "type=stream").await;
    assert_eq!(streams.len(), 1);
    let broker_events = events(&api, &id, "channel=broker").await;
    assert!(broker_events.iter().all(|e| e["direction"] == "broker"));
    assert_eq!(broker_events.len(), 3, "{broker_events:?}");
    let shell = events(
        &api,
        &id,
        "channel=shell&type=execute_request,execute_reply",
    )
    .await;
    assert_eq!(shell.len(), 2);

    // Paging: pages of 3 add up to the whole.
    let mut paged = Vec::new();
    let mut after = 0;
    loop {
        let (status, page) = api
            .get(&format!("/v1/sessions/{id}/events?after={after}&limit=3"))
            .await;
        assert_eq!(status, 200);
        let evs = page["events"].as_array().unwrap();
        assert!(evs.len() <= 3);
        paged.extend(evs.iter().cloned());
        match page["next_after"].as_i64() {
            Some(n) => after = n,
            None => break,
        }
    }
    assert_eq!(paged, evs);
    let (status, e) = api
        .get(&format!("/v1/sessions/{id}/events?after=abc"))
        .await;
    assert_eq!(status, 400, "{e}");
    broker.stop().await;
}

#[tokio::test]
async fn recordings_outlive_deletion_and_stay_private() {
    let broker = Broker::start("local", |_| {}).await;
    let alice = broker.api(ALICE);
    let bob = broker.api(BOB);
    let id = alice.create().await;
    alice.execute(&id, "x = 1").await;
    alice.execute(&id, "x + 1").await;

    let (_, list) = alice.get("/v1/recordings").await;
    let mine = list
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == id.as_str())
        .unwrap();
    assert_eq!(mine["live"], true);
    assert_eq!(mine["state"], "idle");
    assert_eq!(mine["cells"], 2);

    let (status, _) = alice.delete(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 204);
    let evs = events(&alice, &id, "").await;
    assert_eq!(evs.last().unwrap()["kind"], "session_closed");
    let to_kernel = evs
        .iter()
        .filter(|e| e["direction"] == "to_kernel")
        .map(|e| e["msg_type"].as_str().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(
        to_kernel,
        ["execute_request", "execute_request", "shutdown_request"]
    );
    let (status, nb) = alice.get(&format!("/v1/sessions/{id}/notebook")).await;
    assert_eq!(status, 200);
    let cells = nb["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 3, "two code cells and who closed the session");
    assert_eq!(cells[2]["cell_type"], "markdown");
    assert!(
        cells[2]["source"].to_string().contains("closed by rest"),
        "{}",
        cells[2]
    );
    let (_, list) = alice.get("/v1/recordings").await;
    let mine = list
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == id.as_str())
        .unwrap();
    assert_eq!(mine["live"], false);
    assert_eq!(mine["state"], "closed");
    assert_eq!(mine["end_reason"], "closed");

    // Another user sees nothing, exactly as for a session that does not exist.
    let (_, bobs) = bob.get("/v1/recordings").await;
    assert_eq!(bobs, json!([]));
    let missing = uuid::Uuid::new_v4().to_string();
    for target in [id.as_str(), missing.as_str(), "not-a-uuid"] {
        for (method, path) in [
            (reqwest::Method::GET, "events"),
            (reqwest::Method::DELETE, "events"),
            (reqwest::Method::GET, "notebook"),
            (reqwest::Method::POST, "replay"),
        ] {
            let (status, e) = bob
                .call(
                    method.clone(),
                    &format!("/v1/sessions/{target}/{path}"),
                    None,
                )
                .await;
            assert_eq!(status, 404, "{method} {path}: {e}");
            assert_eq!(e["error"]["code"], "session_not_found");
        }
    }
    // A live session of another user too.
    let live = alice.create().await;
    let (status, _) = bob.get(&format!("/v1/sessions/{live}/events")).await;
    assert_eq!(status, 404);
    let (status, _) = alice.get(&format!("/v1/sessions/{live}/events")).await;
    assert_eq!(status, 200);

    let (status, _) = alice.delete(&format!("/v1/sessions/{id}/events")).await;
    assert_eq!(status, 204);
    let (status, e) = alice.get(&format!("/v1/sessions/{id}/events")).await;
    assert_eq!(status, 404);
    assert_eq!(e["error"]["code"], "session_not_found");
    broker.stop().await;
}

#[tokio::test]
async fn recordings_outlive_expiry() {
    let broker = Broker::start("local", |a| a.idle_timeout = Some(2)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    api.execute(&id, "print('before expiry')").await;
    within(30, "expiry", async {
        loop {
            let (status, _) = api.get(&format!("/v1/sessions/{id}")).await;
            if status == 410 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let evs = within(10, "session_expired recorded", async {
        loop {
            let evs = events(&api, &id, "").await;
            if evs.iter().any(|e| e["kind"] == "session_expired") {
                return evs;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(evs
        .iter()
        .any(|e| e["content"]["text"] == "before expiry\n"));
    let (_, list) = api.get("/v1/recordings").await;
    let r = list
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == id.as_str())
        .unwrap();
    assert_eq!(r["state"], "expired");
    broker.stop().await;
}

#[tokio::test]
async fn chart_images_are_stored_once_and_put_back() {
    let broker = Broker::start("local", |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api
        .execute(
            &id,
            "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    let png = x["results"][0]["data"]["image/png"]
        .as_str()
        .unwrap()
        .to_string();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&png)
        .unwrap();
    assert!(bytes.starts_with(b"\x89PNG"));

    let evs = events(&api, &id, "type=display_data,execution_done").await;
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[0]["content"]["data"]["image/png"], png.as_str());
    assert_eq!(
        evs[1]["detail"]["execution"]["results"][0]["data"]["image/png"],
        png.as_str()
    );

    let db = broker.data_dir.join("recordings.sqlite3");
    let conn =
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let (blobs, size): (i64, i64) = conn
        .query_row(
            "SELECT count(*), coalesce(sum(size), 0) FROM blobs",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(blobs, 1, "one image, stored once");
    assert_eq!(size as usize, png.len());
    let largest: i64 = conn
        .query_row("SELECT max(length(content)) FROM events", [], |r| r.get(0))
        .unwrap();
    assert!(
        (largest as usize) < png.len() / 4,
        "an event still holds the image: {largest} bytes"
    );
    broker.stop().await;
}

#[tokio::test]
async fn replay_compares_normalised_outputs() {
    let broker = Broker::start("local", |_| {}).await;
    let api = broker.api(ALICE);

    let steady = api.create().await;
    let cells = [
        "x = 21",
        "print(x * 2)",
        "x",
        "id(object())",
        "object()",
        "import uuid, datetime, tempfile, time\nprint(uuid.uuid4(), datetime.datetime.now().isoformat())\nprint(tempfile.mkdtemp())",
        "t0 = time.time(); time.sleep(0.01); print(f'took {time.time() - t0:.3f} s')",
        "import sys; print('to stderr', file=sys.stderr)",
        "{}['missing']",
        "import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()",
    ];
    for c in cells {
        api.execute(&steady, c).await;
    }
    let (status, r) = api
        .post(&format!("/v1/sessions/{steady}/replay"), json!({}))
        .await;
    assert_eq!(status, 201, "{r}");
    let new_id = r["session"]["id"].as_str().unwrap();
    assert_ne!(new_id, steady);
    assert_eq!(r["session"]["user"], "alice");
    let (status, s) = api.get(&format!("/v1/sessions/{new_id}")).await;
    assert_eq!(status, 200);
    assert_eq!(s["execution_count"], cells.len());
    let replayed = r["cells"].as_array().unwrap();
    assert_eq!(replayed.len(), cells.len());
    for (i, c) in replayed.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(
            c["same_output"],
            true,
            "cell {i} differs:\n{}",
            c["diff"].as_str().unwrap()
        );
        assert_eq!(c["diff"], "");
    }
    assert_eq!(replayed[8]["status"], "error");
    assert_eq!(replayed[0]["status"], "ok");

    let random = api.create().await;
    api.execute(&random, "import random").await;
    api.execute(&random, "random.random()").await;
    let (status, r) = api
        .post(&format!("/v1/sessions/{random}/replay"), json!({}))
        .await;
    assert_eq!(status, 201, "{r}");
    let replayed = r["cells"].as_array().unwrap();
    assert_eq!(replayed[0]["same_output"], true);
    assert_eq!(replayed[1]["same_output"], false);
    let diff = replayed[1]["diff"].as_str().unwrap();
    assert!(
        diff.contains("--- recorded") && diff.contains("+++ replayed"),
        "{diff}"
    );
    assert!(diff.lines().any(|l| l.starts_with("-0.")), "{diff}");
    assert!(diff.lines().any(|l| l.starts_with("+0.")), "{diff}");
    broker.stop().await;
}

/// A session with a workspace of its own loses its files when it ends: its replay gets a
/// workspace of its own, and the files the API wrote (a small one kept whole by the
/// recording, one past what it keeps named instead), moved and removed are made again
/// before the cells that followed, so they run as recorded; the user's shared workspace is
/// not touched.
#[tokio::test]
async fn a_replay_of_a_session_with_its_own_workspace_writes_its_files_again() {
    let broker = Broker::start("local", |_| {}).await;
    let api = broker.api(ALICE);
    let http = reqwest::Client::new();
    let (status, v) = api.post("/v1/sessions", json!({"workspace": "own"})).await;
    assert_eq!(status, 201, "{v}");
    let own = v["id"].as_str().unwrap().to_string();
    let put = |path: &str, body: Vec<u8>| {
        http.put(broker.url(&format!("/v1/sessions/{own}/files/{path}")))
            .bearer_auth(ALICE)
            .body(body)
            .send()
    };
    assert_eq!(
        put("data/sales.csv", b"a,b\n1,2\n".to_vec())
            .await
            .unwrap()
            .status(),
        201
    );
    let first = api
        .execute(
            &own,
            "print(open('/home/user/data/sales.csv').read().split())",
        )
        .await;
    assert_eq!(first["stdout"], "['a,b', '1,2']\n", "{first}");
    // A second version of the file, then it is moved; a large file besides.
    assert_eq!(
        put("data/sales.csv", b"a,b\n3,4\n".to_vec())
            .await
            .unwrap()
            .status(),
        201
    );
    let moved = http
        .patch(broker.url(&format!("/v1/sessions/{own}/files/data/sales.csv")))
        .bearer_auth(ALICE)
        .json(&json!({"path": "sales-2.csv"}))
        .send()
        .await
        .unwrap();
    assert_eq!(moved.status(), 200);
    assert_eq!(
        put("big.bin", vec![7u8; 3 << 20]).await.unwrap().status(),
        201
    );
    let second = api
        .execute(
            &own,
            "import os\nprint(open('/home/user/sales-2.csv').read().split(), os.path.exists('/home/user/data/sales.csv'))",
        )
        .await;
    assert_eq!(second["stdout"], "['a,b', '3,4'] False\n", "{second}");
    assert_eq!(api.delete(&format!("/v1/sessions/{own}")).await.0, 204);

    let (status, r) = api
        .post(&format!("/v1/sessions/{own}/replay"), json!({}))
        .await;
    assert_eq!(status, 201, "{r}");
    let cells = r["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2, "{r}");
    for c in cells {
        assert_eq!(c["same_output"], true, "{}", c["diff"]);
    }
    assert_eq!(r["files_not_replayed"], json!(["big.bin"]), "{r}");
    // The replay worked in a workspace of its own, not in the user's.
    let replay = r["session"]["id"].as_str().unwrap();
    assert_eq!(
        out(
            &api,
            replay,
            "import os\nprint(os.getcwd(), os.path.exists('/workspace/sales-2.csv'))"
        )
        .await,
        "/home/user True"
    );
    let shared = api.create().await;
    assert_eq!(
        out(
            &api,
            &shared,
            "import os\nprint(os.path.exists('/workspace/sales-2.csv'))"
        )
        .await,
        "False"
    );
    broker.stop().await;
}

#[tokio::test]
async fn recording_can_be_turned_off() {
    let broker = Broker::start("local", |a| a.record = Some(false)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api.execute(&id, "1+1").await;
    assert_eq!(x["status"], "ok");
    let (status, e) = api.get(&format!("/v1/sessions/{id}/events")).await;
    assert_eq!(status, 404);
    assert_eq!(e["error"]["code"], "recording_disabled");
    assert!(!broker.data_dir.join("recordings.sqlite3").exists());
    broker.stop().await;
}

#[tokio::test]
async fn the_ui_needs_a_token() {
    let broker = Broker::start("local", |_| {}).await;
    let http = reqwest::Client::new();
    let r = http.get(broker.url("/ui/")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.text().await.unwrap().contains("needs your API token"));
    let r = http
        .get(broker.url(&format!("/ui/?token={ALICE}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let csp = r.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(r.text().await.unwrap().contains("session-list"));
    let r = http.get(broker.url("/ui/app.js")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/javascript"));
    broker.stop().await;
}

/// Runs `print(text)` until its output comes back. Right after a flood of large displays
/// the kernel's iopub socket may still be dropping messages at its high-water mark (the
/// broker reads slower than the kernel writes), so the first small execution can lose its
/// output before it reaches the broker, let alone the recording.
async fn print_until_seen(api: &Api, id: &str, text: &str) {
    for _ in 0..10 {
        let x = api.execute(id, &format!("print({text:?})")).await;
        if x["stdout"] == format!("{text}\n") {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    panic!("{text:?} never came back");
}

/// The recordings file's size once its WAL is checkpointed into it.
fn recording_file_size(data_dir: &std::path::Path) -> u64 {
    let path = data_dir.join("recordings.sqlite3");
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.busy_timeout(Duration::from_secs(10)).unwrap();
    let (busy, _, _): (i64, i64, i64) = conn
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap();
    assert_eq!(busy, 0, "the checkpoint was blocked");
    std::fs::metadata(&path).unwrap().len()
}

#[tokio::test]
async fn large_displays_do_not_grow_the_recording_past_its_caps() {
    const MIB: u64 = 1 << 20;
    let (exec_cap, session_cap) = (20 * MIB, 48 * MIB);
    let broker = Broker::start("local", |a| {
        a.record_max_execution_bytes = Some(exec_cap);
        a.record_max_session_bytes = Some(session_cap);
        a.execution_timeout = Some(300.0);
        // 300 MB of displays pass through the kernel's ZeroMQ queues faster than they are
        // read; the default session limit (256 MiB) would end the kernel, not the test's point.
        a.session_memory_limit = Some(1 << 30);
    })
    .await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let before = recording_file_size(&broker.data_dir);
    // 300 displays of ~1 MB of raw text, each different, in one execution.
    let displays = |n: usize, tag: &str| {
        format!(
            "from IPython.display import display\n\
             for i in range({n}):\n\
             \x20   display({{'text/plain': '{tag}%d ' % i + 'x' * 1_000_000}}, raw=True)"
        )
    };
    let t0 = std::time::Instant::now();
    let mut x = api.execute(&id, &displays(300, "a")).await;
    x["results"] = json!(x["results"].as_array().map(Vec::len));
    // The Execution itself is cut at the result limit: its stdout is dropped.
    assert_eq!(x["status"], "ok", "{x}");
    eprintln!("300 displays of 1 MB took {:?}", t0.elapsed());
    let after_one = recording_file_size(&broker.data_dir);
    eprintln!(
        "the recording grew by {:.1} MiB for 300 MiB of displays (cap {} MiB)",
        (after_one - before) as f64 / MIB as f64,
        exec_cap / MIB
    );
    assert!(
        after_one - before <= exec_cap + 2 * MIB,
        "the recording grew by {} bytes over an execution cap of {exec_cap}",
        after_one - before
    );

    // A new execution has a fresh budget: it is recorded whole.
    print_until_seen(&api, &id, "small, after the cap").await;
    let evs = events(&api, &id, "limit=1000").await;
    let markers: Vec<&Value> = evs
        .iter()
        .filter(|e| e["kind"] == "recording_truncated")
        .collect();
    assert_eq!(markers.len(), 1, "{markers:?}");
    let m = &markers[0]["detail"];
    assert_eq!(m["scope"], "execution", "{m}");
    assert_eq!(m["limit_bytes"], exec_cap);
    // ~20 displays fit; the kernel's iopub socket itself drops some of the rest at its
    // high-water mark, before they reach the broker.
    let dropped = m["dropped_messages"].as_u64().unwrap();
    assert!((100..=300).contains(&dropped), "{m}");
    assert!(
        m["dropped_bytes"].as_u64().unwrap() >= dropped * 1_000_000,
        "{m}"
    );
    let marker_at = position(&evs, |e| e["kind"] == "recording_truncated", "marker");
    let small = position(
        &evs,
        |e| e["msg_type"] == "stream" && e["content"]["text"] == "small, after the cap\n",
        "the small execution's output",
    );
    assert!(small > marker_at);

    // Two more large executions reach the session cap: one more execution marker, then one
    // session marker, and nothing of the session is recorded after it.
    for tag in ["b", "c"] {
        let x = api.execute(&id, &displays(30, tag)).await;
        assert_eq!(x["status"], "ok");
    }
    print_until_seen(&api, &id, "not recorded").await;
    let evs = events(&api, &id, "limit=1000").await;
    let scopes: Vec<&str> = evs
        .iter()
        .filter(|e| e["kind"] == "recording_truncated")
        .map(|e| e["detail"]["scope"].as_str().unwrap())
        .collect();
    assert_eq!(scopes, ["execution", "execution", "session"]);
    assert!(!evs.iter().any(|e| e["content"]["text"] == "not recorded\n"));
    let after_all = recording_file_size(&broker.data_dir);
    eprintln!(
        "after 360 MiB of displays the recording grew by {:.1} MiB (session cap {} MiB)",
        (after_all - before) as f64 / MIB as f64,
        session_cap / MIB
    );
    assert!(after_all - before <= session_cap + 2 * MIB);

    // The notebook export still works and shows the cut.
    let (status, nb) = api.get(&format!("/v1/sessions/{id}/notebook")).await;
    assert_eq!(status, 200, "{nb}");
    let cells = nb["cells"].as_array().unwrap();
    assert!(cells.iter().filter(|c| c["cell_type"] == "code").count() >= 4);
    assert!(cells.iter().any(|c| c["cell_type"] == "markdown"));
    broker.stop().await;
}

/// `--database-url`: the recordings in PostgreSQL, through the API of a real broker: events
/// with the chart put back, the notebook, the list; a broker killed with `kill -9` starts
/// again and closes the session it left open, whose recording stays readable.
#[tokio::test]
async fn recordings_in_postgres_outlive_a_killed_broker() {
    let url = pg::fresh_database().await;
    let mut broker = SpawnedBroker::start(&["--database-url", &url], None);
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api
        .execute(
            &id,
            "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()\nprint('hi')",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    let png = x["results"][0]["data"]["image/png"]
        .as_str()
        .unwrap()
        .to_string();

    // Acknowledged means recorded, in PostgreSQL too.
    let evs = events(&api, &id, "type=display_data,stream").await;
    assert_eq!(evs[0]["content"]["data"]["image/png"], png.as_str());
    assert_eq!(evs[1]["content"]["text"], "hi\n");
    let (status, nb) = api.get(&format!("/v1/sessions/{id}/notebook")).await;
    assert_eq!(status, 200, "{nb}");
    assert_eq!(
        nb["cells"][0]["outputs"][0]["data"]["image/png"],
        png.as_str()
    );
    let (status, list) = api.get("/v1/recordings").await;
    assert_eq!(status, 200, "{list}");
    assert!(list.to_string().contains(&id), "{list}");
    // Private: bob sees none of it.
    let (status, _) = broker
        .api(BOB)
        .get(&format!("/v1/sessions/{id}/events"))
        .await;
    assert_eq!(status, 404);

    // Stored there, not in a file; the session's row names this broker's node.
    assert!(!broker.data_dir().join("recordings.sqlite3").exists());
    let node = std::fs::read_to_string(broker.data_dir().join("node-id")).unwrap();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT node, (SELECT count(*) FROM blobs) FROM sessions WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), node.trim());
    assert_eq!(row.get::<_, i64>(1), 1, "the chart, once");

    broker.restart(Stop::Kill).await;
    let api = broker.api(ALICE);
    let evs = within(30, "the stale session closed", async {
        loop {
            let evs = events(&api, &id, "").await;
            if evs.last().is_some_and(|e| e["kind"] == "broker_stopped") {
                return evs;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(evs.iter().any(|e| e["msg_type"] == "display_data"));
    assert_eq!(
        pg_end_reason(&client, &id).await.as_deref(),
        Some("broker_stopped")
    );
    broker.stop().await;
}

/// Issue 32, item 7: a session id proposed through the Jupyter API (`KERNEL_ID`, Enterprise
/// Gateway's convention) is refused with 409 `session_exists` when any session had it:
/// another user's ended one (whose recording stays as it was), the proposer's own ended
/// one, a live one, and an ended one only the recordings know of (after a restart). A
/// fresh id is taken as proposed.
async fn proposed_ids_are_never_reused(broker: &mut SpawnedBroker) {
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    let propose = |id: &str| json!({"name": "python3", "env": {"KERNEL_ID": id}});
    let refused = |(status, v): (u16, Value), what: &str| {
        assert_eq!(status, 409, "{what}: {v}");
        assert_eq!(v["error"]["code"], "session_exists", "{what}: {v}");
        assert!(
            v["error"]["message"].as_str().is_some_and(|m| m.len() > 20),
            "{what}: {v}"
        );
    };
    let ended = alice.create().await;
    assert_eq!(
        alice.execute(&ended, "secret = 41 + 1").await["status"],
        "ok"
    );
    let (status, _) = alice.delete(&format!("/v1/sessions/{ended}")).await;
    assert_eq!(status, 204);
    // The end is recorded by the writer after the answer: the recording as it stays.
    let mut before = events(&alice, &ended, "").await;
    for _ in 0..200 {
        if before.last().is_some_and(|e| e["kind"] == "session_closed") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        before = events(&alice, &ended, "").await;
    }
    assert_eq!(before.last().unwrap()["kind"], "session_closed");

    refused(
        bob.post("/api/kernels", propose(&ended)).await,
        "another user's ended session",
    );
    refused(
        alice.post("/api/kernels", propose(&ended)).await,
        "the user's own ended session",
    );
    let live = alice.create().await;
    refused(
        bob.post("/api/kernels", propose(&live)).await,
        "another user's live session",
    );
    refused(
        alice.post("/api/kernels", propose(&live)).await,
        "the user's own live session",
    );
    let fresh = uuid::Uuid::new_v4().to_string();
    let (status, k) = bob.post("/api/kernels", propose(&fresh)).await;
    assert_eq!(status, 201, "{k}");
    assert_eq!(k["id"], fresh.as_str());

    // Only the recordings know the ended session now.
    broker.restart(Stop::Term).await;
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    refused(
        bob.post("/api/kernels", propose(&ended)).await,
        "an ended session after a restart",
    );
    // Its recording is as it was: still alice's, nothing added.
    assert_eq!(events(&alice, &ended, "").await, before);
    let (status, _) = bob.get(&format!("/v1/sessions/{ended}/events")).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn proposed_ids_are_never_reused_sqlite() {
    let mut broker = SpawnedBroker::start(&[], None);
    proposed_ids_are_never_reused(&mut broker).await;
    broker.stop().await;
}

#[tokio::test]
async fn proposed_ids_are_never_reused_postgres() {
    let url = pg::fresh_database().await;
    let mut broker = SpawnedBroker::start(&["--database-url", &url], None);
    proposed_ids_are_never_reused(&mut broker).await;
    broker.stop().await;
}

/// An execution is stored once (its `execution_done` keeps only its outcome) and reads back
/// as the session answered it: stdout, stderr, results with a PNG, the count; an error and
/// its status; in every read (all events, filtered, a page without its messages).
/// `stored_once` says how many `execution_done` rows hold only an outcome.
async fn executions_are_stored_once_and_read_back_whole(
    broker: &SpawnedBroker,
    stored_once: impl AsyncFn() -> i64,
) {
    let api = broker.api(ALICE);
    let id = api.create().await;
    let cells = [
        "import sys\nimport matplotlib.pyplot as plt\nprint('x' * 1000)\n\
         print('careful', file=sys.stderr)\nplt.plot([1, 3, 2])\nplt.show()\n6 * 7",
        "raise ValueError('bad')",
    ];
    let mut answers = Vec::new();
    for code in cells {
        answers.push(api.execute(&id, code).await);
    }
    let (a, b) = (&answers[0], &answers[1]);
    assert_eq!(a["status"], "ok", "{a}");
    assert_eq!(a["stdout"], format!("{}\n", "x".repeat(1000)).as_str());
    assert_eq!(a["stderr"], "careful\n");
    assert!(a["results"][0]["data"]["image/png"].is_string(), "{a}");
    assert_eq!(a["results"][1]["data"]["text/plain"], "42");
    assert_eq!(b["status"], "error", "{b}");
    assert_eq!(b["error"]["ename"], "ValueError");
    assert_eq!(stored_once().await, 2);

    let all = events(&api, &id, "").await;
    let dones: Vec<&Value> = all
        .iter()
        .filter(|e| e["kind"] == "execution_done")
        .collect();
    let filtered = events(&api, &id, "type=execution_done").await;
    assert_eq!(filtered.len(), 2);
    for (i, answer) in answers.iter().enumerate() {
        let seq = dones[i]["seq"].as_i64().unwrap();
        let page = events(&api, &id, &format!("after={}&limit=1", seq - 1)).await;
        for read in [dones[i], &filtered[i], &page[0]] {
            let x = &read["detail"]["execution"];
            let fields = x.as_object().unwrap();
            assert_eq!(fields.len(), 8, "{x}");
            for (k, v) in fields {
                assert_eq!(&answer[k], v, "{k}: {x}");
            }
        }
    }
}

#[tokio::test]
async fn executions_are_stored_once_sqlite() {
    let broker = SpawnedBroker::start(&[], None);
    let db = broker.data_dir().join("recordings.sqlite3");
    executions_are_stored_once_and_read_back_whole(&broker, async || {
        let conn =
            rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .unwrap();
        conn.query_row(
            "SELECT count(*) FROM events WHERE kind = 'execution_done'
               AND content LIKE '%\"outcome\"%' AND content NOT LIKE '%\"stdout\"%'",
            [],
            |r| r.get(0),
        )
        .unwrap()
    })
    .await;
    broker.stop().await;
}

#[tokio::test]
async fn executions_are_stored_once_postgres() {
    let url = pg::fresh_database().await;
    let broker = SpawnedBroker::start(&["--database-url", &url], None);
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    executions_are_stored_once_and_read_back_whole(&broker, async || {
        client
            .query_one(
                "SELECT count(*) FROM events WHERE kind = 'execution_done'
                   AND content LIKE '%\"outcome\"%' AND content NOT LIKE '%\"stdout\"%'",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    })
    .await;
    broker.stop().await;
}

/// What an API user makes the broker record without running code (file writes and moves)
/// is bounded like the kernel's output: past the session's cap it is dropped and counted,
/// not kept as lifecycle events are. A user who writes or moves files in a loop must
/// not grow the recording without end (issue 33).
#[tokio::test]
async fn a_flood_of_file_changes_stops_at_the_session_cap() {
    const CAP: u64 = 64 << 10;
    let broker = Broker::start("local", |a| {
        a.record_max_session_bytes = Some(CAP);
    })
    .await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    api.execute(&id, "1").await;
    let before = recording_file_size(&broker.data_dir);
    let http = reqwest::Client::new();
    // Each write is recorded as a `file_written` of ~250 bytes: 1500 are ~6 caps' worth.
    let long = "n".repeat(180);
    for i in 0..1500 {
        let put = http
            .put(format!(
                "http://{}/v1/sessions/{id}/files/{long}{i}.txt",
                broker.addr
            ))
            .bearer_auth(ALICE)
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(put.status(), 201);
    }
    // And 300 moves, each a `file_renamed`.
    for i in 0..300 {
        let (s, v) = api
            .call(
                reqwest::Method::PATCH,
                &format!("/v1/sessions/{id}/files/{long}{i}.txt"),
                Some(json!({ "path": format!("moved/{i}.txt") })),
            )
            .await;
        assert_eq!(s, 200, "{v}");
    }
    // The session lives on, and what it does next is answered.
    print_until_seen(&api, &id, "still here").await;
    let grew = recording_file_size(&broker.data_dir) - before;
    eprintln!("1500 file writes and 300 moves grew the recording by {grew} bytes (cap {CAP})");
    assert!(
        grew <= CAP + (64 << 10),
        "the recording grew by {grew} bytes over a session cap of {CAP}"
    );
    let evs = events(&api, &id, "limit=5000").await;
    let written = evs.iter().filter(|e| e["kind"] == "file_written").count();
    assert!(
        written > 10 && written < 1500,
        "{written} file writes recorded"
    );
    let marker = &evs[position(
        &evs,
        |e| e["kind"] == "recording_truncated" && e["detail"]["scope"] == "session",
        "a session marker",
    )]["detail"];
    assert!(
        marker["dropped_messages"].as_u64().unwrap() >= 1500 - written as u64,
        "{marker}"
    );
    broker.stop().await;
}
