//! Docker kernels kept across a broker restart (`--keep-sessions`), against a real daemon
//! and the real kernel image: a run that keeps its kernels shuts down and leaves them (and
//! their container) running; the next run on the same data directory adopts them with
//! their variables, interrupts and terminates them; a kernel that died while no broker
//! ran (killed, or past its memory limit) is reported with its reason and reclaimed; kernels no session adopts are ended by
//! `discard_unadopted`; a run that does not keep kernels removes what a keeping run left.
//!
//! Each test has its own data directory (so its own containers and labels); a guard
//! removes its containers and unmounts its workspaces even when an assertion fails.
//! Without Docker they fail and say why; the `no-docker` nextest profile leaves them out.

use crate::common::sandbox as common;

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::{bounded, docker_skip_reason, eventually, spec, user, wait_exit, Kernel};
use kernel_broker::kernel::{ConnectOptions, KernelClient};
use kernel_broker::sandbox::docker::{DockerSandbox, DockerSandboxConfig, LABEL_DATA_DIR_HASH};
use kernel_broker::sandbox::{
    AdoptError, AdoptSpec, ExitReason, Launched, Sandbox, SandboxUser, UserLimits,
};
use tokio::time::{timeout, Instant};
use uuid::Uuid;

/// One data directory, shared by the runs of a test; cleans up after them.
struct Runs {
    dir: tempfile::TempDir,
    hash: Option<String>,
}

impl Runs {
    fn new() -> Option<Self> {
        // A test that cannot run fails and says why (the `no-docker` nextest profile leaves
        // this binary out, so it is reported as skipped there).
        if let Some(reason) = docker_skip_reason() {
            panic!("this Docker test cannot run: {reason}; start dockerd and build the image, or leave the Docker tests out: `cargo nextest run --profile no-docker`");
        }
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("kernel_broker=debug")
            .try_init();
        Some(Self {
            dir: tempfile::tempdir().expect("tempdir"),
            hash: None,
        })
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// A new run of the broker's docker sandbox on this data directory.
    fn sandbox(&mut self, keep: bool) -> DockerSandbox {
        let mut cfg = DockerSandboxConfig::new(self.data_dir());
        cfg.socket = common::docker_socket();
        cfg.cgroup_parent = common::docker_cgroup_parent();
        cfg.api_timeout = common::scaled(cfg.api_timeout).min(Duration::from_secs(600));
        cfg.keep_kernels = keep;
        let sandbox = DockerSandbox::new(cfg).expect("DockerSandbox::new");
        self.hash = Some(sandbox.data_dir_hash().to_string());
        sandbox
    }

    fn ticket(&self, session: Uuid) -> PathBuf {
        self.data_dir()
            .join("kept-docker")
            .join(format!("{session}.json"))
    }

    fn containers(&self) -> Vec<String> {
        let Some(hash) = &self.hash else {
            return vec![];
        };
        let out = common::docker_cli()
            .args(["ps", "-a", "--filter"])
            .arg(format!("label={LABEL_DATA_DIR_HASH}={hash}"))
            .args(["--format", "{{.Names}}"])
            .output()
            .expect("docker ps");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Runs {
    fn drop(&mut self) {
        for name in self.containers() {
            let _ = common::docker_cli().args(["rm", "-f", &name]).output();
        }
        // Kept runs leave their workspace file systems mounted for the next run.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let base = self.dir.path().to_string_lossy().into_owned();
        for point in mounts.lines().filter_map(|l| l.split(' ').nth(4)) {
            if point.starts_with(&base) {
                let _ = Command::new("umount").args(["-l", point]).output();
            }
        }
    }
}

fn running(container: &str) -> bool {
    let out = common::docker_cli()
        .args(["inspect", "-f", "{{.State.Running}}", container])
        .output()
        .expect("docker inspect");
    String::from_utf8_lossy(&out.stdout).trim() == "true"
}

/// How many live processes in the container run the kernel of `session` (their argv
/// names its connection file).
fn kernel_processes(container: &str, session: Uuid) -> usize {
    let dir = &session.simple().to_string()[..12];
    let script = format!(
        "import os\n\
         n = 0\n\
         for d in os.listdir('/proc'):\n\
         \x20   if not d.isdigit() or int(d) == os.getpid(): continue\n\
         \x20   try:\n\
         \x20       argv = open('/proc/%s/cmdline' % d, 'rb').read()\n\
         \x20       stat = open('/proc/%s/stat' % d).read()\n\
         \x20   except OSError: continue\n\
         \x20   if b'/run/kernel/{dir}/connection.json' in argv and stat[stat.rindex(')') + 2] != 'Z': n += 1\n\
         print(n)"
    );
    let out = common::docker_cli()
        .args(["exec", container, "python", "-I", "-S", "-c", &script])
        .output()
        .expect("docker exec");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a count")
}

/// Launches a kernel and connects to it; returns it with its key.
async fn launch(sandbox: &DockerSandbox, user: &SandboxUser) -> (Kernel, String) {
    let spec = spec(user);
    let (key, session_id) = (spec.key.clone(), spec.session_id);
    let launched = timeout(Duration::from_secs(90), sandbox.launch(spec))
        .await
        .expect("launch timed out")
        .expect("launch");
    (connect(session_id, launched, &key).await, key)
}

async fn connect(session_id: Uuid, launched: Launched, key: &str) -> Kernel {
    let (client, events, _info) = KernelClient::connect(
        &launched.endpoints,
        key,
        "test",
        ConnectOptions::default(),
        Duration::from_secs(60),
    )
    .await
    .expect("connect to the kernel");
    Kernel {
        session_id,
        launched,
        client,
        events,
    }
}

fn adopt_spec(session_id: Uuid, user: &SandboxUser) -> AdoptSpec {
    AdoptSpec {
        session_id,
        user: user.clone(),
        limits: user.limits.kernel(None),
        own_workspace: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_kernel_is_adopted_by_the_next_run_with_its_variables() {
    let Some(mut runs) = Runs::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let first = runs.sandbox(true);
        assert!(first.keeps_kernels());
        first.check().await.expect("check");
        let container = first.container_name("alice");
        let (mut k, key) = launch(&first, &alice).await;
        let session = k.session_id;
        let set = k.run("x = 41").await;
        assert_eq!(set.error, None, "{set:?}");
        let ticket = runs.ticket(session);
        let meta = std::fs::metadata(&ticket).expect("the kernel's ticket");
        assert_eq!(meta.mode() & 0o777, 0o600);

        first.shutdown().await;
        drop(k); // a released handle kills nothing when dropped
        drop(first);
        assert!(running(&container), "the container outlives the broker");
        assert_eq!(
            kernel_processes(&container, session),
            3,
            "the kernel's shell, its tini and the kernel"
        );
        assert!(ticket.exists());

        let second = runs.sandbox(true);
        second.check().await.expect("check of the next run");
        assert!(
            running(&container),
            "start-up keeps the kept kernel's container"
        );
        let t0 = Instant::now();
        let launched = second
            .adopt(adopt_spec(session, &alice))
            .await
            .expect("adopt");
        let adopt_time = t0.elapsed();
        let mut k = connect(session, launched, &key).await;
        eprintln!(
            "adopted in {adopt_time:?}, connected after {:?}",
            t0.elapsed()
        );
        let got = k.run("x + 1").await;
        assert_eq!(got.result.as_deref(), Some("42"), "{got:?}");
        // Adopted twice: there is only one kernel.
        assert!(matches!(
            second.adopt(adopt_spec(session, &alice)).await,
            Err(AdoptError::Missing)
        ));

        // Interrupt works on the adopted kernel (a signal through its recorded pid).
        let id = k.send("import time; time.sleep(60)").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        k.process().interrupt().await.expect("interrupt");
        let out = k.collect(&id, Duration::from_secs(20)).await;
        assert!(
            out.error
                .as_deref()
                .unwrap_or_default()
                .contains("KeyboardInterrupt"),
            "{out:?}"
        );
        // A launch of the same user reuses the adopted container.
        let (mut other, _) = launch(&second, &alice).await;
        assert_eq!(other.run("1").await.result.as_deref(), Some("1"));
        other.process().terminate().await;

        // Terminate reclaims everything.
        k.process().terminate().await;
        assert_eq!(
            wait_exit(k.process(), Duration::from_secs(30)).await,
            ExitReason::Terminated
        );
        assert_eq!(kernel_processes(&container, session), 0);
        assert!(!ticket.exists(), "the ticket goes with the kernel");
        let session_dir = second
            .run_base()
            .join("alice")
            .join(&session.simple().to_string()[..12]);
        assert!(!session_dir.exists());
        second.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kernels_that_died_meanwhile_or_were_not_adopted_are_ended_and_reclaimed() {
    let Some(mut runs) = Runs::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let first = runs.sandbox(true);
        first.check().await.expect("check");
        let container = first.container_name("alice");
        let (dies, _) = launch(&first, &alice).await;
        let (unadopted, _) = launch(&first, &alice).await;
        let (mut runs_out_of_memory, _) = launch(&first, &alice).await;
        let (dies, unadopted) = (dies.session_id, unadopted.session_id);
        first.shutdown().await;
        drop(first);

        // While no broker runs, a client still connected runs the third kernel past its
        // memory limit (256 MiB by default): its leaf's OOM killer ends it.
        let oom = runs_out_of_memory.session_id;
        runs_out_of_memory.send("b = b'x' * (400 << 20)").await;
        eventually(Duration::from_secs(20), "the OOM kill", || {
            kernel_processes(&container, oom) == 0
        })
        .await;
        drop(runs_out_of_memory);

        // While no broker runs, the first kernel is killed (the python under its tini,
        // which then exits as its child did; its pid file names the python).
        let dir = &dies.simple().to_string()[..12];
        let kill = common::docker_cli()
            .args(["exec", &container, "sh", "-c"])
            .arg(format!("kill -9 $(cat /run/kernel/{dir}/pid)"))
            .output()
            .expect("docker exec kill");
        assert!(kill.status.success(), "{kill:?}");
        eventually(Duration::from_secs(10), "the kernel's end", || {
            kernel_processes(&container, dies) == 0
        })
        .await;

        let second = runs.sandbox(true);
        second.check().await.expect("check");
        match second.adopt(adopt_spec(dies, &alice)).await {
            // Under Podman too, which does not report how a detached exec ended
            // (sandbox/docker/engine.rs): the kernel's shell recorded its status.
            Err(AdoptError::Ended(reason)) => {
                assert_eq!(reason, ExitReason::Signaled(9), "{reason}")
            }
            Err(e) => panic!("adopting a dead kernel: {e}"),
            Ok(_) => panic!("a dead kernel was adopted"),
        }
        assert!(!runs.ticket(dies).exists());
        assert!(!second.run_base().join("alice").join(dir).exists());
        match second.adopt(adopt_spec(oom, &alice)).await {
            Err(AdoptError::Ended(reason)) => assert_eq!(
                reason,
                ExitReason::OutOfMemory {
                    limit_bytes: alice.limits.session_memory_bytes
                },
                "{reason}"
            ),
            Err(e) => panic!("adopting a kernel killed for its memory: {e}"),
            Ok(_) => panic!("a kernel killed for its memory was adopted"),
        }
        assert!(!runs.ticket(oom).exists());
        // No kernel was kept for a session never launched.
        assert!(matches!(
            second.adopt(adopt_spec(Uuid::new_v4(), &alice)).await,
            Err(AdoptError::Missing)
        ));

        // The kernel no session adopted is ended by the discard.
        assert_eq!(kernel_processes(&container, unadopted), 3);
        second.discard_unadopted().await;
        assert_eq!(kernel_processes(&container, unadopted), 0);
        assert!(!runs.ticket(unadopted).exists());
        assert!(matches!(
            second.adopt(adopt_spec(unadopted, &alice)).await,
            Err(AdoptError::Missing)
        ));
        second.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_that_does_not_keep_kernels_removes_what_a_keeping_run_left() {
    let Some(mut runs) = Runs::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let first = runs.sandbox(true);
        first.check().await.expect("check");
        let (k, _) = launch(&first, &alice).await;
        first.shutdown().await;
        drop(k);
        drop(first);
        assert_eq!(runs.containers().len(), 1);

        let second = runs.sandbox(false);
        assert!(!second.keeps_kernels());
        second.check().await.expect("check");
        assert!(runs.containers().is_empty(), "{:?}", runs.containers());
        assert!(!runs.data_dir().join("kept-docker").exists());
        assert!(!second.run_base().join("alice").exists());
        assert!(matches!(
            second.adopt(adopt_spec(Uuid::new_v4(), &alice)).await,
            Err(AdoptError::Missing)
        ));
        second.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kernel_whose_container_stopped_meanwhile_ends_with_it() {
    let Some(mut runs) = Runs::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let first = runs.sandbox(true);
        first.check().await.expect("check");
        let container = first.container_name("alice");
        let (k, _) = launch(&first, &alice).await;
        let session = k.session_id;
        first.shutdown().await;
        drop(k);
        drop(first);
        let stop = common::docker_cli()
            .args(["kill", &container])
            .output()
            .expect("docker kill");
        assert!(stop.status.success(), "{stop:?}");

        let second = runs.sandbox(true);
        second.check().await.expect("check");
        // Kept until its kernels were offered: adoption reads their end from it.
        assert_eq!(runs.containers(), std::slice::from_ref(&container));
        match second.adopt(adopt_spec(session, &alice)).await {
            Err(AdoptError::Ended(ExitReason::Lost(why))) => {
                assert!(why.contains("stopped"), "{why}")
            }
            Err(e) => panic!("adopting a kernel of a stopped container: {e}"),
            Ok(_) => panic!("a kernel of a stopped container was adopted"),
        }
        assert!(!runs.ticket(session).exists());
        second.discard_unadopted().await;
        assert!(runs.containers().is_empty(), "{:?}", runs.containers());
        // A new launch makes a new container.
        let (mut k, _) = launch(&second, &alice).await;
        assert_eq!(k.run("2 * 21").await.result.as_deref(), Some("42"));
        k.process().terminate().await;
        second.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sandbox_container_is_kept_and_adopted_then_removed_with_its_workspace() {
    let Some(mut runs) = Runs::new() else { return };
    bounded(async {
        let alice = user("alice", 0, UserLimits::default());
        let first = runs.sandbox(true);
        let launch_own = |key: Uuid| {
            let mut s = spec(&alice);
            s.own_workspace = Some(key);
            s
        };
        let (kept, dropped) = (launch_own(Uuid::new_v4()), launch_own(Uuid::new_v4()));
        let (kept_key, dropped_key) = (kept.own_workspace.unwrap(), dropped.own_workspace.unwrap());
        let mut kernels = vec![];
        for s in [kept, dropped] {
            let (session, key) = (s.session_id, s.key.clone());
            let launched = timeout(Duration::from_secs(90), first.launch(s))
                .await
                .expect("launch timed out")
                .expect("launch");
            kernels.push((connect(session, launched, &key).await, key));
        }
        kernels[0]
            .0
            .run("x = 41; open('/home/user/f', 'w').write('1')")
            .await;
        let home = first.own_workspace(&alice, kept_key).unwrap().unwrap();
        let dropped_home = first.own_workspace(&alice, dropped_key).unwrap().unwrap();
        first.shutdown().await;
        let name = |key: Uuid| format!("kernel-broker-{}-sandbox-{key}", first.data_dir_hash());
        assert!(running(&name(kept_key)) && running(&name(dropped_key)));

        // The next run adopts one sandbox's kernel in its container, with its workspace.
        let second = runs.sandbox(true);
        second.check().await.expect("check");
        let session = kernels[0].0.session_id;
        let launched = second
            .adopt(adopt_spec(session, &alice))
            .await
            .expect("adopt");
        let mut k = connect(session, launched, &kernels[0].1).await;
        assert_eq!(
            k.run("print(x + 1, open('/home/user/f').read())")
                .await
                .out(),
            "42 1"
        );
        assert_eq!(
            second.own_workspace(&alice, kept_key).unwrap().unwrap(),
            home
        );
        // The other, not adopted, goes with its workspace.
        second.discard_unadopted().await;
        assert!(!runs.containers().contains(&name(dropped_key)));
        assert!(!dropped_home.exists(), "{} is left", dropped_home.display());
        // The adopted sandbox ends: its container and workspace go.
        k.process().terminate().await;
        second.remove_own_workspace(&alice, kept_key).await;
        assert!(!runs.containers().contains(&name(kept_key)));
        assert!(!home.exists(), "{} is left", home.display());
        second.shutdown().await;
    })
    .await;
}
