//! Fork-server starts (issue 12) in the Docker sandbox, real Docker Engine and the real
//! kernel image: kernels forked from the user's template in the user's container are
//! ordinary kernels of their own (pid, key, session directory, cgroup leaf, fresh random
//! generators, none of the template's descriptors, a clean namespace with the data stack
//! already imported), isolated and limited exactly as started ones, interruptible; a
//! session's end takes everything it started (a double-forked daemon too) and nothing of a
//! sibling's; a kernel that kills its template leaves the next session a plain start.
//!
//! The broker runs as root on the host, so the tests read the kernels' host processes in
//! `/proc` and their leaves in the cgroup file system, as the broker does.

use crate::common;

use std::time::Duration;

use common::forked::{
    first_process, kernel_leaf_dir, link, links, out, parent_of,
    planted_modules_reach_no_later_session,
};
use common::*;
use serde_json::{json, Value};

/// The Docker backend with its defaults: templates on, the data stack preloaded.
async fn broker(tweak: impl FnOnce(&mut kernel_broker::config::ServeArgs)) -> Broker {
    docker_ready();
    Broker::start("docker", tweak).await
}

/// `(pid, parent pid, the parent's command name)` of the kernel, as seen in the container.
async fn ancestry(api: &Api, id: &str) -> (u32, u32, String) {
    let text = out(
        api,
        id,
        "import os; p = os.getppid(); print(os.getpid(), p, open('/proc/%d/comm' % p).read().strip())",
    )
    .await;
    let mut it = text.split_whitespace();
    let pid = it.next().unwrap().parse().unwrap();
    let parent = it.next().unwrap().parse().unwrap();
    (pid, parent, it.next().unwrap_or_default().to_string())
}

/// The host pid of the kernel of session `id` (the first process of its leaf).
async fn host_pid(api: &Api, id: &str) -> i32 {
    first_process(&kernel_leaf_dir(api, id).await)
}

#[tokio::test]
async fn forked_kernels_are_kernels_of_their_own() {
    let broker = broker(|_| {}).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let b = api.create().await;
    let (pa, ta, name) = ancestry(&api, &a).await;
    let (pb, tb, _) = ancestry(&api, &b).await;
    assert_eq!(ta, tb, "one template");
    assert_eq!(
        name, "kb-template",
        "forked from the template, not started by tini"
    );
    assert_ne!(pa, pb);
    // Own key and session directory; the connection file is gone once loaded.
    let probe = "import os\nfrom ipykernel.kernelapp import IPKernelApp\napp = IPKernelApp.instance()\n\
                 print(__import__('hashlib').sha256(get_ipython().kernel.session.key).hexdigest(), app.ip, os.path.exists(app.connection_file))";
    let (ka, kb) = (out(&api, &a, probe).await, out(&api, &b, probe).await);
    let (ka, kb): (Vec<&str>, Vec<&str>) = (ka.split(' ').collect(), kb.split(' ').collect());
    assert_ne!(ka[0], kb[0], "own HMAC keys");
    assert_ne!(ka[1], kb[1], "own session directories");
    assert!(ka[1].starts_with("/run/kernel/"), "{ka:?}");
    assert_eq!((ka[2], kb[2]), ("False", "False"));
    // Each in its own leaf, named by its session; the template in another one.
    let (la, lb) = (
        kernel_leaf_dir(&api, &a).await,
        kernel_leaf_dir(&api, &b).await,
    );
    assert!(la.ends_with(&a), "{la:?}");
    assert!(lb.ends_with(&b), "{lb:?}");
    // Fresh random generators.
    let rand = "import random, numpy as np; print(random.random(), np.random.rand(), np.random.default_rng().random())";
    let (ra, rb) = (out(&api, &a, rand).await, out(&api, &b, rand).await);
    for (x, y) in ra.split(' ').zip(rb.split(' ')) {
        assert_ne!(x, y, "{ra} / {rb}");
    }
    // No descriptor of the template's is left in a kernel but stderr (its log, by design).
    let (ha, hb) = (host_pid(&api, &a).await, host_pid(&api, &b).await);
    let template = parent_of(ha);
    assert_eq!(template, parent_of(hb), "one template on the host too");
    let template_leaf = std::fs::read_to_string(format!("/proc/{template}/cgroup")).unwrap();
    assert!(
        !template_leaf.contains(&a) && template_leaf.contains("kb-template-"),
        "{template_leaf}"
    );
    let stderr = link(template, "2");
    let template_fds: Vec<String> = links(template)
        .into_iter()
        .filter(|l| *l != stderr)
        .collect();
    assert!(!template_fds.is_empty(), "the template's control channel");
    for (id, pid) in [(&a, ha), (&b, hb)] {
        for l in links(pid) {
            assert!(!template_fds.contains(&l), "{id}: {l} is the template's");
        }
    }
    broker.stop().await;
}

/// Under the default limits a fork bomb in a forked kernel meets the pids limit, not the
/// memory limit (see tests/it/fork_server.rs).
#[tokio::test]
async fn a_fork_bomb_in_a_forked_kernel_meets_the_pids_limit() {
    let broker = broker(|_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let (_, _, parent) = ancestry(&api, &id).await;
    assert_ne!(parent, "tini", "forked from the template");
    forked::a_fork_bomb_meets_the_pids_limit(&api, &id).await;
    broker.stop().await;
}

#[tokio::test]
async fn the_namespace_is_clean_and_charts_arrive() {
    let broker = broker(|_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    forked::clean_namespace_with_the_stack(&api, &id).await;
    broker.stop().await;
}

#[tokio::test]
async fn isolation_limits_and_interrupts_hold_for_forked_kernels() {
    let broker = broker(|a| a.session_memory_limit = Some(400 << 20)).await;
    let alice = broker.api(ALICE);
    let bob = broker.api(BOB);
    let a = alice.create().await;
    let b = bob.create().await;
    let (_, ta, name) = ancestry(&alice, &a).await;
    assert_eq!(name, "kb-template");
    // Each user in a container of their own: bob sees neither alice's files nor her
    // processes (her template included).
    out(
        &alice,
        &a,
        "open('/workspace/secret.txt', 'w').write('alice')",
    )
    .await;
    let seen = out(
        &bob,
        &b,
        "import os\n\
         def comm(p):\n\
         \x20   try:\n\
         \x20       return open('/proc/%s/comm' % p).read().strip()\n\
         \x20   except OSError:\n\
         \x20       return ''\n\
         names = [comm(p) for p in os.listdir('/proc') if p.isdigit()]\n\
         print(os.path.exists('/workspace/secret.txt'), names.count('kb-template'), names.count('ipykernel'))",
    )
    .await;
    // Only his own template and kernel: alice's are in another container.
    assert_eq!(seen, "False 1 1", "{seen}");
    let bob_host = host_pid(&bob, &b).await;
    let alice_host = host_pid(&alice, &a).await;
    assert_ne!(
        parent_of(bob_host),
        parent_of(alice_host),
        "a template per user"
    );
    let uid = out(&alice, &a, "import os; print(os.getuid())").await;
    assert_eq!(uid, "1000");
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
    // An interrupt reaches the forked kernel; its state survives.
    alice.execute(&a, "kept = 'yes'").await;
    let long = {
        let api = broker.api(ALICE);
        let a = a.clone();
        tokio::spawn(async move { api.execute(&a, "import time\ntime.sleep(60)").await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (status, _) = alice
        .post(&format!("/v1/sessions/{a}/interrupt"), json!({}))
        .await;
    assert_eq!(status, 204);
    let v = within(30, "the interrupted cell", long).await.unwrap();
    assert_eq!(v["status"], "interrupted", "{v}");
    assert_eq!(out(&alice, &a, "print(kept)").await, "yes");
    // Another forked kernel of alice's, past its own memory limit, dies alone.
    let c = alice.create().await;
    let (_, tc, _) = ancestry(&alice, &c).await;
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
        "its sibling lives"
    );
    // The template too: the next kernel is still forked from it.
    let d = alice.create().await;
    assert_eq!(ancestry(&alice, &d).await.1, ta);
    broker.stop().await;
}

#[tokio::test]
async fn a_sessions_daemon_dies_with_it_and_a_sibling_survives() {
    let broker = broker(|_| {}).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let b = api.create().await;
    // A double-forked daemon in a new session: `sh` exits, `sleep` is an orphan.
    let daemon = out(
        &api,
        &a,
        "import subprocess, time\nsubprocess.run(['sh', '-c', 'setsid sleep 1000 > /dev/null 2>&1 & echo $! > /tmp/daemon.pid'])\ntime.sleep(0.5)\nprint(open('/tmp/daemon.pid').read().strip())",
    )
    .await;
    let alive = format!(
        "import os\ntry:\n    print(open('/proc/{daemon}/cmdline').read().split(chr(0))[0])\nexcept OSError:\n    print('gone')"
    );
    assert_eq!(
        out(&api, &b, &alive).await,
        "sleep",
        "the sibling sees the daemon"
    );
    // It is in session a's leaf, whatever it was reparented to.
    let cg = out(
        &api,
        &b,
        &format!("print(open('/proc/{daemon}/cgroup').read())"),
    )
    .await;
    assert!(cg.contains(&a), "{cg}");
    let (status, _) = api.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(status, 204);
    let mut gone = String::new();
    for _ in 0..50 {
        gone = out(&api, &b, &alive).await;
        if gone == "gone" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gone, "gone", "the daemon ended with its session");
    assert_eq!(
        out(&api, &b, "print(6 * 7)").await,
        "42",
        "the sibling lives"
    );
    broker.stop().await;
}

#[tokio::test]
async fn a_kernel_that_kills_its_template_leaves_plain_starts() {
    let broker = broker(|_| {}).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let (_, template, name) = ancestry(&api, &a).await;
    assert_eq!(name, "kb-template");
    // It cannot open the template's control channel; it may kill it, and ends with it.
    forked::kernel_attacks_its_template(&api, &a, template).await;
    let b = api.create().await;
    let (_, _, parent) = ancestry(&api, &b).await;
    assert_eq!(parent, "tini", "started plainly under its own tini");
    assert_eq!(out(&api, &b, "x = 41; print(x + 1)").await, "42");
    // A plain start imports nothing beyond ipykernel.
    let v: Value = api
        .execute(&b, "import sys; print('pandas' in sys.modules)")
        .await;
    assert_eq!(v["stdout"].as_str().unwrap().trim(), "False", "{v}");
    broker.stop().await;
}

#[tokio::test]
async fn the_fork_server_can_be_turned_off() {
    let broker = broker(|a| a.fork_server = Some(false)).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let (_, _, parent) = ancestry(&api, &id).await;
    assert_eq!(parent, "tini", "a plain start");
    broker.stop().await;
}

#[tokio::test]
async fn planted_modules_reach_no_later_session_of_the_user() {
    let broker = broker(|_| {}).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let b = api.create().await;
    planted_modules_reach_no_later_session(&api, &a, &b, false).await;
    broker.stop().await;
}
