//! The docker sandbox against a real Docker daemon and the real kernel image.
//!
//! Each test gets its own data directory, hence its own data-dir hash, container names
//! and labels, so tests run in parallel without touching each other's containers. Without
//! a daemon (`docker info` fails) or without the image, each test prints why it is skipped
//! and passes; CI starts dockerd and builds the image (`.ci/docker-setup.sh`). Every wait
//! has a timeout, and a guard force-removes the test's containers even when an assertion
//! fails.

use std::future::Future;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kernel_broker::kernel::{ConnectOptions, KernelClient, KernelEvent, KernelEvents};
use kernel_broker::sandbox::docker::{
    DockerSandbox, DockerSandboxConfig, DEFAULT_IMAGE, LABEL_DATA_DIR_HASH, LABEL_MANAGED,
};
use kernel_broker::sandbox::{
    ExitReason, KernelProcess, LaunchSpec, Launched, Sandbox, SandboxError, SandboxUser, UserLimits,
};
use kernel_broker::wire::Channel;
use serde_json::{json, Value};
use tokio::time::{sleep, timeout, Instant};
use uuid::Uuid;

const TEST_TIMEOUT: Duration = Duration::from_secs(180);

/// Why this machine cannot run these tests, if it cannot.
fn skip_reason() -> Option<String> {
    match Command::new("docker").arg("info").output() {
        Ok(out) if out.status.success() => {}
        _ => return Some("no docker daemon".into()),
    }
    match Command::new("docker")
        .args(["image", "inspect", DEFAULT_IMAGE])
        .output()
    {
        Ok(out) if out.status.success() => None,
        _ => Some(format!(
            "the image {DEFAULT_IMAGE} is missing (docker/build-offline.sh)"
        )),
    }
}

/// A sandbox with its own data directory; removes its containers when dropped.
struct Harness {
    sandbox: DockerSandbox,
    _dir: tempfile::TempDir,
}

impl Harness {
    fn new() -> Option<Self> {
        Self::with(|_| {})
    }

    fn with(tweak: impl FnOnce(&mut DockerSandboxConfig)) -> Option<Self> {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "kernel_broker=debug".into()),
            )
            .try_init();
        if let Some(reason) = skip_reason() {
            // CI sets up Docker and sets KB_REQUIRE_DOCKER=1: there, skipping is a failure.
            if std::env::var("KB_REQUIRE_DOCKER").as_deref() == Ok("1") {
                panic!("KB_REQUIRE_DOCKER=1 but {reason}");
            }
            eprintln!("skipping: {reason}");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = DockerSandboxConfig::new(dir.path().join("data"));
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
    fn containers(&self) -> Vec<String> {
        let out = Command::new("docker")
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

    fn workspace_of(&self, user: &SandboxUser) -> PathBuf {
        self.sandbox.workspace(user).expect("workspace")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        for name in self.containers() {
            let _ = Command::new("docker").args(["rm", "-f", &name]).output();
        }
    }
}

fn user(name: &str, index: u32, limits: UserLimits) -> SandboxUser {
    SandboxUser {
        name: name.into(),
        index,
        limits,
    }
}

fn limits(memory_mib: u64, pids: u64) -> UserLimits {
    UserLimits {
        memory_bytes: memory_mib << 20,
        cpus: 1.0,
        pids,
        ..UserLimits::default()
    }
}

fn spec(user: &SandboxUser) -> LaunchSpec {
    LaunchSpec {
        session_id: Uuid::new_v4(),
        user: user.clone(),
        kernel_name: "python3".into(),
        key: hex::encode(rand::random::<[u8; 32]>()),
        env: vec![("KB_TEST_VAR".into(), "hello-env".into())],
    }
}

async fn bounded<F: Future<Output = ()>>(body: F) {
    timeout(TEST_TIMEOUT, body)
        .await
        .expect("the test took too long");
}

async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_exit(process: &dyn KernelProcess, limit: Duration) -> ExitReason {
    timeout(limit, process.wait())
        .await
        .expect("the kernel did not end in time")
}

/// A launched and connected kernel.
struct Kernel {
    launched: Launched,
    client: KernelClient,
    events: KernelEvents,
}

/// What one execution produced.
#[derive(Debug, Default)]
struct Outcome {
    stdout: String,
    stderr: String,
    result: Option<String>,
    /// `ename: evalue`
    error: Option<String>,
}

impl Outcome {
    fn out(&self) -> String {
        self.stdout.trim().to_string()
    }
}

async fn start(h: &Harness, user: &SandboxUser) -> Kernel {
    start_timed(h, user).await.0
}

/// Launches and connects; also says how long `launch` took.
async fn start_timed(h: &Harness, user: &SandboxUser) -> (Kernel, Duration) {
    let spec = spec(user);
    let key = spec.key.clone();
    let t0 = Instant::now();
    let launched = timeout(Duration::from_secs(90), h.sandbox.launch(spec))
        .await
        .expect("launch timed out")
        .expect("launch");
    let launch_time = t0.elapsed();
    let (client, events, _info) = KernelClient::connect(
        &launched.endpoints,
        &key,
        "test",
        ConnectOptions::default(),
        Duration::from_secs(60),
    )
    .await
    .expect("connect to the kernel");
    let kernel = Kernel {
        launched,
        client,
        events,
    };
    (kernel, launch_time)
}

impl Kernel {
    fn process(&self) -> &dyn KernelProcess {
        self.launched.process.as_ref()
    }

    /// Sends the code and waits for the shell reply.
    async fn send(&mut self, code: &str) -> String {
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
    async fn collect(&mut self, msg_id: &str, limit: Duration) -> Outcome {
        let mut outcome = Outcome::default();
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
        }
    }

    async fn run(&mut self, code: &str) -> Outcome {
        let id = self.send(code).await;
        self.collect(&id, Duration::from_secs(60)).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kernel_runs_isolated_as_uid_1000_without_network_or_host_files() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        h.sandbox.check().await.expect("check");
        let alice = user("alice", 0, UserLimits::default());
        let mut k = start(&h, &alice).await;

        let o = k.run("print('hello', 6 * 7)\n6 * 7").await;
        assert_eq!(o.out(), "hello 42", "{o:?}");
        assert_eq!(o.result.as_deref(), Some("42"));
        let o = k.run("import os; print(os.environ['KB_TEST_VAR'], os.getcwd())").await;
        assert_eq!(o.out(), "hello-env /workspace", "{o:?}");

        // No network: only loopback, and no route out.
        let o = k
            .run(
                "import socket\n\
                 print(sorted(n for _, n in socket.if_nameindex()))\n\
                 try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\n    print('connected')\n\
                 except OSError as e:\n    print('blocked', type(e).__name__)",
            )
            .await;
        let lines: Vec<&str> = o.stdout.lines().collect();
        assert_eq!(lines.first().copied(), Some("['lo']"), "{o:?}");
        assert!(lines.get(1).is_some_and(|l| l.starts_with("blocked")), "{o:?}");

        // Host files are not visible: a marker in the host's /tmp is absent, /etc/shadow is
        // the image's (not readable anyway), and the root file system is read-only.
        let marker = PathBuf::from(format!("/tmp/kb-docker-marker-{}", Uuid::new_v4().simple()));
        std::fs::write(&marker, b"host secret").unwrap();
        let o = k
            .run(&format!(
                "import os\n\
                 print(os.path.exists({marker:?}))\n\
                 try:\n    open('/etc/shadow').read(); print('shadow readable')\n\
                 except OSError as e:\n    print('shadow', type(e).__name__)\n\
                 try:\n    open('/usr/x', 'w'); print('rootfs writable')\n\
                 except OSError as e:\n    print('rootfs', e.errno)\n\
                 open('/tmp/scratch', 'w').write('ok'); print('tmp ok')",
                marker = marker.to_str().unwrap()
            ))
            .await;
        std::fs::remove_file(&marker).unwrap();
        assert_eq!(
            o.out(),
            "False\nshadow PermissionError\nrootfs 30\ntmp ok",
            "{o:?}"
        );

        // uid/gid 1000, no capabilities, no_new_privs.
        let o = k
            .run(
                "import os\n\
                 st = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n\
                 print(os.getuid(), os.getgid(), st['CapEff'].strip(), st['CapBnd'].strip(), st['NoNewPrivs'].strip())",
            )
            .await;
        assert_eq!(
            o.out(),
            "1000 1000 0000000000000000 0000000000000000 1",
            "{o:?}"
        );

        // The workspace is the host directory, owned by 1000.
        let o = k.run("open('/workspace/hello.txt', 'w').write('from the kernel')").await;
        assert!(o.error.is_none(), "{o:?}");
        let ws = h.workspace_of(&alice);
        assert_eq!(
            std::fs::read_to_string(ws.join("hello.txt")).unwrap(),
            "from the kernel"
        );
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid(2) cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(std::fs::metadata(&ws).unwrap().uid(), 1000);
        }

        k.process().terminate().await;
        assert_eq!(wait_exit(k.process(), Duration::from_secs(5)).await, ExitReason::Terminated);
        // Idempotent.
        k.process().terminate().await;
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminate_kills_the_kernel_and_removes_its_runtime_directory() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let mut k = start(&h, &alice).await;
        let o = k.run("import os; print(os.getpid(), os.getppid())").await;
        let (pid, parent) = o
            .out()
            .split_once(' ')
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .unwrap();
        let run_dir = h.sandbox.run_base().join("alice");
        let sessions: Vec<_> = std::fs::read_dir(&run_dir).unwrap().flatten().collect();
        assert_eq!(sessions.len(), 1);
        let session_dir = sessions[0].path();
        assert_eq!(
            std::fs::read_to_string(session_dir.join("pid"))
                .unwrap()
                .trim(),
            parent,
            "the pid file names the kernel's tini"
        );

        k.process().terminate().await;
        assert_eq!(k.process().wait().await, ExitReason::Terminated);
        assert!(!session_dir.exists(), "the runtime directory is left");
        // The process is gone from the container; the container itself stays.
        let name = h.sandbox.container_name("alice");
        let out = Command::new("docker")
            .args([
                "exec",
                &name,
                "sh",
                "-c",
                &format!("test -d /proc/{pid} && echo alive || echo gone"),
            ])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "gone");
        assert!(k.process().interrupt().await.is_err());
        h.sandbox.shutdown().await;
    })
    .await;
}

/// Pids of the live (not zombie) processes in a container, except the one listing them.
fn live_pids(container: &str) -> Vec<u32> {
    let script = "import os\n\
                  me = os.getpid()\n\
                  for d in os.listdir('/proc'):\n\
                  \x20   if d.isdigit() and int(d) != me:\n\
                  \x20       try: stat = open('/proc/%s/stat' % d).read()\n\
                  \x20       except OSError: continue\n\
                  \x20       if stat[stat.rindex(')') + 2] != 'Z': print(d)";
    let out = Command::new("docker")
        .args(["exec", container, "python", "-I", "-S", "-c", script])
        .output()
        .expect("docker exec");
    assert!(out.status.success(), "{out:?}");
    let mut pids: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.parse().expect("a pid"))
        .collect();
    pids.sort_unstable();
    pids
}

/// Code that starts a child `sleep` and a double-forked daemon, and prints their pids.
const CHILD_AND_DAEMON: &str = "import subprocess, sys, time\n\
    child = subprocess.Popen(['sleep', '1000'], start_new_session=True)\n\
    daemon = 'import os, sys, time\\n\
    if os.fork(): os._exit(0)\\n\
    os.setsid()\\n\
    if os.fork(): os._exit(0)\\n\
    print(os.getpid(), flush=True)\\n\
    os.close(1)\\n\
    time.sleep(1000)'\n\
    p = subprocess.Popen([sys.executable, '-c', daemon], stdout=subprocess.PIPE, text=True)\n\
    daemon_pid = p.stdout.readline().strip()\n\
    p.wait()\n\
    print(child.pid, daemon_pid)";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_process_outlives_its_session_and_other_sessions_keep_theirs() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let container = h.sandbox.container_name("alice");
        // The user's other session, started first, with a child and a daemon of its own.
        let mut other = start(&h, &alice).await;
        let o = other.run(CHILD_AND_DAEMON).await;
        let other_pids: Vec<u32> = o
            .out()
            .split(' ')
            .map(|p| p.parse().unwrap_or_else(|_| panic!("{o:?}")))
            .collect();
        assert_eq!(other_pids.len(), 2, "{o:?}");
        let before = live_pids(&container);

        let mut k = start(&h, &alice).await;
        let o = k.run(CHILD_AND_DAEMON).await;
        let mut escaped: Vec<u32> = o
            .out()
            .split(' ')
            .map(|p| p.parse().unwrap_or_else(|_| panic!("{o:?}")))
            .collect();
        // A process deaf to the polite signals, and one that forks on and on (its pid
        // changes every few milliseconds; it is caught by the whole-container comparison).
        let o = k
            .run(
                "import subprocess, sys\n\
                 deaf = 'import os, signal, time\\n\
                 for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\\n\
                 print(os.getpid(), flush=True)\\n\
                 time.sleep(1000)'\n\
                 p = subprocess.Popen([sys.executable, '-c', deaf], stdout=subprocess.PIPE, text=True)\n\
                 print(p.stdout.readline().strip())\n\
                 runner = 'import os, time\\n\
                 while True:\\n\
                 \x20   if os.fork(): os._exit(0)\\n\
                 \x20   time.sleep(0.005)'\n\
                 subprocess.Popen([sys.executable, '-c', runner], start_new_session=True)",
            )
            .await;
        escaped.push(o.out().parse().unwrap_or_else(|_| panic!("{o:?}")));
        let during = live_pids(&container);
        for pid in &escaped {
            assert!(during.contains(pid), "{pid} is not running: {during:?}");
        }

        let t0 = Instant::now();
        k.process().terminate().await;
        assert_eq!(k.process().wait().await, ExitReason::Terminated);
        let took = t0.elapsed();
        eprintln!("terminate with escaped processes took {took:?}");
        assert!(took < Duration::from_secs(5), "terminate took {took:?}");
        let after = live_pids(&container);
        for pid in &escaped {
            assert!(!after.contains(pid), "{pid} outlived its session: {after:?}");
        }
        let left: Vec<_> = after.iter().filter(|p| !before.contains(p)).collect();
        assert!(left.is_empty(), "processes left by the session: {left:?}");
        // The other session, its child and its daemon are untouched.
        for pid in &other_pids {
            assert!(after.contains(pid), "the other session's {pid} was killed");
        }
        assert_eq!(other.run("print(6 * 7)").await.out(), "42");
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kernel_that_exits_by_itself_leaves_no_process_behind() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let container = h.sandbox.container_name("alice");
        let mut other = start(&h, &alice).await;
        assert_eq!(other.run("print(1)").await.out(), "1");
        let before = live_pids(&container);
        let mut k = start(&h, &alice).await;
        let o = k.run(CHILD_AND_DAEMON).await;
        let escaped: Vec<u32> = o
            .out()
            .split(' ')
            .map(|p| p.parse().unwrap_or_else(|_| panic!("{o:?}")))
            .collect();
        // The kernel ends on its own, not through terminate.
        let _ = k.send("import os; os._exit(3)").await;
        assert_eq!(
            wait_exit(k.process(), Duration::from_secs(30)).await,
            ExitReason::Exited(3)
        );
        let after = live_pids(&container);
        for pid in &escaped {
            assert!(!after.contains(pid), "{pid} outlived its kernel: {after:?}");
        }
        let left: Vec<_> = after.iter().filter(|p| !before.contains(p)).collect();
        assert!(left.is_empty(), "processes left by the kernel: {left:?}");
        assert_eq!(other.run("print(2)").await.out(), "2");
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fork_bomb_hits_the_pids_limit_and_the_kernel_survives() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, limits(1024, 64));
        let mut k = start(&h, &alice).await;
        let o = k
            .run(
                "import os, time\n\
                 pids, err, t0 = [], None, time.time()\n\
                 try:\n\
                 \x20   while time.time() - t0 < 20 and len(pids) < 2000:\n\
                 \x20       pid = os.fork()\n\
                 \x20       if pid == 0:\n\
                 \x20           time.sleep(60); os._exit(0)\n\
                 \x20       pids.append(pid)\n\
                 except OSError as e:\n\
                 \x20   err = e\n\
                 for p in pids: os.kill(p, 9)\n\
                 for p in pids: os.waitpid(p, 0)\n\
                 print(len(pids), type(err).__name__)",
            )
            .await;
        let out = o.out();
        let (n, err) = out.split_once(' ').unwrap_or_else(|| panic!("{o:?}"));
        let n: usize = n.parse().unwrap();
        assert!(n < 64, "forked {n} processes under a limit of 64");
        assert_eq!(err, "BlockingIOError", "{o:?}");
        let o = k.run("print('still here')").await;
        assert_eq!(o.out(), "still here");
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_memory_bomb_kills_only_its_own_kernel() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, limits(512, 256));
        let mut victim = start(&h, &alice).await;
        let mut bystander = start(&h, &alice).await;
        let id = victim
            .send("chunks = []\nwhile True:\n    chunks.append(b'x' * (16 << 20))")
            .await;
        let reason = wait_exit(victim.process(), Duration::from_secs(60)).await;
        assert_eq!(
            reason,
            ExitReason::OutOfMemory {
                limit_bytes: 512 << 20
            }
        );
        drop(id);
        let o = bystander.run("print(sum(range(10)))").await;
        assert_eq!(o.out(), "45", "{o:?}");
        // The container survived; a new kernel starts in it.
        let mut again = start(&h, &alice).await;
        assert_eq!(again.run("print('new')").await.out(), "new");
        // A kernel killed by SIGKILL without OOM is not mistaken for one.
        again.run("import os, signal").await;
        again.send("os.kill(os.getpid(), signal.SIGKILL)").await;
        assert_eq!(
            wait_exit(again.process(), Duration::from_secs(30)).await,
            ExitReason::Signaled(9)
        );
        // And a plain exit is an exit.
        bystander.send("import os; os._exit(3)").await;
        assert_eq!(
            wait_exit(bystander.process(), Duration::from_secs(30)).await,
            ExitReason::Exited(3)
        );
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn users_get_separate_containers_and_workspaces() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let bob = user("bob", 1, UserLimits::default());
        let (mut a, mut b) = tokio::join!(start(&h, &alice), start(&h, &bob));
        a.run("open('/workspace/secret.txt', 'w').write('alice only')").await;
        // Bob sees neither alice's workspace nor her runtime directory (and cannot list
        // his own /run/kernel: kernels reach their session directory by name only).
        let alice_dir = std::fs::read_dir(h.sandbox.run_base().join("alice"))
            .unwrap()
            .flatten()
            .next()
            .unwrap()
            .file_name()
            .into_string()
            .unwrap();
        let o = b
            .run(&format!(
                "import os\n\
                 print(os.path.exists('/workspace/secret.txt'), os.path.exists('/run/kernel/{alice_dir}'))\n\
                 try:\n    os.listdir('/run/kernel')\nexcept PermissionError:\n    print('unlistable')"
            ))
            .await;
        assert_eq!(o.out(), "False False\nunlistable", "{o:?}");
        assert!(h.workspace_of(&alice).join("secret.txt").exists());
        assert!(!h.workspace_of(&bob).join("secret.txt").exists());
        // Two containers, one per user; bob cannot see alice's processes.
        let mut names = h.containers();
        names.sort();
        assert_eq!(
            names,
            vec![h.sandbox.container_name("alice"), h.sandbox.container_name("bob")]
        );
        let o = b
            .run("import os\n\
                  files = set()\n\
                  for p in os.listdir('/proc'):\n\
                  \x20   if p.isdigit():\n\
                  \x20       files.update(a for a in open(f'/proc/{p}/cmdline').read().split('\\0') if a.endswith('connection.json'))\n\
                  print(len(files))")
            .await;
        assert_eq!(o.out(), "1", "{o:?}");
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_launches_of_one_user_share_one_container() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let (mut a, mut b, mut c) =
            tokio::join!(start(&h, &alice), start(&h, &alice), start(&h, &alice));
        for k in [&mut a, &mut b, &mut c] {
            assert_eq!(k.run("print(1)").await.out(), "1");
        }
        assert_eq!(h.containers(), vec![h.sandbox.container_name("alice")]);
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn interrupt_stops_a_long_sleep() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let mut k = start(&h, &alice).await;
        let id = k.send("import time\ntime.sleep(60)").await;
        sleep(Duration::from_secs(1)).await;
        let t0 = Instant::now();
        k.process().interrupt().await.expect("interrupt");
        let o = k.collect(&id, Duration::from_secs(20)).await;
        assert!(
            o.error
                .as_deref()
                .is_some_and(|e| e.starts_with("KeyboardInterrupt")),
            "{o:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert_eq!(k.run("print('alive')").await.out(), "alive");
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_users_container_is_removed_and_recreated_on_demand() {
    let Some(h) = Harness::with(|cfg| cfg.container_idle = Duration::from_secs(1)) else {
        return;
    };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let k = start(&h, &alice).await;
        let name = h.sandbox.container_name("alice");
        assert_eq!(h.containers(), vec![name.clone()]);
        k.process().terminate().await;

        // A launch before the idle time cancels the removal.
        h.sandbox.user_idle(&alice).await;
        let mut k2 = start(&h, &alice).await;
        sleep(Duration::from_secs(2)).await;
        assert_eq!(h.containers(), vec![name.clone()]);
        assert_eq!(k2.run("print(2)").await.out(), "2");
        k2.process().terminate().await;

        h.sandbox.user_idle(&alice).await;
        eventually(Duration::from_secs(20), "the idle container to go", || {
            h.containers().is_empty()
        })
        .await;
        // The next launch starts a new container; the workspace persists.
        let mut k3 = start(&h, &alice).await;
        assert_eq!(k3.run("print(3)").await.out(), "3");
        assert_eq!(h.containers(), vec![name]);
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_container_is_reported_to_its_kernels() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let k = start(&h, &alice).await;
        let name = h.sandbox.container_name("alice");
        let out = Command::new("docker")
            .args(["rm", "-f", &name])
            .output()
            .unwrap();
        assert!(out.status.success());
        let reason = wait_exit(k.process(), Duration::from_secs(30)).await;
        assert!(
            matches!(&reason, ExitReason::Lost(why) if why.contains("container")),
            "{reason:?}"
        );
        // The next launch replaces the container.
        let mut k2 = start(&h, &alice).await;
        assert_eq!(k2.run("print('back')").await.out(), "back");
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_removes_every_container_and_check_sweeps_leftovers() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        // A container an earlier run left behind (same labels), and one of another broker.
        let leftover = format!("{}-stale", h.sandbox.container_name("old"));
        let other = format!("kb-test-other-{}", Uuid::new_v4().simple());
        for (name, hash) in [(&leftover, h.sandbox.data_dir_hash()), (&other, "0000beef")] {
            let out = Command::new("docker")
                .args([
                    "create",
                    "--name",
                    name,
                    "--label",
                    &format!("{LABEL_MANAGED}=true"),
                    "--label",
                    &format!("{LABEL_DATA_DIR_HASH}={hash}"),
                    DEFAULT_IMAGE,
                ])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        h.sandbox.check().await.expect("check");
        assert!(h.containers().is_empty(), "the leftover survived check()");
        let other_exists = Command::new("docker")
            .args(["inspect", &other])
            .output()
            .unwrap()
            .status
            .success();
        let _ = Command::new("docker").args(["rm", "-f", &other]).output();
        assert!(other_exists, "check() removed another broker's container");

        let alice = user("alice", 0, UserLimits::default());
        let bob = user("bob", 1, UserLimits::default());
        let (a, b) = tokio::join!(start(&h, &alice), start(&h, &bob));
        assert_eq!(h.containers().len(), 2);
        h.sandbox.shutdown().await;
        assert!(h.containers().is_empty(), "containers left after shutdown");
        assert_eq!(
            wait_exit(a.process(), Duration::from_secs(5)).await,
            ExitReason::Terminated
        );
        assert_eq!(
            wait_exit(b.process(), Duration::from_secs(5)).await,
            ExitReason::Terminated
        );
    })
    .await;
}

#[tokio::test]
async fn a_missing_daemon_socket_makes_check_fail_with_advice() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = DockerSandboxConfig::new(dir.path().join("data"));
    cfg.socket = "unix:///nonexistent/docker.sock".into();
    let sandbox = DockerSandbox::new(cfg).expect("new does not contact the daemon");
    let err = timeout(Duration::from_secs(30), sandbox.check())
        .await
        .expect("check hung")
        .expect_err("check passed without a daemon");
    let text = err.to_string();
    assert!(matches!(err, SandboxError::Unavailable { .. }), "{err:?}");
    assert!(text.contains("start dockerd"), "{text}");
    assert!(text.contains("--docker-socket"), "{text}");
    // A launch fails the same way instead of hanging.
    let alice = user("alice", 0, UserLimits::default());
    let err = sandbox
        .launch(spec(&alice))
        .await
        .err()
        .expect("launch passed");
    assert!(err.to_string().contains("start dockerd"), "{err}");

    let mut cfg = DockerSandboxConfig::new(dir.path().join("data"));
    cfg.socket = "tcp://127.0.0.1:2375".into();
    assert!(DockerSandbox::new(cfg).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_image_makes_check_fail_with_advice() {
    let Some(h) = Harness::with(|cfg| cfg.image = "kernel-broker/no-such-image:nope".into()) else {
        return;
    };
    let err = h.sandbox.check().await.expect_err("check passed");
    let text = err.to_string();
    assert!(text.contains("build-offline.sh"), "{text}");
    assert!(text.contains("docker build -f docker/Dockerfile"), "{text}");
}

/// Container memory as `docker stats` reports it, in MiB.
fn container_mem_mib(name: &str) -> f64 {
    let out = Command::new("docker")
        .args(["stats", "--no-stream", "--format", "{{.MemUsage}}", name])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let used = text.split('/').next().unwrap_or_default().trim();
    let (num, unit) = used.split_at(
        used.find(|c: char| c.is_ascii_alphabetic())
            .unwrap_or(used.len()),
    );
    let num: f64 = num.trim().parse().unwrap_or(f64::NAN);
    match unit {
        "GiB" => num * 1024.0,
        "MiB" => num,
        "KiB" => num / 1024.0,
        "B" => num / (1024.0 * 1024.0),
        _ => f64::NAN,
    }
}

/// Not an assertion of speed: prints cold and warm launch times and idle memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn measure_launch_times_and_idle_memory() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        h.sandbox.check().await.expect("check");
        let alice = user("alice", 0, UserLimits::default());
        let t0 = Instant::now();
        let (first, cold_launch) = start_timed(&h, &alice).await;
        let cold = (cold_launch, t0.elapsed());
        let mut kernels = vec![first];
        let mut warm = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            let (k, launch) = start_timed(&h, &alice).await;
            kernels.push(k);
            warm.push((launch, t.elapsed()));
        }
        for k in kernels.iter_mut() {
            assert_eq!(k.run("1").await.result.as_deref(), Some("1"));
        }
        sleep(Duration::from_secs(2)).await;
        let name = h.sandbox.container_name("alice");
        let with4 = container_mem_mib(&name);
        for k in kernels.drain(2..) {
            k.process().terminate().await;
        }
        sleep(Duration::from_secs(2)).await;
        let with2 = container_mem_mib(&name);
        eprintln!(
            "MEASURE (launch() returned, kernel ready) cold: {cold:?}; warm: {warm:?}; \
             docker stats: 4 idle kernels {with4:.1} MiB, 2 idle kernels {with2:.1} MiB, \
             per idle kernel {:.1} MiB",
            (with4 - with2) / 2.0
        );
        h.sandbox.shutdown().await;
    })
    .await;
}
