//! The kernel client against a scripted kernel made of real ZeroMQ sockets (a ROUTER for
//! shell/control/stdin, a PUB for iopub, a REP for the heartbeat) over `ipc://`. It tests the
//! client layer in isolation: the readiness handshake, and that a message with a bad
//! signature is dropped, never delivered. (Real kernels are used everywhere else.)

use std::time::Duration;

use bytes::Bytes;
use kernel_broker::kernel::{ConnectOptions, KernelClient, KernelEndpoints, KernelEvent};
use kernel_broker::wire::{self, Channel, Message, Signer};
use zeromq::{PubSocket, RepSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const KEY: &str = "fake-kernel-key";

fn zmq(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).unwrap()
}

/// Reply to `req` (keeping its routing identities), signed with `signer`.
fn reply(req: &Message, msg_type: &str, content: serde_json::Value, signer: &Signer) -> Vec<Bytes> {
    let mut m = Message::new(msg_type, &content, Some(&req.header), "kernel", "kernel");
    m.identities = req.identities.clone();
    wire::encode(&m, signer)
}

fn status(parent: &Message, state: &str, signer: &Signer) -> Vec<Bytes> {
    let m = Message::new(
        "status",
        &serde_json::json!({"execution_state": state}),
        Some(&parent.header),
        "kernel",
        "kernel",
    );
    wire::encode(&m, signer)
}

#[tokio::test]
async fn bad_signatures_are_dropped_and_good_messages_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let ep = |n: &str| format!("ipc://{}/k-{n}", dir.path().display());
    let endpoints = KernelEndpoints {
        shell: ep("1"),
        iopub: ep("2"),
        stdin: ep("3"),
        control: ep("4"),
        hb: ep("5"),
    };
    let mut shell = RouterSocket::new();
    shell.bind(&endpoints.shell).await.unwrap();
    let mut iopub = PubSocket::new();
    iopub.bind(&endpoints.iopub).await.unwrap();
    let mut stdin = RouterSocket::new();
    stdin.bind(&endpoints.stdin).await.unwrap();
    let mut control = RouterSocket::new();
    control.bind(&endpoints.control).await.unwrap();
    let mut hb = RepSocket::new();
    hb.bind(&endpoints.hb).await.unwrap();

    let good = Signer::new(KEY.as_bytes());
    let forged = Signer::new(b"not-the-key");
    // The scripted kernel: answer kernel_info, then for "execute_request" send a forged
    // reply first and the genuine one after.
    let kernel = tokio::spawn(async move {
        let _keep = (stdin, control);
        tokio::spawn(async move {
            while let Ok(m) = hb.recv().await {
                if hb.send(m).await.is_err() {
                    break;
                }
            }
        });
        loop {
            let Ok(frames) = shell.recv().await else {
                return;
            };
            let req = wire::decode(frames.into_vec(), &good).unwrap();
            match req.msg_type.as_str() {
                "kernel_info_request" => {
                    iopub.send(zmq(status(&req, "busy", &good))).await.unwrap();
                    shell
                        .send(zmq(reply(
                            &req,
                            "kernel_info_reply",
                            serde_json::json!({"status": "ok", "protocol_version": "5.3"}),
                            &good,
                        )))
                        .await
                        .unwrap();
                    iopub.send(zmq(status(&req, "idle", &good))).await.unwrap();
                }
                "execute_request" => {
                    shell
                        .send(zmq(reply(
                            &req,
                            "execute_reply",
                            serde_json::json!({"status": "ok", "forged": true}),
                            &forged,
                        )))
                        .await
                        .unwrap();
                    // Tampered content under the right key is forged too.
                    let mut tampered = reply(
                        &req,
                        "execute_reply",
                        serde_json::json!({"status": "ok"}),
                        &good,
                    );
                    let last = tampered.len() - 1;
                    tampered[last] =
                        Bytes::from_static(b"{\"status\": \"ok\", \"tampered\": true}");
                    shell.send(zmq(tampered)).await.unwrap();
                    shell
                        .send(zmq(reply(
                            &req,
                            "execute_reply",
                            serde_json::json!({"status": "ok", "genuine": true}),
                            &good,
                        )))
                        .await
                        .unwrap();
                }
                _ => {}
            }
        }
    });

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

    let req = client.request("execute_request", &serde_json::json!({"code": "1"}));
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
    kernel.abort();
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
