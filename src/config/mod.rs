//! Settings: command-line flags, then `KERNEL_BROKER_<NAME>` environment variables, then the
//! TOML config file, then defaults (strongest first). Also the users file and tokens.
//!
//! Every setting is a flag of `kernel-broker serve` (so `serve --help` lists all of them),
//! an environment variable, and a key of the config file with the same name in snake case.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use serde::Deserialize;

pub use crate::api::auth::User;
use crate::api::clients::ClientLimits;
use crate::recording::{RecordingConfig, Synchronous};
use crate::sandbox::docker::DockerSandboxConfig;
use crate::sandbox::local::LocalSandboxConfig;
use crate::sandbox::UserLimits;
use crate::session::SessionConfig;

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

#[derive(Debug, Parser)]
#[command(
    name = "kernel-broker",
    version,
    about = "Long-lived, sandboxed IPython sessions for agents and notebook frontends"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the broker.
    Serve(Box<ServeArgs>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxKind {
    Local,
    Docker,
}

/// Flags of `serve`. Each is optional so the config file can supply it; each can also come
/// from `KERNEL_BROKER_<NAME>`.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:8888]
    #[arg(long, env = "KERNEL_BROKER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// TOML config file (keys as these flags, in snake case)
    #[arg(long, env = "KERNEL_BROKER_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// TOML users file: [[user]] tables with name, token and optional limits
    #[arg(long, env = "KERNEL_BROKER_USERS_FILE")]
    pub users_file: Option<PathBuf>,
    /// Where kernels run [default: local]
    #[arg(long, env = "KERNEL_BROKER_SANDBOX")]
    pub sandbox: Option<SandboxKind>,
    /// Directory for workspaces, runtime sockets and recordings [default: ./.data]
    #[arg(long, env = "KERNEL_BROKER_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Seconds without activity before a session expires; 0 never [default: 600]
    #[arg(long, env = "KERNEL_BROKER_IDLE_TIMEOUT")]
    pub idle_timeout: Option<u64>,
    /// Largest idle timeout a request may ask for, seconds [default: 86400]
    #[arg(long, env = "KERNEL_BROKER_MAX_IDLE_TIMEOUT")]
    pub max_idle_timeout: Option<u64>,
    /// A session busy this many seconds without a break may expire anyway [default: 3600]
    #[arg(long, env = "KERNEL_BROKER_MAX_BUSY")]
    pub max_busy: Option<u64>,
    /// Execution timeout when the request gives none, seconds [default: 60]
    #[arg(long, env = "KERNEL_BROKER_EXECUTION_TIMEOUT")]
    pub execution_timeout: Option<f64>,
    /// Largest execution timeout a request may ask for, seconds [default: 600]
    #[arg(long, env = "KERNEL_BROKER_MAX_EXECUTION_TIMEOUT")]
    pub max_execution_timeout: Option<f64>,
    /// After a timeout's interrupt, seconds to wait before restarting the kernel [default: 5]
    #[arg(long, env = "KERNEL_BROKER_INTERRUPT_GRACE")]
    pub interrupt_grace: Option<f64>,
    /// stdout and stderr are each cut at this many characters [default: 10000]
    #[arg(long, env = "KERNEL_BROKER_OUTPUT_LIMIT")]
    pub output_limit: Option<usize>,
    /// Results (displays and the main result) of one execution above this many bytes are refused [default: 16777216]
    #[arg(long, env = "KERNEL_BROKER_RESULT_LIMIT")]
    pub result_limit: Option<usize>,
    /// Largest message a kernel may send (all frames together), bytes; a kernel that sends a
    /// bigger one is cut off and its session turns dead. 1 MiB to 1 GiB [default: 67108864]
    #[arg(long, env = "KERNEL_BROKER_MAX_KERNEL_MESSAGE")]
    pub max_kernel_message: Option<u64>,
    /// Largest code of one execution, bytes [default: 1048576]
    #[arg(long, env = "KERNEL_BROKER_MAX_CODE_BYTES")]
    pub max_code_bytes: Option<usize>,
    /// Largest uploaded file, bytes [default: 104857600]
    #[arg(long, env = "KERNEL_BROKER_MAX_FILE_BYTES")]
    pub max_file_bytes: Option<usize>,
    /// Seconds a connection may take to send a request's line and headers, from when it
    /// opens or finishes a response (so also the idle keep-alive timeout); 0 none [default: 10]
    #[arg(long, env = "KERNEL_BROKER_CLIENT_HEADER_TIMEOUT")]
    pub client_header_timeout: Option<f64>,
    /// Seconds a request's body may take to arrive, from the end of its headers; 0 none [default: 300]
    #[arg(long, env = "KERNEL_BROKER_CLIENT_BODY_TIMEOUT")]
    pub client_body_timeout: Option<f64>,
    /// Seconds a broker WebSocket hears nothing from its client before it pings it; 0 no pings [default: 30]
    #[arg(long, env = "KERNEL_BROKER_WEBSOCKET_PING_INTERVAL")]
    pub websocket_ping_interval: Option<f64>,
    /// Seconds a pinged WebSocket client has to answer before it is dropped [default: 30]
    #[arg(long, env = "KERNEL_BROKER_WEBSOCKET_PONG_TIMEOUT")]
    pub websocket_pong_timeout: Option<f64>,
    /// Client connections open at once (WebSockets included); past it new ones are closed at accept; 0 no cap [default: 1024]
    #[arg(long, env = "KERNEL_BROKER_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Client connections open at once from one IP address; 0 no cap [default: 256]
    #[arg(long, env = "KERNEL_BROKER_MAX_CONNECTIONS_PER_CLIENT")]
    pub max_connections_per_client: Option<usize>,
    /// WebSockets open at once on one session (agent streams and Jupyter channels); past it 429; 0 no cap [default: 64]
    #[arg(long, env = "KERNEL_BROKER_MAX_WEBSOCKETS_PER_SESSION")]
    pub max_websockets_per_session: Option<usize>,
    /// WebSockets open at once by one user, on all their sessions; past it 429; 0 no cap [default: 256]
    #[arg(long, env = "KERNEL_BROKER_MAX_WEBSOCKETS_PER_USER")]
    pub max_websockets_per_user: Option<usize>,
    /// Requests of one user in progress at once; past it 429; 0 no cap [default: 64]
    #[arg(long, env = "KERNEL_BROKER_MAX_REQUESTS_PER_USER")]
    pub max_requests_per_user: Option<usize>,
    /// Failed authentications from one address within a minute before its tokens are refused (429) for a minute; 0 never [default: 10]
    #[arg(long, env = "KERNEL_BROKER_MAX_AUTH_FAILURES")]
    pub max_auth_failures: Option<u32>,
    /// Live sessions one user may hold [default: 20]
    #[arg(long, env = "KERNEL_BROKER_MAX_SESSIONS_PER_USER")]
    pub max_sessions_per_user: Option<usize>,
    /// Ready kernels kept per user (and kernel spec) once the user has created a session; 0 disables the warm pool [default: 1]
    #[arg(long, env = "KERNEL_BROKER_POOL_SIZE")]
    pub pool_size: Option<usize>,
    /// Seconds a user's pooled kernels wait unused before they are shut down [default: 600]
    #[arg(long, env = "KERNEL_BROKER_POOL_IDLE")]
    pub pool_idle: Option<u64>,
    /// Executions waiting on one session [default: 64]
    #[arg(long, env = "KERNEL_BROKER_MAX_QUEUE")]
    pub max_queue: Option<usize>,
    /// Default memory limit per user, all sessions together: a create past it is refused (429), bytes [default: 5368709120]
    #[arg(long, env = "KERNEL_BROKER_MEMORY_LIMIT")]
    pub memory_limit: Option<u64>,
    /// Default memory limit of one session (its kernel alone is killed past it; a create may ask for up to the user's total), bytes [default: 268435456]
    #[arg(long, env = "KERNEL_BROKER_SESSION_MEMORY_LIMIT")]
    pub session_memory_limit: Option<u64>,
    /// Processes and threads of one session [default: 128]
    #[arg(long, env = "KERNEL_BROKER_SESSION_PIDS_LIMIT")]
    pub session_pids_limit: Option<u64>,
    /// Default CPU limit per user, cores [default: 1]
    #[arg(long, env = "KERNEL_BROKER_CPU_LIMIT")]
    pub cpu_limit: Option<f64>,
    /// Default process and thread limit per user, all sessions together [default: 2560]
    #[arg(long, env = "KERNEL_BROKER_PIDS_LIMIT")]
    pub pids_limit: Option<u64>,
    /// Default workspace disk quota per user, bytes; 0 = none [default: 1073741824]
    #[arg(long, env = "KERNEL_BROKER_WORKSPACE_QUOTA")]
    pub workspace_quota: Option<u64>,
    /// Directory of kernel specs and their Python environment [default: ./kernels]
    #[arg(long, env = "KERNEL_BROKER_KERNELS_DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Python interpreter that runs kernels [default: <kernels-dir>/.venv/bin/python]
    #[arg(long, env = "KERNEL_BROKER_PYTHON")]
    pub python: Option<PathBuf>,
    /// First host uid for kernels of the local sandbox (user N runs as base+N+1) [default: 200000 + 10000 × (a hash of the data directory mod 10000)]
    #[arg(long, env = "KERNEL_BROKER_UID_BASE")]
    pub uid_base: Option<u32>,
    /// Name of the broker's cgroup (everything below it is the broker's and swept at start) [default: kernel-broker-<hash of the data directory>]
    #[arg(long, env = "KERNEL_BROKER_CGROUP_NAME")]
    pub cgroup_name: Option<String>,
    /// Refuse to start when cgroup limits cannot be enforced [default: true]
    #[arg(long, env = "KERNEL_BROKER_REQUIRE_LIMITS")]
    pub require_limits: Option<bool>,
    /// Docker Engine socket [default: /var/run/docker.sock]
    #[arg(long, env = "KERNEL_BROKER_DOCKER_SOCKET")]
    pub docker_socket: Option<String>,
    /// Kernel image for the docker sandbox [default: kernel-broker/python-kernel:latest]
    #[arg(long, env = "KERNEL_BROKER_DOCKER_IMAGE")]
    pub docker_image: Option<String>,
    /// Seconds a user's container lives on with no session [default: 300]
    #[arg(long, env = "KERNEL_BROKER_CONTAINER_IDLE")]
    pub container_idle: Option<u64>,
    /// Record every message of every session (for /events, /notebook, /replay, /ui/) [default: true]
    #[arg(long, env = "KERNEL_BROKER_RECORD")]
    pub record: Option<bool>,
    /// Days to keep the recording of a session after it ended; 0 keeps them forever [default: 30]
    #[arg(long, env = "KERNEL_BROKER_RETENTION_DAYS")]
    pub retention_days: Option<u64>,
    /// SQLite file of the recordings [default: <data-dir>/recordings.sqlite3]
    #[arg(long, env = "KERNEL_BROKER_RECORD_DB")]
    pub record_db: Option<PathBuf>,
    /// normal: a commit survives a killed broker; full: also a machine crash (an fsync per commit) [default: normal]
    #[arg(long, env = "KERNEL_BROKER_RECORD_SYNCHRONOUS")]
    pub record_synchronous: Option<Synchronous>,
    /// Bytes of messages recorded per execution (from one execute_request to the next), images counted once; past it one recording_truncated marker [default: 52428800]
    #[arg(long, env = "KERNEL_BROKER_RECORD_MAX_EXECUTION_BYTES")]
    pub record_max_execution_bytes: Option<u64>,
    /// Bytes of messages recorded per session in all [default: 1073741824]
    #[arg(long, env = "KERNEL_BROKER_RECORD_MAX_SESSION_BYTES")]
    pub record_max_session_bytes: Option<u64>,
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
    pub users: Vec<User>,
    pub token_source: TokenSource,
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
                (vec![user], source)
            }
        };
        let data_dir = pick!(data_dir, PathBuf::from(".data"));
        Ok(Settings {
            listen: pick!(listen, SocketAddr::from(([127, 0, 0, 1], 8888))),
            sandbox: pick!(sandbox, SandboxKind::Local),
            session: session_config(&args, &file)?,
            max_code_bytes: pick!(max_code_bytes, 1 << 20),
            max_file_bytes: pick!(max_file_bytes, 100 << 20),
            clients: client_limits(&args, &file)?,
            local: local_config(&args, &file, &data_dir, &kernels_dir),
            docker: docker_config(&args, &file, &data_dir),
            kernels_dir,
            recording: recording_config(&args, &file, &data_dir),
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
    c.cgroup_name = either!(args, file, cgroup_name).unwrap_or(c.cgroup_name);
    c
}

/// The docker sandbox's settings: its defaults, overridden by what was given.
fn docker_config(args: &ServeArgs, file: &ServeArgs, data_dir: &Path) -> DockerSandboxConfig {
    let mut c = DockerSandboxConfig::new(data_dir);
    c.socket = either!(args, file, docker_socket).unwrap_or(c.socket);
    c.image = either!(args, file, docker_image).unwrap_or(c.image);
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
) -> Option<RecordingConfig> {
    if !either!(args, file, record).unwrap_or(true) {
        return None;
    }
    let path =
        either!(args, file, record_db).unwrap_or_else(|| data_dir.join("recordings.sqlite3"));
    let mut c = RecordingConfig::new(path);
    if let Some(days) = either!(args, file, retention_days) {
        c.retention = (days != 0).then(|| Duration::from_secs(days.saturating_mul(86_400)));
    }
    c.synchronous = either!(args, file, record_synchronous).unwrap_or(c.synchronous);
    c.max_execution_bytes =
        either!(args, file, record_max_execution_bytes).unwrap_or(c.max_execution_bytes);
    c.max_session_bytes =
        either!(args, file, record_max_session_bytes).unwrap_or(c.max_session_bytes);
    Some(c)
}

#[cfg(test)]
mod tests;
