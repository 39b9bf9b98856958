//! PostgreSQL (`--database-url`): connections, pools, and the schema's versions. The
//! recording ([`crate::recording`]) and cluster mode ([`crate::cluster`]) share one
//! database; each brings its own tables as [`Migration`]s, applied here ([`migrate`]).

mod migrate;
#[cfg(test)]
pub(crate) mod testing;

use std::time::Duration;

use deadpool_postgres::{Config, PoolConfig, Runtime, Timeouts};
use tokio_postgres::{Client, NoTls};

pub use migrate::{migrate, MigrateError, Migration, SCHEMA_VERSION};

/// A pool of connections could not be made (a URL it cannot use).
pub type PoolError = deadpool_postgres::CreatePoolError;

/// `url` without its password, for logs and errors.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(a PostgreSQL connection string)".into();
    };
    match rest.rsplit_once('@') {
        Some((auth, host)) => {
            let user = auth.split(':').next().unwrap_or("");
            format!("{scheme}://{user}@{host}")
        }
        None => url.to_string(),
    }
}

/// A pool of up to `size` connections to `url`; none is opened before it is first asked
/// for one. A database that does not answer fails the caller after 10 s, rather than
/// holding it.
pub fn pool(url: &str, size: usize) -> Result<deadpool_postgres::Pool, PoolError> {
    let mut cfg = Config::new();
    cfg.url = Some(url.to_string());
    let mut pc = PoolConfig::new(size);
    pc.timeouts = Timeouts {
        wait: Some(Duration::from_secs(10)),
        create: Some(Duration::from_secs(10)),
        recycle: Some(Duration::from_secs(10)),
    };
    cfg.pool = Some(pc);
    cfg.create_pool(Some(Runtime::Tokio1), NoTls)
}

/// One connection to `url` (on the caller's runtime), its connection task spawned; `owner`
/// names who logs its end.
pub async fn connect(url: &str, owner: &'static str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "{owner}: the PostgreSQL connection ended");
        }
    });
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_logs() {
        let cases = [
            (
                "postgres://kb:secret@db:5432/kb",
                "postgres://kb@db:5432/kb",
            ),
            ("postgresql://kb@db/kb", "postgresql://kb@db/kb"),
            ("postgres://db/kb", "postgres://db/kb"),
            ("host=db password=x", "(a PostgreSQL connection string)"),
            ("postgres://a:b@c@h/d", "postgres://a@h/d"),
        ];
        for (url, want) in cases {
            assert_eq!(redact(url), want, "{url}");
        }
    }
}
