//! What only the local sandbox does, against the real thing: bubblewrap, cgroups, the
//! kernels' Python. Host-side checks of its mechanisms (the uid and the cgroup leaf of every
//! hierarchy, the limits written there, leaves and runtime directories removed, bwrap's
//! view of the host, the syscall filter, mountinfo, the startup sweep), mostly through
//! `launch_command` scripts. What both backends promise is in `sandbox_contract.rs`; the
//! harness (one data directory and cgroup name per test, cleaned up even when an
//! assertion fails; the skip convention) is `tests/it/common/sandbox.rs`.

use crate::common::sandbox as common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{
    bounded, cgroup_bases, eventually, is_root, limits, local_kernel_uid, repo, scaled, spec, user,
    wait_exit, LocalHarness as Harness,
};
use kernel_broker::sandbox::{ExitReason, LaunchSpec, Launched, Sandbox, SandboxError};
use serde_json::Value;
use tokio::time::{sleep, timeout};
use uuid::Uuid;
use zeromq::{Socket, SocketRecv, SocketSend};

/// Runs a Python snippet in the sandbox (argv: `python -c <code> <args...>`).
async fn run_python(h: &Harness, spec: LaunchSpec, code: &str, args: &[&str]) -> Launched {
    let mut argv = vec!["python".to_string(), "-c".to_string(), code.to_string()];
    argv.extend(args.iter().map(|a| a.to_string()));
    h.sandbox
        .launch_command(spec, argv)
        .await
        .expect("launch_command")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).expect("read report")).expect("report is JSON")
}

fn status_field(pid: i32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

async fn heartbeat(endpoint: &str) -> bool {
    let ping = async {
        let mut socket = zeromq::ReqSocket::new();
        socket.connect(endpoint).await.ok()?;
        socket.send("ping".into()).await.ok()?;
        let reply = socket.recv().await.ok()?;
        Some(reply.get(0).map(|f| f.as_ref() == b"ping").unwrap_or(false))
    };
    matches!(
        timeout(scaled(Duration::from_secs(10)), ping).await,
        Ok(Some(true))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_runs_as_its_uid_in_its_cgroup_and_answers_heartbeats() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        h.sandbox.check().await.expect("check");
        let alice = user("alice", 0, limits(512, 64));
        let spec = spec(&alice);
        let session = spec.session_id;
        let launched = h.sandbox.launch(spec).await.expect("launch");
        let rundir = h.rundir(session);
        assert_eq!(
            launched.endpoints.shell,
            format!("ipc://{}/k-1", rundir.display())
        );
        assert_eq!(
            launched.endpoints.hb,
            format!("ipc://{}/k-5", rundir.display())
        );

        eventually(Duration::from_secs(30), "the kernel's five sockets", || {
            (1..=5).all(|port| rundir.join(format!("k-{port}")).exists())
        })
        .await;
        assert!(
            heartbeat(&launched.endpoints.hb).await,
            "no heartbeat reply"
        );

        // The kernel process: its uid, no privileges, in the leaf of every hierarchy.
        let pids = h.processes_in_leaf("alice", session);
        let kernel = pids
            .iter()
            .copied()
            .find(|pid| {
                // bwrap's own command line names the kernel too; skip bwrap. A plain start
                // runs ipykernel through the bootstrap script (`boot.rs`, its `kernel` mode).
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                comm.trim() != "bwrap"
                    && std::fs::read(format!("/proc/{pid}/cmdline"))
                        .map(|c| {
                            let c = String::from_utf8_lossy(&c);
                            c.contains("ipykernel_launcher") || c.contains("kernel_broker_boot.py")
                        })
                        .unwrap_or(false)
            })
            .expect("the kernel process is in the leaf cgroup");
        let uid = local_kernel_uid(0).to_string();
        assert_eq!(status_field(kernel, "Uid"), [uid.as_str(); 4].join(" "));
        assert_eq!(status_field(kernel, "Gid"), [uid.as_str(); 4].join(" "));
        // No supplementary group; unprivileged, none beyond the broker's own (a user
        // namespace cannot drop them: docs/HOSTS.md).
        let groups = if is_root() {
            String::new()
        } else {
            status_field(std::process::id() as i32, "Groups")
        };
        assert_eq!(status_field(kernel, "Groups"), groups);
        assert_eq!(status_field(kernel, "CapEff"), "0000000000000000");
        assert_eq!(status_field(kernel, "CapBnd"), "0000000000000000");
        assert_eq!(status_field(kernel, "NoNewPrivs"), "1");
        let cgroups = std::fs::read_to_string(format!("/proc/{kernel}/cgroup")).unwrap();
        let leaf = format!("/{}/alice/{session}", h.cgroup_name);
        for leaf_dir in h.leaf_dirs("alice", session) {
            assert!(leaf_dir.is_dir(), "{} exists", leaf_dir.display());
        }
        let in_leaf = cgroups.lines().filter(|l| l.ends_with(&leaf)).count();
        assert!(in_leaf >= 1, "{cgroups}");
        if cgroup_bases(&h.cgroup_name).len() == 3 {
            for ctrl in ["memory", "cpu", "pids"] {
                assert!(
                    cgroups.lines().any(|l| l
                        .split(':')
                        .nth(1)
                        .is_some_and(|c| c.split(',').any(|x| x == ctrl))
                        && l.ends_with(&leaf)),
                    "{ctrl} not in leaf: {cgroups}"
                );
            }
        }

        // The user's limits.
        let read = |dir: Option<PathBuf>, file: &str| {
            std::fs::read_to_string(dir.expect("user cgroup").join(file))
                .unwrap()
                .trim()
                .to_string()
        };
        if let Some(dir) = h.user_dir("memory.limit_in_bytes", "alice") {
            assert_eq!(
                read(Some(dir.clone()), "memory.limit_in_bytes"),
                (512u64 << 20).to_string()
            );
            if dir.join("memory.memsw.limit_in_bytes").exists() {
                assert_eq!(
                    read(Some(dir), "memory.memsw.limit_in_bytes"),
                    (512u64 << 20).to_string()
                );
            }
            assert_eq!(
                read(h.user_dir("cpu.cfs_quota_us", "alice"), "cpu.cfs_quota_us"),
                "100000"
            );
            assert_eq!(read(h.user_dir("pids.max", "alice"), "pids.max"), "64");
        } else {
            assert_eq!(
                read(h.user_dir("memory.max", "alice"), "memory.max"),
                (512u64 << 20).to_string()
            );
            assert_eq!(
                read(h.user_dir("cpu.max", "alice"), "cpu.max"),
                "100000 100000"
            );
            assert_eq!(read(h.user_dir("pids.max", "alice"), "pids.max"), "64");
        }

        // SIGINT reaches the kernel, which survives it (ipykernel treats it as an interrupt).
        // The heartbeat thread answers before ipykernel has taken SIGINT over (its
        // `init_signal` ignores SIGINT outside executions); a SIGINT before that is Python's
        // default KeyboardInterrupt. A session never interrupts that early (it waits for the
        // kernel_info_reply, sent after), so wait for it here too.
        eventually(Duration::from_secs(60), "ipykernel ignores SIGINT", || {
            u64::from_str_radix(&status_field(kernel, "SigIgn"), 16).is_ok_and(|m| m & 0b10 != 0)
        })
        .await;
        launched.process.interrupt().await.expect("interrupt");
        sleep(Duration::from_millis(300)).await;
        assert!(
            heartbeat(&launched.endpoints.hb).await,
            "kernel died of SIGINT"
        );

        launched.process.terminate().await;
        assert_eq!(
            wait_exit(&*launched.process, Duration::from_secs(5)).await,
            ExitReason::Terminated
        );
        assert!(!rundir.exists(), "runtime directory removed");
        for leaf_dir in h.leaf_dirs("alice", session) {
            assert!(!leaf_dir.exists(), "{} removed", leaf_dir.display());
        }
        assert!(h.processes_in_leaf("alice", session).is_empty());
        // The user had no other kernel: the user's cgroup went too.
        assert!(
            h.user_dir("pids.max", "alice").is_none(),
            "user cgroup removed"
        );
        // terminate is idempotent.
        launched.process.terminate().await;
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_delivers_sigint_to_the_command() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let bob = user("bob", 1, limits(256, 64));
        let ws = h.sandbox.workspace(&bob).expect("workspace");
        const CODE: &str = r#"
import pathlib, signal, time
got = []
signal.signal(signal.SIGINT, lambda *a: got.append(1))
pathlib.Path('/workspace/ready').write_text('1')
deadline = time.time() + 30
while not got and time.time() < deadline:
    time.sleep(0.02)
raise SystemExit(0 if got else 7)
"#;
        let launched = run_python(&h, spec(&bob), CODE, &[]).await;
        eventually(Duration::from_secs(20), "the script to be ready", || {
            ws.join("ready").exists()
        })
        .await;
        launched.process.interrupt().await.expect("interrupt");
        assert_eq!(
            wait_exit(&*launched.process, Duration::from_secs(20)).await,
            ExitReason::Exited(0)
        );
        // Interrupting an ended kernel is an error, not a signal to a reused pid.
        assert!(launched.process.interrupt().await.is_err());
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_ends_in_out_of_memory() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let carol = user("carol", 2, limits(64, 64));
        const CODE: &str = r#"
chunks = []
while True:
    chunks.append(b'\x01' * (8 << 20))
"#;
        let spec = spec(&carol);
        let session = spec.session_id;
        let launched = run_python(&h, spec, CODE, &[]).await;
        let reason = wait_exit(&*launched.process, Duration::from_secs(60)).await;
        assert_eq!(
            reason,
            ExitReason::OutOfMemory {
                limit_bytes: 64 << 20
            }
        );
        assert!(reason.to_string().contains("64 MiB"), "{reason}");
        for leaf_dir in h.leaf_dirs("carol", session) {
            assert!(
                !leaf_dir.exists(),
                "{} removed after the kernel died",
                leaf_dir.display()
            );
        }
        assert!(!h.rundir(session).exists());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pids_limit_stops_a_fork_bomb() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let dave = user("dave", 3, limits(256, 32));
        let ws = h.sandbox.workspace(&dave).expect("workspace");
        const CODE: &str = r#"
import json, os, time
ok, err = 0, None
for _ in range(200):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    ok += 1
with open('/workspace/forks.json', 'w') as f:
    json.dump({'ok': ok, 'errno': err}, f)
time.sleep(60)
"#;
        let spec = spec(&dave);
        let session = spec.session_id;
        let launched = run_python(&h, spec, CODE, &[]).await;
        let report = ws.join("forks.json");
        eventually(Duration::from_secs(30), "the fork report", || {
            report.exists()
        })
        .await;
        sleep(Duration::from_millis(100)).await;
        let report = read_json(&report);
        assert_eq!(report["errno"], libc::EAGAIN, "{report}");
        assert!(report["ok"].as_u64().unwrap() < 32, "{report}");
        assert!(h.processes_in_leaf("dave", session).len() <= 32);

        launched.process.terminate().await;
        assert_eq!(
            wait_exit(&*launched.process, Duration::from_secs(5)).await,
            ExitReason::Terminated
        );
        assert!(
            h.processes_in_leaf("dave", session).is_empty(),
            "every forked process was killed"
        );
        for leaf_dir in h.leaf_dirs("dave", session) {
            assert!(!leaf_dir.exists());
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_has_only_loopback_and_hides_the_host() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let erin = user("erin", 4, limits(256, 64));
        let ws = h.sandbox.workspace(&erin).expect("workspace");
        const CODE: &str = r#"
import json, os, socket, sys
repo, data_dir, venv = sys.argv[1:4]
def readable(p):
    try:
        open(p, 'rb').read(1)
        return True
    except Exception:
        return False
def writable(p):
    try:
        with open(p, 'w') as f:
            f.write('x')
        return True
    except Exception:
        return False
def listing(p):
    try:
        return sorted(os.listdir(p))
    except Exception:
        return None
def pool():
    import multiprocessing
    try:
        with multiprocessing.Pool(2) as p:
            return p.map(abs, [-1, -2]) == [1, 2]
    except Exception as e:
        return repr(e)
def connects():
    try:
        socket.create_connection(('1.1.1.1', 53), timeout=2).close()
        return True
    except Exception:
        return False
report = {
    'ifaces': [name for _, name in socket.if_nameindex()],
    'connects': connects(),
    'uid': os.getuid(),
    'user': os.environ.get('USER'),
    'home': os.environ.get('HOME'),
    'env_test': os.environ.get('KB_TEST'),
    'hostname': socket.gethostname(),
    'root': listing('/'),
    'root_home': listing('/root'),
    'root_ssh': os.path.lexists('/root/.ssh'),
    'shadow': readable('/etc/shadow'),
    'passwd': open('/etc/passwd').read(),
    'etc': listing('/etc'),
    'work': listing('/work'),
    'repo': listing(repo),
    'repo_src': os.path.lexists(os.path.join(repo, 'src')),
    'cargo_toml': readable(os.path.join(repo, 'Cargo.toml')),
    'data_dir': os.path.lexists(data_dir),
    'home_dir': os.path.lexists('/home'),
    'var': os.path.lexists('/var'),
    'srv': os.path.lexists('/srv'),
    'write_usr': writable('/usr/kb-test'),
    'write_venv': writable(os.path.join(venv, 'kb-test')),
    'write_neutral_venv': writable('/opt/kernel-venv/kb-test'),
    'write_neutral_bin': writable('/opt/kernel-venv/bin/kb-test'),
    'write_home': writable(os.path.join(os.environ['HOME'], 'kb-test')),
    'home_listing': listing('/home'),
    'opt_listing': listing('/opt'),
    'write_tmp': writable('/tmp/kb-test'),
    'write_workspace': writable('/workspace/kb-test'),
    'write_run': writable('/run/kernel/kb-test'),
    'write_shm': writable('/dev/shm/kb-test'),
    'multiprocessing': pool(),
}
with open('/workspace/report.json', 'w') as f:
    json.dump(report, f)
"#;
        let repo = repo();
        let venv = repo.join("kernels/.venv");
        let launched = run_python(
            &h,
            spec(&erin),
            CODE,
            &[
                repo.to_str().unwrap(),
                h.data_dir().to_str().unwrap(),
                venv.to_str().unwrap(),
            ],
        )
        .await;
        assert_eq!(
            wait_exit(&*launched.process, Duration::from_secs(30)).await,
            ExitReason::Exited(0)
        );
        let r = read_json(&ws.join("report.json"));
        assert_eq!(r["ifaces"], serde_json::json!(["lo"]), "{r}");
        assert_eq!(r["connects"], false);
        assert_eq!(r["uid"], local_kernel_uid(4));
        assert_eq!(r["user"], "erin");
        assert_eq!(r["home"], "/home/kernel");
        assert_eq!(r["env_test"], "1");
        assert_eq!(r["hostname"], "kernel");
        assert!(
            r["passwd"]
                .as_str()
                .unwrap()
                .contains(&format!("erin:x:{0}:{0}:", local_kernel_uid(4))),
            "{r}"
        );
        assert_eq!(r["root_ssh"], false);
        assert_eq!(r["shadow"], false);
        assert_eq!(r["repo_src"], false, "{r}");
        assert_eq!(r["cargo_toml"], false);
        // The venv is shown at /opt/kernel-venv, not at its host path (python.rs).
        assert_eq!(r["repo"], Value::Null, "{r}");
        assert_eq!(r["root_home"], Value::Null, "{r}");
        assert_eq!(r["data_dir"], false);
        assert_eq!(r["home_listing"], serde_json::json!(["kernel"]), "{r}");
        assert_eq!(
            r["opt_listing"],
            serde_json::json!(["kernel-broker-tools", "kernel-python", "kernel-venv"]),
            "{r}"
        );
        assert_eq!(r["write_home"], true);
        assert_eq!(r["write_neutral_venv"], false);
        assert_eq!(r["write_neutral_bin"], false);
        assert_eq!(r["var"], false);
        assert_eq!(r["srv"], false);
        assert_eq!(r["write_usr"], false);
        assert_eq!(r["write_venv"], false);
        assert_eq!(r["write_tmp"], true);
        assert_eq!(r["write_workspace"], true);
        assert_eq!(r["write_run"], true);
        assert_eq!(r["write_shm"], true);
        assert_eq!(r["multiprocessing"], true, "{r}");
        // /root holds at most the path to the Python installation (pyenv on this host).
        let host_root: BTreeSet<String> = std::fs::read_dir("/root")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        for name in r["root_home"].as_array().cloned().unwrap_or_default() {
            let name = name.as_str().unwrap().to_string();
            assert!(
                !matches!(
                    name.as_str(),
                    ".ssh" | ".cargo" | ".bash_history" | ".bashrc"
                ),
                "/root/{name} visible: {r}"
            );
            assert!(host_root.contains(&name));
        }
        let etc: BTreeSet<String> = serde_json::from_value(r["etc"].clone()).unwrap();
        let allowed: BTreeSet<&str> = [
            "passwd",
            "group",
            "hosts",
            "ld.so.cache",
            "localtime",
            "fonts",
            "ssl",
            "alternatives",
            "mime.types",
            // The kernel's own environment, read after the drop (sandbox/environ.rs).
            "kernel-broker.env",
            // The R and Java kernels' configuration (read-only, bwrap.rs), where installed.
            "R",
            "java-17-openjdk",
        ]
        .into();
        assert!(etc.iter().all(|e| allowed.contains(e.as_str())), "{etc:?}");
        let top: BTreeSet<String> = serde_json::from_value(r["root"].clone()).unwrap();
        // /home and /opt are the sandbox's own: the kernel's home, its Python (checked above).
        for hidden in ["var", "srv", "mnt", "boot", "sys"] {
            assert!(!top.contains(hidden), "/{hidden} visible: {top:?}");
        }
        // A workspace file written by the kernel belongs to the kernel's uid on the host.
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            std::fs::metadata(ws.join("kb-test")).unwrap().uid(),
            local_kernel_uid(4)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspaces_are_per_user_and_persist() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let frank = user("frank", 5, limits(256, 64));
        let grace = user("grace", 6, limits(256, 64));
        let frank_ws = h.sandbox.workspace(&frank).unwrap();
        let grace_ws = h.sandbox.workspace(&grace).unwrap();
        assert_ne!(frank_ws, grace_ws);
        for (ws, uid) in [(&frank_ws, local_kernel_uid(5)), (&grace_ws, local_kernel_uid(6))] {
            let meta = std::fs::metadata(ws).unwrap();
            assert_eq!(meta.uid(), uid);
            assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
        }

        const WRITE: &str = "open('/workspace/secret.txt', 'w').write('frank only')";
        let l = run_python(&h, spec(&frank), WRITE, &[]).await;
        assert_eq!(wait_exit(&*l.process, Duration::from_secs(30)).await, ExitReason::Exited(0));

        const LOOK: &str = r#"
import json, os, sys
json.dump({'files': sorted(os.listdir('/workspace')), 'other': os.path.lexists(sys.argv[1])},
          open('/workspace/look.json', 'w'))
"#;
        let l = run_python(&h, spec(&grace), LOOK, &[frank_ws.to_str().unwrap()]).await;
        assert_eq!(wait_exit(&*l.process, Duration::from_secs(30)).await, ExitReason::Exited(0));
        let look = read_json(&grace_ws.join("look.json"));
        assert_eq!(look["files"], serde_json::json!([]), "{look}");
        assert_eq!(look["other"], false);

        // A later session of the same user finds the file.
        const READ: &str = "import sys; sys.exit(0 if open('/workspace/secret.txt').read() == 'frank only' else 5)";
        let l = run_python(&h, spec(&frank), READ, &[]).await;
        assert_eq!(wait_exit(&*l.process, Duration::from_secs(30)).await, ExitReason::Exited(0));

        if !is_root() {
            // Unprivileged there is no uid to repair and no quota file system (HOSTS.md).
            h.sandbox.shutdown().await;
            return;
        }
        // If the user's uid changes (say uid_base was changed), ownership is repaired.
        std::os::unix::fs::chown(&frank_ws, Some(12345), Some(12345)).unwrap();
        std::os::unix::fs::chown(frank_ws.join("secret.txt"), Some(12345), Some(12345)).unwrap();
        h.sandbox.workspace(&frank).unwrap();
        assert_eq!(std::fs::metadata(frank_ws.join("secret.txt")).unwrap().uid(), local_kernel_uid(5));

        // Each workspace is its own file system (the quota), gone on shutdown and mounted
        // again, content intact, when next needed.
        let dev = |p: &std::path::Path| std::fs::metadata(p).unwrap().dev();
        let parent = frank_ws.parent().unwrap();
        assert_ne!(dev(&frank_ws), dev(parent));
        assert_ne!(dev(&frank_ws), dev(&grace_ws));
        h.sandbox.shutdown().await;
        assert_eq!(dev(&frank_ws), dev(parent));
        assert!(!frank_ws.join("secret.txt").exists());
        h.sandbox.workspace(&frank).unwrap();
        assert_ne!(dev(&frank_ws), dev(parent));
        assert_eq!(std::fs::read_to_string(frank_ws.join("secret.txt")).unwrap(), "frank only");
        h.sandbox.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exits_are_reported_to_every_waiter() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let heidi = user("heidi", 7, limits(256, 64));
        let l = run_python(
            &h,
            spec(&heidi),
            "import time; time.sleep(0.5); raise SystemExit(3)",
            &[],
        )
        .await;
        let (a, b) = tokio::join!(l.process.wait(), l.process.wait());
        assert_eq!(a, ExitReason::Exited(3));
        assert_eq!(b, ExitReason::Exited(3));
        // Again, at once; and terminate after the end changes nothing.
        assert_eq!(
            wait_exit(&*l.process, Duration::from_millis(100)).await,
            ExitReason::Exited(3)
        );
        timeout(scaled(Duration::from_secs(1)), l.process.terminate())
            .await
            .unwrap();
        assert_eq!(l.process.wait().await, ExitReason::Exited(3));

        let l = run_python(
            &h,
            spec(&heidi),
            "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
            &[],
        )
        .await;
        assert_eq!(
            wait_exit(&*l.process, Duration::from_secs(30)).await,
            ExitReason::Signaled(libc::SIGTERM)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_handle_kills_the_kernel() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let ivan = user("ivan", 8, limits(256, 64));
        let ws = h.sandbox.workspace(&ivan).unwrap();
        let spec = spec(&ivan);
        let session = spec.session_id;
        let code = "import pathlib, time; pathlib.Path('/workspace/up').touch(); time.sleep(600)";
        let l = run_python(&h, spec, code, &[]).await;
        eventually(Duration::from_secs(20), "the script to start", || {
            ws.join("up").exists()
        })
        .await;
        assert!(!h.processes_in_leaf("ivan", session).is_empty());
        drop(l);
        eventually(
            Duration::from_secs(10),
            "the dropped kernel's cleanup",
            || {
                h.processes_in_leaf("ivan", session).is_empty()
                    && h.leaf_dirs("ivan", session).iter().all(|d| !d.exists())
                    && !h.rundir(session).exists()
            },
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_terminates_every_kernel() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let judy = user("judy", 9, limits(256, 64));
        let ken = user("ken", 10, limits(256, 64));
        let a = run_python(&h, spec(&judy), "import time; time.sleep(600)", &[]).await;
        let b = run_python(&h, spec(&ken), "import time; time.sleep(600)", &[]).await;
        h.sandbox.shutdown().await;
        assert_eq!(
            wait_exit(&*a.process, Duration::from_secs(1)).await,
            ExitReason::Terminated
        );
        assert_eq!(
            wait_exit(&*b.process, Duration::from_secs(1)).await,
            ExitReason::Terminated
        );
        for base in cgroup_bases(&h.cgroup_name) {
            assert!(!base.exists(), "{} removed on shutdown", base.display());
        }
        // Every runtime directory is gone, and so is their (then empty) base.
        assert!(
            !h.sandbox.run_base().exists(),
            "left: {:?}",
            std::fs::read_dir(h.sandbox.run_base()).map(|d| d.flatten().count())
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_sweeps_what_an_earlier_run_left() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        // What a crashed broker leaves: a runtime directory and a leaf with a live process.
        let stale = Uuid::new_v4();
        let run_base = h.sandbox.run_base().to_path_buf();
        std::fs::create_dir_all(run_base.join(stale.to_string())).unwrap();
        std::fs::write(run_base.join(stale.to_string()).join("k-1"), b"").unwrap();
        std::fs::write(run_base.join("not-ours"), b"").unwrap();
        let mut sleeper = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        for base in cgroup_bases(&h.cgroup_name) {
            let leaf = base.join("old-user").join(stale.to_string());
            std::fs::create_dir_all(&leaf).unwrap();
            std::fs::write(leaf.join("cgroup.procs"), sleeper.id().to_string()).unwrap();
        }

        h.sandbox.check().await.expect("check");

        let waited = tokio::task::spawn_blocking(move || sleeper.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(!waited.success(), "the stale process was killed");
        assert!(!run_base.join(stale.to_string()).exists());
        assert!(
            run_base.join("not-ours").exists(),
            "only runtime directories are swept"
        );
        // The base is under /run as root: leave it empty for the harness to remove.
        std::fs::remove_file(run_base.join("not-ours")).unwrap();
        for base in cgroup_bases(&h.cgroup_name) {
            assert!(!base.join("old-user").exists(), "stale cgroups removed");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_kernels_and_bad_user_names_are_refused() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let leo = user("leo", 11, limits(256, 64));
        let mut s = spec(&leo);
        s.kernel_name = "julia".into();
        match h.sandbox.launch(s).await {
            Err(SandboxError::Launch { reason, .. }) => {
                assert!(reason.to_string().contains("python3"), "{reason}")
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("launched an unknown kernel"),
        }
        let evil = user("../evil", 12, limits(256, 64));
        assert!(h.sandbox.workspace(&evil).is_err());
        assert!(h.sandbox.launch(spec(&evil)).await.is_err());
        // The shipped specs (kernels/), Python's first.
        assert_eq!(h.sandbox.kernel_names()[0], "python3");
        assert!(!h.sandbox.kernel_names().contains(&"julia".to_string()));

        // A second launch for a live session is refused and leaves the first kernel alone.
        let first = spec(&leo);
        let session = first.session_id;
        let running = run_python(&h, first.clone(), "import time; time.sleep(600)", &[]).await;
        assert!(h.sandbox.launch(first).await.is_err());
        assert!(h.rundir(session).join("connection.json").exists());
        assert!(h.leaf_dirs("leo", session).iter().all(|d| d.exists()));

        // A command that cannot be executed ends as a failed exit (setpriv says 127), and what
        // it wrote to stderr reaches the log.
        let broken = h
            .sandbox
            .launch_command(spec(&leo), vec!["/nonexistent/program".into()])
            .await
            .expect("bwrap itself starts");
        let reason = wait_exit(&*broken.process, Duration::from_secs(10)).await;
        assert!(
            matches!(reason, ExitReason::Exited(c) if c != 0),
            "{reason:?}"
        );

        running.process.terminate().await;
        assert!(!h.rundir(session).exists());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scientific_stack_works_in_the_sandbox() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let mia = user("mia", 13, limits(1024, 128));
        let ws = h.sandbox.workspace(&mia).unwrap();
        const CODE: &str = r#"
import json, warnings
warnings.simplefilter('error')  # a font or config warning fails the test
import numpy as np, pandas as pd
import matplotlib.pyplot as plt
plt.plot(np.arange(10), np.arange(10) ** 2)
plt.savefig('/workspace/plot.png')
df = pd.DataFrame({'a': [1, 2, 3]})
json.dump({'sum': int(df.a.sum()), 'backend': plt.get_backend()}, open('/workspace/sci.json', 'w'))
"#;
        let l = run_python(&h, spec(&mia), CODE, &[]).await;
        assert_eq!(
            wait_exit(&*l.process, Duration::from_secs(60)).await,
            ExitReason::Exited(0)
        );
        let r = read_json(&ws.join("sci.json"));
        assert_eq!(r["sum"], 6);
        assert!(r["backend"].as_str().unwrap().contains("inline"), "{r}");
        assert!(std::fs::metadata(ws.join("plot.png")).unwrap().len() > 1000);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn syscall_filter_refuses_namespaces_mounts_and_debugging_but_not_work() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let nina = user("nina", 14, limits(1024, 128));
        let ws = h.sandbox.workspace(&nina).expect("workspace");
        // Python 3.11 has no os.unshare: the libc calls go through ctypes.
        const CODE: &str = r#"
import ctypes, errno, json, multiprocessing, os, platform, signal, subprocess, threading, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {
    'x86_64': {'keyctl': 250, 'add_key': 248, 'bpf': 321, 'clone': 56, 'setns': 308},
    'aarch64': {'keyctl': 219, 'add_key': 217, 'bpf': 280, 'clone': 220, 'setns': 268},
}[platform.machine()]
def err(ret):
    return 'ok' if ret >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def isolated(probe):
    # Each probe runs in a child of its own: a call the filter lets through (unshare, say)
    # changes only that child, so one probe cannot spoil the next.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, probe().encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out or 'probe died'
def call(name, *args):
    def probe():
        ctypes.set_errno(0)
        return err(getattr(libc, name)(*args))
    return isolated(probe)
def sys_call(nr, *args):
    def probe():
        ctypes.set_errno(0)
        return err(libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args]))
    return isolated(probe)
def raw_clone(flags):
    ctypes.set_errno(0)
    pid = libc.syscall(ctypes.c_long(NR['clone']), ctypes.c_long(flags | signal.SIGCHLD), 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
        return 'ok'
    return err(pid)
def ptrace_child():
    child = subprocess.Popen(['/bin/sleep', '30'])
    try:
        ctypes.set_errno(0)
        return err(libc.ptrace(ctypes.c_long(16), ctypes.c_long(child.pid), None, None))
    finally:
        child.kill()
        child.wait()
NS = {'NEWNS': 0x20000, 'NEWCGROUP': 0x2000000, 'NEWUTS': 0x4000000, 'NEWIPC': 0x8000000,
      'NEWUSER': 0x10000000, 'NEWPID': 0x20000000, 'NEWNET': 0x40000000}
def threads():
    out = []
    ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return sorted(out) == list(range(8))
def pool():
    with multiprocessing.get_context('fork').Pool(2) as p:
        return p.map(abs, [-1, -2]) == [1, 2]
def numpy():
    import numpy as np
    a = np.arange(16.0).reshape(4, 4)
    return float((a @ a).sum())
def fds():
    out = []
    for fd in os.listdir('/proc/self/fd'):
        try:
            out.append(os.readlink(f'/proc/self/fd/{fd}'))
        except OSError:
            pass  # listdir's own descriptor, closed by now
    return sorted(out)
unshare_cmd = subprocess.run(['/usr/bin/unshare', '-Ur', 'id'], capture_output=True, text=True)
report = {
    'seccomp': [l for l in open('/proc/self/status') if l.startswith('Seccomp:')][0].strip('\n'),
    'uid': os.getuid(),
    'init_seccomp': [l for l in open('/proc/1/status') if l.startswith('Seccomp:')][0].strip('\n'),
    'fds': fds(),
    'unshare_cmd_rc': unshare_cmd.returncode,
    'unshare_cmd_out': unshare_cmd.stdout + unshare_cmd.stderr,
    'unshare': {k: call('unshare', v) for k, v in NS.items()},
    'clone': {k: raw_clone(v) for k, v in NS.items()},
    'clone_plain': raw_clone(0),
    'setns': sys_call(NR['setns'], os.open('/proc/self/ns/net', os.O_RDONLY), 0),
    'mount': call('mount', b'none', b'/tmp', b'tmpfs', 0, None),
    'umount2': call('umount2', b'/tmp', 0),
    'chroot': call('chroot', b'/tmp'),
    'keyctl': sys_call(NR['keyctl'], 0, -3, 1),
    'add_key': sys_call(NR['add_key'], 0, 0, 0, 0, -3),
    'bpf': sys_call(NR['bpf'], 0, 0, 0),
    'io_uring_setup': sys_call(425, 1, 0),
    'clone3': sys_call(435, 0, 0),
    'personality_query': call('personality', ctypes.c_ulong(0xffffffff)),
    'personality_no_aslr': call('personality', ctypes.c_ulong(0x0040000)),
    'ptrace': ptrace_child(),
    'threads': threads(),
    'subprocess': subprocess.run(['/bin/echo', 'hi'], capture_output=True, text=True).stdout,
    'multiprocessing': pool(),
    'numpy': numpy(),
}
with open('/workspace/filter.json', 'w') as f:
    json.dump(report, f)
"#;
        let l = run_python(&h, spec(&nina), CODE, &[]).await;
        assert_eq!(
            wait_exit(&*l.process, Duration::from_secs(60)).await,
            ExitReason::Exited(0)
        );
        let r = read_json(&ws.join("filter.json"));
        assert_eq!(r["seccomp"], "Seccomp:\t2", "{r}");
        eprintln!("sandbox init: {}", r["init_seccomp"]);
        // setpriv still dropped to the kernel's uid after the filter was installed.
        assert_eq!(r["uid"], local_kernel_uid(14), "{r}");
        // bwrap closed the filter's memfd after reading it.
        assert!(!r["fds"].to_string().contains("seccomp"), "{r}");
        assert_ne!(r["unshare_cmd_rc"], 0, "{r}");
        assert!(
            r["unshare_cmd_out"]
                .as_str()
                .unwrap()
                .contains("Operation not permitted"),
            "{r}"
        );
        for flag in [
            "NEWNS",
            "NEWCGROUP",
            "NEWUTS",
            "NEWIPC",
            "NEWUSER",
            "NEWPID",
            "NEWNET",
        ] {
            assert_eq!(r["unshare"][flag], "EPERM", "unshare {flag}: {r}");
            assert_eq!(r["clone"][flag], "EPERM", "clone {flag}: {r}");
        }
        assert_eq!(r["clone_plain"], "ok", "{r}");
        for call in [
            "setns",
            "mount",
            "umount2",
            "chroot",
            "keyctl",
            "add_key",
            "bpf",
            "io_uring_setup",
            "personality_no_aslr",
            "ptrace",
        ] {
            assert_eq!(r[call], "EPERM", "{call}: {r}");
        }
        assert_eq!(r["clone3"], "ENOSYS", "glibc falls back to clone: {r}");
        assert_eq!(r["personality_query"], "ok", "{r}");
        assert_eq!(r["threads"], true, "{r}");
        assert_eq!(r["subprocess"], "hi\n", "{r}");
        assert_eq!(r["multiprocessing"], true, "{r}");
        assert_eq!(r["numpy"], 3920.0, "{r}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mountinfo_does_not_reveal_the_data_directory() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let olga = user("olga", 15, limits(256, 64));
        let ws = h.sandbox.workspace(&olga).expect("workspace");
        const CODE: &str = r#"
import os
open('/workspace/mountinfo', 'w').write(open('/proc/self/mountinfo').read())
open('/workspace/fds', 'w').write(' '.join(os.listdir('/proc/self/fd')))
"#;
        let spec = spec(&olga);
        let session = spec.session_id.to_string();
        let l = run_python(&h, spec, CODE, &[]).await;
        assert_eq!(
            wait_exit(&*l.process, Duration::from_secs(30)).await,
            ExitReason::Exited(0)
        );
        let mountinfo = std::fs::read_to_string(ws.join("mountinfo")).expect("mountinfo");
        assert!(mountinfo.contains(" /run/kernel "), "{mountinfo}");
        // /proc stays usable for the kernel.
        assert!(!std::fs::read_to_string(ws.join("fds")).unwrap().is_empty());
        // Field 4 is the bind source's path inside its file system: for a bind from the data
        // directory, the host path. The workspace is a file system of its own (its ext4
        // image) as root, so its line shows `/` there.
        let data_dir = h.data_dir();
        let data_dir = data_dir.to_str().unwrap();
        for line in mountinfo.lines() {
            if is_root() {
                assert!(!line.contains(data_dir), "{line}\n{mountinfo}");
            } else {
                // Unprivileged nothing can be mounted over them: the kernel's own workspace
                // and runtime directory show their host paths (docs/HOSTS.md), as does the
                // broker's tools directory (`sudo`), beside that runtime directory in the same
                // runtime base (so it shows no more of the host); nothing else of the data
                // directory does.
                let tools = format!("{data_dir}/run/tools ");
                assert!(
                    !line.contains(data_dir)
                        || line.contains(ws.to_str().unwrap())
                        || line.contains(&session)
                        || line.contains(&tools),
                    "{line}\n{mountinfo}"
                );
            }
        }
    })
    .await;
}
