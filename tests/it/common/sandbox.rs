//! The shared harness of the sandbox tests (`sandbox_contract.rs`, `sandbox_local.rs`,
//! `sandbox_docker.rs`): a sandbox of either backend with its own data directory (and, for
//! `local`, its own cgroup name; for `docker`, its own data-dir hash, hence container names
//! and labels), so tests run in parallel without touching each other; a guard that removes
//! what a test left even when an assertion fails; a kernel launched and connected over
//! ZeroMQ, to run code in; and the small helpers every test uses.
//!
//! Tests that cannot run: the local backend needs root (uid switching and cgroups), `bwrap`
//! and `kernels/.venv` (`kernels/setup.sh`); the docker backend needs a daemon and the kernel
//! image. Without them a test fails, saying why (a test that did not run is never counted as
//! passed); `scripts/test` leaves the Docker tests out where Docker is missing (nextest's
//! `no-docker` profile, `.config/nextest.toml`), and nextest reports them as skipped.
#![allow(dead_code)]

pub use super::engine;

#[allow(unused_imports)] // not every test binary asks which engine runs
pub use engine::{docker_cgroup_parent, docker_cli, docker_socket, is_podman};

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kernel_broker::kernel::{ConnectOptions, KernelClient, KernelEvent, KernelEvents};
use kernel_broker::sandbox::docker::{
    DockerSandbox, DockerSandboxConfig, DEFAULT_IMAGE, LABEL_DATA_DIR_HASH, LABEL_MANAGED,
};
use kernel_broker::sandbox::local::{LocalSandbox, LocalSandboxConfig};
use kernel_broker::sandbox::{
    ExitReason, KernelProcess, LaunchSpec, Launched, Sandbox, SandboxUser, UserLimits,
};
use kernel_broker::wire::Channel;
use serde_json::{json, Value};
use tokio::time::{sleep, timeout, Instant};
use uuid::Uuid;

/// Kernels of user `index` run as host uid `UID_BASE + index + 1` in the local sandbox.
pub const UID_BASE: u32 = 200_000;
/// The uid and gid of the docker image's `kernel` user.
pub const DOCKER_KERNEL_UID: u32 = 1000;
/// A test's whole bound on this machine ([`scaled`] elsewhere).
pub const TEST_TIMEOUT: Duration = Duration::from_secs(180);

use super::host;
use super::scale;
pub use host::{delegated_cgroup, euid, is_root};
pub use scale::scaled;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn venv_python() -> PathBuf {
    repo().join("kernels/.venv/bin/python")
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kernel_broker=debug".into()),
        )
        .try_init();
}

/// Why this machine cannot run the local sandbox, if it cannot.
pub fn local_skip_reason() -> Option<String> {
    if !is_root() {
        // An unprivileged broker needs a cgroup v2 subtree delegated to it (systemd's
        // `Delegate=yes`; `scripts/vm --user` runs the tests that way).
        let delegated = delegated_cgroup()
            .map(|d| d.join("cgroup.subtree_control"))
            .is_some_and(|f| std::fs::OpenOptions::new().write(true).open(f).is_ok());
        if !delegated {
            return Some(
                "not running as root, and the test's own cgroup is not a cgroup v2 \
                 subtree delegated to it (run as root, or as a user under `scripts/vm --user`)"
                    .into(),
            );
        }
    }
    if !Path::new("/usr/bin/bwrap").exists()
        && Command::new("bwrap").arg("--version").output().is_err()
    {
        return Some("bwrap is not installed".into());
    }
    if !venv_python().exists() {
        return Some("kernels/.venv is missing (run kernels/setup.sh)".into());
    }
    None
}

/// The host uid the local sandbox runs user `index`'s kernels as: their own as root; the
/// broker's, unprivileged (docs/HOSTS.md).
pub fn local_kernel_uid(index: u32) -> u32 {
    if is_root() {
        UID_BASE + index + 1
    } else {
        euid()
    }
}

/// Why this machine cannot run the docker sandbox, if it cannot.
pub fn docker_skip_reason() -> Option<String> {
    match docker_cli().arg("info").output() {
        Ok(out) if out.status.success() => {}
        _ => return Some("no docker daemon".into()),
    }
    match docker_cli()
        .args(["image", "inspect", DEFAULT_IMAGE])
        .output()
    {
        Ok(out) if out.status.success() => None,
        _ => Some(format!(
            "the image {DEFAULT_IMAGE} is missing (docker/build-offline.sh)"
        )),
    }
}

/// A local sandbox with its own data directory and cgroup tree; cleans both up when dropped.
pub struct LocalHarness {
    pub sandbox: LocalSandbox,
    pub dir: tempfile::TempDir,
    pub cgroup_name: String,
}

impl LocalHarness {
    pub fn new() -> Option<Self> {
        init_tracing();
        if let Some(reason) = local_skip_reason() {
            // Not a pass: the sandbox tests need root (kernels switch uid, use cgroups).
            panic!("this local sandbox test cannot run: {reason}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let cgroup_name = format!("kb-test-{}", &Uuid::new_v4().simple().to_string()[..12]);
        Some(Self::with(dir, cgroup_name))
    }

    pub fn with(dir: tempfile::TempDir, cgroup_name: String) -> Self {
        let mut cfg = LocalSandboxConfig::new(dir.path().join("data"), repo().join("kernels"));
        cfg.python = venv_python();
        cfg.uid_base = UID_BASE;
        cfg.cgroup_name = cgroup_name.clone();
        // The contract of a sandbox's own kernels (one sandbox, one runtime directory and
        // one process tree per kernel); kernels forked from a template are tested through
        // the API in tests/it/fork_server.rs.
        cfg.fork_server = false;
        cfg.launch_timeout = scaled(cfg.launch_timeout);
        let sandbox = LocalSandbox::new(cfg).expect("LocalSandbox::new");
        Self {
            sandbox,
            dir,
            cgroup_name,
        }
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The kernel's leaf directories in every hierarchy.
    pub fn leaf_dirs(&self, user: &str, session: Uuid) -> Vec<PathBuf> {
        cgroup_bases(&self.cgroup_name)
            .into_iter()
            .map(|b| b.join(user).join(session.to_string()))
            .collect()
    }

    pub fn user_dir(&self, ctrl_file: &str, user: &str) -> Option<PathBuf> {
        cgroup_bases(&self.cgroup_name)
            .into_iter()
            .map(|b| b.join(user))
            .find(|d| d.join(ctrl_file).exists())
    }

    pub fn rundir(&self, session: Uuid) -> PathBuf {
        self.sandbox.run_base().join(session.to_string())
    }

    /// Processes (host pids) whose cgroup is the kernel's leaf.
    pub fn processes_in_leaf(&self, user: &str, session: Uuid) -> Vec<i32> {
        let suffix = format!("/{}/{user}/{session}", self.cgroup_name);
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) {
                if text.lines().any(|l| l.ends_with(&suffix)) {
                    pids.push(pid);
                }
            }
        }
        pids
    }
}

impl Drop for LocalHarness {
    fn drop(&mut self) {
        // Whatever the test left (it may have failed half-way): kill and remove, bottom up.
        for base in cgroup_bases(&self.cgroup_name) {
            for user in subdirs(&base) {
                for leaf in subdirs(&user) {
                    kill_and_rmdir(&leaf);
                }
                kill_and_rmdir(&user);
            }
            kill_and_rmdir(&base);
        }
        // As root the runtime base lives under /run, outside the temporary directory; it
        // is empty once every kernel is reaped (a no-op if not).
        let _ = std::fs::remove_dir(self.sandbox.run_base());
    }
}

fn kill_and_rmdir(dir: &Path) {
    for _ in 0..200 {
        let pids = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .map(|e| e.path())
        .collect()
}

/// The test's cgroup base in every hierarchy the sandbox uses (v1: memory, cpu, pids; v2: one).
pub fn cgroup_bases(name: &str) -> Vec<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut v1 = Vec::new();
    let mut v2 = None;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let opts: BTreeSet<&str> = f[3].split(',').collect();
        if f[2] == "cgroup" && ["memory", "cpu", "pids"].iter().any(|c| opts.contains(c)) {
            v1.push(PathBuf::from(f[1]).join(name));
        }
        if f[2] == "cgroup2" {
            let controllers = std::fs::read_to_string(Path::new(f[1]).join("cgroup.controllers"))
                .unwrap_or_default();
            if controllers.contains("memory") {
                v2 = Some(PathBuf::from(f[1]).join(name));
            }
        }
    }
    match v2 {
        // Unprivileged, the tree hangs off the broker's own delegated cgroup.
        Some(_) if !is_root() => delegated_cgroup()
            .map(|d| d.join(name))
            .into_iter()
            .collect(),
        Some(v2) => vec![v2],
        None => v1,
    }
}

/// A docker sandbox with its own data directory; removes its containers when dropped.
pub struct DockerHarness {
    pub sandbox: DockerSandbox,
    _dir: tempfile::TempDir,
}

impl DockerHarness {
    pub fn new() -> Option<Self> {
        Self::with(|_| {})
    }

    pub fn with(tweak: impl FnOnce(&mut DockerSandboxConfig)) -> Option<Self> {
        init_tracing();
        if let Some(reason) = docker_skip_reason() {
            // A test that cannot run fails, saying why (scripts/test leaves the Docker tests
            // out where Docker is missing, and nextest reports them as skipped).
            panic!(
                "this Docker test cannot run: {reason}. Start dockerd and build the image \
                 (docker/build-offline.sh), or leave the Docker tests out: `cargo nextest run \
                 --profile no-docker` (scripts/test does so by itself; nextest reports them as \
                 skipped)"
            );
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = DockerSandboxConfig::new(dir.path().join("data"));
        cfg.socket = docker_socket();
        cfg.cgroup_parent = docker_cgroup_parent();
        // KB_DOCKER_FORK_SERVER=0: plain starts (an exec per kernel), as an unprivileged
        // broker's, which the fork server (root only) otherwise hides from a root run.
        if std::env::var("KB_DOCKER_FORK_SERVER").as_deref() == Ok("0") {
            cfg.fork_server = false;
        }
        // An emulated engine (scripts/vm) answers slowly while it removes containers.
        cfg.api_timeout = scaled(cfg.api_timeout).min(Duration::from_secs(600));
        tweak(&mut cfg);
        let sandbox = DockerSandbox::new(cfg).expect("DockerSandbox::new");
        Some(Self { sandbox, _dir: dir })
    }

    fn label_filter(&self) -> String {
        format!(
            "label={LABEL_DATA_DIR_HASH}={}",
            self.sandbox.data_dir_hash()
        )
    }

    /// Names of this harness's containers (running or not).
    pub fn containers(&self) -> Vec<String> {
        let out = docker_cli()
            .args([
                "ps",
                "-a",
                "--filter",
                &format!("label={LABEL_MANAGED}=true"),
                "--filter",
                &self.label_filter(),
                "--format",
                "{{.Names}}",
            ])
            .output()
            .expect("docker ps");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    pub fn workspace_of(&self, user: &SandboxUser) -> PathBuf {
        self.sandbox.workspace(user).expect("workspace")
    }
}

impl Drop for DockerHarness {
    fn drop(&mut self) {
        for name in self.containers() {
            let _ = docker_cli().args(["rm", "-f", &name]).output();
        }
        // The users' parent cgroups (empty once the containers went), in every hierarchy.
        let base = format!("kernel-broker-docker-{}", self.sandbox.data_dir_hash());
        let hierarchies = std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .chain([PathBuf::from("/sys/fs/cgroup")]);
        for dir in hierarchies.map(|h| h.join(&base)) {
            for user in subdirs(&dir) {
                // Podman leaves its monitors' `conmon` cgroup in each parent.
                for child in subdirs(&user) {
                    let _ = std::fs::remove_dir(child);
                }
                let _ = std::fs::remove_dir(user);
            }
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A sandbox of either backend, for the tests both backends must pass.
pub enum Harness {
    // Boxed: the local harness is much the larger.
    Local(Box<LocalHarness>),
    Docker(DockerHarness),
}

impl Harness {
    /// `backend` is `local` or `docker`; `None`: skipped (see the module comment).
    pub fn new(backend: &str) -> Option<Self> {
        match backend {
            "local" => LocalHarness::new().map(|h| Harness::Local(Box::new(h))),
            "docker" => DockerHarness::new().map(Harness::Docker),
            other => panic!("no sandbox backend {other:?}"),
        }
    }

    pub fn sandbox(&self) -> &dyn Sandbox {
        match self {
            Harness::Local(h) => &h.sandbox,
            Harness::Docker(h) => &h.sandbox,
        }
    }

    /// The host uid (and gid) the user's kernels run as.
    pub fn kernel_uid(&self, user: &SandboxUser) -> u32 {
        match self {
            Harness::Local(_) => local_kernel_uid(user.index),
            Harness::Docker(_) => DOCKER_KERNEL_UID,
        }
    }

    /// The runtime directories of the user's live kernels (the local backend's are per
    /// session, not per user: there, every live kernel's).
    pub fn runtime_dirs(&self, user: &SandboxUser) -> Vec<PathBuf> {
        match self {
            // Not the broker's own directories (the bootstrap script's, the tools').
            Harness::Local(h) => subdirs(h.sandbox.run_base())
                .into_iter()
                .filter(|d| !d.ends_with("boot") && !d.ends_with("tools"))
                .collect(),
            // A kernel's session directory, not the user's fork-server template's (`t...`,
            // never a hex digit), which lives on with the user's container.
            Harness::Docker(h) => subdirs(&h.sandbox.run_base().join(&user.name))
                .into_iter()
                .filter(|d| {
                    !d.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('t'))
                })
                .collect(),
        }
    }

    pub fn workspace_of(&self, user: &SandboxUser) -> PathBuf {
        self.sandbox().workspace(user).expect("workspace")
    }
}

pub fn user(name: &str, index: u32, limits: UserLimits) -> SandboxUser {
    SandboxUser {
        name: name.into(),
        index,
        limits,
    }
}

/// A user's limits where one kernel may take the whole of them (its own limits equal the
/// user's totals).
pub fn limits(memory_mib: u64, pids: u64) -> UserLimits {
    UserLimits {
        memory_bytes: memory_mib << 20,
        cpus: 1.0,
        pids,
        session_memory_bytes: memory_mib << 20,
        session_pids: pids,
        ..UserLimits::default()
    }
}

/// A launch of the `python3` kernel for `user` with a fresh session and key, and two test
/// variables in its environment.
pub fn spec(user: &SandboxUser) -> LaunchSpec {
    LaunchSpec {
        session_id: Uuid::new_v4(),
        user: user.clone(),
        kernel_name: "python3".into(),
        key: hex::encode(rand::random::<[u8; 32]>()),
        env: vec![
            ("KB_TEST".into(), "1".into()),
            ("KB_TEST_VAR".into(), "hello-env".into()),
        ],
        limits: user.limits.kernel(None),
        own_workspace: None,
    }
}

/// Runs a test body under [`TEST_TIMEOUT`].
pub async fn bounded<F: Future<Output = ()>>(body: F) {
    timeout(scaled(TEST_TIMEOUT), body)
        .await
        .expect("test took longer than its timeout");
}

/// Polls `cond` every 50 ms until it holds or `limit` passes.
pub async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + scaled(limit);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        sleep(Duration::from_millis(50)).await;
    }
}

pub async fn wait_exit(process: &dyn KernelProcess, limit: Duration) -> ExitReason {
    timeout(scaled(limit), process.wait())
        .await
        .expect("the kernel did not end in time")
}

/// A launched and connected kernel.
pub struct Kernel {
    pub session_id: Uuid,
    pub launched: Launched,
    pub client: KernelClient,
    pub events: KernelEvents,
}

/// What one execution produced.
#[derive(Debug, Default)]
pub struct Outcome {
    pub stdout: String,
    pub stderr: String,
    pub result: Option<String>,
    /// `ename: evalue`
    pub error: Option<String>,
}

impl Outcome {
    pub fn out(&self) -> String {
        self.stdout.trim().to_string()
    }
}

pub async fn start(sandbox: &dyn Sandbox, user: &SandboxUser) -> Kernel {
    start_timed(sandbox, user).await.0
}

/// Launches and connects; also says how long `launch` took.
pub async fn start_timed(sandbox: &dyn Sandbox, user: &SandboxUser) -> (Kernel, Duration) {
    start_spec(sandbox, spec(user)).await
}

/// Launches `spec` and connects; also says how long `launch` took.
pub async fn start_spec(sandbox: &dyn Sandbox, spec: LaunchSpec) -> (Kernel, Duration) {
    let key = spec.key.clone();
    let session_id = spec.session_id;
    let t0 = Instant::now();
    let launched = timeout(scaled(Duration::from_secs(90)), sandbox.launch(spec))
        .await
        .expect("launch timed out")
        .expect("launch");
    let launch_time = t0.elapsed();
    let (client, events, _info) = KernelClient::connect(
        &launched.endpoints,
        &key,
        "test",
        ConnectOptions::default(),
        scaled(Duration::from_secs(60)),
    )
    .await
    .expect("connect to the kernel");
    let kernel = Kernel {
        session_id,
        launched,
        client,
        events,
    };
    (kernel, launch_time)
}

impl Kernel {
    pub fn process(&self) -> &dyn KernelProcess {
        self.launched.process.as_ref()
    }

    /// Sends the code and waits for the shell reply.
    pub async fn send(&mut self, code: &str) -> String {
        let msg = self.client.request(
            "execute_request",
            &json!({
                "code": code,
                "silent": false,
                "store_history": false,
                "user_expressions": {},
                "allow_stdin": false,
                "stop_on_error": true,
            }),
        );
        self.client
            .send(Channel::Shell, &msg)
            .await
            .expect("send execute_request");
        msg.msg_id
    }

    /// Collects the output of `msg_id` until iopub says idle for it.
    pub async fn collect(&mut self, msg_id: &str, limit: Duration) -> Outcome {
        self.collect_until(msg_id, limit, |_| false).await
    }

    /// Collects the output of `msg_id` until `enough` holds of what came so far, or iopub
    /// says idle for it.
    pub async fn collect_until(
        &mut self,
        msg_id: &str,
        limit: Duration,
        mut enough: impl FnMut(&Outcome) -> bool,
    ) -> Outcome {
        let mut outcome = Outcome::default();
        let limit = scaled(limit);
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let event = timeout(left, self.events.recv())
                .await
                .unwrap_or_else(|_| panic!("no idle status within {limit:?}; so far {outcome:?}"))
                .expect("the kernel connection closed");
            let KernelEvent::Message(Channel::Iopub, m) = event else {
                continue;
            };
            if m.parent_msg_id.as_deref() != Some(msg_id) {
                continue;
            }
            let content: Value = serde_json::from_slice(&m.content).unwrap_or(Value::Null);
            match m.msg_type.as_str() {
                "stream" => {
                    let text = content["text"].as_str().unwrap_or_default();
                    if content["name"] == "stderr" {
                        outcome.stderr.push_str(text);
                    } else {
                        outcome.stdout.push_str(text);
                    }
                }
                "execute_result" => {
                    outcome.result = content["data"]["text/plain"].as_str().map(str::to_string)
                }
                "error" => {
                    outcome.error = Some(format!(
                        "{}: {}",
                        content["ename"].as_str().unwrap_or_default(),
                        content["evalue"].as_str().unwrap_or_default()
                    ))
                }
                "status" if content["execution_state"] == "idle" => return outcome,
                _ => {}
            }
            if enough(&outcome) {
                return outcome;
            }
        }
    }

    pub async fn run(&mut self, code: &str) -> Outcome {
        let id = self.send(code).await;
        self.collect(&id, Duration::from_secs(60)).await
    }
}

/// One test per backend for each named `async fn name(backend: &'static str)`; a backend
/// that cannot run here is skipped inside [`Harness::new`].
#[macro_export]
macro_rules! sandbox_contract {
    ($($name:ident),* $(,)?) => {
        mod local {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name("local").await })*
        }
        mod docker {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name("docker").await })*
        }
    };
}
