//! Network policy per user (issue 15), real kernels, real PyPI, both backends (local with
//! and without the fork-server template): alice may reach the package index through the
//! broker's egress proxy and `%pip install` into her workspace; everything else she asks
//! the proxy for is refused before any connection (a listener of this test, on an allowed
//! port of `localhost`, must see none); bob, without a policy, has no network at all;
//! carol's limits (connections, bytes) refuse past them. The recording holds the requests,
//! `/metrics` counts them.

use crate::common;

use std::net::ToSocketAddrs;

use common::*;
use kernel_broker::config::ServeArgs;
use serde_json::Value;

const CAROL: &str = "carol-token-0003";
/// Small, pure Python, no dependencies, in neither `kernels/requirements.txt` nor the image.
const PACKAGE: &str = "tabulate==0.9.0";
/// carol's byte limit: a few small exchanges fit, the index page of pip does not.
const CAROL_BYTES: u64 = 40_000;

/// Where this machine's DNS sends the package index, when that is not a public address
/// (a site whose egress gateway answers for public names): exempted, as an operator here
/// would (`--egress-allow-networks`). Empty where the index resolves to public addresses.
fn gateway_networks() -> Vec<String> {
    let mut nets = Vec::new();
    for host in ["pypi.org:443", "files.pythonhosted.org:443"] {
        for a in host
            .to_socket_addrs()
            .expect("the package index resolves here")
        {
            let net = format!("{}/{}", a.ip(), if a.is_ipv4() { 32 } else { 128 });
            if kernel_broker::egress::check_address(a.ip()).is_err() && !nets.contains(&net) {
                nets.push(net);
            }
        }
    }
    nets
}

fn users_file(dir: &std::path::Path, proof_port: u16) -> std::path::PathBuf {
    let text = format!(
        r#"[[user]]
name = "alice"
token = "{ALICE}"
egress_allow = ["pypi.org", "*.pythonhosted.org", "localhost"]
egress_ports = [80, 443, {proof_port}]

[[user]]
name = "bob"
token = "{BOB}"

[[user]]
name = "carol"
token = "{CAROL}"
egress_allow = ["pypi.org"]
egress_max_connections = 1
egress_max_bytes = {CAROL_BYTES}
"#
    );
    let path = dir.join("users-egress.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Kernel code: `via(method, target)` asks the proxy named by `HTTP_PROXY` directly (no
/// `NO_PROXY` shortcut) and gives `"status reason | body"`.
const VIA: &str = r#"
import os, http.client
def via(method, target):
    port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request(method, target)
    r = c.getresponse()
    return f"{r.status} {r.reason} | {r.read().decode().strip()}"
"#;

async fn run(api: &Api, id: &str, code: &str) -> String {
    let x = api
        .execute_with(
            id,
            serde_json::json!({"code": code, "timeout_seconds": 120}),
        )
        .await;
    assert_eq!(x["status"], "ok", "{code}\n{x}");
    x["stdout"].as_str().unwrap_or_default().trim().to_string()
}

async fn events(api: &Api, id: &str) -> Vec<Value> {
    let (status, v) = api
        .get(&format!("/v1/sessions/{id}/events?limit=1000"))
        .await;
    assert_eq!(status, 200, "{v}");
    v["events"].as_array().unwrap().clone()
}

async fn egress_policy(sandbox: &'static str, fork: bool) {
    let proof = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    proof.set_nonblocking(true).unwrap();
    let proof_port = proof.local_addr().unwrap().port();
    let tmp = tempfile::tempdir().unwrap();
    let users = users_file(tmp.path(), proof_port);
    let broker = Broker::start(sandbox, |a: &mut ServeArgs| {
        a.users_file = Some(users);
        a.egress_allow_networks = Some(gateway_networks());
        // The host's trust store: where a site's egress intercepts TLS, its CA is there
        // (and the kernel image's own store may not have it).
        a.egress_ca_file = Some("/etc/ssl/certs/ca-certificates.crt".into());
        if fork {
            a.fork_server = Some(true);
            a.preload = Some("numpy".into());
        } else {
            a.fork_server = Some(false);
            a.preload = Some("none".into());
        }
    })
    .await;

    // bob: no policy, so no proxy, no listener, no names, no route.
    let bob = broker.api(BOB);
    let b = bob.create().await;
    let no_network = run(
        &bob,
        &b,
        r#"import os, socket
def fails(f):
    try:
        f()
        return False
    except OSError:
        return True
env = [k for k in os.environ if "proxy" in k.lower()]
# Listening sockets the broker (uid 0) opened in this namespace: the proxy's.
listening = [l for l in open("/proc/net/tcp").read().splitlines()[1:]
             if l.split()[3] == "0A" and l.split()[7] == "0"]
print(env, len(listening), fails(lambda: socket.getaddrinfo("pypi.org", 443)),
      fails(lambda: socket.create_connection(("151.101.0.223", 443), timeout=3)))"#,
    )
    .await;
    assert_eq!(no_network, "[] 0 True True", "bob has no egress");

    // alice: the index through the proxy; pip installs into her workspace and the package
    // imports in the same session.
    let alice = broker.api(ALICE);
    let a = alice.create().await;
    let names_fail = run(
        &alice,
        &a,
        "import socket\ntry:\n    socket.getaddrinfo('pypi.org', 443); print('resolved')\nexcept OSError: print('no names')",
    )
    .await;
    assert_eq!(names_fail, "no names", "the kernel resolves nothing itself");
    let proxy = run(
        &alice,
        &a,
        r#"import os
port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
listening = [int(l.split()[1].split(":")[1], 16) for l in open("/proc/net/tcp").read().splitlines()[1:]
             if l.split()[3] == "0A" and l.split()[7] == "0"]
print(port in listening, os.environ["NO_PROXY"], os.environ["PIP_TARGET"], os.getppid() != 1)"#,
    )
    .await;
    // Locally, forked kernels are children of the template, plain ones of the sandbox's init
    // (Docker's are children of their tini).
    let (env, forked) = proxy.rsplit_once(' ').unwrap();
    assert_eq!(env, "True localhost,127.0.0.1 /workspace/.python-packages");
    if sandbox == "local" {
        assert_eq!(forked, if fork { "True" } else { "False" }, "forked or not");
    }
    let started = std::time::Instant::now();
    let pip = alice
        .execute_with(
            &a,
            serde_json::json!({"code": format!("%pip install --no-deps {PACKAGE}"), "timeout_seconds": 180}),
        )
        .await;
    let pip_seconds = started.elapsed().as_secs_f64();
    assert_eq!(pip["status"], "ok", "{pip}");
    assert!(
        pip["stdout"]
            .as_str()
            .unwrap()
            .contains("Successfully installed tabulate-0.9.0"),
        "{pip}"
    );
    eprintln!("{sandbox} fork={fork}: %pip install took {pip_seconds:.1} s");
    let imported = run(
        &alice,
        &a,
        "import tabulate; print(tabulate.__file__); print(tabulate.tabulate([[1, 2]]))",
    )
    .await;
    assert!(
        imported.starts_with("/workspace/.python-packages/tabulate"),
        "{imported}"
    );
    assert!(imported.contains("-  -\n1  2\n-  -"), "{imported}");
    let (status, _) = alice
        .get(&format!(
            "/v1/sessions/{a}/files/.python-packages/tabulate/__init__.py"
        ))
        .await;
    assert_eq!(status, 200, "the package is in alice's workspace");
    // It persists for alice: another session imports it without installing.
    let a2 = alice.create().await;
    let again = run(&alice, &a2, "import tabulate; print(tabulate.__version__)").await;
    assert_eq!(again, "0.9.0");
    alice.delete(&format!("/v1/sessions/{a2}")).await;
    // The kernel's own environment stayed as it was (read-only in the sandbox anyway).
    let venv = run(
        &alice,
        &a,
        "import os, sys\nprint(os.access(sys.prefix + '/lib', os.W_OK), any('tabulate' in n for n in os.listdir(next(p for p in sys.path if p.endswith('site-packages')))))",
    )
    .await;
    assert_eq!(venv, "False False");

    // Refusals, each before any outbound connection.
    run(&alice, &a, VIA).await;
    let cases = [
        (
            "GET",
            "http://example.org/".to_string(),
            "403 host not allowed by policy: example.org",
        ),
        (
            "CONNECT",
            "example.org:443".to_string(),
            "403 host not allowed by policy: example.org",
        ),
        (
            "GET",
            format!("http://127.0.0.1:{proof_port}/"),
            "403 host not allowed by policy: 127.0.0.1",
        ),
        (
            "GET",
            format!("http://localhost:{proof_port}/"),
            "403 address not allowed by policy: localhost is 127.0.0.1 (loopback)",
        ),
        (
            "CONNECT",
            "pypi.org:8443".to_string(),
            "403 port not allowed by policy: pypi.org:8443",
        ),
        ("GET", "/relative".to_string(), "400 this is an HTTP proxy"),
    ];
    for (method, target, want) in &cases {
        let got = run(&alice, &a, &format!("print(via({method:?}, {target:?}))")).await;
        assert!(got.starts_with(want), "{method} {target}: {got}");
    }
    // What pip and requests print for a refused tunnel: the reason phrase.
    let tunnel = run(
        &alice,
        &a,
        "import urllib.request\ntry:\n    urllib.request.urlopen('https://example.org/', timeout=30)\nexcept OSError as e: print(e)",
    )
    .await;
    assert!(
        tunnel.contains("403 host not allowed by policy: example.org"),
        "{tunnel}"
    );
    assert!(
        matches!(proof.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the proxy connected to the refused address"
    );

    // carol: one connection at a time, and a byte budget.
    let carol = broker.api(CAROL);
    let c = carol.create().await;
    run(&carol, &c, VIA).await;
    let limits = run(
        &carol,
        &c,
        r#"import socket, urllib.request
port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
held = socket.create_connection(("127.0.0.1", port))
held.sendall(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n")
print(held.recv(100).split(b"\r\n")[0].decode())
print(via("CONNECT", "pypi.org:443"))
held.close()
import time; time.sleep(0.5)
try:
    urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=60).read()
    print("read it all")
except Exception as e:
    print("cut:", type(e).__name__)
print(via("CONNECT", "pypi.org:443"))"#,
    )
    .await;
    let lines: Vec<&str> = limits.lines().collect();
    assert_eq!(lines[0], "HTTP/1.1 200 OK", "{limits}");
    assert!(
        lines[1].starts_with(
            "403 egress connection limit reached: this user may have 1 connections open"
        ),
        "{limits}"
    );
    assert!(lines[2].starts_with("cut:"), "{limits}");
    assert!(
        lines[3].starts_with(&format!(
            "403 egress byte limit reached: this user may send and receive {CAROL_BYTES} bytes"
        )),
        "{limits}"
    );

    // The recording holds the allowed and the refused requests.
    let evs = events(&alice, &a).await;
    let kinds = |k: &str| {
        evs.iter()
            .filter(|e| e["kind"] == k)
            .cloned()
            .collect::<Vec<_>>()
    };
    let allowed = kinds("egress_allowed");
    assert!(
        allowed
            .iter()
            .any(|e| e["detail"]["host"] == "pypi.org" && e["detail"]["method"] == "CONNECT"),
        "{allowed:?}"
    );
    assert!(allowed
        .iter()
        .any(|e| e["detail"]["host"] == "files.pythonhosted.org"));
    let refused = kinds("egress_refused");
    for (_, _, want) in &cases {
        let reason = want.split_once(' ').unwrap().1;
        assert!(
            refused
                .iter()
                .any(|e| e["detail"]["reason"].as_str().unwrap().starts_with(reason)),
            "{reason} not recorded: {refused:?}"
        );
    }
    assert!(kinds("egress_closed")
        .iter()
        .any(|e| e["detail"]["bytes_received"].as_u64().unwrap() > 10_000));
    // The notebook export and the timeline take the new events in their stride.
    let (status, notebook) = alice.get(&format!("/v1/sessions/{a}/notebook")).await;
    assert_eq!(status, 200, "{notebook}");

    // Metrics: all users' totals, alice's own by name.
    let base = broker.url("");
    let base = base.trim_end_matches('/');
    let refused_total = metric(
        base,
        "kernel_broker_egress_requests_total{outcome=\"refused\"}",
    )
    .await;
    assert!(refused_total >= (cases.len() + 3) as f64, "{refused_total}");
    assert!(
        metric(
            base,
            "kernel_broker_egress_requests_total{outcome=\"allowed\"}"
        )
        .await
            >= 3.0
    );
    assert!(
        metric(
            base,
            "kernel_broker_egress_user_bytes_total{user=\"alice\",direction=\"received\"}"
        )
        .await
            > 30_000.0
    );
    broker.stop().await;
}

#[tokio::test]
async fn local_forked_kernels_reach_only_their_allowlist() {
    egress_policy("local", true).await;
}

#[tokio::test]
async fn local_plain_kernels_reach_only_their_allowlist() {
    egress_policy("local", false).await;
}

#[tokio::test]
async fn docker_kernels_reach_only_their_allowlist() {
    docker_ready();
    egress_policy("docker", false).await;
}
