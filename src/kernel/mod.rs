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

mod cut;
mod heartbeat;
mod link;
mod log_limit;
pub mod spec;
pub mod zmtp;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};

use crate::wire::{self, Channel, Message, Signer};
pub use link::ChannelError;
use link::{endpoint_of, Link};
use log_limit::LogLimit;
use zmtp::SocketType;

pub use zmtp::Limits as MessageLimits;

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
    ChannelFailed(Channel, ChannelError),
    /// An output message on iopub over the message limit, cut (see [`cut`]): its content
    /// now says so; `bytes` is the size the kernel sent, all frames together.
    OutputCut {
        message: Message,
        bytes: u64,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("could not connect the {channel} channel to {endpoint}: {source}")]
    Connect {
        channel: &'static str,
        endpoint: String,
        #[source]
        source: ChannelError,
    },
    #[error("the kernel did not become ready within {0:?}")]
    NotReady(Duration),
    #[error("the kernel connection is closed")]
    Closed,
    #[error("the kernel is not reading its {0} channel ({QUEUE_CAPACITY} messages are waiting)")]
    Backlogged(&'static str),
}

/// Heartbeat settings.
#[derive(Debug, Clone, Copy)]
pub struct Heartbeat {
    pub interval: Duration,
    /// Consecutive misses before the kernel is declared lost.
    pub max_misses: u32,
}

/// How the broker connects to kernels: heartbeat, message limits, and where readiness is
/// asked.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConnectOptions {
    pub heartbeat: Heartbeat,
    pub limits: MessageLimits,
    pub readiness: Readiness,
}

/// Which kernel is being reached, which decides the channel its readiness is asked on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Readiness {
    /// A kernel just started: readiness is asked on shell.
    #[default]
    Fresh,
    /// A kernel that has been running (adopted after a broker restart, `--keep-sessions`):
    /// it may be busy with code a client sent before the restart, and its shell answers
    /// nothing until that code ends, so readiness is asked on control (ipykernel answers
    /// `kernel_info_request` there too, busy or not).
    Running,
}

impl Readiness {
    fn channel(self) -> Channel {
        match self {
            Readiness::Fresh => Channel::Shell,
            Readiness::Running => Channel::Control,
        }
    }
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
    shell: mpsc::Sender<Outgoing>,
    stdin: mpsc::Sender<Outgoing>,
    control: mpsc::Sender<Outgoing>,
    /// Held so the socket tasks end when the last clone is dropped.
    _tasks: Arc<TaskSet>,
}

struct TaskSet(Vec<JoinHandle<()>>);

impl Drop for TaskSet {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// What a connection's writer task sends.
enum Outgoing {
    Message(Vec<Bytes>),
    /// The answer to the kernel's ZMTP `PING`.
    Pong(Bytes),
}

/// Capacity of the event queue from the socket readers to the consumer. The consumer (the
/// session task) never awaits anything slow, so this is only a burst buffer. What bounds
/// memory is the byte budget (see [`KernelEvents`]): when the consumer falls behind, the
/// readers wait, and the kernel's PUB socket drops iopub at its high-water mark instead of
/// the broker buffering without bound.
const EVENT_CAPACITY: usize = 256;

/// Readiness is asked again when a probe went unanswered (a SUB that subscribed after the
/// kernel published the probe's status misses it): first after this long, then twice as
/// long each time up to [`MAX_PROBE_INTERVAL`]. A kernel answers a probe in about a
/// millisecond once it runs, so the short first interval costs nothing, and a late
/// subscription costs ~25 ms instead of a quarter of a second.
const FIRST_PROBE_INTERVAL: Duration = Duration::from_millis(25);
const MAX_PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// Messages queued for one channel's writer before [`KernelClient::send`] reports the
/// kernel as not reading.
const QUEUE_CAPACITY: usize = 1024;

/// The events of one kernel, in arrival order per channel.
///
/// Memory bound: every message from the kernel holds permits of a per-kernel byte budget
/// (twice the message limit) from the moment its first frame is read until the consumer
/// takes it here, so whatever a kernel sends, at most that many bytes of its messages are
/// in the broker's hands between its sockets and the session.
pub struct KernelEvents {
    rx: mpsc::Receiver<(KernelEvent, Option<OwnedSemaphorePermit>)>,
}

impl KernelEvents {
    /// The next event; `None` once every socket task has ended. Cancel-safe.
    pub async fn recv(&mut self) -> Option<KernelEvent> {
        self.rx.recv().await.map(|(event, _budget)| event)
    }
}

impl KernelClient {
    /// Connect to a kernel and wait until it answers `kernel_info_request` and its iopub
    /// output reaches us. Returns the client, the event stream, and the kernel_info reply.
    /// `options.readiness` says on which channel readiness is asked.
    pub async fn connect(
        endpoints: &KernelEndpoints,
        key: &str,
        username: &str,
        options: ConnectOptions,
        ready_timeout: Duration,
    ) -> Result<(KernelClient, KernelEvents, Message), KernelError> {
        let ConnectOptions {
            heartbeat,
            limits,
            readiness,
        } = options;
        let probe = readiness.channel();
        let deadline = Instant::now() + ready_timeout;
        let signer = Signer::new(key.as_bytes());
        let identity = hex::encode(rand::random::<[u8; 16]>()).into_bytes();
        // Twice the largest message, so one whole message always fits while another is
        // being consumed.
        let budget = Arc::new(Semaphore::new(
            usize::try_from(limits.max_message.saturating_mul(2))
                .unwrap_or(usize::MAX)
                .min(Semaphore::MAX_PERMITS),
        ));
        let log = Arc::new(Mutex::new(LogLimit::new()));
        let (events_tx, rx) = mpsc::channel(EVENT_CAPACITY);
        let mut events = KernelEvents { rx };
        let mut tasks = Vec::new();
        let mut open = |channel: Channel,
                        endpoint: &str,
                        socket_type: SocketType,
                        identity: Option<Vec<u8>>| {
            let link = Link {
                channel,
                endpoint: endpoint.to_string(),
                socket_type,
                identity,
                limits,
                budget: budget.clone(),
                signer: signer.clone(),
                events: events_tx.clone(),
                log: log.clone(),
            };
            let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
            tasks.push(tokio::spawn(link.run(deadline, rx, tx.clone())));
            tx
        };
        let _iopub = open(Channel::Iopub, &endpoints.iopub, SocketType::Sub, None);
        let shell = open(
            Channel::Shell,
            &endpoints.shell,
            SocketType::Dealer,
            Some(identity.clone()),
        );
        let stdin = open(
            Channel::Stdin,
            &endpoints.stdin,
            SocketType::Dealer,
            Some(identity),
        );
        let control = open(
            Channel::Control,
            &endpoints.control,
            SocketType::Dealer,
            None,
        );
        tasks.push(tokio::spawn(heartbeat::run(
            endpoints.hb.clone(),
            heartbeat,
            events_tx,
        )));

        let client = KernelClient {
            signer,
            session: uuid::Uuid::new_v4().to_string(),
            username: username.to_string(),
            shell,
            stdin,
            control,
            _tasks: Arc::new(TaskSet(tasks)),
        };

        // Readiness: a kernel_info_reply on the probed channel, and iopub output for one of our requests
        // (a SUB that connected late misses early messages, so keep asking until iopub
        // answers too), or the kernel's welcome to our subscription.
        let mut info: Option<Message> = None;
        let mut sent = std::collections::HashSet::new();
        let mut iopub_seen = false;
        let started = Instant::now();
        let mut next_probe = started;
        let mut probe_interval = FIRST_PROBE_INTERVAL;
        loop {
            if info.is_some() && iopub_seen {
                tracing::debug!(
                    probes = sent.len(),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "kernel ready"
                );
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(KernelError::NotReady(ready_timeout));
            }
            if now >= next_probe {
                let m = client.request("kernel_info_request", &serde_json::json!({}));
                sent.insert(m.msg_id.clone());
                client.send(probe, &m).await?;
                next_probe = now + probe_interval;
                probe_interval = (probe_interval * 2).min(MAX_PROBE_INTERVAL);
            }
            let wait = next_probe.min(deadline) - Instant::now();
            match timeout(wait, events.recv()).await {
                Err(_) => continue,
                Ok(None) => return Err(KernelError::Closed),
                Ok(Some(KernelEvent::Message(channel, m))) => {
                    let ours = m.parent_msg_id.as_ref().is_some_and(|p| sent.contains(p));
                    match channel {
                        ch if ch == probe && m.msg_type == "kernel_info_reply" && ours => {
                            info = Some(m)
                        }
                        Channel::Iopub if ours => iopub_seen = true,
                        // A kernel that says when a subscription arrives (ipykernel 7's
                        // XPUB, protocol 5.4) publishes everything after it to us: no
                        // second probe for a status message published before it.
                        Channel::Iopub if m.msg_type == "iopub_welcome" => iopub_seen = true,
                        _ => {}
                    }
                }
                Ok(Some(KernelEvent::ChannelFailed(ch, why))) => {
                    return Err(KernelError::Connect {
                        channel: ch.as_str(),
                        endpoint: endpoint_of(endpoints, ch).to_string(),
                        source: why,
                    })
                }
                Ok(Some(KernelEvent::HeartbeatLost { .. } | KernelEvent::OutputCut { .. })) => {}
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

    /// Sign and queue a message on shell, stdin or control. Never waits: a kernel that
    /// stops reading its sockets must not stall the session that sends to it, so a full
    /// queue is [`KernelError::Backlogged`].
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
        tx.try_send(Outgoing::Message(frames)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => KernelError::Backlogged(channel.as_str()),
            mpsc::error::TrySendError::Closed(_) => KernelError::Closed,
        })
    }
}
