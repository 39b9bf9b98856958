//! A kernel launched in the sandbox and connected: [`Live`], made by [`start_kernel`].
//! Both the session actor (create, restart) and the warm pool start kernels through here,
//! so a pooled kernel is started exactly as a cold one.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::timeout;

use super::error::SessionError;
use crate::kernel::{KernelClient, KernelError, KernelEvents};
use crate::sandbox::{ExitReason, KernelProcess, LaunchSpec, Launched, Sandbox};
use crate::wire::Message;

/// How long a failed connection waits for the sandbox to report the kernel's end (the
/// docker backend polls every 500 ms).
const DEATH_REPORT: Duration = Duration::from_secs(3);

/// A connected kernel.
pub(crate) struct Live {
    pub client: KernelClient,
    pub events: KernelEvents,
    pub process: Arc<dyn KernelProcess>,
    /// The kernel's HMAC key (kept in the session's record with `--keep-sessions`).
    pub key: String,
    /// Resolves when the process ends (fed by a watcher task, so `Live` stays `Sync`).
    pub(super) exit: oneshot::Receiver<ExitReason>,
}

impl Live {
    /// Whether the kernel process has already ended.
    pub fn exited(&mut self) -> bool {
        !matches!(
            self.exit.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        )
    }
}

/// Launch a kernel in the sandbox and connect to it.
pub(crate) async fn start_kernel(
    sandbox: &Arc<dyn Sandbox>,
    spec: LaunchSpec,
    options: crate::kernel::ConnectOptions,
) -> Result<Live, SessionError> {
    let user = spec.user.name.clone();
    let key = spec.key.clone();
    let limit = sandbox.launch_timeout();
    let launched = timeout(limit, sandbox.launch(spec))
        .await
        .map_err(|_| SessionError::LaunchTimedOut { limit })?
        .map_err(|source| SessionError::LaunchFailed { source })?;
    connect_kernel(launched, key, &user, options, limit).await
}

/// Connects to a kernel the sandbox launched (or a fork it adopted); a kernel that does
/// not become ready within `limit` is terminated.
pub(crate) async fn connect_kernel(
    launched: Launched,
    key: String,
    user: &str,
    options: crate::kernel::ConnectOptions,
    limit: Duration,
) -> Result<Live, SessionError> {
    let Launched { endpoints, process } = launched;
    let k = key.clone();
    let connect = async move { KernelClient::connect(&endpoints, &k, user, options, limit).await };
    ready_kernel(Arc::from(process), key, connect).await
}

/// What a connection to a kernel's sockets returns once the kernel is ready.
pub(crate) type Connected = Result<(KernelClient, KernelEvents, Message), KernelError>;

/// Waits for `connect`, a connection under way to `process`'s sockets (begun before the
/// process was known, for a fork), watching the process meanwhile; a kernel that does not
/// become ready is terminated.
pub(crate) async fn ready_kernel(
    process: Arc<dyn KernelProcess>,
    key: String,
    connect: impl std::future::Future<Output = Connected>,
) -> Result<Live, SessionError> {
    // Fail fast if the process dies while we wait for it to become ready.
    let p = process.clone();
    let before_ready = |reason: ExitReason| SessionError::DiedBeforeReady { reason };
    let outcome = tokio::select! {
        r = connect => match r {
            Ok(connected) => Ok(connected),
            // A kernel that dies while connecting breaks the connection first; its end
            // (which names what ran out) says more than the broken socket, once known.
            Err(e) => match timeout(DEATH_REPORT, p.wait()).await {
                Ok(reason) => Err(before_ready(reason)),
                Err(_) => Err(SessionError::ConnectFailed { source: e }),
            },
        },
        reason = p.wait() => Err(before_ready(reason)),
    };
    match outcome {
        Ok((client, events, _info)) => {
            let (tx, exit) = oneshot::channel();
            let p = process.clone();
            tokio::spawn(async move {
                let _ = tx.send(p.wait().await);
            });
            Ok(Live {
                client,
                events,
                process,
                key,
                exit,
            })
        }
        Err(e) => {
            process.terminate().await;
            Err(e)
        }
    }
}
