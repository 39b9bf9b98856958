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

/// `args`' value of a setting, else the config file's.
macro_rules! either {
    ($args:ident, $file:ident, $field:ident) => {
        $args.$field.clone().or($file.$field.clone())
    };
}

mod args;
mod egress;
mod layers;

use layers::{
    check_preload, client_limits, cluster_config, docker_config, local_config, recording_config,
    session_config,
};

pub use crate::api::auth::User;
use crate::api::clients::ClientLimits;
use crate::recording::RecordingConfig;
use crate::sandbox::docker::DockerSandboxConfig;
use crate::sandbox::local::LocalSandboxConfig;
use crate::sandbox::UserLimits;
use crate::session::{CheckpointPolicy, PausePolicy, SessionConfig};
pub use args::{Cli, Command, EgressMode, McpArgs, SandboxKind, ServeArgs, TokenArgs};

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
    #[error("invalid setting: {0}")]
    Egress(#[from] crate::egress::PolicyError),
    #[error("invalid setting: {what}: {source}")]
    EgressNetwork {
        what: &'static str,
        #[source]
        source: crate::egress::PolicyError,
    },
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
    max_checkpoints: Option<usize>,
    checkpoint_memory_bytes: Option<u64>,
    checkpoint_every_execution: Option<bool>,
    /// Overrides `--pause-after` (0: this user's sessions are never paused by themselves).
    pause_after_seconds: Option<u64>,
    /// Overrides `--paused-ttl`.
    paused_ttl_seconds: Option<u64>,
    session_memory_bytes: Option<u64>,
    session_pids: Option<u64>,
    /// Modules this user's kernels import before their first cell (overrides `--preload`).
    preload: Option<Vec<String>>,
    /// Hosts this user's kernels may reach (overrides `--egress`; empty: none).
    egress_allow: Option<Vec<String>>,
    egress_ports: Option<Vec<u16>>,
    egress_max_bytes: Option<u64>,
    egress_max_connections: Option<usize>,
    /// Secrets every session of this user gets (names to values).
    secrets: Option<std::collections::BTreeMap<String, String>>,
}

/// Where the users came from, for the start-up message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    UsersFile(PathBuf),
    Environment,
    /// To be made at the first start on the data directory, then kept there (`kept_token`).
    Generated,
    /// Kept in the data directory (`made`: at this start).
    Kept {
        made: bool,
    },
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
    /// The credential formats masked in every session's output.
    pub secret_patterns: std::sync::Arc<crate::secrets::Patterns>,
    /// The pre-execution policy (empty: none).
    pub policy: std::sync::Arc<crate::policy::Policy>,
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

impl Settings {
    /// What every session's output is masked of besides its own secrets: every user's
    /// token (a kernel has no business printing any) and the credential patterns.
    pub fn credentials(&self) -> crate::secrets::Credentials {
        crate::secrets::Credentials {
            values: self
                .users
                .iter()
                .map(|u| crate::secrets::Named {
                    name: "broker-token".into(),
                    value: u.token.clone(),
                })
                .collect(),
            patterns: self.secret_patterns.clone(),
        }
    }

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
        let base_checkpoints = CheckpointPolicy::default();
        let checkpoints = CheckpointPolicy {
            max_count: pick!(max_checkpoints_per_user, base_checkpoints.max_count),
            memory_budget_bytes: pick!(
                checkpoint_memory_per_user,
                base_checkpoints.memory_budget_bytes
            ),
            every_execution: pick!(checkpoint_every_execution, false),
        };
        let pause = pause_policy(
            either!(args, file, pause_after),
            either!(args, file, paused_ttl),
            PausePolicy::default(),
            "paused_ttl",
        )?;
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
                    let secrets = u.secrets.unwrap_or_default();
                    crate::secrets::check(&secrets)
                        .map_err(|e| ConfigError::Invalid(format!("user {}: {e}", u.name)))?;
                    users.push(User {
                        secrets,
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
                        checkpoints: CheckpointPolicy {
                            max_count: u.max_checkpoints.unwrap_or(checkpoints.max_count),
                            memory_budget_bytes: u
                                .checkpoint_memory_bytes
                                .unwrap_or(checkpoints.memory_budget_bytes),
                            every_execution: u
                                .checkpoint_every_execution
                                .unwrap_or(checkpoints.every_execution),
                        },
                        pause: pause_policy(
                            u.pause_after_seconds,
                            u.paused_ttl_seconds,
                            pause,
                            &format!("paused_ttl_seconds of user {}", u.name),
                        )?,
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
                    checkpoints,
                    pause,
                    secrets: Default::default(),
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
        session.paused_dir = Some(data_dir.join("paused-sessions"));
        session.snapshots_dir = Some(data_dir.join("snapshot-records"));
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
        if let Some(criu) = either!(args, file, criu) {
            docker.criu = Some(criu.clone());
            local.criu = Some(criu);
        }
        if let Some(bytes) = either!(args, file, copy_reserve_bytes) {
            docker.copy_reserve_bytes = bytes;
            local.copy_reserve_bytes = bytes;
        }
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
        let secret_patterns = crate::secrets::Patterns::new(
            &either!(args, file, secret_patterns).unwrap_or_default(),
            pick!(default_secret_patterns, true),
        )
        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let policy = match either!(args, file, policy) {
            Some(path) => crate::policy::Policy::load(&path)
                .map_err(|e| ConfigError::Invalid(format!("--policy {}: {e}", path.display())))?,
            None => crate::policy::Policy::default(),
        };
        Ok(Settings {
            secret_patterns: std::sync::Arc::new(secret_patterns),
            policy: std::sync::Arc::new(policy),
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

#[cfg(test)]
mod tests;

/// A pause policy from `after` and `ttl` seconds given (each in place of `base`'s); `what`
/// names the TTL's setting in an error. `after` 0 is off; a TTL of 0 is refused (a pause
/// would end its session at once).
fn pause_policy(
    after: Option<u64>,
    ttl: Option<u64>,
    base: PausePolicy,
    what: &str,
) -> Result<PausePolicy, ConfigError> {
    let ttl = match ttl {
        Some(0) => {
            return Err(ConfigError::Invalid(format!(
                "{what}: 0 would end a session as it is paused; give seconds, at least 1"
            )))
        }
        Some(t) => Duration::from_secs(t),
        None => base.ttl,
    };
    Ok(PausePolicy {
        after: match after {
            Some(0) => None,
            Some(s) => Some(Duration::from_secs(s)),
            None => base.after,
        },
        ttl,
    })
}
