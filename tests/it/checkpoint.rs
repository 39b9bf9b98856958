//! Checkpoints and rewind (issue 36, item 2), real kernels forked from their user's
//! template, through the REST API: a checkpoint is the frozen former live kernel; a rewind
//! makes a fork of it the live kernel; the bounds drop the oldest; a checkpoint's processes
//! do not run; nothing is left once the session ends; a checkpoint kernel that lies about
//! its fork gets nothing adopted. The first three on both sandboxes (Docker: kernels in the
//! user's container, their leaves frozen beneath the container's cgroup), the rest on the
//! local one.

use crate::common;

use common::forked::{busy_with, kernel_leaf_dir, out};
use common::*;
use serde_json::{json, Value};

on_both_backends!(
    a_rewind_brings_back_the_checkpoints_state_again_and_again,
    a_fork_of_a_checkpoint_is_a_new_session_with_its_state,
    a_checkpoints_processes_do_not_run,
    executions_sent_together_each_get_their_checkpoint,
    a_checkpoint_its_kernel_stops_or_kills_fails_nothing_and_hangs_nothing,
);

fn forking(a: &mut kernel_broker::config::ServeArgs) {
    a.fork_server = Some(true);
    a.preload = Some("numpy".into());
}

async fn take(api: &Api, id: &str) -> Value {
    let (status, v) = api
        .post(&format!("/v1/sessions/{id}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 201, "{v}");
    v
}

/// A broker forking kernels whose launch timeout (hence a fork reply's bound) is `secs`.
async fn short_launch_broker(secs: u64) -> Broker {
    Broker::start("local", |a| {
        forking(a);
        a.launch_timeout = Some(scaled(std::time::Duration::from_secs(secs)).as_secs());
    })
    .await
}

/// A new session of `api`'s user taking a checkpoint after every execution.
async fn every_execution_session(api: &Api) -> String {
    let (status, v) = api
        .post("/v1/sessions", json!({"checkpoint_every_execution": true}))
        .await;
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

/// The execution counts of listing `l`'s checkpoints, oldest first.
fn counts(l: &Value) -> Vec<u64> {
    l["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["execution_count"].as_u64().unwrap())
        .collect()
}

async fn list(api: &Api, id: &str) -> Value {
    let (status, v) = api.get(&format!("/v1/sessions/{id}/checkpoints")).await;
    assert_eq!(status, 200, "{v}");
    v
}

async fn rewind(api: &Api, id: &str, cp: &str) -> (u16, Value) {
    api.post(
        &format!("/v1/sessions/{id}/rewind"),
        json!({ "checkpoint": cp }),
    )
    .await
}

/// The host pids in leaf `leaf` of `user`.
fn leaf_pids(broker: &Broker, user: &str, leaf: &str) -> Vec<i32> {
    std::fs::read_to_string(
        pids_cgroup_base(broker.cgroup_name())
            .join(user)
            .join(leaf)
            .join("cgroup.procs"),
    )
    .unwrap_or_default()
    .lines()
    .filter_map(|l| l.trim().parse().ok())
    .collect()
}

async fn broker_events(api: &Api, id: &str) -> Vec<Value> {
    let (status, v) = api
        .get(&format!("/v1/sessions/{id}/events?channel=broker"))
        .await;
    assert_eq!(status, 200, "{v}");
    v["events"].as_array().unwrap().clone()
}

async fn a_rewind_brings_back_the_checkpoints_state_again_and_again(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1; import random; random.seed(5)").await;
    let started = std::time::Instant::now();
    let cp = take(&api, &a).await;
    let take_ms = started.elapsed().as_millis();
    let cp_id = cp["id"].as_str().unwrap().to_string();
    assert_eq!(cp["session"], a.as_str(), "{cp}");
    assert_eq!(cp["execution_count"], 1, "{cp}");
    assert!(cp["memory_bytes"].as_u64().unwrap() > 0, "{cp}");
    // The session goes on, with the state it had.
    let draw = out(&api, &a, "print(random.random())").await;
    out(&api, &a, "x = 2; y = 3\ndef g(): pass").await;
    out(&api, &a, "random.random(); random.random()").await;
    for round in 0..2 {
        let started = std::time::Instant::now();
        let (status, s) = rewind(&api, &a, &cp_id).await;
        let rewind_ms = started.elapsed().as_millis();
        assert_eq!(status, 200, "{s}");
        assert_eq!(s["id"], a.as_str(), "{s}");
        assert_eq!(s["execution_count"], 1, "{s}");
        assert_eq!(s["state"], "idle", "{s}");
        let v = api
            .execute(&a, "print(x, 'y' in dir(), 'g' in dir(), random.random())")
            .await;
        assert_eq!(v["status"], "ok", "{v}");
        assert_eq!(v["execution_count"], 2, "{v}");
        assert_eq!(
            v["stdout"].as_str().unwrap().trim(),
            format!("1 False False {draw}"),
            "round {round}"
        );
        out(&api, &a, "x = 99; z = 1").await;
        eprintln!("checkpoint take: {take_ms} ms; rewind: {rewind_ms} ms");
    }
    // The recording tells it.
    let events = broker_events(&api, &a).await;
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"checkpoint_taken"), "{kinds:?}");
    let rewound: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "session_rewound")
        .collect();
    assert_eq!(rewound.len(), 2, "{kinds:?}");
    assert_eq!(rewound[0]["detail"]["checkpoint"], cp_id.as_str());
    assert_eq!(rewound[0]["detail"]["execution_count"], 1);
    let l = list(&api, &a).await;
    assert_eq!(l["checkpoints"].as_array().unwrap().len(), 1, "{l}");
    assert_eq!(l["budget"]["count"], 1, "{l}");

    // A restart while the checkpoint (the session's first kernel) is held starts a kernel
    // beside it (the OpenAPI fuzzer's 503: "session ... already has a kernel"); both
    // Jupyter's and the agent API's, twice; the checkpoint still rewinds after.
    for path in [
        format!("/v1/sessions/{a}/restart"),
        format!("/api/kernels/{a}/restart"),
        format!("/v1/sessions/{a}/restart"),
    ] {
        let (status, v) = api.post(&path, json!({})).await;
        assert_eq!(status, 200, "{path}: {v}");
        assert_eq!(out(&api, &a, "print('x' in dir())").await, "False");
    }
    let (status, s) = rewind(&api, &a, &cp_id).await;
    assert_eq!(status, 200, "{s}");
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    broker.stop().await;
}

async fn a_fork_of_a_checkpoint_is_a_new_session_with_its_state(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1; import random; random.seed(7)").await;
    let cp = take(&api, &a).await["id"].as_str().unwrap().to_string();
    let draw = out(&api, &a, "print(random.random())").await;
    out(&api, &a, "x = 2; y = 5").await;
    let (status, v) = api
        .post(
            &format!("/v1/sessions/{a}/checkpoints/{cp}/fork"),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    let b = v["sessions"][0]["id"].as_str().unwrap().to_string();
    assert_ne!(b, a);
    assert_eq!(v["sessions"][0]["execution_count"], 1, "{v}");
    assert_eq!(
        out(&api, &b, "print(x, 'y' in dir(), random.random())").await,
        format!("1 False {draw}")
    );
    // The original is unaffected, and so is the checkpoint (forked again, same state).
    assert_eq!(out(&api, &a, "print(x, y)").await, "2 5");
    out(&api, &b, "x = 50").await;
    assert_eq!(out(&api, &a, "print(x)").await, "2");
    let (status, v) = api
        .post(
            &format!("/v1/sessions/{a}/checkpoints/{cp}/fork"),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    let c = v["sessions"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(out(&api, &c, "print(x)").await, "1");
    // The recording links it to the session and the checkpoint.
    let created = broker_events(&api, &b).await;
    assert_eq!(created[0]["detail"]["forked_from"]["session"], a.as_str());
    assert_eq!(
        created[0]["detail"]["forked_from"]["checkpoint"],
        cp.as_str()
    );
    assert_eq!(created[0]["detail"]["forked_from"]["execution_count"], 1);
    broker.stop().await;
}

/// A thread started before the checkpoint appends to a file every 50 ms. Local sandbox
/// (held checkpoints): the checkpoint is the live kernel's child, held, one thread, the OOM
/// killer's first choice, in the leaf the live kernel had (which moves to a new one); the
/// live kernel goes on untouched, its thread too. Docker (frozen copies): the live kernel
/// becomes the fork (no thread), the former one is frozen, so the file stops growing.
async fn a_checkpoints_processes_do_not_run(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(
        &api,
        &a,
        "import threading, time, os\n\
         def tick():\n\
         \x20   while True:\n\
         \x20       with open('/workspace/ticks.txt', 'a') as f: f.write('t\\n')\n\
         \x20       time.sleep(0.05)\n\
         threading.Thread(target=tick, daemon=True).start()\n\
         time.sleep(0.3)",
    )
    .await;
    let size = "import os; print(os.path.getsize('/workspace/ticks.txt'))";
    let grows: u64 = out(&api, &a, size).await.parse().unwrap();
    assert!(grows > 0);
    let live_adj = out(
        &api,
        &a,
        "print(open('/proc/self/oom_score_adj').read().strip())",
    )
    .await;
    assert_ne!(live_adj, "1000");
    let leaf_before = leaf_name(&api, &a).await;
    take(&api, &a).await;
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let first: u64 = out(&api, &a, size).await.parse().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let later: u64 = out(&api, &a, size).await.parse().unwrap();
    let l = list(&api, &a).await;
    assert_eq!(l["checkpoints"].as_array().unwrap().len(), 1, "{l}");
    // An unprivileged broker cannot set a kernel's (docs/HOSTS.md): only the leaves differ.
    let root = rustix::process::geteuid().is_root();
    let checkpoint_adj = if root { "1000" } else { live_adj.as_str() };
    if sandbox == "local" {
        assert!(
            later > first,
            "the live kernel's thread stopped at a checkpoint"
        );
        // The held child: one thread, sleeping, the OOM killer's first choice; the live
        // kernel an ordinary one, moved to a new leaf (in the background: awaited here).
        let seen = out(
            &api,
            &a,
            "me = os.getpid()\n\
             kids = [int(c) for t in os.listdir(f'/proc/{me}/task') for c in open(f'/proc/{me}/task/{t}/children').read().split()]\n\
             held = [c for c in kids if open(f'/proc/{c}/status').read().count('Threads:\\t1\\n')]\n\
             c = held[0]\n\
             st = open(f'/proc/{c}/stat').read().rsplit(') ', 1)[1].split()[0]\n\
             print(len(held), st, open(f'/proc/{c}/oom_score_adj').read().strip(), open('/proc/self/oom_score_adj').read().strip())",
        )
        .await;
        assert_eq!(
            seen,
            format!("1 S {checkpoint_adj} {live_adj}"),
            "the checkpoint's and the live kernel's"
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while leaf_name(&api, &a).await == leaf_before {
            assert!(
                std::time::Instant::now() < deadline,
                "the live kernel never moved"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        if root {
            let pids = leaf_pids(&broker, "alice", &leaf_before);
            assert_eq!(pids.len(), 1, "the checkpoint alone in its leaf: {pids:?}");
            let adj = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", pids[0])).unwrap();
            assert_eq!(adj.trim(), "1000");
        }
    } else {
        assert_eq!(
            first, later,
            "the checkpoint's thread ran while it was frozen"
        );
        // The live kernel is the checkpoint's child, in a leaf of its own; the checkpoint
        // is the OOM killer's first choice, the live kernel an ordinary one.
        let seen = out(
            &api,
            &a,
            "p = os.getppid()\n\
             print(open(f'/proc/{p}/oom_score_adj').read().strip(), open('/proc/self/oom_score_adj').read().strip(),\n\
             \x20     open(f'/proc/{p}/cgroup').read() != open('/proc/self/cgroup').read())",
        )
        .await;
        assert_eq!(
            seen,
            format!("{checkpoint_adj} {live_adj} True"),
            "the checkpoint's and the live kernel's"
        );
    }
    // Rewound: the rewound kernel is a fork of the checkpoint (no thread), the kernel it
    // replaced ended, and the checkpoint does not run: the file stays as it is.
    let cp = l["checkpoints"][0]["id"].as_str().unwrap().to_string();
    let (status, v) = rewind(&api, &a, &cp).await;
    assert_eq!(status, 200, "{v}");
    let rewound: u64 = out(&api, &a, size).await.parse().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let after: u64 = out(&api, &a, size).await.parse().unwrap();
    assert_eq!(after, rewound, "a thread ran after the rewind");
    // The rewound kernel (a fork of the checkpoint, which it inherits 1000 from) is an
    // ordinary kernel to the OOM killer again: the value the session's first kernel had.
    let rewound_adj = out(
        &api,
        &a,
        "print(open('/proc/self/oom_score_adj').read().strip())",
    )
    .await;
    assert_eq!(rewound_adj, live_adj, "the rewound kernel's oom_score_adj");
    broker.stop().await;
}

#[tokio::test]
async fn deleting_the_session_ends_its_checkpoints_and_leaves_nothing() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let keep = api.create().await;
    let a = api.create().await;
    // The leaf of the session's live kernel, as the kernel sees it.
    let live_leaf = || async { leaf_name(&api, &a).await };
    let mut theirs = vec![live_leaf().await];
    out(&api, &a, "x = 1").await;
    let first = take(&api, &a).await;
    theirs.push(moved_leaf(&api, &a, &theirs[0]).await);
    out(&api, &a, "x = 2").await;
    take(&api, &a).await;
    theirs.push(moved_leaf(&api, &a, &theirs[1]).await);
    assert_eq!(theirs[0], a);
    // A rewind replaces the live kernel, which ends in the background: it is gone soon
    // after, leaf and all, while the session goes on. (Its parent, the frozen checkpoint
    // it was forked from, reaps it when it next runs: a zombie until then, holding
    // nothing.)
    let running = |pid: &i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
            .unwrap_or(false)
    };
    let replaced = theirs.pop().unwrap();
    let replaced_pids = leaf_pids(&broker, "alice", &replaced);
    assert!(!replaced_pids.is_empty(), "{replaced}");
    let cp = first["id"].as_str().unwrap();
    assert_eq!(rewind(&api, &a, cp).await.0, 200);
    assert_eq!(out(&api, &a, "print(x)").await.trim(), "1");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while user_leaves(&broker, "alice").contains(&replaced) || replaced_pids.iter().any(running) {
        assert!(
            std::time::Instant::now() < deadline,
            "the kernel a rewind replaced is left: {replaced} {replaced_pids:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    theirs.push(live_leaf().await);
    let during = user_leaves(&broker, "alice");
    assert!(
        theirs.iter().all(|l| during.contains(l)),
        "{theirs:?} / {during:?}"
    );
    let pids: Vec<i32> = theirs
        .iter()
        .flat_map(|l| leaf_pids(&broker, "alice", l))
        .collect();
    assert!(pids.len() >= 3, "{pids:?}");
    // Held checkpoints wait on their control socket: nothing is frozen.
    let freezer = std::path::Path::new("/sys/fs/cgroup/freezer").join(broker.cgroup_name());
    assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    let after = user_leaves(&broker, "alice");
    assert!(
        theirs.iter().all(|l| !after.contains(l)),
        "{theirs:?} / {after:?}"
    );
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "pid {pid} is left"
        );
    }
    assert!(!freezer.exists(), "{} is left", freezer.display());
    let dirs = out(
        &api,
        &keep,
        "import os; print([d for d in os.listdir('/run/kernel') if d.startswith('f')])",
    )
    .await;
    assert_eq!(dirs, "[]");
    broker.stop().await;
}

#[tokio::test]
async fn over_the_count_the_oldest_checkpoint_is_dropped() {
    let broker = Broker::start("local", |a| {
        forking(a);
        a.max_checkpoints_per_user = Some(2);
    })
    .await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        out(&api, &a, &format!("x = {i}")).await;
        ids.push(take(&api, &a).await["id"].as_str().unwrap().to_string());
    }
    let l = list(&api, &a).await;
    let kept: Vec<&str> = l["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(kept, vec![ids[1].as_str(), ids[2].as_str()], "{l}");
    assert_eq!(l["budget"]["max_count"], 2, "{l}");
    assert_eq!(l["budget"]["count"], 2, "{l}");
    assert!(
        l["budget"]["memory_used_bytes"].as_u64().unwrap() > 0,
        "{l}"
    );
    let dropped = l["dropped"].as_array().unwrap();
    assert_eq!(dropped.len(), 1, "{l}");
    assert_eq!(dropped[0]["id"], ids[0].as_str());
    assert!(
        dropped[0]["reason"]
            .as_str()
            .unwrap()
            .contains("maximum of 2"),
        "{l}"
    );
    let (status, v) = rewind(&api, &a, &ids[0]).await;
    assert_eq!(status, 404, "{v}");
    let (status, v) = rewind(&api, &a, &ids[1]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    let events = broker_events(&api, &a).await;
    let dropped: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "checkpoint_dropped")
        .collect();
    assert_eq!(dropped.len(), 1, "{events:?}");
    assert_eq!(dropped[0]["detail"]["checkpoint"], ids[0].as_str());
    // Deleted by request: gone, and said so.
    let (status, _) = api
        .delete(&format!("/v1/sessions/{a}/checkpoints/{}", ids[2]))
        .await;
    assert_eq!(status, 204);
    let l = list(&api, &a).await;
    assert_eq!(l["checkpoints"].as_array().unwrap().len(), 1, "{l}");
    assert_eq!(l["dropped"][1]["reason"], "deleted by request", "{l}");
    broker.stop().await;
}

#[tokio::test]
async fn every_execution_mode_takes_one_per_successful_execution() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = every_execution_session(&api).await;
    out(&api, &a, "x = 1").await;
    out(&api, &a, "x = 2").await;
    let v = api.execute(&a, "raise ValueError('no')").await;
    assert_eq!(v["status"], "error", "{v}");
    out(&api, &a, "x = 3").await;
    // One on demand, which leaves the mode as it is.
    take(&api, &a).await;
    out(&api, &a, "x = 3").await;
    let l = list(&api, &a).await;
    let counts = counts(&l);
    assert_eq!(counts, vec![1, 2, 4, 4, 5], "{l}");
    let second = l["checkpoints"][1]["id"].as_str().unwrap().to_string();
    let (status, v) = rewind(&api, &a, &second).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(out(&api, &a, "print(x)").await, "2");
    // A session that did not ask takes none.
    let b = api.create().await;
    out(&api, &b, "x = 1").await;
    let l = list(&api, &b).await;
    assert_eq!(l["checkpoints"], json!([]), "{l}");
    broker.stop().await;
}

/// In every-execution mode, executions an agent sends together (queued in the broker
/// behind one another) each get their checkpoint, holding the state between them: the
/// kernel is between executions when it is taken, whatever waits in the broker. (Before,
/// one with another queued behind it got none.)
async fn executions_sent_together_each_get_their_checkpoint(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let api = broker.api(ALICE);
    let a = every_execution_session(&api).await;
    out(&api, &a, "import time\nxs = []").await;
    let step = "time.sleep(0.3)\nxs.append(len(xs))";
    let (r1, r2, r3) = tokio::join!(
        api.execute(&a, step),
        api.execute(&a, step),
        api.execute(&a, step)
    );
    for r in [&r1, &r2, &r3] {
        assert_eq!(r["status"], "ok", "{r}");
    }
    let l = list(&api, &a).await;
    let taken: Vec<(u64, String)> = l["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let count = c["execution_count"].as_u64().unwrap();
            (count, c["id"].as_str().unwrap().to_string())
        })
        .collect();
    let counts: Vec<u64> = taken.iter().map(|(c, _)| *c).collect();
    assert_eq!(counts, vec![1, 2, 3, 4], "{l}");
    for (count, id) in taken.iter().rev() {
        let (status, v) = rewind(&api, &a, id).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            out(&api, &a, "print(xs)").await,
            format!("{:?}", (0..count - 1).collect::<Vec<_>>())
        );
    }
    broker.stop().await;
}

/// Session memory limit M: the live kernel holds ~0.6 M, a checkpoint is taken, and the
/// live kernel rewrites all of it. The old pages stay charged to the checkpoint's leaf,
/// the new ones to the live kernel's: it survives. (Were the fork the frozen copy, the
/// live kernel's leaf would hold both copies, 1.2 M, and be killed.)
#[tokio::test]
async fn a_checkpoint_never_pushes_the_live_kernel_into_the_oom_killer() {
    const MIB: u64 = 1 << 20;
    let broker = Broker::start("local", |a| {
        forking(a);
        a.memory_limit = Some(4096 * MIB);
    })
    .await;
    let api = broker.api(ALICE);
    let (status, s) = api
        .post("/v1/sessions", json!({"memory_limit_bytes": 400 * MIB}))
        .await;
    assert_eq!(status, 201, "{s}");
    let a = s["id"].as_str().unwrap().to_string();
    out(
        &api,
        &a,
        "import numpy as np; big = np.ones((240 << 20) // 8)",
    )
    .await;
    let cp = take(&api, &a).await;
    assert!(cp["memory_bytes"].as_u64().unwrap() > 240 * MIB, "{cp}");
    let v = api.execute(&a, "big[:] = 2.0; print(big[-1])").await;
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["stdout"].as_str().unwrap().trim(), "2.0");
    let (_, info) = api.get(&format!("/v1/sessions/{a}")).await;
    assert_eq!(info["state"], "idle", "{info}");
    let live = info["memory_used_bytes"].as_u64().unwrap();
    let l = list(&api, &a).await;
    let held = l["checkpoints"][0]["memory_bytes"].as_u64().unwrap();
    eprintln!(
        "live kernel after rewriting: {} MiB; checkpoint: {} MiB",
        live / MIB,
        held / MIB
    );
    assert!(held > 240 * MIB, "{l}");

    // The numbers for the note: pandas and a 200 MB DataFrame, 10% rewritten.
    let (status, s) = api
        .post("/v1/sessions", json!({"memory_limit_bytes": 1024 * MIB}))
        .await;
    assert_eq!(status, 201, "{s}");
    let b = s["id"].as_str().unwrap().to_string();
    out(
        &api,
        &b,
        "import numpy as np, pandas as pd\n\
         df = pd.DataFrame(np.random.rand((200 << 20) // 80, 10))\n\
         print(df.memory_usage().sum() >> 20)",
    )
    .await;
    let started = std::time::Instant::now();
    let cp = take(&api, &b).await;
    let take_ms = started.elapsed().as_millis();
    out(&api, &b, "n = len(df) // 10; df.iloc[:n] = 0.5").await;
    let l = list(&api, &b).await;
    let (_, info) = api.get(&format!("/v1/sessions/{b}")).await;
    eprintln!(
        "200 MB DataFrame: checkpoint took {take_ms} ms; checkpoint memory {} MiB at take, {} MiB after the live kernel rewrote 10%; live kernel {} MiB",
        cp["memory_bytes"].as_u64().unwrap() / MIB,
        l["checkpoints"][0]["memory_bytes"].as_u64().unwrap() / MIB,
        info["memory_used_bytes"].as_u64().unwrap() / MIB
    );
    let started = std::time::Instant::now();
    let (status, _) = rewind(&api, &b, cp["id"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    let v = api.execute(&b, "print(float(df.iloc[0, 0]) != 0.5)").await;
    eprintln!(
        "rewind -> next result: {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(v["stdout"].as_str().unwrap().trim(), "True", "{v}");
    broker.stop().await;
}

#[tokio::test]
async fn checkpoint_requests_that_cannot_be_served_are_refused_clearly() {
    let broker = Broker::start("local", forking).await;
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    let a = alice.create().await;
    out(&alice, &a, "x = 1").await;
    let cp = take(&alice, &a).await["id"].as_str().unwrap().to_string();
    let unknown = uuid::Uuid::new_v4().to_string();
    // Unknown checkpoints: 404, whatever the operation.
    let (status, v) = rewind(&alice, &a, &unknown).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "checkpoint_not_found", "{v}");
    for path in [
        format!("/v1/sessions/{a}/checkpoints/{unknown}"),
        format!("/v1/sessions/{a}/checkpoints/not-a-uuid"),
    ] {
        assert_eq!(alice.delete(&path).await.0, 404, "{path}");
        let (status, _) = alice.post(&format!("{path}/fork"), json!({})).await;
        assert_eq!(status, 404, "{path}");
    }
    // Another user's session or checkpoint: 404, as a missing one; nothing touched.
    let b = bob.create().await;
    assert_eq!(
        bob.get(&format!("/v1/sessions/{a}/checkpoints")).await.0,
        404
    );
    let (status, _) = bob
        .post(&format!("/v1/sessions/{a}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 404);
    assert_eq!(rewind(&bob, &a, &cp).await.0, 404);
    assert_eq!(rewind(&bob, &b, &cp).await.0, 404);
    let (status, _) = bob
        .post(
            &format!("/v1/sessions/{a}/checkpoints/{cp}/fork"),
            json!({}),
        )
        .await;
    assert_eq!(status, 404);
    let (status, _) = bob
        .post(
            &format!("/v1/sessions/{b}/checkpoints/{cp}/fork"),
            json!({}),
        )
        .await;
    assert_eq!(status, 404);
    assert_eq!(
        bob.delete(&format!("/v1/sessions/{a}/checkpoints/{cp}"))
            .await
            .0,
        404
    );
    assert_eq!(
        bob.delete(&format!("/v1/sessions/{b}/checkpoints/{cp}"))
            .await
            .0,
        404
    );
    assert_eq!(bob.get("/v1/sessions").await.1.as_array().unwrap().len(), 1);
    assert_eq!(
        list(&alice, &a).await["checkpoints"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // Bad JSON: 400.
    for body in [
        "{not json",
        r#"{"checkpoint": "nope"}"#,
        r#"{"checkpoint": 1, "x": 2}"#,
    ] {
        let raw = reqwest::Client::new()
            .post(broker.url(&format!("/v1/sessions/{a}/rewind")))
            .bearer_auth(ALICE)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(raw.status().as_u16(), 400, "{body}");
    }
    // Busy: 409 at once, for a checkpoint and a rewind.
    let busy = busy_with(&alice, &a, "import time; time.sleep(4)").await;
    let asked = std::time::Instant::now();
    let (status, v) = alice
        .post(&format!("/v1/sessions/{a}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 409, "{v}");
    let (status, v) = rewind(&alice, &a, &cp).await;
    assert_eq!(status, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("running code"),
        "{v}"
    );
    assert!(asked.elapsed().as_secs() < 2);
    // A fork of a checkpoint does not need the live kernel idle.
    let (status, v) = alice
        .post(
            &format!("/v1/sessions/{a}/checkpoints/{cp}/fork"),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(busy.await.unwrap()["status"], "ok");
    // (A session with a workspace of its own has checkpoints of its own kind:
    // `fork_copy.rs`.)
    broker.stop().await;
}

#[tokio::test]
async fn a_plainly_started_kernel_has_no_checkpoints() {
    let broker = Broker::start("local", |a| a.fork_server = Some(false)).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1").await;
    let (status, v) = api
        .post(&format!("/v1/sessions/{a}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("started plainly"),
        "{v}"
    );
    assert_eq!(list(&api, &a).await["checkpoints"], json!([]));
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    broker.stop().await;
}

/// The kernel's `os.fork` forks honestly in the kernel itself (the checkpoint is made) and
/// lies in the checkpoint (the pid it answers a rewind with, a forged one, no child made):
/// the rewind fails clearly, the session keeps its live kernel and state, nothing is
/// adopted or left, and the checkpoint stays.
#[tokio::test]
async fn a_checkpoint_that_lies_about_its_fork_gets_nothing_adopted() {
    let broker = short_launch_broker(8).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(
        &api,
        &a,
        "import os\n\
         _kernel_pid = os.getpid()\n\
         _real_fork = os.fork\n\
         def _liar():\n\
         \x20   if os.getpid() == _kernel_pid:\n\
         \x20       return _real_fork()\n\
         \x20   lie = open('/workspace/lie.txt').read().strip()\n\
         \x20   return int(open('/workspace/live.pid').read()) if lie == 'live' else int(lie)\n\
         os.fork = _liar\n\
         x = 1",
    )
    .await;
    let cp = take(&api, &a).await["id"].as_str().unwrap().to_string();
    out(
        &api,
        &a,
        "x = 2; open('/workspace/live.pid', 'w').write(str(os.getpid()))",
    )
    .await;
    let live_pid = out(&api, &a, "print(os.getpid())").await;
    let before = user_leaves(&broker, "alice");
    let fork_dirs = "print(sorted(d for d in os.listdir('/run/kernel') if d.startswith('f')))";
    let dirs = out(&api, &a, fork_dirs).await;
    for lie in ["1", "live", "99999", "-3"] {
        out(
            &api,
            &a,
            &format!("open('/workspace/lie.txt', 'w').write('{lie}')"),
        )
        .await;
        let (status, v) = rewind(&api, &a, &cp).await;
        assert_eq!(status, 502, "{lie}: {v}");
        assert_eq!(v["error"]["code"], "checkpoint_failed", "{lie}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not a child it forked"),
            "{lie}: {v}"
        );
        // The session keeps its live kernel and state; nothing adopted or left.
        assert_eq!(
            out(&api, &a, "print(x, os.getpid())").await,
            format!("2 {live_pid}")
        );
        assert_eq!(user_leaves(&broker, "alice"), before, "{lie}");
        assert_eq!(out(&api, &a, fork_dirs).await, dirs, "{lie}");
        let (_, s) = api.get(&format!("/v1/sessions/{a}")).await;
        assert_eq!(s["state"], "idle", "{s}");
        // The checkpoint is still there.
        let l = list(&api, &a).await;
        assert_eq!(l["checkpoints"].as_array().unwrap().len(), 1, "{l}");
    }
    broker.stop().await;
}

/// `--checkpoint-every-execution` is the default of every front door's sessions; the REST
/// create can say otherwise.
#[tokio::test]
async fn the_every_execution_flag_is_every_front_doors_default() {
    let broker = Broker::start("local", |a| {
        forking(a);
        a.checkpoint_every_execution = Some(true);
    })
    .await;
    let api = broker.api(ALICE);
    let (status, k) = api.post("/api/kernels", json!({"name": "python3"})).await;
    assert_eq!(status, 201, "{k}");
    let jupyter = k["id"].as_str().unwrap().to_string();
    let rest = api.create().await;
    let (status, s) = api
        .post("/v1/sessions", json!({"checkpoint_every_execution": false}))
        .await;
    assert_eq!(status, 201, "{s}");
    let off = s["id"].as_str().unwrap().to_string();
    for id in [&jupyter, &rest, &off] {
        out(&api, id, "x = 1").await;
        out(&api, id, "x = 2").await;
    }
    for (id, taken) in [(&jupyter, 2), (&rest, 2), (&off, 0)] {
        let l = list(&api, id).await;
        assert_eq!(
            l["checkpoints"].as_array().unwrap().len(),
            taken,
            "{id}: {l}"
        );
        assert_eq!(l["budget"]["every_execution"], true, "{l}");
        // The session's own mode: the user's default, or what its creation asked.
        assert_eq!(l["every_execution"], taken > 0, "{id}: {l}");
    }
    broker.stop().await;
}

/// A cell that kills the kernel: the session is dead; a rewind brings it back to life with
/// the checkpoint's state, and nothing of the dead kernel is left.
#[tokio::test]
async fn a_rewind_brings_a_dead_session_back() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1; import os").await;
    let cp = take(&api, &a).await["id"].as_str().unwrap().to_string();
    let dead_leaf = moved_leaf(&api, &a, &a).await;
    let v = api.execute(&a, "os._exit(3)").await;
    assert_ne!(v["status"], "ok", "{v}");
    let (_, s) = api.get(&format!("/v1/sessions/{a}")).await;
    assert_eq!(s["state"], "dead", "{s}");
    let (status, s) = rewind(&api, &a, &cp).await;
    assert_eq!(status, 200, "{s}");
    assert_eq!(s["state"], "idle", "{s}");
    assert_eq!(s["dead_reason"], Value::Null, "{s}");
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    assert!(!user_leaves(&broker, "alice").contains(&dead_leaf));
    assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    assert!(!user_leaves(&broker, "alice").contains(&a));
    broker.stop().await;
}

/// In every-execution mode a checkpoint's reply is awaited off the next execution's path.
/// A kernel that answers with a pid that is not its held child (its own, the sandbox's
/// init, one that does not exist), or never answers, gets nothing adopted, no cgroup leaf
/// and no checkpoint, and leaves no directory; its executions go on, their results its
/// own.
#[tokio::test]
async fn every_execution_checkpoints_a_kernel_lies_about_are_not_kept() {
    let broker = short_launch_broker(4).await;
    let api = broker.api(ALICE);
    let a = every_execution_session(&api).await;
    out(
        &api,
        &a,
        "import os\n\
         open('/workspace/lie.txt', 'w').write('honest')\n\
         _k = get_ipython().kernel\n\
         _honest = _k.shell_handlers['kb_fork_request']\n\
         def _liar(stream, ident, parent):\n\
         \x20   lie = open('/workspace/lie.txt').read().strip()\n\
         \x20   if lie == 'honest':\n\
         \x20       return _honest(stream, ident, parent)\n\
         \x20   if lie == 'silent':\n\
         \x20       return\n\
         \x20   pid = os.getpid() if lie == 'self' else int(lie)\n\
         \x20   _k.session.send(stream, 'kb_fork_reply', {'status': 'ok', 'pid': pid}, parent, ident=ident)\n\
         _k.shell_handlers['kb_fork_request'] = _liar",
    )
    .await;
    let only_the_first = |l: &Value| assert_eq!(counts(l), vec![1], "{l}");
    only_the_first(&list(&api, &a).await);
    let dirs = "print(sorted(d for d in os.listdir('/run/kernel') if d.startswith('c')))";
    for (i, lie) in ["self", "1", "99999"].iter().enumerate() {
        // From the checkpoint after this execution on, each is lied about.
        out(
            &api,
            &a,
            &format!("open('/workspace/lie.txt', 'w').write('{lie}')"),
        )
        .await;
        only_the_first(&list(&api, &a).await);
        let before = user_leaves(&broker, "alice");
        let listed = out(&api, &a, dirs).await;
        out(&api, &a, &format!("x = {i}")).await;
        assert_eq!(out(&api, &a, "print(x)").await, i.to_string(), "{lie}");
        only_the_first(&list(&api, &a).await);
        assert_eq!(out(&api, &a, dirs).await, listed, "{lie}");
        let _ = list(&api, &a).await;
        assert_eq!(user_leaves(&broker, "alice"), before, "{lie}");
        let (_, s) = api.get(&format!("/v1/sessions/{a}")).await;
        assert_eq!(s["state"], "idle", "{lie}: {s}");
    }
    // One never answered: the next execution is not held up; the session's next command
    // waits for the answer at most the launch timeout and its grace, then goes on.
    out(&api, &a, "open('/workspace/lie.txt', 'w').write('silent')").await;
    let v = api
        .execute(
            &a,
            "x = 'after'; open('/workspace/lie.txt', 'w').write('honest')",
        )
        .await;
    assert_eq!(v["status"], "ok", "{v}");
    let l = list(&api, &a).await;
    // The silent one has none; the execution after it (honest again) has its own.
    let after = v["execution_count"].as_u64().unwrap();
    assert_eq!(counts(&l), vec![1, after], "{l}");
    assert_eq!(out(&api, &a, "print(x)").await, "after");
    broker.stop().await;
}

/// In every-execution mode the checkpoint after an execution swaps the live kernel while
/// the client may already be asking for a fork: the fork is prepared by the session's
/// actor for the kernel it then asks, never for the one the checkpoint replaced (which
/// failed with 502 "not a child it forked").
#[tokio::test]
async fn a_fork_asked_right_after_an_execution_forks_the_live_kernel() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = every_execution_session(&api).await;
    for i in 0..5 {
        out(&api, &a, &format!("x = {i}")).await;
        let (status, v) = api.post(&format!("/v1/sessions/{a}/fork"), json!({})).await;
        assert_eq!(status, 201, "round {i}: {v}");
        let b = v["sessions"][0]["id"].as_str().unwrap().to_string();
        assert_eq!(out(&api, &b, "print(x)").await, i.to_string());
        let (status, _) = api.delete(&format!("/v1/sessions/{b}")).await;
        assert_eq!(status, 204);
    }
    broker.stop().await;
}

/// The name of the cgroup leaf of session `id`'s live kernel (v1 or v2), as the kernel sees it.
/// The live kernel's leaf once it is not `before` any more: a held checkpoint takes the
/// leaf its kernel had, which moves to a new one in the background.
async fn moved_leaf(api: &Api, id: &str, before: &str) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = leaf_name(api, id).await;
        if now != before {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the live kernel stayed in {before}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

async fn leaf_name(api: &Api, id: &str) -> String {
    let dir = kernel_leaf_dir(api, id).await;
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// A held checkpoint's control socket is the broker's: its directory in the template's
/// fork directory is one the kernels may enter, not list or write, and the socket is gone
/// once the checkpoint connected. A checkpoint whose held child does not connect itself
/// (a grandchild connects in its place, as a kernel that patched its own `connect` can
/// arrange) is refused, saying why: the socket takes the held child's pid alone.
#[tokio::test]
async fn a_checkpoints_control_socket_takes_the_held_child_alone() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1; import os, socket, time").await;
    take(&api, &a).await;
    let seen = out(
        &api,
        &a,
        "import re\n\
         d = [n for n in os.listdir('/run/kernel') if re.fullmatch('c[0-9a-f]{12}', n)]\n\
         p = '/run/kernel/' + d[0]\n\
         def tried(f):\n\
         \x20   try:\n\
         \x20       f(); return 'done'\n\
         \x20   except OSError as e:\n\
         \x20       return type(e).__name__\n\
         print(len(d), tried(lambda: os.listdir(p)), tried(lambda: open(p + '/x', 'w')), os.path.lexists(p + '/c'))",
    )
    .await;
    assert_eq!(seen, "1 PermissionError PermissionError False");
    // The held child lets a child of its own connect, and never connects itself.
    // (The broker's end of the wait is 5 s.)
    out(
        &api,
        &a,
        "_kernel_pid = os.getpid()\n\
         _real_connect = socket.socket.connect\n\
         def _proxy(self, addr):\n\
         \x20   if os.getpid() != _kernel_pid and isinstance(addr, str):\n\
         \x20       if os.fork() == 0:\n\
         \x20           _real_connect(self, addr); time.sleep(30); os._exit(0)\n\
         \x20       time.sleep(30)\n\
         \x20   return _real_connect(self, addr)\n\
         socket.socket.connect = _proxy",
    )
    .await;
    let before = list(&api, &a).await["checkpoints"]
        .as_array()
        .unwrap()
        .len();
    let (status, v) = api
        .post(&format!("/v1/sessions/{a}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["code"], "checkpoint_failed", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not connect to its control socket"),
        "{v}"
    );
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    let l = list(&api, &a).await;
    assert_eq!(l["checkpoints"].as_array().unwrap().len(), before, "{l}");
    broker.stop().await;
}

/// The kernels of the checkpoint the live kernel was forked from, other than itself, as
/// the live kernel sees them (its parent is that checkpoint's held child): after a
/// rewind, the spare made for the next one.
const SPARES: &str = "import os\n\
held = os.getppid()\n\
kids = open(f'/proc/{held}/task/{held}/children').read().split()\n\
print(' '.join(k for k in kids if int(k) != os.getpid()))";

async fn spares(api: &Api, id: &str, want: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let found: Vec<String> = out(api, id, SPARES)
            .await
            .split_whitespace()
            .map(str::to_string)
            .collect();
        if found.len() == want {
            return found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the checkpoint's other kernels are {found:?}, not {want}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_second_rewind_to_a_checkpoint_takes_the_kernel_made_for_it_meanwhile() {
    let broker = Broker::start("local", forking).await;
    let api = broker.api(ALICE);
    // Another session first: the user's template and its leaves are there before.
    let keep = api.create().await;
    out(&api, &keep, "pass").await;
    let before = user_leaves(&broker, "alice");
    let a = api.create().await;
    out(&api, &a, "x = 1; import random; random.seed(5)").await;
    let cp = take(&api, &a).await;
    let cp = cp["id"].as_str().unwrap().to_string();
    let draw = out(&api, &a, "print(random.random())").await;
    out(&api, &a, "x = 2").await;
    let check = "print(x, random.random(), os.getpid())";

    // The first rewind forks the checkpoint, then makes a spare from it.
    assert_eq!(rewind(&api, &a, &cp).await.0, 200);
    let first = out(&api, &a, &format!("import os\n{check}")).await;
    let first: Vec<&str> = first.split(' ').collect();
    assert_eq!(first[..2], ["1", draw.as_str()], "{first:?}");
    let spare = spares(&api, &a, 1).await;
    let listed = list(&api, &a).await;
    assert!(
        listed["checkpoints"][0]["memory_bytes"].as_u64().unwrap() > 0,
        "{listed}"
    );
    out(&api, &a, "x = 3").await;

    // The second is that spare, with the checkpoint's state as a fork would have it; the
    // kernel it replaced ends, and another spare is made.
    assert_eq!(rewind(&api, &a, &cp).await.0, 200);
    let second = out(&api, &a, &format!("import os\n{check}")).await;
    assert_eq!(second, format!("1 {draw} {}", spare[0]));
    let next = spares(&api, &a, 1).await;
    assert_ne!(next, spare);

    // A kernel of the session that kills the spare gets a fork of the checkpoint instead.
    out(
        &api,
        &a,
        &format!("import signal; os.kill({}, signal.SIGKILL)", next[0]),
    )
    .await;
    spares(&api, &a, 0).await;
    assert_eq!(rewind(&api, &a, &cp).await.0, 200);
    let third = out(&api, &a, &format!("import os\n{check}")).await;
    let third: Vec<&str> = third.split(' ').collect();
    assert_eq!(third[..2], ["1", draw.as_str()], "{third:?}");
    assert_ne!(third[2], next[0]);
    spares(&api, &a, 1).await;

    // The session's leaves: its live kernel's, the checkpoint's and the spare's (once the
    // kernels the rewinds replaced have ended). A pause ends the spare with the live
    // kernel (the session gives its memory back), leaving the checkpoint; the session's
    // end ends everything: no leaf of the session's is left.
    // (Waited for on the runtime: the broker's tasks end those kernels.)
    let count_is = |want: usize| {
        let broker = &broker;
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
            loop {
                let now = user_leaves(broker, "alice");
                if now.len() == want {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{now:?}, not {want} leaves"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    count_is(before.len() + 3).await;
    if criu_ready() {
        let (status, v) = api
            .post(&format!("/v1/sessions/{a}/pause"), json!({}))
            .await;
        assert_eq!(status, 200, "{v}");
        count_is(before.len() + 1).await;
        assert_eq!(out(&api, &a, "print(x)").await, "1");
    }
    assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    // (The pool's kernel that became the session's was replaced by another: as many.)
    assert_eq!(user_leaves(&broker, "alice").len(), before.len());
    broker.stop().await;
}

/// The session's pid of its one checkpoint's process, found from inside the live kernel
/// (local: the kernel's child with a single thread; Docker: the kernel's parent, the
/// frozen former live kernel), and what `/proc` says its state is.
const FIND_CHECKPOINT: &str = "import os, signal, time\n\
    def checkpoint_pid():\n\
    \x20   me = os.getpid()\n\
    \x20   kids = [int(c) for t in os.listdir(f'/proc/{me}/task') for c in open(f'/proc/{me}/task/{t}/children').read().split()]\n\
    \x20   held = [c for c in kids if open(f'/proc/{c}/status').read().count('Threads:\\t1\\n')]\n\
    \x20   return held[0] if held else os.getppid()\n\
    def state(pid):\n\
    \x20   return open(f'/proc/{pid}/stat').read().rsplit(') ', 1)[1].split()[0]";

/// The kernel is the attacker of its own checkpoints (issue 36, item 6): one it stops with
/// SIGSTOP is still rewound to, at once (the broker continues it before it wakes it, on
/// both sandboxes), and one it kills is refused clearly and listed as dropped, with why; the
/// session goes on with its state.
async fn a_checkpoint_its_kernel_stops_or_kills_fails_nothing_and_hangs_nothing(
    sandbox: &'static str,
) {
    // A launch timeout of 40 s bounds a fork's reply: a wake that waited for it would show.
    let broker = Broker::start(sandbox, |a| {
        forking(a);
        a.launch_timeout = Some(40);
    })
    .await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, FIND_CHECKPOINT).await;
    out(&api, &a, "x = 1").await;
    let cp = take(&api, &a).await["id"].as_str().unwrap().to_string();
    let stopped = out(
        &api,
        &a,
        "x = 2\n\
         c = checkpoint_pid()\n\
         os.kill(c, signal.SIGSTOP)\n\
         for _ in range(200):\n\
         \x20   if state(c) in 'TD': break\n\
         \x20   time.sleep(0.01)\n\
         print(state(c))",
    )
    .await;
    // (Docker's checkpoint is frozen, `D`: the stop is pending until it is thawed.)
    assert!(
        stopped == "T" || (sandbox == "docker" && stopped == "D"),
        "the checkpoint was not stopped: {stopped}"
    );
    let started = std::time::Instant::now();
    let (status, v) = rewind(&api, &a, &cp).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "the rewind to a stopped checkpoint took {:?}",
        started.elapsed()
    );
    assert_eq!(out(&api, &a, "print(x)").await, "1");

    // Killed: the rewind is refused at once, saying so; the checkpoint is listed as dropped.
    out(&api, &a, &format!("{FIND_CHECKPOINT}\nx = 3")).await;
    let cp2 = take(&api, &a).await["id"].as_str().unwrap().to_string();
    out(
        &api,
        &a,
        "x = 4\n\
         c = checkpoint_pid()\n\
         os.kill(c, signal.SIGKILL)",
    )
    .await;
    let started = std::time::Instant::now();
    let (status, v) = rewind(&api, &a, &cp2).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "checkpoint_not_found", "{v}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "the rewind to a killed checkpoint took {:?}",
        started.elapsed()
    );
    let l = list(&api, &a).await;
    let ids: Vec<&str> = l["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [cp.as_str()], "{l}");
    assert_eq!(l["dropped"][0]["id"], cp2.as_str(), "{l}");
    assert!(
        l["dropped"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("its kernel ended"),
        "{l}"
    );
    // The session goes on where it was, and its other checkpoint still works.
    assert_eq!(out(&api, &a, "print(x)").await, "4");
    let (status, v) = rewind(&api, &a, &cp).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    if sandbox == "local" {
        // The rewind's spare (the kernel the next rewind there takes), stopped by the
        // session's kernel, is continued as it becomes the live kernel.
        let spare = spares(&api, &a, 1).await;
        let stopped = out(
            &api,
            &a,
            &format!(
                "{FIND_CHECKPOINT}\nos.kill({0}, signal.SIGSTOP)\n\
                 for _ in range(200):\n\
                 \x20   if state({0}) == 'T': break\n\
                 \x20   time.sleep(0.01)\n\
                 print(state({0}))",
                spare[0]
            ),
        )
        .await;
        assert_eq!(stopped, "T");
        let (status, v) = rewind(&api, &a, &cp).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            out(&api, &a, "import os; print(x, os.getpid())").await,
            format!("1 {}", spare[0])
        );
    }
    broker.stop().await;
}
