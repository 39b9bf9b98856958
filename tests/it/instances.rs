//! Brokers side by side (issue 11): a second broker on a data directory in use refuses to
//! start and names the running one; the running one is untouched.

use crate::common;

use std::time::Duration;

use common::spawned::SpawnedBroker;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_on_the_same_data_directory_is_refused() {
    let first = SpawnedBroker::start(&[], None);
    let api = first.api(ALICE);
    let id = api.create().await;
    assert_eq!(api.execute(&id, "x = 7").await["status"], "ok");

    let second = tokio::task::spawn_blocking({
        let data_dir = first.data_dir();
        let users = first.users_file();
        move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_kernel-broker"))
                .args(["serve", "--listen", "127.0.0.1:0"])
                .arg("--data-dir")
                .arg(&data_dir)
                .arg("--users-file")
                .arg(&users)
                .arg("--kernels-dir")
                .arg(repo().join("kernels"))
                .env_remove("KERNEL_BROKER_TOKEN")
                .output()
                .unwrap()
        }
    });
    let out = within(60, "the second broker to give up", second)
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("is in use by another kernel-broker"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("listening on {}", first.addr)),
        "{stderr}"
    );
    // The first broker and its session are untouched.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let v = api.execute(&id, "x * 6").await;
    assert_eq!(v["results"][0]["data"]["text/plain"], "42", "{v}");
    first.stop().await;
}

/// Two brokers with default settings and different data directories: the second one's
/// start-up sweep, its kernels and its shutdown leave the first one's kernels alone
/// (before, a starting broker killed every kernel under the shared `kernel-broker` cgroup).
async fn side_by_side(backend: &str) {
    let args: &[&str] = &["--sandbox", backend];
    let first = SpawnedBroker::start_with_defaults(args);
    let a = first.api(ALICE);
    let id = a.create().await;
    assert_eq!(a.execute(&id, "x = 7").await["status"], "ok");

    let second = SpawnedBroker::start_with_defaults(args);
    let b = second.api(ALICE);
    let other = b.create().await;
    let v = b.execute(&other, "y = 1").await;
    assert_eq!(v["status"], "ok", "{v}");
    // The first broker's session lived through the second's start.
    let v = a.execute(&id, "x * 6").await;
    assert_eq!(v["results"][0]["data"]["text/plain"], "42", "{v}");
    if backend == "local" {
        // Different uid ranges: the kernels of the two alices are different host users.
        assert_ne!(
            v_uid(&a, &id).await,
            v_uid(&b, &other).await,
            "both brokers' alices run as one host uid"
        );
    }
    // The second broker stops (shutting its kernels down); the first carries on.
    second.stop().await;
    let v = a.execute(&id, "x + 1").await;
    assert_eq!(v["results"][0]["data"]["text/plain"], "8", "{v}");
    first.stop().await;
}

async fn v_uid(api: &Api, id: &str) -> serde_json::Value {
    api.execute(id, "import os; os.getuid()").await["results"][0]["data"]["text/plain"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_brokers_side_by_side_leave_each_other_alone() {
    side_by_side("local").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_brokers_side_by_side_leave_each_other_alone() {
    docker_ready(); // fails, saying why, where Docker cannot run
    side_by_side("docker").await;
}

/// A broker with no users file and no `KERNEL_BROKER_TOKEN` makes its token once and keeps
/// it in its data directory: the next start on that directory uses the same token (open
/// browser tabs, MCP hosts' settings and `E2B_API_KEY` keep working), and
/// `kernel-broker token` prints it (issue 34).
#[tokio::test]
async fn a_generated_token_is_kept_across_restarts_and_printed_by_the_token_command() {
    let tmp = tempfile::tempdir().unwrap();
    let data_dir = tmp.path().join("data");
    let start = |data_dir: std::path::PathBuf| {
        tokio::task::spawn_blocking(move || {
            use std::io::BufRead;
            let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kernel-broker"))
                .args(["serve", "--listen", "127.0.0.1:0", "--pool-size", "0"])
                .arg("--data-dir")
                .arg(&data_dir)
                .arg("--kernels-dir")
                .arg(repo().join("kernels"))
                .env_remove("KERNEL_BROKER_TOKEN")
                .env("KERNEL_BROKER_LOG", "info")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
            let (mut said, mut token, mut addr) = (String::new(), None, None);
            for line in lines.by_ref().map_while(Result::ok) {
                said.push_str(&line);
                said.push('\n');
                if said.contains("the token of user 'default'") && token.is_none() {
                    if let Some(t) = line.strip_prefix("    ").filter(|t| !t.contains(' ')) {
                        token = Some(t.to_string());
                    }
                }
                if let Some(rest) = line.split("ready on http://").nth(1) {
                    addr = rest.split_whitespace().next().map(str::to_string);
                    break;
                }
            }
            // The rest of the log is not needed; keep the pipe drained.
            std::thread::spawn(move || lines.for_each(drop));
            (child, said, token, addr)
        })
    };
    let (mut first, said, token, addr) = within(60, "the first start", start(data_dir.clone()))
        .await
        .unwrap();
    let token = token.unwrap_or_else(|| panic!("no token printed:\n{said}"));
    assert!(said.contains("made now and kept in"), "{said}");
    let addr = addr.unwrap_or_else(|| panic!("not ready:\n{said}"));
    let api = Api {
        http: reqwest::Client::new(),
        base: format!("http://{addr}"),
        token: token.clone(),
    };
    assert_eq!(api.get("/v1/sessions").await.0, 200);
    // SAFETY: a plain signal to the child this test started.
    unsafe { libc::kill(first.id() as i32, libc::SIGTERM) };
    let _ = tokio::task::spawn_blocking(move || first.wait()).await;

    let (mut second, said, again, _) = within(60, "the second start", start(data_dir.clone()))
        .await
        .unwrap();
    assert_eq!(again.as_deref(), Some(token.as_str()), "{said}");
    assert!(said.contains("kept in"), "{said}");
    // SAFETY: as above.
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    let _ = tokio::task::spawn_blocking(move || second.wait()).await;

    let printed = std::process::Command::new(env!("CARGO_BIN_EXE_kernel-broker"))
        .arg("token")
        .arg("--data-dir")
        .arg(&data_dir)
        .output()
        .unwrap();
    assert!(printed.status.success());
    assert_eq!(String::from_utf8_lossy(&printed.stdout).trim(), token);
    // And where none is kept, it says what to do.
    let none = std::process::Command::new(env!("CARGO_BIN_EXE_kernel-broker"))
        .arg("token")
        .arg("--data-dir")
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(!none.status.success());
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("no token is kept in"),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );
}
