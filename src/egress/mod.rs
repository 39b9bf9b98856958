//! Egress: the HTTP(S) forward proxy through which kernels of users with a network policy
//! reach the hosts their policy allows (issue 15), and nothing else.
//!
//! Kernels have no network interface but loopback (bubblewrap's `--unshare-net`, Docker's
//! `network_mode: none`). For a user with a policy, the sandbox layer opens a listener on
//! `127.0.0.1:<port>` *inside* the kernel's network namespace (`sandbox/egress.rs`) and
//! hands it to [`Egress::serve`]; the accepted connections are served here, in the broker's
//! own event loop, outside every sandbox. So the proxy needs no host interface, no bridge
//! and no forwarder process in the sandbox.
//!
//! Layout:
//! - `policy.rs`: allowlists of hosts (`*.domain` wildcards, public IP literals) and ports;
//! - `address.rs`: which resolved addresses may be connected to (public unicast only);
//! - `proxy.rs`: one client connection: HTTP/1.1 by hyper, `CONNECT` tunnels (no TLS
//!   interception) and plain `http://` requests forwarded;
//! - `meter.rs`: per-user limits (bytes, concurrent connections) and counters.
//!
//! This module knows nothing of sandboxes or sessions: a served listener is attributed to
//! a session id and a user, and what happens is reported to an [`EgressObserver`] (the
//! server turns it into recording events).

mod address;
mod error;
mod meter;
mod policy;
mod proxy;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use address::{check as check_address, check_exemption, Blocked};
pub use error::PolicyError;
pub use ipnet::IpNet;
pub use meter::{UserLimits as EgressLimits, UserUsage};
pub use policy::{Policy, Refusal, DEFAULT_PORTS};

use crate::sync::lock;
use meter::UserMeter;

/// Where `pip install` puts packages inside the sandbox: in the user's workspace, so they
/// persist for the user and count against the workspace quota.
pub const PACKAGES_DIR: &str = ".python-packages";

/// Where a CA bundle the operator gives (`--egress-ca-file`) is shown, read-only, in every
/// sandbox: a neutral path, so no host path is named inside.
pub const CA_FILE_INSIDE: &str = "/etc/kernel-broker-ca.pem";

/// One user's network policy and limits, as configured.
#[derive(Debug, Clone, PartialEq)]
pub struct UserEgress {
    pub policy: Policy,
    pub limits: EgressLimits,
}

/// The egress settings: a policy for each user who has one (users not listed have no
/// network at all), and the proxy's timeouts.
#[derive(Debug, Clone, Default)]
pub struct EgressConfig {
    pub users: HashMap<String, UserEgress>,
    /// The CA bundle (a path inside the sandbox) pip, requests and Python's `ssl` trust in
    /// kernels with egress; `None`: their own defaults (pip's is certifi's, which knows no
    /// CA a site added to its system store).
    pub ca_bundle: Option<String>,
}

impl EgressConfig {
    /// Whether any user has a policy (else no proxy runs at all).
    pub fn enabled(&self) -> bool {
        !self.users.is_empty()
    }
}

/// What happened to one request through the proxy, for the session's recording.
#[derive(Debug, Clone, PartialEq)]
pub enum EgressEvent {
    /// The request passed the policy and the proxy connected to `address`.
    Allowed {
        method: String,
        host: String,
        port: u16,
        address: String,
    },
    /// The request was refused before any outbound connection; `reason` is the sentence
    /// the kernel was answered with.
    Refused {
        method: String,
        host: String,
        port: u16,
        reason: String,
    },
    /// An allowed connection ended: bytes sent to the host and received from it.
    Closed {
        host: String,
        port: u16,
        bytes_sent: u64,
        bytes_received: u64,
        seconds: f64,
    },
}

/// Who receives the reports (the server: recording and logs). Must not block.
pub trait EgressObserver: Send + Sync {
    fn report(&self, session: Uuid, user: &str, event: EgressEvent);
}

/// The proxy's time limits (fixed: they bound what a hostile client can hold, not what a
/// well-behaved one needs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// From accept to the end of the request's headers (slowloris, or a silent client).
    pub header: Duration,
    /// Resolving the host name.
    pub resolve: Duration,
    /// Connecting to the host.
    pub connect: Duration,
    /// A tunnel or forwarded exchange with no byte either way for this long is closed.
    pub idle: Duration,
}

const TIMEOUTS: Timeouts = Timeouts {
    header: Duration::from_secs(10),
    resolve: Duration::from_secs(10),
    connect: Duration::from_secs(10),
    idle: Duration::from_secs(120),
};

/// The broker's egress proxy: every user's policy and meter, and the observer.
pub struct Egress {
    users: HashMap<String, Arc<UserMeter>>,
    ca_bundle: Option<String>,
    observer: OnceLock<Arc<dyn EgressObserver>>,
    /// Ports handed out and still served, per user (a user's kernels may share a network
    /// namespace: a fork-server template, a Docker container).
    ports: Mutex<HashMap<String, Vec<u16>>>,
}

/// First and last port of the range the proxy listens on inside sandboxes.
const PORT_FIRST: u16 = 20_000;
const PORT_COUNT: u16 = 40_000;

impl Egress {
    pub fn new(config: &EgressConfig) -> Arc<Self> {
        let users = config
            .users
            .iter()
            .map(|(name, u)| (name.clone(), Arc::new(UserMeter::new(u.clone()))))
            .collect();
        Arc::new(Self {
            users,
            ca_bundle: config.ca_bundle.clone(),
            observer: OnceLock::new(),
            ports: Mutex::new(HashMap::new()),
        })
    }

    /// Sets who hears about requests (once; later calls are ignored).
    pub fn observe(&self, observer: Arc<dyn EgressObserver>) {
        let _ = self.observer.set(observer);
    }

    /// The CA bundle kernels trust (see [`EgressConfig::ca_bundle`]).
    pub fn ca_bundle(&self) -> Option<&str> {
        self.ca_bundle.as_deref()
    }

    /// Whether `user` has a network policy.
    pub fn has_policy(&self, user: &str) -> bool {
        self.users.contains_key(user)
    }

    /// The port for `session`'s listener: derived from the session id (so an adopted
    /// kernel finds its proxy on the same port after a broker restart) and not one this
    /// user's other live listeners hold.
    pub fn port_for(&self, user: &str, session: Uuid) -> u16 {
        let held = lock(&self.ports).get(user).cloned().unwrap_or_default();
        let seed = (session.as_u128() % u128::from(PORT_COUNT)) as u16;
        (0..PORT_COUNT)
            .map(|i| PORT_FIRST + (seed + i) % PORT_COUNT)
            .find(|p| !held.contains(p))
            .unwrap_or(PORT_FIRST + seed)
    }

    /// Serves the proxy on `listener` (bound inside `session`'s network namespace) for
    /// `user` until the returned guard is dropped. `None` when the user has no policy.
    pub fn serve(
        self: &Arc<Self>,
        listener: std::net::TcpListener,
        user: &str,
        session: Uuid,
    ) -> std::io::Result<Option<ServeGuard>> {
        let Some(meter) = self.users.get(user).cloned() else {
            return Ok(None);
        };
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let listener = tokio::net::TcpListener::from_std(listener)?;
        lock(&self.ports)
            .entry(user.to_string())
            .or_default()
            .push(port);
        let stop = CancellationToken::new();
        let attribution = Arc::new(Mutex::new(session));
        let ctx = Arc::new(proxy::Context {
            meter,
            user: user.to_string(),
            session: attribution.clone(),
            egress: self.clone(),
            timeouts: TIMEOUTS,
        });
        tokio::spawn(proxy::accept_loop(listener, ctx, stop.clone()));
        Ok(Some(ServeGuard {
            stop,
            attribution,
            egress: self.clone(),
            user: user.to_string(),
            port,
        }))
    }

    /// Each user's counters, for `/metrics`.
    pub fn usage(&self) -> Vec<UserUsage> {
        let mut all: Vec<_> = self.users.iter().map(|(name, m)| m.usage(name)).collect();
        all.sort_by(|a, b| a.user.cmp(&b.user));
        all
    }

    fn report(&self, session: Uuid, user: &str, event: EgressEvent) {
        match &event {
            EgressEvent::Refused { reason, .. } => {
                tracing::info!(%session, user, %reason, "egress refused")
            }
            EgressEvent::Allowed {
                method,
                host,
                port,
                address,
            } => tracing::debug!(%session, user, method, host, port, address, "egress allowed"),
            EgressEvent::Closed { .. } => {}
        }
        if let Some(o) = self.observer.get() {
            o.report(session, user, event);
        }
    }

    fn release_port(&self, user: &str, port: u16) {
        if let Some(ports) = lock(&self.ports).get_mut(user) {
            ports.retain(|p| *p != port);
        }
    }
}

/// A listener being served; dropping it stops the accept loop (connections already
/// accepted finish on their own time limits).
pub struct ServeGuard {
    stop: CancellationToken,
    attribution: Arc<Mutex<Uuid>>,
    egress: Arc<Egress>,
    user: String,
    port: u16,
}

impl ServeGuard {
    /// Attributes later requests to `session` (a pooled kernel handed to a session).
    pub fn attribute(&self, session: Uuid) {
        *lock(&self.attribution) = session;
    }

    /// The port served, inside the sandbox.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for ServeGuard {
    fn drop(&mut self) {
        self.stop.cancel();
        self.egress.release_port(&self.user, self.port);
    }
}

#[cfg(test)]
mod tests;
