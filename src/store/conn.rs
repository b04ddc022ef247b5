//! Connections to the store, and the two rules every statement follows.
//!
//! * **Every statement is bounded, and a connection whose statement was cut
//!   off is never reused.** A primary that hangs (frozen, black-holed)
//!   answers nothing: a statement on it would wait forever, and a connection
//!   returned to the pool mid-statement would hand its late answer to the
//!   next caller. [`Conn`] counts the statements it has in flight; if it is
//!   dropped with one still running (its caller's `store.timeout` fired, or
//!   the caller went away), the connection is detached from the pool and
//!   closed instead of being recycled.
//! * **Prepared statements are optional.** By default each statement is
//!   prepared once per connection and cached. Behind a pooler in transaction
//!   mode (PgBouncer before 1.21) a named statement does not survive its
//!   transaction, so with `store.prepared_statements = false` every statement
//!   goes as an unnamed one with its parameter types given
//!   (`query_typed`): Parse, Bind and Execute in one round trip, as before.
//!
//! Connecting is bounded per host. tokio-postgres bounds only the TCP connect
//! of each host of a multi-host URL; a frozen server accepts TCP (the kernel
//! does) and then never answers the startup, so the first host would hold
//! every new connection and the promoted standby behind it would never be
//! tried. [`Connector`] tries the hosts one by one, each with its share of
//! `store.timeout` for the whole startup (TLS, authentication and the
//! `target_session_attrs` check included), starting with the host that
//! answered last. TCP keepalives and a TCP user timeout are set on every
//! connection, so a black-holed network is noticed on idle connections (the
//! LISTEN connection above all) and on writes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool::managed::{self, Metrics, Object, RecycleError, RecycleResult};
use deadpool_postgres::ClientWrapper;
use tokio_postgres::config::Host;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Config, Row, Statement};
use tracing::{debug, warn};

use super::{describe_db_error, tls, StoreError};

/// One SQL statement and the types of its parameters (which an unnamed
/// statement must carry, since nothing was prepared to infer them).
#[derive(Debug)]
pub(crate) struct Sql {
    /// The statement.
    pub text: &'static str,
    /// One type per `$n`, in order.
    pub types: &'static [Type],
}

/// A parameter list, one value per `$n`.
pub(crate) type Params<'a> = [&'a (dyn ToSql + Sync)];

/// Opens connections, one host at a time, each bounded.
pub(crate) struct Connector {
    /// One configuration per host of the URL, everything else equal.
    hosts: Vec<Config>,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    per_host: Duration,
    /// The host that answered last: tried first.
    preferred: AtomicUsize,
    /// When a new connection last went to another host than the one
    /// before it (a failover): pooled connections opened earlier lead to
    /// the old host and are not reused ([`Manager`]'s recycle).
    switched: Mutex<Option<Instant>>,
}

impl Connector {
    /// A connector for `config` (any number of hosts) that gives the whole
    /// attempt `timeout`, shared equally among the hosts.
    pub(crate) fn new(
        config: &Config,
        tls: tokio_postgres_rustls::MakeRustlsConnect,
        timeout: Duration,
    ) -> Self {
        let hosts = single_host_configs(config, timeout);
        let n = u32::try_from(hosts.len().max(1)).unwrap_or(u32::MAX);
        Connector {
            per_host: (timeout / n).max(Duration::from_millis(100)),
            hosts,
            tls,
            preferred: AtomicUsize::new(0),
            switched: Mutex::new(None),
        }
    }

    /// Connects to the first host that answers within its share of the
    /// timeout and satisfies `target_session_attrs`. The caller drives the
    /// returned connection.
    pub(crate) async fn connect(
        &self,
    ) -> Result<
        (
            Client,
            tokio_postgres::Connection<tokio_postgres::Socket, tls::TlsStream>,
        ),
        StoreError,
    > {
        let first = self.preferred.load(Ordering::Relaxed);
        let n = self.hosts.len();
        let mut failures = Vec::new();
        for i in (0..n).map(|k| (first + k) % n) {
            let host = &self.hosts[i];
            // Boxed: the driver's connect future (TLS included) is large,
            // and would otherwise be part of every future that may open a
            // connection (any pool checkout).
            let attempt = Box::pin(host.connect(self.tls.clone()));
            match tokio::time::timeout(self.per_host, attempt).await {
                Ok(Ok(pair)) => {
                    if self.preferred.swap(i, Ordering::Relaxed) != i {
                        *self.switched.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(Instant::now());
                        warn!(
                            host = %describe_host(host),
                            "store: connected to another host than before (failover); \
                             pooled connections to the previous one are closed as they \
                             are checked out"
                        );
                    }
                    return Ok(pair);
                }
                Ok(Err(e)) => failures.push(format!(
                    "{}: {}",
                    describe_host(host),
                    describe_db_error(&e)
                )),
                Err(_) => failures.push(format!(
                    "{}: no answer within {:?}",
                    describe_host(host),
                    self.per_host
                )),
            }
        }
        Err(StoreError::Pool(format!(
            "cannot connect: {}",
            failures.join("; ")
        )))
    }

    /// Whether a connection opened at `created` predates the last switch
    /// to another host.
    pub(crate) fn opened_before_failover(&self, created: Instant) -> bool {
        self.switched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|at| created < at)
    }
}

/// `host:port` of a single-host configuration (never the password).
fn describe_host(config: &Config) -> String {
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "?".into(),
    };
    match config.get_ports().first() {
        Some(port) => format!("{host}:{port}"),
        None => host,
    }
}

/// Splits a (possibly multi-host) configuration into one per host, and sets
/// the TCP keepalives and user timeout on each.
fn single_host_configs(config: &Config, timeout: Duration) -> Vec<Config> {
    let hosts = config.get_hosts();
    let ports = config.get_ports();
    let addrs = config.get_hostaddrs();
    let count = hosts.len().max(addrs.len()).max(1);
    (0..count)
        .map(|i| {
            let mut c = Config::new();
            if let Some(user) = config.get_user() {
                c.user(user);
            }
            if let Some(password) = config.get_password() {
                c.password(password);
            }
            if let Some(dbname) = config.get_dbname() {
                c.dbname(dbname);
            }
            if let Some(options) = config.get_options() {
                c.options(options);
            }
            if let Some(name) = config.get_application_name() {
                c.application_name(name);
            }
            c.ssl_mode(config.get_ssl_mode());
            c.ssl_negotiation(config.get_ssl_negotiation());
            c.channel_binding(config.get_channel_binding());
            c.target_session_attrs(config.get_target_session_attrs());
            match hosts.get(i) {
                Some(Host::Tcp(h)) => {
                    c.host(h);
                }
                #[cfg(unix)]
                Some(Host::Unix(p)) => {
                    c.host_path(p);
                }
                None => {}
            }
            if let Some(addr) = addrs.get(i) {
                c.hostaddr(*addr);
            }
            // One port for all hosts, or one per host (libpq's rule).
            if let Some(port) = ports.get(i).or_else(|| ports.first()) {
                c.port(*port);
            }
            c.connect_timeout(timeout);
            // A black-holed peer: idle connections learn of it from
            // keepalives (about 10 + 3 × 2 s), busy ones from the user
            // timeout on unacknowledged data.
            c.keepalives(true);
            c.keepalives_idle(Duration::from_secs(10));
            c.keepalives_interval(Duration::from_secs(2));
            c.keepalives_retries(3);
            c.tcp_user_timeout((timeout * 2).max(Duration::from_secs(5)));
            c
        })
        .collect()
}

/// A pooled connection: the client (with deadpool's wrapper, which ends
/// the connection task when it is dropped) and the statements prepared on
/// it.
pub(crate) struct PgConn {
    client: ClientWrapper,
    /// Statements prepared on this connection, found by the address of
    /// their [`Sql`]'s text and types (every `Sql` is a constant, so each
    /// has one), a handful of entries compared by a few words each. In
    /// place of deadpool's statement cache, which is keyed by the text: each
    /// lookup there hashed the whole statement (up to some 1.5 KiB of SQL).
    statements: Mutex<Vec<(StatementKey, Statement)>>,
}

/// What identifies a [`Sql`] in [`PgConn::statements`].
type StatementKey = (usize, usize, usize);

fn statement_key(sql: &Sql) -> StatementKey {
    (
        sql.text.as_ptr() as usize,
        sql.text.len(),
        sql.types.as_ptr() as usize,
    )
}

/// The pool's manager: connections from a [`Connector`].
pub(crate) struct Manager {
    pub(crate) connector: Arc<Connector>,
}

impl managed::Manager for Manager {
    type Type = PgConn;
    type Error = StoreError;

    async fn create(&self) -> Result<PgConn, StoreError> {
        let (client, connection) = self.connector.connect().await?;
        let task = tokio::spawn(async move {
            if let Err(e) = connection.await {
                debug!(error = %describe_db_error(&e), "store connection ended");
            }
        });
        Ok(PgConn {
            client: ClientWrapper::new(client, task),
            statements: Mutex::new(Vec::new()),
        })
    }

    async fn recycle(&self, conn: &mut PgConn, metrics: &Metrics) -> RecycleResult<StoreError> {
        if conn.client.is_closed() {
            return Err(RecycleError::message("connection closed"));
        }
        // A primary that hangs instead of dying keeps its connections
        // open: each would cost a request its store.timeout. Once a new
        // connection has reached another host, the older ones are dropped
        // unused, in every thread's pool at once.
        if self.connector.opened_before_failover(metrics.created) {
            return Err(RecycleError::message(
                "opened before a failover to another host",
            ));
        }
        Ok(())
    }
}

/// The pool of store connections.
pub(crate) type Pool = managed::Pool<Manager>;

/// A pooled connection that is closed, not reused, when dropped while a
/// statement is in flight (see the module docs).
pub(crate) struct Conn {
    object: Option<Object<Manager>>,
    prepared: bool,
    in_flight: AtomicUsize,
}

impl Conn {
    pub(crate) fn new(object: Object<Manager>, prepared: bool) -> Self {
        Conn {
            object: Some(object),
            prepared,
            in_flight: AtomicUsize::new(0),
        }
    }

    fn pg(&self) -> &PgConn {
        // Present until drop.
        self.object
            .as_deref()
            .expect("a Conn holds its object until dropped")
    }

    fn client(&self) -> &ClientWrapper {
        &self.pg().client
    }

    /// `sql`, prepared on this connection (once; then from its list).
    async fn statement(&self, sql: &Sql) -> Result<Statement, tokio_postgres::Error> {
        let pg = self.pg();
        let key = statement_key(sql);
        let found = pg
            .statements
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, stmt)| stmt.clone());
        if let Some(stmt) = found {
            return Ok(stmt);
        }
        let stmt = pg.client.prepare_typed(sql.text, sql.types).await?;
        let mut statements = pg
            .statements
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !statements.iter().any(|(k, _)| *k == key) {
            statements.push((key, stmt.clone()));
        }
        Ok(stmt)
    }

    /// Runs one statement future, counted as in flight from its first poll
    /// until it finishes.
    ///
    /// Combinators, not an `async fn`: an `async fn` keeps its argument and
    /// the future it awaits in separate slots, so every statement's future
    /// would take its room twice (and be copied as often).
    fn tracked<'a, T: 'a>(
        &'a self,
        op: impl std::future::Future<Output = Result<T, tokio_postgres::Error>> + 'a,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a {
        use futures_util::FutureExt as _;
        let in_flight = &self.in_flight;
        futures_util::future::lazy(move |_| {
            in_flight.fetch_add(1, Ordering::SeqCst);
        })
        .then(move |()| op)
        .map(move |out| {
            in_flight.fetch_sub(1, Ordering::SeqCst);
            Ok(out?)
        })
    }

    /// Closes the connection when it is dropped, whatever happened: for a
    /// transaction that failed half-way, which must not be handed on.
    pub(crate) fn poison(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    /// Runs `sql`, returning its rows.
    pub(crate) async fn query(
        &self,
        sql: &Sql,
        params: &Params<'_>,
    ) -> Result<Vec<Row>, StoreError> {
        debug_assert_eq!(sql.types.len(), params.len(), "{}", sql.text);
        let client = self.client();
        if self.prepared {
            self.tracked(async {
                let stmt = self.statement(sql).await?;
                client.query(&stmt, params).await
            })
            .await
        } else {
            let typed = typed(sql, params);
            self.tracked(client.query_typed(sql.text, &typed)).await
        }
    }

    /// Runs `sql`, returning its one row or none.
    pub(crate) async fn query_opt(
        &self,
        sql: &Sql,
        params: &Params<'_>,
    ) -> Result<Option<Row>, StoreError> {
        let mut rows = self.query(sql, params).await?;
        match rows.len() {
            0 | 1 => Ok(rows.pop()),
            n => Err(StoreError::Corrupt(format!(
                "{n} rows where at most one was expected"
            ))),
        }
    }

    /// Runs `sql`, returning its one row.
    pub(crate) async fn query_one(
        &self,
        sql: &Sql,
        params: &Params<'_>,
    ) -> Result<Row, StoreError> {
        self.query_opt(sql, params)
            .await?
            .ok_or_else(|| StoreError::Corrupt("no row where one was expected".into()))
    }

    /// Runs `sql`, returning how many rows it changed.
    pub(crate) async fn execute(&self, sql: &Sql, params: &Params<'_>) -> Result<u64, StoreError> {
        let client = self.client();
        if self.prepared {
            self.tracked(async {
                let stmt = self.statement(sql).await?;
                client.execute(&stmt, params).await
            })
            .await
        } else {
            let typed = typed(sql, params);
            self.tracked(client.execute_typed(sql.text, &typed)).await
        }
    }

    /// Runs statements without parameters (simple protocol: no statement
    /// is named, so it works through any pooler).
    pub(crate) async fn batch_execute(&self, text: &str) -> Result<(), StoreError> {
        self.tracked(self.client().batch_execute(text)).await
    }
}

fn typed<'a>(sql: &Sql, params: &Params<'a>) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    params
        .iter()
        .zip(sql.types)
        .map(|(p, t)| (*p, t.clone()))
        .collect()
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            if let Some(object) = self.object.take() {
                // Detached from the pool; dropping the client closes it.
                drop(Object::take(object));
                debug!("store connection closed: a statement on it was cut off");
            }
        }
    }
}
