//! The actor's side of a fork of its live kernel (issue 36): the request sent, between
//! executions; the registry (`session/registry/fork.rs`) adopts and connects the child.

use super::Actor;
use crate::session::command::ReplyRoute;
use crate::session::error::SessionError;
use crate::session::forking::send_fork_request;

impl Actor {
    /// Prepares a fork of the live kernel for `spec` and sends it the fork request, if it
    /// is idle (nothing running or queued: the fork copies the state between executions).
    /// Prepared here, for the kernel asked: a checkpoint swaps the live kernel, and a fork
    /// prepared for the one before would look for the child under the wrong parent. The
    /// request is not recorded: it holds the new kernel's key. Its reply is, as every
    /// message of the kernel.
    pub(super) async fn fork(
        &mut self,
        spec: crate::sandbox::LaunchSpec,
        route: ReplyRoute,
    ) -> Result<(crate::sandbox::fork::PreparedFork, u64), SessionError> {
        let session = self.session.id;
        let Some(k) = self.kernel.as_mut() else {
            return Err(SessionError::KernelNotRunning);
        };
        if self.running.is_some() || !self.queue.is_empty() {
            return Err(SessionError::ForkBusy { session });
        }
        // A held checkpoint's leaf move done first: the child starts where its parent is.
        k.process.settle().await;
        let prepared = self
            .sandbox
            .prepare_fork(&*k.process, spec)
            .await
            .map_err(|e| crate::session::forking::fork_error(session, e))?;
        let (prepared, msg_id) = send_fork_request(&self.sandbox, session, k, prepared).await?;
        // Routed from here on: the reply is read in this actor's loop, after this returns.
        self.routes.insert(msg_id, route);
        Ok((prepared, self.session.status().execution_count))
    }
}
