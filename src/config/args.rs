//! The command line: `kernel-broker serve` and every flag, its `KERNEL_BROKER_<NAME>`
//! environment variable and the default its help shows. The same struct is the config
//! file's schema (keys in snake case); `mod.rs` resolves flags, file and defaults into
//! [`super::Settings`].

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use serde::Deserialize;

use crate::recording::Synchronous;

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
    /// Serve MCP over stdio for a host that launches stdio servers, relayed to a running
    /// broker's /mcp (Streamable HTTP) as the token's user.
    Mcp(McpArgs),
    /// Print the token a broker made and kept in its data directory (when it runs with no
    /// users file and no KERNEL_BROKER_TOKEN), e.g. `export KERNEL_BROKER_TOKEN=$(kernel-broker token)`.
    Token(TokenArgs),
    /// List your live sessions at a running broker.
    Sessions {
        #[command(flatten)]
        client: crate::cli::ClientArgs,
        /// The API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run code in a session (`new` for a new one) and print its output; charts are saved
    /// to files. The exit status is 0 when the execution ended `ok`.
    Exec(crate::cli::ExecArgs),
    /// An interactive prompt attached to a live session (as `jupyter console --existing`):
    /// Ctrl-C interrupts, charts are saved to files, Ctrl-D leaves with the session alive.
    Console(crate::cli::ConsoleArgs),
    /// The files of a session's workspace: ls, get, put, rm.
    Files(crate::cli::FilesArgs),
    /// Fork a live session: new sessions whose kernels hold everything its kernel holds
    /// now (variables, imports, open files, the execution count); their ids are printed,
    /// one a line. The session keeps running untouched.
    Fork {
        #[command(flatten)]
        client: crate::cli::ClientArgs,
        /// A session of yours (its id, or the start of it).
        session: String,
        /// How many forks to make (all or none).
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// End a session.
    Kill {
        #[command(flatten)]
        client: crate::cli::ClientArgs,
        /// A session of yours (its id, or the start of it).
        session: String,
    },
}

/// Flags of `token`.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenArgs {
    /// The broker's data directory [default: ./.data]
    #[arg(long, env = "KERNEL_BROKER_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
}

/// Flags of `mcp`.
#[derive(Debug, Clone, clap::Args)]
pub struct McpArgs {
    /// The running broker's address, e.g. http://127.0.0.1:8888 (`/mcp` is added).
    #[arg(long, env = "KERNEL_BROKER_URL")]
    pub url: String,
    /// The user's token at that broker.
    #[arg(long, env = "KERNEL_BROKER_TOKEN", hide_env_values = true)]
    pub token: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxKind {
    Local,
    Docker,
}

/// The default network policy of kernels (`--egress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EgressMode {
    /// No network at all.
    None,
    /// The hosts of `--egress-allow`, through the broker's proxy.
    Allow,
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
    /// Keep sessions across broker restarts: stopping (or losing) the broker leaves kernels
    /// running, and the next `serve` on the same data directory adopts them [default: false]
    #[arg(long, env = "KERNEL_BROKER_KEEP_SESSIONS", num_args = 0..=1, default_missing_value = "true")]
    pub keep_sessions: Option<bool>,
    /// Modules kernels import before their first cell, comma-separated; `none` for none
    /// [default: numpy,pandas,matplotlib]
    #[arg(long, env = "KERNEL_BROKER_PRELOAD")]
    pub preload: Option<String>,
    /// Default network policy of kernels: `none`, or `allow` the hosts of --egress-allow
    /// through the broker's proxy; a user's `egress_allow` in the users file overrides it
    /// [default: none]
    #[arg(long, env = "KERNEL_BROKER_EGRESS")]
    pub egress: Option<EgressMode>,
    /// Hosts kernels may reach with `--egress allow`, comma-separated: names, `*.domain`
    /// wildcards (names below the domain), public IP literals (e.g. pypi.org,files.pythonhosted.org)
    #[arg(long, env = "KERNEL_BROKER_EGRESS_ALLOW", value_delimiter = ',')]
    pub egress_allow: Option<Vec<String>>,
    /// Ports allowed with the egress hosts, comma-separated [default: 80,443]
    #[arg(long, env = "KERNEL_BROKER_EGRESS_PORTS", value_delimiter = ',')]
    pub egress_ports: Option<Vec<u16>>,
    /// Bytes a user's kernels may send and receive through the egress proxy, both ways
    /// together, since the broker started; 0 no limit [default: 1073741824]
    #[arg(long, env = "KERNEL_BROKER_EGRESS_MAX_BYTES")]
    pub egress_max_bytes: Option<u64>,
    /// Connections a user's kernels may have open to the egress proxy at once; 0 no limit
    /// [default: 16]
    #[arg(long, env = "KERNEL_BROKER_EGRESS_MAX_CONNECTIONS")]
    pub egress_max_connections: Option<usize>,
    /// Non-public networks (CIDR, comma-separated) the egress proxy may connect to anyway:
    /// where the host's DNS points public names at its own egress gateway. Never loopback,
    /// link-local, unspecified or multicast [default: none]
    #[arg(
        long,
        env = "KERNEL_BROKER_EGRESS_ALLOW_NETWORKS",
        value_delimiter = ','
    )]
    pub egress_allow_networks: Option<Vec<String>>,
    /// CA bundle, as a path inside the sandbox, that pip, requests and Python's ssl trust in
    /// kernels with egress (PIP_CERT, REQUESTS_CA_BUNDLE, SSL_CERT_FILE); `none` leaves
    /// their own defaults [default: /etc/ssl/certs/ca-certificates.crt]
    #[arg(long, env = "KERNEL_BROKER_EGRESS_CA_BUNDLE")]
    pub egress_ca_bundle: Option<String>,
    /// A CA bundle (host file) kernels with egress trust instead: shown read-only in every
    /// sandbox at /etc/kernel-broker-ca.pem and named by PIP_CERT, REQUESTS_CA_BUNDLE and
    /// SSL_CERT_FILE (for a site whose egress intercepts TLS); overrides --egress-ca-bundle
    #[arg(long, env = "KERNEL_BROKER_EGRESS_CA_FILE")]
    pub egress_ca_file: Option<PathBuf>,
    /// Fork kernels from a per-user template that has imported the preloaded modules
    /// (both sandboxes: with cgroups, without --keep-sessions; Docker: as root) [default: true]
    #[arg(long, env = "KERNEL_BROKER_FORK_SERVER", num_args = 0..=1, default_missing_value = "true")]
    pub fork_server: Option<bool>,
    /// CRIU (4.0 or later), which copies a kernel into a sandbox of its own: forks of
    /// sessions with a workspace of their own (both sandboxes, as root) [default: the first
    /// of /usr/local/sbin/criu, /usr/sbin/criu, /usr/local/bin/criu that is 4.0 or later]
    #[arg(long, env = "KERNEL_BROKER_CRIU")]
    pub criu: Option<PathBuf>,
    /// Bytes of the data directory's file system a copy must leave free: a copy (CRIU's
    /// images of a kernel's memory, held there until it is restored) that would not is
    /// refused with 507 [default: 1073741824, 1 GiB]
    #[arg(long, env = "KERNEL_BROKER_COPY_RESERVE_BYTES")]
    pub copy_reserve_bytes: Option<u64>,
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
    /// bigger one is cut off and its session turns dead, except for output (stream, display
    /// and result messages on iopub), which is cut to its first 256 KiB. 1 MiB to 1 GiB
    /// [default: 67108864]
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
    /// Checkpoints one user may hold at once, over all sessions; past it the oldest is dropped [default: 32]
    #[arg(long, env = "KERNEL_BROKER_MAX_CHECKPOINTS_PER_USER")]
    pub max_checkpoints_per_user: Option<usize>,
    /// Memory one user's checkpoints may be charged together, bytes; past it the oldest are dropped [default: 2147483648]
    #[arg(long, env = "KERNEL_BROKER_CHECKPOINT_MEMORY_PER_USER")]
    pub checkpoint_memory_per_user: Option<u64>,
    /// Take a checkpoint of a session after every execution that ends ok (a user's or a session's own setting overrides it) [default: false]
    #[arg(long, env = "KERNEL_BROKER_CHECKPOINT_EVERY_EXECUTION", num_args = 0..=1, default_missing_value = "true")]
    pub checkpoint_every_execution: Option<bool>,
    /// Pause a session idle this many seconds to disk instead of expiring it at its idle timeout (issue 37; sessions that cannot be paused expire as before); 0 or unset: off
    #[arg(long, env = "KERNEL_BROKER_PAUSE_AFTER")]
    pub pause_after: Option<u64>,
    /// Seconds a paused session is kept before it expires [default: 604800]
    #[arg(long, env = "KERNEL_BROKER_PAUSED_TTL")]
    pub paused_ttl: Option<u64>,
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
    /// Processes and threads of one session; keep 64 MiB + 3 MiB per process within the
    /// session memory limit, so a fork bomb meets the pids limit first [default: 64]
    #[arg(long, env = "KERNEL_BROKER_SESSION_PIDS_LIMIT")]
    pub session_pids_limit: Option<u64>,
    /// Default CPU limit per user, cores [default: 1]
    #[arg(long, env = "KERNEL_BROKER_CPU_LIMIT")]
    pub cpu_limit: Option<f64>,
    /// Default process and thread limit per user, all sessions together [default: 1280]
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
    /// Refuse to start (local) or to run a user's container (docker) when cgroup limits
    /// cannot be enforced [default: true]
    #[arg(long, env = "KERNEL_BROKER_REQUIRE_LIMITS")]
    pub require_limits: Option<bool>,
    /// Seconds a sandbox may take to start a kernel before the launch fails (a kernel's answer
    /// to a fork, pause or snapshot request is given 10 s more) [default: 30; docker: 60, as
    /// a cold launch creates and starts the user's container first]
    #[arg(long, env = "KERNEL_BROKER_LAUNCH_TIMEOUT")]
    pub launch_timeout: Option<u64>,
    /// Docker Engine socket [default: /var/run/docker.sock]
    #[arg(long, env = "KERNEL_BROKER_DOCKER_SOCKET")]
    pub docker_socket: Option<String>,
    /// Kernel image for the docker sandbox [default: kernel-broker/python-kernel:latest]
    #[arg(long, env = "KERNEL_BROKER_DOCKER_IMAGE")]
    pub docker_image: Option<String>,
    /// The cgroup the engine creates users' containers under (HostConfig.CgroupParent), e.g.
    /// a subtree delegated to a rootless Podman's user (docs/HOSTS-podman.md) [default: the engine's]
    #[arg(long, env = "KERNEL_BROKER_DOCKER_CGROUP_PARENT")]
    pub docker_cgroup_parent: Option<String>,
    /// Seconds one request to the container engine may take, connecting included [default: 60]
    #[arg(long, env = "KERNEL_BROKER_DOCKER_API_TIMEOUT")]
    pub docker_api_timeout: Option<u64>,
    /// Seconds a user's container (docker) or fork-server template (local) lives on with no
    /// session [default: 300]
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
    /// PostgreSQL for the recordings instead of the SQLite file, shared by the brokers of a
    /// cluster: postgres://USER:PASSWORD@HOST:PORT/DATABASE (the schema is made and migrated at start)
    #[arg(long, env = "KERNEL_BROKER_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Cluster mode (with --database-url): how the other brokers reach this one,
    /// http://HOST:PORT; a request for a session another broker holds is forwarded to it
    #[arg(long, env = "KERNEL_BROKER_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Cluster mode: seconds a node's registration lasts without renewal; a node silent that
    /// long is lost, and its sessions dead [default: 15]
    #[arg(long, env = "KERNEL_BROKER_NODE_LEASE")]
    pub node_lease: Option<u64>,
    /// Cluster mode: sessions this node is sized for; a new session goes to the node with the
    /// most headroom, its sessions and memory against its capacity [default: 1000]
    #[arg(long, env = "KERNEL_BROKER_NODE_CAPACITY_SESSIONS")]
    pub node_capacity_sessions: Option<u64>,
    /// Cluster mode: bytes of kernel memory this node is sized for [default: the machine's memory]
    #[arg(long, env = "KERNEL_BROKER_NODE_CAPACITY_MEMORY")]
    pub node_capacity_memory: Option<u64>,
    /// Cluster mode: store a copy of every paused session with a workspace of its own in
    /// the database, so that any node resumes it while its own is not live (give every
    /// node this and the same --uid-base and users file) [default: false]
    #[arg(long, env = "KERNEL_BROKER_CARRY_PAUSED")]
    pub carry_paused: Option<bool>,
    /// Cluster mode, --carry-paused: a file of at least 32 bytes (the same on every node,
    /// kept out of the database) the copies are sealed with; without it, with the cluster's
    /// key, which the database holds [default: none]
    #[arg(long, env = "KERNEL_BROKER_CARRY_KEY_FILE")]
    pub carry_key_file: Option<PathBuf>,
    /// This broker's name among those sharing a database (its open sessions are its own)
    /// [default: made on first start and kept in <data-dir>/node-id]
    #[arg(long, env = "KERNEL_BROKER_NODE_ID")]
    pub node_id: Option<String>,
    /// normal: a commit survives a killed broker; full: also a machine crash (an fsync per commit) [default: normal]
    #[arg(long, env = "KERNEL_BROKER_RECORD_SYNCHRONOUS")]
    pub record_synchronous: Option<Synchronous>,
    /// Bytes of messages recorded per execution (from one execute_request to the next), images counted once; past it one recording_truncated marker [default: 52428800]
    #[arg(long, env = "KERNEL_BROKER_RECORD_MAX_EXECUTION_BYTES")]
    pub record_max_execution_bytes: Option<u64>,
    /// Bytes of messages recorded per session in all [default: 1073741824]
    #[arg(long, env = "KERNEL_BROKER_RECORD_MAX_SESSION_BYTES")]
    pub record_max_session_bytes: Option<u64>,
    /// A credential format masked in every session's output as `[secret:NAME]`, as
    /// NAME=REGEX; repeat for more. Added to the default set (AWS, GitHub, Slack, Google,
    /// Stripe keys, `sk-` API keys, PEM private keys) unless that is turned off
    #[arg(
        long = "secret-pattern",
        env = "KERNEL_BROKER_SECRET_PATTERNS",
        value_delimiter = '\n'
    )]
    pub secret_patterns: Option<Vec<String>>,
    /// Mask the default credential formats in every session's output [default: true]
    #[arg(long, env = "KERNEL_BROKER_DEFAULT_SECRET_PATTERNS")]
    pub default_secret_patterns: Option<bool>,
    /// The pre-execution policy (TOML, docs/SECURITY.md "Pre-execution policy"): rules over
    /// Python code's syntax tree that refuse an execution before it reaches the kernel
    /// [default: none]
    #[arg(long, env = "KERNEL_BROKER_POLICY")]
    pub policy: Option<PathBuf>,
}
