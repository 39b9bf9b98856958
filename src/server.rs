//! Wires the layers together: builds the sandbox from the settings, the session registry,
//! the HTTP router, and serves until the shutdown signal; then drains every session.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::api::{self, ApiLimits, AppState};
use crate::config::{SandboxKind, Settings, TokenSource};
use crate::egress::Egress;
use crate::kernel::spec::KernelSpecs;
use crate::sandbox::docker::{DockerSandbox, DockerSandboxConfig};
use crate::sandbox::egress::EgressSandbox;
use crate::sandbox::local::{LocalSandbox, LocalSandboxConfig};
use crate::sandbox::Sandbox;
use crate::session::{EndedBy, Registry};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Sandbox(#[from] crate::sandbox::SandboxError),
    #[error("could not listen on {addr}: {source} (another broker or program may use it: give this one another address with --listen)")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    KernelSpecs(#[from] crate::kernel::spec::SpecError),
    #[error(transparent)]
    Recording(#[from] crate::recording::RecordingError),
    #[error("the server failed: {0}")]
    Serve(#[source] std::io::Error),
    #[error(transparent)]
    Lock(#[from] crate::instance_lock::LockError),
    #[error(transparent)]
    Cluster(#[from] crate::cluster::ClusterError),
    #[error(transparent)]
    Token(#[from] crate::kept_token::TokenFileError),
    #[error("could not create the data directory {path}: {source}")]
    DataDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The kernel specs of the kernels directory, read once. The Docker backend brings its own
/// `python3` kernel, so without a kernels directory it offers that one.
pub fn load_kernel_specs(settings: &Settings) -> Result<Arc<KernelSpecs>, ServerError> {
    match KernelSpecs::load(&settings.kernels_dir) {
        Ok(specs) if settings.sandbox == SandboxKind::Local => {
            // A spec whose program this host lacks (R, a JDK: `scripts/setup` installs
            // them) is not offered, rather than failing at every launch.
            let venv_bin = settings.local.python.parent().map(Path::to_path_buf);
            let (found, missing) = specs.retained(|s| local_program_found(s, venv_bin.as_deref()));
            for name in &missing {
                let program = specs.get(name).and_then(|s| s.argv.first()).cloned();
                tracing::warn!(kernel = %name, program = ?program, "kernel spec left out: its program is not installed on this host (scripts/setup installs the runtimes of the shipped kernels)");
            }
            if found.iter().next().is_none() {
                return Ok(Arc::new(specs));
            }
            Ok(Arc::new(found))
        }
        Ok(specs) => Ok(Arc::new(specs)),
        Err(e) if settings.sandbox == SandboxKind::Docker => {
            tracing::info!(error = %e, "no kernel specs; offering the image's python3");
            Ok(Arc::new(KernelSpecs::builtin_python3(
                &settings.kernels_dir,
            )))
        }
        Err(e) => Err(ServerError::KernelSpecs(e)),
    }
}

/// Whether a spec's program is on this host, where the local sandbox would find it: the
/// kernels' Python and what is placed by substitution always are; a bare name is looked up
/// in the kernels' environment's `bin` and the sandbox's `PATH` (`/usr/local/bin`,
/// `/usr/bin`, `/bin`); an absolute path must exist.
fn local_program_found(spec: &crate::kernel::spec::KernelSpec, venv_bin: Option<&Path>) -> bool {
    let Some(program) = spec.argv.first() else {
        return false;
    };
    if matches!(program.as_str(), "python" | "python3") || program.contains('{') {
        return true;
    }
    if program.starts_with('/') {
        return Path::new(program).is_file();
    }
    venv_bin
        .into_iter()
        .chain(["/usr/local/bin", "/usr/bin", "/bin"].map(Path::new))
        .any(|dir| dir.join(program).is_file())
}

pub async fn build_sandbox(
    settings: &Settings,
    specs: Arc<KernelSpecs>,
) -> Result<Arc<dyn Sandbox>, ServerError> {
    let sandbox: Arc<dyn Sandbox> = match settings.sandbox {
        SandboxKind::Local => Arc::new(LocalSandbox::new(LocalSandboxConfig {
            kernel_specs: Some(specs),
            ..settings.local.clone()
        })?),
        SandboxKind::Docker => Arc::new(DockerSandbox::new(DockerSandboxConfig {
            kernel_specs: Some(specs),
            ..settings.docker.clone()
        })?),
    };
    sandbox.check().await?;
    Ok(sandbox)
}

/// The sandbox with the egress proxy in front of its kernels' launches, when a user has a
/// network policy (else the sandbox as it is: no proxy runs at all).
fn with_egress(
    sandbox: Arc<dyn Sandbox>,
    settings: &Settings,
) -> (Arc<dyn Sandbox>, Option<Arc<Egress>>) {
    if !settings.egress.enabled() {
        return (sandbox, None);
    }
    let egress = Egress::new(&settings.egress);
    for (user, e) in &settings.egress.users {
        tracing::info!(user, hosts = ?e.policy.patterns(), ports = ?e.policy.ports().collect::<Vec<_>>(),
            max_bytes = e.limits.max_bytes, max_connections = e.limits.max_connections,
            "egress policy");
    }
    let wrapped: Arc<dyn Sandbox> = Arc::new(EgressSandbox::new(sandbox, egress.clone()));
    (wrapped, Some(egress))
}

/// The recording store, unless recording is off.
pub fn open_recording(
    settings: &Settings,
) -> Result<Option<Arc<crate::recording::RecordingStore>>, ServerError> {
    match &settings.recording {
        None => {
            tracing::info!("recording is off");
            Ok(None)
        }
        Some(config) => Ok(Some(crate::recording::RecordingStore::open(
            config.clone(),
        )?)),
    }
}

/// Run the broker on `settings.listen` until `shutdown` resolves, then shut every session down.
pub async fn run(
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let listener =
        TcpListener::bind(settings.listen)
            .await
            .map_err(|source| ServerError::Listen {
                addr: settings.listen,
                source,
            })?;
    serve(settings, listener, shutdown).await
}

/// Run the broker on a bound listener (tests bind port 0).
pub async fn serve(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    std::fs::create_dir_all(&settings.data_dir).map_err(|source| ServerError::DataDir {
        path: settings.data_dir.clone(),
        source,
    })?;
    let addr = listener.local_addr().map_err(ServerError::Serve)?;
    // Before anything is swept: the leftovers under this data directory are ours only if
    // no other broker is running on it.
    let _lock = crate::instance_lock::InstanceLock::acquire(&settings.data_dir, &addr.to_string())?;
    let mut settings = settings;
    if settings.token_source == TokenSource::Generated {
        // Made on the first run on this data directory, then kept (kept_token.rs).
        let (token, made) =
            crate::kept_token::keep_or_reuse(&settings.data_dir, &settings.users[0].token)?;
        settings.users[0].token = token;
        settings.token_source = TokenSource::Kept { made };
    }
    let kernelspecs = load_kernel_specs(&settings)?;
    let clients = budget_descriptors(&settings, kernelspecs.names().len());
    // The kernels' own output lines are masked before the log (`secrets::book`).
    let secret_book = Arc::new(crate::secrets::SecretBook::new(settings.credentials()));
    settings.local.log_filter = Some(secret_book.log_filter());
    settings.docker.log_filter = settings.local.log_filter.clone();
    let sandbox = build_sandbox(&settings, kernelspecs.clone()).await?;
    let (sandbox, egress) = with_egress(sandbox, &settings);
    if !settings.keep_sessions {
        // A run without --keep-sessions ends what an earlier run kept (the sandbox has
        // swept its kernels): their records must not bring them back later.
        forget_kept_sessions(&settings.data_dir.join("sessions"));
    }
    if let (Some(dir), Some(recording)) = (&settings.session.keep_dir, &mut settings.recording) {
        // The recordings of kept sessions stay open, to be continued.
        recording.kept_sessions = kept_session_ids(dir);
    }
    if let (Some(dir), Some(recording)) = (&settings.session.paused_dir, &mut settings.recording) {
        // So do paused sessions' (issue 37).
        recording.kept_sessions.extend(kept_session_ids(dir));
    }
    let recording = open_recording(&settings)?;
    let metrics = Arc::new(api::metrics::Metrics::new(settings.sandbox_name()));
    // The session layer reports to the recording (when on) and to the metrics.
    let mut recorders: Vec<Arc<dyn crate::session::Recorder>> = vec![metrics.clone()];
    if let Some(store) = &recording {
        recorders.insert(0, store.clone());
    }
    let recorder: Arc<dyn crate::session::Recorder> =
        Arc::new(crate::session::Recorders(recorders));
    // Specs that keep fewer pooled kernels (`metadata.kernel_broker.pool_size`).
    let mut session_config = settings.session.clone();
    // Kernels that cannot be copied (forks, checkpoints, pause): those not started as
    // ipykernel (`boot.rs`).
    session_config.not_copyable = Arc::new(
        kernelspecs
            .iter()
            .filter(|s| crate::sandbox::boot::ipykernel_args(&s.argv).is_none())
            .map(|s| s.name.clone())
            .collect(),
    );
    session_config.pool.per_kernel = Arc::new(
        kernelspecs
            .iter()
            .filter_map(|s| {
                Some((
                    s.name.clone(),
                    crate::sandbox::boot::spec_pool_size(&s.raw)?,
                ))
            })
            .collect(),
    );
    session_config.secret_book = secret_book;
    let sealer = crate::secrets::seal::Sealer::open(&settings.data_dir);
    session_config.sealer = Some(sealer.map_err(|source| ServerError::DataDir {
        path: settings.data_dir.join(crate::secrets::seal::KEY_FILE),
        source,
    })?);
    session_config.policy = settings.policy.clone();
    session_config.languages = Arc::new(kernelspecs.languages());
    let registry = Registry::new(sandbox, session_config, kernelspecs.names(), recorder);
    if let Some(egress) = &egress {
        // The proxy's reports reach the recording through the session layer, as the rest.
        egress.observe(Arc::new(registry.clone()));
    }
    let users: Vec<_> = settings
        .users
        .iter()
        .map(|u| crate::sandbox::SandboxUser {
            name: u.name.clone(),
            index: u.index,
            limits: u.limits.clone(),
        })
        .collect();
    if settings.keep_sessions {
        registry.adopt_kept(&users).await;
    }
    // Paused sessions outlive the broker, with or without --keep-sessions (issue 37).
    registry.adopt_paused(&users).await;
    // So do snapshots.
    registry.adopt_snapshots(&users).await;
    // What came back pauses by itself as its user's settings say now (a create sets it).
    for user in &settings.users {
        for session in registry.list(&user.name) {
            session.set_pause_policy(user.pause);
        }
    }
    let cluster = match &settings.cluster {
        Some(c) => {
            let cluster = crate::cluster::Cluster::join(c.clone()).await?;
            let r = registry.clone();
            cluster.set_load(move || {
                let m = r.memory_use_all();
                crate::cluster::Load {
                    sessions: m.sessions as u64,
                    memory_reserved: m.total_bytes(),
                }
            });
            let r = registry.clone();
            cluster.set_listed(move || {
                r.all()
                    .iter()
                    .map(|s| crate::cluster::Listed {
                        id: s.id,
                        user: s.user.name.clone(),
                        kernel: s.kernel_name.clone(),
                        created_at: s.created_at.timestamp_micros(),
                        paused: s.state() == crate::session::SessionState::Paused,
                    })
                    .collect()
            });
            cluster.on_node_lost(Box::new(|client, node, kept| {
                Box::pin(async move {
                    crate::recording::close_lost_node(client, node, kept)
                        .await
                        .map_err(Into::into)
                })
            }));
            let r = registry.clone();
            cluster.on_lost(move |kept, taken| {
                let r = r.clone();
                Box::pin(async move { r.end_declared_lost(&kept, &taken).await })
            });
            if cluster.carries_paused() {
                api::start_carrying_paused(&registry, &cluster, &settings.users).await;
            }
            // Back after the cluster declared this node lost: what it answered dead while
            // this node was away, and a restart took back (a kept kernel, a session paused
            // too late for the directory to know), ends here too.
            match cluster.declared_dead_here().await {
                Ok(dead) => {
                    let ending: Vec<_> = registry
                        .all()
                        .into_iter()
                        .filter(|s| dead.contains(&s.id))
                        .collect();
                    if !ending.is_empty() {
                        tracing::warn!(sessions = ending.len(), "cluster: sessions taken back that the cluster declared dead while this node was lost: ending them");
                    }
                    for s in ending {
                        let _ = registry.delete(&s.user.name, s.id, EndedBy::NodeLost).await;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cluster: could not read which sessions of this node the cluster declared dead")
                }
            }
            Some(cluster)
        }
        None => None,
    };
    let state = AppState {
        registry: registry.clone(),
        users: Arc::new(api::auth::Users::new(
            settings.users.iter().cloned().map(Arc::new),
        )),
        limits: Arc::new(ApiLimits {
            max_code_bytes: settings.max_code_bytes,
            max_file_bytes: settings.max_file_bytes,
            execution_timeout: settings.session.execution_timeout,
            max_execution_timeout: settings.session.max_execution_timeout,
            clients: clients.clone(),
        }),
        started: std::time::Instant::now(),
        kernelspecs,
        jupyter_clients: Default::default(),
        recording: recording.clone(),
        metrics,
        user_load: Arc::new(api::user_load::UserLoad::new(
            clients.max_requests_per_user,
            clients.max_websockets_per_user,
        )),
        auth_failures: Arc::new(api::auth_failures::AuthFailures::new(
            clients.max_auth_failures,
        )),
        stopping: Default::default(),
        egress,
        cluster: cluster.clone(),
        uploads: Arc::new(api::extract::upload_budgets(settings.max_file_bytes)),
    };
    // Summarises and forgets the failed-authentication records whose window is over.
    let sweeper = {
        let failures = state.auth_failures.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(api::auth_failures::WINDOW);
            loop {
                every.tick().await;
                failures.sweep(std::time::Instant::now());
            }
        })
    };
    if let TokenSource::Kept { made } = settings.token_source {
        // Printed at every start, as Jupyter does, so the operator can connect.
        eprintln!(
            "kernel-broker: no users file and no KERNEL_BROKER_TOKEN; the token of user 'default' ({how} {path}; `kernel-broker token` prints it):\n    {token}\n    e.g. curl -H 'Authorization: Bearer {token}' http://{addr}/v1/sessions\n    session browser: http://{addr}/ui/?token={token}",
            how = if made { "made now and kept in" } else { "kept in" },
            path = settings.data_dir.join(crate::kept_token::TOKEN_FILE).display(),
            token = settings.users[0].token,
        );
    }
    // One line says where everything is (the address first: scripts and tests read it).
    tracing::info!(%addr, sandbox = %settings.sandbox_name(), users = settings.users.len(),
        "kernel-broker ready on http://{addr} (API http://{addr}/v1/sessions, session browser \
         http://{addr}/ui/?token=TOKEN, Jupyter kernels API http://{addr}/api/kernels, API docs \
         http://{addr}/openapi.json and docs/API.md)");
    let metrics = state.metrics.clone();
    let stopping = state.stopping.clone();
    let app = api::router(state);
    // With --keep-sessions, the executions in flight are answered ("the broker restarted")
    // as soon as the stop begins, so the listener's drain does not wait for them.
    let detaching = registry.clone();
    let drained = drain_on_signal(&cluster, &registry, settings.keep_sessions);
    let shutdown = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = drained.cancelled() => {}
        }
        stopping.cancel();
        detaching.detach_all().await;
    };
    api::listener::serve(listener, app, &clients, metrics, shutdown).await;
    sweeper.abort();
    tracing::info!("shutting down: closing sessions");
    registry.shutdown().await;
    if let Some(store) = &recording {
        // Commits what the sessions reported while closing, then stops the writer.
        store.close().await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Cluster mode: SIGUSR1 drains this node. It takes no new sessions (they are made on other
/// nodes; `/healthz` answers 503 so load balancers look elsewhere), and stops once its
/// sessions have ended, or at once with `--keep-sessions` (they are kept: the node restarts
/// in place with them). The token is cancelled when it is time to stop.
fn drain_on_signal(
    cluster: &Option<Arc<crate::cluster::Cluster>>,
    registry: &Registry,
    keep_sessions: bool,
) -> tokio_util::sync::CancellationToken {
    let done = tokio_util::sync::CancellationToken::new();
    let Some(cluster) = cluster.clone() else {
        return done;
    };
    let mut usr1 =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGUSR1: no drain by signal");
                return done;
            }
        };
    let (registry, stop) = (registry.clone(), done.clone());
    tokio::spawn(async move {
        usr1.recv().await;
        tracing::info!("draining: no new sessions here");
        if let Err(e) = cluster.drain().await {
            tracing::warn!(error = %e, "draining: the nodes table was not told (placement learns at the next renewal)");
        }
        // A session leaves the registry as it ends: wait for those there now to end, then
        // look again for any created meanwhile.
        if !keep_sessions {
            loop {
                let sessions = registry.all();
                if sessions.is_empty() {
                    break;
                }
                futures::future::join_all(sessions.iter().map(|s| s.ended())).await;
            }
        }
        tracing::info!(keep_sessions, "drained: stopping");
        stop.cancel();
    });
    done
}

/// Removes the session records an earlier run with `--keep-sessions` left in `dir`.
fn forget_kept_sessions(dir: &std::path::Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => tracing::info!(
            dir = %dir.display(),
            "sessions kept by an earlier run were ended (this run does not keep sessions)"
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the records of kept sessions")
        }
    }
}

/// The ids of the sessions an earlier run kept (their records in `dir`).
fn kept_session_ids(dir: &std::path::Path) -> std::collections::HashSet<uuid::Uuid> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Default::default();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            uuid::Uuid::parse_str(name.to_str()?.strip_suffix(".json")?).ok()
        })
        .collect()
}

/// Raise the descriptor limit and keep what the sessions need out of the clients' share:
/// the client limits, with the connection cap lowered to fit.
fn budget_descriptors(
    settings: &Settings,
    kernel_specs: usize,
) -> crate::api::clients::ClientLimits {
    use crate::descriptors::{raise_limit, Budget};
    let mut clients = settings.clients.clone();
    let limit = match raise_limit() {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the descriptor limit; client connections are not budgeted");
            return clients;
        }
    };
    // Every user's sessions at their cap, and each user's warm pool of every kernel spec.
    let pooled = settings.session.pool.size * kernel_specs.max(1);
    let sessions: u64 = settings
        .users
        .iter()
        .map(|u| (u.max_sessions + pooled) as u64)
        .sum();
    let budget = Budget::new(limit, sessions);
    let cap = budget.cap_clients(clients.max_connections);
    if !budget.is_enough() {
        tracing::warn!(
            limit,
            sessions,
            needed = budget.for_sessions,
            "the descriptor limit (ulimit -n) is too low for the sessions the users may hold; raise it, or lower the session caps"
        );
    }
    if cap != clients.max_connections {
        tracing::info!(
            limit,
            configured = clients.max_connections,
            cap,
            "client connections capped to fit the descriptor limit after {} kept for {sessions} sessions",
            budget.for_sessions
        );
    }
    tracing::debug!(
        limit,
        reserved = budget.for_sessions,
        clients = cap,
        "descriptor budget"
    );
    clients.max_connections = cap;
    clients
}

impl Settings {
    pub fn sandbox_name(&self) -> &'static str {
        match self.sandbox {
            SandboxKind::Local => "local",
            SandboxKind::Docker => "docker",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::spec::KernelSpecs;

    #[test]
    fn a_spec_is_offered_only_when_its_program_is_on_the_host() {
        let specs = KernelSpecs::load(Path::new("kernels")).unwrap();
        let venv = tempfile::tempdir().unwrap();
        let python3 = specs.get("python3").unwrap();
        let sql = specs.get("sql").unwrap();
        assert!(local_program_found(python3, None));
        assert!(local_program_found(sql, None));
        let deno = specs.get("javascript").unwrap();
        // Deno comes with the kernels' environment: found in its bin only.
        assert!(!local_program_found(deno, Some(venv.path())));
        std::fs::write(venv.path().join("deno"), b"").unwrap();
        assert!(local_program_found(deno, Some(venv.path())));
        let mut absent = deno.clone();
        absent.argv[0] = "/nonexistent/bin/deno".into();
        assert!(!local_program_found(&absent, None));
        absent.argv[0] = "no-such-program-anywhere".into();
        assert!(!local_program_found(&absent, Some(venv.path())));
        absent.argv[0] = "sh".into();
        assert!(local_program_found(&absent, None));
    }
}
