//! The proxy against hostile clients, on a loopback listener of the test (the same code
//! serves the listeners opened in sandboxes): a silent or slow client is cut at the header
//! timeout, an oversized head is refused, the connection cap refuses with a sentence, and
//! refusals are reported before anything is connected.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use uuid::Uuid;

use super::*;

#[derive(Default)]
struct Seen(Mutex<Vec<EgressEvent>>);

impl EgressObserver for Seen {
    fn report(&self, _: Uuid, _: &str, event: EgressEvent) {
        lock(&self.0).push(event);
    }
}

/// A proxy for user `u` allowing `localhost` on the port of `proof` (a listener that
/// must never be connected to), with `max_connections`.
async fn proxy(max_connections: usize) -> (ServeGuard, u16, Arc<Seen>, std::net::TcpListener) {
    let proof = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    proof.set_nonblocking(true).unwrap();
    let port = proof.local_addr().unwrap().port();
    let policy = Policy::parse(&["localhost".into()], Some(&[port]), "test").unwrap();
    let config = EgressConfig {
        users: HashMap::from([(
            "u".to_string(),
            UserEgress {
                policy,
                limits: EgressLimits {
                    max_bytes: 0,
                    max_connections,
                },
            },
        )]),
        ca_bundle: None,
    };
    let egress = Egress::new(&config);
    let seen = Arc::new(Seen::default());
    egress.observe(seen.clone());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap().port();
    let guard = egress.serve(listener, "u", Uuid::nil()).unwrap().unwrap();
    (guard, at, seen, proof)
}

/// Everything the proxy answers until it closes the connection.
async fn answer(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(start_paused = true)]
async fn silent_and_slow_clients_are_cut_at_the_header_timeout() {
    let (_guard, at, _, _) = proxy(0).await;
    let mut silent = TcpStream::connect(("127.0.0.1", at)).await.unwrap();
    let mut slow = TcpStream::connect(("127.0.0.1", at)).await.unwrap();
    slow.write_all(b"GET http://localhost/ HTTP/1.1\r\nX-A: ")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    // Bounded (in paused time): a proxy that waited forever would fail here, not hang.
    let both = async { (answer(&mut silent).await, answer(&mut slow).await) };
    let (silent_got, _) = tokio::time::timeout(TIMEOUTS.header * 6, both)
        .await
        .expect("the proxy cut neither");
    assert_eq!(silent_got, "");
    let waited = started.elapsed();
    assert!(
        waited >= TIMEOUTS.header && waited < TIMEOUTS.header * 2,
        "{waited:?}"
    );
}

#[tokio::test]
async fn an_oversized_request_head_is_refused() {
    let (_guard, at, _, proof) = proxy(0).await;
    let mut s = TcpStream::connect(("127.0.0.1", at)).await.unwrap();
    let port = proof.local_addr().unwrap().port();
    let head = format!(
        "GET http://localhost:{port}/ HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let _ = s.write_all(head.as_bytes()).await;
    let got = tokio::time::timeout(Duration::from_secs(10), answer(&mut s))
        .await
        .unwrap();
    assert!(got.starts_with("HTTP/1.1 431"), "{got:?}");
    assert!(proof.accept().is_err(), "nothing was connected");
}

#[tokio::test]
async fn past_the_connection_cap_the_proxy_answers_with_a_sentence() {
    let (_guard, at, seen, _) = proxy(1).await;
    let _held = TcpStream::connect(("127.0.0.1", at)).await.unwrap();
    // The first is counted once accepted: give the accept loop a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut second = TcpStream::connect(("127.0.0.1", at)).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), answer(&mut second))
        .await
        .unwrap();
    assert!(
        got.starts_with(
            "HTTP/1.1 403 egress connection limit reached: this user may have 1 connections open"
        ),
        "{got:?}"
    );
    assert!(matches!(
        lock(&seen.0).last(),
        Some(EgressEvent::Refused { reason, .. }) if reason.starts_with("egress connection limit")
    ));
}

#[tokio::test]
async fn a_name_that_resolves_to_loopback_is_refused_before_connecting() {
    let (_guard, at, seen, proof) = proxy(0).await;
    let port = proof.local_addr().unwrap().port();
    let mut s = TcpStream::connect(("127.0.0.1", at)).await.unwrap();
    let head = format!("CONNECT localhost:{port} HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), answer(&mut s))
        .await
        .unwrap();
    assert!(
        got.starts_with("HTTP/1.1 403 address not allowed by policy: localhost is "),
        "{got:?}"
    );
    assert!(got.contains("(loopback)"), "{got:?}");
    assert!(proof.accept().is_err(), "nothing was connected");
    let events = lock(&seen.0).clone();
    assert!(
        matches!(&events[..], [EgressEvent::Refused { method, host, .. }] if method == "CONNECT" && host == "localhost"),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_refused_host_or_port_is_answered_with_the_setting_that_would_allow_it() {
    let (_guard, at, seen, proof) = proxy(0).await;
    let port = proof.local_addr().unwrap().port();
    for (head, sentence, setting) in [
        (
            "CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n".to_string(),
            "HTTP/1.1 403 host not allowed by policy: example.org (kernel-broker's egress policy",
            "--egress-allow or a user's egress_allow",
        ),
        (
            format!("GET http://localhost:{}/ HTTP/1.1\r\n\r\n", port ^ 1),
            "HTTP/1.1 403 port not allowed by policy: localhost:",
            "--egress-ports or a user's egress_ports",
        ),
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", at)).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), answer(&mut s))
            .await
            .unwrap();
        let (status_line, body) = got.split_once("\r\n\r\n").unwrap();
        assert!(status_line.starts_with(sentence), "{got:?}");
        // In the reason phrase (what pip and requests print) and in the body.
        assert!(
            status_line.lines().next().unwrap().contains(setting),
            "{got:?}"
        );
        assert!(body.contains(setting), "{got:?}");
    }
    assert!(proof.accept().is_err(), "nothing was connected");
    // The recording keeps the sentence alone.
    let events = lock(&seen.0).clone();
    assert!(
        events.iter().all(|e| matches!(e,
            EgressEvent::Refused { reason, .. } if reason.contains("not allowed by policy")
                && !reason.contains("egress_allow") && !reason.contains("egress_ports"))),
        "{events:?}"
    );
}
