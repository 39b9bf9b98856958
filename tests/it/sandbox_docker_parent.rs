//! All of one user's Docker containers (her shared container and every sandbox's own) sit
//! under one parent cgroup holding her limits, so that together they never exceed them:
//! the parent's place and limits as the host shows them, a fork bomb across two sandbox
//! containers stopped at her process limit in total while another user's kernel answers,
//! and the parents removed with the user's last container and at shutdown. The harness is
//! `tests/it/common/sandbox.rs`.

use crate::common::sandbox as common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{bounded, eventually, spec, start_spec, user, DockerHarness as Harness, Kernel};
use kernel_broker::sandbox::docker::LABEL_SANDBOX;
use kernel_broker::sandbox::{Sandbox, SandboxUser, UserLimits};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// A user whose limits are small enough to reach: 0.5 CPU, 120 processes.
fn small(name: &str, index: u32) -> SandboxUser {
    let limits = UserLimits {
        memory_bytes: 768 << 20,
        cpus: 0.5,
        pids: 120,
        session_memory_bytes: 256 << 20,
        session_pids: 120,
        ..UserLimits::default()
    };
    user(name, index, limits)
}

/// The host pid of a container's init.
fn init_pid(container: &str) -> u32 {
    let out = common::docker_cli()
        .args(["inspect", "-f", "{{.State.Pid}}", container])
        .output()
        .expect("docker inspect");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a pid")
}

/// The container (id) of the sandbox `key`.
fn sandbox_container(key: Uuid) -> String {
    let out = common::docker_cli()
        .args(["ps", "-q", "--filter"])
        .arg(format!("label={LABEL_SANDBOX}={key}"))
        .output()
        .expect("docker ps");
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    ids[0].clone()
}

/// Where the host mounts a controller's hierarchy, and the cgroup of `pid` in it
/// (cgroup v1: the controller's own hierarchy; v2: the unified one).
fn cgroup_of(pid: u32, controller: &str) -> (PathBuf, String) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let v1 = Path::new("/sys/fs/cgroup").join(controller);
    if v1.join("cgroup.procs").exists() {
        let path = text
            .lines()
            .find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
                ctrls.split(',').any(|c| c == controller).then_some(path)
            })
            .expect("the controller's line");
        return (v1, path.to_string());
    }
    let path = text.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
    (PathBuf::from("/sys/fs/cgroup"), path.to_string())
}

/// The user's parent, as the broker names it: `kernel-broker-docker-<hash>/u<sha256>`.
fn parent_name(h: &Harness, user: &str) -> String {
    let key = hex::encode(&Sha256::digest(user.as_bytes())[..8]);
    format!("kernel-broker-docker-{}/u{key}", h.sandbox.data_dir_hash())
}

/// The host directory of the user's parent in a controller's hierarchy, checked to hold the
/// container whose init is `pid` (directly or deeper).
fn parent_of(h: &Harness, user: &str, pid: u32, controller: &str) -> PathBuf {
    let (mount, path) = cgroup_of(pid, controller);
    let name = parent_name(h, user);
    let at = path
        .find(&format!("/{name}/"))
        .unwrap_or_else(|| panic!("{user}'s container is in {path}, not under {name}"));
    mount.join(&path[1..at + 1 + name.len()])
}

/// The directories of this broker's parents (`<user>` given: of hers) in every hierarchy.
fn parent_dirs(h: &Harness, user: Option<&str>) -> Vec<PathBuf> {
    let base = format!("kernel-broker-docker-{}", h.sandbox.data_dir_hash());
    let name = user.map_or(base, |u| parent_name(h, u));
    let hierarchies = std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .chain([PathBuf::from("/sys/fs/cgroup")]);
    hierarchies
        .map(|d| d.join(&name))
        .filter(|d| d.is_dir())
        .collect()
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()))
        .trim()
        .to_string()
}

/// Forks children that sleep until it has forked `max` or the system refuses; prints how
/// many it holds.
fn fork_and_hold(max: u32) -> String {
    format!(
        "import os, time\n\
         held = []\n\
         for _ in range({max}):\n\
         \x20   try:\n\
         \x20       p = os.fork()\n\
         \x20   except OSError:\n\
         \x20       break\n\
         \x20   if p == 0:\n\
         \x20       time.sleep(120)\n\
         \x20       os._exit(0)\n\
         \x20   held.append(p)\n\
         print(len(held))"
    )
}

const RELEASE: &str = "import os\n\
    for p in held:\n\
    \x20   os.kill(p, 9)\n\
    \x20   os.waitpid(p, 0)\n\
    held = []\n\
    print('released')";

async fn own_kernel(h: &Harness, who: &SandboxUser, key: Uuid) -> Kernel {
    let mut s = spec(who);
    s.own_workspace = Some(key);
    start_spec(&h.sandbox, s).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn docker_a_users_containers_together_stay_within_her_limits() {
    let Some(h) = Harness::with(|cfg| cfg.container_idle = Duration::from_secs(1)) else {
        return;
    };
    bounded(async {
        let alice = small("alice", 0);
        // A name that would nest as a systemd slice and holds dots: hashed, not used.
        let bob = small("-..-bob.slice", 1);
        let (k1, k2) = (Uuid::new_v4(), Uuid::new_v4());
        let mut shared = start_spec(&h.sandbox, spec(&alice)).await.0;
        let mut a = own_kernel(&h, &alice, k1).await;
        let mut b = own_kernel(&h, &alice, k2).await;
        let mut other = start_spec(&h.sandbox, spec(&bob)).await.0;

        // Behaviour: a fork bomb across both sandboxes stops at her 120 processes in total
        // (each container alone would allow 120), and bob's kernel answers meanwhile.
        let held_a: u32 = a.run(&fork_and_hold(400)).await.out().parse().unwrap();
        let held_b: u32 = b.run(&fork_and_hold(400)).await.out().parse().unwrap();
        eprintln!("alice's sandboxes held {held_a} + {held_b} processes (her limit: 120)");
        assert!(held_a > 20, "the first sandbox could fork only {held_a}");
        assert!(
            held_a + held_b < 120,
            "her sandboxes held {held_a} + {held_b} processes beyond her limit of 120"
        );
        assert_eq!(other.run("print(6 * 7)").await.out(), "42");
        for k in [&mut a, &mut b] {
            assert_eq!(k.run(RELEASE).await.out(), "released");
        }
        assert_eq!(shared.run("print(1)").await.out(), "1");

        // Structure: her three containers sit under one parent holding her limits, once.
        let pids = [
            init_pid(&h.sandbox.container_name("alice")),
            init_pid(&sandbox_container(k1)),
            init_pid(&sandbox_container(k2)),
        ];
        let parents: Vec<(PathBuf, PathBuf)> = pids
            .iter()
            .map(|&pid| {
                (
                    parent_of(&h, "alice", pid, "pids"),
                    parent_of(&h, "alice", pid, "cpu"),
                )
            })
            .collect();
        assert!(parents.iter().all(|p| *p == parents[0]), "{parents:?}");
        let (pids_dir, cpu_dir) = &parents[0];
        assert_eq!(read(pids_dir, "pids.max"), "120");
        if cpu_dir.join("cpu.cfs_quota_us").exists() {
            assert_eq!(read(cpu_dir, "cpu.cfs_quota_us"), "50000");
            assert_eq!(read(cpu_dir, "cpu.cfs_period_us"), "100000");
        } else {
            assert_eq!(read(cpu_dir, "cpu.max"), "50000 100000");
        }
        // Bob's parent is his own.
        let bob_pid = init_pid(&h.sandbox.container_name("-..-bob.slice"));
        let bobs = parent_of(&h, "-..-bob.slice", bob_pid, "pids");
        assert_ne!(&bobs, pids_dir);
        assert_eq!(read(&bobs, "pids.max"), "120");

        // Podman runs each exec's monitor (`conmon`) in `<parent>/conmon`, where they linger
        // for minutes after the exec ended (docs/HOSTS-podman.md): the parent cannot go
        // before them, so removal is checked on Docker Engine only.
        if common::is_podman() {
            h.sandbox.shutdown().await;
            drop(other);
            return;
        }
        // The parent goes with her last container: the sandboxes' first, then her own.
        for (k, key) in [(a, k1), (b, k2)] {
            k.process().terminate().await;
            h.sandbox.remove_own_workspace(&alice, key).await;
        }
        assert!(pids_dir.exists(), "her shared container still runs in it");
        shared.process().terminate().await;
        h.sandbox.user_idle(&alice).await;
        eventually(Duration::from_secs(30), "alice's parent removed", || {
            parent_dirs(&h, Some("alice")).is_empty()
        })
        .await;
        assert!(bobs.exists());

        // Shutdown removes every parent of this broker, and the broker's directory, in
        // every hierarchy (the engine makes them in each one it mounts).
        h.sandbox.shutdown().await;
        let left = parent_dirs(&h, None);
        assert!(left.is_empty(), "left after shutdown: {left:?}");
        drop(other);
    })
    .await;
}
