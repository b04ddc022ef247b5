//! A real PgBouncer in front of a PostgreSQL server, for the tests of
//! poolers (DESIGN §8.3): transaction mode and a small server pool, as
//! operators run it in front of many sidecars.
//!
//! The binary is `IDEMPROXY_PGBOUNCER`, else `pgbouncer` on `PATH`, else
//! `/usr/sbin/pgbouncer` (Debian's package; `scripts/dev test` installs it).
//! Without it a test fails, saying what to install: it never skips.
//!
//! PgBouncer refuses to run as root, so as root it is started through
//! `setpriv` as the unprivileged user the private clusters use
//! ([`super::pgcluster`]); `setpriv` execs (unlike `runuser`, which forks),
//! so the child this fixture kills is PgBouncer itself. It listens on a
//! free 127.0.0.1 port, no unix socket, logs to its `Proc` log file, and is
//! killed when dropped.
//!
//! Authentication is `trust` with an `auth_file` naming the target URL's
//! user (PgBouncer 1.18 wants the user listed even for `trust`); every
//! database name is forwarded to the same server (`* = host=… port=…`),
//! so a test's fresh database needs no configuration here. The admin
//! console (database `pgbouncer`) is open to that user: [`PgBouncer::servers`]
//! reads `SHOW SERVERS`, whose `remote_pid` is the backend's pid on the
//! real server, to tell the pooler's connections from direct ones.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use super::process::{free_port, Proc, TempDir};

/// How the pooler is set up.
#[derive(Debug, Clone)]
pub struct PgBouncerOptions {
    /// `pool_mode`: `transaction` (the point of these tests), `session`, …
    pub mode: String,
    /// `default_pool_size` and `max_db_connections`: server connections
    /// per database.
    pub pool_size: u32,
    /// `max_client_conn`.
    pub max_client_conn: u32,
    /// `min_pool_size`: server connections the pooler keeps open per pool
    /// once a client has used it (0: opened on demand).
    pub min_pool_size: u32,
}

impl Default for PgBouncerOptions {
    fn default() -> Self {
        PgBouncerOptions {
            mode: "transaction".into(),
            pool_size: 6,
            max_client_conn: 500,
            min_pool_size: 0,
        }
    }
}

/// A server connection of the pool, from `SHOW SERVERS`.
#[derive(Debug, Clone)]
pub struct ServerConn {
    pub database: String,
    /// `active`, `idle`, `used`, `tested`, `new`.
    pub state: String,
    /// The backend's pid on the real server.
    pub remote_pid: i32,
}

/// One pool, from `SHOW POOLS`.
#[derive(Debug, Clone, Default)]
pub struct PoolStats {
    pub database: String,
    pub cl_active: i64,
    pub cl_waiting: i64,
    pub sv_active: i64,
    pub sv_idle: i64,
    pub sv_used: i64,
    /// Longest wait of a waiting client, in seconds (`maxwait`).
    pub maxwait: i64,
}

pub struct PgBouncer {
    pub port: u16,
    pub options: PgBouncerOptions,
    pub proc: Proc,
    user: String,
    _dir: TempDir,
}

/// The binary, or a panic naming what to install.
pub fn binary(test: &str) -> PathBuf {
    if let Ok(p) = std::env::var("IDEMPROXY_PGBOUNCER") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "{test}: IDEMPROXY_PGBOUNCER={} is not a file",
            p.display()
        );
        return p;
    }
    let on_path = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join("pgbouncer"))
                .find(|p| p.is_file())
        })
        .unwrap_or_default();
    on_path
        .or_else(|| {
            let p = PathBuf::from("/usr/sbin/pgbouncer");
            p.is_file().then_some(p)
        })
        .unwrap_or_else(|| {
            panic!(
                "{test} needs PgBouncer (1.18 or newer), found neither in IDEMPROXY_PGBOUNCER, \
                 on PATH nor at /usr/sbin/pgbouncer: install it (Debian/Ubuntu: apt-get \
                 install pgbouncer; `scripts/dev test` does so when run as root) or set \
                 IDEMPROXY_PGBOUNCER to the binary"
            )
        })
}

impl PgBouncer {
    /// Starts a pooler in front of the server of `target_url` (any database
    /// of it) and waits until its admin console answers.
    pub async fn start(test: &str, target_url: &str, options: PgBouncerOptions) -> PgBouncer {
        let bin = binary(test);
        let target = tokio_postgres::Config::from_str(target_url)
            .unwrap_or_else(|e| panic!("target URL: {e}"));
        let host = match target.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            other => panic!("the pooler needs a TCP target, not {other:?}"),
        };
        let target_port = target.get_ports().first().copied().unwrap_or(5432);
        let user = target.get_user().unwrap_or("postgres").to_owned();

        let run_as = super::pgcluster::server_user();
        let dir = readable_dir(run_as.as_deref());
        let port = free_port();
        let auth_file = dir.join("userlist.txt");
        super::process::write(&auth_file, &format!("\"{user}\" \"\"\n"));
        let ini = dir.join("pgbouncer.ini");
        super::process::write(
            &ini,
            &format!(
                "; Written by the idemproxy pooler tests.\n\
                 [databases]\n\
                 * = host={host} port={target_port}\n\
                 \n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {auth}\n\
                 admin_users = {user}\n\
                 stats_users = {user}\n\
                 pool_mode = {mode}\n\
                 default_pool_size = {pool}\n\
                 max_db_connections = {pool}\n\
                 min_pool_size = {min_pool}\n\
                 reserve_pool_size = 0\n\
                 max_client_conn = {max_client}\n\
                 ignore_startup_parameters = extra_float_digits,options\n\
                 server_connect_timeout = 5\n\
                 server_login_retry = 1\n\
                 log_connections = 0\n\
                 log_disconnections = 0\n\
                 log_pooler_errors = 1\n\
                 stats_period = 60\n",
                auth = auth_file.display(),
                mode = options.mode,
                pool = options.pool_size,
                max_client = options.max_client_conn,
                min_pool = options.min_pool_size,
            ),
        );
        let (program, args) = match &run_as {
            Some(u) => (
                "setpriv".to_string(),
                vec![
                    format!("--reuid={u}"),
                    format!("--regid={u}"),
                    "--init-groups".into(),
                    "--".into(),
                    bin.display().to_string(),
                    ini.display().to_string(),
                ],
            ),
            None => (bin.display().to_string(), vec![ini.display().to_string()]),
        };
        let mut proc = Proc::new("pgbouncer", &program, args, dir.join("pgbouncer.log"));
        proc.spawn(false);
        let b = PgBouncer {
            port,
            options,
            proc,
            user,
            _dir: dir,
        };
        b.wait_accepting(Duration::from_secs(20)).await;
        b
    }

    /// A client URL for database `db` through the pooler.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{}@127.0.0.1:{}/{db}", self.user, self.port)
    }

    async fn wait_accepting(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if tokio_postgres::connect(&self.url("pgbouncer"), NoTls)
                .await
                .is_ok()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "PgBouncer did not accept connections within {timeout:?}\n{}",
                self.proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// A connection to the admin console (simple queries only).
    pub async fn admin(&self) -> Client {
        let (client, conn) = tokio_postgres::connect(&self.url("pgbouncer"), NoTls)
            .await
            .unwrap_or_else(|e| panic!("PgBouncer admin console: {e}"));
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    /// `SHOW SERVERS`: the pooler's server connections, all databases.
    pub async fn servers(&self) -> Vec<ServerConn> {
        rows(&self.admin().await, "SHOW SERVERS")
            .await
            .into_iter()
            .map(|r| ServerConn {
                database: r.get("database").unwrap_or_default().to_owned(),
                state: r.get("state").unwrap_or_default().to_owned(),
                remote_pid: r
                    .get("remote_pid")
                    .and_then(|p| p.parse().ok())
                    .unwrap_or_default(),
            })
            .collect()
    }

    /// `SHOW POOLS` for one database.
    pub async fn pool(&self, db: &str) -> PoolStats {
        let num = |r: &tokio_postgres::SimpleQueryRow, c: &str| -> i64 {
            r.get(c).and_then(|v| v.parse().ok()).unwrap_or_default()
        };
        rows(&self.admin().await, "SHOW POOLS")
            .await
            .iter()
            .filter(|r| r.get("database") == Some(db))
            .map(|r| PoolStats {
                database: db.into(),
                cl_active: num(r, "cl_active"),
                cl_waiting: num(r, "cl_waiting"),
                sv_active: num(r, "sv_active"),
                sv_idle: num(r, "sv_idle"),
                sv_used: num(r, "sv_used"),
                maxwait: num(r, "maxwait"),
            })
            .fold(PoolStats::default(), |a, b| PoolStats {
                database: b.database,
                cl_active: a.cl_active + b.cl_active,
                cl_waiting: a.cl_waiting + b.cl_waiting,
                sv_active: a.sv_active + b.sv_active,
                sv_idle: a.sv_idle + b.sv_idle,
                sv_used: a.sv_used + b.sv_used,
                maxwait: a.maxwait.max(b.maxwait),
            })
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

async fn rows(client: &Client, sql: &str) -> Vec<tokio_postgres::SimpleQueryRow> {
    client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("PgBouncer {sql}: {e}"))
        .into_iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(r),
            _ => None,
        })
        .collect()
}

/// A temporary directory whose files `user` can read (a private TMPDIR may
/// be closed to it; /tmp is not).
fn readable_dir(user: Option<&str>) -> TempDir {
    let dir = TempDir::new("pgbouncer");
    let Some(user) = user else {
        return dir;
    };
    if can_read(user, &dir.path) {
        return dir;
    }
    let fallback = PathBuf::from("/tmp").join(dir.path.file_name().unwrap());
    std::fs::create_dir_all(&fallback).unwrap();
    TempDir {
        path: fallback,
        keep_on_failure: true,
    }
}

fn can_read(user: &str, dir: &Path) -> bool {
    Command::new("setpriv")
        .args([
            &format!("--reuid={user}"),
            &format!("--regid={user}"),
            "--init-groups",
            "--",
            "test",
            "-x",
        ])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
}

/// Backends of `db` on the real server, as `(pid, application_name, query)`,
/// the caller's own connection excluded.
pub async fn backends(server: &Client, db: &str) -> Vec<(i32, String, String)> {
    server
        .query(
            "SELECT pid, coalesce(application_name, ''), coalesce(query, '')
               FROM pg_stat_activity
              WHERE datname = $1 AND backend_type = 'client backend'
                AND pid <> pg_backend_pid()",
            &[&db],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}
