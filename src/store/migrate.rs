//! Schema migrations: the plain SQL files of `migrations/`, compiled in and
//! applied in order inside one transaction under an advisory lock, so any
//! number of replicas may start at once.
//!
//! A small runner rather than a migrations crate: we need the advisory lock,
//! a checksum check of applied files and a cheap "is the schema current"
//! probe for `/readyz`, which together are about as much code as the glue
//! around a crate would be.

use sha2::{Digest, Sha256};
use tokio_postgres::Client;

use tokio_postgres::types::Type;

use super::conn::{Conn, Sql};
use super::StoreError;

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Applied in ascending order; recorded in the version table.
    pub version: i32,
    /// File name, for messages.
    pub name: &'static str,
    /// The SQL.
    pub sql: &'static str,
}

/// Every migration, in order.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_idempotency_records.sql",
    sql: include_str!("../../migrations/0001_idempotency_records.sql"),
}];

/// The latest schema version this binary knows.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.version)
}

/// Key of the advisory lock that serialises migrations across replicas.
const LOCK_KEY: i64 = 0x1de3_9a0c_5e11_0001;

const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS idemproxy_schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   bytea       NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)";

/// Applies every pending migration; returns the versions applied.
pub async fn run(client: &mut Client) -> Result<Vec<i32>, StoreError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await?;
    tx.batch_execute(VERSION_TABLE).await?;
    let rows = tx
        .query(
            "SELECT version, checksum FROM idemproxy_schema_migrations",
            &[],
        )
        .await?;
    let applied: Vec<(i32, Vec<u8>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut done = Vec::new();
    for m in MIGRATIONS {
        let checksum = Sha256::digest(m.sql.as_bytes()).to_vec();
        match applied.iter().find(|(v, _)| *v == m.version) {
            Some((_, c)) if *c == checksum => continue,
            Some(_) => {
                return Err(StoreError::Migration(format!(
                    "migration {} was applied with different contents; refusing to continue",
                    m.name
                )))
            }
            None => {}
        }
        tx.batch_execute(m.sql).await.map_err(|e| {
            StoreError::Migration(format!(
                "applying {}: {}",
                m.name,
                super::describe_db_error(&e)
            ))
        })?;
        tx.execute(
            "INSERT INTO idemproxy_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&m.version, &m.name, &checksum],
        )
        .await?;
        done.push(m.version);
    }
    tx.commit().await?;
    Ok(done)
}

/// Whether every migration this binary knows has been applied.
pub(super) async fn is_current(conn: &Conn) -> Result<bool, StoreError> {
    const TABLE: Sql = Sql {
        text: "SELECT to_regclass('idemproxy_schema_migrations') IS NOT NULL",
        types: &[],
    };
    const APPLIED: Sql = Sql {
        text: "SELECT count(*) FROM idemproxy_schema_migrations WHERE version <= $1",
        types: &[Type::INT4],
    };
    if !conn.query_one(&TABLE, &[]).await?.get::<_, bool>(0) {
        return Ok(false);
    }
    let row = conn.query_one(&APPLIED, &[&latest_version()]).await?;
    Ok(row.get::<_, i64>(0) == MIGRATIONS.len() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_in_strictly_ascending_order_and_named_by_version() {
        for pair in MIGRATIONS.windows(2) {
            assert!(pair[0].version < pair[1].version);
        }
        for m in MIGRATIONS {
            assert!(
                m.name.starts_with(&format!("{:04}_", m.version)),
                "{}",
                m.name
            );
        }
    }

    #[test]
    fn every_file_in_migrations_dir_is_compiled_in() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        let names: Vec<&str> = MIGRATIONS.iter().map(|m| m.name).collect();
        assert_eq!(files, names);
    }
}
