//! Network policy in the sandbox: a [`Sandbox`] that gives the kernels of users with an
//! egress policy a way out through the broker's proxy (`crate::egress`), for either
//! backend. Kernels of other users are launched exactly as before: no proxy, no variable,
//! no listener, no network.
//!
//! For a user with a policy, a launch
//! 1. picks the port of the session's listener and puts the proxy variables
//!    (`HTTP_PROXY`, `HTTPS_PROXY`, their lower-case forms, `NO_PROXY`) and pip's
//!    settings (`PIP_TARGET` in the workspace, on `PYTHONPATH`) in the kernel's
//!    environment;
//! 2. launches the kernel with the inner backend;
//! 3. opens `127.0.0.1:<port>` inside the kernel's network namespace (`netns.rs`) and
//!    hands it to the proxy, before the launch returns, so before the kernel is reported
//!    ready; the listener ends with the kernel's handle.
//!
//! One port per session, also where kernels share a namespace (a user's fork-server
//! template, a user's Docker container), so each request is attributed to its session.
//! Kernels of one user that share a namespace can reach each other's port (the same
//! user's policy and limits apply; only the attribution could be borrowed).

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use super::command::{CommandSpec, RunningCommand};
use super::{
    AdoptError, AdoptSpec, ExitReason, KernelProcess, LaunchSpec, Launched, Sandbox, SandboxError,
    SandboxUser,
};
use crate::egress::{Egress, ServeGuard, PACKAGES_DIR};

/// Where the user's workspace is inside every sandbox (both backends).
const WORKSPACE_INSIDE: &str = "/workspace";

/// A sandbox whose kernels of users with a policy reach the egress proxy.
pub struct EgressSandbox {
    inner: Arc<dyn Sandbox>,
    egress: Arc<Egress>,
}

impl EgressSandbox {
    pub fn new(inner: Arc<dyn Sandbox>, egress: Arc<Egress>) -> Self {
        Self { inner, egress }
    }

    /// The environment of a kernel whose proxy listens on `port`; `ca_bundle`: the CA
    /// bundle pip, requests and Python's `ssl` are told to trust.
    pub fn kernel_env(port: u16, ca_bundle: Option<&str>) -> Vec<(String, String)> {
        let proxy = format!("http://127.0.0.1:{port}");
        let packages = format!("{WORKSPACE_INSIDE}/{PACKAGES_DIR}");
        [
            ("HTTP_PROXY", proxy.as_str()),
            ("HTTPS_PROXY", proxy.as_str()),
            ("http_proxy", proxy.as_str()),
            ("https_proxy", proxy.as_str()),
            ("NO_PROXY", "localhost,127.0.0.1"),
            ("no_proxy", "localhost,127.0.0.1"),
            // The kernel's environment is read-only (and a venv, where `pip --user` is
            // refused): packages go to the workspace, which persists and has the quota.
            ("PIP_TARGET", packages.as_str()),
            ("PYTHONPATH", packages.as_str()),
            // pip's own version check is one more request nobody asked for.
            ("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
            ("PIP_NO_INPUT", "1"),
        ]
        .into_iter()
        .chain(ca_bundle.into_iter().flat_map(|ca| {
            [
                ("PIP_CERT", ca),
                ("REQUESTS_CA_BUNDLE", ca),
                ("SSL_CERT_FILE", ca),
            ]
        }))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// Makes the packages directory in the user's workspace (owned by the kernel's
    /// identity), so it is on `sys.path` from the kernel's start: Python caches a missing
    /// path entry as "nothing here" until `importlib.invalidate_caches()`, so a package
    /// installed into a directory that did not exist would not import without a restart.
    /// Made beneath a descriptor of the workspace and never through a symlink: the
    /// workspace is the kernel's to change.
    fn prepare_packages(&self, user: &SandboxUser) -> Result<(), SandboxError> {
        use rustix::fs::{AtFlags, Mode};
        let workspace = self.inner.workspace(user)?;
        let io = |source: std::io::Error| SandboxError::Io {
            what: "cannot make the packages directory",
            path: workspace.join(PACKAGES_DIR),
            source,
        };
        let root = super::fsutil::open_tree_root(&workspace).map_err(io)?;
        let name = CString::new(PACKAGES_DIR).map_err(|e| io(std::io::Error::other(e)))?;
        match rustix::fs::mkdirat(&root, &name, Mode::from_raw_mode(0o755)) {
            Ok(()) => {}
            // Already there (or something the kernel put there: its own business).
            Err(rustix::io::Errno::EXIST) => return Ok(()),
            Err(e) => return Err(io(e.into())),
        }
        if let Some((uid, gid)) = self.inner.workspace_owner(user) {
            // SYMLINK_NOFOLLOW: a symlink swapped in meanwhile is changed itself, never
            // what it points to.
            rustix::fs::chownat(
                &root,
                &name,
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| io(e.into()))?;
        }
        Ok(())
    }

    /// Opens the session's listener in the kernel's namespace and serves it.
    async fn attach(
        &self,
        process: &dyn KernelProcess,
        user: &str,
        session: Uuid,
        port: u16,
    ) -> Result<ServeGuard, NotAttached> {
        let pid = process
            .network_pid()
            .await
            .ok_or(NotAttached::NoNetworkNamespace)?;
        let listener = super::netns::listen_in(pid, port)
            .await
            .map_err(|source| NotAttached::Listen { port, source })?;
        self.egress
            .serve(listener, user, session)
            .map_err(NotAttached::Serve)?
            .ok_or_else(|| NotAttached::NoPolicy(user.to_string()))
    }
}

/// Why a kernel could not be given its way out through the proxy.
#[derive(Debug, thiserror::Error)]
enum NotAttached {
    #[error("the sandbox cannot name the kernel's network namespace")]
    NoNetworkNamespace,
    #[error("cannot open the egress proxy's port {port} in the sandbox: {source}")]
    Listen {
        port: u16,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serve the egress proxy: {0}")]
    Serve(#[source] std::io::Error),
    #[error("user {0} has no egress policy")]
    NoPolicy(String),
}

/// A kernel with its egress listener: the listener ends with the handle.
struct EgressKernel {
    inner: Box<dyn KernelProcess>,
    guard: ServeGuard,
}

impl EgressKernel {
    /// The launched kernel, with its listener ending with its handle.
    fn wrap(launched: Launched, guard: ServeGuard) -> Launched {
        Launched {
            endpoints: launched.endpoints,
            process: Box::new(EgressKernel {
                inner: launched.process,
                guard,
            }),
        }
    }
}

#[async_trait]
impl KernelProcess for EgressKernel {
    async fn interrupt(&self) -> Result<(), SandboxError> {
        self.inner.interrupt().await
    }
    async fn wait(&self) -> ExitReason {
        self.inner.wait().await
    }
    async fn terminate(&self) {
        self.inner.terminate().await
    }
    fn memory_used(&self) -> Option<u64> {
        self.inner.memory_used()
    }
    fn release(&self) {
        self.inner.release()
    }
    fn kernel_id(&self) -> Option<Uuid> {
        self.inner.kernel_id()
    }
    async fn network_pid(&self) -> Option<i32> {
        self.inner.network_pid().await
    }
    fn fork_origin(&self) -> Option<super::fork::ForkOrigin> {
        self.inner.fork_origin()
    }
    fn hold_as_checkpoint(&self, hold: bool) -> Result<(), SandboxError> {
        self.inner.hold_as_checkpoint(hold)
    }
    fn can_hold_as_checkpoint(&self) -> bool {
        self.inner.can_hold_as_checkpoint()
    }
    fn continue_stopped(&self) {
        self.inner.continue_stopped()
    }
    fn set_live_oom_score(&self) -> Result<(), SandboxError> {
        self.inner.set_live_oom_score()
    }
    async fn settle(&self) {
        self.inner.settle().await
    }
    fn serves(&self, session: Uuid) {
        self.guard.attribute(session);
        self.inner.serves(session)
    }
}

#[async_trait]
impl Sandbox for EgressSandbox {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn check(&self) -> Result<(), SandboxError> {
        self.inner.check().await
    }
    async fn launch(&self, mut spec: LaunchSpec) -> Result<Launched, SandboxError> {
        let user = spec.user.name.clone();
        if !self.egress.has_policy(&user) {
            return self.inner.launch(spec).await;
        }
        let session = spec.session_id;
        let port = self.egress.port_for(&user, session);
        self.prepare_packages(&spec.user)?;
        spec.env
            .extend(Self::kernel_env(port, self.egress.ca_bundle()));
        let sandbox_user = spec.user.clone();
        let launched = self.inner.launch(spec).await?;
        match self
            .attach(launched.process.as_ref(), &user, session, port)
            .await
        {
            Ok(guard) => Ok(EgressKernel::wrap(launched, guard)),
            Err(reason) => {
                launched.process.terminate().await;
                Err(super::fsutil::launch_failed(&sandbox_user, reason))
            }
        }
    }
    fn workspace(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        self.inner.workspace(user)
    }
    fn workspace_owner(&self, user: &SandboxUser) -> Option<(u32, u32)> {
        self.inner.workspace_owner(user)
    }
    async fn user_idle(&self, user: &SandboxUser) {
        self.inner.user_idle(user).await
    }
    async fn shutdown(&self) {
        self.inner.shutdown().await
    }
    fn keeps_kernels(&self) -> bool {
        self.inner.keeps_kernels()
    }
    /// An adopted kernel gets its listener back on the port its environment names (the
    /// port is derived from the session id); if that fails it runs on without egress.
    async fn adopt(&self, spec: AdoptSpec) -> Result<Launched, AdoptError> {
        let (user, session) = (spec.user.name.clone(), spec.session_id);
        let launched = self.inner.adopt(spec).await?;
        if !self.egress.has_policy(&user) {
            return Ok(launched);
        }
        let port = self.egress.port_for(&user, session);
        match self
            .attach(launched.process.as_ref(), &user, session, port)
            .await
        {
            Ok(guard) => Ok(EgressKernel::wrap(launched, guard)),
            Err(why) => {
                tracing::warn!(%session, user, %why, "adopted kernel runs without egress");
                Ok(launched)
            }
        }
    }
    async fn discard_unadopted(&self) {
        self.inner.discard_unadopted().await
    }
    fn launch_timeout(&self) -> Duration {
        self.inner.launch_timeout()
    }
    /// Commands get no proxy: they are short-lived helpers, not the kernel.
    async fn run_command(&self, spec: CommandSpec) -> Result<RunningCommand, SandboxError> {
        self.inner.run_command(spec).await
    }
}
