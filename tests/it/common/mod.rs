//! The shared harness of the integration tests: a real broker (real sandbox, real
//! ipykernel) on 127.0.0.1:0 with two users, and small HTTP and WebSocket clients.
#![allow(dead_code)]

pub mod engine;
pub mod forked;
pub mod host;
pub mod leftovers;
#[macro_use]
pub mod sandbox;
/// A PostgreSQL database of its own for a test (the crate's own helper).
#[allow(dead_code)]
#[path = "../../../src/db/postgres/testing.rs"]
pub mod pg;
pub mod scale;
pub mod spawned;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use kernel_broker::config::{ServeArgs, Settings};

#[allow(unused_imports)] // not every test binary asks which engine runs
pub use engine::{docker_cgroup_parent, docker_cli, docker_socket, is_podman};
pub use scale::scaled;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::Message as WsMessage;

pub const ALICE: &str = "alice-token-0001";
pub const BOB: &str = "bob-token-0002";

/// The users file of the test brokers: alice and bob.
pub fn users_toml() -> String {
    format!(
        "[[user]]\nname = \"alice\"\ntoken = \"{ALICE}\"\n\n[[user]]\nname = \"bob\"\ntoken = \"{BOB}\"\n"
    )
}

/// The value of the `/metrics` line that starts with `line_start` (labels included), read
/// from the broker at `base` as alice.
pub async fn metric(base: &str, line_start: &str) -> f64 {
    let text = reqwest::Client::new()
        .get(format!("{base}/metrics"))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_start:?} in\n{text}"))
}

/// A WebSocket to `url`, retried until the broker takes it (a place freed by a closed one
/// is given back when the broker sees the close).
pub async fn ws_connect_when_free(url: &str) -> Ws {
    within(10, "a place to free", async {
        loop {
            if let Ok((ws, _)) = tokio_tungstenite::connect_async(url).await {
                return ws;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

/// The directory of a broker's cgroup tree `name` where `pids` is: the v1 `pids` hierarchy,
/// else the unified one, off its root as root and off the test's own delegated cgroup
/// (the one above its `broker` leaf) unprivileged.
pub fn pids_cgroup_base(name: &str) -> PathBuf {
    let v1 = std::path::Path::new("/sys/fs/cgroup/pids");
    if v1.is_dir() {
        return v1.join(name);
    }
    if host::is_root() {
        return std::path::Path::new("/sys/fs/cgroup").join(name);
    }
    host::delegated_cgroup()
        .expect("the test's own cgroup in /proc/self/cgroup")
        .join(name)
}

/// `user`'s kernels' cgroup leaves (pids hierarchy) on the local sandbox, sorted.
pub fn user_leaves(broker: &Broker, user: &str) -> Vec<String> {
    subdirectories(&pids_cgroup_base(broker.cgroup_name()).join(user))
}

/// The names of the directories in `dir` (none when it is gone), sorted.
pub fn subdirectories(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Fail instead of hanging.
pub async fn within<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(scaled(Duration::from_secs(secs)), fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {secs} s: {what}"),
    }
}

pub struct Broker {
    pub addr: std::net::SocketAddr,
    pub data_dir: PathBuf,
    pub sandbox: &'static str,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<()>>,
    cgroup_name: String,
    _tmp: tempfile::TempDir,
}

/// The prefix of the test brokers' cgroup names (scripts/test checks none is left).
pub const CGROUP_PREFIX: &str = "kernel-broker-test-";

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

impl Broker {
    /// The broker's directory in the cgroup hierarchies.
    pub fn cgroup_name(&self) -> &str {
        &self.cgroup_name
    }

    /// Start a broker with the `sandbox` backend (`local` or `docker`); `tweak` adjusts the
    /// settings (limits, timeouts) for one test.
    pub async fn start(sandbox: &'static str, tweak: impl FnOnce(&mut ServeArgs)) -> Broker {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("KERNEL_BROKER_LOG")
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
        let tmp = tempfile::Builder::new()
            .prefix("kb-test-")
            .tempdir()
            .unwrap();
        let users = tmp.path().join("users.toml");
        std::fs::write(&users, users_toml()).unwrap();
        let mut args = ServeArgs {
            users_file: Some(users),
            data_dir: Some(tmp.path().join("data")),
            kernels_dir: Some(repo().join("kernels")),
            cgroup_name: Some(format!("{CGROUP_PREFIX}{}", uuid::Uuid::new_v4().simple())),
            // Tests count kernels and runtime directories; the pool is tested on its own.
            pool_size: Some(0),
            // Emulated hosts (scripts/vm without KVM) start kernels many times slower.
            launch_timeout: std::env::var("KERNEL_BROKER_LAUNCH_TIMEOUT")
                .ok()
                .and_then(|v| v.parse().ok())
                .or_else(|| {
                    (scale::time_scale() > 1.0).then(|| scaled(Duration::from_secs(30)).as_secs())
                }),
            sandbox: Some(match sandbox {
                "docker" => kernel_broker::config::SandboxKind::Docker,
                _ => kernel_broker::config::SandboxKind::Local,
            }),
            docker_socket: (sandbox == "docker").then(docker_socket),
            docker_cgroup_parent: (sandbox == "docker").then(docker_cgroup_parent).flatten(),
            ..Default::default()
        };
        tweak(&mut args);
        let cgroup_name = args.cgroup_name.clone().unwrap_or_default();
        let settings = Settings::resolve(args, None).unwrap();
        let data_dir = settings.data_dir.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            kernel_broker::server::serve(settings, listener, async {
                let _ = rx.await;
            })
            .await
            .expect("broker failed");
        });
        // Wait for /healthz.
        let http = reqwest::Client::new();
        within(30, "broker start", async {
            loop {
                if let Ok(r) = http.get(format!("http://{addr}/healthz")).send().await {
                    if r.status().is_success() {
                        break;
                    }
                }
                if handle.is_finished() {
                    panic!("the broker stopped during start-up");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        Broker {
            addr,
            data_dir,
            sandbox,
            shutdown: Some(tx),
            handle: Some(handle),
            cgroup_name,
            _tmp: tmp,
        }
    }

    /// Kernel runtime directories (sockets, connection file) that exist now.
    pub fn runtime_dirs(&self) -> usize {
        runtime_dirs(self.sandbox, &self.data_dir)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn api(&self, token: &str) -> Api {
        Api {
            http: reqwest::Client::new(),
            base: format!("http://{}", self.addr),
            token: token.to_string(),
        }
    }

    /// Stop the broker cleanly and wait for it.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.handle.take() {
            within(60, "broker shutdown", h).await.unwrap();
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // Not stopped: the test failed (or forgot). Its runtime is ending, so the broker's
        // shutdown will not finish: remove what it made (see `leftovers.rs`).
        if self.handle.take().is_some() {
            leftovers::remove_cgroups(&self.cgroup_name);
            if self.sandbox == "docker" {
                leftovers::remove_containers(&self.data_dir);
            } else if let Ok(base) =
                kernel_broker::sandbox::local::LocalSandboxConfig::new(&self.data_dir, "kernels")
                    .run_base()
            {
                let _ = std::fs::remove_dir_all(base);
            }
            leftovers::unmount_below(&self.data_dir);
        }
    }
}

#[derive(Clone)]
pub struct Api {
    pub http: reqwest::Client,
    pub base: String,
    pub token: String,
}

impl Api {
    /// The same client, connecting from `ip` (any 127.0.0.0/8 address reaches a loopback
    /// listener): a second client, as the broker counts them.
    pub fn connecting_from(self, ip: std::net::IpAddr) -> Api {
        Api {
            http: reqwest::Client::builder()
                .local_address(ip)
                .build()
                .unwrap(),
            ..self
        }
    }

    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{}", self.base, path))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = within(120, path, req.send()).await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, v)
    }

    pub async fn create(&self) -> String {
        let (status, s) = self
            .call(reqwest::Method::POST, "/v1/sessions", Some(json!({})))
            .await;
        assert_eq!(status, 201, "{s}");
        s["id"].as_str().unwrap().to_string()
    }

    pub async fn execute(&self, id: &str, code: &str) -> Value {
        self.execute_with(id, json!({"code": code})).await
    }

    pub async fn execute_with(&self, id: &str, body: Value) -> Value {
        let (status, v) = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/sessions/{id}/execute"),
                Some(body),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::DELETE, path, None).await
    }
}

pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub async fn ws_connect(broker: &Broker, id: &str, token: &str) -> Ws {
    let url = format!("ws://{}/v1/sessions/{id}/stream?token={token}", broker.addr);
    let (ws, _) = within(30, "ws connect", tokio_tungstenite::connect_async(url))
        .await
        .unwrap();
    ws
}

/// A Jupyter client of alice's on `/api/kernels/{id}/channels`, named `client` (its
/// `session_id`), in the legacy JSON framing.
pub async fn jupyter_channels(broker: &Broker, id: &str, client: &str) -> Ws {
    let url = format!(
        "ws://{}/api/kernels/{id}/channels?session_id={client}&token={ALICE}",
        broker.addr
    );
    let (ws, _) = within(
        30,
        "channels connect",
        tokio_tungstenite::connect_async(url),
    )
    .await
    .unwrap();
    ws
}

/// Sends a Jupyter request of `client`'s on `channel` over a [`jupyter_channels`] socket and
/// answers its msg_id.
pub async fn jupyter_send(
    ws: &mut Ws,
    client: &str,
    (channel, msg_type): (&str, &str),
    content: Value,
) -> String {
    let msg_id = uuid::Uuid::new_v4().to_string();
    let request = serde_json::json!({
        "header": {"msg_id": msg_id, "msg_type": msg_type, "session": client,
                   "username": "alice", "date": "2026-01-01T00:00:00.000000Z", "version": "5.3"},
        "parent_header": {}, "metadata": {}, "buffers": [], "channel": channel,
        "content": content
    });
    ws_send(ws, request).await;
    msg_id
}

pub async fn ws_send(ws: &mut Ws, v: Value) {
    ws.send(WsMessage::Text(v.to_string().into()))
        .await
        .unwrap();
}

/// Next JSON frame (skipping pings).
pub async fn ws_next(ws: &mut Ws) -> Value {
    loop {
        let m = within(120, "ws frame", ws.next())
            .await
            .expect("ws closed")
            .unwrap();
        if let WsMessage::Text(t) = m {
            return serde_json::from_str(t.as_str()).unwrap();
        }
    }
}

/// Frames until the `done` of `id` (inclusive).
pub async fn ws_until_done(ws: &mut Ws, id: &str) -> Vec<Value> {
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

/// Kernel runtime directories under a data directory for a backend: directories, not the
/// bootstrap script beside them (Docker) nor the broker's own directories (local `boot`,
/// `tools`).
pub fn runtime_dirs(sandbox: &str, data_dir: &std::path::Path) -> usize {
    let count = |d: PathBuf| {
        std::fs::read_dir(d)
            .map(|r| {
                r.flatten()
                    .filter(|e| {
                        e.path().is_dir() && e.file_name() != "boot" && e.file_name() != "tools"
                    })
                    .count()
            })
            .unwrap_or(0)
    };
    match sandbox {
        "docker" => std::fs::read_dir(data_dir.join("run-docker"))
            .map(|r| r.flatten().map(|user| count(user.path())).sum())
            .unwrap_or(0),
        _ => kernel_broker::sandbox::local::LocalSandboxConfig::new(data_dir, "kernels")
            .run_base()
            .map(count)
            .unwrap_or(0),
    }
}

/// Whether the Docker backend can run here (a daemon answers and the kernel image exists).
/// A Docker test that runs where it cannot fails, saying why: a skipped test must be reported
/// as skipped, never counted as passed. `scripts/test` leaves the Docker tests out where
/// Docker is missing (nextest's `no-docker` profile), so nextest counts them as skipped.
pub fn docker_ready() -> bool {
    let ok = docker_cli()
        .args(["image", "inspect", "kernel-broker/python-kernel:latest"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        panic!("{DOCKER_MISSING}");
    }
    ok
}

/// What a Docker test says when it cannot run.
pub const DOCKER_MISSING: &str = "this Docker test cannot run: no Docker daemon with the image \
     kernel-broker/python-kernel:latest. Start dockerd and build the image \
     (docker/build-offline.sh), or leave the Docker tests out: `cargo nextest run --profile \
     no-docker` (scripts/test does so by itself, and nextest reports them as skipped)";

/// One test per backend for each named `async fn name(sandbox: &'static str)`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod local {
            $(#[tokio::test] async fn $name() { super::$name("local").await })*
        }
        mod docker {
            $(#[tokio::test] async fn $name() {
                // Panics, saying why, where Docker cannot run (see `docker_ready`).
                super::common::docker_ready();
                super::$name("docker").await
            })*
        }
    };
}

/// Tests of what does not depend on the sandbox backend: once, on the local sandbox
/// (`<suite>::backend_independent::<test>`).
macro_rules! on_one_backend {
    ($($name:ident),* $(,)?) => {
        mod backend_independent {
            $(#[tokio::test] async fn $name() { super::$name("local").await })*
        }
    };
}

/// How the recording of session `id` ended, as its row in PostgreSQL says.
pub async fn pg_end_reason(client: &tokio_postgres::Client, id: &str) -> Option<String> {
    client
        .query_one("SELECT end_reason FROM sessions WHERE id = $1", &[&id])
        .await
        .unwrap()
        .get(0)
}

/// Whether CRIU 4 is installed where the broker looks; panics when CI requires it.
pub fn criu_ready() -> bool {
    let found = [
        "/usr/local/sbin/criu",
        "/usr/sbin/criu",
        "/usr/local/bin/criu",
    ]
    .iter()
    .any(|p| {
        std::process::Command::new(p)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("Version: 4"))
            .unwrap_or(false)
    });
    if !found && std::env::var("KB_REQUIRE_CRIU").as_deref() == Ok("1") {
        panic!("KB_REQUIRE_CRIU=1 but CRIU 4 is not installed: run scripts/setup-criu");
    }
    if !found {
        eprintln!("skipped: CRIU 4 is not installed (scripts/setup-criu)");
    }
    found
}

/// The first memory pages image in the CRIU image directory `dir`.
pub fn pages_image(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("pages-")
        })
        .expect("a pages image")
}

/// Damages a CRIU image directory `dir` as root could (no kernel reaches it): its first
/// memory pages image cut to half its length.
pub fn truncate_pages_image(dir: &std::path::Path) {
    let pages = pages_image(dir);
    let len = std::fs::metadata(&pages).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pages)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
}

/// Runs `code` as `client`'s `execute_request` over a [`jupyter_channels`] socket; the text
/// it printed (its first stream message).
pub async fn jupyter_print(ws: &mut Ws, client: &str, code: &str) -> String {
    let run = jupyter_send(
        ws,
        client,
        ("shell", "execute_request"),
        serde_json::json!({"code": code, "silent": false, "store_history": true,
               "user_expressions": {}, "allow_stdin": false, "stop_on_error": true}),
    )
    .await;
    loop {
        let v = ws_next(ws).await;
        if v["msg_type"] == "stream" && v["parent_header"]["msg_id"] == run.as_str() {
            return v["content"]["text"].as_str().unwrap().trim().to_string();
        }
    }
}
