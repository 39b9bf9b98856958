//! Forks of a session with a workspace of its own (issue 36): the kernel is copied with
//! CRIU into a sandbox of its own with a copy of the workspace (`sandbox/local/copy.rs`,
//! `sandbox/docker/copy.rs`: a container of its own). Both backends, as root, real kernels
//! and a real CRIU 4 (`scripts/setup-criu`); with `KB_REQUIRE_CRIU=1` (CI) a missing CRIU
//! fails these tests instead of skipping them.

use crate::common;

use common::forked::out;
use common::*;
use serde_json::{json, Value};

async fn own(api: &Api) -> String {
    let (status, v) = api.post("/v1/sessions", json!({"workspace": "own"})).await;
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn fork(api: &Api, id: &str, count: u64) -> (u16, Value) {
    api.post(
        &format!("/v1/sessions/{id}/fork"),
        json!({ "count": count }),
    )
    .await
}

async fn forked(api: &Api, id: &str) -> String {
    let (status, v) = fork(api, id, 1).await;
    assert_eq!(status, 201, "{v}");
    v["sessions"][0]["id"].as_str().unwrap().to_string()
}

const STATE: &str = r#"
import os, random
x = 41
def f(a):
    return a * 2
os.makedirs('/home/user/sub', exist_ok=True)
with open('/home/user/data.txt', 'w') as w:
    w.write(''.join('line%d\n' % i for i in range(10)))
with open('/tmp/scratch.txt', 'w') as w:
    w.write('scratch')
fh = open('/home/user/data.txt')
fh.readline(); fh.readline()
g = (i * i for i in range(100))
next(g); next(g); next(g)
random.seed(1234)
random.random()
os.chdir('/home/user/sub')
os.environ['FORK_TEST'] = 'yes'
os.symlink('/etc/shadow', '/home/user/host-link')
"#;

const PROBE: &str = "print(x, f(3), fh.readline().strip(), next(g), random.random(), \
                     os.getcwd(), os.environ['FORK_TEST'], len(In))";

const WHO: &str = "st = {l.split(':')[0]: l.split(':')[1].strip() for l in open('/proc/self/status')}\n\
                   print(os.getuid(), st['CapEff'], st['CapPrm'], st['CapBnd'], st['NoNewPrivs'], st['Seccomp'])";

crate::on_both_backends!(
    a_fork_of_a_session_with_its_own_workspace_gets_a_copy_of_it,
    checkpoints_of_a_session_with_its_own_workspace_hold_its_files,
    a_kernel_that_lies_about_its_held_fork_gets_nothing_copied,
    a_copy_without_room_for_its_images_is_refused_and_nothing_is_made,
);

/// Where a backend keeps the own workspaces and the copies' images, in the data directory.
fn dirs(sandbox: &str) -> (&'static str, &'static str) {
    match sandbox {
        "docker" => ("sandboxes-docker", "copies-docker"),
        _ => ("sandboxes", "copies"),
    }
}

/// The host processes running CRIU's restore for session `id` (in its cgroup leaf): each
/// one's `/proc/<pid>/status`.
fn restores_of(id: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let args = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        // Run by descriptor (directly, or through the host's loader): its arguments say
        // what it is; those of the helpers that start it (nsenter, bwrap, setpriv) hold
        // CRIU's after a `--`.
        let args: Vec<&[u8]> = args.split(|b| *b == 0).collect();
        let at = |word: &[u8]| args.iter().position(|a| *a == word);
        let restoring = match (at(b"restore"), at(b"--")) {
            (Some(r), Some(d)) => r < d,
            (Some(_), None) => true,
            _ => false,
        } && at(b"--unprivileged").is_some();
        let in_leaf =
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(id));
        if restoring && in_leaf {
            if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
                found.push(status);
            }
        }
    }
    found
}

async fn a_fork_of_a_session_with_its_own_workspace_gets_a_copy_of_it(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let (sandboxes, copies) = dirs(sandbox);
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    let setup = api.execute(&a, STATE).await;
    assert_eq!(setup["status"], "ok", "{setup}");
    let who_a = out(&api, &a, WHO).await;

    let started = std::time::Instant::now();
    let b = forked(&api, &a).await;
    eprintln!(
        "fork of an own workspace: {} ms",
        started.elapsed().as_millis()
    );
    // The fork first, then the original: the same state, the same next values.
    let in_b = api.execute(&b, PROBE).await;
    let in_a = api.execute(&a, PROBE).await;
    assert_eq!(in_b["status"], "ok", "{in_b}");
    assert_eq!(in_b["stdout"], in_a["stdout"], "{in_b} / {in_a}");
    assert_eq!(in_b["execution_count"], in_a["execution_count"]);
    let line = in_a["stdout"].as_str().unwrap().trim().to_string();
    assert!(line.starts_with("41 6 line2 9 "), "{line}");
    assert!(line.contains("/home/user/sub yes"), "{line}");
    // The copy is as confined as the original: the kernel's uid, no capabilities,
    // no_new_privs, its syscall filter (restored by CRIU, not dropped).
    assert_eq!(out(&api, &b, WHO).await, who_a);
    assert!(
        who_a.ends_with(" 0000000000000000 0000000000000000 0000000000000000 1 2"),
        "{who_a}"
    );

    // The copy took the tenant's symlink as a symlink, never following it.
    assert_eq!(
        out(
            &api,
            &b,
            "print(os.path.islink('/home/user/host-link'), os.readlink('/home/user/host-link'))"
        )
        .await,
        "True /etc/shadow"
    );
    // CRIU, which waits for the copy in its sandbox (in the copy's cgroup leaf), runs as
    // the kernel's uid with the two capabilities a restore needs and nothing else,
    // no_new_privs.
    let criu = restores_of(&b);
    assert_eq!(criu.len(), 1, "{criu:?}");
    let field = |name: &str| {
        criu[0]
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap()
            .trim()
            .to_string()
    };
    let uid = who_a.split(' ').next().unwrap().to_string();
    assert_eq!(field("Uid"), format!("{uid}\t{uid}\t{uid}\t{uid}"));
    // CAP_SETPCAP (8) and CAP_CHECKPOINT_RESTORE (40).
    assert_eq!(field("CapEff"), "0000010000000100");
    assert_eq!(field("CapBnd"), "0000010000000100");
    assert_eq!(field("NoNewPrivs"), "1");
    // The copy holds no descriptor of the programs that made it (the host's loader and
    // library directories, CRIU's images), only its own files.
    let fds = out(
        &api,
        &b,
        "import os\nfds = os.listdir('/proc/self/fd')\nls = []\nfor d in fds:\n    try: ls.append(os.readlink('/proc/self/fd/' + d))\n    except OSError: pass\nprint(sorted(l for l in ls if l.startswith('/')))",
    )
    .await;
    assert!(
        !fds.contains("/usr/") && !fds.contains("/lib") && !fds.contains("copies"),
        "{fds}"
    );
    if sandbox == "docker" {
        // Its own /proc hides what Docker hides from a container: each masked path there
        // is covered (the host's timers and their tasks' names, keys), /proc/sys read-only.
        let mounts = out(
            &api,
            &b,
            "print(' '.join(l.split()[4] + ':' + l.split()[5].split(',')[0] for l in open('/proc/self/mountinfo') if l.split()[4].startswith('/proc/')))",
        )
        .await;
        for (path, mode) in [
            ("/proc/keys", "ro"),
            ("/proc/sys", "ro"),
            ("/proc/acpi", "ro"),
        ] {
            if std::path::Path::new(path).exists() {
                assert!(
                    mounts.contains(&format!("{path}:{mode}")),
                    "{path}: {mounts}"
                );
            }
        }
    }

    // E2B's flow: the fork reads the file as it was; what the fork writes stays its own.
    assert_eq!(
        out(&api, &b, "print(open('/home/user/data.txt').read().count('line'), open('/tmp/scratch.txt').read())").await,
        "10 scratch"
    );
    out(
        &api,
        &b,
        "open('/home/user/data.txt', 'w').write('changed in the fork'); open('/home/user/new.txt', 'w').write('n')",
    )
    .await;
    assert_eq!(
        out(&api, &a, "print(open('/home/user/data.txt').read().count('line'), os.path.exists('/home/user/new.txt'))").await,
        "10 False"
    );
    // The original's open file is the original's: it reads on from where it was.
    assert_eq!(out(&api, &a, "print(fh.readline().strip())").await, "line3");
    out(
        &api,
        &a,
        "open('/home/user/data.txt', 'a').write('more\\n')",
    )
    .await;
    assert_eq!(
        out(&api, &b, "print(open('/home/user/data.txt').read())").await,
        "changed in the fork"
    );
    // The files API sees the fork's own workspace too.
    let (status, listed) = api.get(&format!("/v1/sessions/{b}/files")).await;
    assert_eq!(status, 200, "{listed}");
    assert!(listed.to_string().contains("new.txt"), "{listed}");

    // A fork of the fork, and two at once.
    let c = forked(&api, &b).await;
    assert_eq!(
        out(&api, &c, "print(x, open('/home/user/new.txt').read())").await,
        "41 n"
    );
    let (status, two) = fork(&api, &a, 2).await;
    assert_eq!(status, 201, "{two}");
    for s in two["sessions"].as_array().unwrap() {
        let id = s["id"].as_str().unwrap();
        assert_eq!(out(&api, id, "print(x + 1)").await, "42");
    }
    // Interrupting a copy reaches its kernel (not CRIU, its sandbox's command).
    let running = {
        let api = broker.api(ALICE);
        let c = c.clone();
        tokio::spawn(async move { api.execute(&c, "import time; time.sleep(30)").await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (status, _) = api
        .post(&format!("/v1/sessions/{c}/interrupt"), json!({}))
        .await;
    assert!(status < 300, "{status}");
    let interrupted = running.await.unwrap();
    assert_eq!(interrupted["status"], "interrupted", "{interrupted}");
    assert_eq!(out(&api, &c, "print(x)").await, "41");

    // A file the kernel itself cannot read (mode 0): the copy, as the kernel's uid, fails,
    // saying so, and leaves nothing.
    let data = broker.data_dir.clone();
    let before = std::fs::read_dir(data.join(sandboxes)).unwrap().count();
    out(
        &api,
        &a,
        "open('/home/user/locked', 'w').write('x'); os.chmod('/home/user/locked', 0)",
    )
    .await;
    let (status, v) = fork(&api, &a, 1).await;
    assert_eq!(status, 502, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        (message.contains("could not be copied") || message.contains("could not be read"))
            && message.contains("locked"),
        "{v}"
    );
    assert_eq!(
        std::fs::read_dir(data.join(sandboxes)).unwrap().count(),
        before
    );
    out(&api, &a, "os.remove('/home/user/locked')").await;

    // Ending a fork removes its workspace, and nothing of the copies stays.
    for id in [&b, &c] {
        assert_eq!(api.delete(&format!("/v1/sessions/{id}")).await.0, 204);
        assert!(!data.join(sandboxes).join(id).exists(), "{id}");
    }
    let copies: Vec<_> = std::fs::read_dir(data.join(copies))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(copies.is_empty(), "{copies:?}");
    assert_eq!(out(&api, &a, "print(x)").await, "41");
    broker.stop().await;
}

/// A kernel that answers a hold request with a pid that is not its held child (its own,
/// pid 1, another user's kernel, garbage) gets nothing dumped or restored, and nothing of
/// the fork is left: no session, no workspace, no copy.
async fn a_kernel_that_lies_about_its_held_fork_gets_nothing_copied(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let (sandboxes, copies) = dirs(sandbox);
    // What a broker killed mid-copy left (a kernel's memory, in its images) goes at the
    // next start.
    let broker = Broker::start(sandbox, |a| {
        let left = a
            .data_dir
            .clone()
            .unwrap()
            .join(copies)
            .join("left-by-a-crash");
        std::fs::create_dir_all(&left).unwrap();
        std::fs::write(left.join("pages-1.img"), b"a kernel's memory").unwrap();
    })
    .await;
    let (alice, bob) = (broker.api(ALICE), broker.api(BOB));
    let a = own(&alice).await;
    let other = own(&bob).await;
    let bob_pid = out(&bob, &other, "import os; print(os.getpid())").await;
    let handler = |reply: &str| {
        format!(
            "import os\n\
             _k = get_ipython().kernel\n\
             def _hostile(stream, ident, parent):\n\
             \x20   _k.session.send(stream, 'kb_fork_reply', {reply}, parent, ident=ident)\n\
             _k.shell_handlers['kb_fork_request'] = _hostile\n"
        )
    };
    for reply in [
        "{'status': 'ok', 'pid': os.getpid()}".to_string(),
        "{'status': 'ok', 'pid': 1}".to_string(),
        format!("{{'status': 'ok', 'pid': {bob_pid}}}"),
        "{'status': 'ok', 'pid': 99999}".to_string(),
        "{'status': 'ok', 'pid': 'x'}".to_string(),
    ] {
        out(&alice, &a, &handler(&reply)).await;
        let (status, v) = fork(&alice, &a, 1).await;
        assert_eq!(status, 502, "{reply}: {v}");
        let (_, list) = alice.get("/v1/sessions").await;
        assert_eq!(list.as_array().unwrap().len(), 1, "{reply}: {list}");
    }
    // A real child of the kernel, not held: one that keeps the kernel's sockets makes
    // CRIU refuse the dump, saying so; one that holds nothing is dumped and restored, and
    // the wake signal ends it (its default action), so the fork never becomes ready. The
    // kernel answers once its child has set itself up (as a real held child does): a dump
    // begun before the child put 0-2 on the sandbox's /dev/null would find the kernel's.
    for (keep, needle) in [
        ("False", "CRIU could not dump"),
        ("True", "did not become ready"),
    ] {
        out(
            &alice,
            &a,
            &format!(
                "import os, time\n\
                 def _child(stream, ident, parent):\n\
                 \x20   r, w = os.pipe()\n\
                 \x20   pid = os.fork()\n\
                 \x20   if pid == 0:\n\
                 \x20       os.setsid()\n\
                 \x20       if {keep}:\n\
                 \x20           n = os.open('/dev/null', os.O_RDWR)\n\
                 \x20           [os.dup2(n, i) for i in (0, 1, 2)]\n\
                 \x20           os.closerange(3, w); os.closerange(w + 1, 65536)\n\
                 \x20       os.write(w, b'x'); os.close(w)\n\
                 \x20       time.sleep(60)\n\
                 \x20       os._exit(0)\n\
                 \x20   os.close(w); os.read(r, 1); os.close(r)\n\
                 \x20   _k.session.send(stream, 'kb_fork_reply', {{'status': 'ok', 'pid': pid}}, parent, ident=ident)\n\
                 _k.shell_handlers['kb_fork_request'] = _child\n"
            ),
        )
        .await;
        let (status, v) = fork(&alice, &a, 1).await;
        assert_eq!(status, 502, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{v}");
        eprintln!("a child of the kernel named: {message}");
        let (_, list) = alice.get("/v1/sessions").await;
        assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    }
    let data = broker.data_dir.clone();
    let left: Vec<_> = std::fs::read_dir(data.join(sandboxes))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    let copies: Vec<_> = std::fs::read_dir(data.join(copies))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(copies.is_empty(), "{copies:?}");
    // The original goes on.
    assert_eq!(out(&alice, &a, "print(1 + 1)").await, "2");
    broker.stop().await;
}

/// A copy's images hold its kernel's memory on the broker's data file system until the
/// copy is restored: a fork or a checkpoint that would leave that file system with less
/// than `--copy-reserve-bytes` free is refused `507` before anything is made (no session,
/// no workspace, no images), saying what it needed; the original goes on.
async fn a_copy_without_room_for_its_images_is_refused_and_nothing_is_made(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let (sandboxes, copies) = dirs(sandbox);
    // More than any file system here has free: every copy is refused.
    let broker = Broker::start(sandbox, |a| a.copy_reserve_bytes = Some(1 << 62)).await;
    let api = broker.api(ALICE);
    let a = own(&api).await;
    out(&api, &a, "block = bytearray(64 << 20)\nx = 1").await;
    let data = broker.data_dir.clone();
    let workspaces = own_workspaces(&data, sandboxes);
    for path in [
        format!("/v1/sessions/{a}/fork"),
        format!("/v1/sessions/{a}/checkpoints"),
    ] {
        let (status, v) = api.post(&path, json!({})).await;
        assert_eq!(status, 507, "{path}: {v}");
        assert_eq!(v["error"]["code"], "insufficient_storage", "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        // The kernel's 64 MiB block is in what its images would need.
        let need: u64 = message
            .split("need about ")
            .nth(1)
            .and_then(|m| m.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{message}"));
        assert!(need > 64, "{message}");
        assert!(message.contains("--copy-reserve-bytes"), "{message}");
    }
    let (_, list) = api.get("/v1/sessions").await;
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    let (_, listed) = api.get(&format!("/v1/sessions/{a}/checkpoints")).await;
    assert_eq!(
        listed["checkpoints"].as_array().map(Vec::len),
        Some(0),
        "{listed}"
    );
    assert_eq!(own_workspaces(&data, sandboxes), workspaces);
    let images: Vec<_> = std::fs::read_dir(data.join(copies))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(images.is_empty(), "{images:?}");
    assert_eq!(out(&api, &a, "print(x, len(block))").await, "1 67108864");
    broker.stop().await;
}

/// `POST /v1/sessions/{id}/rewind` to checkpoint `cp`.
async fn rewind(api: &Api, id: &str, cp: &str) -> (u16, Value) {
    api.post(
        &format!("/v1/sessions/{id}/rewind"),
        json!({ "checkpoint": cp }),
    )
    .await
}

/// The names in the own workspaces' directory `sandboxes` of `data`, sorted.
fn own_workspaces(data: &std::path::Path, sandboxes: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(data.join(sandboxes))
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A checkpoint of a session with a workspace of its own holds the kernel and the files: a
/// rewind after a destructive cell (a variable deleted, a file changed, a directory
/// removed) brings both back, a fork of the checkpoint starts from both, and a dropped
/// checkpoint takes its copy of the files with it.
async fn checkpoints_of_a_session_with_its_own_workspace_hold_its_files(sandbox: &'static str) {
    if !criu_ready() {
        return;
    }
    let (sandboxes, _) = dirs(sandbox);
    let broker = Broker::start(sandbox, |_| {}).await;
    let api = broker.api(ALICE);
    let data = broker.data_dir.clone();
    let a = own(&api).await;
    out(
        &api,
        &a,
        "import os, shutil\nrows = [1, 2, 3]\nopen('/home/user/f.txt', 'w').write('v1')\n\
         os.makedirs('/home/user/d', exist_ok=True)\nopen('/home/user/d/keep.txt', 'w').write('k')",
    )
    .await;
    let (status, cp) = api
        .post(&format!("/v1/sessions/{a}/checkpoints"), json!({}))
        .await;
    assert_eq!(status, 201, "{cp}");
    let cp = cp["id"].as_str().unwrap().to_string();
    // The checkpoint's copy of the files, beside the session's.
    assert_eq!(own_workspaces(&data, sandboxes), {
        let mut v = vec![a.clone(), cp.clone()];
        v.sort();
        v
    });
    out(
        &api,
        &a,
        "del rows\nopen('/home/user/f.txt', 'w').write('v2')\nshutil.rmtree('/home/user/d')\n\
         open('/home/user/after.txt', 'w').write('a')",
    )
    .await;
    let (status, listed) = api.get(&format!("/v1/sessions/{a}/checkpoints")).await;
    assert_eq!(status, 200, "{listed}");
    assert!(
        listed["checkpoints"][0]["memory_bytes"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "{listed}"
    );

    let (status, v) = rewind(&api, &a, &cp).await;
    assert_eq!(status, 200, "{v}");
    let probe =
        "print(rows, open('/home/user/f.txt').read(), open('/home/user/d/keep.txt').read(), \
                 os.path.exists('/home/user/after.txt'))";
    assert_eq!(out(&api, &a, probe).await, "[1, 2, 3] v1 k False");
    // Again, after more changes: the checkpoint is still as it was.
    out(
        &api,
        &a,
        "rows.append(4)\nopen('/home/user/f.txt', 'w').write('v3')",
    )
    .await;
    let (status, v) = rewind(&api, &a, &cp).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(out(&api, &a, probe).await, "[1, 2, 3] v1 k False");

    // A rewind that fails (a directory the kernel itself cannot empty) leaves the session
    // its kernel and its workspace: not removed as a failed fork's would be.
    out(
        &api,
        &a,
        "os.makedirs('/home/user/ro/x', exist_ok=True)\nos.chmod('/home/user/ro', 0o500)\nafter = 1",
    )
    .await;
    let (status, v) = rewind(&api, &a, &cp).await;
    assert_eq!(status, 502, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("cannot write the directory"), "{v}");
    // Nothing of it was touched: its files are all there, its kernel the same.
    assert_eq!(
        out(
            &api,
            &a,
            "print(after, os.path.isdir('/home/user/ro/x'), open('/home/user/f.txt').read())"
        )
        .await,
        "1 True v1"
    );
    assert!(own_workspaces(&data, sandboxes).contains(&a));
    out(&api, &a, "os.chmod('/home/user/ro', 0o700)").await;

    // A fork of the checkpoint: a new session with the checkpoint's kernel and files.
    let (status, v) = api
        .post(
            &format!("/v1/sessions/{a}/checkpoints/{cp}/fork"),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    let f = v["sessions"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(out(&api, &f, probe).await, "[1, 2, 3] v1 k False");
    out(
        &api,
        &f,
        "open('/home/user/f.txt', 'w').write('in the fork')",
    )
    .await;
    assert_eq!(
        out(&api, &a, "print(open('/home/user/f.txt').read())").await,
        "v1"
    );

    // Dropping the checkpoint removes its copy; ending the sessions removes theirs.
    let (status, _) = api
        .delete(&format!("/v1/sessions/{a}/checkpoints/{cp}"))
        .await;
    assert_eq!(status, 204);
    assert!(!own_workspaces(&data, sandboxes).contains(&cp));
    for id in [&f, &a] {
        assert_eq!(api.delete(&format!("/v1/sessions/{id}")).await.0, 204);
    }
    assert_eq!(own_workspaces(&data, sandboxes), Vec::<String>::new());
    broker.stop().await;
}
