//! A client for one running kernel over ZeroMQ: the five channels of the Jupyter protocol.
//!
//! [`KernelClient::connect`] opens shell, stdin (same routing identity, so `input_request`
//! reaches us), control, iopub and heartbeat sockets to a kernel's endpoints, confirms the
//! kernel is ready with `kernel_info_request`, and hands back a stream of
//! [`KernelEvent`]s. Every socket is read in its own task, so a slow consumer of one
//! channel never stalls another; iopub in particular is drained as fast as it arrives.
//!
//! Architecture invariant: this layer knows the wire protocol and sockets, not sessions,
//! sandboxes or HTTP. A restarted kernel gets a brand-new client: an old DEALER of the
//! `zeromq` crate silently loses messages to a kernel restarted on the same address.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use zeromq::{
    DealerSocket, ReqSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use crate::wire::{self, Channel, Message, Signer};

/// The five ZeroMQ endpoints of a kernel as the broker reaches them,
/// e.g. `ipc:///var/lib/kernel-broker/run/<id>/k-1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelEndpoints {
    pub shell: String,
    pub iopub: String,
    pub stdin: String,
    pub control: String,
    pub hb: String,
}

/// What the kernel sent, or what happened to the connection.
// Messages are nearly every event: boxing them would cost an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum KernelEvent {
    Message(Channel, Message),
    /// The heartbeat went unanswered `misses` times in a row.
    HeartbeatLost {
        misses: u32,
    },
    /// A socket failed for good.
    ChannelFailed(Channel, String),
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("could not connect the {channel} channel to {endpoint}: {reason}")]
    Connect {
        channel: &'static str,
        endpoint: String,
        reason: String,
    },
    #[error("the kernel did not become ready within {0:?}")]
    NotReady(Duration),
    #[error("the kernel connection is closed")]
    Closed,
}

/// Heartbeat settings.
#[derive(Debug, Clone, Copy)]
pub struct Heartbeat {
    pub interval: Duration,
    /// Consecutive misses before the kernel is declared lost.
    pub max_misses: u32,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(3),
            max_misses: 3,
        }
    }
}

/// The sending side of a connected kernel. Cheap to clone. Dropping every clone (and the
/// event receiver) closes the sockets.
#[derive(Clone)]
pub struct KernelClient {
    signer: Signer,
    session: String,
    username: String,
    shell: mpsc::Sender<ZmqMessage>,
    stdin: mpsc::Sender<ZmqMessage>,
    control: mpsc::Sender<ZmqMessage>,
    /// Held so the socket tasks end when the last clone is dropped.
    _tasks: std::sync::Arc<TaskSet>,
}

struct TaskSet(Vec<JoinHandle<()>>);

impl Drop for TaskSet {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Capacity of the event queue from the socket readers to the consumer. The consumer (the
/// session task) never awaits anything slow, so this is only a burst buffer; kept small
/// because one message can be megabytes: when the consumer falls behind, the readers wait,
/// and the kernel's PUB socket drops iopub at its high-water mark instead of the broker
/// buffering without bound.
const EVENT_CAPACITY: usize = 256;

fn to_zmq(frames: Vec<Bytes>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames).ok()
}

async fn connect_socket<S: Socket>(
    mut socket: S,
    channel: &'static str,
    endpoint: &str,
) -> Result<S, KernelError> {
    socket
        .connect(endpoint)
        .await
        .map_err(|e| KernelError::Connect {
            channel,
            endpoint: endpoint.to_string(),
            reason: e.to_string(),
        })?;
    Ok(socket)
}

impl KernelClient {
    /// Connect to a kernel and wait until it answers `kernel_info_request` and its iopub
    /// output reaches us. Returns the client, the event stream, and the kernel_info reply.
    pub async fn connect(
        endpoints: &KernelEndpoints,
        key: &str,
        username: &str,
        heartbeat: Heartbeat,
        ready_timeout: Duration,
    ) -> Result<(KernelClient, mpsc::Receiver<KernelEvent>, Message), KernelError> {
        let deadline = Instant::now() + ready_timeout;
        let signer = Signer::new(key.as_bytes());
        let identity: [u8; 16] = rand::random();
        let identity = zeromq::util::PeerIdentity::try_from(hex::encode(identity).into_bytes())
            .map_err(|e| KernelError::Connect {
                channel: "shell",
                endpoint: endpoints.shell.clone(),
                reason: e.to_string(),
            })?;
        let dealer = |id: Option<zeromq::util::PeerIdentity>| {
            let mut opts = SocketOptions::default();
            opts.connect_timeout(ready_timeout);
            if let Some(id) = id {
                opts.peer_identity(id);
            }
            DealerSocket::with_options(opts)
        };
        let connect_all = async {
            let mut sub = SubSocket::new();
            sub.subscribe("").await.map_err(|e| KernelError::Connect {
                channel: "iopub",
                endpoint: endpoints.iopub.clone(),
                reason: e.to_string(),
            })?;
            let iopub = connect_socket(sub, "iopub", &endpoints.iopub).await?;
            let shell =
                connect_socket(dealer(Some(identity.clone())), "shell", &endpoints.shell).await?;
            let stdin = connect_socket(dealer(Some(identity)), "stdin", &endpoints.stdin).await?;
            let control = connect_socket(dealer(None), "control", &endpoints.control).await?;
            Ok::<_, KernelError>((iopub, shell, stdin, control))
        };
        // The crate retries a missing ipc socket with a growing backoff (up to 800 ms); wait
        // for the kernel to bind its sockets first, so the first attempt succeeds.
        wait_for_ipc_sockets(endpoints, deadline).await;
        let (iopub, shell, stdin, control) = timeout(ready_timeout, connect_all)
            .await
            .map_err(|_| KernelError::NotReady(ready_timeout))??;

        let (events_tx, mut events) = mpsc::channel(EVENT_CAPACITY);
        let mut tasks = Vec::new();
        let (shell_tx, t) = spawn_dealer(shell, Channel::Shell, signer.clone(), events_tx.clone());
        tasks.extend(t);
        let (stdin_tx, t) = spawn_dealer(stdin, Channel::Stdin, signer.clone(), events_tx.clone());
        tasks.extend(t);
        let (control_tx, t) =
            spawn_dealer(control, Channel::Control, signer.clone(), events_tx.clone());
        tasks.extend(t);
        tasks.push(tokio::spawn(read_loop(
            iopub,
            Channel::Iopub,
            signer.clone(),
            events_tx.clone(),
        )));
        tasks.push(tokio::spawn(heartbeat_loop(
            endpoints.hb.clone(),
            heartbeat,
            events_tx,
        )));

        let client = KernelClient {
            signer,
            session: uuid::Uuid::new_v4().to_string(),
            username: username.to_string(),
            shell: shell_tx,
            stdin: stdin_tx,
            control: control_tx,
            _tasks: std::sync::Arc::new(TaskSet(tasks)),
        };

        // Readiness: a kernel_info_reply on shell, and iopub output for one of our requests
        // (a SUB that connected late misses early messages, so keep asking until iopub
        // answers too).
        let mut info: Option<Message> = None;
        let mut sent = std::collections::HashSet::new();
        let mut iopub_seen = false;
        let mut next_probe = Instant::now();
        loop {
            if info.is_some() && iopub_seen {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(KernelError::NotReady(ready_timeout));
            }
            if now >= next_probe {
                let m = client.request("kernel_info_request", &serde_json::json!({}));
                sent.insert(m.msg_id.clone());
                client.send(Channel::Shell, &m).await?;
                next_probe = now + Duration::from_millis(250);
            }
            let wait = next_probe.min(deadline) - Instant::now();
            match timeout(wait, events.recv()).await {
                Err(_) => continue,
                Ok(None) => return Err(KernelError::Closed),
                Ok(Some(KernelEvent::Message(channel, m))) => {
                    let ours = m.parent_msg_id.as_ref().is_some_and(|p| sent.contains(p));
                    match channel {
                        Channel::Shell if m.msg_type == "kernel_info_reply" && ours => {
                            info = Some(m)
                        }
                        Channel::Iopub if ours => iopub_seen = true,
                        _ => {}
                    }
                }
                Ok(Some(KernelEvent::ChannelFailed(ch, why))) => {
                    return Err(KernelError::Connect {
                        channel: ch.as_str(),
                        endpoint: String::new(),
                        reason: why,
                    })
                }
                Ok(Some(KernelEvent::HeartbeatLost { .. })) => {}
            }
        }
        // Replies and statuses of the other probes may still follow; consumers ignore
        // messages that answer requests they did not make.
        let info = info.ok_or(KernelError::Closed)?;
        Ok((client, events, info))
    }

    /// The Jupyter session id the broker stamps on its own requests.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// A new request from the broker, ready to send.
    pub fn request(&self, msg_type: &str, content: &impl serde::Serialize) -> Message {
        Message::new(msg_type, content, None, &self.session, &self.username)
    }

    /// A new message in reply to `parent` (e.g. an `input_reply`).
    pub fn reply_to(
        &self,
        msg_type: &str,
        content: &impl serde::Serialize,
        parent: &Bytes,
    ) -> Message {
        Message::new(
            msg_type,
            content,
            Some(parent),
            &self.session,
            &self.username,
        )
    }

    /// Sign and send a message on shell, stdin or control.
    pub async fn send(&self, channel: Channel, msg: &Message) -> Result<(), KernelError> {
        let tx = match channel {
            Channel::Shell => &self.shell,
            Channel::Stdin => &self.stdin,
            Channel::Control => &self.control,
            Channel::Iopub | Channel::Heartbeat => return Err(KernelError::Closed),
        };
        let mut msg = msg.clone();
        // Identities belong to the client side of a ROUTER; a DEALER sends none.
        msg.identities.clear();
        let frames = wire::encode(&msg, &self.signer);
        let zmq = to_zmq(frames).ok_or(KernelError::Closed)?;
        tx.send(zmq).await.map_err(|_| KernelError::Closed)
    }
}

/// Poll (every 5 ms) until the unix sockets of `ipc://` endpoints exist, or the deadline.
async fn wait_for_ipc_sockets(endpoints: &KernelEndpoints, deadline: Instant) {
    let paths: Vec<&str> = [
        &endpoints.shell,
        &endpoints.iopub,
        &endpoints.stdin,
        &endpoints.control,
        &endpoints.hb,
    ]
    .into_iter()
    .filter_map(|e| e.strip_prefix("ipc://"))
    .collect();
    for path in paths {
        while !tokio::fs::try_exists(path).await.unwrap_or(false) {
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Split a dealer into a writer task fed by a channel and a reader task.
fn spawn_dealer(
    socket: DealerSocket,
    channel: Channel,
    signer: Signer,
    events: mpsc::Sender<KernelEvent>,
) -> (mpsc::Sender<ZmqMessage>, [JoinHandle<()>; 2]) {
    let (mut send_half, recv_half) = socket.split();
    let (tx, mut rx) = mpsc::channel::<ZmqMessage>(256);
    let events_w = events.clone();
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if let Err(e) = send_half.send(m).await {
                tracing::warn!(channel = channel.as_str(), error = %e, "send to kernel failed");
                let _ = events_w
                    .send(KernelEvent::ChannelFailed(channel, e.to_string()))
                    .await;
                break;
            }
        }
    });
    let reader = tokio::spawn(read_loop(recv_half, channel, signer, events));
    (tx, [writer, reader])
}

/// Read, verify and forward every message of one socket until it closes.
async fn read_loop<S: SocketRecv + Send>(
    mut socket: S,
    channel: Channel,
    signer: Signer,
    events: mpsc::Sender<KernelEvent>,
) {
    loop {
        match socket.recv().await {
            Ok(zmsg) => {
                let frames = zmsg.into_vec();
                match wire::decode(frames, &signer) {
                    Ok(m) => {
                        if events.send(KernelEvent::Message(channel, m)).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(channel = channel.as_str(), error = %e, "dropped a message from the kernel");
                    }
                }
            }
            Err(e) => {
                tracing::debug!(channel = channel.as_str(), error = %e, "kernel socket closed");
                let _ = events
                    .send(KernelEvent::ChannelFailed(channel, e.to_string()))
                    .await;
                return;
            }
        }
    }
}

/// Ping the kernel's heartbeat (REQ/REP echo). A REQ socket that timed out cannot send
/// again, so each miss rebuilds it.
async fn heartbeat_loop(endpoint: String, hb: Heartbeat, events: mpsc::Sender<KernelEvent>) {
    let mut misses = 0u32;
    let mut socket: Option<ReqSocket> = None;
    loop {
        tokio::time::sleep(hb.interval).await;
        if events.is_closed() {
            return;
        }
        let ok = async {
            if socket.is_none() {
                let mut opts = SocketOptions::default();
                opts.connect_timeout(hb.interval);
                let mut s = ReqSocket::with_options(opts);
                s.connect(&endpoint).await.ok()?;
                socket = Some(s);
            }
            let s = socket.as_mut()?;
            s.send(ZmqMessage::from(Bytes::from_static(b"ping")))
                .await
                .ok()?;
            s.recv().await.ok()
        };
        let answered = matches!(timeout(hb.interval, ok).await, Ok(Some(_)));
        if answered {
            misses = 0;
        } else {
            socket = None;
            misses += 1;
            tracing::debug!(misses, "heartbeat missed");
            if misses >= hb.max_misses {
                if events
                    .send(KernelEvent::HeartbeatLost { misses })
                    .await
                    .is_err()
                {
                    return;
                }
                misses = 0;
            }
        }
    }
}
