//! The schema's versions. `schema_migrations` holds one row per version applied; the
//! versions are one sequence shared by every owner of tables (the recording has 1, 4 and 5,
//! cluster mode 2, 3 and 6), each migration is its owner's. An owner applies what is missing of its own
//! at start, all of it in one transaction under an advisory lock (brokers of a cluster start
//! together; the first migrates, the others wait and find nothing to do), and a database
//! whose version is newer than this broker knows ([`SCHEMA_VERSION`]) is refused rather
//! than written wrongly.

use tokio_postgres::Client;

/// Held while migrating.
const MIGRATION_LOCK: i64 = 0x6b62_6d69_6772; // "kbmigr"

/// The highest version of any owner's migrations: the newest schema this broker knows.
/// Every version up to it belongs to exactly one owner (checked by the crate's tests).
pub const SCHEMA_VERSION: i64 = 7;

/// One step of an owner's tables: it brings the database to `version`.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i64,
    pub sql: &'static str,
}

/// A migration that failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("migrating the schema of {location}: {source}")]
    Query {
        /// The URL without its password.
        location: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("the database {location} has schema version {found}; this broker knows up to {known}")]
    TooNew {
        location: String,
        found: i64,
        known: i64,
    },
}

/// Applies those of `migrations` (of `owner`, for the logs) that the database at `location`
/// (its URL without the password) does not have yet, in the order of their versions.
pub async fn migrate(
    client: &Client,
    location: &str,
    owner: &str,
    migrations: &[Migration],
) -> Result<(), MigrateError> {
    let err = |source| MigrateError::Query {
        location: location.to_string(),
        source,
    };
    client
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({MIGRATION_LOCK});
             CREATE TABLE IF NOT EXISTS schema_migrations (
                 version BIGINT PRIMARY KEY,
                 applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
             );"
        ))
        .await
        .map_err(err)?;
    let r = async {
        let applied: Vec<i64> = client
            .query("SELECT version FROM schema_migrations", &[])
            .await
            .map_err(err)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let found = applied.iter().copied().max().unwrap_or(0);
        if found > SCHEMA_VERSION {
            return Err(MigrateError::TooNew {
                location: location.to_string(),
                found,
                known: SCHEMA_VERSION,
            });
        }
        let mut missing: Vec<&Migration> = migrations
            .iter()
            .filter(|m| !applied.contains(&m.version))
            .collect();
        missing.sort_by_key(|m| m.version);
        for step in missing {
            client.batch_execute(step.sql).await.map_err(err)?;
            client
                .execute(
                    "INSERT INTO schema_migrations (version) VALUES ($1)",
                    &[&step.version],
                )
                .await
                .map_err(err)?;
            tracing::info!(db = %location, version = step.version, "{owner}: PostgreSQL schema migrated");
        }
        Ok(())
    }
    .await;
    match r {
        Ok(()) => client.batch_execute("COMMIT").await.map_err(err),
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two owners' tables, as each owner brings them.
    const FIRST: &[Migration] = &[Migration {
        version: 1,
        sql: "CREATE TABLE first_owner (id INT);",
    }];
    const SECOND: &[Migration] = &[
        Migration {
            version: 3,
            sql: "ALTER TABLE second_owner ADD COLUMN b INT;",
        },
        Migration {
            version: 2,
            sql: "CREATE TABLE second_owner (a INT);",
        },
    ];

    async fn versions(client: &Client) -> Vec<i64> {
        client
            .query(
                "SELECT version FROM schema_migrations ORDER BY version",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    #[tokio::test]
    async fn each_owner_applies_its_own_versions_once_and_a_newer_database_is_refused() {
        let url = super::super::testing::fresh_database().await;
        let client = super::super::connect(&url, "test").await.unwrap();
        // An owner may come first with a later version (the cluster joining a database the
        // recording has not opened yet); its steps run in their versions' order.
        migrate(&client, "db", "second", SECOND).await.unwrap();
        assert_eq!(versions(&client).await, [2, 3]);
        migrate(&client, "db", "first", FIRST).await.unwrap();
        migrate(&client, "db", "second", SECOND).await.unwrap();
        assert_eq!(versions(&client).await, [1, 2, 3]);
        client
            .execute("INSERT INTO first_owner (id) VALUES (1)", &[])
            .await
            .unwrap();
        client
            .execute("INSERT INTO second_owner (a, b) VALUES (1, 2)", &[])
            .await
            .unwrap();

        client
            .execute(
                "INSERT INTO schema_migrations (version) VALUES ($1)",
                &[&(SCHEMA_VERSION + 1)],
            )
            .await
            .unwrap();
        let err = migrate(&client, "db", "first", FIRST).await.unwrap_err();
        assert!(
            matches!(err, MigrateError::TooNew { found, known, .. }
                if found == SCHEMA_VERSION + 1 && known == SCHEMA_VERSION),
            "{err}"
        );
    }
}
