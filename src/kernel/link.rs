//! One channel's connection to a kernel: the `ipc://` connect (retried until the kernel has
//! bound its socket), the ZMTP handshake, then a task that reads, verifies and forwards
//! every message as a [`KernelEvent`] under the kernel's byte budget, and a child task that
//! writes what the client queues.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::cut;
use super::log_limit::LogLimit;
use super::zmtp::{self, Incoming, SocketType, ZmtpError};
use super::{KernelEndpoints, KernelEvent, MessageLimits, Outgoing};
use crate::sync::lock;
use crate::wire::{self, Channel, Signer};

pub(super) fn endpoint_of(endpoints: &KernelEndpoints, channel: Channel) -> &str {
    match channel {
        Channel::Shell => &endpoints.shell,
        Channel::Iopub => &endpoints.iopub,
        Channel::Stdin => &endpoints.stdin,
        Channel::Control => &endpoints.control,
        Channel::Heartbeat => &endpoints.hb,
    }
}

/// Why a kernel channel could not be opened, or was cut off.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("{0} is not an ipc:// endpoint")]
    NotIpc(String),
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The handshake failed, or the kernel broke the protocol.
    #[error(transparent)]
    Protocol(#[from] ZmtpError),
}

/// The unix socket path of an `ipc://` endpoint; the broker reaches kernels through no
/// other transport.
fn ipc_path(endpoint: &str) -> Result<&Path, ChannelError> {
    endpoint
        .strip_prefix("ipc://")
        .map(Path::new)
        .ok_or_else(|| ChannelError::NotIpc(endpoint.to_string()))
}

/// Why a connection to a kernel endpoint could not be made.
#[derive(Debug)]
pub(super) struct OpenFailed {
    pub(super) error: ChannelError,
    /// The broker itself ran out of descriptors or memory (see
    /// [`crate::descriptors::is_exhaustion`]): nothing is known of the kernel.
    pub(super) exhausted: bool,
}

impl OpenFailed {
    fn kernel(error: impl Into<ChannelError>) -> Self {
        Self {
            error: error.into(),
            exhausted: false,
        }
    }
}

/// How long a connection to sockets not bound yet is retried every millisecond (then every
/// five).
const QUICK_RETRIES: Duration = Duration::from_millis(100);

/// Connects to an `ipc://` endpoint and runs the ZMTP handshake, retrying while the
/// kernel has not bound the socket yet (missing, or not listening yet) until `deadline`.
pub(super) async fn open_connection(
    endpoint: &str,
    socket_type: SocketType,
    identity: Option<&[u8]>,
    limits: MessageLimits,
    deadline: Instant,
) -> Result<(ZmtpReader, ZmtpWriter), OpenFailed> {
    let path = ipc_path(endpoint).map_err(OpenFailed::kernel)?;
    let started = Instant::now();
    let stream = loop {
        match zmtp::connect_ipc(path).await {
            Ok(s) => break s,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT) | Some(libc::ECONNREFUSED) | Some(libc::EAGAIN)
                ) && Instant::now() < deadline =>
            {
                // A fork binds its sockets 10 to 20 ms after its pid is known: asked
                // often at first, so it is reached within a millisecond of binding; a
                // kernel started from nothing takes a second or more.
                let pause = if started.elapsed() < QUICK_RETRIES {
                    Duration::from_millis(1)
                } else {
                    Duration::from_millis(5)
                };
                tokio::time::sleep(pause).await;
            }
            Err(e) => {
                return Err(OpenFailed {
                    exhausted: crate::descriptors::is_exhaustion(&e),
                    error: ChannelError::Connect {
                        path: path.to_path_buf(),
                        source: e,
                    },
                })
            }
        }
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    zmtp::handshake(stream, socket_type, identity, limits, left)
        .await
        .map_err(OpenFailed::kernel)
}

type ZmtpReader = zmtp::Reader<tokio::io::ReadHalf<tokio::net::UnixStream>>;
pub(super) type ZmtpWriter = zmtp::Writer<tokio::io::WriteHalf<tokio::net::UnixStream>>;

/// One channel's connection: opened, then read by this task and written by a child task.
pub(super) struct Link {
    pub(super) channel: Channel,
    pub(super) endpoint: String,
    pub(super) socket_type: SocketType,
    pub(super) identity: Option<Vec<u8>>,
    pub(super) limits: MessageLimits,
    pub(super) budget: Arc<Semaphore>,
    pub(super) signer: Signer,
    pub(super) events: mpsc::Sender<(KernelEvent, Option<OwnedSemaphorePermit>)>,
    pub(super) log: Arc<Mutex<LogLimit>>,
}

impl Link {
    async fn fail(&self, why: ChannelError) {
        let _ = self
            .events
            .send((KernelEvent::ChannelFailed(self.channel, why), None))
            .await;
    }

    /// Connect, then read, verify and forward every message until the connection ends or
    /// the kernel breaks the protocol (then the channel is reported failed: a kernel that
    /// sends what no kernel sends is cut off).
    pub(super) async fn run(
        self,
        deadline: Instant,
        outgoing: mpsc::Receiver<Outgoing>,
        pongs: mpsc::Sender<Outgoing>,
    ) {
        let channel = self.channel;
        let (mut reader, writer) = match open_connection(
            &self.endpoint,
            self.socket_type,
            self.identity.as_deref(),
            self.limits,
            deadline,
        )
        .await
        {
            Ok(c) => c,
            Err(why) => return self.fail(why.error).await,
        };
        reader.set_budget(self.budget.clone());
        if channel == Channel::Iopub {
            // Output is the kernel's business: cut it when it is too big (see [`cut`]).
            reader.cut_oversized(
                Box::new(cut::OutputCutter::new(self.signer.clone())),
                cut::cut_limits(self.limits.max_message),
            );
        }
        let _writer = AbortOnDrop(tokio::spawn(write_loop(writer, outgoing, channel)));
        loop {
            match reader.next().await {
                Ok(Incoming::Message(frames, permit)) => match wire::decode(frames, &self.signer) {
                    Ok(m) => {
                        if self
                            .events
                            .send((KernelEvent::Message(channel, m), permit))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    Err(e) => {
                        if lock(&self.log).allow() {
                            tracing::warn!(channel = channel.as_str(), error = %e, "dropped a message from the kernel");
                        }
                    }
                },
                Ok(Incoming::Cut(cut, permit)) => {
                    let bytes = cut.bytes;
                    let decoded = if cut.genuine {
                        cut::replace_content(cut.frames, bytes)
                    } else {
                        Err(wire::WireError::BadSignature {
                            msg_type: "cut output".into(),
                        })
                    };
                    match decoded {
                        Ok(message) => {
                            if lock(&self.log).allow() {
                                tracing::info!(channel = channel.as_str(), bytes, msg_type = %message.msg_type, "cut an output message over the limit");
                            }
                            let event = KernelEvent::OutputCut { message, bytes };
                            if self.events.send((event, permit)).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            if lock(&self.log).allow() {
                                tracing::warn!(channel = channel.as_str(), bytes, error = %e, "dropped a cut message from the kernel");
                            }
                        }
                    }
                }
                Ok(Incoming::Ping(context)) => {
                    let _ = pongs.try_send(Outgoing::Pong(context));
                }
                // A connection that ends is not a death by itself: a kernel that exits or is
                // killed ends them all, and its sandbox says why (exit code, out of memory);
                // a live kernel that drops one is caught by its heartbeat or the execution
                // timeout. Reporting it here would race the real reason.
                Err(ZmtpError::Closed | ZmtpError::Io(_)) => {
                    tracing::debug!(channel = channel.as_str(), "kernel socket closed");
                    return;
                }
                Err(e) => {
                    if lock(&self.log).allow() {
                        tracing::warn!(channel = channel.as_str(), error = %e, "cutting off the kernel");
                    }
                    return self.fail(e.into()).await;
                }
            }
        }
    }
}

pub(super) struct AbortOnDrop(pub(super) JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn write_loop(mut writer: ZmtpWriter, mut rx: mpsc::Receiver<Outgoing>, channel: Channel) {
    while let Some(out) = rx.recv().await {
        let r = match out {
            Outgoing::Message(frames) => writer.send(&frames).await,
            Outgoing::Pong(context) => zmtp::pong(&mut writer, &context).await,
        };
        if let Err(e) = r {
            // As for reads: the sandbox reports the kernel's end; later sends fail as Closed.
            tracing::debug!(channel = channel.as_str(), error = %e, "send to kernel failed");
            break;
        }
    }
}
