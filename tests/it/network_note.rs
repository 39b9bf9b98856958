//! A kernel's failed network connection says why and which setting would allow it (issue
//! 35), real kernels on both backends, with and without the fork-server template: code
//! written for E2B's sandboxes, which have the internet, meets loopback only here. The note
//! is the kernel's own (`kernels/kernel_broker_network.py`, a note on the exception IPython
//! shows): the exception keeps its type and stays catchable, a refused loopback connection
//! has none, and a kernel with an egress policy is told its hosts go through the proxy,
//! whose refusal names the setting that would allow the host. The same traceback reaches
//! REST clients and Jupyter clients.

use crate::common;

use common::*;
use futures::StreamExt;
use kernel_broker::config::ServeArgs;
use serde_json::{json, Value};

/// carol has a policy (one host, never reached: every request of hers here is refused
/// before any connection); alice and bob have none.
const CAROL: &str = "carol-token-0003";

/// What the note says without a policy, and what only the note says.
const NO_NETWORK: &str = "kernel-broker: this sandbox has no network (loopback only); an \
     operator allows hosts with --egress-allow or a user's egress_allow (docs/API.md, \
     Network policy)";
/// The start of the note of a kernel whose user has a policy.
const THROUGH_PROXY: &str = "kernel-broker: this sandbox has no network of its own";

fn users_file(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("users-network-note.toml");
    let text = format!(
        "{}\n[[user]]\nname = \"carol\"\ntoken = \"{CAROL}\"\negress_allow = [\"pypi.org\"]\n",
        users_toml()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The execution's error as the REST API answers it: its name and the traceback's lines
/// joined (escape sequences and all: the note is a plain line among them).
async fn failing(api: &Api, id: &str, code: &str) -> (String, String) {
    let x = api
        .execute_with(id, json!({"code": code, "timeout_seconds": 60}))
        .await;
    assert_eq!(x["status"], "error", "{code}\n{x}");
    let traceback = x["error"]["traceback"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    (x["error"]["ename"].as_str().unwrap().to_string(), traceback)
}

async fn printed(api: &Api, id: &str, code: &str) -> String {
    let x = api
        .execute_with(id, json!({"code": code, "timeout_seconds": 60}))
        .await;
    assert_eq!(x["status"], "ok", "{code}\n{x}");
    x["stdout"].as_str().unwrap_or_default().trim().to_string()
}

/// The `error` message a Jupyter client gets on iopub for `code`, and the `execute_reply`'s
/// traceback, both joined.
async fn jupyter_error(broker: &Broker, id: &str, code: &str) -> (String, String) {
    let mut ws = jupyter_channels(broker, id, "nb-note").await;
    let content = json!({"code": code, "silent": false, "store_history": true,
                         "user_expressions": {}, "allow_stdin": false});
    let msg_id = jupyter_send(&mut ws, "nb-note", ("shell", "execute_request"), content).await;
    let join = |v: &Value| {
        v["content"]["traceback"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    };
    within(120, "the Jupyter error and reply", async {
        let mut error = None;
        loop {
            let m = ws.next().await.expect("channels closed").unwrap();
            let tokio_tungstenite::tungstenite::Message::Text(t) = m else {
                continue;
            };
            let v: Value = serde_json::from_str(t.as_str()).unwrap();
            if v["parent_header"]["msg_id"] != msg_id.as_str() {
                continue;
            }
            if v["msg_type"] == "error" {
                error = Some(join(&v));
            }
            if v["msg_type"] == "execute_reply" {
                assert_eq!(v["content"]["status"], "error", "{v}");
                return (error.expect("an error message before the reply"), join(&v));
            }
        }
    })
    .await
}

async fn failed_connections_name_the_setting(sandbox: &'static str, fork: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let users = users_file(tmp.path());
    let broker = Broker::start(sandbox, |a: &mut ServeArgs| {
        a.users_file = Some(users);
        a.fork_server = Some(fork);
        a.preload = Some(if fork { "numpy" } else { "none" }.into());
    })
    .await;

    // alice, no policy: a name, an address, each shown with the note.
    let alice = broker.api(ALICE);
    let a = alice.create().await;
    let (name, tb) = failing(
        &alice,
        &a,
        "import socket\nsocket.create_connection(('example.com', 80), timeout=30)",
    )
    .await;
    assert_eq!(name, "gaierror", "{tb}");
    assert!(tb.contains(NO_NETWORK), "{tb}");
    // An address: no name to resolve, no route (urllib wraps the OSError in a URLError).
    let (name, tb) = failing(
        &alice,
        &a,
        "import urllib.request\nurllib.request.urlopen('http://93.184.216.34/', timeout=30)",
    )
    .await;
    assert_eq!(name, "URLError", "{tb}");
    assert!(tb.contains("Network is unreachable"), "{tb}");
    assert!(tb.contains(NO_NETWORK), "{tb}");
    // Once, however often it is shown.
    assert_eq!(tb.matches("kernel-broker:").count(), 1, "{tb}");
    // Same type, caught as before, nothing added where nothing is shown.
    let caught = printed(
        &alice,
        &a,
        "import socket, urllib.request, urllib.error\n\
         try:\n    socket.create_connection(('example.com', 80), timeout=30)\n\
         except OSError as e:\n    print(type(e).__name__, getattr(e, '__notes__', None))\n\
         try:\n    urllib.request.urlopen('http://93.184.216.34/', timeout=30)\n\
         except urllib.error.URLError as e:\n    print(type(e.reason).__name__, e.reason.errno, getattr(e, '__notes__', None))",
    )
    .await;
    assert_eq!(caught, "gaierror None\nOSError 101 None");
    // A refused loopback connection is no network-policy matter: no note.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let (name, tb) = failing(
        &alice,
        &a,
        &format!("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=30)"),
    )
    .await;
    assert_eq!(name, "ConnectionRefusedError", "{tb}");
    assert!(!tb.contains("kernel-broker:"), "{tb}");
    // Hostile output: a kernel that prints the note has printed it, nothing more; the
    // broker reads no note out of output (the error is the kernel's, as it raised it).
    // The note is assembled at run time so that the traceback's source line is not it.
    let tail = &NO_NETWORK["kernel-".len()..];
    let code = format!(
        "import sys\nsys.stdout.write('kernel-' + {tail:?} + '\\n')\n\
         sys.stderr.write('kernel-' + {tail:?} + '\\n')\nraise ValueError('x')"
    );
    let x = alice
        .execute_with(&a, json!({"code": code, "timeout_seconds": 60}))
        .await;
    assert_eq!(x["error"]["ename"], "ValueError", "{x}");
    assert!(x["stdout"].as_str().unwrap().contains(NO_NETWORK), "{x}");
    let tb = x["error"]["traceback"].to_string();
    assert!(!tb.contains("kernel-broker:"), "{tb}");

    // The same traceback reaches a Jupyter client: the error message and the reply.
    let (error, reply) = jupyter_error(
        &broker,
        &a,
        "import socket\nsocket.getaddrinfo('files.example.com', 443)",
    )
    .await;
    assert!(error.contains(NO_NETWORK), "{error}");
    assert!(reply.contains(NO_NETWORK), "{reply}");
    alice.delete(&format!("/v1/sessions/{a}")).await;

    // carol, a policy: her kernel is told its hosts go through the proxy, and the proxy's
    // refusal of a host names the setting that would allow it.
    let carol = broker.api(CAROL);
    let c = carol.create().await;
    let (name, tb) = failing(
        &carol,
        &c,
        "import socket\nsocket.create_connection(('example.com', 80), timeout=30)",
    )
    .await;
    assert_eq!(name, "gaierror", "{tb}");
    assert!(tb.contains(THROUGH_PROXY), "{tb}");
    assert!(tb.contains("HTTP_PROXY/HTTPS_PROXY"), "{tb}");
    assert!(!tb.contains(NO_NETWORK), "{tb}");
    let (name, tb) = failing(
        &carol,
        &c,
        "import urllib.request\nurllib.request.urlopen('https://example.org/', timeout=30)",
    )
    .await;
    assert_eq!(name, "URLError", "{tb}");
    assert!(
        tb.contains("Tunnel connection failed: 403 host not allowed by policy: example.org"),
        "{tb}"
    );
    assert!(
        tb.contains("an operator allows hosts with --egress-allow or a user's egress_allow"),
        "{tb}"
    );
    carol.delete(&format!("/v1/sessions/{c}")).await;
    broker.stop().await;
}

#[tokio::test]
async fn local_forked_kernels_name_the_setting() {
    failed_connections_name_the_setting("local", true).await;
}

#[tokio::test]
async fn local_plain_kernels_name_the_setting() {
    failed_connections_name_the_setting("local", false).await;
}

#[tokio::test]
async fn docker_forked_kernels_name_the_setting() {
    docker_ready();
    failed_connections_name_the_setting("docker", true).await;
}

#[tokio::test]
async fn docker_plain_kernels_name_the_setting() {
    docker_ready();
    failed_connections_name_the_setting("docker", false).await;
}
