//! Cluster mode (`--database-url` with `--advertise-url`): brokers that share a PostgreSQL
//! database serve each other's sessions. Each node registers itself in `nodes` (its id, the
//! URL the others reach it at) and renews a lease there (`lease.rs`); the live nodes are its
//! peers (`peers.rs`). A request for a session this node does not hold is forwarded, whole
//! (streaming bodies and WebSockets included), to the peer that holds it: that is the api
//! layer's work (`crate::api::cluster`), this module builds no request. Which peer that is,
//! the session directory says (`directory.rs`: each node lists the sessions it holds at every
//! renewal, and a lost node's are marked lost); for a session made since its node last wrote
//! the directory, the api layer asks the peers themselves. Answers are cached. A new session
//! goes to the node with the most headroom (`placement.rs`).
//!
//! Node-to-node requests carry the cluster's key (made by the first node, kept in the
//! database: only a node that can read the database knows it, [`Cluster::key`]); a request
//! with the key is served where it lands, never forwarded again, and a request with a wrong
//! key is refused. The user's own credentials travel with it and are checked by the serving
//! node as by any other.
//!
//! Its tables are its own ([`schema`]); the database layer ([`crate::db::postgres`]) applies
//! them. It knows nothing of the recording: what a lost node leaves to close there is done
//! by whoever [`Cluster::on_node_lost`] was given.

mod copies;
mod directory;
mod lease;
mod peers;
mod placement;
pub mod schema;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use uuid::Uuid;

use crate::db::postgres as pg;

pub use copies::{CopyFile, FoundCopy, PieceSeal, StoredCopy, MANIFEST};
pub use directory::{Directory, Listed};
pub use lease::LEASE;
pub use peers::Peer;
pub use placement::{headroom, Load, UserLock};

/// Cluster mode's settings.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub database_url: String,
    pub node_id: String,
    /// How the other nodes reach this one: `http://HOST:PORT`.
    pub advertise_url: String,
    /// How long this node's registration lasts without renewal (renewed every third of
    /// it); a node whose lease lapsed is lost.
    pub lease: Duration,
    /// Sessions this node is sized for (placement weighs its sessions against it).
    pub session_capacity: u64,
    /// Bytes of kernel memory this node is sized for [default: the machine's memory].
    pub memory_capacity: Option<u64>,
    /// Paused sessions are carried to the database (`copies.rs`), for any node to resume.
    pub carry_paused: bool,
    /// What the copies are sealed with (`--carry-key-file`), if not the cluster's key.
    pub carry_key: Option<CarryKey>,
}

/// A key kept out of the database that carried copies are sealed with (never printed).
#[derive(Clone)]
pub struct CarryKey(pub Vec<u8>);

impl std::fmt::Debug for CarryKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CarryKey(..)")
    }
}

/// Errors of the cluster layer.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A statement on the cluster's tables failed.
    #[error("cluster database: {0}")]
    Query(#[from] tokio_postgres::Error),
    /// The pool of connections could not be made.
    #[error("cluster database {location}: {source}")]
    Pool {
        /// The URL without its password.
        location: String,
        #[source]
        source: pg::PoolError,
    },
    /// No connection to the database (within the pool's time).
    #[error("cluster database: connecting: {0}")]
    Connect(#[source] deadpool_postgres::PoolError),
    /// The cluster's tables could not be migrated.
    #[error(transparent)]
    Schema(#[from] pg::MigrateError),
    /// A paused session's file could not be read for its copy.
    #[error("reading a paused session's file: {0}")]
    Copy(#[source] std::io::Error),
}

/// What closes the recordings of a lost node (given the cluster's connection, the node's
/// id, and the ids of its paused sessions, which stay open); how many it closed.
pub type CloseLostNode = Box<
    dyn for<'a> Fn(
            &'a tokio_postgres::Client,
            &'a str,
            &'a [String],
        ) -> BoxFuture<'a, Result<u64, Box<dyn std::error::Error + Send + Sync>>>
        + Send
        + Sync,
>;

/// What ends this node's sessions once it learns it was declared lost (given the ids of the
/// paused ones the cluster kept, and of those another node took over).
type EndDeclaredDead = Box<dyn Fn(Vec<Uuid>, Vec<Uuid>) -> BoxFuture<'static, ()> + Send + Sync>;

/// The most users' creation locks one node holds at once (more wait for a connection).
const LOCK_CONNECTIONS: usize = 32;

/// This node's view of the cluster.
pub struct Cluster {
    config: ClusterConfig,
    pool: deadpool_postgres::Pool,
    /// The connections users' creation locks are held on ([`Cluster::lock_user`]): apart,
    /// so that many creations at once never keep the lease from being renewed.
    lock_pool: deadpool_postgres::Pool,
    key: String,
    /// Session → the advertise URL of the peer that holds it.
    owners: Mutex<HashMap<Uuid, String>>,
    /// The live peers, refreshed at most once a second.
    peers: Mutex<(Instant, Vec<Peer>)>,
    /// This node's load now (set once the registry exists).
    load: OnceLock<Box<dyn Fn() -> Load + Send + Sync>>,
    memory_capacity: u64,
    /// Draining: no new sessions here (placement skips this node).
    draining: AtomicBool,
    /// The lease's health as this node sees it (see [`Cluster::is_isolated`]).
    health: Mutex<lease::Health>,
    /// This node's sessions now, for the session directory (set once the registry exists).
    listed: OnceLock<Box<dyn Fn() -> Vec<Listed> + Send + Sync>>,
    /// What ends this node's sessions when it learns it was declared lost (given the paused
    /// ones the cluster kept).
    on_lost: OnceLock<EndDeclaredDead>,
    /// What closes the recordings of another node found lost.
    on_node_lost: OnceLock<CloseLostNode>,
}

impl Cluster {
    /// Joins the cluster: migrates the schema if needed, registers this node and starts
    /// renewing its lease (until the process ends).
    pub async fn join(config: ClusterConfig) -> Result<Arc<Self>, ClusterError> {
        let location = pg::redact(&config.database_url);
        let pool = pg::pool(&config.database_url, 4).map_err(|source| ClusterError::Pool {
            location: location.clone(),
            source,
        })?;
        let lock_pool = pg::pool(&config.database_url, LOCK_CONNECTIONS).map_err(|source| {
            ClusterError::Pool {
                location: location.clone(),
                source,
            }
        })?;
        let client = pool.get().await.map_err(ClusterError::Connect)?;
        pg::migrate(&client, &location, "cluster", schema::MIGRATIONS).await?;
        let mut fresh = [0u8; 32];
        rand::Rng::fill(&mut rand::thread_rng(), &mut fresh);
        client
            .execute(
                "INSERT INTO cluster_key (id, key) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
                &[&hex::encode(fresh)],
            )
            .await?;
        let key: String = client
            .query_one("SELECT key FROM cluster_key WHERE id = 1", &[])
            .await?
            .get(0);
        lease::register(&client, &config).await?;
        drop(client);
        let memory_capacity = config
            .memory_capacity
            .unwrap_or_else(placement::machine_memory);
        let cluster = Arc::new(Self {
            memory_capacity,
            load: OnceLock::new(),
            draining: AtomicBool::new(false),
            config,
            pool,
            lock_pool,
            key,
            owners: Mutex::new(HashMap::new()),
            peers: Mutex::new((Instant::now() - Duration::from_secs(60), Vec::new())),
            health: Mutex::new(lease::Health::new()),
            on_lost: OnceLock::new(),
            on_node_lost: OnceLock::new(),
            listed: OnceLock::new(),
        });
        tracing::info!(node = %cluster.config.node_id, url = %cluster.config.advertise_url, "joined the cluster");
        lease::spawn_upkeep(&cluster);
        Ok(cluster)
    }

    /// A connection of the pool.
    async fn client(&self) -> Result<deadpool_postgres::Client, ClusterError> {
        self.pool.get().await.map_err(ClusterError::Connect)
    }

    /// Where this node's sessions come from (the registry), for the session directory.
    pub fn set_listed(&self, f: impl Fn() -> Vec<Listed> + Send + Sync + 'static) {
        let _ = self.listed.set(Box::new(f));
    }

    /// What ends this node's sessions when it learns it was declared lost: all but the
    /// paused ones the cluster kept (given first), whose state is on this node's disk;
    /// those another node took over (given second) are let go, not ended.
    pub fn on_lost(
        &self,
        f: impl Fn(Vec<Uuid>, Vec<Uuid>) -> BoxFuture<'static, ()> + Send + Sync + 'static,
    ) {
        let _ = self.on_lost.set(Box::new(f));
    }

    /// What closes the recordings of a node this one finds lost (their kernels went with
    /// the node; their recordings end with `node_lost` and stay readable).
    pub fn on_node_lost(&self, f: CloseLostNode) {
        let _ = self.on_node_lost.set(f);
    }

    /// Whether `value` (of a node-to-node request) is the cluster's key.
    pub fn is_node(&self, value: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        value.ct_eq(self.key.as_bytes()).into()
    }

    /// The cluster's key, which this node's requests to its peers carry.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.config.node_id
    }

    /// Whether this node carries paused sessions to the database (`--carry-paused`).
    pub fn carries_paused(&self) -> bool {
        self.config.carry_paused
    }

    /// What carried copies are sealed with: `--carry-key-file`'s key, else the cluster's
    /// (which the database holds).
    pub fn carry_secret(&self) -> &[u8] {
        match &self.config.carry_key {
            Some(key) => &key.0,
            None => self.key.as_bytes(),
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Drains this node: it takes no new sessions (those asked of it go to other nodes),
    /// and says so in the nodes table at once.
    pub async fn drain(&self) -> Result<(), ClusterError> {
        self.draining.store(true, Ordering::Release);
        self.renew().await.map(|_| ())
    }

    /// Where this node's load comes from (the registry).
    pub fn set_load(&self, f: impl Fn() -> Load + Send + Sync + 'static) {
        let _ = self.load.set(Box::new(f));
    }

    fn load_now(&self) -> Load {
        self.load.get().map(|f| f()).unwrap_or_default()
    }
}

fn now_micros() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

#[cfg(test)]
mod tests;
