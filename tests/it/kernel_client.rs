//! The kernel client against a scripted kernel made of real ZeroMQ sockets (a ROUTER for
//! shell/control/stdin, a PUB for iopub, a REP for the heartbeat) over `ipc://`. It tests the
//! client layer in isolation: the readiness handshake, and that a message with a bad
//! signature is dropped, never delivered. (Real kernels are used everywhere else.) The
//! scripted kernel is the session layer's test kernel, shared through `#[path]`.

use std::time::Duration;

use kernel_broker::kernel::{ConnectOptions, KernelClient, KernelEndpoints, KernelEvent};
use kernel_broker::wire::Channel;

use crate::scripted_kernel;

const KEY: &str = "fake-kernel-key";

#[tokio::test]
async fn bad_signatures_are_dropped_and_good_messages_delivered() {
    let dir = tempfile::tempdir().unwrap();
    // The scripted kernel answers kernel_info; for the `forge` script it sends a reply
    // under a wrong key first, then one with tampered content, then the genuine one.
    let kernel = scripted_kernel::ScriptedKernel::start(dir.path(), KEY).await;
    let endpoints = kernel.endpoints.clone();

    let (client, mut events, info) = tokio::time::timeout(
        Duration::from_secs(20),
        KernelClient::connect(
            &endpoints,
            KEY,
            "test",
            ConnectOptions::default(),
            Duration::from_secs(15),
        ),
    )
    .await
    .expect("connect timed out")
    .expect("connect failed");
    assert_eq!(info.msg_type, "kernel_info_reply");

    let req = client.request("execute_request", &serde_json::json!({"code": "forge"}));
    client.send(Channel::Shell, &req).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match events.recv().await {
                Some(KernelEvent::Message(Channel::Shell, m)) if m.msg_type == "execute_reply" => {
                    return m
                }
                Some(_) => continue,
                None => panic!("event stream closed"),
            }
        }
    })
    .await
    .expect("no execute_reply");
    let content: serde_json::Value = serde_json::from_slice(&reply.content).unwrap();
    assert_eq!(
        content["genuine"], true,
        "the first reply delivered must be the genuine one: {content}"
    );
    assert_eq!(reply.parent_msg_id.as_deref(), Some(req.msg_id.as_str()));
    // Nothing else (in particular no forged reply) is queued behind it.
    let more = tokio::time::timeout(Duration::from_millis(300), events.recv()).await;
    assert!(
        !matches!(more, Ok(Some(KernelEvent::Message(Channel::Shell, _)))),
        "a forged reply got through"
    );
    drop(kernel);
}

#[tokio::test]
async fn connect_gives_up_cleanly_when_no_kernel_answers() {
    let dir = tempfile::tempdir().unwrap();
    let ep = |n: &str| format!("ipc://{}/k-{n}", dir.path().display());
    let endpoints = KernelEndpoints {
        shell: ep("1"),
        iopub: ep("2"),
        stdin: ep("3"),
        control: ep("4"),
        hb: ep("5"),
    };
    let started = std::time::Instant::now();
    let r = KernelClient::connect(
        &endpoints,
        KEY,
        "test",
        ConnectOptions::default(),
        Duration::from_secs(2),
    )
    .await;
    assert!(r.is_err());
    assert!(started.elapsed() < Duration::from_secs(10));
}
