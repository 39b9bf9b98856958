//! What only the docker sandbox does, against a real Docker daemon and the real kernel
//! image: one container per user (shared by concurrent launches, removed when idle,
//! replaced when lost, swept on startup and removed on shutdown), the reaper exec that
//! leaves no process of a session behind, and the advice when the daemon or the image is
//! missing. What both backends promise is in `sandbox_contract.rs`; the harness (one data
//! directory, hence data-dir hash, container names and labels per test; containers
//! force-removed even when an assertion fails; the skip and `KB_REQUIRE_DOCKER`
//! convention) is `tests/it/common/sandbox.rs`.

use crate::common::sandbox as common;

use std::time::Duration;

use common::{
    bounded, eventually, spec, start, start_timed, user, wait_exit, DockerHarness as Harness,
};
use kernel_broker::sandbox::docker::{
    DockerSandbox, DockerSandboxConfig, DEFAULT_IMAGE, LABEL_DATA_DIR_HASH, LABEL_MANAGED,
};
use kernel_broker::sandbox::{ExitReason, Sandbox, SandboxError, UserLimits};
use tokio::time::{sleep, timeout, Instant};
use uuid::Uuid;

/// Pids of the live (not zombie) processes in a container, except the one listing them.
fn live_pids(container: &str) -> Vec<u32> {
    let script = "import os\n\
                  me = os.getpid()\n\
                  for d in os.listdir('/proc'):\n\
                  \x20   if d.isdigit() and int(d) != me:\n\
                  \x20       try: stat = open('/proc/%s/stat' % d).read()\n\
                  \x20       except OSError: continue\n\
                  \x20       if stat[stat.rindex(')') + 2] != 'Z': print(d)";
    let out = common::docker_cli()
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
        let mut other = start(&h.sandbox, &alice).await;
        let o = other.run(CHILD_AND_DAEMON).await;
        let other_pids: Vec<u32> = o
            .out()
            .split(' ')
            .map(|p| p.parse().unwrap_or_else(|_| panic!("{o:?}")))
            .collect();
        assert_eq!(other_pids.len(), 2, "{o:?}");
        let before = live_pids(&container);

        let mut k = start(&h.sandbox, &alice).await;
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
        let mut other = start(&h.sandbox, &alice).await;
        assert_eq!(other.run("print(1)").await.out(), "1");
        let before = live_pids(&container);
        let mut k = start(&h.sandbox, &alice).await;
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
async fn concurrent_launches_of_one_user_share_one_container() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let (mut a, mut b, mut c) = tokio::join!(
            start(&h.sandbox, &alice),
            start(&h.sandbox, &alice),
            start(&h.sandbox, &alice)
        );
        for k in [&mut a, &mut b, &mut c] {
            assert_eq!(k.run("print(1)").await.out(), "1");
        }
        assert_eq!(h.containers(), vec![h.sandbox.container_name("alice")]);
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
        let k = start(&h.sandbox, &alice).await;
        let name = h.sandbox.container_name("alice");
        assert_eq!(h.containers(), vec![name.clone()]);
        k.process().terminate().await;

        // A launch before the idle time cancels the removal.
        h.sandbox.user_idle(&alice).await;
        let mut k2 = start(&h.sandbox, &alice).await;
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
        let mut k3 = start(&h.sandbox, &alice).await;
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
        let k = start(&h.sandbox, &alice).await;
        let name = h.sandbox.container_name("alice");
        let out = common::docker_cli()
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
        let mut k2 = start(&h.sandbox, &alice).await;
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
            let out = common::docker_cli()
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
        let other_exists = common::docker_cli()
            .args(["inspect", &other])
            .output()
            .unwrap()
            .status
            .success();
        let _ = common::docker_cli().args(["rm", "-f", &other]).output();
        assert!(other_exists, "check() removed another broker's container");

        let alice = user("alice", 0, UserLimits::default());
        let bob = user("bob", 1, UserLimits::default());
        let (a, b) = tokio::join!(start(&h.sandbox, &alice), start(&h.sandbox, &bob));
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
    let out = common::docker_cli()
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
        let (first, cold_launch) = start_timed(&h.sandbox, &alice).await;
        let cold = (cold_launch, t0.elapsed());
        let mut kernels = vec![first];
        let mut warm = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            let (k, launch) = start_timed(&h.sandbox, &alice).await;
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

/// The limits a user's container is created with must be in force in its cgroup: an engine
/// that accepts them and applies none (rootless Podman on cgroup v1, which only logs that it
/// ignores them) gets no kernel, unless `require_limits` is off. Where the harness is told
/// the engine ignores limits (`KB_ENGINE_IGNORES_LIMITS=1`: scripts/test-podman-rootless on
/// this cgroup v1 host), the launch must fail saying so and leave no container, and with
/// `require_limits = false` run; elsewhere the launch runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_container_whose_limits_are_not_in_force_is_refused() {
    let ignores = std::env::var("KB_ENGINE_IGNORES_LIMITS").as_deref() == Ok("1");
    let Some(h) = Harness::new() else { return };
    let alice = user("alice", 0, UserLimits::default());
    bounded(async {
        match h.sandbox.launch(spec(&alice)).await {
            Err(e) if ignores => {
                let text = e.to_string();
                assert!(
                    text.contains("the engine did not apply the user's limits"),
                    "{text}"
                );
                assert!(text.contains("require_limits = false"), "{text}");
                assert!(h.containers().is_empty(), "{:?}", h.containers());
            }
            Ok(launched) if !ignores => {
                launched.process.terminate().await;
            }
            Err(e) => panic!("a launch on an engine that applies limits failed: {e}"),
            Ok(_) => panic!("a container without its limits ran a kernel"),
        }
        h.sandbox.shutdown().await;
    })
    .await;
    if !ignores {
        return;
    }
    let Some(lax) = Harness::with(|cfg| cfg.require_limits = false) else {
        return;
    };
    bounded(async {
        let mut k = start(&lax.sandbox, &alice).await;
        let o = k.run("print(1 + 1)").await;
        assert_eq!(o.out(), "2", "{o:?}");
        k.process().terminate().await;
        lax.sandbox.shutdown().await;
    })
    .await;
}

/// A loop in the kernel, as an attacker would write it: it watches `/proc` for the shell of
/// a new exec waiting for its `go` file (its argv names the session directory) and plants
/// `go` there as a symlink to a host path, alternating between `victim` (a host file) and
/// `created` (a host path that does not exist). `planted` counts its wins.
fn go_racer(victim: &str, created: &str) -> String {
    format!(
        "import os, re, threading\n\
         planted = []\n\
         def _race(targets=({victim:?}, {created:?})):\n\
         \x20   pat = re.compile(rb'/run/kernel/([A-Za-z0-9]+)/go')\n\
         \x20   done = set()\n\
         \x20   while True:\n\
         \x20       for pid in os.listdir('/proc'):\n\
         \x20           if not pid.isdigit():\n\
         \x20               continue\n\
         \x20           try:\n\
         \x20               cmd = open('/proc/%s/cmdline' % pid, 'rb').read()\n\
         \x20           except OSError:\n\
         \x20               continue\n\
         \x20           m = pat.search(cmd)\n\
         \x20           if not m or m.group(1) in done:\n\
         \x20               continue\n\
         \x20           done.add(m.group(1))\n\
         \x20           try:\n\
         \x20               os.symlink(targets[len(planted) % 2], '/run/kernel/%s/go' % m.group(1).decode())\n\
         \x20               planted.append(m.group(1))\n\
         \x20           except OSError:\n\
         \x20               pass\n\
         threading.Thread(target=_race, daemon=True).start()"
    )
}

/// Issue 32, attack 3: the broker (root on the host) wrote a waiting exec's `go` file with
/// `std::fs::write`, which follows a symlink the kernel planted in its own session
/// directory: any host file could be truncated or created as root. Now `go` is created
/// through the directory's descriptor with `O_EXCL | O_NOFOLLOW`; a planted one fails that
/// launch. The racer must have won at least once, or the test proves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_planted_go_symlink_is_never_followed() {
    use kernel_broker::sandbox::command::CommandSpec;
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let mut k = start(&h.sandbox, &alice).await;
        let tag = Uuid::new_v4().simple().to_string();
        let victim = std::path::PathBuf::from(format!("/tmp/kb-go-victim-{tag}"));
        let created = std::path::PathBuf::from(format!("/tmp/kb-go-created-{tag}"));
        std::fs::write(&victim, b"precious host data").unwrap();
        let o = k
            .run(&go_racer(
                victim.to_str().unwrap(),
                created.to_str().unwrap(),
            ))
            .await;
        assert!(o.error.is_none(), "{o:?}");
        let mut wins = 0;
        for _ in 0..20 {
            let spec = CommandSpec {
                user: alice.clone(),
                argv: vec!["/bin/true".into()],
                env: vec![],
                cwd: None,
                limits: alice.limits.kernel(None),
                pty: None,
                own_workspace: None,
            };
            // A lost race fails the command's start; a won one for the broker runs it.
            if let Ok(cmd) = h.sandbox.run_command(spec).await {
                timeout(Duration::from_secs(60), cmd.control.wait())
                    .await
                    .expect("the command ends");
            }
            wins = k.run("print(len(planted))").await.out().parse().unwrap();
            if wins >= 4 {
                break;
            }
        }
        let intact = std::fs::read(&victim).unwrap();
        let made = created.exists();
        let _ = std::fs::remove_file(&victim);
        let _ = std::fs::remove_file(&created);
        assert!(
            wins >= 1,
            "the racer never planted a go file: this test saw nothing"
        );
        assert_eq!(
            intact, b"precious host data",
            "a host file was written through a planted go"
        );
        assert!(!made, "a host file was created through a planted go");
        h.sandbox.shutdown().await;
    })
    .await;
}
