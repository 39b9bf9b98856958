//! Cluster mode (`--database-url` with `--advertise-url`): brokers that share a PostgreSQL
//! database serve each other's sessions. Each node registers itself in `nodes` (its id, the
//! URL the others reach it at) and renews a lease there; the live nodes are its peers. A
//! request for a session this node does not hold is forwarded, whole (streaming bodies and
//! WebSockets included), to the peer that holds it (`crate::api::cluster`). Which peer that
//! is, the session directory says (`cluster_sessions`: each node lists the sessions it holds
//! at every renewal, and a lost node's are marked lost); for a session made since its node
//! last wrote the directory, the node asks the peers themselves. Answers are cached.
//!
//! Node-to-node requests carry the cluster's key (made by the first node, kept in the
//! database: only a node that can read the database knows it) in
//! [`NODE_HEADER`]; a request with the key is served where it lands, never forwarded again,
//! and a request with a wrong key is refused. The user's own credentials travel with it and
//! are checked by the serving node as by any other.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use http_body_util::BodyExt;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio_postgres::NoTls;
use uuid::Uuid;

use crate::sync::lock;

/// The header of node-to-node requests: the cluster's key.
pub const NODE_HEADER: &str = "x-kernel-broker-node";
/// How long a node's registration lasts without renewal, by default.
pub const LEASE: Duration = Duration::from_secs(15);
/// Sessions whose owner is remembered.
const OWNERS: usize = 10_000;

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
}

/// A node's load, as placement weighs it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    pub sessions: u64,
    /// The memory limits of its sessions and pooled kernels.
    pub memory_reserved: u64,
}

/// How much room a node has: the smaller of its free shares of memory and of sessions.
pub fn headroom(load: Load, memory_capacity: u64, session_capacity: u64) -> f64 {
    let share = |used: u64, cap: u64| {
        if cap == 0 {
            0.0
        } else {
            1.0 - (used as f64 / cap as f64).min(1.0)
        }
    };
    share(load.memory_reserved, memory_capacity).min(share(load.sessions, session_capacity))
}

/// The machine's memory (`MemTotal`).
fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster database: {0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("cluster: {0}")]
    Other(String),
}

/// This node's view of the cluster.
pub struct Cluster {
    config: ClusterConfig,
    pool: deadpool_postgres::Pool,
    key: String,
    http: Client<HttpConnector, Body>,
    /// Session → the advertise URL of the peer that holds it.
    owners: Mutex<HashMap<Uuid, String>>,
    /// The live peers, refreshed at most once a second.
    peers: Mutex<(Instant, Vec<Peer>)>,
    /// This node's load now (set once the registry exists).
    load: std::sync::OnceLock<Box<dyn Fn() -> Load + Send + Sync>>,
    memory_capacity: u64,
    /// Draining: no new sessions here (placement skips this node).
    draining: std::sync::atomic::AtomicBool,
    /// The lease's health as this node sees it (see [`Cluster::is_isolated`]).
    health: Mutex<Health>,
    /// This node's sessions now, for the session directory (set once the registry exists).
    listed: std::sync::OnceLock<Box<dyn Fn() -> Vec<Listed> + Send + Sync>>,
    /// What ends this node's sessions when it learns it was declared lost.
    on_lost:
        std::sync::OnceLock<Box<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>>,
}

/// When this node last renewed its lease, and since when without a failure.
struct Health {
    renewed: Instant,
    /// Since when every renewal succeeded (`None` right after a failure).
    healthy_since: Option<Instant>,
}

/// A session of this node, as the session directory lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub id: Uuid,
    pub user: String,
    pub kernel: String,
    /// Microseconds since the epoch.
    pub created_at: i64,
}

/// What the session directory says of a session of a user's.
#[derive(Debug, Clone, PartialEq)]
pub enum Directory {
    /// Held by the live peer at this URL.
    At(String),
    /// Held by a node that was lost: dead.
    Lost {
        kernel: String,
        created_at: i64,
        lost_at: i64,
    },
    /// Not listed (not the user's, unknown, ended, or made since its node last wrote the
    /// directory; or held here).
    Unknown,
}

/// Another live node.
#[derive(Debug, Clone)]
pub struct Peer {
    pub id: String,
    pub url: String,
}

/// Registers the node of `config` in `nodes`: live (a lease from now), not lost, not
/// draining.
async fn register(
    client: &deadpool_postgres::Client,
    config: &ClusterConfig,
) -> Result<(), ClusterError> {
    client
        .execute(
            "INSERT INTO nodes (id, advertise_url, started_at, lease_until)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (id) DO UPDATE SET advertise_url = EXCLUDED.advertise_url,
               started_at = EXCLUDED.started_at, lease_until = EXCLUDED.lease_until,
               lost_at = NULL, draining = false",
            &[
                &config.node_id,
                &config.advertise_url,
                &now_micros(),
                &(now_micros() + config.lease.as_micros() as i64),
            ],
        )
        .await?;
    Ok(())
}

fn now_micros() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

impl Cluster {
    /// Joins the cluster: migrates the schema if needed, registers this node and starts
    /// renewing its lease (until the process ends).
    pub async fn join(config: ClusterConfig) -> Result<std::sync::Arc<Self>, ClusterError> {
        let pool = crate::recording::postgres_pool(&config.database_url, 4)
            .map_err(|e| ClusterError::Other(e.to_string()))?;
        let client = pool
            .get()
            .await
            .map_err(|e| ClusterError::Other(format!("connecting: {e}")))?;
        crate::recording::migrate_postgres(&client, &config.database_url)
            .await
            .map_err(|e| ClusterError::Other(e.to_string()))?;
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
        register(&client, &config).await?;
        drop(client);
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        connector.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new()).build(connector);
        let memory_capacity = config.memory_capacity.unwrap_or_else(machine_memory);
        let cluster = std::sync::Arc::new(Self {
            memory_capacity,
            load: std::sync::OnceLock::new(),
            draining: std::sync::atomic::AtomicBool::new(false),
            config,
            pool,
            key,
            http,
            owners: Mutex::new(HashMap::new()),
            peers: Mutex::new((Instant::now() - Duration::from_secs(60), Vec::new())),
            health: Mutex::new(Health {
                renewed: Instant::now(),
                healthy_since: Some(Instant::now()),
            }),
            on_lost: std::sync::OnceLock::new(),
            listed: std::sync::OnceLock::new(),
        });
        tracing::info!(node = %cluster.config.node_id, url = %cluster.config.advertise_url, "joined the cluster");
        let lease = cluster.config.lease;
        let renew = std::sync::Arc::downgrade(&cluster);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(lease / 3);
            loop {
                every.tick().await;
                let Some(c) = renew.upgrade() else { return };
                c.tend_lease().await;
            }
        });
        Ok(cluster)
    }

    /// One turn of the lease's upkeep: renew it; if this node was declared lost meanwhile
    /// (it could not renew in time: paused, cut off from the database), end its sessions,
    /// which the cluster already counts as dead, and join again; look for lost nodes, but
    /// only after a whole lease of renewals without a failure, so that a node coming back
    /// from an outage of the database (when every lease lapsed) does not declare the others
    /// lost before they could renew.
    async fn tend_lease(&self) {
        match self.renew().await {
            Ok(true) => {
                let mut h = lock(&self.health);
                h.renewed = Instant::now();
                h.healthy_since.get_or_insert_with(Instant::now);
            }
            Ok(false) => {
                tracing::error!(node = %self.config.node_id, "cluster: this node was declared lost (its lease lapsed); its sessions are dead: ending them, then joining again");
                if let Some(end) = self.on_lost.get() {
                    end().await;
                }
                lock(&self.owners).clear();
                match self.register().await {
                    Ok(()) => {
                        let mut h = lock(&self.health);
                        h.renewed = Instant::now();
                        h.healthy_since = Some(Instant::now());
                        tracing::info!(node = %self.config.node_id, "cluster: joined again");
                    }
                    Err(e) => {
                        lock(&self.health).healthy_since = None;
                        tracing::warn!(error = %e, "cluster: could not join again");
                    }
                }
                return;
            }
            Err(e) => {
                lock(&self.health).healthy_since = None;
                tracing::warn!(error = %e, "cluster: could not renew this node's lease");
                return;
            }
        }
        if let Err(e) = self.write_directory().await {
            tracing::warn!(error = %e, "cluster: could not write this node's sessions to the directory");
        }
        let settled = lock(&self.health)
            .healthy_since
            .is_some_and(|t| t.elapsed() >= self.config.lease);
        if settled {
            if let Err(e) = self.sweep_lost().await {
                tracing::warn!(error = %e, "cluster: could not look for lost nodes");
            }
        }
    }

    /// Where this node's sessions come from (the registry), for the session directory.
    pub fn set_listed(&self, f: impl Fn() -> Vec<Listed> + Send + Sync + 'static) {
        let _ = self.listed.set(Box::new(f));
    }

    /// Writes this node's sessions to the directory: the ones it holds now are listed
    /// (under this node), the ones that ended are removed. Nothing is written once this
    /// node was declared lost (its sessions stay listed as lost).
    async fn write_directory(&self) -> Result<(), ClusterError> {
        let sessions = self.listed.get().map(|f| f()).unwrap_or_default();
        let ids: Vec<String> = sessions.iter().map(|s| s.id.to_string()).collect();
        let users: Vec<String> = sessions.iter().map(|s| s.user.clone()).collect();
        let kernels: Vec<String> = sessions.iter().map(|s| s.kernel.clone()).collect();
        let created: Vec<i64> = sessions.iter().map(|s| s.created_at).collect();
        let mut c = self
            .pool
            .get()
            .await
            .map_err(|e| ClusterError::Other(e.to_string()))?;
        let tx = c.transaction().await?;
        let live = tx
            .query_opt(
                "SELECT 1 FROM nodes WHERE id = $1 AND lost_at IS NULL FOR SHARE",
                &[&self.config.node_id],
            )
            .await?;
        if live.is_none() {
            return Ok(());
        }
        tx.execute(
            "DELETE FROM cluster_sessions
             WHERE node = $1 AND lost_at IS NULL AND NOT (id = ANY($2))",
            &[&self.config.node_id, &ids],
        )
        .await?;
        tx.execute(
            "INSERT INTO cluster_sessions (id, node, user_name, kernel, created_at, seen_at)
             SELECT u.id, $1, u.user_name, u.kernel, u.created_at, $6
             FROM unnest($2::text[], $3::text[], $4::text[], $5::int8[])
               AS u(id, user_name, kernel, created_at)
             ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node, seen_at = EXCLUDED.seen_at,
               lost_at = NULL",
            &[
                &self.config.node_id,
                &ids,
                &users,
                &kernels,
                &created,
                &now_micros(),
            ],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// What the session directory says of session `id` of `user`.
    pub async fn directory(&self, id: Uuid, user: &str) -> Result<Directory, ClusterError> {
        let c = self
            .pool
            .get()
            .await
            .map_err(|e| ClusterError::Other(e.to_string()))?;
        let row = c
            .query_opt(
                "SELECT s.kernel, s.created_at, s.lost_at, n.advertise_url,
                   n.lease_until > $3 AND n.lost_at IS NULL AND n.id <> $4
                 FROM cluster_sessions s LEFT JOIN nodes n ON n.id = s.node
                 WHERE s.id = $1 AND s.user_name = $2",
                &[&id.to_string(), &user, &now_micros(), &self.config.node_id],
            )
            .await?;
        let Some(row) = row else {
            return Ok(Directory::Unknown);
        };
        let lost_at: Option<i64> = row.get(2);
        if let Some(lost_at) = lost_at {
            return Ok(Directory::Lost {
                kernel: row.get(0),
                created_at: row.get(1),
                lost_at,
            });
        }
        let url: Option<String> = row.get(3);
        let live: Option<bool> = row.get(4);
        Ok(match (url, live) {
            (Some(url), Some(true)) => Directory::At(url),
            _ => Directory::Unknown,
        })
    }

    /// Registers this node (again): live, not lost, not draining.
    async fn register(&self) -> Result<(), ClusterError> {
        let c = self
            .pool
            .get()
            .await
            .map_err(|e| ClusterError::Other(e.to_string()))?;
        register(&c, &self.config).await
    }

    /// What ends this node's sessions when it learns it was declared lost.
    pub fn on_lost(
        &self,
        f: impl Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync + 'static,
    ) {
        let _ = self.on_lost.set(Box::new(f));
    }

    /// Whether this node could not renew its lease for longer than the lease: the others
    /// may have declared it lost and its sessions dead, so it serves none of them (`503`)
    /// until it renews again (and ends them if it was declared lost).
    pub fn is_isolated(&self) -> bool {
        lock(&self.health).renewed.elapsed() > self.config.lease
    }

    /// Whether `value` (of [`NODE_HEADER`]) is the cluster's key.
    pub fn is_node(&self, value: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        value.ct_eq(self.key.as_bytes()).into()
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.config.node_id
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Drains this node: it takes no new sessions (those asked of it go to other nodes),
    /// and says so in the nodes table at once.
    pub async fn drain(&self) -> Result<(), ClusterError> {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
        self.renew().await.map(|_| ())
    }

    /// Where this node's load comes from (the registry).
    pub fn set_load(&self, f: impl Fn() -> Load + Send + Sync + 'static) {
        let _ = self.load.set(Box::new(f));
    }

    fn load_now(&self) -> Load {
        self.load.get().map(|f| f()).unwrap_or_default()
    }

    /// Renews this node's lease (and reports its load); `false` if it was declared lost.
    async fn renew(&self) -> Result<bool, ClusterError> {
        let c = self
            .pool
            .get()
            .await
            .map_err(|e| ClusterError::Other(e.to_string()))?;
        let load = self.load_now();
        let n = c
            .execute(
                "UPDATE nodes SET lease_until = $2, advertise_url = $3, sessions = $4,
               memory_reserved = $5, memory_capacity = $6, session_capacity = $7, draining = $8
             WHERE id = $1 AND lost_at IS NULL",
                &[
                    &self.config.node_id,
                    &(now_micros() + self.config.lease.as_micros() as i64),
                    &self.config.advertise_url,
                    &(load.sessions as i64),
                    &(load.memory_reserved as i64),
                    &(self.memory_capacity as i64),
                    &(self.config.session_capacity as i64),
                    &self.is_draining(),
                ],
            )
            .await?;
        Ok(n == 1)
    }

    /// The node a new session goes to: the live node with the most headroom (this one's
    /// load counted now, the others' as of their last renewal); `None` when it is this one
    /// (a draining node places every session elsewhere, or nowhere: `None` then too).
    pub async fn place(&self, memory: u64) -> Option<Peer> {
        let c = match self.pool.get().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cluster: placement without the nodes table; here");
                return None;
            }
        };
        let rows = c
            .query(
                "SELECT id, advertise_url, sessions, memory_reserved, memory_capacity,
                        session_capacity
                 FROM nodes WHERE lease_until > $1 AND lost_at IS NULL AND NOT draining
                   AND id <> $2",
                &[&now_micros(), &self.config.node_id],
            )
            .await
            .map_err(|e| tracing::warn!(error = %e, "cluster: placement failed; here"))
            .ok()?;
        let mut best: Option<(f64, Peer)> = None;
        let here = headroom(
            self.load_now(),
            self.memory_capacity,
            self.config.session_capacity,
        );
        for r in rows {
            let load = Load {
                sessions: r.get::<_, i64>(2).max(0) as u64,
                memory_reserved: r.get::<_, i64>(3).max(0) as u64,
            };
            let h = headroom(
                load,
                r.get::<_, i64>(4).max(0) as u64,
                r.get::<_, i64>(5).max(0) as u64,
            );
            if best.as_ref().is_none_or(|(b, _)| h > *b) {
                best = Some((
                    h,
                    Peer {
                        id: r.get(0),
                        url: r.get(1),
                    },
                ));
            }
        }
        let chosen = if self.is_draining() {
            best.map(|(_, p)| p)
        } else {
            // Ties stay here: no hop for nothing.
            best.filter(|(h, _)| *h > here).map(|(_, p)| p)
        };
        // The chosen node's row counts the session at once, so that the next placements,
        // here and on every node, see it before that node's next renewal reports its load
        // (a burst of creations would otherwise all go to the node that looked emptiest).
        let id = chosen.as_ref().map_or(&self.config.node_id, |p| &p.id);
        if let Err(e) = c
            .execute(
                "UPDATE nodes SET sessions = sessions + 1, memory_reserved = memory_reserved + $2
                 WHERE id = $1",
                &[id, &(memory.min(i64::MAX as u64) as i64)],
            )
            .await
        {
            tracing::warn!(error = %e, "cluster: the placement was not counted in the nodes table");
        }
        chosen
    }

    /// Holds `user`'s creation lock for the cluster until the guard is dropped: one
    /// session creation of a user at a time, cluster-wide, so the quota counted across nodes
    /// holds. On a connection of its own: if this request is dropped half-way, the
    /// connection closes and PostgreSQL releases the lock.
    pub async fn lock_user(&self, user: &str) -> Result<UserLock, ClusterError> {
        let (client, conn) = tokio_postgres::connect(&self.config.database_url, NoTls).await?;
        let task = tokio::spawn(conn);
        client
            .execute(
                "SELECT pg_advisory_lock(hashtext('kernel-broker user ' || $1))",
                &[&user],
            )
            .await?;
        Ok(UserLock {
            _client: client,
            task,
        })
    }

    /// Nodes whose lease lapsed are lost: the first node to notice claims each (so it is
    /// done once) and ends its sessions' recordings with `node_lost`; their kernels went
    /// with the node, their recordings stay readable.
    async fn sweep_lost(&self) -> Result<(), ClusterError> {
        let c = self
            .pool
            .get()
            .await
            .map_err(|e| ClusterError::Other(e.to_string()))?;
        let now = now_micros();
        let lost = c
            .query(
                "UPDATE nodes SET lost_at = $1
                 WHERE lease_until < $1 AND lost_at IS NULL AND id <> $2 RETURNING id",
                &[&now, &self.config.node_id],
            )
            .await?;
        // The directory keeps a lost node's sessions (answered dead) for a week.
        const KEEP_LOST: i64 = 7 * 24 * 3600 * 1_000_000;
        c.execute(
            "DELETE FROM cluster_sessions WHERE lost_at < $1",
            &[&(now - KEEP_LOST)],
        )
        .await?;
        for row in lost {
            let node: String = row.get(0);
            if let Err(e) = c
                .execute(
                    "UPDATE cluster_sessions SET lost_at = $2 WHERE node = $1 AND lost_at IS NULL",
                    &[&node, &now],
                )
                .await
            {
                tracing::error!(node = %node, error = %e, "cluster: could not mark a lost node's sessions in the directory");
            }
            match crate::recording::close_lost_node(&c, &node).await {
                Ok(n) => {
                    tracing::warn!(node = %node, sessions = n, "cluster: a node was lost (its lease lapsed); its sessions are dead")
                }
                Err(e) => {
                    tracing::error!(node = %node, error = %e, "cluster: could not close a lost node's sessions")
                }
            }
        }
        Ok(())
    }

    /// Whether the node at `url` is a live peer.
    pub async fn is_live(&self, url: &str) -> bool {
        self.peers().await.iter().any(|p| p.url == url)
    }

    /// Resolves once the node at `url` is no longer a live peer (checked every third of the
    /// lease).
    pub async fn until_gone(&self, url: &str) {
        loop {
            tokio::time::sleep(self.config.lease / 3).await;
            if !self.is_live(url).await {
                return;
            }
        }
    }

    /// The other live nodes, read from the database now.
    pub async fn fresh_peers(&self) -> Vec<Peer> {
        lock(&self.peers).0 = Instant::now() - Duration::from_secs(60);
        self.peers().await
    }

    /// The other live nodes (leases not lapsed).
    pub async fn peers(&self) -> Vec<Peer> {
        {
            let p = lock(&self.peers);
            if p.0.elapsed() < Duration::from_secs(1) {
                return p.1.clone();
            }
        }
        let fetched = async {
            let c = self
                .pool
                .get()
                .await
                .map_err(|e| ClusterError::Other(e.to_string()))?;
            let rows = c
                .query(
                    "SELECT id, advertise_url FROM nodes
                     WHERE lease_until > $1 AND lost_at IS NULL AND id <> $2 ORDER BY id",
                    &[&now_micros(), &self.config.node_id],
                )
                .await?;
            Ok::<_, ClusterError>(
                rows.iter()
                    .map(|r| Peer {
                        id: r.get(0),
                        url: r.get(1),
                    })
                    .collect::<Vec<_>>(),
            )
        }
        .await;
        match fetched {
            Ok(peers) => {
                *lock(&self.peers) = (Instant::now(), peers.clone());
                peers
            }
            Err(e) => {
                tracing::warn!(error = %e, "cluster: could not read the nodes");
                lock(&self.peers).1.clone()
            }
        }
    }

    pub fn owner_cached(&self, id: Uuid) -> Option<String> {
        lock(&self.owners).get(&id).cloned()
    }

    pub fn remember_owner(&self, id: Uuid, url: String) {
        let mut o = lock(&self.owners);
        if o.len() >= OWNERS {
            o.clear();
        }
        o.insert(id, url);
    }

    pub fn forget_owner(&self, id: Uuid) {
        lock(&self.owners).remove(&id);
    }

    /// Sends `req` to `base` (a peer's URL) as a node-to-node request and returns its
    /// answer, body streaming.
    pub async fn send(
        &self,
        base: &str,
        mut req: axum::http::Request<Body>,
    ) -> Result<axum::http::Response<Body>, ClusterError> {
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        let uri: axum::http::Uri = format!("{}{path}", base.trim_end_matches('/'))
            .parse()
            .map_err(|e| ClusterError::Other(format!("peer URL {base}: {e}")))?;
        if let Some(authority) = uri.authority() {
            let host = axum::http::HeaderValue::from_str(authority.as_str())
                .map_err(|e| ClusterError::Other(e.to_string()))?;
            req.headers_mut().insert(axum::http::header::HOST, host);
        }
        *req.uri_mut() = uri;
        req.headers_mut().insert(
            NODE_HEADER,
            axum::http::HeaderValue::from_str(&self.key)
                .map_err(|e| ClusterError::Other(e.to_string()))?,
        );
        let resp = self
            .http
            .request(req)
            .await
            .map_err(|e| ClusterError::Other(format!("{base}: {e}")))?;
        Ok(resp.map(|b| Body::new(b.map_err(axum::Error::new))))
    }
}

/// A user's creation lock (see [`Cluster::lock_user`]); released when dropped.
pub struct UserLock {
    _client: tokio_postgres::Client,
    task: tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
}

impl Drop for UserLock {
    fn drop(&mut self) {
        // Closing the connection releases the lock.
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_is_the_scarcer_resource() {
        let load = |sessions, memory_reserved| Load {
            sessions,
            memory_reserved,
        };
        assert_eq!(headroom(load(0, 0), 100, 10), 1.0);
        assert_eq!(headroom(load(5, 10), 100, 10), 0.5);
        assert_eq!(headroom(load(1, 90), 100, 10), 0.09999999999999998);
        assert_eq!(headroom(load(20, 0), 100, 10), 0.0, "over capacity is none");
        assert_eq!(
            headroom(load(0, 0), 0, 10),
            0.0,
            "no capacity known is none"
        );
    }
}
