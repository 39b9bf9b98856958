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
