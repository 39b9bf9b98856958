//! Each layer's configuration from the flags and the config file: the layer's own
//! `Default`, overridden by what was given (flags first), and checked.

use std::path::Path;
use std::time::Duration;

use super::*;

/// The session layer's settings: its defaults, overridden by what was given.
pub(super) fn session_config(
    args: &ServeArgs,
    file: &ServeArgs,
) -> Result<SessionConfig, ConfigError> {
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
pub(super) fn client_limits(
    args: &ServeArgs,
    file: &ServeArgs,
) -> Result<ClientLimits, ConfigError> {
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
pub(super) fn local_config(
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
pub(super) fn check_preload(list: &[String], what: &str) -> Result<Vec<String>, ConfigError> {
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
pub(super) fn docker_config(
    args: &ServeArgs,
    file: &ServeArgs,
    data_dir: &Path,
) -> DockerSandboxConfig {
    let mut c = DockerSandboxConfig::new(data_dir);
    c.socket = either!(args, file, docker_socket).unwrap_or(c.socket);
    c.image = either!(args, file, docker_image).unwrap_or(c.image);
    c.cgroup_parent = either!(args, file, docker_cgroup_parent).filter(|p| !p.is_empty());
    c.require_limits = either!(args, file, require_limits).unwrap_or(c.require_limits);
    if let Some(secs) = either!(args, file, launch_timeout) {
        c.launch_timeout = Duration::from_secs(secs.max(1));
    }
    if let Some(secs) = either!(args, file, docker_api_timeout) {
        c.api_timeout = Duration::from_secs(secs.max(1));
    }
    if let Some(secs) = either!(args, file, container_idle) {
        c.container_idle = Duration::from_secs(secs);
    }
    c
}

/// The recording's settings (its defaults, overridden), or `None` when recording is off.
pub(super) fn recording_config(
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
pub(super) fn cluster_config(
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
    let parsed: http::Uri = advertise_url.parse().map_err(|_| {
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
        carry_paused: either!(args, file, carry_paused).unwrap_or(false),
        carry_key: either!(args, file, carry_key_file)
            .map(|p| carry_key(&p))
            .transpose()?,
    }))
}

/// The key in `--carry-key-file`: its contents, surrounding whitespace left out; at least
/// 32 bytes.
fn carry_key(path: &Path) -> Result<crate::cluster::CarryKey, ConfigError> {
    let invalid =
        |why: String| ConfigError::Invalid(format!("--carry-key-file {}: {why}", path.display()));
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(
            std::fs::File::open(path).map_err(|e| invalid(e.to_string()))?,
            4096,
        ),
        &mut bytes,
    )
    .map_err(|e| invalid(e.to_string()))?;
    let key = String::from_utf8_lossy(&bytes).trim().as_bytes().to_vec();
    if key.len() < 32 {
        return Err(invalid(format!(
            "{} bytes; it needs at least 32 (`openssl rand -hex 32`)",
            key.len()
        )));
    }
    Ok(crate::cluster::CarryKey(key))
}

/// This broker's node id, kept in `<data-dir>/node-id` (made on first start): stable across
/// restarts on the same data directory, distinct between brokers with their own.
pub(super) fn node_id(data_dir: &Path) -> Result<String, ConfigError> {
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
