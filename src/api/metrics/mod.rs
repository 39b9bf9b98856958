//! The broker's Prometheus metrics, exposed at `/metrics` in the OpenMetrics text format by
//! the official Rust client, `prometheus-client` (chosen over the `prometheus` crate: it is
//! the one the Prometheus project maintains, has typed label sets, needs no protobuf, and
//! writes OpenMetrics, which Prometheus scrapes natively).
//!
//! Two kinds of values:
//! - [`Metrics`] holds what happens over time, fed through plain methods
//!   ([`Metrics::execution_finished`], [`Metrics::kernel_started`], ...): histograms of
//!   execution duration, queue wait and kernel start, counters of executions by status,
//!   timeouts, restarts, deaths and expiries. Every family carries the sandbox backend as a
//!   `backend` label (`local` or `docker`), so dashboards of several brokers compare them.
//! - A [`Snapshot`] is what is true at scrape time (sessions by state, connections, the warm
//!   pool, memory reserved and used, the recording writer's counters, uptime); it is read by
//!   the handler and rendered beside the families. Memory per session is shown for the
//!   scraping token's own sessions only (a user sees only its own sessions, here too);
//!   across all users only totals, without names.
//!
//! Names: every family is prefixed `kernel_broker_`. OpenMetrics counters end in `_total`
//! (the writer adds it), so `kernel_broker_uptime_seconds`, a counter when the text was
//! written by hand, is a gauge now: same name, same value.

use std::time::Duration;

mod egress;
mod snapshot;

pub use snapshot::{RecordingSnapshot, Snapshot};

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use super::shapes::ExecutionStatusJson;
use crate::session::{Direction, ExecutionStatus, LifecycleEvent, Recorder, Session};
use crate::wire::{Channel, Message};

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// What `/metrics` answers a scraper that does not ask for OpenMetrics: Prometheus' text
/// format 0.0.4, which reads the same body (`# EOF` and `# UNIT` are comments to it).
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const PREFIX: &str = "kernel_broker";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabel {
    backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    backend: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// Why a client connection was refused at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `max_connections` were open.
    MaxConnections,
    /// `max_connections_per_client` were open from the same address.
    MaxConnectionsPerClient,
    /// `accept` itself failed: the broker had no descriptor for the connection (counted
    /// once per failed accept; the descriptor budget is there to keep this at 0).
    Descriptors,
}

impl Refusal {
    const ALL: [Refusal; 3] = [
        Refusal::MaxConnections,
        Refusal::MaxConnectionsPerClient,
        Refusal::Descriptors,
    ];
    fn label(self) -> ReasonLabel {
        let reason = match self {
            Refusal::MaxConnections => "max_connections",
            Refusal::MaxConnectionsPerClient => "max_connections_per_client",
            Refusal::Descriptors => "descriptors",
        };
        ReasonLabel { reason }
    }
}

/// Why a request was answered 429 before it reached its handler's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// `max_websockets_per_session` WebSockets were open on the session.
    WebSocketsPerSession,
    /// `max_websockets_per_user` WebSockets were open by the user.
    WebSocketsPerUser,
    /// `max_requests_per_user` requests of the user were in progress.
    RequestsPerUser,
    /// The client's address was blocked for failed authentications.
    AuthFailures,
}

impl Refused {
    const ALL: [Refused; 4] = [
        Refused::WebSocketsPerSession,
        Refused::WebSocketsPerUser,
        Refused::RequestsPerUser,
        Refused::AuthFailures,
    ];
    fn label(self) -> ReasonLabel {
        let reason = match self {
            Refused::WebSocketsPerSession => "websockets_per_session",
            Refused::WebSocketsPerUser => "websockets_per_user",
            Refused::RequestsPerUser => "requests_per_user",
            Refused::AuthFailures => "auth_failures",
        };
        ReasonLabel { reason }
    }
}

/// Which client time limit closed a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientTimeout {
    /// The request line and headers (or the next request of an idle keep-alive
    /// connection) did not arrive within `client_header_timeout`.
    Header,
    /// The request body did not arrive within `client_body_timeout`.
    Body,
    /// A WebSocket client did not answer a ping within `websocket_pong_timeout`.
    WebSocketPong,
}

impl ClientTimeout {
    const ALL: [ClientTimeout; 3] = [
        ClientTimeout::Header,
        ClientTimeout::Body,
        ClientTimeout::WebSocketPong,
    ];
    fn label(self) -> ReasonLabel {
        let reason = match self {
            ClientTimeout::Header => "header",
            ClientTimeout::Body => "body",
            ClientTimeout::WebSocketPong => "websocket_pong",
        };
        ReasonLabel { reason }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SessionLabel {
    session: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HolderLabel {
    holder: &'static str,
}

/// Executions: 5 ms to ~11 min (the longest timeouts).
fn execution_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 18))
}

/// Queue wait: 1 ms to ~65 s.
fn queue_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Kernel start: 50 ms to ~100 s (a cold Docker container is seconds).
fn start_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 2.0, 12))
}

/// The metrics fed as things happen. Cheap to share (`Arc`); every method is lock-free.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    backend: BackendLabel,
    execution_duration: Family<BackendLabel, Histogram, fn() -> Histogram>,
    queue_wait: Family<BackendLabel, Histogram, fn() -> Histogram>,
    kernel_start: Family<BackendLabel, Histogram, fn() -> Histogram>,
    executions: Family<StatusLabels, Counter>,
    timeouts: Family<BackendLabel, Counter>,
    restarts: Family<BackendLabel, Counter>,
    deaths: Family<BackendLabel, Counter>,
    expiries: Family<BackendLabel, Counter>,
    connections_refused: Family<ReasonLabel, Counter>,
    connections_timed_out: Family<ReasonLabel, Counter>,
    client_connections: Gauge,
    requests_refused: Family<ReasonLabel, Counter>,
    auth_failures: Counter,
}

impl Metrics {
    /// The metrics of a broker whose sandbox backend is `backend` (`local`, `docker`).
    pub fn new(backend: &str) -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let execution_duration =
            Family::<_, _, fn() -> Histogram>::new_with_constructor(execution_histogram as _);
        let queue_wait =
            Family::<_, _, fn() -> Histogram>::new_with_constructor(queue_histogram as _);
        let kernel_start =
            Family::<_, _, fn() -> Histogram>::new_with_constructor(start_histogram as _);
        let executions = Family::default();
        let timeouts = Family::default();
        let restarts = Family::default();
        let deaths = Family::default();
        let expiries = Family::default();
        registry.register_with_unit(
            "execution_duration",
            "Time from an execution's start on the kernel to its result.",
            Unit::Seconds,
            execution_duration.clone(),
        );
        registry.register_with_unit(
            "execution_queue_wait",
            "Time an execution waited in its session's queue before it started.",
            Unit::Seconds,
            queue_wait.clone(),
        );
        registry.register_with_unit(
            "kernel_start",
            "Time from launching a kernel to its readiness.",
            Unit::Seconds,
            kernel_start.clone(),
        );
        registry.register(
            "executions",
            "Executions finished, by status (ok, error, timeout, interrupted, dead).",
            executions.clone(),
        );
        registry.register(
            "execution_timeouts",
            "Executions interrupted at their timeout.",
            timeouts.clone(),
        );
        registry.register("kernel_restarts", "Kernel restarts.", restarts.clone());
        registry.register(
            "kernel_deaths",
            "Kernels that died or broke the protocol.",
            deaths.clone(),
        );
        registry.register(
            "session_expiries",
            "Sessions expired after their idle timeout.",
            expiries.clone(),
        );
        let connections_refused = Family::<ReasonLabel, Counter>::default();
        let connections_timed_out = Family::<ReasonLabel, Counter>::default();
        let client_connections = Gauge::default();
        registry.register(
            "connections_refused",
            "Client connections closed at accept, by the cap they hit (max_connections, max_connections_per_client).",
            connections_refused.clone(),
        );
        registry.register(
            "connections_timed_out",
            "Client connections closed by a time limit (header, body, websocket_pong).",
            connections_timed_out.clone(),
        );
        registry.register(
            "client_connections",
            "Client TCP connections open now.",
            client_connections.clone(),
        );
        let requests_refused = Family::<ReasonLabel, Counter>::default();
        let auth_failures = Counter::default();
        registry.register(
            "requests_refused",
            "Requests answered 429 by a client cap (websockets_per_session, websockets_per_user, requests_per_user, auth_failures).",
            requests_refused.clone(),
        );
        registry.register(
            "auth_failures",
            "Requests whose token matched no user.",
            auth_failures.clone(),
        );
        for r in Refusal::ALL {
            let _ = connections_refused.get_or_create(&r.label());
        }
        for t in ClientTimeout::ALL {
            let _ = connections_timed_out.get_or_create(&t.label());
        }
        for r in Refused::ALL {
            let _ = requests_refused.get_or_create(&r.label());
        }
        let backend = BackendLabel {
            backend: backend.to_string(),
        };
        // Each family has its backend's series from the start, so a rate is 0, not absent.
        for f in [&timeouts, &restarts, &deaths, &expiries] {
            let _ = f.get_or_create(&backend);
        }
        Self {
            registry,
            backend,
            execution_duration,
            queue_wait,
            kernel_start,
            executions,
            timeouts,
            restarts,
            deaths,
            expiries,
            connections_refused,
            connections_timed_out,
            client_connections,
            requests_refused,
            auth_failures,
        }
    }

    /// A request was answered 429 by the cap `why`.
    pub fn request_refused(&self, why: Refused) {
        self.requests_refused.get_or_create(&why.label()).inc();
    }

    /// A request's token matched no user.
    pub fn auth_failed(&self) {
        self.auth_failures.inc();
    }

    /// A client connection was closed at accept because of `why`.
    pub fn connection_refused(&self, why: Refusal) {
        self.connections_refused.get_or_create(&why.label()).inc();
    }

    /// A client connection was closed by the time limit `which`.
    pub fn connection_timed_out(&self, which: ClientTimeout) {
        self.connections_timed_out
            .get_or_create(&which.label())
            .inc();
    }

    /// The number of client connections open now went up (`+1`) or down (`-1`).
    pub fn client_connections_changed(&self, by: i64) {
        self.client_connections.inc_by(by);
    }

    /// An execution finished after running for `duration`; its `status` is the label by
    /// its JSON name (`ok`, `error`, `timeout`, `interrupted`, `dead`).
    pub fn execution_finished(&self, duration: Duration, status: ExecutionStatus) {
        let status = match ExecutionStatusJson::from(status) {
            ExecutionStatusJson::Ok => "ok",
            ExecutionStatusJson::Error => "error",
            ExecutionStatusJson::Timeout => "timeout",
            ExecutionStatusJson::Interrupted => "interrupted",
            ExecutionStatusJson::Dead => "dead",
        };
        self.execution_duration
            .get_or_create(&self.backend)
            .observe(duration.as_secs_f64());
        self.executions
            .get_or_create(&StatusLabels {
                backend: self.backend.backend.clone(),
                status: status.to_string(),
            })
            .inc();
    }

    /// An execution left its session's queue after `wait`.
    pub fn execution_queued(&self, wait: Duration) {
        self.queue_wait
            .get_or_create(&self.backend)
            .observe(wait.as_secs_f64());
    }

    /// A kernel became ready `duration` after its launch.
    pub fn kernel_started(&self, duration: Duration) {
        self.kernel_start
            .get_or_create(&self.backend)
            .observe(duration.as_secs_f64());
    }

    pub fn timed_out(&self) {
        self.timeouts.get_or_create(&self.backend).inc();
    }

    pub fn restarted(&self) {
        self.restarts.get_or_create(&self.backend).inc();
    }

    pub fn died(&self) {
        self.deaths.get_or_create(&self.backend).inc();
    }

    pub fn expired(&self) {
        self.expiries.get_or_create(&self.backend).inc();
    }

    /// Counts one lifecycle event of a session.
    pub fn observe(&self, event: &LifecycleEvent) {
        let secs = |s: f64| Duration::try_from_secs_f64(s).unwrap_or_default();
        match event {
            LifecycleEvent::KernelStarted {
                startup_seconds, ..
            } => self.kernel_started(secs(*startup_seconds)),
            LifecycleEvent::ExecutionStarted {
                queue_wait_seconds, ..
            } => self.execution_queued(secs(*queue_wait_seconds)),
            LifecycleEvent::ExecutionDone { execution, .. } => {
                self.execution_finished(secs(execution.duration_ms / 1000.0), execution.status)
            }
            LifecycleEvent::ExecutionTimeout { .. } => self.timed_out(),
            LifecycleEvent::KernelRestarted { .. } => self.restarted(),
            LifecycleEvent::KernelDied { .. } => self.died(),
            LifecycleEvent::SessionExpired => self.expired(),
            LifecycleEvent::SessionCreated { .. }
            | LifecycleEvent::SessionForked { .. }
            | LifecycleEvent::CheckpointTaken { .. }
            | LifecycleEvent::CheckpointDropped { .. }
            | LifecycleEvent::SessionRewound { .. }
            | LifecycleEvent::SessionPaused { .. }
            | LifecycleEvent::SessionResumed { .. }
            | LifecycleEvent::Interrupt
            | LifecycleEvent::ExecutionRefused { .. }
            | LifecycleEvent::OutputCut { .. }
            | LifecycleEvent::SessionClosed { .. }
            | LifecycleEvent::SessionDetached { .. }
            | LifecycleEvent::SessionKept
            | LifecycleEvent::BrokerRestarted { .. }
            // Egress is counted where its limits are kept (`Snapshot::egress`).
            | LifecycleEvent::EgressAllowed { .. }
            | LifecycleEvent::EgressRefused { .. }
            | LifecycleEvent::EgressClosed { .. }
            | LifecycleEvent::FileWritten { .. }
            | LifecycleEvent::FileRemoved { .. }
            | LifecycleEvent::FileRenamed { .. }
            | LifecycleEvent::CommandStarted { .. }
            | LifecycleEvent::CommandEnded { .. } => {}
        }
    }

    /// The exposition: the scrape-time values of `now`, then the families, then `# EOF`.
    pub fn render(&self, now: &Snapshot) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail: fmt::Write for String is infallible, and the
        // encoder's only other errors come from the writer.
        let _ = encode_registry(&mut out, &now.registry());
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_eof(&mut out);
        out
    }
}

pub(super) fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A gauge holding `v`.
pub(super) trait DefaultWith {
    fn default_with(v: i64) -> Self;
}

impl DefaultWith for Gauge<i64> {
    fn default_with(v: i64) -> Self {
        let g = Gauge::<i64>::default();
        g.set(v);
        g
    }
}

/// The metrics hear what the recording hears: the session layer reports to both.
impl Recorder for Metrics {
    fn message(&self, _: &Session, _: Direction, _: Channel, _: &Message) {}

    fn event(&self, _: &Session, event: &LifecycleEvent) {
        self.observe(event);
    }

    fn barrier(&self) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
}

#[cfg(test)]
mod tests;
