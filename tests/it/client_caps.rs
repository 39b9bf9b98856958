//! Hostile clients that have a token (issue 18): a user's WebSockets and requests in
//! progress are capped across all their sessions; an address that keeps failing to
//! authenticate is throttled; a client that never reads its WebSocket costs bounded broker
//! memory while everyone else carries on. Runs against a real broker with real kernels.

use crate::common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::spawned::SpawnedBroker;
use common::*;
use futures::SinkExt;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message as WsMessage;

const OTHER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// A WebSocket upgrade that must be refused with 429 `code`, its message containing `says`.
async fn refused_upgrade(url: String, code: &str, says: &str) {
    match tokio_tungstenite::connect_async(url.as_str()).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
            assert_eq!(r.status().as_u16(), 429, "{url}");
            let body = String::from_utf8_lossy(r.body().as_deref().unwrap_or_default());
            assert!(body.contains(code), "{body}");
            assert!(body.contains(says), "{body}");
        }
        other => panic!("{url}: expected a 429, got {:?}", other.map(|_| ())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn websockets_per_user_are_capped_across_sessions() {
    let broker = Broker::start("local", |a| {
        a.max_websockets_per_user = Some(3);
        a.max_websockets_per_session = Some(10);
    })
    .await;
    let alice = broker.api(ALICE);
    let a1 = alice.create().await;
    let a2 = alice.create().await;
    let mut first = ws_connect(&broker, &a1, ALICE).await;
    let _second = ws_connect(&broker, &a1, ALICE).await;
    let third = ws_connect(&broker, &a2, ALICE).await;

    // A fourth, on either session, agent stream or Jupyter channels: 429.
    let addr = broker.addr;
    refused_upgrade(
        format!("ws://{addr}/v1/sessions/{a2}/stream?token={ALICE}"),
        "too_many_websockets",
        "user alice already has 3",
    )
    .await;
    refused_upgrade(
        format!("ws://{addr}/api/kernels/{a1}/channels?token={ALICE}"),
        "too_many_websockets",
        "user alice already has 3",
    )
    .await;

    // Bob is not affected.
    let bob = broker.api(BOB);
    let b = bob.create().await;
    let mut bobs = ws_connect(&broker, &b, BOB).await;
    assert_eq!(ws_next(&mut bobs).await["type"], "status");

    // A closed WebSocket frees its place.
    drop(third);
    let mut again = ws_connect_when_free(&format!(
        "ws://{addr}/v1/sessions/{a2}/stream?token={ALICE}"
    ))
    .await;
    assert_eq!(ws_next(&mut again).await["type"], "status");

    // The open ones work.
    ws_send(
        &mut first,
        json!({"type": "execute", "id": "a", "code": "6 * 7"}),
    )
    .await;
    let frames = ws_until_done(&mut first, "a").await;
    assert_eq!(frames.last().unwrap()["execution"]["status"], "ok");
    let base = broker.url("");
    let refused = metric(
        &base,
        "kernel_broker_requests_refused_total{reason=\"websockets_per_user\"} ",
    )
    .await;
    assert!(refused >= 2.0, "{refused}");
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_in_progress_per_user_are_capped() {
    let broker = Broker::start("local", |a| a.max_requests_per_user = Some(2)).await;
    let alice = broker.api(ALICE);
    let id = alice.create().await;

    // Two slow executions in progress (the second waits in the session's queue). The poll
    // below is alice's too: one that is in flight when a slow execution arrives takes the
    // second place, and that execution is refused; it is sent again until it is in.
    let slow = |n: u64| {
        let url = broker.url(&format!("/v1/sessions/{id}/execute"));
        tokio::spawn(async move {
            let code = format!("import time; time.sleep(3); {n}");
            loop {
                let r = reqwest::Client::new()
                    .post(&url)
                    .bearer_auth(ALICE)
                    .json(&json!({ "code": code }))
                    .send()
                    .await
                    .unwrap();
                if r.status() != 429 {
                    assert_eq!(r.status(), 200);
                    return r.json::<Value>().await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let running = [slow(1), slow(2)];
    // Until both are in: the third is refused.
    let url = broker.url("/v1/sessions");
    let refused = within(10, "the cap to apply", async {
        loop {
            let r = reqwest::Client::new()
                .get(&url)
                .bearer_auth(ALICE)
                .send()
                .await
                .unwrap();
            if r.status() == 429 {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(refused.headers().contains_key("retry-after"));
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_requests", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("alice already has 2 requests in progress"),
        "{body}"
    );
    // Other users and requests without a token are not affected.
    let (status, _) = broker.api(BOB).get("/v1/sessions").await;
    assert_eq!(status, 200);
    let health = reqwest::get(broker.url("/healthz")).await.unwrap();
    assert_eq!(health.status(), 200);

    for r in running {
        let v = r.await.unwrap();
        assert_eq!(v["status"], "ok", "{v}");
    }
    // Places are given back when the responses are sent.
    let (status, _) = alice.get("/v1/sessions").await;
    assert_eq!(status, 200);
    let n = metric(
        &broker.url(""),
        "kernel_broker_requests_refused_total{reason=\"requests_per_user\"} ",
    )
    .await;
    assert!(n >= 1.0, "{n}");
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_address_that_keeps_failing_to_authenticate_is_throttled() {
    let broker = Broker::start("local", |a| a.max_auth_failures = Some(3)).await;
    let from_other = reqwest::Client::builder()
        .local_address(OTHER)
        .build()
        .unwrap();
    // Three bad tokens, on the agent and the Jupyter API: 401 each.
    for path in ["/v1/sessions", "/api/kernels", "/v1/sessions"] {
        let r = from_other
            .get(broker.url(path))
            .bearer_auth("not-a-token")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{path}");
    }
    // Now even a good token from that address is refused, without being checked.
    let r = from_other
        .get(broker.url("/v1/sessions"))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let wait: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=61).contains(&wait), "{wait}");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_auth_failures", "{body}");
    // Requests without a token still get through, and other addresses are not affected.
    let r = from_other.get(broker.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (status, _) = broker.api(ALICE).get("/v1/sessions").await;
    assert_eq!(status, 200);

    let base = broker.url("");
    assert_eq!(
        metric(&base, "kernel_broker_auth_failures_total ").await,
        3.0
    );
    assert_eq!(
        metric(
            &base,
            "kernel_broker_requests_refused_total{reason=\"auth_failures\"} "
        )
        .await,
        1.0
    );
    broker.stop().await;
}

/// Each execution displays 4 × 2 MB of HTML: its `done` frame is 8 MB.
const BIG_OUTPUT: &str =
    "from IPython.display import HTML, display\nfor _ in range(4): display(HTML('x' * 2_000_000))";
const EXECUTIONS: usize = 40;

/// A client that sends 40 executions of 8 MB of results each (320 MB, twice that with the
/// `done` frames) on its agent stream and reads nothing. The broker holds a bounded part of
/// that (a few executions in the session, a few MB of frames): measured ~115 MB whether 20
/// or 40 executions are sent; another user's
/// session works meanwhile; and when the client reads at last, every `done` is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_websocket_client_that_does_not_read_costs_bounded_memory() {
    // No pings: a client that reads nothing cannot answer them, and this test is about memory.
    let broker = SpawnedBroker::start(&["--websocket-ping-interval", "0"], None);
    let alice = broker.api(ALICE);
    let id = alice.create().await;
    let url = format!("ws://{}/v1/sessions/{id}/stream?token={ALICE}", broker.addr);
    let (mut slow, _) = within(30, "ws connect", tokio_tungstenite::connect_async(url))
        .await
        .unwrap();
    // Warm the kernel's imports so the baseline includes them.
    assert_eq!(
        alice.execute(&id, "from IPython.display import HTML").await["status"],
        "ok"
    );
    let before = broker.rss_bytes();
    for i in 0..EXECUTIONS {
        slow.send(WsMessage::Text(
            json!({"type": "execute", "id": i, "code": BIG_OUTPUT})
                .to_string()
                .into(),
        ))
        .await
        .unwrap();
    }

    // Until the broker has done what it will without the client reading: the session idle
    // for two seconds in a row (or two minutes have passed).
    let started = Instant::now();
    let mut idle_since: Option<Instant> = None;
    let mut peak = before;
    while started.elapsed() < Duration::from_secs(120) {
        peak = peak.max(broker.rss_bytes());
        let (_, s) = alice.get(&format!("/v1/sessions/{id}")).await;
        if s["state"] == "idle" {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= Duration::from_secs(2) {
                break;
            }
        } else {
            idle_since = None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let grown = peak.saturating_sub(before);
    eprintln!("broker memory grew by {} MB", grown >> 20);
    assert!(
        grown < 200 << 20,
        "the broker grew by {} MB for a client that does not read",
        grown >> 20
    );

    // Another user's session is served meanwhile.
    let bob = broker.api(BOB);
    let b = bob.create().await;
    assert_eq!(bob.execute(&b, "1 + 1").await["status"], "ok");

    // Reading at last, the client gets every execution's `done`, in order.
    use futures::StreamExt;
    let mut done = 0;
    within(300, "every done frame", async {
        while done < EXECUTIONS {
            let m = slow.next().await.expect("ws closed").unwrap();
            if let WsMessage::Text(t) = m {
                let f: Value = serde_json::from_str(t.as_str()).unwrap();
                if f["type"] == "done" {
                    assert_eq!(f["id"], done, "{}", f["id"]);
                    assert_eq!(f["execution"]["status"], "ok");
                    done += 1;
                }
            }
        }
    })
    .await;
    drop(slow);
    broker.stop().await;
}
