//! Forking a live session (issue 36, `POST /v1/sessions/{id}/fork`) on both sandboxes, real
//! kernels forked from their user's template (local: its bwrap sandbox; Docker: the user's
//! container): the forks carry the kernel's state and then go their own way, are ordinary
//! sessions with a cgroup leaf of their own, count against the quota as a whole, and a
//! kernel that lies about its fork gets nothing adopted. The broker runs as root, so the
//! tests read leaves, host pids and runtime directories on the host, as the broker does.

use crate::common;

use common::forked::{busy_with, first_process, kernel_leaf_dir, out};
use common::*;
use serde_json::{json, Value};

on_both_backends!(
    a_fork_continues_as_the_original_would_and_then_goes_its_own_way,
    forks_outlive_the_original_and_the_original_outlives_them,
    a_fork_has_its_own_leaf_and_memory_limit,
    a_kernel_that_lies_about_its_fork_gets_nothing_adopted,
    symlinks_planted_at_the_forks_sockets_are_not_followed,
    a_plainly_started_kernel_is_refused_with_the_reason,
    an_earlier_fork_is_not_taken_from_its_session,
);
on_one_backend!(
    forks_beyond_the_quota_are_refused_whole,
    bad_fork_requests_are_refused_clearly,
);

fn forking(a: &mut kernel_broker::config::ServeArgs) {
    a.fork_server = Some(true);
    a.preload = Some("numpy".into());
}

async fn fork(api: &Api, id: &str, body: Value) -> (u16, Value) {
    api.post(&format!("/v1/sessions/{id}/fork"), body).await
}

/// The ids of the sessions a successful fork made.
async fn forked(api: &Api, id: &str, count: u64) -> Vec<String> {
    let (status, v) = fork(api, id, json!({ "count": count })).await;
    assert_eq!(status, 201, "{v}");
    let sessions = v["sessions"].as_array().unwrap();
    assert_eq!(sessions.len() as u64, count, "{v}");
    sessions
        .iter()
        .map(|s| {
            assert_eq!(s["state"], "idle", "{s}");
            s["id"].as_str().unwrap().to_string()
        })
        .collect()
}

async fn session_ids(api: &Api) -> Vec<String> {
    let (status, v) = api.get("/v1/sessions").await;
    assert_eq!(status, 200);
    let mut ids: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

/// The cgroup leaf (pids hierarchy on v1, else the v2 tree) of `user`'s session `id`: local,
/// in the broker's tree; Docker, in the user's container's cgroup, as the kernel reads it.
async fn leaf_of(broker: &Broker, api: &Api, user: &str, id: &str) -> std::path::PathBuf {
    if broker.sandbox == "local" {
        return pids_cgroup_base(broker.cgroup_name()).join(user).join(id);
    }
    kernel_leaf_dir(api, id).await
}

/// The host pid of session `id`'s kernel (the first process of its leaf).
async fn host_pid(broker: &Broker, api: &Api, user: &str, id: &str) -> i64 {
    i64::from(first_process(&leaf_of(broker, api, user, id).await))
}

/// What `/run/kernel` holds as the kernel with host pid `pid` sees it (its runtime
/// directory and its forks' beside it), read from the host, sorted.
fn runtime_dirs(pid: i64) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root/run/kernel"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The leaves beside `leaf` (its user's, or its container's), sorted.
fn leaves(leaf: &std::path::Path) -> Vec<String> {
    subdirectories(leaf.parent().unwrap())
}

/// The broker's events in the recording of session `id`.
async fn broker_events(api: &Api, id: &str) -> Vec<Value> {
    let (status, v) = api
        .get(&format!("/v1/sessions/{id}/events?channel=broker"))
        .await;
    assert_eq!(status, 200, "{v}");
    v["events"].as_array().unwrap().clone()
}

const STATE: &str = r#"
import os, random
x = 41
def f(a):
    return a * 2
class C:
    def __init__(self):
        self.v = 7
with open('/workspace/fork-lines.txt', 'w') as w:
    w.write(''.join('line%d\n' % i for i in range(10)))
fh = open('/workspace/fork-lines.txt')
fh.readline(); fh.readline()
g = (i * i for i in range(100))
next(g); next(g); next(g)
random.seed(1234)
random.random()
os.makedirs('/tmp/fork-cwd', exist_ok=True)
os.chdir('/tmp/fork-cwd')
os.environ['FORK_TEST'] = 'yes'
"#;

const PROBE: &str = "print(x, f(3), C().v, fh.readline().strip(), next(g), random.random(), \
                     os.getcwd(), os.environ['FORK_TEST'], len(In))";

async fn a_fork_continues_as_the_original_would_and_then_goes_its_own_way(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let setup = api.execute(&a, STATE).await;
    assert_eq!(setup["status"], "ok", "{setup}");
    let (_, before) = api.get(&format!("/v1/sessions/{a}")).await;
    let count = before["execution_count"].as_u64().unwrap();

    let started = std::time::Instant::now();
    let b = forked(&api, &a, 1).await.remove(0);
    let fork_ms = started.elapsed().as_millis();
    let (_, info) = api.get(&format!("/v1/sessions/{b}")).await;
    assert_eq!(info["execution_count"].as_u64(), Some(count), "{info}");
    // The fork first, then the original: each reads the same next line, generator value
    // and random number, in the same directory and environment.
    let in_b = api.execute(&b, PROBE).await;
    let in_a = api.execute(&a, PROBE).await;
    assert_eq!(in_b["status"], "ok", "{in_b}");
    assert_eq!(in_b["stdout"], in_a["stdout"], "{in_b} / {in_a}");
    assert_eq!(in_b["execution_count"], in_a["execution_count"]);
    assert_eq!(in_b["execution_count"].as_u64(), Some(count + 1));
    let line = in_a["stdout"].as_str().unwrap().trim().to_string();
    assert!(line.starts_with("41 6 7 line2 9 "), "{line}");
    assert!(line.contains("/tmp/fork-cwd yes"), "{line}");
    eprintln!("{sandbox}: fork -> usable session: {fork_ms} ms");
    // fork -> first result in the fork.
    let started = std::time::Instant::now();
    let c = forked(&api, &a, 1).await.remove(0);
    assert_eq!(out(&api, &c, "print(x)").await, "41");
    eprintln!(
        "{sandbox}: fork -> first result: {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(api.delete(&format!("/v1/sessions/{c}")).await.0, 204);

    // Changes in the fork stay there, and the other way round.
    out(
        &api,
        &b,
        "x = 100; fh.readline(); os.environ['FORK_TEST'] = 'b'; os.chdir('/')",
    )
    .await;
    let seen = out(
        &api,
        &a,
        "print(x, fh.readline().strip(), os.environ['FORK_TEST'], os.getcwd())",
    )
    .await;
    // The fork read line3 meanwhile: the original's offset is its own.
    assert_eq!(seen, "41 line3 yes /tmp/fork-cwd");
    out(&api, &a, "y = 5").await;
    assert_eq!(out(&api, &b, "print('y' in dir(), x)").await, "False 100");
    // Its memory, as its own leaf counts it.
    let (_, info) = api.get(&format!("/v1/sessions/{b}")).await;
    eprintln!("fork memory: {} bytes", info["memory_used_bytes"]);

    // Three at once: three independent sessions.
    let three = forked(&api, &a, 3).await;
    let mut all = vec![a.clone(), b.clone()];
    all.extend(three.iter().cloned());
    all.sort();
    assert_eq!(session_ids(&api).await, all);
    for (i, id) in three.iter().enumerate() {
        out(&api, id, &format!("x = {i}")).await;
    }
    for (i, id) in three.iter().enumerate() {
        assert_eq!(
            out(&api, id, "print(x, 'y' in dir())").await,
            format!("{i} True")
        );
    }
    assert_eq!(out(&api, &a, "print(x)").await, "41");
    broker.stop().await;
}

async fn forks_outlive_the_original_and_the_original_outlives_them(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1").await;
    let b = forked(&api, &a, 1).await.remove(0);
    let c = forked(&api, &a, 1).await.remove(0);
    // The recordings link them: the fork's `session_created` names its origin and the
    // execution count it started from; the original's recording names its forks.
    let created = broker_events(&api, &b).await;
    assert_eq!(created[0]["kind"], "session_created", "{created:?}");
    assert_eq!(created[0]["detail"]["forked_from"]["session"], a.as_str());
    assert_eq!(created[0]["detail"]["forked_from"]["execution_count"], 1);
    let forks: Vec<Value> = broker_events(&api, &a)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "session_forked")
        .collect();
    assert_eq!(forks.len(), 2, "{forks:?}");
    assert_eq!(forks[0]["detail"]["sessions"], json!([b]));
    assert_eq!(forks[1]["detail"]["sessions"], json!([c]));
    // A fork deleted: the original goes on.
    assert_eq!(api.delete(&format!("/v1/sessions/{b}")).await.0, 204);
    assert_eq!(out(&api, &a, "x += 1; print(x)").await, "2");
    // A fork of a fork, then the original deleted: the forks go on.
    out(&api, &c, "x = 10").await;
    let d = forked(&api, &c, 1).await.remove(0);
    assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    assert_eq!(out(&api, &c, "x += 1; print(x)").await, "11");
    assert_eq!(out(&api, &d, "x += 5; print(x)").await, "15");
    // The Jupyter API lists it as a kernel; the agent WebSocket runs code on it.
    let (_, kernels) = api.get("/api/kernels").await;
    assert!(
        kernels
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["id"] == d.as_str()),
        "{kernels}"
    );
    let mut ws = ws_connect(&broker, &d, ALICE).await;
    ws_send(
        &mut ws,
        json!({"type": "execute", "id": "w1", "code": "print(x)"}),
    )
    .await;
    let frames = ws_until_done(&mut ws, "w1").await;
    let done = frames.last().unwrap();
    assert_eq!(done["execution"]["stdout"], "15\n", "{frames:?}");
    drop(ws);
    // Ordinary sessions: interrupt and restart work on a fork.
    let (status, _) = api
        .post(&format!("/v1/sessions/{d}/interrupt"), json!({}))
        .await;
    assert_eq!(status, 204);
    let (status, v) = api
        .post(&format!("/v1/sessions/{d}/restart"), json!({}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(out(&api, &d, "print('x' in dir())").await, "False");
    // Its parent (c) deleted too: d, restarted from the template, still works.
    assert_eq!(api.delete(&format!("/v1/sessions/{c}")).await.0, 204);
    assert_eq!(out(&api, &d, "print(6 * 7)").await, "42");
    broker.stop().await;
}

async fn a_fork_has_its_own_leaf_and_memory_limit(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1").await;
    let a_leaf = leaf_of(&broker, &api, "alice", &a).await;
    let b = forked(&api, &a, 1).await.remove(0);
    // Its own leaf, named by its session, beside the original's, with the session's
    // memory limit.
    let cg = out(&api, &b, "print(open('/proc/self/cgroup').read())").await;
    assert!(cg.contains(b.as_str()), "{cg}");
    let b_leaf = leaf_of(&broker, &api, "alice", &b).await;
    assert_eq!(b_leaf.parent(), a_leaf.parent());
    assert!(leaves(&a_leaf).contains(&b));
    // A memory hog in the fork is killed by the fork's limit; the original survives.
    let v = api
        .execute(
            &b,
            "hog = bytearray(600 << 20); hog[::4096] = b'x' * len(hog[::4096])",
        )
        .await;
    assert_ne!(v["status"], "ok", "{v}");
    let (_, info) = api.get(&format!("/v1/sessions/{b}")).await;
    assert_eq!(info["state"], "dead", "{info}");
    let reason = info["dead_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("out of memory"), "{info}");
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    // The dead fork's leaf is gone; deleting it leaves only the original's (and the
    // template's).
    assert_eq!(api.delete(&format!("/v1/sessions/{b}")).await.0, 204);
    assert!(!leaves(&a_leaf).contains(&b));
    broker.stop().await;
}

async fn forks_beyond_the_quota_are_refused_whole(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |a| {
        forking(a);
        a.max_sessions_per_user = Some(3);
    })
    .await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let a_leaf = leaf_of(&broker, &api, "alice", &a).await;
    let before = leaves(&a_leaf);
    let (status, v) = fork(&api, &a, json!({"count": 3})).await;
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["code"], "quota_exceeded", "{v}");
    assert_eq!(session_ids(&api).await, vec![a.clone()]);
    assert_eq!(leaves(&a_leaf), before);
    // Two fit.
    assert_eq!(forked(&api, &a, 2).await.len(), 2);
    assert_eq!(session_ids(&api).await.len(), 3);
    let (status, _) = fork(&api, &a, json!({})).await;
    assert_eq!(status, 429);
    broker.stop().await;
}

async fn bad_fork_requests_are_refused_clearly(sandbox: &'static str) {
    let broker = Broker::start(sandbox, forking).await;
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    let a = alice.create().await;
    let missing = uuid::Uuid::new_v4();
    let (status, v) = fork(&alice, &missing.to_string(), json!({})).await;
    assert_eq!(status, 404, "{v}");
    // Another user's session: as missing as a session that never was.
    let (status, v) = fork(&bob, &a, json!({})).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "session_not_found");
    for (body, needle) in [
        (json!({"count": 0}), "between 1 and 8"),
        (json!({"count": 9}), "between 1 and 8"),
        (json!({"count": "2"}), "expected u64"),
        (json!({"cont": 2}), "cont"),
    ] {
        let (status, v) = fork(&alice, &a, body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{body}: {v}");
    }
    let raw = alice
        .http
        .post(broker.url(&format!("/v1/sessions/{a}/fork")))
        .bearer_auth(ALICE)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    // A busy session: 409 at once, not after the code ends.
    let busy = busy_with(&alice, &a, "import time; time.sleep(4)").await;
    let asked = std::time::Instant::now();
    let (status, v) = fork(&alice, &a, json!({})).await;
    assert_eq!(status, 409, "{v}");
    assert!(asked.elapsed().as_secs() < 2);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("running code"),
        "{v}"
    );
    busy.await.unwrap();
    assert_eq!(
        alice.get("/v1/sessions").await.1.as_array().unwrap().len(),
        1
    );
    broker.stop().await;
}

/// Installs in the kernel a `kb_fork_request` handler that answers `reply` (Python: an
/// expression of `parent`, the request; `None`: no answer at all).
fn hostile_handler(reply: &str) -> String {
    format!(
        "import os, json\n\
         _k = get_ipython().kernel\n\
         def _hostile(stream, ident, parent):\n\
         \x20   content = {reply}\n\
         \x20   if content is not None:\n\
         \x20       _k.session.send(stream, 'kb_fork_reply', content, parent, ident=ident)\n\
         _k.shell_handlers['kb_fork_request'] = _hostile\n"
    )
}

/// A launch timeout short enough for the waits of a kernel that never answers a fork (it
/// and 10 s) to stay short, long enough for a cold launch (Docker makes the user's
/// container and template first).
fn short_launch_timeout(sandbox: &str) -> Option<u64> {
    let secs = if sandbox == "docker" { 20 } else { 8 };
    Some(scaled(std::time::Duration::from_secs(secs)).as_secs())
}

async fn a_kernel_that_lies_about_its_fork_gets_nothing_adopted(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |a| {
        forking(a);
        // The wait for a kernel that never answers: the launch timeout and 10 s.
        a.launch_timeout = short_launch_timeout(sandbox);
    })
    .await;
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    let a = alice.create().await;
    let b = bob.create().await;
    let bob_inner: i64 = out(&bob, &b, "import os; print(os.getpid())")
        .await
        .parse()
        .unwrap();
    // (Docker: in bob's own container.)
    let bob_host = host_pid(&broker, &bob, "bob", &b).await;
    let bob_leaf = leaf_of(&broker, &bob, "bob", &b).await;
    let parent: i64 = out(&alice, &a, "import os; print(os.getpid())")
        .await
        .parse()
        .unwrap();
    let a_leaf = leaf_of(&broker, &alice, "alice", &a).await;
    let a_host = host_pid(&broker, &alice, "alice", &a).await;
    let before = leaves(&a_leaf);
    let dirs_before = runtime_dirs(a_host);
    let bob_leaves = leaves(&bob_leaf);
    let ok = |pid: String| format!("{{'status': 'ok', 'pid': {pid}}}");
    let mut replies = vec![
        ok("1".into()),
        ok(parent.to_string()),
        ok(bob_inner.to_string()),
        ok(bob_host.to_string()),
        ok("99999".into()),
        ok("-5".into()),
        ok("2**40".into()),
        ok("'12'".into()),
        ok("12.5".into()),
        // A child it started that is not a kernel: adopted, it never answers on the
        // fork's sockets and is ended with its leaf.
        ok("__import__('subprocess').Popen(['sleep', '600']).pid".into()),
        "{'status': 'ok', 'pid': os.getpid(), 'pad': 'a' * (10 << 20)}".into(),
        "{'status': 'error', 'ename': 'Nope', 'evalue': 'no fork for you'}".into(),
        "'not an object'".into(),
    ];
    replies.push("None".into());
    for reply in &replies {
        out(&alice, &a, &hostile_handler(reply)).await;
        let (status, v) = fork(&alice, &a, json!({})).await;
        assert!([502, 504].contains(&status), "{reply}: {status} {v}");
        assert_eq!(v["error"]["code"], "fork_failed", "{reply}: {v}");
        // Nothing adopted or left: no session, no leaf, no fork directory.
        assert_eq!(session_ids(&alice).await, vec![a.clone()], "{reply}");
        assert_eq!(leaves(&a_leaf), before, "{reply}");
        assert_eq!(runtime_dirs(a_host), dirs_before, "{reply}");
        // The original works; bob's kernel was not touched.
        assert_eq!(out(&alice, &a, "print(1 + 1)").await, "2", "{reply}");
        assert_eq!(
            out(&bob, &b, "print(os.getpid())").await,
            bob_inner.to_string()
        );
        assert_eq!(leaves(&bob_leaf), bob_leaves);
        assert!(std::path::Path::new(&format!("/proc/{bob_host}")).exists());
    }
    // The sleeping child it named was ended with the leaf it was moved into.
    let left = out(
        &alice,
        &a,
        "import subprocess\n\
         print([p for p in os.listdir('/proc') if p.isdigit() and open('/proc/%s/cmdline' % p).read() == 'sleep\\x00600\\x00'])",
    )
    .await;
    assert_eq!(left, "[]");
    broker.stop().await;
}

/// The kernel forks for real, on sockets of its choosing, and plants symlinks to them at
/// the paths the broker named (relative, so they resolve on the host too): the broker never connects through a symlink, so the fork
/// fails (with the symlinks followed it would have succeeded: the sockets are a real
/// kernel's with the right key).
async fn symlinks_planted_at_the_forks_sockets_are_not_followed(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |a| {
        forking(a);
        a.launch_timeout = short_launch_timeout(sandbox);
    })
    .await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let a_leaf = leaf_of(&broker, &api, "alice", &a).await;
    let a_host = host_pid(&broker, &api, "alice", &a).await;
    let before = leaves(&a_leaf);
    let dirs_before = runtime_dirs(a_host);
    let plant = "import os, sys\n\
        from ipykernel.kernelapp import IPKernelApp\n\
        _kbf = sys.modules['kernel_broker_fork']\n\
        _k = get_ipython().kernel\n\
        _app = IPKernelApp.instance()\n\
        def _planting(stream, ident, parent):\n\
        \x20   conn = dict(parent['content']['connection'])\n\
        \x20   named = conn['ip']\n\
        \x20   conn['ip'] = os.path.dirname(named) + '/x'\n\
        \x20   pid = _kbf.fork(_app, _k, conn)\n\
        \x20   for port in ('shell_port', 'iopub_port', 'stdin_port', 'control_port', 'hb_port'):\n\
        \x20       os.symlink('x-%d' % conn[port], '%s-%d' % (named, conn[port]))\n\
        \x20   _k.session.send(stream, 'kb_fork_reply', {'status': 'ok', 'pid': pid}, parent, ident=ident)\n\
        _k.shell_handlers['kb_fork_request'] = _planting\n";
    out(&api, &a, plant).await;
    let (status, v) = fork(&api, &a, json!({})).await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(session_ids(&api).await, vec![a.clone()]);
    assert_eq!(leaves(&a_leaf), before);
    assert_eq!(runtime_dirs(a_host), dirs_before);
    assert_eq!(out(&api, &a, "print(2 + 2)").await, "4");
    broker.stop().await;
}

/// A kernel started plainly (no template) is its sandbox's only command: its forks would
/// end with it, so it is refused, saying what would allow it.
async fn a_plainly_started_kernel_is_refused_with_the_reason(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |a| a.fork_server = Some(false)).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1").await;
    let (status, v) = fork(&api, &a, json!({"count": 2})).await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"]["code"], "fork_refused", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("started plainly") && message.contains("template"),
        "{v}"
    );
    assert_eq!(session_ids(&api).await, vec![a.clone()]);
    assert_eq!(out(&api, &a, "print(x)").await, "1");
    // A session with a workspace of its own is started plainly on both backends and is
    // copied, not forked beside itself (`fork_copy.rs`): the template has no part in it.
    if !criu_ready() {
        broker.stop().await;
        return;
    }
    let (status, own) = api.post("/v1/sessions", json!({"workspace": "own"})).await;
    assert_eq!(status, 201, "{own}");
    let own = own["id"].as_str().unwrap().to_string();
    out(&api, &own, "y = 2").await;
    let (status, v) = fork(&api, &own, json!({})).await;
    assert_eq!(status, 201, "{v}");
    let copy = v["sessions"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(out(&api, &copy, "print(y)").await, "2");
    assert_eq!(session_ids(&api).await.len(), 3);
    broker.stop().await;
}

/// An earlier fork is the parent kernel's child too, but a session's kernel now: a kernel
/// that names it for a new fork does not take it from its session.
async fn an_earlier_fork_is_not_taken_from_its_session(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |a| {
        forking(a);
        a.launch_timeout = short_launch_timeout(sandbox);
    })
    .await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    out(&api, &a, "x = 1").await;
    let b = forked(&api, &a, 1).await.remove(0);
    let b_pid = out(&api, &b, "import os; print(os.getpid())").await;
    let a_leaf = leaf_of(&broker, &api, "alice", &a).await;
    let before = leaves(&a_leaf);
    out(
        &api,
        &a,
        &hostile_handler(&format!("{{'status': 'ok', 'pid': {b_pid}}}")),
    )
    .await;
    let (status, v) = fork(&api, &a, json!({})).await;
    assert_eq!(status, 502, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("cgroup"),
        "{v}"
    );
    let mut both = vec![a.clone(), b.clone()];
    both.sort();
    assert_eq!(session_ids(&api).await, both);
    assert_eq!(leaves(&a_leaf), before);
    // b is still b's, in its own leaf.
    assert_eq!(
        out(&api, &b, "x += 1; print(x, os.getpid())").await,
        format!("2 {b_pid}")
    );
    let cg = out(&api, &b, "print(open('/proc/self/cgroup').read())").await;
    assert!(cg.contains(b.as_str()), "{cg}");
    broker.stop().await;
}
