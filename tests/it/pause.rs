//! Pausing a session to disk and resuming it (issue 37): the kernel's held child dumped
//! with CRIU into the broker's data directory, the kernel ended, and restored as the
//! kernel's uid into a new sandbox over the session's own workspace (`sandbox/pause.rs`).
//! Real kernels and a real CRIU 4 (`scripts/setup-criu`); with `KB_REQUIRE_CRIU=1` (CI) a
//! missing CRIU fails these tests instead of skipping them.

use crate::common;

use common::forked::out;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

on_one_backend!(
    a_broker_killed_mid_pause_loses_nothing_acknowledged,
    idle_sessions_pause_by_themselves_and_paused_ones_expire,
);

crate::on_both_backends!(
    a_session_sharing_its_users_workspace_pauses_too,
    what_cannot_be_paused_is_refused_and_goes_on_running,
    a_paused_session_comes_back_with_its_state_on_any_use,
    a_paused_session_outlives_the_broker,
    a_pause_without_room_for_its_images_is_refused_and_the_session_runs_on,
    a_damaged_paused_kernel_leaves_the_session_dead_saying_why,
    another_users_session_cannot_be_paused_or_resumed,
    a_jupyter_client_on_a_paused_session_resumes_it,
    a_session_paused_longer_than_its_held_child_would_wait_comes_back,
    a_resume_right_after_the_pause_is_admitted_within_the_users_memory,
    a_kernel_that_stops_its_own_children_never_stalls_a_pause,
);

async fn own(api: &Api) -> String {
    let (status, v) = api.post("/v1/sessions", json!({"workspace": "own"})).await;
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn pause(api: &Api, id: &str) -> (u16, Value) {
    api.post(&format!("/v1/sessions/{id}/pause"), json!({}))
        .await
}

async fn resume(api: &Api, id: &str) -> (u16, Value) {
    api.post(&format!("/v1/sessions/{id}/resume"), json!({}))
        .await
}

async fn state_of(api: &Api, id: &str) -> Value {
    let (status, v) = api.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Whether a host process runs in a cgroup whose path names `id` (a kernel's leaf).
fn processes_in_leaf(id: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter(|e| std::fs::read_to_string(e.path().join("cgroup")).is_ok_and(|c| c.contains(id)))
        .count()
}

/// Waits until no process is left in the leaf of the kernel of `id`, paused: it ends
/// after the pause's answer (SIGKILL, its sandbox emptied: tens of milliseconds).
async fn kernel_gone(id: &str) {
    within(10, "no process of the paused kernel to be left", async {
        while processes_in_leaf(id) != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// Where a backend keeps the paused kernels' images, in the data directory.
fn paused_dir(sandbox: &str) -> &'static str {
    match sandbox {
        "docker" => "paused-docker",
        _ => "paused",
    }
}

/// The paused kernels' image directories in the data directory (the local sandbox's, and
/// the Docker sandbox's).
fn paused_images(data: &std::path::Path) -> Vec<std::path::PathBuf> {
    ["paused", "paused-docker"]
        .iter()
        .flat_map(|d| match std::fs::read_dir(data.join(d)) {
            Ok(entries) => entries.flatten().map(|e| e.path()).collect(),
            Err(_) => Vec::new(),
        })
        .collect()
}

/// The Docker containers of the sandbox `id` (a session with a container of its own).
fn containers_of(id: &str) -> usize {
    let out = docker_cli()
        .args(["ps", "-a", "--filter"])
        .arg(format!("label=org.kernel-broker.sandbox={id}"))
        .args(["--format", "{{.Names}}"])
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

fn paused_images_of(data: &std::path::Path, sandbox: &str) -> Vec<std::path::PathBuf> {
    match std::fs::read_dir(data.join(paused_dir(sandbox))) {
        Ok(entries) => entries.flatten().map(|e| e.path()).collect(),
        Err(_) => Vec::new(),
    }
}

const STATE: &str = r#"
import os, random, sqlite3
x = 41
def f(a):
    return a * 2
class K:
    def __init__(self, v): self.v = v
k = K(lambda: x + 1)
with open('/home/user/data.txt', 'w') as w:
    w.write(''.join('line%d\n' % i for i in range(10)))
fh = open('/home/user/data.txt')
fh.readline(); fh.readline()
g = (i * i for i in range(100))
next(g); next(g); next(g)
db = sqlite3.connect(':memory:')
db.execute('create table t (v)'); db.execute('insert into t values (7)')
random.seed(1234)
random.random()
_s = random.getstate(); expected = random.random(); random.setstate(_s)
os.makedirs('/home/user/sub', exist_ok=True)
os.chdir('/home/user/sub')
os.environ['PAUSE_TEST'] = 'yes'
"#;

const PROBE: &str = "print(x, f(3), k.v(), fh.readline().strip(), next(g), \
                     db.execute('select v from t').fetchone()[0], random.random() == expected, \
                     os.getcwd(), os.environ['PAUSE_TEST'], len(In))";

const WHO: &str = "st = {l.split(':')[0]: l.split(':')[1].strip() for l in open('/proc/self/status')}\n\
                   print(os.getuid(), st['CapEff'], st['CapPrm'], st['CapBnd'], st['NoNewPrivs'], st['Seccomp'])";

async fn a_paused_session_comes_back_with_its_state_on_any_use(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    let setup = api.execute(&a, STATE).await;
    assert_eq!(setup["status"], "ok", "{setup}");
    let who = out(&api, &a, WHO).await;
    // The first kernel's cgroup leaf is named after its session.
    let leaf_named = true;
    assert!(
        !leaf_named || processes_in_leaf(&a) > 0,
        "the kernel runs in its leaf"
    );

    let (status, v) = pause(&api, &a).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "paused");
    assert_eq!(v["execution_count"], 2);
    let image_bytes = v["image_bytes"].as_u64().unwrap();
    assert!(image_bytes > 1 << 20, "{v}");
    // The kernel is gone, and so is its memory; the state is on disk, root's.
    let s = state_of(&api, &a).await;
    assert_eq!(s["state"], "paused", "{s}");
    assert!(s["memory_used_bytes"].is_null(), "{s}");
    if leaf_named {
        kernel_gone(&a).await;
    }
    if sandbox == "docker" {
        // Removed after the answer (the engine takes about a second).
        let gone = || async { containers_of(&a) == 0 };
        assert!(
            wait_until(Duration::from_secs(30), gone).await,
            "its container goes while it is paused"
        );
    }
    let images = paused_images_of(&broker.data_dir, sandbox);
    assert_eq!(images.len(), 1, "{images:?}");
    {
        use std::os::unix::fs::MetadataExt;
        let parent = std::fs::metadata(broker.data_dir.join(paused_dir(sandbox))).unwrap();
        assert_eq!((parent.uid(), parent.mode() & 0o777), (0, 0o700));
        for f in std::fs::read_dir(&images[0]).unwrap().flatten() {
            let m = f.metadata().unwrap();
            assert!(m.is_file(), "{:?}", f.path());
            // The images root's and read-only; the broker's record of them root's alone.
            let mode = if f.file_name() == "broker.json" {
                0o600
            } else {
                0o644
            };
            assert_eq!((m.uid(), m.mode() & 0o777, m.nlink()), (0, mode, 1));
        }
    }
    // Pausing again answers as the pause did; the session is listed as paused.
    let (status, again) = pause(&api, &a).await;
    assert_eq!((status, &again["image_bytes"]), (200, &v["image_bytes"]));
    let (_, list) = api.get("/v1/sessions").await;
    let listed = list
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == a.as_str())
        .cloned()
        .unwrap();
    assert_eq!(listed["state"], "paused", "{listed}");

    // An execution resumes it: the same variables, closures, file positions, generator,
    // sqlite connection, random state, directory, environment and history.
    let probe = api.execute(&a, PROBE).await;
    assert_eq!(probe["status"], "ok", "{probe}");
    assert_eq!(
        probe["stdout"].as_str().unwrap().trim(),
        "41 6 42 line2 9 7 True /home/user/sub yes 4"
    );
    assert_eq!(probe["execution_count"], 3);
    assert_eq!(state_of(&api, &a).await["state"], "idle");
    if sandbox == "docker" {
        assert_eq!(containers_of(&a), 1, "a container of its own again");
    }
    assert!(
        paused_images(&broker.data_dir).is_empty(),
        "its images go once it runs"
    );
    // As confined as before: the kernel's uid, no capabilities, its syscall filter.
    assert_eq!(out(&api, &a, WHO).await, who);

    // Explicitly: pause, resume, and a resume of a running session changes nothing.
    assert_eq!(pause(&api, &a).await.0, 200);
    let (status, s) = resume(&api, &a).await;
    assert_eq!(status, 200, "{s}");
    assert_eq!(s["state"], "idle", "{s}");
    let (status, s) = resume(&api, &a).await;
    assert_eq!((status, &s["state"]), (200, &json!("idle")));
    assert_eq!(out(&api, &a, "print(x + 1, next(g))").await, "42 16");
    // Its files stayed where they were, and the kernel writes on in them.
    out(&api, &a, "open('/home/user/after.txt', 'w').write('after')").await;

    // Its files are on disk: listed while it is paused, without resuming it.
    assert_eq!(pause(&api, &a).await.0, 200);
    let (status, files) = api.get(&format!("/v1/sessions/{a}/files")).await;
    assert_eq!(status, 200, "{files}");
    assert!(files.to_string().contains("after.txt"), "{files}");
    assert_eq!(state_of(&api, &a).await["state"], "paused");

    // Ended while paused: its images go with it.
    assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    assert!(paused_images(&broker.data_dir).is_empty());
    broker.stop().await;
}

async fn a_damaged_paused_kernel_leaves_the_session_dead_saying_why(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    let b = own(&api).await;
    out(&api, &a, "x = 1").await;
    out(&api, &b, "y = 2").await;
    assert_eq!(pause(&api, &a).await.0, 200);
    // Damage its memory image (as root could: a kernel cannot reach it).
    let images = paused_images(&broker.data_dir);
    truncate_pages_image(&images[0]);

    let (status, v) = resume(&api, &a).await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["code"], "resume_failed", "{v}");
    let s = state_of(&api, &a).await;
    assert_eq!(s["state"], "dead", "{s}");
    assert!(
        s["dead_reason"]
            .as_str()
            .unwrap()
            .contains("paused state could not be resumed"),
        "{s}"
    );
    assert!(paused_images(&broker.data_dir).is_empty());
    // An execution says it is dead, never hangs; the other session is untouched; a
    // restart gives the session a fresh kernel.
    let dead = api.execute(&a, "1").await;
    assert_eq!(dead["status"], "dead", "{dead}");
    assert_eq!(out(&api, &b, "print(y)").await, "2");
    let (status, _) = api
        .post(&format!("/v1/sessions/{a}/restart"), json!({}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(out(&api, &a, "print(1 + 1)").await, "2");

    // One byte of its memory changed, the length kept: CRIU would restore it as it is; the
    // check made beside the restore refuses it before anything connects to it.
    let before = user_leaves(&broker, "alice");
    let c = own(&api).await;
    out(&api, &c, "z = 3").await;
    assert_eq!(pause(&api, &c).await.0, 200);
    let images = paused_images(&broker.data_dir);
    assert_eq!(images.len(), 1, "{images:?}");
    flip_a_page_byte(&images[0]);
    let (status, v) = resume(&api, &c).await;
    assert_eq!(status, 502, "{v}");
    let s = state_of(&api, &c).await;
    assert_eq!(s["state"], "dead", "{s}");
    let reason = s["dead_reason"].as_str().unwrap();
    assert!(
        reason.contains("not as they were written") && reason.contains("pages-"),
        "{s}"
    );
    assert!(paused_images(&broker.data_dir).is_empty());
    // The kernel restored from them is gone with its sandbox.
    if sandbox == "local" {
        within(20, "the restored kernel's sandbox to go", async {
            while user_leaves(&broker, "alice") != before {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
    }
    assert_eq!(out(&api, &b, "print(y)").await, "2");
    broker.stop().await;
}

/// Changes one byte in the middle of the pages image in `dir`, as root could.
fn flip_a_page_byte(dir: &std::path::Path) {
    use std::os::unix::fs::FileExt;
    let pages = pages_image(dir);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&pages)
        .unwrap();
    let at = file.metadata().unwrap().len() / 2;
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
}

async fn what_cannot_be_paused_is_refused_and_goes_on_running(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    // A session sharing its user's workspace that holds a file of its sandbox's own /tmp
    // (memory, gone with that sandbox): it would not come back, so it is not paused.
    let (_, v) = api.post("/v1/sessions", json!({})).await;
    let shared = v["id"].as_str().unwrap().to_string();
    out(&api, &shared, "z = 3\nt = open('/tmp/scratch.txt', 'w+')").await;
    let (status, v) = pause(&api, &shared).await;
    if criu_ready() {
        assert_eq!(status, 502, "{v}");
        assert_eq!(v["error"]["code"], "pause_failed", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("/tmp/scratch.txt"), "{v}");
        assert_eq!(out(&api, &shared, "print(z)").await, "3");
        // Closed, it pauses.
        out(&api, &shared, "t.close()").await;
        assert_eq!(pause(&api, &shared).await.0, 200);
    } else {
        assert_eq!(status, 409, "{v}");
    }
    assert_eq!(out(&api, &shared, "print(z)").await, "3");
    if criu_ready() {
        // A session running code: refused, and the code runs on.
        let a = own(&api).await;
        let running = {
            let api = broker.api(ALICE);
            let a = a.clone();
            tokio::spawn(async move {
                api.execute(&a, "import time; time.sleep(2); print('done')")
                    .await
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let (status, v) = pause(&api, &a).await;
        assert_eq!(status, 409, "{v}");
        let done = running.await.unwrap();
        assert_eq!(done["stdout"].as_str().unwrap().trim(), "done", "{done}");
    }
    broker.stop().await;
}

async fn another_users_session_cannot_be_paused_or_resumed(sandbox: &'static str) {
    let broker = Broker::start(sandbox, |_| {}).await;
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    let (_, v) = alice.post("/v1/sessions", json!({})).await;
    let a = v["id"].as_str().unwrap().to_string();
    out(&alice, &a, "secret = 1").await;
    for path in ["pause", "resume"] {
        let (status, v) = bob
            .post(&format!("/v1/sessions/{a}/{path}"), json!({}))
            .await;
        assert_eq!(status, 404, "{path}: {v}");
    }
    for bad in ["not-a-uuid", "00000000-0000-0000-0000-000000000000"] {
        let (status, _) = alice
            .post(&format!("/v1/sessions/{bad}/pause"), json!({}))
            .await;
        assert_eq!(status, 404, "{bad}");
    }
    assert_eq!(out(&alice, &a, "print(secret)").await, "1");

    // Paused images are beyond every kernel's reach: with an own session of alice's paused,
    // a kernel of bob's and another of alice's search all they can see for CRIU's images.
    if criu_ready() {
        let paused = own(&alice).await;
        out(&alice, &paused, "hidden = 'in the image'").await;
        assert_eq!(pause(&alice, &paused).await.0, 200);
        let (_, v) = bob.post("/v1/sessions", json!({})).await;
        let b = v["id"].as_str().unwrap().to_string();
        let search = "import os\nfound = []\n\
                      for root, dirs, files in os.walk('/', onerror=lambda e: None):\n\
                      \x20   dirs[:] = [d for d in dirs if not (root == '/' and d in ('proc', 'sys', 'dev'))]\n\
                      \x20   found += [os.path.join(root, f) for f in files if f in ('inventory.img', 'pstree.img') or (f.startswith(('pages-', 'core-')) and f.endswith('.img'))]\n\
                      print(len(found), found[:3])";
        assert_eq!(out(&bob, &b, search).await, "0 []");
        assert_eq!(out(&alice, &a, search).await, "0 []");
        assert_eq!(out(&alice, &paused, "print(hidden)").await, "in the image");
    }
    broker.stop().await;
}

async fn idle_sessions_pause_by_themselves_and_paused_ones_expire(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |a| {
        a.pause_after = Some(1);
        a.paused_ttl = Some(4);
    })
    .await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "kept = 'across an idle pause'").await;
    // One that cannot be paused (it shares its user's workspace) stays as it was.
    let (_, v) = api.post("/v1/sessions", json!({})).await;
    let shared = v["id"].as_str().unwrap().to_string();
    out(&api, &shared, "y = 2").await;

    let paused = wait_until(Duration::from_secs(20), || async {
        state_of(&api, &a).await["state"] == "paused"
    })
    .await;
    assert!(paused, "{}", state_of(&api, &a).await);
    kernel_gone(&a).await;
    assert_eq!(state_of(&api, &shared).await["state"], "idle");
    assert_eq!(out(&api, &shared, "print(y)").await, "2");
    // Used again, it resumes; idle again, it pauses again.
    assert_eq!(out(&api, &a, "print(kept)").await, "across an idle pause");
    assert!(
        wait_until(Duration::from_secs(20), || async {
            state_of(&api, &a).await["state"] == "paused"
        })
        .await
    );
    // Paused past --paused-ttl, it expires (410) and its images go.
    let expired = wait_until(Duration::from_secs(20), || async {
        api.get(&format!("/v1/sessions/{a}")).await.0 == 410
    })
    .await;
    assert!(expired, "{}", state_of(&api, &a).await);
    // Its images go once it has expired (the removal follows the 410 by moments: a CI run
    // on a loaded machine looked in between).
    assert!(
        wait_until(Duration::from_secs(10), || async {
            paused_images(&broker.data_dir).is_empty()
        })
        .await,
        "{:?}",
        paused_images(&broker.data_dir)
    );
    broker.stop().await;
}

/// Polls `check` every 100 ms until it holds or `limit` passes; whether it held.
async fn wait_until<F, Fut>(limit: Duration, check: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = std::time::Instant::now() + limit;
    while std::time::Instant::now() < end {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn a_pause_without_room_for_its_images_is_refused_and_the_session_runs_on(
    sandbox: &'static str,
) {
    if !criu_ready() {
        return;
    }
    // More than any file system here has free: as a full disk, every pause is refused.
    let broker = Broker::start(sandbox, |a| a.copy_reserve_bytes = Some(1 << 62)).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "block = bytearray(64 << 20)\nx = 1").await;
    let (status, v) = pause(&api, &a).await;
    assert_eq!(status, 507, "{v}");
    assert_eq!(v["error"]["code"], "insufficient_storage", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("was not paused"), "{message}");
    assert!(message.contains("--copy-reserve-bytes"), "{message}");
    // Nothing made, nothing lost: the session runs on with its state.
    assert!(paused_images(&broker.data_dir).is_empty());
    assert_eq!(state_of(&api, &a).await["state"], "idle");
    assert_eq!(out(&api, &a, "print(x, len(block))").await, "1 67108864");
    broker.stop().await;
}

/// The kernel is the attacker (Docker): its container's `/tmp` is archived beside its images
/// at a pause, and it fills `/tmp` with a sparse file of 8 GiB (its tmpfs holds 256 MiB of
/// data, but any length). The archive stops at its bound (`RLIMIT_FSIZE`): the pause is
/// refused saying why, nothing is left on disk, and the session runs on; once the file is
/// gone the pause works.
#[tokio::test]
async fn docker_a_kernel_cannot_grow_its_paused_archive_past_its_bound() {
    docker_ready();
    if !criu_ready() {
        return;
    }
    let broker = Broker::start("docker", |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(
        &api,
        &a,
        "x = 5
with open('/tmp/sparse', 'wb') as f:
    f.truncate(8 << 30)",
    )
    .await;
    let (status, v) = pause(&api, &a).await;
    assert_eq!(status, 502, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("could not be archived"), "{message}");
    assert!(paused_images(&broker.data_dir).is_empty(), "nothing left");
    assert_eq!(state_of(&api, &a).await["state"], "idle");
    assert_eq!(out(&api, &a, "print(x)").await, "5");
    out(&api, &a, "import os; os.remove('/tmp/sparse')").await;
    let (status, v) = pause(&api, &a).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(out(&api, &a, "print(x)").await, "5");
    broker.stop().await;
}

/// Paused state outlives the broker (both sandboxes): stopped (SIGTERM) or killed (SIGKILL)
/// once the pause was answered, with and without `--keep-sessions`, the next run has the
/// session paused under the same id, and its next use resumes it with its state. With
/// `--keep-sessions` the resumed kernel (one CRIU restored) is kept in turn: a `kill -9`
/// later, the next run adopts it with its state, and on Docker pauses it again.
async fn a_paused_session_outlives_the_broker(sandbox: &'static str) {
    use common::spawned::{SpawnedBroker, Stop};
    if !criu_ready() {
        return;
    }
    let backend: Vec<&str> = match sandbox {
        "docker" => vec!["--sandbox", "docker"],
        _ => vec![],
    };
    let with = |extra: &[&'static str]| [backend.clone(), extra.to_vec()].concat();
    let rounds = [
        (with(&[]), Stop::Term),
        (with(&[]), Stop::Kill),
        (with(&["--keep-sessions"]), Stop::Term),
    ];
    for (args, how) in rounds {
        let keeping = args.contains(&"--keep-sessions");
        let mut broker = SpawnedBroker::start(&args, None);
        let api = broker.api(ALICE);
        let a = own(&api).await;
        out(&api, &a, "kept = [1, 2, 3]\nit = iter(kept); next(it)\nfh = open('/home/user/f.txt', 'w+'); fh.write('abc'); fh.seek(1)\ntf = open('/tmp/t.txt', 'w+'); tf.write('in tmp'); tf.seek(3)").await;
        let (status, v) = pause(&api, &a).await;
        assert_eq!(status, 200, "{v}");
        let running = own(&api).await;
        out(&api, &running, "y = 1").await;

        broker.restart(how).await;
        let api = broker.api(ALICE);
        let s = state_of(&api, &a).await;
        assert_eq!(s["state"], "paused", "{args:?}: {s}");
        assert_eq!(s["execution_count"], 1, "{s}");
        assert_eq!(paused_images(&broker.data_dir()).len(), 1);
        // Its next use resumes it: the same variables, iterator and open file.
        assert_eq!(
            out(&api, &a, "print(kept, next(it), fh.read(), tf.read())").await,
            "[1, 2, 3] 2 bc tmp",
            "{args:?}"
        );
        assert!(paused_images(&broker.data_dir()).is_empty());
        // A session that was running: kept only with --keep-sessions (and not after a kill
        // without it: its kernel died with the broker).
        let (status, _) = api.get(&format!("/v1/sessions/{running}")).await;
        assert_eq!(status == 200, keeping, "{args:?}: {status}");
        if keeping {
            // A kernel adopted from the earlier run pauses.
            assert_eq!(pause(&api, &running).await.0, 200);
            assert_eq!(out(&api, &running, "print(y)").await, "1");
        }
        if keeping {
            broker.restart(Stop::Kill).await;
            let api = broker.api(ALICE);
            assert_eq!(state_of(&api, &a).await["state"], "idle");
            assert_eq!(
                out(&api, &a, "print(next(it), fh.tell(), tf.tell())").await,
                "3 3 6",
                "the resumed kernel, adopted"
            );
            // Its workspace is its session's, kept with it (the resumed kernel is kept
            // under a kernel id of its own: the start-up sweep once took the workspace).
            assert_eq!(
                out(&api, &a, "print(open('/home/user/f.txt').read())").await,
                "abc"
            );
            // The adopted kernel pauses again.
            let (status, v) = pause(&api, &a).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(out(&api, &a, "print(kept)").await, "[1, 2, 3]");
        }
        let api = broker.api(ALICE);
        assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
        broker.halt(Stop::Term).await;
    }

    // Taken back, a session pauses by itself as its user's settings say (`--pause-after`).
    let mut broker = SpawnedBroker::start(&with(&["--pause-after", "1"]), None);
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "z = 5").await;
    let paused = || async { state_of(&broker.api(ALICE), &a).await["state"] == "paused" };
    assert!(wait_until(Duration::from_secs(20), paused).await);
    broker.restart(Stop::Term).await;
    let api = broker.api(ALICE);
    assert_eq!(out(&api, &a, "print(z)").await, "5");
    let paused = || async { state_of(&broker.api(ALICE), &a).await["state"] == "paused" };
    assert!(
        wait_until(Duration::from_secs(20), paused).await,
        "paused by itself again after the restart"
    );
    broker.halt(Stop::Term).await;
}

/// A paused session is resumed any time later: the held child in its images waits to be
/// woken for at most `HOLD_TIMEOUT` (a copy the broker never came back for ends), and its
/// clock is far past that at a resume; the time it spent dumped must not count. Here the
/// kernel's timeout is 2 s and the session stays paused for 4 s (once, a session paused for
/// more than ten minutes could not be resumed).
async fn a_session_paused_longer_than_its_held_child_would_wait_comes_back(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    let short = "import sys\n\
                 _kbf = sys.modules['kernel_broker_fork']\n\
                 _kbf.HOLD_TIMEOUT, _kbf.HOLD_STEP = 2.0, 0.2\n\
                 x = 42";
    out(&api, &a, short).await;
    assert_eq!(pause(&api, &a).await.0, 200);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(out(&api, &a, "print(x)").await, "42");
    broker.stop().await;
}

/// The paused kernel ends after the pause's answer, holding its share of its user's memory
/// until it has: a resume asked at once, by a user whose memory fits one session and not
/// two, is admitted once that share is back (not refused as if two sessions ran).
async fn a_resume_right_after_the_pause_is_admitted_within_the_users_memory(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |a| {
        a.memory_limit = Some(400 << 20);
        a.session_memory_limit = Some(256 << 20);
    })
    .await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "x = 0").await;
    for i in 1..=4 {
        assert_eq!(pause(&api, &a).await.0, 200);
        let (status, v) = resume(&api, &a).await;
        assert_eq!(status, 200, "resume {i}: {v}");
        assert_eq!(out(&api, &a, "x += 1\nprint(x)").await, i.to_string());
    }
    broker.stop().await;
}

/// JupyterLab (or any Jupyter client) on a paused session's channels: its first message
/// (`kernel_info_request`, which every client sends on connecting) resumes the kernel, and
/// it answers with the state it was paused with.
async fn a_jupyter_client_on_a_paused_session_resumes_it(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "x = 41\nit = iter('abc'); next(it)").await;
    assert_eq!(pause(&api, &a).await.0, 200);

    let mut ws = jupyter_channels(&broker, &a, "lab-1").await;
    // Connected, not yet resumed: a connection alone uses no kernel.
    assert_eq!(state_of(&api, &a).await["state"], "paused");
    let info = jupyter_send(
        &mut ws,
        "lab-1",
        ("shell", "kernel_info_request"),
        json!({}),
    )
    .await;
    let reply = loop {
        let v = ws_next(&mut ws).await;
        if v["msg_type"] == "kernel_info_reply" {
            break v;
        }
    };
    assert_eq!(reply["parent_header"]["msg_id"], info.as_str());
    assert_eq!(reply["content"]["status"], "ok", "{reply}");
    assert_eq!(state_of(&api, &a).await["state"], "idle");
    assert_eq!(
        jupyter_print(&mut ws, "lab-1", "print(x + 1, next(it))").await,
        "42 b"
    );
    drop(ws);
    assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    broker.stop().await;
}

/// `kill -9` of the broker while a pause is under way, at points from before the dump to
/// after the answer (`--keep-sessions`, so that a running session outlives the broker
/// too): the next run has the session, paused or running, with everything its executions
/// were answered for; nothing of an unfinished pause is left on disk.
async fn a_broker_killed_mid_pause_loses_nothing_acknowledged(sandbox: &'static str) {
    use common::spawned::{SpawnedBroker, Stop};
    if !criu_ready() || sandbox != "local" {
        return;
    }
    let mut broker = SpawnedBroker::start(&["--keep-sessions"], None);
    let mut states = std::collections::BTreeSet::new();
    for (round, delay_ms) in [0u64, 15, 40, 80, 120, 180, 300, 2000]
        .into_iter()
        .enumerate()
    {
        // A kernel of this run's each round.
        let api = broker.api(ALICE);
        let a = own(&api).await;
        // Acknowledged: this execution's answer.
        let set =
            format!("import numpy as np\nv = np.arange(2_000_000)\nstep = {round}\nprint(step)");
        assert_eq!(out(&api, &a, &set).await, round.to_string());
        let url = format!("{}/v1/sessions/{a}/pause", api.base);
        let asked = api.http.post(url).bearer_auth(&api.token).json(&json!({}));
        // Its answer may never come: the broker is killed under it.
        let pausing = tokio::spawn(async move { asked.send().await.map(|r| r.status().as_u16()) });
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        let answered = pausing.is_finished();
        if answered {
            assert_eq!(pausing.await.unwrap().unwrap(), 200, "round {round}");
        } else {
            pausing.abort();
        }
        broker.restart(Stop::Kill).await;
        let api = broker.api(ALICE);
        let s = state_of(&api, &a).await;
        let state = s["state"].as_str().unwrap().to_string();
        assert!(state == "paused" || state == "idle", "round {round}: {s}");
        if answered {
            assert_eq!(state, "paused", "an answered pause stays done");
        }
        states.insert(state);
        // Everything acknowledged is there, whichever way the pause went.
        assert_eq!(
            out(&api, &a, "print(step, int(v.sum()))").await,
            format!("{round} 1999999000000"),
            "round {round} ({delay_ms} ms)"
        );
        // What an unfinished pause left is gone; a finished one's images went on resuming.
        assert!(
            paused_images(&broker.data_dir()).is_empty(),
            "round {round}"
        );
        assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    }
    // The last kill comes after the pause was answered.
    assert!(states.contains("paused"), "{states:?}");
    println!("states after the kills mid-pause: {states:?}");

    // And mid-resume: a paused session whose next execution is under way when the broker
    // is killed comes back paused or running, with its state.
    let mut states = std::collections::BTreeSet::new();
    for (round, delay_ms) in [0u64, 20, 50, 90, 140, 200, 2000].into_iter().enumerate() {
        let api = broker.api(ALICE);
        let a = own(&api).await;
        out(&api, &a, &format!("w = {round} * 1000")).await;
        assert_eq!(pause(&api, &a).await.0, 200);
        let url = format!("{}/v1/sessions/{a}/execute", api.base);
        let asked = api
            .http
            .post(url)
            .bearer_auth(&api.token)
            .json(&json!({"code": "w += 1"}));
        let resuming = tokio::spawn(async move { asked.send().await.map(|r| r.status().as_u16()) });
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        let answered = resuming.is_finished();
        resuming.abort();
        broker.restart(Stop::Kill).await;
        let api = broker.api(ALICE);
        let (status, s) = api.get(&format!("/v1/sessions/{a}")).await;
        if status != 200 {
            for l in broker.log_lines(&a) {
                println!("LOG {l}");
            }
            for l in broker.log_lines("adopt") {
                println!("LOG {l}");
            }
        }
        assert_eq!(status, 200, "round {round} ({delay_ms} ms): {s}");
        let state = s["state"].as_str().unwrap().to_string();
        assert!(state == "paused" || state == "idle", "round {round}: {s}");
        states.insert(state);
        let w = out(&api, &a, "print(w)").await;
        let before = (round * 1000).to_string();
        let after = (round * 1000 + 1).to_string();
        assert!(
            w == before || w == after,
            "round {round} ({delay_ms} ms): {w}"
        );
        if answered {
            assert_eq!(w, after, "an answered execution stays done");
        }
        assert_eq!(api.delete(&format!("/v1/sessions/{a}")).await.0, 204);
    }
    println!("states after the kills mid-resume: {states:?}");
    broker.halt(Stop::Term).await;
}

/// A session sharing its user's workspace (REST's default, every Jupyter kernel) pauses as
/// one with its own does; it resumes in a sandbox of its own over the user's workspace,
/// with its state (files open in the workspace at their positions), while the user's other
/// sessions go on in theirs.
async fn a_session_sharing_its_users_workspace_pauses_too(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = api.create().await;
    let other = api.create().await;
    out(&api, &a, STATE.replace("/home/user", "/workspace").as_str()).await;
    let who = out(&api, &a, WHO).await;
    let (status, v) = pause(&api, &a).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(state_of(&api, &a).await["state"], "paused");
    // The user's other session runs on meanwhile, and writes in the shared workspace.
    out(
        &api,
        &other,
        "open('/workspace/from-other.txt', 'w').write('hi')",
    )
    .await;
    let probe = api
        .execute(&a, &PROBE.replace("/home/user", "/workspace"))
        .await;
    assert_eq!(probe["status"], "ok", "{probe}");
    assert_eq!(
        probe["stdout"].as_str().unwrap().trim(),
        "41 6 42 line2 9 7 True /workspace/sub yes 4"
    );
    assert_eq!(
        out(&api, &a, "print(open('/workspace/from-other.txt').read())").await,
        "hi"
    );
    assert_eq!(out(&api, &a, WHO).await, who, "as confined as before");
    // A resumed kernel is no longer in its user's template: a fork of it is refused saying
    // so, and the session runs on.
    assert_eq!(out(&api, &a, "print(x)").await, "41");
    let (status, v) = api.post(&format!("/v1/sessions/{a}/fork"), json!({})).await;
    assert_eq!(
        (status, &v["error"]["code"]),
        (409, &json!("fork_refused")),
        "{v}"
    );
    assert_eq!(out(&api, &a, "print(x)").await, "41");
    // Paused again from where it was resumed, and through Jupyter's channels back again.
    {
        let (st, v) = pause(&api, &a).await;
        assert_eq!(st, 200, "{v}");
    }
    let mut ws = jupyter_channels(&broker, &a, "lab-1").await;
    assert_eq!(
        jupyter_print(&mut ws, "lab-1", "print(x, next(g))").await,
        "41 16"
    );
    drop(ws);
    assert!(paused_images(&broker.data_dir).is_empty());
    broker.stop().await;
}

/// A broker without a capability it hands CRIU (a container started without
/// `CAP_CHECKPOINT_RESTORE`, as Docker Engine before 23.0 must be): a pause and a fork of a
/// session with a workspace of its own are refused with `409`, naming what is missing and
/// how to add it, and the session runs on with its state.
#[tokio::test]
async fn a_broker_without_checkpoint_restore_refuses_pauses_saying_why() {
    if !criu_ready() {
        return;
    }
    // nextest runs each test in a process of its own: the capability dropped from this
    // process's bounding set is missing in the broker it starts (root's permitted set at
    // exec is the bounding set), and in no other test's.
    if std::env::var("NEXTEST_EXECUTION_MODE").as_deref() != Ok("process-per-test") {
        eprintln!("skipped: needs nextest's process per test");
        return;
    }
    const CAP_CHECKPOINT_RESTORE: libc::c_ulong = 40;
    // SAFETY: prctl with integer arguments only.
    let dropped = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, CAP_CHECKPOINT_RESTORE, 0, 0, 0) };
    assert_eq!(dropped, 0, "{}", std::io::Error::last_os_error());
    let broker = common::spawned::SpawnedBroker::start(&[], None);
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "kept = 5").await;
    let (status, v) = pause(&api, &a).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("pause_refused")),
        "{v}"
    );
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("CAP_CHECKPOINT_RESTORE")
            && message.contains("--cap-add CHECKPOINT_RESTORE"),
        "{v}"
    );
    assert!(
        !message.contains("CAP_SYS_PTRACE ("),
        "only what is missing is named: {v}"
    );
    let (status, v) = api.post(&format!("/v1/sessions/{a}/fork"), json!({})).await;
    assert_eq!(status, 409, "{v}");
    assert!(v.to_string().contains("CAP_CHECKPOINT_RESTORE"), "{v}");
    assert_eq!(out(&api, &a, "print(kept)").await, "5");
    assert_eq!(state_of(&api, &a).await["state"], "idle");
    broker.stop().await;
}

/// A thread of the kernel that stops (SIGSTOP) every child the kernel has, over and over,
/// stops the held child a pause forks as well, before it can say it is held and while
/// CRIU dumps it. The kernel continues its child until it answers (it waited 30 s for a
/// stopped one before), and CRIU, interrupted, fails: the pause is refused at once and
/// clearly, and the session runs on with its state. (Were it to succeed, the resume must
/// bring the state back.)
async fn a_kernel_that_stops_its_own_children_never_stalls_a_pause(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(
        &api,
        &a,
        "import os, signal, threading\n\
         x = 42\n\
         def stop_children():\n\
         \x20   me = os.getpid()\n\
         \x20   while True:\n\
         \x20       for t in os.listdir(f'/proc/{me}/task'):\n\
         \x20           try:\n\
         \x20               for c in open(f'/proc/{me}/task/{t}/children').read().split():\n\
         \x20                   os.kill(int(c), signal.SIGSTOP)\n\
         \x20           except OSError:\n\
         \x20               pass\n\
         threading.Thread(target=stop_children, daemon=True).start()",
    )
    .await;
    let started = std::time::Instant::now();
    let (status, v) = pause(&api, &a).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the pause took {:?}: {v}",
        started.elapsed()
    );
    match status {
        200 => {}
        502 => {
            assert_eq!(v["error"]["code"], "pause_failed", "{v}");
            assert!(
                v["error"]["message"].as_str().unwrap().contains("CRIU"),
                "{v}"
            );
            assert_eq!(state_of(&api, &a).await["state"], "idle");
        }
        _ => panic!("the pause answered {status}: {v}"),
    }
    assert_eq!(out(&api, &a, "print(x)").await, "42");
    broker.stop().await;
}
