//! Hostile clients (issue 18): connections that send nothing or half a request are closed
//! within the header timeout and leave the broker working; the connection caps refuse new
//! connections while existing sessions carry on; a stalled body gets a 408; a WebSocket
//! client that stops answering pings is dropped. Runs against a real broker.

use crate::common;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use common::spawned::SpawnedBroker;
use common::*;
use futures::StreamExt;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::Message as WsMessage;

/// A TCP connection to the broker from `from` (any 127.0.0.0/8 address works on loopback).
async fn connect_from(addr: SocketAddr, from: IpAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    within(10, "connect", socket.connect(addr)).await.unwrap()
}

/// Reads until the broker closes `tcp`; what it sent. Fails after `secs`.
async fn read_until_closed(tcp: &mut TcpStream, secs: u64) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    within(secs, "the broker to close the connection", async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&got).into_owned()
}

/// A GET over a fresh connection from `from`: the response, or `None` when the broker closed
/// the connection without one (a refused connection).
async fn raw_get(broker: &Broker, from: IpAddr, path: &str) -> Option<String> {
    let mut tcp = connect_from(broker.addr, from).await;
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    // A refused connection may be closed before the request is written.
    let _ = tcp.write_all(request.as_bytes()).await;
    let text = read_until_closed(&mut tcp, 10).await;
    (!text.is_empty()).then_some(text)
}

const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1));

/// The flood: a session made first (`x = 41`); then `n` connections to `addr` from
/// 127.0.0.1 (`api` may connect from elsewhere), half sending half a request line, half nothing (every write must succeed when
/// `all_admitted`). Meanwhile `/healthz`, a new session and the existing one must work, and
/// every flood connection must be closed within `closed_within` of the flood. Returns the
/// existing session and when the flood was complete.
async fn flood_while_working(
    api: &Api,
    addr: SocketAddr,
    n: usize,
    all_admitted: bool,
    closed_within: Duration,
) -> (String, Instant) {
    let existing = api.create().await;
    assert_eq!(api.execute(&existing, "x = 41").await["status"], "ok");
    let mut flood = Vec::new();
    for i in 0..n {
        let mut tcp = connect_from(addr, LOCAL).await;
        if i % 2 == 0 {
            let written = tcp.write_all(b"GET /healthz HT").await;
            if all_admitted {
                written.unwrap();
            }
        }
        flood.push(tcp);
    }
    let flooded_at = Instant::now();

    // The broker answers meanwhile: health, a new session, the existing session.
    let (status, _) = api.get("/healthz").await;
    assert_eq!(status, 200);
    let fresh = api.create().await;
    assert_eq!(api.execute(&fresh, "1 + 1").await["status"], "ok");
    let v = api.execute(&existing, "x + 1").await;
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["results"][0]["data"]["text/plain"], "42", "{v}");

    for mut tcp in flood {
        let left = closed_within.saturating_sub(flooded_at.elapsed());
        read_until_closed(&mut tcp, left.as_secs().max(1)).await;
    }
    (existing, flooded_at)
}
const OTHER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_half_requests_and_idle_connections_leaves_the_broker_working() {
    let broker = Broker::start("local", |a| {
        a.client_header_timeout = Some(3.0);
        a.max_connections = Some(2000);
        a.max_connections_per_client = Some(2000);
    })
    .await;
    let api = broker.api(ALICE);
    // Every connection is admitted (the caps are above 600) and closed within the header
    // timeout and some slack.
    let (existing, flooded_at) =
        flood_while_working(&api, broker.addr, 600, true, Duration::from_secs(3 + 5)).await;
    assert!(
        flooded_at.elapsed() >= Duration::from_millis(2500),
        "closed before the timeout: {:?}",
        flooded_at.elapsed()
    );
    let timed_out = metric(
        &broker.url(""),
        "kernel_broker_connections_timed_out_total{reason=\"header\"} ",
    )
    .await;
    assert!(timed_out >= 600.0, "timed out: {timed_out}");
    // The existing session is still alive after the flood.
    assert_eq!(api.execute(&existing, "x").await["status"], "ok");
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_caps_refuse_new_connections_while_sessions_carry_on() {
    let broker = Broker::start("local", |a| {
        a.max_connections = Some(6);
        a.max_connections_per_client = Some(4);
        a.client_header_timeout = Some(60.0);
    })
    .await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    // The setup's HTTP client keeps its connections open: let them go.
    drop(api);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // One WebSocket (a session in use) and three idle connections: 4 from 127.0.0.1.
    let mut ws = ws_connect(&broker, &id, ALICE).await;
    assert_eq!(ws_next(&mut ws).await["type"], "status");
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(connect_from(broker.addr, LOCAL).await);
    }
    // The per-client cap: a fifth from 127.0.0.1 is closed at once, without an answer.
    let started = Instant::now();
    assert_eq!(raw_get(&broker, LOCAL, "/healthz").await, None);
    assert!(started.elapsed() < Duration::from_secs(2));
    // Another address still gets in (5 open in all)...
    let ok = raw_get(&broker, OTHER, "/healthz")
        .await
        .unwrap_or_default();
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    // ... until the total cap: 2 more from it fill 6, the next is refused.
    let _other1 = connect_from(broker.addr, OTHER).await;
    let _other2 = connect_from(broker.addr, OTHER).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(raw_get(&broker, OTHER, "/healthz").await, None);

    // The session in use carries on.
    ws_send(
        &mut ws,
        json!({"type": "execute", "id": "a", "code": "6 * 7"}),
    )
    .await;
    let frames = ws_until_done(&mut ws, "a").await;
    let done = frames.last().unwrap();
    assert_eq!(done["execution"]["status"], "ok", "{done}");

    // Closed connections free their places.
    drop(idle);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ok = raw_get(&broker, LOCAL, "/healthz")
        .await
        .unwrap_or_default();
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");

    let per_client = metric(
        &broker.url(""),
        "kernel_broker_connections_refused_total{reason=\"max_connections_per_client\"} ",
    )
    .await;
    let total = metric(
        &broker.url(""),
        "kernel_broker_connections_refused_total{reason=\"max_connections\"} ",
    )
    .await;
    assert_eq!((per_client, total), (1.0, 1.0));
    drop(ws);
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_that_does_not_arrive_gets_a_408() {
    let broker = Broker::start("local", |a| a.client_body_timeout = Some(1.0)).await;
    let mut tcp = connect_from(broker.addr, LOCAL).await;
    let head = format!(
        "POST /v1/sessions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ALICE}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"kern"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let answer = read_until_closed(&mut tcp, 10).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"request_timeout\""), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    let n = metric(
        &broker.url(""),
        "kernel_broker_connections_timed_out_total{reason=\"body\"} ",
    )
    .await;
    assert_eq!(n, 1.0);
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_websocket_client_that_does_not_answer_pings_is_dropped() {
    let broker = Broker::start("local", |a| {
        a.websocket_ping_interval = Some(1.0);
        a.websocket_pong_timeout = Some(1.0);
    })
    .await;
    let api = broker.api(ALICE);
    let id = api.create().await;

    // Two clients: one that reads (so its library answers pings) and one that does not.
    let mut silent = ws_connect(&broker, &id, ALICE).await;
    let mut live = ws_connect(&broker, &id, ALICE).await;
    let mut pings = 0;
    let until = Instant::now() + Duration::from_secs(4);
    while let Ok(Some(m)) = tokio::time::timeout_at(until.into(), live.next()).await {
        if matches!(m.unwrap(), WsMessage::Ping(_)) {
            pings += 1;
        }
    }
    assert!(pings >= 2, "pings: {pings}");

    // The silent one was dropped: it finds a close (or the end) after what was queued.
    let ended = within(10, "the silent client's end", async {
        loop {
            match silent.next().await {
                None | Some(Err(_)) | Some(Ok(WsMessage::Close(_))) => return true,
                Some(Ok(_)) => continue,
            }
        }
    })
    .await;
    assert!(ended);

    // The live client still works.
    ws_send(
        &mut live,
        json!({"type": "execute", "id": "b", "code": "1 + 1"}),
    )
    .await;
    let frames = ws_until_done(&mut live, "b").await;
    assert_eq!(frames.last().unwrap()["execution"]["status"], "ok");
    let _ = live.close(None).await;
    let n = metric(
        &broker.url(""),
        "kernel_broker_connections_timed_out_total{reason=\"websocket_pong\"} ",
    )
    .await;
    assert!(n >= 1.0, "{n}");
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn websockets_per_session_are_capped() {
    let broker = Broker::start("local", |a| a.max_websockets_per_session = Some(2)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let mut first = ws_connect(&broker, &id, ALICE).await;
    let second = ws_connect(&broker, &id, ALICE).await;
    // A third, agent stream or Jupyter channels, is refused with 429 before the upgrade.
    for path in [
        format!("/v1/sessions/{id}/stream"),
        format!("/api/kernels/{id}/channels"),
    ] {
        let url = format!("ws://{}{path}?token={ALICE}", broker.addr);
        match tokio_tungstenite::connect_async(url).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
                assert_eq!(r.status().as_u16(), 429, "{path}");
                let body = String::from_utf8_lossy(r.body().as_deref().unwrap_or_default());
                assert!(body.contains("too_many_websockets"), "{body}");
            }
            other => panic!("{path}: expected a 429, got {:?}", other.map(|_| ())),
        }
    }
    // Another session is not affected, and a closed WebSocket frees its place.
    let other = api.create().await;
    let _elsewhere = ws_connect(&broker, &other, ALICE).await;
    drop(second);
    let mut third = ws_connect_when_free(&format!(
        "ws://{}/v1/sessions/{id}/stream?token={ALICE}",
        broker.addr
    ))
    .await;
    assert_eq!(ws_next(&mut third).await["type"], "status");
    ws_send(
        &mut first,
        json!({"type": "execute", "id": "c", "code": "2 + 2"}),
    )
    .await;
    let frames = ws_until_done(&mut first, "c").await;
    assert_eq!(frames.last().unwrap()["execution"]["status"], "ok");
    broker.stop().await;
}

/// The measurement, as a test: the real binary with 1,024 descriptors, 1,000
/// connections that send nothing or half a request line. The caps keep the broker within
/// its descriptors (the excess is closed at accept), the header timeout closes the rest,
/// and a session made before the flood lives through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_1024_descriptors_a_flood_of_1000_connections_leaves_sessions_alive() {
    // --max-connections 600 asks for more than the descriptors allow once alice's and bob's
    // 20 sessions each are kept for: the broker lowers it and says so.
    let broker = SpawnedBroker::start(
        &[
            "--max-connections",
            "600",
            "--max-connections-per-client",
            "600",
            "--client-header-timeout",
            "4",
        ],
        Some(1024),
    );
    let capped = broker.log_lines("client connections capped to fit the descriptor limit");
    assert_eq!(capped.len(), 1, "{capped:?}");
    // The agent is another client: the flood from 127.0.0.1 fills its share of the lowered
    // cap (seven eighths), the rest is closed at accept (their writes may fail), and the
    // last eighth stays for the agent.
    let api = broker.api(ALICE).connecting_from(OTHER);
    let (existing, _) =
        flood_while_working(&api, broker.addr, 1000, false, Duration::from_secs(4 + 6)).await;
    // Past the flood: the session answers, and was never declared dead.
    let v = api.execute(&existing, "x").await;
    assert_eq!(v["status"], "ok", "{v}");
    let (_, s) = api.get(&format!("/v1/sessions/{existing}")).await;
    assert_ne!(s["state"], "dead", "{s}");
    // The flood's excess was closed at accept, and the budget kept accept from failing.
    let refused = metric(
        &format!("http://{}", broker.addr),
        "kernel_broker_connections_refused_total{reason=\"max_connections_per_client\"} ",
    )
    .await;
    assert!(refused >= 1.0, "refused: {refused}");
    assert!(broker.log_lines("accept failed").is_empty());
    broker.stop().await;
}
