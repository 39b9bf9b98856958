//! Settings: command-line flags, then `KERNEL_BROKER_<NAME>` environment variables, then the
//! TOML config file, then defaults (strongest first). Also the users file and tokens.
//!
//! Every setting is a flag of `kernel-broker serve` (so `serve --help` lists all of them),
//! an environment variable, and a key of the config file with the same name in snake case.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

mod args;
mod egress;

pub use crate::api::auth::User;
use crate::api::clients::ClientLimits;
use crate::recording::RecordingConfig;
use crate::sandbox::docker::DockerSandboxConfig;
use crate::sandbox::local::LocalSandboxConfig;
use crate::sandbox::UserLimits;
use crate::session::SessionConfig;
pub use args::{Cli, Command, EgressMode, McpArgs, SandboxKind, ServeArgs};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("could not read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid TOML for kernel-broker: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("invalid setting: {0}")]
    Invalid(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsersFile {
    #[serde(default)]
    user: Vec<UserEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UserEntry {
    name: String,
    token: String,
    memory_bytes: Option<u64>,
    cpus: Option<f64>,
    pids: Option<u64>,
    workspace_quota_bytes: Option<u64>,
    max_sessions: Option<usize>,
    session_memory_bytes: Option<u64>,
    session_pids: Option<u64>,
    /// Modules this user's kernels import before their first cell (overrides `--preload`).
    preload: Option<Vec<String>>,
    /// Hosts this user's kernels may reach (overrides `--egress`; empty: none).
    egress_allow: Option<Vec<String>>,
    egress_ports: Option<Vec<u16>>,
    egress_max_bytes: Option<u64>,
    egress_max_connections: Option<usize>,
}

/// Where the users came from, for the start-up message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    UsersFile(PathBuf),
    Environment,
    /// Generated at start: print it once.
    Generated,
}

/// The resolved settings the broker runs with. Each layer's settings are its own config type
/// (whose `Default` holds the defaults); this only adds what the binary itself needs.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub sandbox: SandboxKind,
    pub data_dir: PathBuf,
    /// Sessions (kernels, workspaces, idle deadlines) outlive the broker process and are
    /// adopted by its next run on this data directory.
    pub keep_sessions: bool,
    /// Sessions: timeouts, output limits, queue, kernel connections, warm pool.
    pub session: SessionConfig,
    pub max_code_bytes: usize,
    pub max_file_bytes: usize,
    /// Time limits and caps on client connections.
    pub clients: ClientLimits,
    pub kernels_dir: PathBuf,
    /// The local sandbox's settings (used with `--sandbox local`).
    pub local: LocalSandboxConfig,
    /// The docker sandbox's settings (used with `--sandbox docker`).
    pub docker: DockerSandboxConfig,
    /// The recording; `None` when recording is off.
    pub recording: Option<RecordingConfig>,
    /// Cluster mode (`--advertise-url` with `--database-url`).
    pub cluster: Option<crate::cluster::ClusterConfig>,
    pub users: Vec<User>,
    pub token_source: TokenSource,
    /// Network policies: who may reach which hosts through the egress proxy.
    pub egress: crate::egress::EgressConfig,
}

fn read_toml<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn secs(v: f64, name: &str) -> Result<Duration, ConfigError> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        ConfigError::Invalid(format!("{name} must be a non-negative number of seconds"))
    })
}

/// `./kernels` when it exists, else the repository's `kernels/` next to the binary
/// (`target/<profile>/kernel-broker` → `kernels/`), so the broker runs from any directory.
fn default_kernels_dir() -> PathBuf {
    let here = PathBuf::from("kernels");
    if here.join("python3").is_dir() {
        return here;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            exe.ancestors()
                .skip(1)
                .take(4)
                .map(|d| d.join("kernels"))
                .find(|k| k.join("python3").is_dir())
        })
        .unwrap_or(here)
}

/// A workspace quota is 0 (none) or at least 16 MiB: the workspace is an ext4 file system
/// of that size, and smaller ones leave no room after ext4's own metadata.
fn check_workspace_quota(bytes: u64, what: &str) -> Result<u64, ConfigError> {
    if bytes != 0 && bytes < (16 << 20) {
        return Err(ConfigError::Invalid(format!(
            "{what}: {bytes} bytes is too small; use 0 (no quota) or at least 16 MiB"
        )));
    }
    Ok(bytes)
}

/// A session's memory is at least 16 MiB and at most the user's total (else no session
/// could ever be admitted); its processes at least 1.
fn check_session_limits(l: &UserLimits, whose: &str) -> Result<(), ConfigError> {
    if l.session_memory_bytes < (16 << 20) || l.session_memory_bytes > l.memory_bytes {
        return Err(ConfigError::Invalid(format!(
            "{whose}: the session memory limit ({} bytes) must be at least 16 MiB and at most \
             the user's memory limit ({} bytes)",
            l.session_memory_bytes, l.memory_bytes
        )));
    }
    if l.session_pids == 0 {
        return Err(ConfigError::Invalid(format!(
            "{whose}: the session pids limit must be above 0"
        )));
    }
    // Legal, but a fork bomb would end the kernel by OOM instead of meeting EAGAIN.
    if let Some(needed) = l.memory_for_pids() {
        tracing::warn!(
            "{whose}: a session may have {} processes and threads but only {} MiB: a fork \
             bomb would run the kernel out of memory (each process costs about {} MiB) before \
             the pids limit stops it; give sessions at least {} MiB or fewer pids",
            l.session_pids,
            l.session_memory_bytes >> 20,
            crate::sandbox::PROCESS_MEMORY >> 20,
            needed.div_ceil(1 << 20)
        );
    }
    Ok(())
}

fn valid_user_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// `args`' value of a setting, else the config file's.
macro_rules! either {
    ($args:ident, $file:ident, $field:ident) => {
        $args.$field.clone().or($file.$field.clone())
    };
}

impl Settings {
    /// Merge flags/environment (already in `args`), the config file, and defaults.
    /// `env_token` is `KERNEL_BROKER_TOKEN`.
    pub fn resolve(args: ServeArgs, env_token: Option<String>) -> Result<Self, ConfigError> {
        let file: ServeArgs = match &args.config {
            Some(path) => read_toml(path)?,
            None => ServeArgs::default(),
        };
        macro_rules! pick {
            ($field:ident, $default:expr) => {
                either!(args, file, $field).unwrap_or_else(|| $default)
            };
        }
        let kernels_dir = pick!(kernels_dir, default_kernels_dir());
        let base = UserLimits::default();
        let memory_bytes = pick!(memory_limit, base.memory_bytes);
        let defaults = UserLimits {
            memory_bytes,
            cpus: pick!(cpu_limit, base.cpus),
            pids: pick!(pids_limit, base.pids),
            workspace_quota_bytes: pick!(workspace_quota, base.workspace_quota_bytes),
            // A smaller total than the default session takes the session down with it.
            session_memory_bytes: pick!(
                session_memory_limit,
                base.session_memory_bytes.min(memory_bytes)
            ),
            session_pids: pick!(session_pids_limit, base.session_pids),
        };
        if defaults.cpus <= 0.0 || defaults.pids == 0 || defaults.memory_bytes < (16 << 20) {
            return Err(ConfigError::Invalid(
                "limits: cpu must be > 0, pids > 0, memory at least 16 MiB".into(),
            ));
        }
        check_session_limits(&defaults, "the defaults")?;
        check_workspace_quota(defaults.workspace_quota_bytes, "workspace_quota")?;
        let max_sessions = pick!(max_sessions_per_user, 20);
        let users_file = args.users_file.clone().or(file.users_file.clone());
        let mut user_preload = HashMap::new();
        let egress_default = egress::Defaults::resolve(&args, &file)?;
        let mut egress = crate::egress::EgressConfig {
            ca_bundle: egress_default.ca_bundle.clone(),
            ..Default::default()
        };
        let (users, token_source) = match (users_file, env_token.filter(|t| !t.is_empty())) {
            (Some(path), _) => {
                let parsed: UsersFile = read_toml(&path)?;
                let mut users = Vec::new();
                let mut seen_tokens = HashMap::new();
                for (i, u) in parsed.user.into_iter().enumerate() {
                    if !valid_user_name(&u.name) {
                        return Err(ConfigError::Invalid(format!(
                            "user name {:?} in {}: use letters, digits, '_', '-', '.'",
                            u.name,
                            path.display()
                        )));
                    }
                    if u.token.len() < 8 {
                        return Err(ConfigError::Invalid(format!(
                            "the token of user {} is shorter than 8 characters",
                            u.name
                        )));
                    }
                    if seen_tokens
                        .insert(u.token.clone(), u.name.clone())
                        .is_some()
                    {
                        return Err(ConfigError::Invalid(format!(
                            "two users share the token of user {}",
                            u.name
                        )));
                    }
                    if let Some(list) = &u.preload {
                        user_preload.insert(
                            u.name.clone(),
                            check_preload(list, &format!("preload of user {}", u.name))?,
                        );
                    }
                    let user_egress = egress::UserEgressEntry {
                        allow: u.egress_allow.as_deref(),
                        ports: u.egress_ports.as_deref(),
                        max_bytes: u.egress_max_bytes,
                        max_connections: u.egress_max_connections,
                    };
                    if let Some(e) = egress_default.for_user(&u.name, &user_egress)? {
                        egress.users.insert(u.name.clone(), e);
                    }
                    users.push(User {
                        index: i as u32,
                        limits: UserLimits {
                            memory_bytes: u.memory_bytes.unwrap_or(defaults.memory_bytes),
                            cpus: u.cpus.unwrap_or(defaults.cpus),
                            pids: u.pids.unwrap_or(defaults.pids),
                            workspace_quota_bytes: check_workspace_quota(
                                u.workspace_quota_bytes
                                    .unwrap_or(defaults.workspace_quota_bytes),
                                &format!("workspace_quota_bytes of user {}", u.name),
                            )?,
                            session_memory_bytes: u.session_memory_bytes.unwrap_or(
                                defaults
                                    .session_memory_bytes
                                    .min(u.memory_bytes.unwrap_or(defaults.memory_bytes)),
                            ),
                            session_pids: u.session_pids.unwrap_or(defaults.session_pids),
                        },
                        max_sessions: u.max_sessions.unwrap_or(max_sessions),
                        name: u.name,
                        token: u.token,
                    });
                }
                for u in &users {
                    check_session_limits(&u.limits, &format!("user {}", u.name))?;
                }
                if users.is_empty() {
                    return Err(ConfigError::Invalid(format!(
                        "{} defines no [[user]]",
                        path.display()
                    )));
                }
                (users, TokenSource::UsersFile(path))
            }
            (None, token) => {
                let (token, source) = match token {
                    Some(token) => (token, TokenSource::Environment),
                    None => (
                        hex::encode(rand::random::<[u8; 24]>()),
                        TokenSource::Generated,
                    ),
                };
                let user = User {
                    name: "default".into(),
                    token,
                    index: 0,
                    limits: defaults.clone(),
                    max_sessions,
                };
                if let Some(e) =
                    egress_default.for_user(&user.name, &egress::UserEgressEntry::default())?
                {
                    egress.users.insert(user.name.clone(), e);
                }
                (vec![user], source)
            }
        };
        let data_dir = pick!(data_dir, PathBuf::from(".data"));
        let keep_sessions = pick!(keep_sessions, false);
        let mut session = session_config(&args, &file)?;
        session.keep_dir = keep_sessions.then(|| data_dir.join("sessions"));
        let mut local = local_config(&args, &file, &data_dir, &kernels_dir);
        local.keep_kernels = keep_sessions;
        let mut docker = docker_config(&args, &file, &data_dir);
        docker.keep_kernels = keep_sessions;
        if let Some(list) = either!(args, file, preload) {
            let list: Vec<String> = list
                .split(',')
                .map(str::trim)
                .filter(|m| !m.is_empty() && *m != "none")
                .map(str::to_string)
                .collect();
            let list = check_preload(&list, "--preload")?;
            local.preload = list.clone();
            docker.preload = list;
        }
        local.fork_server = pick!(fork_server, local.fork_server);
        docker.fork_server = pick!(fork_server, docker.fork_server);
        if let Some(secs) = either!(args, file, container_idle) {
            local.template_idle = Duration::from_secs(secs);
        }
        // The CA bundle is mounted only where some user has egress (else no one needs it).
        if egress.enabled() {
            local.ca_file = egress_default.ca_file.clone();
            docker.ca_file = egress_default.ca_file.clone();
        }
        local.user_preload = user_preload.clone();
        docker.user_preload = user_preload;
        Ok(Settings {
            listen: pick!(listen, SocketAddr::from(([127, 0, 0, 1], 8888))),
            sandbox: pick!(sandbox, SandboxKind::Local),
            session,
            keep_sessions,
            max_code_bytes: pick!(max_code_bytes, 1 << 20),
            max_file_bytes: pick!(max_file_bytes, 100 << 20),
            clients: client_limits(&args, &file)?,
            local,
            docker,
            kernels_dir,
            recording: recording_config(&args, &file, &data_dir)?,
            cluster: cluster_config(&args, &file, &data_dir)?,
            egress,
            data_dir,
            users,
            token_source,
        })
    }
}

/// The session layer's settings: its defaults, overridden by what was given.
fn session_config(args: &ServeArgs, file: &ServeArgs) -> Result<SessionConfig, ConfigError> {
    let mut c = SessionConfig::default();
    let seconds = |v: Option<u64>, d: Duration| v.map(Duration::from_secs).unwrap_or(d);
    c.idle_timeout = seconds(either!(args, file, idle_timeout), c.idle_timeout);
    c.max_idle_timeout = seconds(either!(args, file, max_idle_timeout), c.max_idle_timeout);
    c.max_busy = seconds(either!(args, file, max_busy), c.max_busy);
    if let Some(v) = either!(args, file, max_execution_timeout) {
        c.max_execution_timeout = secs(v, "max_execution_timeout")?;
    }
    if let Some(v) = either!(args, file, execution_timeout) {
        c.execution_timeout = secs(v, "execution_timeout")?;
    }
    c.execution_timeout = c.execution_timeout.min(c.max_execution_timeout);
    if let Some(v) = either!(args, file, interrupt_grace) {
        c.interrupt_grace = secs(v, "interrupt_grace")?;
    }
    c.output_limit = either!(args, file, output_limit).unwrap_or(c.output_limit);
    c.result_limit = either!(args, file, result_limit).unwrap_or(c.result_limit);
    c.max_queue = either!(args, file, max_queue).unwrap_or(c.max_queue);
    if let Some(v) = either!(args, file, max_kernel_message) {
        if !(1 << 20..=1 << 30).contains(&v) {
            return Err(ConfigError::Invalid(format!(
                "max_kernel_message must be between 1 MiB and 1 GiB, not {v}"
            )));
        }
        c.kernel.limits.max_message = v;
    }
    c.pool.size = either!(args, file, pool_size).unwrap_or(c.pool.size);
    c.pool.idle = seconds(either!(args, file, pool_idle), c.pool.idle);
    Ok(c)
}

/// The client connections' limits: the API's defaults, overridden by what was given.
fn client_limits(args: &ServeArgs, file: &ServeArgs) -> Result<ClientLimits, ConfigError> {
    let mut c = ClientLimits::default();
    if let Some(v) = either!(args, file, client_header_timeout) {
        c.header_timeout = secs(v, "client_header_timeout")?;
    }
    if let Some(v) = either!(args, file, client_body_timeout) {
        c.body_timeout = secs(v, "client_body_timeout")?;
    }
    if let Some(v) = either!(args, file, websocket_ping_interval) {
        c.websocket_ping_interval = secs(v, "websocket_ping_interval")?;
    }
    if let Some(v) = either!(args, file, websocket_pong_timeout) {
        c.websocket_pong_timeout = secs(v, "websocket_pong_timeout")?;
    }
    if !c.websocket_ping_interval.is_zero() && c.websocket_pong_timeout.is_zero() {
        return Err(ConfigError::Invalid(
            "websocket_pong_timeout must be above 0 while pings are on".into(),
        ));
    }
    c.max_connections = either!(args, file, max_connections).unwrap_or(c.max_connections);
    c.max_connections_per_client =
        either!(args, file, max_connections_per_client).unwrap_or(c.max_connections_per_client);
    c.max_websockets_per_session =
        either!(args, file, max_websockets_per_session).unwrap_or(c.max_websockets_per_session);
    c.max_websockets_per_user =
        either!(args, file, max_websockets_per_user).unwrap_or(c.max_websockets_per_user);
    c.max_requests_per_user =
        either!(args, file, max_requests_per_user).unwrap_or(c.max_requests_per_user);
    c.max_auth_failures = either!(args, file, max_auth_failures).unwrap_or(c.max_auth_failures);
    Ok(c)
}

/// The local sandbox's settings: its defaults, overridden by what was given.
fn local_config(
    args: &ServeArgs,
    file: &ServeArgs,
    data_dir: &Path,
    kernels_dir: &Path,
) -> LocalSandboxConfig {
    let mut c = LocalSandboxConfig::new(data_dir, kernels_dir);
    c.python = either!(args, file, python).unwrap_or(c.python);
    c.uid_base = either!(args, file, uid_base).unwrap_or(c.uid_base);
    c.require_limits = either!(args, file, require_limits).unwrap_or(c.require_limits);
    if let Some(secs) = either!(args, file, launch_timeout) {
        c.launch_timeout = std::time::Duration::from_secs(secs.max(1));
    }
    c.cgroup_name = either!(args, file, cgroup_name).unwrap_or(c.cgroup_name);
    c
}

/// A preload list whose every entry is a module name.
fn check_preload(list: &[String], what: &str) -> Result<Vec<String>, ConfigError> {
    match list
        .iter()
        .find(|m| !crate::sandbox::boot::is_module_name(m))
    {
        Some(bad) => Err(ConfigError::Invalid(format!(
            "{what}: {bad:?} is not a Python module name"
        ))),
        None => Ok(list.to_vec()),
    }
}

/// The docker sandbox's settings: its defaults, overridden by what was given.
fn docker_config(args: &ServeArgs, file: &ServeArgs, data_dir: &Path) -> DockerSandboxConfig {
    let mut c = DockerSandboxConfig::new(data_dir);
    c.socket = either!(args, file, docker_socket).unwrap_or(c.socket);
    c.image = either!(args, file, docker_image).unwrap_or(c.image);
    c.cgroup_parent = either!(args, file, docker_cgroup_parent).filter(|p| !p.is_empty());
    c.require_limits = either!(args, file, require_limits).unwrap_or(c.require_limits);
    if let Some(secs) = either!(args, file, docker_api_timeout) {
        c.api_timeout = Duration::from_secs(secs.max(1));
    }
    if let Some(secs) = either!(args, file, container_idle) {
        c.container_idle = Duration::from_secs(secs);
    }
    c
}

/// The recording's settings (its defaults, overridden), or `None` when recording is off.
fn recording_config(
    args: &ServeArgs,
    file: &ServeArgs,
    data_dir: &Path,
) -> Result<Option<RecordingConfig>, ConfigError> {
    if !either!(args, file, record).unwrap_or(true) {
        return Ok(None);
    }
    let record_db = either!(args, file, record_db);
    let database_url = either!(args, file, database_url).filter(|u| !u.is_empty());
    if let Some(url) = &database_url {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(ConfigError::Invalid(
                "--database-url must be a postgres:// or postgresql:// URL".into(),
            ));
        }
        if record_db.is_some() {
            return Err(ConfigError::Invalid(
                "--record-db (a SQLite file) and --database-url (PostgreSQL) both say where the recordings go: give one".into(),
            ));
        }
    }
    let path = record_db.unwrap_or_else(|| data_dir.join("recordings.sqlite3"));
    let mut c = RecordingConfig::new(path);
    c.database_url = database_url;
    c.node = match either!(args, file, node_id).filter(|n| !n.is_empty()) {
        Some(n) => n,
        None if c.database_url.is_some() => node_id(data_dir)?,
        None => c.node,
    };
    if let Some(days) = either!(args, file, retention_days) {
        c.retention = (days != 0).then(|| Duration::from_secs(days.saturating_mul(86_400)));
    }
    c.synchronous = either!(args, file, record_synchronous).unwrap_or(c.synchronous);
    c.max_execution_bytes =
        either!(args, file, record_max_execution_bytes).unwrap_or(c.max_execution_bytes);
    c.max_session_bytes =
        either!(args, file, record_max_session_bytes).unwrap_or(c.max_session_bytes);
    Ok(Some(c))
}

/// Cluster mode's settings: with `--advertise-url`, which needs `--database-url`.
fn cluster_config(
    args: &ServeArgs,
    file: &ServeArgs,
    data_dir: &Path,
) -> Result<Option<crate::cluster::ClusterConfig>, ConfigError> {
    let Some(advertise_url) = either!(args, file, advertise_url).filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    let Some(database_url) = either!(args, file, database_url).filter(|u| !u.is_empty()) else {
        return Err(ConfigError::Invalid(
            "--advertise-url is for cluster mode, which needs --database-url".into(),
        ));
    };
    let parsed: axum::http::Uri = advertise_url.parse().map_err(|_| {
        ConfigError::Invalid(format!("--advertise-url {advertise_url:?} is not a URL"))
    })?;
    if parsed.scheme_str() != Some("http") || parsed.authority().is_none() {
        return Err(ConfigError::Invalid(format!(
            "--advertise-url must be http://HOST:PORT, not {advertise_url:?}"
        )));
    }
    let node_id = match either!(args, file, node_id).filter(|n| !n.is_empty()) {
        Some(n) => n,
        None => node_id(data_dir)?,
    };
    Ok(Some(crate::cluster::ClusterConfig {
        database_url,
        node_id,
        advertise_url: advertise_url.trim_end_matches('/').to_string(),
        lease: either!(args, file, node_lease)
            .map_or(crate::cluster::LEASE, |s| Duration::from_secs(s.max(1))),
        session_capacity: either!(args, file, node_capacity_sessions).unwrap_or(1000),
        memory_capacity: either!(args, file, node_capacity_memory),
    }))
}

/// This broker's node id, kept in `<data-dir>/node-id` (made on first start): stable across
/// restarts on the same data directory, distinct between brokers with their own.
fn node_id(data_dir: &Path) -> Result<String, ConfigError> {
    let path = data_dir.join("node-id");
    let invalid = |e: std::io::Error| {
        ConfigError::Invalid(format!("the node id file {}: {e}", path.display()))
    };
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(invalid(e)),
    }
    std::fs::create_dir_all(data_dir).map_err(invalid)?;
    let id = uuid::Uuid::new_v4().to_string();
    std::fs::write(&path, format!("{id}\n")).map_err(invalid)?;
    Ok(id)
}

#[cfg(test)]
mod tests;
