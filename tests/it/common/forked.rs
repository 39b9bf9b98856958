//! What the fork-server tests of both backends check the same way: a cell's output, the
//! host's view of a process (its parent, its descriptors) and a forked kernel's namespace.

use super::Api;

/// The kernel's cgroup directory in the host's `pids` hierarchy (v1) or the v2 tree, read
/// from inside the kernel (Docker on cgroup v1 shares the host's cgroup namespace).
pub async fn kernel_leaf_dir(api: &Api, id: &str) -> std::path::PathBuf {
    let text = out(api, id, "print(open('/proc/self/cgroup').read())").await;
    let v1 = text
        .lines()
        .find_map(|l| l.split_once(":pids:").map(|(_, p)| p.to_string()));
    match v1 {
        Some(path) => {
            std::path::Path::new("/sys/fs/cgroup/pids").join(path.trim_start_matches('/'))
        }
        None => {
            let path = text.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
            std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'))
        }
    }
}

/// The first process of the cgroup directory `dir` (a kernel's leaf: the kernel).
pub fn first_process(dir: &std::path::Path) -> i32 {
    let procs = dir.join("cgroup.procs");
    let text = std::fs::read_to_string(&procs).unwrap_or_else(|e| panic!("{procs:?}: {e}"));
    text.lines().next().unwrap().trim().parse().unwrap()
}

/// Starts `code` in session `id` and returns once the session is busy with it; the task
/// ends with the execution.
pub async fn busy_with(
    api: &Api,
    id: &str,
    code: &str,
) -> tokio::task::JoinHandle<serde_json::Value> {
    let running = {
        let api = Api {
            http: api.http.clone(),
            base: api.base.clone(),
            token: api.token.clone(),
        };
        let (id, code) = (id.to_string(), code.to_string());
        tokio::spawn(async move { api.execute(&id, &code).await })
    };
    let (_, mut info) = api.get(&format!("/v1/sessions/{id}")).await;
    while info["state"] != "busy" {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        info = api.get(&format!("/v1/sessions/{id}")).await.1;
    }
    running
}

/// The text a cell printed (its stdout), trimmed.
pub async fn out(api: &Api, id: &str, code: &str) -> String {
    let v = api.execute(id, code).await;
    assert_eq!(v["status"], "ok", "{code}: {v}");
    v["stdout"].as_str().unwrap_or_default().trim().to_string()
}

pub fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}

pub fn link(pid: i32, fd: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// What the descriptors of `pid` point to (pipes and sockets by inode).
pub fn links(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| link(pid, &e.file_name().to_string_lossy()))
        .filter(|l| l.starts_with("pipe:") || l.starts_with("socket:"))
        .collect()
}

/// The user's namespace of session `id` is a fresh kernel's, the data stack is already in
/// `sys.modules`, and the inline backend works as in a fresh kernel: a chart arrives as PNG.
pub async fn clean_namespace_with_the_stack(api: &Api, id: &str) {
    let names = out(
        api,
        id,
        "print(sorted(k for k in dir() if not k.startswith('_')))",
    )
    .await;
    assert_eq!(
        names,
        "['In', 'Out', 'exit', 'get_ipython', 'open', 'quit']"
    );
    let who = api.execute(id, "%who").await;
    assert_eq!(
        who["stdout"].as_str().unwrap().trim(),
        "Interactive namespace is empty."
    );
    let loaded = out(
        api,
        id,
        "import sys; print(all(m in sys.modules for m in ('numpy', 'pandas', 'matplotlib.pyplot')))",
    )
    .await;
    assert_eq!(loaded, "True");
    let v = api
        .execute(
            id,
            "import matplotlib.pyplot as plt\nplt.plot(range(100))\nplt.show()",
        )
        .await;
    let png = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|o| o["data"]["image/png"].as_str())
        .unwrap_or_else(|| panic!("no chart: {v}"));
    assert!(png.starts_with("iVBORw0KGgo"), "{png:.20}");
}

/// A forked kernel of session `id` cannot open its template's (pid `template` in the
/// sandbox) control channel through /proc, since the template is non-dumpable; being the
/// same uid, it may kill it, and then ends with it (`ok` or `dead`).
pub async fn kernel_attacks_its_template(api: &Api, id: &str, template: impl std::fmt::Display) {
    let attack = out(
        api,
        id,
        &format!(
            "import os\nfor fd in ('0', '1', '3'):\n    try:\n        os.open('/proc/{template}/fd/' + fd, os.O_WRONLY)\n        print('opened', fd)\n    except OSError as e:\n        print('refused', e.errno)"
        ),
    )
    .await;
    assert!(!attack.contains("opened"), "{attack}");
    let v = api
        .execute(
            id,
            &format!("import os, signal; os.kill({template}, signal.SIGKILL)"),
        )
        .await;
    assert!(matches!(v["status"].as_str(), Some("ok" | "dead")), "{v}");
}

/// Issue 32, attack 6: a forked kernel's import path held its template's runtime directory
/// (the boot script's directory, `sys.path[0]`), which the kernel can write and the files
/// API does not show: a module planted there ran in the user's later sessions. Session
/// `attacker` plants a module in that directory and in every other directory on its
/// `sys.path` it can write but the workspace; session `next`, forked from the same
/// template, must not import it, and every entry of its path but the workspace's must be
/// one it cannot write.
///
/// The places tried also include the directory of the script its parent (the template)
/// runs. `writable_runtime_dir`: the backend gives the kernel a writable `/run/kernel` (the
/// local template's runtime directory; Docker's is the broker's), so the attacker must
/// have planted something there.
pub async fn planted_modules_reach_no_later_session(
    api: &Api,
    attacker: &str,
    next: &str,
    writable_runtime_dir: bool,
) {
    let planted = out(
        api,
        attacker,
        "import os, sys\n\
         places = {'/run/kernel'} | {p for p in sys.path if p and os.path.isdir(p)}\n\
         argv = open('/proc/%d/cmdline' % os.getppid(), 'rb').read().decode().split('\\0')\n\
         places |= {os.path.dirname(a) for a in argv if a.endswith('.py')}\n\
         done = []\n\
         for d in sorted(places):\n\
         \x20   if d in ('', '.') or os.path.realpath(d).startswith('/workspace'):\n\
         \x20       continue\n\
         \x20   try:\n\
         \x20       open(os.path.join(d, 'kb_planted_probe.py'), 'w').write('PLANTED = True\\n')\n\
         \x20       done.append(d)\n\
         \x20   except OSError:\n\
         \x20       pass\n\
         print(done)",
    )
    .await;
    assert!(
        !writable_runtime_dir || planted.contains("/run/kernel"),
        "the attacker could not even plant in its runtime directory: {planted}"
    );
    let imported = out(
        api,
        next,
        "try:\n    import kb_planted_probe\n    print('imported', kb_planted_probe.__file__)\n\
         except ModuleNotFoundError:\n    print('not found')",
    )
    .await;
    assert_eq!(imported, "not found", "planted in {planted}");
    let writable = out(
        api,
        next,
        "import os, sys\n\
         print([p for p in sys.path if p not in ('', '.') and not os.path.realpath(p).startswith('/workspace') and os.access(p or '.', os.W_OK)])",
    )
    .await;
    assert_eq!(writable, "[]", "writable directories on the import path");
}

/// A bounded fork bomb in the kernel of session `id`, under the broker's default limits:
/// the kernel forks children that sleep, then exit, until `fork` fails. It must fail with
/// `EAGAIN` (`BlockingIOError`: the pids limit) and not run the kernel out of memory first,
/// and the kernel must survive with its variables. Returns how many children it forked.
pub async fn a_fork_bomb_meets_the_pids_limit(api: &Api, id: &str) -> u64 {
    out(api, id, "before_the_bomb = 41").await;
    let code = "import os, time\n\
                pids, err, t0 = [], None, time.time()\n\
                try:\n\
                \x20   while time.time() - t0 < 30 and len(pids) < 2000:\n\
                \x20       pid = os.fork()\n\
                \x20       if pid == 0:\n\
                \x20           time.sleep(30); os._exit(0)\n\
                \x20       pids.append(pid)\n\
                except OSError as e:\n\
                \x20   err = e\n\
                for p in pids: os.kill(p, 9)\n\
                for p in pids: os.waitpid(p, 0)\n\
                print(len(pids), type(err).__name__)";
    let x = api
        .execute_with(
            id,
            serde_json::json!({"code": code, "timeout_seconds": 120}),
        )
        .await;
    assert_eq!(x["status"], "ok", "the bomb ended the kernel: {x}");
    let stdout = x["stdout"].as_str().unwrap_or_default().trim().to_string();
    let (n, err) = stdout.split_once(' ').unwrap_or_else(|| panic!("{x}"));
    assert_eq!(err, "BlockingIOError", "{x}");
    let n: u64 = n.parse().unwrap();
    let limit = kernel_broker::sandbox::DEFAULT_SESSION_PIDS;
    assert!(n < limit, "forked {n} under a pids limit of {limit}");
    // The kernel's own threads take some of the limit, the rest is the user's.
    assert!(
        n >= limit / 2,
        "only {n} children under a pids limit of {limit}"
    );
    assert_eq!(out(api, id, "print(before_the_bomb + 1)").await, "42");
    n
}
