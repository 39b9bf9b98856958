//! Attacks from inside a kernel on the broker's end of the ZeroMQ connections, on both
//! backends. The kernel's code finds its own end of the broker's connections (accepted unix
//! sockets whose name is `…/k-N`) and writes raw bytes there, or swaps its socket files for
//! symlinks, as untrusted code can. The broker must stay up with bounded memory, cut the
//! offending kernel off with a clear reason, never follow a planted symlink, and keep every
//! other session working.

use crate::common;

on_both_backends!(
    a_frame_claiming_exabytes_cuts_the_kernel_off_and_nothing_else,
    a_streamed_giant_frame_does_not_grow_the_broker,
    a_flood_of_malformed_messages_is_dropped_and_the_session_lives,
    the_broker_never_connects_through_a_planted_symlink,
    an_oversized_output_message_is_cut_and_the_session_lives,
);

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Python defining `broker_connections()`: the kernel's ends of the broker's connections
/// (accepted unix sockets named `…/k-N`, not the listeners), as `(socket, name)` pairs.
/// libzmq's descriptors are non-blocking; a timeout makes Python wait for room to write.
const BROKER_CONNECTIONS: &str = r#"
import os, socket, struct, glob, time
def broker_connections():
    found = []
    for fd in [int(f) for f in os.listdir('/proc/self/fd')]:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            name = s.getsockname() if s.family == socket.AF_UNIX else ''
            if isinstance(name, str) and name[-3:-1] == 'k-' \
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.settimeout(30)
                found.append((s, name))
                continue
        except OSError:
            pass
        s.close()
    return found
"#;

/// Python that calls `attack(sock)` on the kernel's end of every broker connection to the
/// socket `k-{port}` and prints how many it found.
fn on_connections(port: u32, attack: &str) -> String {
    format!(
        r#"{BROKER_CONNECTIONS}
{attack}
hits = 0
for s, name in broker_connections():
    try:
        if name.endswith('k-{port}'):
            attack(s)
            hits += 1
    except OSError:
        pass
    finally:
        s.close()
print('connections attacked:', hits)
"#
    )
}

/// The broker's (this process's) peak resident memory so far.
fn peak_rss_kib() -> u64 {
    status_kib("VmHWM")
}

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap()
}

/// Polls the session until its state is `dead`; returns the session.
async fn until_dead(api: &Api, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, s) = api.get(&format!("/v1/sessions/{id}")).await;
        assert_eq!(status, 200, "{s}");
        if s["state"] == "dead" {
            return s;
        }
        assert!(Instant::now() < deadline, "the session never died: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn text(exec: &Value) -> String {
    exec["results"]
        .as_array()
        .and_then(|r| r.first())
        .and_then(|r| r["data"]["text/plain"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// Bob's session keeps working and the broker answers /healthz.
async fn others_carry_on(broker: &Broker, bob: &Api, bob_id: &str) {
    let x = bob.execute(bob_id, "6*7").await;
    assert_eq!(text(&x), "42", "{x}");
    let health = reqwest::get(broker.url("/healthz")).await.unwrap();
    assert!(health.status().is_success());
}

async fn a_frame_claiming_exabytes_cuts_the_kernel_off_and_nothing_else(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let alice = broker.api(ALICE);
    let bob = broker.api(BOB);
    let bob_id = bob.create().await;
    let id = alice.create().await;
    alice.execute(&id, "x = 1").await;
    // A ZMTP long frame claiming 2^62 bytes, on the iopub connection (the broker's SUB).
    let code = on_connections(
        2,
        "def attack(s):\n    s.sendall(b'\\x02' + struct.pack('>Q', 1 << 62))",
    );
    let x = alice.execute(&id, &code).await;
    // The execution ends dead (or finished just before the broker cut the kernel off).
    let s = until_dead(&alice, &id).await;
    let x = if x["status"] == "dead" {
        x
    } else {
        alice.execute(&id, "1").await
    };
    assert_eq!(x["status"], "dead", "{x}");
    let why = x["error"]["evalue"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        why.contains("iopub") || why.contains("restart"),
        "{x} / {s}"
    );
    others_carry_on(&broker, &bob, &bob_id).await;
    // The session recovers with a restart.
    let (status, _) = alice
        .post(&format!("/v1/sessions/{id}/restart"), serde_json::json!({}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(text(&alice.execute(&id, "2+2").await), "4");
    broker.stop().await;
}

async fn a_streamed_giant_frame_does_not_grow_the_broker(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let alice = broker.api(ALICE);
    let bob = broker.api(BOB);
    let bob_id = bob.create().await;
    let id = alice.create().await;
    alice.execute(&id, "1").await;
    let before = peak_rss_kib();
    // A frame header claiming 1 GiB, then 1 GiB of zeros, on the iopub connection. The
    // peak counts: memory taken and given back during the attack is still memory taken.
    let code = on_connections(
        2,
        "def attack(s):\n    \
             s.sendall(b'\\x02' + struct.pack('>Q', 1 << 30))\n    \
             chunk = bytes(1 << 20)\n    \
             try:\n        \
                 for _ in range(1024):\n            \
                     s.sendall(chunk)\n    \
             except OSError:\n        \
                 pass",
    );
    let _ = alice
        .execute_with(
            &id,
            serde_json::json!({"code": code, "timeout_seconds": 60}),
        )
        .await;
    let grown = peak_rss_kib().saturating_sub(before);
    assert!(
        grown < 100 * 1024,
        "the broker grew by {grown} KiB while a kernel streamed a 1 GiB frame"
    );
    until_dead(&alice, &id).await;
    others_carry_on(&broker, &bob, &bob_id).await;
    broker.stop().await;
}

/// The broker's log lines, captured (installed before the harness's own subscriber, which
/// then stays out of the way).
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn a_flood_of_malformed_messages_is_dropped_and_the_session_lives(sb: &'static str) {
    let log = Captured::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_env_filter("warn")
        .with_writer(move || writer.clone())
        .init();
    let broker = Broker::start(sb, |_| {}).await;
    let alice = broker.api(ALICE);
    let id = alice.create().await;
    alice.execute(&id, "x = 41").await;
    // 200,000 well-framed one-frame messages that are not Jupyter messages (600 kB), on
    // the control connection (which carries nothing else while code runs): each is
    // dropped (no delimiter), the session is not harmed, and the log gets a few lines.
    let code = on_connections(4, "def attack(s):\n    s.sendall(b'\\x00\\x01A' * 200000)");
    let x = alice.execute(&id, &code).await;
    assert_eq!(x["status"], "ok", "{x}");
    assert!(x["stdout"].as_str().unwrap().contains("attacked: 1"), "{x}");
    let x = alice.execute(&id, "x + 1").await;
    assert_eq!(text(&x), "42", "{x}");
    let (_, s) = alice.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(s["state"], "idle", "{s}");
    broker.stop().await;
    let text = String::from_utf8_lossy(&log.0.lock().unwrap()).to_string();
    let lines = text
        .lines()
        .filter(|l| l.contains("dropped a message from the kernel"))
        .count();
    assert!(
        (1..=10).contains(&lines),
        "{lines} log lines for 200,000 bad messages"
    );
}

async fn the_broker_never_connects_through_a_planted_symlink(sb: &'static str) {
    // A host socket the kernel wants the broker to connect to.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("host.sock");
    let listener = tokio::net::UnixListener::bind(&target).unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    let acceptor = tokio::spawn(async move {
        while listener.accept().await.is_ok() {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let broker = Broker::start(sb, |_| {}).await;
    let alice = broker.api(ALICE);
    let id = alice.create().await;
    alice.execute(&id, "1").await;
    // Rename every socket file of this kernel, plant a symlink to the host socket in its
    // place, then drop the broker's connections so that it would reconnect.
    let code = format!(
        r#"{BROKER_CONNECTIONS}
conns = broker_connections()
for d in {{os.path.dirname(n) for _, n in conns}}:
    for p in glob.glob(d + '/k-[1-5]'):
        os.rename(p, p + '.real')
        os.symlink({target:?}, p)
for s, _ in conns:
    s.shutdown(socket.SHUT_RDWR)
print('connections dropped:', len(conns))
time.sleep(0.2)
"#,
        target = target.display().to_string()
    );
    let x = alice.execute(&id, &code).await;
    let dropped = x["stdout"].as_str().unwrap_or_default().to_string();
    assert!(
        dropped.contains("connections dropped: 5") || x["status"] == "dead",
        "the attack did not run: {x}"
    );
    // The heartbeat reconnects after a miss; give it several intervals.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the broker connected through a planted symlink"
    );
    let health = reqwest::get(broker.url("/healthz")).await.unwrap();
    assert!(health.status().is_success());
    broker.stop().await;
    acceptor.abort();
}

/// Output is the kernel's business, not an attack: an iopub `stream` message over the
/// kernel-message limit (1 MiB here, so one `write` of 3 MB makes one deterministically) is
/// cut, not taken for a protocol violation, and an endless print loop after it ends with
/// the timeout and a session that keeps its variables. The output limit is raised so the
/// execution shows the end of the kept prefix and the marker after it.
async fn an_oversized_output_message_is_cut_and_the_session_lives(sb: &'static str) {
    let broker = Broker::start(sb, |a| {
        a.max_kernel_message = Some(1 << 20);
        a.output_limit = Some(1 << 20);
    })
    .await;
    let alice = broker.api(ALICE);
    let id = alice.create().await;
    alice.execute(&id, "x = 41").await;
    let code = "import sys\n\
                sys.stdout.write('y' * 3_000_000)\n\
                sys.stdout.flush()\n\
                i = 0\n\
                while True:\n    print(i)\n    i += 1";
    let x = within(
        60,
        "the looping execution",
        alice.execute_with(&id, serde_json::json!({"code": code, "timeout_seconds": 3})),
    )
    .await;
    assert_eq!(x["status"], "timeout", "{}", short(&x));
    assert_eq!(x["truncated"], true, "{}", short(&x));
    let stdout = x["stdout"].as_str().unwrap_or_default();
    assert!(stdout.starts_with("yyyy"), "{}", short(&x));
    // The first 256 KiB of the message's content are kept: the text up to there, then
    // the marker with the size the kernel sent.
    let marker = stdout
        .find("\n[kernel-broker: an output message of ")
        .unwrap_or_else(|| panic!("the cut is not marked: {}", short(&x)));
    assert!(
        (200_000..262_144).contains(&marker) && stdout[..marker].bytes().all(|b| b == b'y'),
        "{marker} characters before the marker: {}",
        short(&x)
    );
    assert!(
        stdout[marker..].contains(" bytes was cut to its first"),
        "{}",
        &stdout[marker..marker + 200]
    );
    // The session lives on with its variables.
    let x = alice.execute(&id, "x + 1").await;
    assert_eq!(text(&x), "42", "{x}");
    // The recording says what was cut and how big it was.
    let (status, v) = alice.get(&format!("/v1/sessions/{id}/events")).await;
    assert_eq!(status, 200, "{v}");
    let cut = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "output_cut")
        .unwrap_or_else(|| panic!("no output_cut event in the recording"))
        .clone();
    assert_eq!(cut["detail"]["msg_type"], "stream", "{cut}");
    assert!(
        cut["detail"]["bytes"].as_u64().unwrap_or(0) > 3_000_000,
        "{cut}"
    );
    broker.stop().await;
}

/// An execution with its (possibly long) stdout shortened, for assertion messages.
fn short(x: &Value) -> String {
    let mut x = x.clone();
    if let Some(s) = x["stdout"].as_str() {
        let head: String = s.chars().take(200).collect();
        x["stdout"] = Value::String(format!("{head}... ({} chars)", s.len()));
    }
    x.to_string()
}
