//! Cluster mode (issue 16): three broker processes on one PostgreSQL database, each
//! advertising its own address. A session created through one node is used through the
//! others (REST, the agent WebSocket, the Jupyter kernels API and its channels), lists show
//! every node's sessions, and node-to-node requests need the cluster's key.

use crate::common;

use std::net::SocketAddr;

use common::spawned::{SpawnedBroker, Stop};
use common::*;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};

/// `n` nodes of one cluster, and its database.
async fn cluster_on(n: usize, extra: &[&str]) -> (Vec<SpawnedBroker>, String) {
    let url = pg::fresh_database().await;
    let nodes = (0..n).map(|_| node(&url, extra)).collect();
    (nodes, url)
}

async fn cluster(n: usize) -> Vec<SpawnedBroker> {
    cluster_on(n, &[]).await.0
}

/// A node joining the cluster of database `url`.
fn node(url: &str, extra: &[&str]) -> SpawnedBroker {
    let addr = common::spawned::restartable_addr();
    let advertise = format!("http://{addr}");
    let mut args = vec!["--database-url", url, "--advertise-url", &advertise];
    args.extend(extra);
    SpawnedBroker::start_on(addr, &args)
}

/// `node`'s list of alice's sessions holds `ids`.
async fn assert_lists(node: &SpawnedBroker, ids: &[&str]) {
    let (status, list) = node.api(ALICE).get("/v1/sessions").await;
    assert_eq!(status, 200, "{list}");
    let listed: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert!(
        ids.iter().all(|id| listed.contains(id)),
        "{listed:?} lacks some of {ids:?}"
    );
}

/// The node id in the recording of session `id` (written as the session reports its
/// creation).
async fn recorded_node(client: &tokio_postgres::Client, id: &str) -> String {
    within(10, "the session's recording", async {
        loop {
            let row = client
                .query_opt("SELECT node FROM sessions WHERE id = $1", &[&id])
                .await
                .unwrap();
            if let Some(row) = row {
                return row.get::<_, String>(0);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
}

async fn ws_open(addr: SocketAddr, id: &str, token: &str) -> Ws {
    let url = format!("ws://{addr}/v1/sessions/{id}/stream?token={token}");
    let (ws, _) = within(30, "ws connect", tokio_tungstenite::connect_async(url))
        .await
        .unwrap();
    ws
}

/// A connection to database `url`, for the test's own queries.
async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// Waits (at most 30 s) until `node` answers session `id` as dead; its JSON.
async fn until_dead(node: &SpawnedBroker, id: &str, what: &str) -> Value {
    within(30, what, async {
        loop {
            let (status, s) = node.api(ALICE).get(&format!("/v1/sessions/{id}")).await;
            if status == 200 && s["state"] == "dead" {
                return s;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await
}

/// Waits (at most `secs`) until `node` answers `/healthz` 200 and session `id` as dead: it
/// ended the session and joined again.
async fn until_rejoined_with_dead(node: &SpawnedBroker, id: &str, secs: u64) {
    within(secs, "the node to end its session and rejoin", async {
        loop {
            let (hs, _) = node.api(ALICE).get("/healthz").await;
            let (st, s) = node.api(ALICE).get(&format!("/v1/sessions/{id}")).await;
            if hs == 200 && st == 200 && s["state"] == "dead" {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await
}

/// Session `id` was ended on `node` with the loss of its node: anything but `GET` answers
/// `410 node_lost`, it is not listed, and its recording ends with `node_lost`.
async fn assert_ended_as_lost(node: &SpawnedBroker, client: &tokio_postgres::Client, id: &str) {
    let (status, r) = node
        .api(ALICE)
        .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "x"}))
        .await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (410, &json!("node_lost")),
        "{r}"
    );
    let (_, list) = node.api(ALICE).get("/v1/sessions").await;
    assert!(!list.to_string().contains(id), "{list}");
    assert_eq!(
        pg_end_reason(client, id).await.as_deref(),
        Some("node_lost")
    );
}

#[tokio::test]
async fn any_node_serves_any_session() {
    let nodes = cluster(3).await;
    let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
    let id = a.api(ALICE).create().await;

    // State set through A, read through B and C: one kernel, wherever the request lands.
    let x = a.api(ALICE).execute(&id, "x = 41").await;
    assert_eq!(x["status"], "ok", "{x}");
    let x = b.api(ALICE).execute(&id, "x += 1\nx").await;
    assert_eq!(x["status"], "ok", "{x}");
    assert_eq!(x["results"][0]["data"]["text/plain"], "42");
    let (status, s) = c.api(ALICE).get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 200, "{s}");
    assert_eq!(s["id"], id.as_str());

    // The agent stream, through C.
    let mut ws = ws_open(c.addr, &id, ALICE).await;
    ws_send(
        &mut ws,
        json!({"type": "execute", "id": 7, "code": "print(x * 2)"}),
    )
    .await;
    let mut out = String::new();
    loop {
        let f = ws_next(&mut ws).await;
        if f["type"] == "stdout" {
            out.push_str(f["text"].as_str().unwrap_or(""));
        }
        if f["type"] == "done" && f["id"] == 7 {
            break;
        }
    }
    assert_eq!(out, "84\n");
    ws.close(None).await.unwrap();

    // The Jupyter kernels API and its channels, through B.
    let (status, k) = b.api(ALICE).get(&format!("/api/kernels/{id}")).await;
    assert_eq!(status, 200, "{k}");
    let url = format!("ws://{}/api/kernels/{id}/channels?token={ALICE}", b.addr);
    let (mut ch, _) = within(30, "channels", tokio_tungstenite::connect_async(url))
        .await
        .unwrap();
    let msg_id = uuid::Uuid::new_v4().to_string();
    let req = json!({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "t",
                   "session": "s", "date": "2026-01-01T00:00:00Z", "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell",
        "content": {"code": "x", "silent": false, "store_history": true,
                    "user_expressions": {}, "allow_stdin": false},
    });
    ch.send(tokio_tungstenite::tungstenite::Message::Text(
        req.to_string().into(),
    ))
    .await
    .unwrap();
    let result = within(60, "execute_result over channels", async {
        loop {
            let m = ch.next().await.unwrap().unwrap();
            if let tokio_tungstenite::tungstenite::Message::Text(t) = m {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["msg_type"] == "execute_result"
                    && v["parent_header"]["msg_id"] == msg_id.as_str()
                {
                    return v;
                }
            }
        }
    })
    .await;
    assert_eq!(result["content"]["data"]["text/plain"], "42");
    let _ = ch.close(None).await;

    // Lists are the cluster's: a second session on C, both listed by A, B and C.
    let id2 = c.api(ALICE).create().await;
    for node in [a, b, c] {
        assert_lists(node, &[&id, &id2]).await;
        let (_, kernels) = node.api(ALICE).get("/api/kernels").await;
        assert_eq!(kernels.as_array().unwrap().len(), 2, "{kernels}");
        // Private across nodes too: bob sees none of alice's.
        let (_, theirs) = node.api(BOB).get("/v1/sessions").await;
        assert_eq!(theirs, json!([]));
        let (status, _) = node.api(BOB).get(&format!("/v1/sessions/{id}")).await;
        assert_eq!(status, 404);
    }
    // The recording is read from the shared database by any node.
    let (status, evs) = b
        .api(ALICE)
        .get(&format!("/v1/sessions/{id}/events?type=execute_request"))
        .await;
    assert_eq!(status, 200, "{evs}");
    assert_eq!(
        evs["events"].as_array().unwrap().len(),
        4,
        "REST twice, the stream, the channels"
    );

    // Deleted through B; then gone everywhere.
    let (status, _) = b.api(ALICE).delete(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 204);
    for node in [a, b, c] {
        let (status, _) = node.api(ALICE).get(&format!("/v1/sessions/{id}")).await;
        assert_eq!(status, 404);
    }
    for node in nodes {
        node.stop().await;
    }
}

#[tokio::test]
async fn node_to_node_requests_need_the_clusters_key() {
    let nodes = cluster(2).await;
    let client = reqwest::Client::new();
    // A client posing as a node is refused, whatever it asks.
    let r = client
        .get(format!("http://{}/v1/sessions", nodes[0].addr))
        .bearer_auth(ALICE)
        .header("x-kernel-broker-node", "guess")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "bad_node_key"
    );
    // Without credentials nothing is forwarded: 401 here.
    let r = client
        .get(format!(
            "http://{}/v1/sessions/{}",
            nodes[0].addr,
            uuid::Uuid::new_v4()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // An unknown session is 404 after asking the peers.
    let (status, _) = nodes[1]
        .api(ALICE)
        .get(&format!("/v1/sessions/{}", uuid::Uuid::new_v4()))
        .await;
    assert_eq!(status, 404);
    for node in nodes {
        node.stop().await;
    }
}

/// `kill -9` of one node: within its lease its sessions are dead (reason "node lost") as every
/// other node tells, their recordings stay readable, the other nodes' sessions go on, and a
/// new node joins and takes sessions.
#[tokio::test]
async fn a_lost_nodes_sessions_turn_dead_and_the_rest_go_on() {
    let (mut nodes, url) = cluster_on(3, &["--node-lease", "2"]).await;
    let lost = nodes[0].api(ALICE).create().await;
    let kept = nodes[1].api(ALICE).create().await;
    for (i, id) in [(0, &lost), (1, &kept)] {
        let x = nodes[i].api(ALICE).execute(id, "x = 'still here'").await;
        assert_eq!(x["status"], "ok", "{x}");
    }
    nodes[0].halt(Stop::Kill).await;
    let killed = std::time::Instant::now();

    let (b, c) = (&nodes[1], &nodes[2]);
    let s = until_dead(b, &lost, "the lost node's session dead").await;
    // The lease (2 s) and one sweep (a third of it) on top, with room for a busy machine.
    assert!(
        killed.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        killed.elapsed()
    );
    assert!(
        s["dead_reason"].as_str().unwrap().starts_with("node lost"),
        "{s}"
    );
    let (status, s) = c.api(ALICE).get(&format!("/v1/sessions/{lost}")).await;
    assert_eq!((status, &s["state"]), (200, &json!("dead")));
    let (status, r) = c
        .api(ALICE)
        .post(
            &format!("/v1/sessions/{lost}/execute"),
            json!({"code": "x"}),
        )
        .await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (410, &json!("node_lost")),
        "{r}"
    );
    let (status, _) = c.api(BOB).get(&format!("/v1/sessions/{lost}")).await;
    assert_eq!(
        status, 404,
        "another user's lost session is nobody's business"
    );
    // Its recording is readable from the survivors, ended by the loss.
    let (status, evs) = c
        .api(ALICE)
        .get(&format!("/v1/sessions/{lost}/events"))
        .await;
    assert_eq!(status, 200, "{evs}");
    let evs = evs["events"].as_array().unwrap();
    assert!(evs.iter().any(|e| e["msg_type"] == "execute_request"));
    assert_eq!(evs.last().unwrap()["kind"], "node_lost");

    // The others' sessions go on, through any node.
    let x = c.api(ALICE).execute(&kept, "x").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "'still here'", "{x}");

    // A new node joins and takes sessions, served through the others too.
    let d = node(&url, &["--node-lease", "2"]);
    let fresh = d.api(ALICE).create().await;
    let x = b.api(ALICE).execute(&fresh, "1 + 1").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "2", "{x}");
    assert_lists(c, &[&kept, &fresh]).await;

    // The lost node restarts in place (same data directory, same node id) and rejoins.
    nodes[0].resume();
    let x = nodes[0].api(ALICE).execute(&kept, "x").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "'still here'", "{x}");
    d.stop().await;
    for n in nodes {
        n.stop().await;
    }
}

/// New sessions go to the node with the most headroom, whichever node is asked; a user's
/// session quota counts every node's sessions.
#[tokio::test]
async fn sessions_spread_over_the_nodes_and_the_quota_holds_cluster_wide() {
    // A long lease: no renewal reports the nodes' load during the burst below.
    let (nodes, url) = cluster_on(3, &["--node-lease", "60", "--max-sessions-per-user", "4"]).await;
    let client = connect(&url).await;
    // A burst asked of one node: each placement is counted in the nodes table at once, so
    // the next one sees it before any renewal could.
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(nodes[0].api(ALICE).create().await);
    }
    let mut held = Vec::new();
    for id in &ids {
        held.push(recorded_node(&client, id).await);
    }
    held.sort();
    held.dedup();
    assert_eq!(
        held.len(),
        3,
        "three sessions asked of one node at once, one on each: {held:?}"
    );

    // The quota (4) holds across the nodes: none of them has more than two.
    ids.push(nodes[2].api(ALICE).create().await);
    let (status, body) = nodes[1].api(ALICE).post("/v1/sessions", json!({})).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "quota_exceeded");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("across the cluster"),
        "{body}"
    );
    // Another user's sessions are not counted against it.
    let (status, body) = nodes[1].api(BOB).post("/v1/sessions", json!({})).await;
    assert_eq!(status, 201, "{body}");
    // Each of alice's sessions works through one node, wherever it is.
    for id in &ids {
        let x = nodes[0].api(ALICE).execute(id, "6 * 7").await;
        assert_eq!(x["results"][0]["data"]["text/plain"], "42", "{x}");
    }
    for n in nodes {
        n.stop().await;
    }
}

/// A fork, a checkpoint's fork and a replay make sessions on the node holding the original,
/// not through a new session's placement: they count against the user's quota across the
/// cluster all the same (her sessions on the other nodes counted under her creation lock),
/// and a refusal says so.
#[tokio::test]
async fn forks_and_replays_count_against_the_quota_across_the_cluster() {
    let (nodes, url) = cluster_on(
        2,
        &[
            "--node-lease",
            "60",
            "--max-sessions-per-user",
            "3",
            "--fork-server",
            "true",
            "--preload",
            "numpy",
        ],
    )
    .await;
    let client = connect(&url).await;
    // Two sessions asked of one node: one on each node.
    let a = nodes[0].api(ALICE).create().await;
    let b = nodes[0].api(ALICE).create().await;
    let (held_a, held_b) = (
        recorded_node(&client, &a).await,
        recorded_node(&client, &b).await,
    );
    assert_ne!(held_a, held_b, "one session on each node");
    // Asked of both nodes: one forwards to the other, which holds `a`.
    let x = nodes[1].api(ALICE).execute(&a, "x = 41").await;
    assert_eq!(x["status"], "ok", "{x}");
    let (status, cp) = nodes[1]
        .api(ALICE)
        .post(&format!("/v1/sessions/{a}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 201, "{cp}");
    let cp = cp["id"].as_str().unwrap().to_string();

    // Two forks would make four sessions of three: refused whole, through either node,
    // though the node holding `a` holds one session of hers.
    for node in &nodes {
        let (status, body) = node
            .api(ALICE)
            .post(&format!("/v1/sessions/{a}/fork"), json!({"count": 2}))
            .await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["error"]["code"], "quota_exceeded", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("across the cluster"), "{body}");
    }
    // One fits, and holds what `a` held.
    let (status, body) = nodes[0]
        .api(ALICE)
        .post(&format!("/v1/sessions/{a}/fork"), json!({}))
        .await;
    assert_eq!(status, 201, "{body}");
    let fork = body["sessions"][0]["id"].as_str().unwrap().to_string();
    let x = nodes[1].api(ALICE).execute(&fork, "x + 1").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "42", "{x}");

    // Three of three: the checkpoint's fork, a replay and another fork are refused.
    for (path, what) in [
        (
            format!("/v1/sessions/{a}/checkpoints/{cp}/fork"),
            "a checkpoint's fork",
        ),
        (format!("/v1/sessions/{a}/replay"), "a replay"),
        (format!("/v1/sessions/{fork}/fork"), "a fork of a fork"),
    ] {
        let (status, body) = nodes[0].api(ALICE).post(&path, json!({})).await;
        assert_eq!(status, 429, "{what}: {body}");
        assert_eq!(body["error"]["code"], "quota_exceeded", "{what}: {body}");
    }
    // Another user's sessions are not counted against hers, nor hers against his.
    let bob = nodes[1].api(BOB).create().await;
    let (status, body) = nodes[1]
        .api(BOB)
        .post(&format!("/v1/sessions/{bob}/fork"), json!({"count": 2}))
        .await;
    assert_eq!(status, 201, "{body}");

    // The session on the other node ends: room for one again, counted, not remembered.
    let (status, _) = nodes[0]
        .api(ALICE)
        .delete(&format!("/v1/sessions/{b}"))
        .await;
    assert_eq!(status, 204);
    let (status, body) = nodes[1]
        .api(ALICE)
        .post(
            &format!("/v1/sessions/{a}/checkpoints/{cp}/fork"),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let from_cp = body["sessions"][0]["id"].as_str().unwrap().to_string();
    let x = nodes[0].api(ALICE).execute(&from_cp, "x").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "41", "{x}");
    for n in nodes {
        n.stop().await;
    }
}

/// The cost of forwarding: `1+1` over REST through the session's own node and through
/// another node, alternating. A measurement (BENCHMARKS.md), not a test of speed:
/// `KB_TEST_POSTGRES_URL=... cargo nextest run --release --test cluster forward_cost --run-ignored only --no-capture`
#[tokio::test]
#[ignore = "a measurement"]
async fn forward_cost() {
    let (nodes, url) = cluster_on(2, &[]).await;
    let id = nodes[0].api(ALICE).create().await;
    // Where it landed: its recording names the node.
    let client = connect(&url).await;
    let node = recorded_node(&client, &id).await;
    let owner = nodes
        .iter()
        .position(|n| {
            std::fs::read_to_string(n.data_dir().join("node-id"))
                .unwrap()
                .trim()
                == node
        })
        .unwrap();
    let (direct, other) = (&nodes[owner], &nodes[1 - owner]);
    let (mut d, mut f) = (Vec::new(), Vec::new());
    for i in 0..400 {
        for (api, v) in [(direct.api(ALICE), &mut d), (other.api(ALICE), &mut f)] {
            let t = std::time::Instant::now();
            let x = api.execute(&id, "1+1").await;
            if i >= 20 {
                v.push(t.elapsed());
            }
            assert_eq!(x["status"], "ok");
        }
    }
    for (what, mut v) in [("direct", d), ("forwarded", f)] {
        v.sort();
        let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
        eprintln!("{what}: p50 {:?} p99 {:?}", p(0.5), p(0.99));
    }
    for n in nodes {
        n.stop().await;
    }
}

/// What cluster mode adds to a fork (its user's creation lock and the count of her
/// sessions on the other node): a fork and its delete, alternately on a broker alone and on
/// a node of a cluster of two. A measurement (BENCHMARKS.md), not a test of speed:
/// `cargo nextest run --test it fork_cost --run-ignored only --no-capture`
#[tokio::test]
#[ignore = "a measurement"]
async fn fork_cost() {
    let forking = ["--fork-server", "true", "--preload", "numpy"];
    let url = pg::fresh_database().await;
    let mut clustered: Vec<&str> = vec!["--node-lease", "60"];
    clustered.extend(forking);
    let a = node(&url, &clustered);
    let b = node(&url, &clustered);
    let alone = SpawnedBroker::start(&forking, None);
    let mut times = Vec::new();
    for broker in [&alone, &a] {
        let api = broker.api(ALICE);
        let id = api.create().await;
        let mut v = Vec::new();
        for i in 0..60 {
            let t = std::time::Instant::now();
            let (status, f) = api
                .post(&format!("/v1/sessions/{id}/fork"), json!({}))
                .await;
            let took = t.elapsed();
            assert_eq!(status, 201, "{f}");
            let fork = f["sessions"][0]["id"].as_str().unwrap();
            api.delete(&format!("/v1/sessions/{fork}")).await;
            if i >= 10 {
                v.push(took);
            }
        }
        v.sort();
        times.push(v);
    }
    for (what, v) in ["alone", "in a cluster of two"].iter().zip(times) {
        let p = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
        eprintln!("fork, {what}: p50 {:?} p90 {:?}", p(0.5), p(0.9));
    }
    for n in [a, b, alone] {
        n.stop().await;
    }
}

/// SIGUSR1 drains a node: `/healthz` says so (503), new sessions asked of it are made on the
/// others, its sessions keep working (through any node), and it stops by itself once they
/// have ended.
#[tokio::test]
async fn a_drained_node_takes_no_new_sessions_and_stops_when_its_sessions_end() {
    let (mut nodes, url) = cluster_on(2, &["--node-lease", "3"]).await;
    let client = connect(&url).await;
    let ids: Vec<String> = nodes
        .iter()
        .map(|n| {
            std::fs::read_to_string(n.data_dir().join("node-id"))
                .unwrap()
                .trim()
                .to_string()
        })
        .collect();
    // Equal headroom: the first session stays on the node asked.
    let old = nodes[0].api(ALICE).create().await;
    assert_eq!(recorded_node(&client, &old).await, ids[0]);

    nodes[0].signal(libc::SIGUSR1);
    let health = within(30, "draining in /healthz", async {
        loop {
            let r = reqwest::get(format!("http://{}/healthz", nodes[0].addr))
                .await
                .unwrap();
            if r.status() == 503 {
                return r.json::<Value>().await.unwrap();
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(health["status"], "draining");
    let fresh = nodes[0].api(ALICE).create().await;
    assert_eq!(
        recorded_node(&client, &fresh).await,
        ids[1],
        "made on the other node"
    );
    let x = nodes[1].api(ALICE).execute(&old, "'still served'").await;
    assert_eq!(
        x["results"][0]["data"]["text/plain"], "'still served'",
        "{x}"
    );

    // Its last session ends: it stops, cleanly.
    let (status, _) = nodes[1]
        .api(ALICE)
        .delete(&format!("/v1/sessions/{old}"))
        .await;
    assert_eq!(status, 204);
    let status = nodes[0].exited(60).await;
    assert!(status.success(), "{status:?}");
    let x = nodes[1].api(ALICE).execute(&fresh, "1").await;
    assert_eq!(x["status"], "ok");
    let _drained = nodes.remove(0);
    for n in nodes {
        n.stop().await;
    }
}

/// A raw HTTP request to `node`: status and body (as JSON when it is).
async fn raw(
    node: &SpawnedBroker,
    method: reqwest::Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut r = reqwest::Client::new().request(method, format!("http://{}{path}", node.addr));
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    if let Some(b) = body {
        r = r
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    let resp = within(120, path, r.send()).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (
        status,
        headers,
        within(120, path, resp.text()).await.unwrap(),
    )
}

#[tokio::test]
async fn e2b_sandboxes_are_served_through_any_node() {
    use reqwest::Method as M;
    let nodes = cluster(3).await;
    let key = [("x-api-key", ALICE)];
    let (status, _, created) = raw(
        &nodes[0],
        M::POST,
        "/e2b/v2/sandboxes",
        &key,
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let created: Value = serde_json::from_str(&created).unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let tok = created["envdAccessToken"].as_str().unwrap().to_string();
    let inside = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("X-Access-Token", tok.as_str()),
    ];

    // The code interpreter through every node: one kernel's state.
    for (i, node) in nodes.iter().enumerate() {
        let code = format!("n = globals().get('n', 0) + 1\nprint('node', {i}, 'n', n)");
        let (status, _, text) = raw(
            node,
            M::POST,
            "/e2b/sandbox/execute",
            &inside,
            Some(json!({"code": code})),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        assert!(text.contains(&format!("node {i} n {}", i + 1)), "{text}");
        assert!(
            text.ends_with("{\"type\":\"end_of_execution\"}\n"),
            "{text}"
        );
        // The control plane too: the sandbox and the lists.
        let (status, _, one) = raw(node, M::GET, &format!("/e2b/sandboxes/{id}"), &key, None).await;
        assert_eq!(status, 200, "{one}");
        let (status, _, list) = raw(node, M::GET, "/e2b/v2/sandboxes", &key, None).await;
        assert_eq!(status, 200, "{list}");
        assert!(list.contains(&id), "{list}");
        // Envd's files: written through one node, read through the next.
        let (status, _, _) = raw(node, M::GET, "/e2b/sandbox/health", &inside, None).await;
        assert_eq!(status, 204);
    }

    // A forged or foreign token is not forwarded: absent, in E2B's shape, on every node;
    // bob's key sees nothing of alice's.
    let forged = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("X-Access-Token", "0123abcd"),
    ];
    for node in &nodes {
        let (status, _, body) = raw(
            node,
            M::POST,
            "/e2b/sandbox/execute",
            &forged,
            Some(json!({"code": "1"})),
        )
        .await;
        assert_eq!(status, 404, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["code"], 404, "{v}");
        let (status, _, body) = raw(
            node,
            M::GET,
            &format!("/e2b/sandboxes/{id}"),
            &[("x-api-key", BOB)],
            None,
        )
        .await;
        assert_eq!(status, 404, "{body}");
        let (_, _, list) = raw(node, M::GET, "/e2b/sandboxes", &[("x-api-key", BOB)], None).await;
        assert_eq!(list, "[]");
    }

    // Killed through the last node: gone from all.
    let (status, _, body) = raw(
        &nodes[2],
        M::DELETE,
        &format!("/e2b/sandboxes/{id}"),
        &key,
        None,
    )
    .await;
    assert_eq!(status, 204, "{body}");
    for node in &nodes {
        let (status, _, body) =
            raw(node, M::GET, &format!("/e2b/sandboxes/{id}"), &key, None).await;
        assert_eq!(status, 404, "{body}");
    }
}

/// The JSON-RPC messages of an MCP answer (JSON, or SSE events).
fn mcp_messages(text: &str) -> Vec<Value> {
    if let Ok(v) = serde_json::from_str(text) {
        return vec![v];
    }
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str(d.trim()).ok())
        .collect()
}

#[tokio::test]
async fn an_mcp_session_is_served_through_any_node() {
    use reqwest::Method as M;
    let nodes = cluster(3).await;
    let bearer = format!("Bearer {ALICE}");
    let base = [
        ("authorization", bearer.as_str()),
        ("accept", "application/json, text/event-stream"),
    ];
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "tests/it/cluster.rs", "version": "1"}}});
    let (status, headers, body) = raw(&nodes[0], M::POST, "/mcp", &base, Some(init)).await;
    assert_eq!(status, 200, "{body}");
    let sid = headers["mcp-session-id"].to_str().unwrap().to_string();
    assert!(sid.contains('.'), "cluster MCP ids name their node: {sid}");
    let with = |sid: &str| {
        let mut h = base.to_vec();
        h.push((
            "mcp-session-id",
            Box::leak(sid.to_string().into_boxed_str()),
        ));
        h.push(("mcp-protocol-version", "2025-11-25"));
        h
    };
    let h = with(&sid);
    let (status, _, body) = raw(
        &nodes[1],
        M::POST,
        "/mcp",
        &h,
        Some(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})),
    )
    .await;
    assert_eq!(status, 202, "{body}");

    // The session's own kernel, used through each node in turn.
    for (i, node) in nodes.iter().enumerate() {
        let call = json!({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call", "params": {
            "name": "run_python", "arguments": {"code": format!("k = globals().get('k', 0) + 1\nprint('via', {i}, k)")}}});
        let (status, _, body) = raw(node, M::POST, "/mcp", &h, Some(call)).await;
        assert_eq!(status, 200, "{body}");
        let answer = mcp_messages(&body)
            .into_iter()
            .find(|m| m["id"] == json!(i + 1))
            .unwrap_or_else(|| panic!("no answer: {body}"));
        assert!(
            answer.to_string().contains(&format!("via {i} {}", i + 1)),
            "{answer}"
        );
    }

    // Another user's id is unknown on every node; so is one naming a node not in the cluster.
    let bob = format!("Bearer {BOB}");
    let ghost = format!("{}.{}", "Z2hvc3Q", uuid::Uuid::new_v4());
    for node in &nodes {
        let mut hb = with(&sid);
        hb[0] = ("authorization", bob.as_str());
        let ping = json!({"jsonrpc": "2.0", "id": 99, "method": "ping"});
        let (status, _, body) = raw(node, M::POST, "/mcp", &hb, Some(ping.clone())).await;
        assert_eq!(status, 404, "{body}");
        let (status, _, body) = raw(node, M::POST, "/mcp", &with(&ghost), Some(ping)).await;
        assert_eq!(status, 404, "{body}");
    }

    // Closed through the last node: unknown everywhere.
    let (status, _, body) = raw(&nodes[2], M::DELETE, "/mcp", &h, None).await;
    assert_eq!(status, 204, "{body}");
    for node in &nodes {
        let ping = json!({"jsonrpc": "2.0", "id": 100, "method": "ping"});
        let (status, _, body) = raw(node, M::POST, "/mcp", &h, Some(ping)).await;
        assert_eq!(status, 404, "{body}");
    }
}

/// A node that was paused past its lease (a stalled VM, a stopped process) comes back to
/// find itself declared lost: it ends the sessions the cluster already counts as dead
/// (their kernels must not live on beside the "dead" answer) and joins again; their
/// recordings keep the loss as their end.
#[tokio::test]
async fn a_node_paused_past_its_lease_ends_its_dead_sessions_and_rejoins() {
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    // B alone first, so that it holds the sessions made below.
    let b_node = node(&url, &["--node-lease", "2"]);
    let b = &b_node;
    let b_id = std::fs::read_to_string(b.data_dir().join("node-id")).unwrap();
    let id = b.api(ALICE).create().await;
    assert_eq!(recorded_node(&client, &id).await, b_id.trim());
    // A session paused to B's disk is not dead with B: away, then back.
    let paused = match criu_ready() {
        true => {
            let p = own_session(b).await;
            assert_eq!(recorded_node(&client, &p).await, b_id.trim());
            pause_known(b, &client, &p, "v = [1, 2, 3]; it = iter(v); next(it)").await;
            Some(p)
        }
        false => None,
    };
    let a_node = node(&url, &["--node-lease", "2"]);
    let a = &a_node;
    let x = a.api(ALICE).execute(&id, "x = 'on b'").await;
    assert_eq!(x["status"], "ok", "{x}");

    b.signal(libc::SIGSTOP);
    let s = until_dead(a, &id, "the paused node's session dead").await;
    assert!(
        s["dead_reason"].as_str().unwrap().starts_with("node lost"),
        "{s}"
    );
    if let Some(p) = &paused {
        assert_away(a, &client, p).await;
    }
    b.signal(libc::SIGCONT);

    // B learns it was lost at its next renewal: the session ends there too, and B is a
    // live node again.
    until_rejoined_with_dead(b, &id, 30).await;
    assert_ended_as_lost(b, &client, &id).await;
    // The paused session went on: it resumes, through either node, with its state.
    if let Some(p) = &paused {
        let x = a.api(ALICE).execute(p, "print(v, next(it))").await;
        assert_eq!(x["stdout"], "[1, 2, 3] 2\n", "{x}");
        assert_eq!(pg_end_reason(&client, p).await, None);
        let (status, _) = a.api(ALICE).delete(&format!("/v1/sessions/{p}")).await;
        assert_eq!(status, 204);
    }

    // B takes sessions again, and its recordings go on.
    let fresh = within(30, "a session made on B again", async {
        loop {
            let (status, s) = b.api(ALICE).post("/v1/sessions", json!({})).await;
            if status == 201 {
                let id = s["id"].as_str().unwrap().to_string();
                if recorded_node(&client, &id).await == b_id.trim() {
                    return id;
                }
                b.api(ALICE).delete(&format!("/v1/sessions/{id}")).await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await;
    let x = a.api(ALICE).execute(&fresh, "1 + 1").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "2", "{x}");
    a_node.stop().await;
    b_node.stop().await;
}

/// A session of alice's with a workspace of its own, made through `node` (placed wherever).
async fn own_session(node: &SpawnedBroker) -> String {
    let (status, v) = node
        .api(ALICE)
        .post("/v1/sessions", json!({"workspace": "own"}))
        .await;
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

/// Runs `code` in session `id` (through `node`), pauses it, and waits until the session
/// directory knows it paused (written at the node's next renewal).
async fn pause_known(node: &SpawnedBroker, client: &tokio_postgres::Client, id: &str, code: &str) {
    let x = node.api(ALICE).execute(id, code).await;
    assert_eq!(x["status"], "ok", "{x}");
    let (status, v) = node
        .api(ALICE)
        .post(&format!("/v1/sessions/{id}/pause"), json!({}))
        .await;
    assert_eq!(status, 200, "{v}");
    within(20, "the directory to know the session paused", async {
        loop {
            let row = client
                .query_opt("SELECT paused FROM cluster_sessions WHERE id = $1", &[&id])
                .await
                .unwrap();
            if row.is_some_and(|r| r.get::<_, bool>(0)) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
}

/// Session `id`, paused on a node that is not live, is away as `node` answers: `503
/// session_away` to anything, its recording still open.
async fn assert_away(node: &SpawnedBroker, client: &tokio_postgres::Client, id: &str) {
    let (status, r) = node.api(ALICE).get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (503, &json!("session_away")),
        "{r}"
    );
    let (status, r) = node
        .api(ALICE)
        .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "1"}))
        .await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (503, &json!("session_away")),
        "{r}"
    );
    let (status, _) = node.api(BOB).get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 404, "another user's session is nobody's business");
    assert_eq!(
        pg_end_reason(client, id).await,
        None,
        "its recording goes on"
    );
}

/// `kill -9` of a node holding a paused session and a running one: the running one is dead
/// as every node answers (and stays so when the node is back: lost is final); the paused
/// one, whose state is on the node's disk, is away while the node is, and resumes with its
/// state, through any node, once the node restarts in place (the deployments' case: a pod
/// rescheduled with its volume).
#[tokio::test]
async fn a_paused_session_outlives_the_loss_of_its_node() {
    if !criu_ready() {
        return;
    }
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    // The node alone first, so that it holds both sessions.
    let mut a = node(&url, &["--node-lease", "2"]);
    let p = own_session(&a).await;
    let running = a.api(ALICE).create().await;
    let x = a.api(ALICE).execute(&running, "y = 1").await;
    assert_eq!(x["status"], "ok", "{x}");
    pause_known(&a, &client, &p, "v = [1, 2, 3]; it = iter(v); next(it)").await;
    let b = node(&url, &["--node-lease", "2"]);

    a.halt(Stop::Kill).await;
    until_dead(&b, &running, "the lost node's running session dead").await;
    assert_away(&b, &client, &p).await;
    let (_, list) = b.api(ALICE).get("/v1/sessions").await;
    assert!(!list.to_string().contains(&p), "{list}");

    // The node restarts in place: the paused session is back, through either node.
    a.resume();
    let x = served(&b, &p, "print(v, next(it))", not_yet).await;
    assert_eq!(x["stdout"], "[1, 2, 3] 2\n", "{x}");
    assert_eq!(pg_end_reason(&client, &p).await, None);
    // The running session stays dead, on both nodes.
    for n in [&a, &b] {
        assert_ended_as_lost(n, &client, &running).await;
    }
    a.stop().await;
    b.stop().await;
}

/// A node's flags in the tests of `--carry-paused`: every node with the same uid base.
const CARRY: [&str; 6] = [
    "--node-lease",
    "2",
    "--carry-paused",
    "true",
    "--uid-base",
    "310000",
];

/// Waits until the copy of paused session `id` is stored in the database (after its
/// pause's answer, `--carry-paused`).
async fn until_carried(client: &tokio_postgres::Client, id: &str) {
    within(60, "the paused session's copy stored", async {
        loop {
            let row = client
                .query_opt("SELECT 1 FROM paused_copies WHERE session_id = $1", &[&id])
                .await
                .unwrap();
            if row.is_some() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
}

/// A fresh database, a node with `args` on it, and a session of alice's with a workspace
/// of its own made there, `code` run in it, paused, and its copy stored (`--carry-paused`
/// in `args`): the database's URL and a client of it, the node, the session.
async fn carried_on_a_node(
    args: &[&str],
    code: &str,
) -> (String, tokio_postgres::Client, SpawnedBroker, String) {
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    let a = node(&url, args);
    let p = own_session(&a).await;
    pause_known(&a, &client, &p, code).await;
    until_carried(&client, &p).await;
    (url, client, a, p)
}

/// The copy of session `id` and its directory row are still `node`'s, taken from no other
/// node: a takeover that failed gave its claim back.
async fn assert_claim_given_back(client: &tokio_postgres::Client, id: &str, node: &str) {
    let row = client
        .query_one(
            "SELECT s.node, c.node, s.taken_from FROM cluster_sessions s
             JOIN paused_copies c ON c.session_id = s.id WHERE s.id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, Option<String>>(2)
        ),
        (node.to_string(), node.to_string(), None),
        "the claim is given back"
    );
}

/// Runs `code` in alice's session `id` through `node` until its answer is not one `waiting`
/// says to wait past (a minute at most); that answer.
async fn served(
    node: &SpawnedBroker,
    id: &str,
    code: &str,
    waiting: impl Fn(u16, &Value) -> bool,
) -> Value {
    within(60, "the session served", async {
        loop {
            let (status, x) = node
                .api(ALICE)
                .post(&format!("/v1/sessions/{id}/execute"), json!({"code": code}))
                .await;
            if !waiting(status, &x) {
                return x;
            }
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
    })
    .await
}

/// A carried session not served yet: its node's lease has not lapsed (it is asked: `502`
/// while it does not answer; one cut off from the database refuses to resume it, in the
/// execution's error), or it is away until a node takes it over (`503`).
fn not_yet(status: u16, x: &Value) -> bool {
    matches!(status, 502 | 503) || x["error"]["ename"] == "SessionPaused"
}

/// `--carry-paused`: a session with a workspace of its own, paused on a node, is stored in
/// the database with its pause; once that node is lost, the next request through another
/// node takes it over there and resumes it with its variables, its iterator part-way and
/// its workspace's files. Another user finds nothing; the lost node, restarted, lets its
/// paused state go and forwards the session to its new node; a session sharing its user's
/// workspace is not carried (away, as without the option).
#[tokio::test]
async fn a_carried_paused_session_resumes_on_another_node_once_its_own_is_lost() {
    if !criu_ready() {
        return;
    }
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    let args = CARRY;
    let mut a = node(&url, &args);
    let p = own_session(&a).await;
    let shared = a.api(ALICE).create().await;
    pause_known(
        &a,
        &client,
        &p,
        "v = [1, 2, 3]; it = iter(v); next(it); open('notes.txt', 'w').write('written on a')",
    )
    .await;
    until_carried(&client, &p).await;
    pause_known(&a, &client, &shared, "w = 7").await;
    let a_id = recorded_node(&client, &p).await;
    let row = client
        .query_one(
            "SELECT node, bytes FROM paused_copies WHERE session_id = $1",
            &[&p],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), a_id);
    assert!(row.get::<_, i64>(1) > 1 << 20, "its images are in the copy");
    let copies: i64 = client
        .query_one("SELECT count(*) FROM paused_copies", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        copies, 1,
        "the session sharing its user's workspace is not carried"
    );
    let b = node(&url, &args);

    a.halt(Stop::Kill).await;
    // Two requests at once through b: one takes the session over, the other waits for it
    // (neither finds the session missing).
    let path = format!("/v1/sessions/{p}");
    let (one, two) = within(60, "the session taken over through b", async {
        loop {
            let (first, second) = (b.api(ALICE), b.api(ALICE));
            let (one, two) = tokio::join!(first.get(&path), second.get(&path));
            if !matches!(one.0, 502 | 503) && !matches!(two.0, 502 | 503) {
                return (one, two);
            }
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
    })
    .await;
    assert_eq!((one.0, two.0), (200, 200), "{} {}", one.1, two.1);
    let x = served(
        &b,
        &p,
        "print(v, next(it), open('notes.txt').read())",
        not_yet,
    )
    .await;
    assert_eq!(x["stdout"], "[1, 2, 3] 2 written on a\n", "{x}");
    let (status, _) = b.api(BOB).get(&format!("/v1/sessions/{p}")).await;
    assert_eq!(status, 404, "another user's session is nobody's business");
    let row = client
        .query_one(
            "SELECT node, paused FROM cluster_sessions WHERE id = $1",
            &[&p],
        )
        .await
        .unwrap();
    assert_ne!(
        row.get::<_, String>(0),
        a_id,
        "the directory says b holds it"
    );
    assert!(!row.get::<_, bool>(1));
    let copies: i64 = client
        .query_one("SELECT count(*) FROM paused_copies", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(copies, 0, "a resume drops the copy");
    assert_eq!(
        pg_end_reason(&client, &p).await,
        None,
        "its recording goes on"
    );
    assert_away(&b, &client, &shared).await;

    // a restarts on its data directory: it lets the session go, and forwards it to b.
    a.resume();
    let x = served(&a, &p, "print(next(it))", |status, _| status != 200).await;
    assert_eq!(x["stdout"], "3\n", "{x}");
    let paused_here = std::fs::read_dir(a.data_dir().join("paused-sessions"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(paused_here, 1, "a keeps only the shared session's record");
    // The shared session is a's again, with its state.
    let x = b.api(ALICE).execute(&shared, "print(w)").await;
    assert_eq!(x["stdout"], "7\n", "{x}");
    a.stop().await;
    b.stop().await;
}

/// A carried session resumed right after its pause, its copy still being stored, resumes
/// and leaves no copy behind (a copy of a running session would be taken over as stale
/// state), and its directory row says it runs.
#[tokio::test]
async fn a_carried_session_resumed_at_once_leaves_no_copy() {
    if !criu_ready() {
        return;
    }
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    // A long lease: the node writes the directory every 20 s, so the session is paused
    // before its row is there, and only the session's lock orders the store and the check.
    let mut args = CARRY;
    args[1] = "60";
    let a = node(&url, &args);
    let p = own_session(&a).await;
    let x = a
        .api(ALICE)
        .execute(
            &p,
            "import numpy as np; big = np.random.rand(12_000_000); n = 0",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    for i in 1..=3 {
        let (status, v) = a
            .api(ALICE)
            .post(&format!("/v1/sessions/{p}/pause"), json!({}))
            .await;
        assert_eq!(status, 200, "{v}");
        let x = a.api(ALICE).execute(&p, "n += 1; print(n)").await;
        assert_eq!(x["stdout"], format!("{i}\n"), "{x}");
    }
    // Whatever was being stored is given up or dropped by now.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let copies: i64 = client
        .query_one(
            "SELECT count(*) FROM paused_copies WHERE session_id = $1",
            &[&p],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(copies, 0, "no copy of a running session");
    let row = client
        .query_opt("SELECT paused FROM cluster_sessions WHERE id = $1", &[&p])
        .await
        .unwrap();
    assert!(row.is_none_or(|r| !r.get::<_, bool>(0)), "it runs");
    // Paused and left paused, it is carried.
    let (status, v) = a
        .api(ALICE)
        .post(&format!("/v1/sessions/{p}/pause"), json!({}))
        .await;
    assert_eq!(status, 200, "{v}");
    until_carried(&client, &p).await;
    a.stop().await;
}

/// A node stopped (`kill -9`) after it claimed a carried copy and before it took it in
/// (the claim made here by hand, as the node would have) takes it in at its next start:
/// the session is served there with its state.
#[tokio::test]
async fn a_claimed_copy_is_taken_in_at_the_claimers_next_start() {
    if !criu_ready() {
        return;
    }
    let args = CARRY;
    let (url, client, mut a, p) = carried_on_a_node(&args, "kept = 'from a'").await;
    a.halt(Stop::Kill).await;
    for sql in [
        "UPDATE cluster_sessions SET node = 'claimer' WHERE id = $1",
        "UPDATE paused_copies SET node = 'claimer' WHERE session_id = $1",
    ] {
        assert_eq!(client.execute(sql, &[&p]).await.unwrap(), 1, "{sql}");
    }
    let mut with_id = args.to_vec();
    with_id.extend(["--node-id", "claimer"]);
    let b = node(&url, &with_id);
    let x = b.api(ALICE).execute(&p, "print(kept)").await;
    assert_eq!(x["stdout"], "from a\n", "{x}");
    b.stop().await;
    a.resume();
    a.stop().await;
}

/// Requests through `node` for session `id` (of a node that is not live) until one is
/// answered but `502`/`503 session_away` without `wanted` in its message; that answer's
/// status and body.
async fn until_refused_with(node: &SpawnedBroker, id: &str, wanted: &str) -> (u16, Value) {
    within(40, "the takeover's refusal", async {
        loop {
            let (status, x) = node
                .api(ALICE)
                .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "1"}))
                .await;
            let message = x["error"]["message"].as_str().unwrap_or_default();
            if !(status == 502 || status == 503 && !message.contains(wanted)) {
                return (status, x);
            }
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
    })
    .await
}

/// A carried copy is taken over only as it was stored, by a node that runs its user's
/// kernels as the same uid: a node with another `--uid-base` refuses and says why, and a
/// copy altered in the database is refused with what changed, the session staying away
/// (the claim given back, nothing left on the node that tried). While it is paused, no
/// host holds its workspace mounted.
#[tokio::test]
async fn a_carried_copy_altered_in_the_database_or_for_another_uid_is_not_taken_over() {
    if !criu_ready() {
        return;
    }
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    let with_uids = |base: &'static str| {
        vec![
            "--node-lease",
            "2",
            "--carry-paused",
            "true",
            "--uid-base",
            base,
        ]
    };
    let mut a = node(&url, &with_uids("310000"));
    let p = own_session(&a).await;
    pause_known(&a, &client, &p, "kept = 42").await;
    until_carried(&client, &p).await;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&p),
        "its workspace is unmounted while paused"
    );
    let a_id = recorded_node(&client, &p).await;
    let other = node(&url, &with_uids("320000"));
    a.halt(Stop::Kill).await;
    let (status, x) = until_refused_with(&other, &p, "uid-base").await;
    assert_eq!(
        (status, &x["error"]["code"]),
        (503, &json!("session_away")),
        "{x}"
    );
    assert!(
        x["error"]["message"]
            .as_str()
            .unwrap()
            .contains("uid 310001"),
        "{x}"
    );

    // A byte of a piece changed: the piece does not open.
    let piece = "SELECT file, at, data FROM paused_chunks
                 WHERE session_id = $1 AND file LIKE 'pages-%' ORDER BY at DESC LIMIT 1";
    let kept = client.query_one(piece, &[&p]).await.unwrap();
    let (file, at, data): (String, i64, Vec<u8>) = (kept.get(0), kept.get(1), kept.get(2));
    let altered = client
        .execute(
            "UPDATE paused_chunks SET data = overlay(data placing '\\xff'::bytea from 200 for 1)
             WHERE session_id = $1 AND file = $2 AND at = $3",
            &[&p, &file, &at],
        )
        .await
        .unwrap();
    assert_eq!(altered, 1);
    let b = node(&url, &with_uids("310000"));
    let (status, x) = until_refused_with(&b, &p, "does not open").await;
    assert_eq!(
        (status, &x["error"]["code"]),
        (503, &json!("session_away")),
        "{x}"
    );
    assert_claim_given_back(&client, &p, &a_id).await;
    // The piece taken out (which would read as zeros): missed against the manifest.
    client
        .execute(
            "DELETE FROM paused_chunks WHERE session_id = $1 AND file = $2 AND at = $3",
            &[&p, &file, &at],
        )
        .await
        .unwrap();
    let (status, x) = until_refused_with(&b, &p, "and its node stored").await;
    assert_eq!(status, 503, "{x}");
    assert_claim_given_back(&client, &p, &a_id).await;
    // Put back as it was, under another offset: it does not open there either.
    client
        .execute(
            "INSERT INTO paused_chunks (session_id, file, at, data) VALUES ($1, $2, $3, $4)",
            &[&p, &file, &(at + (1 << 20)), &data],
        )
        .await
        .unwrap();
    let (status, x) = until_refused_with(&b, &p, "does not open").await;
    assert_eq!(status, 503, "{x}");
    assert_claim_given_back(&client, &p, &a_id).await;
    for dir in ["paused", "sandboxes-images"] {
        let left: Vec<_> = std::fs::read_dir(b.data_dir().join(dir))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{dir}: {left:?}");
    }
    other.stop().await;
    b.stop().await;
    a.resume();
    a.stop().await;
}

/// A snapshot is on the disk of the node that took it: through any node it is listed, read,
/// started from (the new sessions made on that node, whichever node is asked and though the
/// other has more room; E2B's `Sandbox.create` by its name too) and deleted; another user's
/// request finds nothing anywhere.
#[tokio::test]
async fn snapshots_are_served_by_the_node_that_has_them() {
    use reqwest::Method as M;
    if !criu_ready() {
        return;
    }
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    // A alone first, so that it holds the session.
    let a = node(&url, &[]);
    let a_id = std::fs::read_to_string(a.data_dir().join("node-id")).unwrap();
    let s = own_session(&a).await;
    let x = a.api(ALICE).execute(&s, "x = 41").await;
    assert_eq!(x["status"], "ok", "{x}");
    let b = node(&url, &[]);

    // Taken through B (the session's node makes it).
    let (status, snap) = b
        .api(ALICE)
        .post(
            &format!("/v1/sessions/{s}/snapshots"),
            json!({"name": "after-x"}),
        )
        .await;
    assert_eq!(status, 201, "{snap}");
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    for n in [&a, &b] {
        let (status, list) = n.api(ALICE).get("/v1/snapshots").await;
        assert_eq!(status, 200, "{list}");
        let ids: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["snapshot_id"].as_str())
            .collect();
        assert_eq!(ids, [sid.as_str()], "listed once, through either node");
        let (status, one) = n.api(ALICE).get(&format!("/v1/snapshots/{sid}")).await;
        assert_eq!((status, &one["name"]), (200, &json!("after-x")), "{one}");
        let (status, _) = n.api(BOB).get(&format!("/v1/snapshots/{sid}")).await;
        assert_eq!(status, 404, "another user's snapshot is nobody's business");
        let (_, list) = n.api(BOB).get("/v1/snapshots").await;
        assert_eq!(list, json!([]));
    }

    // Started from through B, which has more room: made on A, with the snapshot's state.
    let (status, v) = b
        .api(ALICE)
        .post("/v1/sessions", json!({"snapshot": sid}))
        .await;
    assert_eq!(status, 201, "{v}");
    let from = v["id"].as_str().unwrap().to_string();
    assert_eq!(recorded_node(&client, &from).await, a_id.trim());
    let x = b.api(ALICE).execute(&from, "x + 1").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "42", "{x}");
    // Another user cannot start from it, through any node.
    let (status, v) = b
        .api(BOB)
        .post("/v1/sessions", json!({"snapshot": sid}))
        .await;
    assert_eq!(status, 404, "{v}");
    // The routing reads a new session's body for its snapshot: a body too large for it, or
    // not JSON, is refused clearly and makes nothing.
    let auth = format!("Bearer {ALICE}");
    let alice = [("authorization", auth.as_str())];
    let huge = json!({"snapshot": sid, "metadata": {"pad": "x".repeat(2 << 20)}});
    let (status, _, body) = raw(&b, M::POST, "/v1/sessions", &alice, Some(huge)).await;
    assert_eq!(status, 413, "{body}");
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/sessions", b.addr))
        .header("authorization", &auth)
        .header("content-type", "application/json")
        .body("{\"snapshot\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let (_, list) = b.api(ALICE).get("/v1/sessions").await;
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    // E2B's `Sandbox.create("after-x")`, through B: on A too.
    let (status, _, created) = raw(
        &b,
        M::POST,
        "/e2b/v2/sandboxes",
        &[("x-api-key", ALICE)],
        Some(json!({"templateID": "after-x"})),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let created: Value = serde_json::from_str(&created).unwrap();
    let sandbox = created["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(recorded_node(&client, &sandbox).await, a_id.trim());
    let (status, _, list) = raw(&b, M::GET, "/e2b/snapshots", &[("x-api-key", ALICE)], None).await;
    assert_eq!(status, 200, "{list}");
    assert!(list.contains(&sid), "{list}");

    // Deleted through B, by E2B's name for it (not by bob): gone everywhere.
    for (key, want) in [(BOB, 404), (ALICE, 204)] {
        let (status, _, body) = raw(
            &b,
            M::DELETE,
            "/e2b/templates/after-x",
            &[("x-api-key", key)],
            None,
        )
        .await;
        assert_eq!(status, want, "{key}: {body}");
    }
    for n in [&a, &b] {
        let (status, _) = n.api(ALICE).get(&format!("/v1/snapshots/{sid}")).await;
        assert_eq!(status, 404);
    }
    a.stop().await;
    b.stop().await;
}

/// A TCP relay to PostgreSQL that can be cut (every connection through it broken, new ones
/// refused) and restored: a node's network partition from the database.
struct Cuttable {
    url: String,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Cuttable {
    /// A relay to the server of database `url`; `self.url` names the same database
    /// through it.
    async fn new(url: &str) -> Self {
        let (head, rest) = url.rsplit_once('@').unwrap();
        let (server, db) = rest.split_once('/').unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let me = Self {
            url: format!("{head}@{}/{db}", listener.local_addr().unwrap()),
            cut: Default::default(),
            conns: Default::default(),
        };
        let (cut, conns, server) = (me.cut.clone(), me.conns.clone(), server.to_string());
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if cut.load(std::sync::atomic::Ordering::SeqCst) {
                    continue;
                }
                let server = server.clone();
                conns.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(&server).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                    }
                }));
            }
        });
        me
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A node cut off from the database stops serving its sessions once its lease is past (503
/// `node_isolated`, `/healthz` 503 `isolated`: a load balancer looks elsewhere) while the
/// others declare it lost; when it reaches the database again it learns it was lost, ends
/// those sessions and joins again. No node ever serves a session the cluster counts as dead.
// Multi-threaded: the relay must run while the test thread waits for a node to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_the_database_stops_serving_then_rejoins() {
    let (nodes, url) = cluster_on(1, &["--node-lease", "2"]).await;
    let a = &nodes[0];
    let relay = Cuttable::new(&url).await;
    let b = node(&relay.url, &["--node-lease", "2"]);
    let b_id = std::fs::read_to_string(b.data_dir().join("node-id")).unwrap();
    let client = connect(&url).await;
    let id = b.api(ALICE).create().await;
    assert_eq!(recorded_node(&client, &id).await, b_id.trim());
    let x = a.api(ALICE).execute(&id, "x = 'on b'").await;
    assert_eq!(x["status"], "ok", "{x}");

    relay.cut();
    within(30, "the cut-off node to stop serving", async {
        loop {
            let (hs, h) = b.api(ALICE).get("/healthz").await;
            if hs == 503 && h["status"] == "isolated" {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await;
    let (status, r) = b
        .api(ALICE)
        .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "x"}))
        .await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (503, &json!("node_isolated")),
        "{r}"
    );
    let (status, r) = b.api(ALICE).post("/v1/sessions", json!({})).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (503, &json!("node_isolated")),
        "{r}"
    );
    until_dead(a, &id, "the cut-off node's session dead on the other").await;

    relay.restore();
    until_rejoined_with_dead(&b, &id, 60).await;
    assert_ended_as_lost(&b, &client, &id).await;
    // Both serve again: a new session through B, used through A.
    let fresh = b.api(ALICE).create().await;
    let x = a.api(ALICE).execute(&fresh, "1 + 1").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "2", "{x}");
    b.stop().await;
    for n in nodes {
        n.stop().await;
    }
}

/// `--carry-paused`: a node cut off from the database while its carried paused session is
/// taken over by another does not resume it when it reaches the database again (its
/// resume would check first); it learns the session is the other's, lets its paused state
/// go without ending it, and forwards it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_while_its_carried_session_is_taken_over_lets_it_go_when_back() {
    if !criu_ready() {
        return;
    }
    let url = pg::fresh_database().await;
    let client = connect(&url).await;
    let relay = Cuttable::new(&url).await;
    let args = CARRY;
    // b alone first, so that it holds the session.
    let b = node(&relay.url, &args);
    let p = own_session(&b).await;
    pause_known(&b, &client, &p, "v = [1, 2, 3]; it = iter(v); next(it)").await;
    until_carried(&client, &p).await;
    let a = node(&url, &args);

    relay.cut();
    let x = served(&a, &p, "print(v, next(it))", not_yet).await;
    assert_eq!(x["stdout"], "[1, 2, 3] 2\n", "{x}");

    relay.restore();
    let x = served(&b, &p, "print(next(it))", |status, _| status != 200).await;
    assert_eq!(x["stdout"], "3\n", "{x}");
    let left = std::fs::read_dir(b.data_dir().join("paused-sessions"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(left, 0, "b let its paused state go");
    assert_eq!(
        pg_end_reason(&client, &p).await,
        None,
        "the session goes on"
    );
    b.stop().await;
    a.stop().await;
}

/// The session directory in PostgreSQL: each node lists the sessions it holds (and takes
/// off the ones that ended) at every renewal; the sessions of a lost node are marked so,
/// and answered dead from it even with recording off (no recording to tell).
#[tokio::test]
async fn the_session_directory_knows_each_sessions_node_and_its_loss() {
    let (mut nodes, url) = cluster_on(2, &["--node-lease", "2", "--record", "false"]).await;
    let client = connect(&url).await;
    let ids: Vec<String> = (0..2)
        .map(|i| std::fs::read_to_string(nodes[i].data_dir().join("node-id")).unwrap())
        .map(|s| s.trim().to_string())
        .collect();
    let on_a = nodes[0].api(ALICE).create().await;
    let on_b = nodes[1].api(ALICE).create().await;
    let gone = nodes[1].api(ALICE).create().await;
    let listed = |id: String| {
        let client = &client;
        async move {
            client
                .query_opt(
                    "SELECT node, user_name, lost_at FROM cluster_sessions WHERE id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .map(|r| {
                    (
                        r.get::<_, String>(0),
                        r.get::<_, String>(1),
                        r.get::<_, Option<i64>>(2),
                    )
                })
        }
    };
    within(30, "the directory to list the sessions", async {
        loop {
            let (a, b, g) = (
                listed(on_a.clone()).await,
                listed(on_b.clone()).await,
                listed(gone.clone()).await,
            );
            if let (Some(a), Some(b), Some(_)) = (a, b, g) {
                assert_eq!(a, (ids[0].clone(), "alice".to_string(), None));
                assert_eq!(b, (ids[1].clone(), "alice".to_string(), None));
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    // Deleted: off the directory at the next renewal.
    let (status, _) = nodes[0]
        .api(ALICE)
        .delete(&format!("/v1/sessions/{gone}"))
        .await;
    assert_eq!(status, 204);
    within(30, "the deleted session off the directory", async {
        while listed(gone.clone()).await.is_some() {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    // Served through the other node as found in the directory.
    let x = nodes[0].api(ALICE).execute(&on_b, "y = 2").await;
    assert_eq!(x["status"], "ok", "{x}");

    nodes[1].halt(Stop::Kill).await;
    let s = until_dead(
        &nodes[0],
        &on_b,
        "the lost node's session dead, with no recording",
    )
    .await;
    assert!(
        s["dead_reason"].as_str().unwrap().starts_with("node lost"),
        "{s}"
    );
    assert_eq!(s["kernel"], "python3", "{s}");
    assert!(listed(on_b.clone()).await.unwrap().2.is_some());
    let (status, r) = nodes[0]
        .api(ALICE)
        .post(
            &format!("/v1/sessions/{on_b}/execute"),
            json!({"code": "y"}),
        )
        .await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (410, &json!("node_lost")),
        "{r}"
    );
    let (status, _) = nodes[0].api(BOB).get(&format!("/v1/sessions/{on_b}")).await;
    assert_eq!(status, 404, "not bob's");
    // The survivor's own session goes on.
    let x = nodes[0].api(ALICE).execute(&on_a, "1 + 1").await;
    assert_eq!(x["results"][0]["data"]["text/plain"], "2", "{x}");
    // The lost node restarts in place: its lost sessions stay lost.
    nodes[1].resume();
    let (status, s) = nodes[1]
        .api(ALICE)
        .get(&format!("/v1/sessions/{on_b}"))
        .await;
    assert_eq!((status, &s["state"]), (200, &json!("dead")), "{s}");
    for n in nodes {
        n.stop().await;
    }
}

/// [`CARRY`] on nodes without workspace quotas (the container deployments': an own
/// workspace is a plain directory there).
fn carry_plain() -> Vec<&'static str> {
    let mut args = CARRY.to_vec();
    args.extend(["--workspace-quota", "0"]);
    args
}

/// Re-makes session `id`'s copy in the database as one who holds the cluster's key (read
/// from the database, which keeps it) could: its head opened, file `name` given `data` as
/// its one piece (and that length), the head sealed anew and every piece and the manifest
/// sealed again for it, as `api/cluster/carry.rs` seals them.
async fn forge_copy(client: &tokio_postgres::Client, id: &str, name: &str, data: &[u8]) {
    use chacha20poly1305::aead::{Aead, KeyInit, Payload};
    use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
    use sha2::Digest;
    let key: String = client
        .query_one("SELECT key FROM cluster_key WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    let mut derived = sha2::Sha256::new();
    derived.update(b"kernel-broker: paused sessions' copies\0");
    derived.update(key.as_bytes());
    let cipher = ChaCha20Poly1305::new(Key::from_slice(&derived.finalize()));
    let seal = |aad: &[u8], msg: &[u8]| {
        let nonce: [u8; 12] = rand::random();
        let mut out = nonce.to_vec();
        out.extend(
            cipher
                .encrypt(Nonce::from_slice(&nonce), Payload { msg, aad })
                .unwrap(),
        );
        out
    };
    let open = |aad: &[u8], sealed: &[u8]| {
        let (nonce, msg) = sealed.split_at(12);
        cipher
            .decrypt(Nonce::from_slice(nonce), Payload { msg, aad })
            .unwrap()
    };
    let uuid = uuid::Uuid::parse_str(id).unwrap();
    let head_aad = [&b"kernel-broker copy head\0"[..], uuid.as_bytes()].concat();
    let binding = |head: &[u8]| {
        let digest = sha2::Sha256::digest(head);
        [
            &b"kernel-broker copy piece\0"[..],
            uuid.as_bytes(),
            &digest[..16],
        ]
        .concat()
    };
    let piece_aad = |binding: &[u8], file: &str, at: u64| {
        [binding, file.as_bytes(), &[0], &at.to_be_bytes()].concat()
    };
    let old: Vec<u8> = client
        .query_one(
            "SELECT head FROM paused_copies WHERE session_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    let mut head: Value = serde_json::from_slice(&open(&head_aad, &old)).unwrap();
    for f in head["files"].as_array_mut().unwrap() {
        if f[0] == name {
            f[1] = json!(data.len());
        }
    }
    let new = seal(&head_aad, &serde_json::to_vec(&head).unwrap());
    let (old_binding, new_binding) = (binding(&old), binding(&new));
    let rows = client
        .query(
            "SELECT file, at, data FROM paused_chunks WHERE session_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let mut pieces: Vec<(String, u64, Vec<u8>)> = vec![(name.to_string(), 0, data.to_vec())];
    let mut manifest = serde_json::Map::new();
    for r in &rows {
        let (file, at, sealed): (String, i64, Vec<u8>) = (r.get(0), r.get(1), r.get(2));
        let plain = open(&piece_aad(&old_binding, &file, at as u64), &sealed);
        if file.is_empty() {
            manifest = serde_json::from_slice(&plain).unwrap();
        } else if file != name {
            pieces.push((file, at as u64, plain));
        }
    }
    for file in manifest.keys().cloned().collect::<Vec<_>>() {
        let count = pieces.iter().filter(|p| p.0 == file).count();
        manifest.insert(file, json!(count));
    }
    pieces.push((String::new(), 0, serde_json::to_vec(&manifest).unwrap()));
    client
        .execute("DELETE FROM paused_chunks WHERE session_id = $1", &[&id])
        .await
        .unwrap();
    for (file, at, plain) in pieces {
        let sealed = seal(&piece_aad(&new_binding, &file, at), &plain);
        client
            .execute(
                "INSERT INTO paused_chunks (session_id, file, at, data) VALUES ($1, $2, $3, $4)",
                &[&id, &file, &(at as i64), &sealed],
            )
            .await
            .unwrap();
    }
    client
        .execute(
            "UPDATE paused_copies SET head = $2 WHERE session_id = $1",
            &[&id, &new],
        )
        .await
        .unwrap();
}

/// `--carry-paused` where own workspaces are plain directories (no quota, as in the
/// shipped container deployments): the workspace travels as an archive made with the
/// kernel's rights, and the session taken over on another node has its files as they
/// were: contents, a subdirectory, a hidden file, modes, a symlink kept as a symlink (to
/// the host's `/etc/shadow`: never followed), its `/tmp`, and a file the kernel held open
/// at its offset. A node keeping own workspaces otherwise (a quota) refuses it and says
/// why.
#[tokio::test]
async fn a_carried_session_whose_workspace_is_a_plain_directory_keeps_its_files() {
    if !criu_ready() {
        return;
    }
    let args = carry_plain();
    let setup = "import os\n\
        os.makedirs('sub/deeper')\n\
        open('sub/deeper/data.csv', 'w').write('a,b\\n1,2\\n')\n\
        open('.hidden', 'w').write('h')\n\
        open('private.txt', 'w').write('p'); os.chmod('private.txt', 0o600)\n\
        os.symlink('/etc/shadow', 'shadow')\n\
        open('/tmp/scratch.txt', 'w').write('in tmp')\n\
        open('notes.txt', 'w').write('line one\\nline two\\n')\n\
        held = open('notes.txt'); held.readline()\n\
        open('marked.txt', 'w').write('kb-file-' + 'marker')\n\
        marker = 'kb-memory-' + 'marker'\n\
        kept = 42";
    let (url, client, mut a, p) = carried_on_a_node(&args, setup).await;
    // Sealed: the database holds none of its memory or files in the clear.
    for marker in ["kb-memory-marker", "kb-file-marker"] {
        let found: i64 = client
            .query_one(
                "SELECT count(*) FROM paused_chunks WHERE session_id = $1
                 AND position($2::bytea in data) > 0",
                &[&p, &marker.as_bytes()],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(found, 0, "{marker} is in the database in the clear");
    }
    let files: Vec<String> = client
        .query(
            "SELECT DISTINCT file FROM paused_chunks WHERE session_id = $1",
            &[&p],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(files.iter().any(|f| f == "workspace.tar"), "{files:?}");
    assert!(!files.iter().any(|f| f == "workspace"), "{files:?}");

    // A node with workspace quotas keeps own workspaces as images: it refuses, and says so.
    let quota = node(&url, &CARRY);
    a.halt(Stop::Kill).await;
    let (status, x) = until_refused_with(&quota, &p, "--workspace-quota").await;
    assert_eq!(
        (status, &x["error"]["code"]),
        (503, &json!("session_away")),
        "{x}"
    );
    quota.stop().await;

    let b = node(&url, &args);
    let check = "import os, stat\n\
        print(kept, held.readline().strip(), open('sub/deeper/data.csv').read().split()[1])\n\
        print(open('.hidden').read(), oct(stat.S_IMODE(os.stat('private.txt').st_mode)))\n\
        print(os.path.islink('shadow'), os.readlink('shadow'), open('/tmp/scratch.txt').read())";
    let x = served(&b, &p, check, not_yet).await;
    assert_eq!(
        x["stdout"], "42 line two 1,2\nh 0o600\nTrue /etc/shadow in tmp\n",
        "{x}"
    );
    b.stop().await;
    a.resume();
    a.stop().await;
}

/// A carried workspace's archive is unpacked with the kernel's rights into the session's
/// own directories only: an archive altered in the database to write outside them (a
/// `..` name, an absolute one, a write through a symlink to `/`, a member beside `home`
/// and `tmp`) writes nothing anywhere else, the takeover is refused saying why, the claim
/// is given back and the node that tried keeps nothing of it.
#[tokio::test]
async fn a_carried_workspace_archive_writes_only_into_its_own_directories() {
    if !criu_ready() {
        return;
    }
    let args = carry_plain();
    let (url, client, mut a, p) = carried_on_a_node(&args, "kept = 1").await;
    let a_id = recorded_node(&client, &p).await;
    a.halt(Stop::Kill).await;

    // The archive replaced by one made to escape, its length in the copy's head to match.
    let mark = format!("kb-escape-{}", uuid::Uuid::new_v4().simple());
    let script = format!(
        "import io, sys, tarfile\n\
         b = io.BytesIO(); t = tarfile.open(fileobj=b, mode='w')\n\
         def add(name, data=b'x', link=None, dir=False):\n\
         \x20   i = tarfile.TarInfo(name)\n\
         \x20   if link: i.type = tarfile.SYMTYPE; i.linkname = link; t.addfile(i)\n\
         \x20   elif dir: i.type = tarfile.DIRTYPE; i.mode = 0o700; t.addfile(i)\n\
         \x20   else: i.size = len(data); t.addfile(i, io.BytesIO(data))\n\
         add('home', dir=True); add('home/kept.txt', b'fine')\n\
         add('home/../../{mark}-dotdot'); add('/tmp/{mark}-absolute')\n\
         add('home/up', link='/'); add('home/up/tmp/{mark}-through')\n\
         add('other/{mark}-beside')\n\
         t.close(); sys.stdout.buffer.write(b.getvalue())"
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let archive = out.stdout;
    // Made as one holding the cluster's key could: the copy opens, and tar is what stands.
    forge_copy(&client, &p, "workspace.tar", &archive).await;

    let b = node(&url, &args);
    let (status, x) = until_refused_with(&b, &p, "unpacked").await;
    assert_eq!(
        (status, &x["error"]["code"]),
        (503, &json!("session_away")),
        "{x}"
    );
    let message = x["error"]["message"].as_str().unwrap();
    assert!(message.contains("contains '..'"), "tar's own refusal: {x}");
    assert_claim_given_back(&client, &p, &a_id).await;
    // Nothing of it anywhere: not in the host's / or /tmp, not in either node's data
    // directory.
    let found = std::process::Command::new("find")
        .arg("/tmp")
        .args([a.data_dir(), b.data_dir()])
        .args(["-name", &format!("{mark}*"), "-print"])
        .output()
        .unwrap();
    let found = String::from_utf8_lossy(&found.stdout);
    assert!(found.trim().is_empty(), "{found}");
    for name in ["dotdot", "absolute", "through", "beside"] {
        let path = std::path::Path::new("/").join(format!("{mark}-{name}"));
        assert!(!path.exists(), "{}", path.display());
    }
    for dir in ["paused", "sandboxes"] {
        let left: Vec<_> = std::fs::read_dir(b.data_dir().join(dir))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{dir}: {left:?}");
    }
    b.stop().await;
    a.resume();
    a.stop().await;
}

/// A paused session whose copy is not in the database when its node starts (the store cut
/// short by the node's stop, or the session paused before `--carry-paused`) is carried at
/// that start, so that another node can still take it over once this one is gone.
#[tokio::test]
async fn a_copy_cut_short_by_its_nodes_stop_is_made_at_its_next_start() {
    if !criu_ready() {
        return;
    }
    let args = carry_plain();
    let (url, client, mut a, p) = carried_on_a_node(
        &args,
        "kept = 'made again'; open('f.txt', 'w').write('file')",
    )
    .await;
    a.halt(Stop::Kill).await;
    let gone = client
        .execute("DELETE FROM paused_copies WHERE session_id = $1", &[&p])
        .await
        .unwrap();
    assert_eq!(gone, 1, "the copy, as if its store had been cut short");
    a.resume();
    until_carried(&client, &p).await;
    a.halt(Stop::Kill).await;
    let b = node(&url, &args);
    let x = served(&b, &p, "print(kept, open('f.txt').read())", not_yet).await;
    assert_eq!(x["stdout"], "made again file\n", "{x}");
    b.stop().await;
    a.resume();
    a.stop().await;
}

/// `args` as `&str`s.
fn borrowed(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `--carry-key-file`: copies sealed with a key kept out of the database are taken over
/// only by a node with the same key; a node with another key (or the database's own, as
/// one who reads the database could derive) refuses the copy and says so, and gives its
/// claim back.
#[tokio::test]
async fn a_copy_sealed_with_a_key_file_opens_only_with_that_key() {
    if !criu_ready() {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let key_file = |name: &str, key: &str| {
        let path = keys.path().join(name);
        std::fs::write(&path, key).unwrap();
        path.to_str().unwrap().to_string()
    };
    let (ours, theirs) = (
        key_file("ours", &"a1".repeat(32)),
        key_file("theirs", &"b2".repeat(32)),
    );
    let with_key = |key: &str| {
        let mut args: Vec<String> = CARRY.iter().map(|a| a.to_string()).collect();
        args.extend(["--carry-key-file".to_string(), key.to_string()]);
        args
    };
    let (a_args, b_args, c_args) = (with_key(&ours), with_key(&ours), with_key(&theirs));
    let (url, client, mut a, p) =
        carried_on_a_node(&borrowed(&a_args), "kept = 'sealed with ours'").await;
    let a_id = recorded_node(&client, &p).await;
    a.halt(Stop::Kill).await;
    for refusing in [node(&url, &borrowed(&c_args)), node(&url, &CARRY)] {
        let (status, x) = until_refused_with(&refusing, &p, "does not open").await;
        assert_eq!(status, 503, "{x}");
        assert_claim_given_back(&client, &p, &a_id).await;
        refusing.stop().await;
    }
    let b = node(&url, &borrowed(&b_args));
    let x = served(&b, &p, "print(kept)", not_yet).await;
    assert_eq!(x["stdout"], "sealed with ours\n", "{x}");
    b.stop().await;
    a.resume();
    a.stop().await;
}
