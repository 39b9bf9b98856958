//! Snapshots (issue 37): a named, persistent copy of a session's state (its kernel dumped by
//! CRIU and a copy of its own workspace and `/tmp`) that any number of new sessions of the
//! same user start from, each with its own copy (`sandbox/local/snapshot.rs`,
//! `sandbox/docker/snapshot.rs`). Real kernels and a real CRIU 4 (`scripts/setup-criu`);
//! with `KB_REQUIRE_CRIU=1` (CI) a missing CRIU fails these tests instead of skipping them.

use crate::common;

use common::forked::out;
use common::*;
use serde_json::{json, Value};

crate::on_both_backends!(
    a_snapshot_starts_any_number_of_sessions_with_its_state,
    a_snapshot_outlives_the_broker,
    restored_kernels_are_kept_with_keep_sessions,
    a_restored_kernel_that_replaced_itself_while_no_broker_watched_is_not_adopted,
    a_damaged_snapshot_starts_nothing_and_says_why,
    a_kernel_cannot_reach_its_snapshot_or_plant_anything_in_it,
    what_cannot_be_snapshotted_is_refused_and_goes_on,
);

async fn own(api: &Api) -> String {
    let (status, v) = api.post("/v1/sessions", json!({"workspace": "own"})).await;
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn snapshot(api: &Api, id: &str, body: Value) -> (u16, Value) {
    api.post(&format!("/v1/sessions/{id}/snapshots"), body)
        .await
}

async fn from_snapshot(api: &Api, snapshot: &str) -> (u16, Value) {
    api.post("/v1/sessions", json!({ "snapshot": snapshot }))
        .await
}

/// The directory of `sandbox`'s snapshots in the data directory.
fn snapshots_dir(sandbox: &str) -> &'static str {
    match sandbox {
        "docker" => "snapshots-docker",
        _ => "snapshots",
    }
}

/// The directory of `sandbox`'s own workspaces in the data directory.
fn own_dir(sandbox: &str) -> &'static str {
    match sandbox {
        "docker" => "sandboxes-docker",
        _ => "sandboxes",
    }
}

/// The snapshots' image directories in the data directory.
fn snapshot_images(data: &std::path::Path, sandbox: &str) -> Vec<std::path::PathBuf> {
    match std::fs::read_dir(data.join(snapshots_dir(sandbox))) {
        Ok(entries) => entries.flatten().map(|e| e.path()).collect(),
        Err(_) => Vec::new(),
    }
}

const STATE: &str = r#"
import os
x = 41
k = (lambda: x + 1)
with open('/home/user/data.txt', 'w') as w:
    w.write(''.join('line%d\n' % i for i in range(10)))
fh = open('/home/user/data.txt')
fh.readline(); fh.readline()
g = (i * i for i in range(100))
next(g); next(g); next(g)
with open('/tmp/scratch.txt', 'w') as w:
    w.write('from tmp')
"#;

const PROBE: &str =
    "print(x, k(), fh.readline().strip(), next(g), len(In), open('/tmp/scratch.txt').read())";

async fn a_snapshot_starts_any_number_of_sessions_with_its_state(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let bob = broker.api(BOB);
    let a = own(&api).await;
    assert_eq!(api.execute(&a, STATE).await["status"], "ok");

    let (status, snap) = snapshot(&api, &a, json!({"name": "after-load"})).await;
    assert_eq!(status, 201, "{snap}");
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    assert_eq!(snap["name"], "after-load");
    assert_eq!(snap["session_id"], a.as_str());
    assert_eq!(snap["execution_count"], 1);
    assert!(snap["image_bytes"].as_u64().unwrap() > 1 << 20, "{snap}");
    assert!(snap.get("user").is_none(), "{snap}");
    // The original goes on, changed after the snapshot.
    assert_eq!(
        out(
            &api,
            &a,
            "x = 100\nopen('/home/user/later.txt', 'w').write('later')\nprint(x)"
        )
        .await,
        "100"
    );
    // The images are root's, beneath a root-only directory.
    {
        use std::os::unix::fs::MetadataExt;
        let parent = std::fs::metadata(broker.data_dir.join(snapshots_dir(sandbox))).unwrap();
        assert_eq!((parent.uid(), parent.mode() & 0o777), (0, 0o700));
        let images = snapshot_images(&broker.data_dir, sandbox);
        assert_eq!(images.len(), 1, "{images:?}");
        for f in std::fs::read_dir(&images[0]).unwrap().flatten() {
            let m = f.metadata().unwrap();
            assert!(
                m.is_file() && m.uid() == 0 && m.nlink() == 1,
                "{:?}",
                f.path()
            );
            // Root's alone to change; the broker's record of them root's alone to read.
            let mode = if f.file_name() == "broker.json" {
                0o600
            } else {
                0o644
            };
            assert_eq!(m.mode() & 0o777, mode, "{:?}", f.path());
        }
    }

    // Two sessions from it: each the state the snapshot had, and each its own.
    let mut made = Vec::new();
    for _ in 0..2 {
        let (status, s) = from_snapshot(&api, &sid).await;
        assert_eq!(status, 201, "{s}");
        assert_eq!(s["execution_count"], 1, "{s}");
        made.push(s["id"].as_str().unwrap().to_string());
    }
    let (b, c) = (&made[0], &made[1]);
    for s in [b, c] {
        assert_eq!(out(&api, s, PROBE).await, "41 42 line2 9 3 from tmp");
        assert_eq!(
            out(
                &api,
                s,
                "import os; print(sorted(os.listdir('/home/user')))"
            )
            .await,
            "['data.txt']",
            "the workspace as it was at the snapshot"
        );
    }
    out(&api, b, "x = 7\nopen('/home/user/b.txt', 'w').write('b')").await;
    assert_eq!(
        out(
            &api,
            c,
            "import os; print(x, os.path.exists('/home/user/b.txt'))"
        )
        .await,
        "41 False"
    );
    assert_eq!(
        out(&api, &a, "print(x, os.path.exists('/home/user/b.txt'))").await,
        "100 False"
    );

    // Listed and read by its user; another user sees nothing of it.
    let (status, list) = api.get("/v1/snapshots").await;
    assert_eq!(status, 200);
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(api.get(&format!("/v1/snapshots/{sid}")).await.0, 200);
    assert_eq!(bob.get("/v1/snapshots").await.1, json!([]));
    for (status, v) in [
        bob.get(&format!("/v1/snapshots/{sid}")).await,
        bob.delete(&format!("/v1/snapshots/{sid}")).await,
        from_snapshot(&bob, &sid).await,
        snapshot(&bob, &a, json!({})).await,
    ] {
        assert_eq!(status, 404, "{v}");
    }

    // Bad input: clear errors, nothing made.
    for (body, want) in [
        (json!({"name": "a b"}), 400),
        (json!({"name": "x".repeat(129)}), 400),
        (json!({"nme": "typo"}), 400),
    ] {
        let (status, v) = snapshot(&api, &a, body).await;
        assert_eq!(status, want, "{v}");
    }
    for (body, want) in [
        (json!({"snapshot": sid, "workspace": "shared"}), 400),
        (json!({"snapshot": sid, "kernel": "no-such-kernel"}), 400),
        (json!({"snapshot": "not-a-uuid"}), 400),
        (json!({"snapshot": uuid::Uuid::new_v4()}), 404),
    ] {
        let (status, v) = api.post("/v1/sessions", body).await;
        assert_eq!(status, want, "{v}");
    }
    for path in [
        "/v1/snapshots/nope",
        &format!("/v1/snapshots/{}", uuid::Uuid::new_v4()),
    ] {
        let (status, v) = api.get(path).await;
        assert_eq!(
            (status, &v["error"]["code"]),
            (404, &json!("snapshot_not_found"))
        );
    }
    assert_eq!(snapshot_images(&broker.data_dir, sandbox).len(), 1);

    // Deleted: its images and its workspace copy go; the sessions from it go on.
    let (status, _) = api.delete(&format!("/v1/snapshots/{sid}")).await;
    assert_eq!(status, 204);
    assert!(snapshot_images(&broker.data_dir, sandbox).is_empty());
    assert!(!broker.data_dir.join(own_dir(sandbox)).join(&sid).exists());
    assert_eq!(out(&api, c, "print(x)").await, "41");
    assert_eq!(from_snapshot(&api, &sid).await.0, 404);
    assert_eq!(api.delete(&format!("/v1/snapshots/{sid}")).await.0, 404);
    broker.stop().await;
}

async fn a_damaged_snapshot_starts_nothing_and_says_why(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "x = 1").await;
    let (status, snap) = snapshot(&api, &a, json!({})).await;
    assert_eq!(status, 201, "{snap}");
    let sid = snap["snapshot_id"].as_str().unwrap();
    let images = snapshot_images(&broker.data_dir, sandbox);
    truncate_pages_image(&images[0]);
    let sessions_before = api.get("/v1/sessions").await.1.as_array().unwrap().len();
    let workspaces =
        || std::fs::read_dir(broker.data_dir.join(own_dir(sandbox))).map_or(0, Iterator::count);
    let before = workspaces();
    let (status, v) = from_snapshot(&api, sid).await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["code"], "snapshot_failed", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("pages-"),
        "{v}"
    );
    assert_eq!(
        api.get("/v1/sessions").await.1.as_array().unwrap().len(),
        sessions_before
    );
    assert_eq!(workspaces(), before, "no workspace is left of it");
    // The original is untouched.
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    broker.stop().await;
}

async fn what_cannot_be_snapshotted_is_refused_and_goes_on(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    // A session sharing its user's workspace.
    let shared = api.create().await;
    out(&api, &shared, "y = 2").await;
    let (status, v) = snapshot(&api, &shared, json!({})).await;
    assert_eq!(
        (status, &v["error"]["code"]),
        (409, &json!("snapshot_refused")),
        "{v}"
    );
    assert_eq!(out(&api, &shared, "print(y)").await, "2");
    let a = own(&api).await;
    out(&api, &a, "z = 3").await;
    if !criu_ready() {
        // Nothing without CRIU: refused, saying so.
        let (status, v) = snapshot(&api, &a, json!({})).await;
        assert_eq!(
            (status, &v["error"]["code"]),
            (409, &json!("snapshot_refused")),
            "{v}"
        );
    } else {
        // Busy: refused at once, the execution goes on.
        let api2 = api.clone();
        let a2 = a.clone();
        let running =
            tokio::spawn(
                async move { out(&api2, &a2, "import time; time.sleep(3); print(z)").await },
            );
        tokio::time::sleep(std::time::Duration::from_millis(800)).await;
        let (status, v) = snapshot(&api, &a, json!({})).await;
        assert_eq!(
            (status, &v["error"]["code"]),
            (409, &json!("snapshot_refused")),
            "{v}"
        );
        assert_eq!(running.await.unwrap(), "3");
    }
    assert_eq!(out(&api, &a, "print(z)").await, "3");
    assert!(snapshot_images(&broker.data_dir, sandbox).is_empty());
    assert_eq!(api.get("/v1/snapshots").await.1, json!([]));
    broker.stop().await;
}

async fn a_snapshot_outlives_the_broker(sandbox: &'static str) {
    use common::spawned::{SpawnedBroker, Stop};
    if !criu_ready() {
        return;
    }
    let args: &[&str] = match sandbox {
        "docker" => &["--sandbox", "docker"],
        _ => &[],
    };
    let mut broker = SpawnedBroker::start(args, None);
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "kept = [1, 2, 3]\nit = iter(kept); next(it)").await;
    let (status, snap) = snapshot(&api, &a, json!({"name": "kept"})).await;
    assert_eq!(status, 201, "{snap}");
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    for how in [Stop::Term, Stop::Kill] {
        broker.restart(how).await;
        let api = broker.api(ALICE);
        let (status, listed) = api.get(&format!("/v1/snapshots/{sid}")).await;
        assert_eq!(status, 200, "{listed}");
        assert_eq!(listed, snap, "the same snapshot, as it was");
        let (status, s) = from_snapshot(&api, &sid).await;
        assert_eq!(status, 201, "{s}");
        let b = s["id"].as_str().unwrap();
        assert_eq!(out(&api, b, "print(kept, next(it))").await, "[1, 2, 3] 2");
        assert_eq!(api.delete(&format!("/v1/sessions/{b}")).await.0, 204);
    }
    let api = broker.api(ALICE);
    assert_eq!(api.delete(&format!("/v1/snapshots/{sid}")).await.0, 204);
    broker.restart(Stop::Term).await;
    assert_eq!(broker.api(ALICE).get("/v1/snapshots").await.1, json!([]));
    assert!(snapshot_images(&broker.data_dir(), sandbox).is_empty());
    broker.halt(Stop::Term).await;
}

/// A broker with `--keep-sessions` on `sandbox`, a session with a workspace of its own that
/// ran `code`, and a session from a snapshot of it: the broker and the two ids.
async fn kept_with_a_snapshot_session(
    sandbox: &str,
    code: &str,
) -> (common::spawned::SpawnedBroker, String, String) {
    let mut args = vec!["--keep-sessions"];
    if sandbox == "docker" {
        args.extend(["--sandbox", "docker"]);
    }
    let broker = common::spawned::SpawnedBroker::start(&args, None);
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, code).await;
    let (status, snap) = snapshot(&api, &a, json!({})).await;
    assert_eq!(status, 201, "{snap}");
    let (status, s) = from_snapshot(&api, snap["snapshot_id"].as_str().unwrap()).await;
    assert_eq!(status, 201, "{s}");
    let b = s["id"].as_str().unwrap().to_string();
    (broker, a, b)
}

/// With `--keep-sessions`, the kernels CRIU restores are kept as launched ones are: a
/// session from a snapshot and a fork of a session with a workspace of its own (a copy)
/// outlive a `kill -9` of the broker with their state, and fork again in the next run.
async fn restored_kernels_are_kept_with_keep_sessions(sandbox: &'static str) {
    use common::spawned::Stop;
    if !criu_ready() {
        return;
    }
    let code = "x = 7\nit = iter('abcd'); next(it)";
    let (mut broker, a, from_snap) = kept_with_a_snapshot_session(sandbox, code).await;
    let api = broker.api(ALICE);
    let (status, v) = api.post(&format!("/v1/sessions/{a}/fork"), json!({})).await;
    assert_eq!(status, 201, "{v}");
    let copy = v["sessions"][0]["id"].as_str().unwrap().to_string();
    out(&api, &copy, "x += 1").await;
    out(&api, &from_snap, "x += 2").await;

    broker.restart(Stop::Kill).await;
    let api = broker.api(ALICE);
    for (id, expected) in [(&a, "7 b"), (&copy, "8 b"), (&from_snap, "9 b")] {
        assert_eq!(out(&api, id, "print(x, next(it))").await, expected, "{id}");
    }
    // An adopted copy forks again.
    let (status, v) = api
        .post(&format!("/v1/sessions/{copy}/fork"), json!({}))
        .await;
    assert_eq!(status, 201, "{v}");
    let again = v["sessions"][0]["id"].as_str().unwrap();
    assert_eq!(out(&api, again, "print(x, next(it))").await, "8 c");
    broker.halt(Stop::Term).await;
}

/// The kernel is the attacker: a kept restored kernel (a session from a snapshot) forks a
/// child and exits while no broker runs, so that a process of its uid, in its cgroup leaf,
/// waits where it was. The next run adopts no process but the one it kept (pid and start
/// time): the session reads dead, and its leaf goes with the child in it.
async fn a_restored_kernel_that_replaced_itself_while_no_broker_watched_is_not_adopted(
    sandbox: &'static str,
) {
    use common::spawned::Stop;
    if !criu_ready() {
        return;
    }
    let (mut broker, a, b) = kept_with_a_snapshot_session(sandbox, "x = 1").await;
    let api = broker.api(ALICE);
    let leaf = match sandbox {
        "docker" => common::forked::kernel_leaf_dir(&api, &b).await,
        _ => pids_cgroup_base(broker.cgroup_name().unwrap())
            .join("alice")
            .join(&b),
    };
    assert!(leaf.join("cgroup.procs").exists(), "{leaf:?}");
    out(
        &api,
        &b,
        "import os, threading, time\n\
         def _swap():\n\
         \x20   if os.fork() == 0:\n\
         \x20       time.sleep(600)\n\
         \x20   os._exit(0)\n\
         threading.Timer(1.5, _swap).start()",
    )
    .await;
    broker.halt(Stop::Kill).await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    broker.resume();
    let api = broker.api(ALICE);
    let (status, s) = api.get(&format!("/v1/sessions/{b}")).await;
    assert_eq!(status, 200, "{s}");
    assert_eq!(s["state"], "dead", "{s}");
    assert!(
        !leaf.exists(),
        "its leaf, and the child in it, are gone: {leaf:?}"
    );
    // The snapshot's original, a kernel the broker launched, is adopted as ever.
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    broker.halt(Stop::Term).await;
}

/// The kernel is the attacker: it plants links in its workspace (to the host's secrets, to
/// the broker's data directory) before a snapshot, and looks for its images. The copy is
/// made as the kernel's uid in namespaces that show nothing of the host, and the restore
/// runs as the kernel's uid: the links stay links to nothing it may read.
async fn a_kernel_cannot_reach_its_snapshot_or_plant_anything_in_it(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    let data = broker.data_dir.display().to_string();
    let (snaps, owns) = (snapshots_dir(sandbox), own_dir(sandbox));
    let plant = format!(
        "import os\n\
         os.symlink('/etc/shadow', '/home/user/shadow')\n\
         os.symlink('{data}/{snaps}', '/home/user/snaps')\n\
         os.symlink('/etc/shadow', '/tmp/shadow')\n\
         os.symlink('/proc/1/root', '/home/user/hostroot')\n\
         secret = 'mine'"
    );
    out(&api, &a, &plant).await;
    let (status, snap) = snapshot(&api, &a, json!({})).await;
    assert_eq!(status, 201, "{snap}");
    let sid = snap["snapshot_id"].as_str().unwrap();
    // From inside, neither the images nor the snapshot's workspace copy exist.
    let probe = format!(
        "import os\n\
         print(os.path.exists('{data}/{snaps}/{sid}'), os.path.exists('{data}/{owns}/{sid}'))"
    );
    assert_eq!(out(&api, &a, &probe).await, "False False");

    let (status, s) = from_snapshot(&api, sid).await;
    assert_eq!(status, 201, "{s}");
    let b = s["id"].as_str().unwrap();
    let read = "def r(p):\n\
                \x20   try:\n\
                \x20       return len(open(p, 'rb').read())\n\
                \x20   except OSError as e:\n\
                \x20       return type(e).__name__\n\
                print(secret, [os.path.islink('/home/user/' + n) for n in ('shadow', 'snaps', 'hostroot')], \
                r('/home/user/shadow'), os.path.exists('/home/user/snaps/' + '{sid}'), \
                os.path.exists('/home/user/hostroot/etc/shadow'), os.path.islink('/tmp/shadow'), \
                r('/tmp/shadow'), os.getuid() != 0)";
    let got = out(&api, b, &read.replace("{sid}", sid)).await;
    assert!(got.starts_with("mine [True, True, True] "), "{got}");
    assert!(
        !got.contains("True True"),
        "nothing of the host through the links: {got}"
    );
    assert!(got.ends_with("True"), "{got}");
    let words: Vec<&str> = got.split_whitespace().collect();
    for (at, what) in [(4, "in /home/user"), (8, "in /tmp")] {
        assert!(
            words[at].parse::<usize>().is_err(),
            "the host's /etc/shadow is not read through the link {what}: {got}"
        );
    }
    assert_eq!(
        words[7], "True",
        "the link in /tmp is kept as a link: {got}"
    );
    broker.stop().await;
}
