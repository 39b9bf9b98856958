//! Forking a live session (issue 36, `POST /v1/sessions/{id}/fork`), local sandbox, real
//! kernels forked from their user's template: the forks carry the kernel's state and then go
//! their own way, are ordinary sessions with a cgroup leaf of their own, count against the
//! quota as a whole, and a kernel that lies about its fork gets nothing adopted.

use crate::common;

use common::forked::out;
use common::*;
use serde_json::{json, Value};

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

/// `user`'s cgroup leaves (pids hierarchy), sorted.
fn leaves(broker: &Broker, user: &str) -> Vec<String> {
    let dir = pids_cgroup_base(broker.cgroup_name()).join(user);
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
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

#[tokio::test]
async fn a_fork_continues_as_the_original_would_and_then_goes_its_own_way() {
    let broker = Broker::start("local", forking).await;
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
    eprintln!("fork -> usable session: {fork_ms} ms");

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
