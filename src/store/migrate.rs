//! Schema migrations: the plain SQL files of `migrations/`, compiled in and
//! applied in order inside one transaction under an advisory lock, so any
//! number of replicas may start at once.
//!
//! A small runner rather than a migrations crate: we need the advisory lock,
//! a checksum check of applied files and a cheap "is the schema current"
//! probe for `/readyz`, which together are about as much code as the glue
//! around a crate would be.
//!
//! # Compatibility across releases
//!
//! Migrations are expand-then-contract (docs/operations.md, "Upgrades and
//! compatibility"): a new release's migrations run while the previous
//! release still serves, so they only add what the previous release
//! ignores. A contract step (dropping what an earlier expand replaced)
//! records in [`Migration::requires`] the oldest migration a binary must
//! know to run against it; the version table keeps that number, so a
//! binary that meets a schema migrated by a *later* release can tell
//! whether it still fits ([`Status`], `idemproxy migrate --status`).
//!
//! # Citus
//!
//! On a Citus coordinator (the `citus` extension installed in the
//! database) every run also makes sure the records table is distributed
//! by `idempotency_key` (`distribute`), in the same transaction under the
//! same lock: a fresh table when the first migration just created it, an
//! existing one (data included: `create_distributed_table` copies it to the
//! shards) when the extension arrived later. Not a numbered migration: the
//! schema is the same everywhere, only its placement differs, and a
//! database may gain the extension after every migration ran.
use sha2::{Digest, Sha256};
use tokio_postgres::Client;

use tokio_postgres::types::Type;

use super::conn::{Conn, Sql};
use super::StoreError;

/// One migration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Applied in ascending order; recorded in the version table.
    pub version: i32,
    /// File name, for messages.
    pub name: &'static str,
    /// The SQL.
    pub sql: &'static str,
    /// The oldest migration a binary must know to run against a schema
    /// holding this one: 0 for an expand step (every earlier release keeps
    /// working), the version of the matching expand step for a contract
    /// step (releases that predate it stop working).
    pub requires: i32,
}

/// Every migration, in order.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_idempotency_records.sql",
    sql: include_str!("../../migrations/0001_idempotency_records.sql"),
    requires: 0,
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

/// Added after 0.1.0 (an expand step of the runner's own table: 0.1.0
/// reads and inserts the other columns only, and the default covers its
/// rows).
const REQUIRES_COLUMN: &str = "ALTER TABLE idemproxy_schema_migrations
    ADD COLUMN IF NOT EXISTS requires integer NOT NULL DEFAULT 0";

/// Applies every pending migration; returns the versions applied.
pub async fn run(client: &mut Client) -> Result<Vec<i32>, StoreError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await?;
    tx.batch_execute(VERSION_TABLE).await?;
    tx.batch_execute(REQUIRES_COLUMN).await?;
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
            "INSERT INTO idemproxy_schema_migrations (version, name, checksum, requires)
             VALUES ($1, $2, $3, $4)",
            &[&m.version, &m.name, &checksum, &m.requires],
        )
        .await?;
        done.push(m.version);
    }
    if distribute(&tx).await? {
        tracing::info!(
            table = RECORDS_TABLE,
            column = DISTRIBUTION_COLUMN,
            "Citus: distributed the records table over the workers"
        );
    }
    tx.commit().await?;
    Ok(done)
}

/// The table `distribute` distributes.
pub const RECORDS_TABLE: &str = "idempotency_records";

/// Its distribution column on Citus. The primary key is `(tenant_id,
/// idempotency_key)` and Citus wants the distribution column in every
/// unique index, so either column qualifies; the key spreads every
/// tenant's keys (a deployment without tenants has only `""`) over all
/// shards, where `tenant_id` would put a tenant on one shard. Every
/// statement of the request path filters by both columns, so each is
/// routed to one shard either way (docs/scale-out.md).
pub const DISTRIBUTION_COLUMN: &str = "idempotency_key";

/// On a Citus coordinator, distributes the records table by
/// [`DISTRIBUTION_COLUMN`] unless it already is; `true` when it did.
/// Nothing on plain PostgreSQL. Runs inside the migration transaction,
/// under its advisory lock, so replicas starting at once distribute once.
async fn distribute(tx: &tokio_postgres::Transaction<'_>) -> Result<bool, StoreError> {
    let citus: bool = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')",
            &[],
        )
        .await?
        .get(0);
    if !citus {
        return Ok(false);
    }
    let distributed: bool = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_dist_partition
              WHERE logicalrelid = to_regclass($1))",
            &[&RECORDS_TABLE],
        )
        .await?
        .get(0);
    if distributed {
        return Ok(false);
    }
    tx.execute(
        "SELECT create_distributed_table($1::text::regclass, $2)",
        &[&RECORDS_TABLE, &DISTRIBUTION_COLUMN],
    )
    .await
    .map_err(|e| {
        StoreError::Migration(format!(
            "distributing {RECORDS_TABLE} by {DISTRIBUTION_COLUMN} on Citus: {}",
            super::describe_db_error(&e)
        ))
    })?;
    Ok(true)
}

/// A row of the version table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Migration version.
    pub version: i32,
    /// File name as recorded.
    pub name: String,
    /// SHA-256 of the file as applied.
    pub checksum: Vec<u8>,
    /// When it was applied (the database's clock).
    pub applied_at: std::time::SystemTime,
    /// See [`Migration::requires`]; 0 for rows written before the column
    /// existed.
    pub requires: i32,
}

/// One line of `migrate --status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Known to this binary and applied with the same contents.
    Applied(Applied),
    /// Known to this binary, not applied yet.
    Pending(Migration),
    /// Known to this binary but applied with different contents: the file
    /// was edited after it shipped. `migrate` refuses to continue.
    Modified(Applied),
    /// Applied by a later release; this binary does not know it. Harmless
    /// unless it `requires` a migration newer than this binary knows.
    Newer(Applied),
}

/// Whether this binary can run against the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every migration this binary knows is applied, and nothing applied
    /// by a later release requires more than it knows.
    Current,
    /// Migrations this binary knows are missing: `idemproxy migrate`
    /// applies them (an older release keeps working meanwhile).
    Pending,
    /// This binary must not serve this schema: a migration was applied with
    /// different contents, or a later release's contract step requires a
    /// migration this binary does not know.
    Incompatible,
}

/// The schema as this binary sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Every migration known or applied, in version order.
    pub entries: Vec<Entry>,
    /// The conclusion.
    pub verdict: Verdict,
}

/// Compares the version table with the migrations this binary knows. Pure:
/// `migrate --status` and `--dry-run` print it, its tests pin it.
pub fn assess(applied: &[Applied], known: &[Migration]) -> Status {
    let latest = known.last().map_or(0, |m| m.version);
    let mut entries = Vec::new();
    let mut verdict = Verdict::Current;
    for m in known {
        let checksum = Sha256::digest(m.sql.as_bytes()).to_vec();
        match applied.iter().find(|a| a.version == m.version) {
            Some(a) if a.checksum == checksum => entries.push(Entry::Applied(a.clone())),
            Some(a) => {
                verdict = Verdict::Incompatible;
                entries.push(Entry::Modified(a.clone()));
            }
            None => {
                if verdict == Verdict::Current {
                    verdict = Verdict::Pending;
                }
                entries.push(Entry::Pending(*m));
            }
        }
    }
    for a in applied {
        if known.iter().all(|m| m.version != a.version) {
            if a.requires > latest {
                verdict = Verdict::Incompatible;
            }
            entries.push(Entry::Newer(a.clone()));
        }
    }
    entries.sort_by_key(|e| match e {
        Entry::Applied(a) | Entry::Modified(a) | Entry::Newer(a) => a.version,
        Entry::Pending(m) => m.version,
    });
    Status { entries, verdict }
}

/// Reads the version table (read-only: nothing is created or locked) and
/// assesses it against [`MIGRATIONS`].
pub async fn status(client: &Client) -> Result<Status, StoreError> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('idemproxy_schema_migrations') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    let mut applied = Vec::new();
    if exists {
        // The `requires` column arrived after 0.1.0: a table only 0.1.0
        // has written lacks it.
        let has_requires: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute
                  WHERE attrelid = 'idemproxy_schema_migrations'::regclass
                    AND attname = 'requires' AND NOT attisdropped)",
                &[],
            )
            .await?
            .get(0);
        let requires = if has_requires { "requires" } else { "0" };
        let rows = client
            .query(
                &format!(
                    "SELECT version, name, checksum, applied_at, {requires}
                       FROM idemproxy_schema_migrations ORDER BY version"
                ),
                &[],
            )
            .await?;
        for r in rows {
            applied.push(Applied {
                version: r.get(0),
                name: r.get(1),
                checksum: r.get(2),
                applied_at: r.get(3),
                requires: r.get(4),
            });
        }
    }
    Ok(assess(&applied, MIGRATIONS))
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

    const EXPAND: &str = "ALTER TABLE t ADD COLUMN b int";
    const CONTRACT: &str = "ALTER TABLE t DROP COLUMN a";

    fn known() -> Vec<Migration> {
        vec![
            Migration {
                version: 1,
                name: "0001_a.sql",
                sql: "CREATE TABLE t (a int)",
                requires: 0,
            },
            Migration {
                version: 2,
                name: "0002_b.sql",
                sql: EXPAND,
                requires: 0,
            },
        ]
    }

    fn applied(m: &Migration) -> Applied {
        Applied {
            version: m.version,
            name: m.name.into(),
            checksum: Sha256::digest(m.sql.as_bytes()).to_vec(),
            applied_at: std::time::SystemTime::UNIX_EPOCH,
            requires: m.requires,
        }
    }

    fn later(version: i32, sql: &str, requires: i32) -> Applied {
        Applied {
            version,
            name: format!("{version:04}_later.sql"),
            checksum: Sha256::digest(sql.as_bytes()).to_vec(),
            applied_at: std::time::SystemTime::UNIX_EPOCH,
            requires,
        }
    }

    #[test]
    fn a_database_without_migrations_has_every_one_pending() {
        let s = assess(&[], &known());
        assert_eq!(s.verdict, Verdict::Pending);
        assert!(matches!(
            s.entries[..],
            [Entry::Pending(_), Entry::Pending(_)]
        ));
    }

    #[test]
    fn every_known_migration_applied_is_current() {
        let k = known();
        let s = assess(&[applied(&k[0]), applied(&k[1])], &k);
        assert_eq!(s.verdict, Verdict::Current);
    }

    #[test]
    fn a_file_edited_after_it_was_applied_is_incompatible() {
        let k = known();
        let mut edited = applied(&k[1]);
        edited.checksum = vec![0; 32];
        let s = assess(&[applied(&k[0]), edited], &k);
        assert_eq!(s.verdict, Verdict::Incompatible);
        assert!(matches!(s.entries[1], Entry::Modified(_)));
    }

    #[test]
    fn a_later_releases_expand_step_leaves_this_binary_current() {
        let k = known();
        let s = assess(&[applied(&k[0]), applied(&k[1]), later(3, EXPAND, 0)], &k);
        assert_eq!(s.verdict, Verdict::Current);
        assert!(matches!(s.entries[2], Entry::Newer(_)));
    }

    #[test]
    fn a_contract_step_this_binary_predates_is_incompatible() {
        let k = known();
        // Requires migration 2: this binary knows it, so it still fits.
        let fits = assess(&[applied(&k[0]), applied(&k[1]), later(3, CONTRACT, 2)], &k);
        assert_eq!(fits.verdict, Verdict::Current);
        // Requires migration 3, an expand step this binary never saw.
        let breaks = assess(
            &[
                applied(&k[0]),
                applied(&k[1]),
                later(3, EXPAND, 0),
                later(4, CONTRACT, 3),
            ],
            &k,
        );
        assert_eq!(breaks.verdict, Verdict::Incompatible);
    }

    #[test]
    fn a_missing_migration_under_a_later_one_is_still_pending() {
        let k = known();
        let s = assess(&[applied(&k[1])], &k);
        assert_eq!(s.verdict, Verdict::Pending);
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
