//! Fork-server starts (issue 12), local sandbox, real kernels: kernels forked from the
//! user's template are ordinary kernels of their own (key, sockets, pid, cgroup leaf, fresh
//! random generators, a clean namespace with the data stack already imported), isolated and
//! limited exactly as started ones, and a broken template falls back to a plain start.

use crate::common;

use common::forked::{link, links, out, parent_of, planted_modules_reach_no_later_session};
use common::*;
use serde_json::{json, Value};

crate::on_both_backends!(the_python3_specs_env_reaches_forked_kernels);

fn forking(a: &mut kernel_broker::config::ServeArgs) {
    a.fork_server = Some(true);
    a.preload = Some("numpy,pandas,matplotlib".into());
}

/// The host pid of the kernel of `session` (the only process of its cgroup leaf).
fn host_pid(broker: &Broker, user: &str, session: &str) -> i32 {
    let procs = pids_cgroup_base(broker.cgroup_name())
        .join(user)
        .join(session)
        .join("cgroup.procs");
    let text = std::fs::read_to_string(&procs).unwrap();
    text.lines().next().unwrap().trim().parse().unwrap()
}

/// `(pid, parent pid)` of the kernel process, as seen in its sandbox.
async fn pids(api: &Api, id: &str) -> (u32, u32) {
    let text = out(api, id, "import os; print(os.getpid(), os.getppid())").await;
    let mut it = text.split_whitespace().map(|p| p.parse::<u32>().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

#[tokio::test]
async fn forked_kernels_are_kernels_of_their_own() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let b = api.create().await;
    let (pa, ta) = pids(&api, &a).await;
    let (pb, tb) = pids(&api, &b).await;
    // Both forked from the same template (not the sandbox's init, pid 1), each its own pid.
    assert_eq!(ta, tb, "one template");
    assert_ne!(ta, 1, "forked, not started by bwrap's init");
    assert_ne!(pa, pb);
    // Own key and sockets; the connection file is gone once loaded. (The key's digest: the
    // key itself is masked in output, as every kernel's.)
    let probe = "import os, hashlib\nk = get_ipython().kernel\n\
                 print(hashlib.sha256(k.session.key).hexdigest(), os.path.exists(get_ipython().config.get('IPKernelApp', {}).get('connection_file', '/nonexistent')))";
    let (ka, kb) = (out(&api, &a, probe).await, out(&api, &b, probe).await);
    assert_ne!(ka.split(' ').next(), kb.split(' ').next(), "own HMAC keys");
    assert!(
        ka.ends_with("False") && kb.ends_with("False"),
        "{ka} / {kb}"
    );
    let socket_dir =
        "from ipykernel.kernelapp import IPKernelApp\nprint(IPKernelApp.instance().ip)";
    assert_ne!(
        out(&api, &a, socket_dir).await,
        out(&api, &b, socket_dir).await
    );
    // Each in its own cgroup leaf, named by its session.
    for id in [&a, &b] {
        let cg = out(&api, id, "print(open('/proc/self/cgroup').read())").await;
        assert!(cg.contains(id.as_str()), "{id}: {cg}");
    }
    // Fresh random generators.
    let rand = "import random, numpy as np; print(random.random(), np.random.rand(), np.random.default_rng().random())";
    let (ra, rb) = (out(&api, &a, rand).await, out(&api, &b, rand).await);
    for (x, y) in ra.split(' ').zip(rb.split(' ')) {
        assert_ne!(x, y, "{ra} / {rb}");
    }
    // No descriptor of the template's is left in a kernel but stderr (which goes to the
    // broker's log by design): not its control pipes, nothing else. Read from the host,
    // which an unprivileged broker's uid may not do (kernels are not dumpable, so their
    // /proc/PID/fd is closed to it); the fork's clean-up is the same in both modes.
    let root = host::is_root();
    for id in [&a, &b].into_iter().filter(|_| root) {
        let kernel = host_pid(&broker, "alice", id);
        let template = parent_of(kernel);
        let stderr = link(template, "2");
        let template_fds: Vec<String> = links(template)
            .into_iter()
            .filter(|l| *l != stderr)
            .collect();
        assert!(!template_fds.is_empty(), "the template's control pipes");
        for l in links(kernel) {
            assert!(!template_fds.contains(&l), "{id}: {l} is the template's");
        }
    }
    broker.stop().await;
}

#[tokio::test]
async fn the_namespace_is_clean_and_the_stack_is_already_there() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    forked::clean_namespace_with_the_stack(&api, &id).await;
    broker.stop().await;
}

/// A forked kernel's children cost it memory (each ~2.5 MiB of copied pages and page tables
/// with the data stack preloaded): under the default limits a fork bomb must meet the pids
/// limit, not the memory limit.
#[tokio::test]
async fn a_fork_bomb_in_a_forked_kernel_meets_the_pids_limit() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let (_, template) = pids(&api, &id).await;
    assert_ne!(template, 1, "forked");
    forked::a_fork_bomb_meets_the_pids_limit(&api, &id).await;
    broker.stop().await;
}

#[tokio::test]
async fn isolation_and_limits_hold_for_forked_kernels() {
    let broker = Broker::start("local", |a| {
        forking(a);
        a.session_memory_limit = Some(400 << 20);
    })
    .await;
    let alice = broker.api(ALICE);
    let bob = broker.api(BOB);
    let a = alice.create().await;
    let b = bob.create().await;
    let (_, ta) = pids(&alice, &a).await;
    assert_ne!(ta, 1, "forked");
    // Different users, different uids, neither root; each sees only its own workspace.
    // An unprivileged broker's kernels all run as its own uid (docs/HOSTS.md says what
    // that gives up): users are apart by their namespaces only.
    let ua = out(&alice, &a, "import os; print(os.getuid())").await;
    let ub = out(&bob, &b, "import os; print(os.getuid())").await;
    // SAFETY: geteuid(2) cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        assert_ne!(ua, ub);
    } else {
        assert_eq!(
            (ua.as_str(), ub.as_str()),
            (euid.to_string().as_str(), euid.to_string().as_str())
        );
    }
    assert_ne!(ua, "0");
    out(
        &alice,
        &a,
        "open('/workspace/secret.txt', 'w').write('alice')",
    )
    .await;
    let seen = out(
        &bob,
        &b,
        "import os; print(os.path.exists('/workspace/secret.txt'), sorted(os.listdir('/proc'))[:0])",
    )
    .await;
    assert!(seen.starts_with("False"), "{seen}");
    // No network but loopback.
    let net = out(
        &alice,
        &a,
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)",
    )
    .await;
    assert!(net.starts_with("refused"), "{net}");
    let ifaces = out(&alice, &a, "import socket; print(socket.if_nameindex())").await;
    assert_eq!(ifaces, "[(1, 'lo')]");
    // Another forked kernel of alice's, past its own memory limit, dies alone.
    let c = alice.create().await;
    let (_, tc) = pids(&alice, &c).await;
    assert_eq!(tc, ta, "forked from alice's template");
    let v = alice
        .execute(
            &c,
            "x = bytearray(600 * 1024 * 1024); x[::4096] = b'x' * len(x[::4096])",
        )
        .await;
    assert_eq!(v["status"], "dead", "{v}");
    let (status, s) = alice.get(&format!("/v1/sessions/{c}")).await;
    assert_eq!(status, 200);
    let reason = s["dead_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("out of memory"), "{reason}");
    assert_eq!(
        out(&alice, &a, "print(1 + 1)").await,
        "2",
        "the other kernel lives"
    );
    broker.stop().await;
}

#[tokio::test]
async fn a_broken_template_falls_back_to_a_plain_start() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let (_, template) = pids(&api, &a).await;
    assert_ne!(template, 1);
    // It cannot open the template's control channel; it may kill it, and ends with it.
    forked::kernel_attacks_its_template(&api, &a, template).await;
    let b = api.create().await;
    let v = api.execute(&b, "import os; print(os.getppid())").await;
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(
        v["stdout"].as_str().unwrap().trim(),
        "1",
        "started plainly by bwrap's init"
    );
    assert_eq!(out(&api, &b, "x = 41; print(x + 1)").await, "42");
    broker.stop().await;
}

#[tokio::test]
async fn the_fork_server_can_be_turned_off() {
    let broker = Broker::start("local", |a| {
        forking(a);
        a.fork_server = Some(false);
    })
    .await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let (_, parent) = pids(&api, &id).await;
    assert_eq!(parent, 1, "a plain start");
    let v: Value = api
        .execute(&id, "import sys; print('pandas' in sys.modules)")
        .await;
    assert_eq!(v["stdout"].as_str().unwrap().trim(), "False", "{v}");
    let _ = json!({});
    broker.stop().await;
}

/// The leaves of `user` in the pids hierarchy: (name, its processes).
fn leaves(broker: &Broker, user: &str) -> Vec<(String, Vec<i32>)> {
    let dir = pids_cgroup_base(broker.cgroup_name()).join(user);
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        if !e.path().is_dir() {
            continue;
        }
        let procs = std::fs::read_to_string(e.path().join("cgroup.procs")).unwrap_or_default();
        let pids = procs
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        out.push((e.file_name().to_string_lossy().into_owned(), pids));
    }
    out
}

/// The memory limit of `user`'s leaf `leaf` (v1 `memory.limit_in_bytes`, v2 `memory.max`).
fn memory_limit(broker: &Broker, user: &str, leaf: &str) -> String {
    let v1 = std::path::Path::new("/sys/fs/cgroup/memory")
        .join(broker.cgroup_name())
        .join(user)
        .join(leaf)
        .join("memory.limit_in_bytes");
    let file = if v1.exists() {
        v1
    } else {
        pids_cgroup_base(broker.cgroup_name())
            .join(user)
            .join(leaf)
            .join("memory.max")
    };
    std::fs::read_to_string(&file).unwrap().trim().to_string()
}

/// The stem of `user`'s template: the leaf, named by none of `sessions`, whose only process
/// is a child of `template` (host pid). Waited for.
async fn stem_of(broker: &Broker, user: &str, template: i32, sessions: &[&str]) -> (String, i32) {
    within(20, "the template's stem", async {
        loop {
            let found =
                leaves(broker, user)
                    .into_iter()
                    .find_map(|(name, pids)| match pids.as_slice() {
                        [pid]
                            if parent_of(*pid) == template
                                && !sessions.contains(&name.as_str()) =>
                        {
                            Some((name, *pid))
                        }
                        _ => None,
                    });
            if let Some(found) = found {
                return found;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
}

/// A session's pid inside its sandbox, from the host's (the last `NSpid`).
fn inner_pid(host_pid: i32) -> i32 {
    let status = std::fs::read_to_string(format!("/proc/{host_pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    line.split_whitespace().last().unwrap().parse().unwrap()
}

/// Stems: after each fork the template forks the next kernel's process ahead of need and
/// moves it into a leaf of its own (the slow part on cgroup v1); the next session's kernel
/// is that process, its leaf renamed after the session and given the session's limits.
/// A stem a hostile kernel kills or stops is not used (the launch forks anew); the stems'
/// leaves go with the template.
#[tokio::test]
async fn each_kernel_is_forked_and_placed_ahead_of_need() {
    if !host::is_root() || !std::path::Path::new("/sys/fs/cgroup/pids").is_dir() {
        // The stems are found through /proc/<pid>/stat of the kernels (not dumpable), and
        // made only on cgroup v1 (v2 cannot rename a leaf).
        eprintln!("skipped: needs root and cgroup v1");
        return;
    }
    let broker = Broker::start("local", |a| {
        forking(a);
        a.session_memory_limit = Some(300 << 20);
        a.container_idle = Some(0);
    })
    .await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let kernel_a = host_pid(&broker, "alice", &a);
    let template = parent_of(kernel_a);
    let (stem_leaf, stem_pid) = stem_of(&broker, "alice", template, &[&a]).await;
    assert_ne!(stem_leaf, a);
    assert_ne!(
        memory_limit(&broker, "alice", &stem_leaf),
        (300u64 << 20).to_string()
    );

    // The next session's kernel is the stem: same process, its leaf now the session's.
    let b = api.create().await;
    assert_eq!(
        host_pid(&broker, "alice", &b),
        stem_pid,
        "the stem became b's kernel"
    );
    assert_eq!(
        memory_limit(&broker, "alice", &b),
        (300u64 << 20).to_string()
    );
    let names: Vec<String> = leaves(&broker, "alice")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(!names.contains(&stem_leaf), "renamed: {names:?}");
    assert_eq!(out(&api, &b, "x = 6 * 7; print(x)").await, "42");
    let cg = out(&api, &b, "print(open('/proc/self/cgroup').read())").await;
    assert!(cg.contains(b.as_str()), "{cg}");

    // A kernel of the same user kills the next stem: the next launch forks anew.
    let (killed_leaf, killed) = stem_of(&broker, "alice", template, &[&a, &b]).await;
    assert_ne!(killed, stem_pid);
    let v = api
        .execute(&a, &format!("import os; os.kill({}, 9)", inner_pid(killed)))
        .await;
    assert_eq!(v["status"], "ok", "{v}");
    within(10, "the stem's end", async {
        while std::path::Path::new(&format!("/proc/{killed}")).exists() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    let c = api.create().await;
    let kernel_c = host_pid(&broker, "alice", &c);
    assert_ne!(kernel_c, killed);
    assert_eq!(parent_of(kernel_c), template, "still forked");
    assert_eq!(out(&api, &c, "print(1 + 1)").await, "2");
    within(10, "the killed stem's leaf removed", async {
        while leaves(&broker, "alice")
            .iter()
            .any(|(n, _)| *n == killed_leaf)
        {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;

    // One that stops the next stem (it would never answer once released): not used either.
    let (stopped_leaf, stopped) = stem_of(&broker, "alice", template, &[&a, &b, &c]).await;
    let v = api
        .execute(
            &a,
            &format!("import os; os.kill({}, 19)", inner_pid(stopped)),
        )
        .await;
    assert_eq!(v["status"], "ok", "{v}");
    within(10, "the stem stopped", async {
        while !std::fs::read_to_string(format!("/proc/{stopped}/stat"))
            .unwrap_or_default()
            .contains(") T ")
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    let d = api.create().await;
    assert_ne!(host_pid(&broker, "alice", &d), stopped);
    assert_eq!(out(&api, &d, "print(2 + 2)").await, "4");
    within(10, "the stopped stem's leaf removed", async {
        while leaves(&broker, "alice")
            .iter()
            .any(|(n, _)| *n == stopped_leaf)
        {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;

    // With no session left the template ends (no grace), and its stem with it.
    stem_of(&broker, "alice", template, &[&a, &b, &c, &d]).await;
    for id in [&a, &b, &c, &d] {
        api.delete(&format!("/v1/sessions/{id}")).await;
    }
    within(20, "alice's cgroup removed", async {
        while pids_cgroup_base(broker.cgroup_name())
            .join("alice")
            .exists()
        {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    broker.stop().await;
}

/// A loop in a forked kernel, as an attacker would write it: inotify on `/run/kernel` (its
/// template's runtime directory, where the broker makes each next kernel's directory) and,
/// as soon as a directory appears, move it aside and put a symlink to `victim` (a host
/// directory) in its place. `swapped` counts its wins.
fn stem_racer(victim: &str) -> String {
    format!(
        "import ctypes, os, struct, threading\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         _fd = libc.inotify_init1(0)\n\
         assert _fd >= 0, ctypes.get_errno()\n\
         assert libc.inotify_add_watch(_fd, b'/run/kernel', 0x100) >= 0, ctypes.get_errno()\n\
         swapped = []\n\
         def _race():\n\
         \x20   while True:\n\
         \x20       buf, i = os.read(_fd, 65536), 0\n\
         \x20       while i < len(buf):\n\
         \x20           _, mask, _, n = struct.unpack_from('iIII', buf, i)\n\
         \x20           name = buf[i + 16:i + 16 + n].rstrip(b'\\0').decode()\n\
         \x20           i += 16 + n\n\
         \x20           if mask & 0x40000000 and not name.endswith('.aside'):\n\
         \x20               p = '/run/kernel/' + name\n\
         \x20               try:\n\
         \x20                   os.rename(p, p + '.aside')\n\
         \x20                   os.symlink({victim:?}, p)\n\
         \x20                   swapped.append(name)\n\
         \x20               except OSError:\n\
         \x20                   pass\n\
         threading.Thread(target=_race, daemon=True).start()\n\
         print('racing')"
    )
}

/// Issue 32, attack 4: the broker made the next kernel's directory in the template's
/// runtime directory (the kernel's to write), then chowned it and wrote the connection
/// file by path: a racer swapping the new directory for a symlink got a host directory
/// chowned to its uid and the new kernel's key written into it. Now the directory is made,
/// checked and written through descriptors; a swapped one fails that fork (the session
/// starts plainly). The racer ran long enough here to win against the old code (it did
/// within 15-71 launches), and must have swapped at least once.
#[tokio::test]
async fn a_racer_in_the_template_directory_never_redirects_the_brokers_writes() {
    if !host::is_root() {
        eprintln!("skipped: the kernel's directory is chowned only by a root broker");
        return;
    }
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let attacker = api.create().await;
    let victim = tempfile::Builder::new()
        .prefix("kb-stem-victim-")
        .tempdir_in("/tmp")
        .unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    std::fs::set_permissions(victim.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(
        out(
            &api,
            &attacker,
            &stem_racer(victim.path().to_str().unwrap())
        )
        .await,
        "racing"
    );
    let mut swaps = 0;
    for _ in 0..80 {
        // A swap the racer wins after the broker's writes breaks only that kernel (its
        // sockets' directory is gone): the user's own sessions are the racer's to spoil.
        let (status, v) = api.post("/v1/sessions", json!({})).await;
        assert!(status == 201 || status == 503, "{status} {v}");
        if let Some(id) = v["id"].as_str() {
            api.delete(&format!("/v1/sessions/{id}")).await;
        }
        swaps = out(&api, &attacker, "print(len(swapped))")
            .await
            .parse::<usize>()
            .unwrap();
        if swaps >= 10 {
            break;
        }
    }
    let meta = std::fs::metadata(victim.path()).unwrap();
    let inside: Vec<_> = std::fs::read_dir(victim.path())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert!(
        swaps >= 1,
        "the racer never swapped a directory: this test saw nothing"
    );
    assert_eq!(
        meta.uid(),
        0,
        "a host directory was chowned to the kernel's uid"
    );
    assert!(
        inside.is_empty(),
        "the broker wrote into a host directory: {inside:?}"
    );
    broker.stop().await;
}

#[tokio::test]
async fn planted_modules_reach_no_later_session_of_the_user() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let b = api.create().await;
    planted_modules_reach_no_later_session(&api, &a, &b, true).await;
    broker.stop().await;
}

/// The python3 spec's own `env` (its `kernel.json`) reaches kernels forked from the
/// template as it reaches started ones (the local sandbox's template has it too): the
/// template runs with it, and its forks inherit it.
async fn the_python3_specs_env_reaches_forked_kernels(sandbox: &'static str) {
    let specs = tempfile::tempdir().unwrap();
    let dir = specs.path().join("python3");
    std::fs::create_dir(&dir).unwrap();
    let mut spec: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("kernels/python3/kernel.json")).unwrap(),
    )
    .unwrap();
    spec["env"] = json!({"KB_SPEC_MARK": "from-the-spec", "KB_SPEC_OTHER": "spec"});
    std::fs::write(dir.join("kernel.json"), spec.to_string()).unwrap();
    let b = Broker::start(sandbox, |a| {
        a.kernels_dir = Some(specs.path().to_path_buf());
        a.python = Some(repo().join("kernels/.venv/bin/python"));
    })
    .await;
    let api = b.api(ALICE);
    let id = api.create().await;
    assert!(
        out(&api, &id, "import sys; print('numpy' in sys.modules)").await == "True",
        "not a fork of the template (which preloads the data stack)"
    );
    let seen = out(
        &api,
        &id,
        "import os; print(os.environ.get('KB_SPEC_MARK'), os.environ.get('KB_SPEC_OTHER'))",
    )
    .await;
    assert_eq!(seen, "from-the-spec spec");
    b.stop().await;
}
