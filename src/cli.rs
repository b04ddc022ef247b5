//! The `idemproxy` command line.
//!
//! Precedence everywhere: flags > environment > configuration file.

use std::io::{BufRead, IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::SystemTime;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::app::{self, ServeOptions};
use crate::config::{self, Config, ConfigError, Environment, Overrides, Secret};
use crate::idempotency::TenantId;
use crate::metrics::Metrics;
use crate::store::Store;

/// A reverse-proxy sidecar that makes an HTTP API safe to retry: requests
/// carrying an Idempotency-Key are executed by the upstream once, and
/// retries get the original response.
#[derive(Debug, Parser)]
#[command(name = "idemproxy", version = crate::version::LONG, propagate_version = true)]
pub struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Options every subcommand shares.
#[derive(Debug, Args)]
pub struct Common {
    /// Configuration file (TOML); every key of its sections can also come
    /// from the environment (the help text says how).
    #[arg(
        long,
        short = 'c',
        env = "IDEMPROXY_CONFIG",
        value_name = "FILE",
        // Given here rather than as the doc comment, which rustdoc would
        // read as links and HTML tags.
        help = "Configuration file (TOML). Without it, the built-in defaults apply. \
                Every key of [server], [upstream], [store], [sweeper] and [defaults] \
                can also be set as IDEMPROXY_<SECTION>_<KEY> (or, read from a file, \
                IDEMPROXY_<SECTION>_<KEY>_FILE), which beats the file"
    )]
    pub config: Option<PathBuf>,
    /// PostgreSQL URL; overrides IDEMPROXY_DATABASE_URL and store.database_url.
    /// Prefer the environment (IDEMPROXY_DATABASE_URL_FILE for a secret):
    /// flags are visible in process listings.
    #[arg(long, value_name = "URL", hide_env_values = true)]
    pub database_url: Option<String>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (applies pending migrations first unless --no-migrate).
    Serve {
        #[command(flatten)]
        common: Common,
        /// Proxy listen address; overrides server.listen.
        #[arg(long, value_name = "ADDR")]
        listen: Option<SocketAddr>,
        /// Admin listen address; overrides server.admin_listen.
        #[arg(long, value_name = "ADDR")]
        admin_listen: Option<SocketAddr>,
        /// Do not apply migrations at start (run `idemproxy migrate` instead).
        #[arg(long)]
        no_migrate: bool,
    },
    /// Apply pending database migrations and exit (or report on them).
    ///
    /// Migrations are expand-then-contract: running them while replicas of
    /// the previous release still serve is safe (docs/operations.md,
    /// "Upgrades and compatibility"). Several replicas may migrate at once
    /// (an advisory lock serialises them).
    ///
    /// Exit status: 0 done (or, with --status, the schema is current for
    /// this binary; with --dry-run, the report was printed); 1 an error
    /// (database unreachable, a migration failed); 3 with --status, this
    /// binary's migrations are pending; 4 with --status or --dry-run, this
    /// binary must not run against the schema (a migration applied with
    /// different contents, or a later release's contract step that this
    /// binary predates).
    Migrate {
        #[command(flatten)]
        common: Common,
        /// Print applied and pending migrations and whether this binary can
        /// run against the schema; change nothing.
        #[arg(long, conflicts_with = "dry_run")]
        status: bool,
        /// Print what `migrate` would apply, with its SQL; write nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Validate the configuration: exit 0 if valid, else list every problem and exit 1.
    ///
    /// A problem names the file and line, or the environment variable or
    /// flag, its value came from.
    CheckConfig {
        #[command(flatten)]
        common: Common,
        /// Also print the effective configuration (file, environment and
        /// flags applied) with where each value came from; secrets redacted.
        #[arg(long)]
        print: bool,
    },
    /// Run one pass of the retention sweeper and print how many records it deleted.
    Sweep {
        #[command(flatten)]
        common: Common,
    },
    /// Inspect or release one key's record (for operators in an incident).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Probe a health URL: exit 0 if it answers 2xx within the timeout, 1 otherwise.
    ///
    /// For container healthchecks in images without a shell or curl. Without
    /// --url, probes /readyz on the configured admin listener (an unspecified
    /// address such as 0.0.0.0 is reached through the loopback).
    Health {
        #[command(flatten)]
        common: Common,
        /// URL to probe (http:// only), e.g. http://127.0.0.1:9090/readyz.
        #[arg(long, value_name = "URL")]
        url: Option<http::Uri>,
        /// Bound on the whole probe: connect, send, response headers.
        #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
}

/// `idemproxy keys …`.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List records, oldest first: e.g. stuck claims with `--state in_flight --older-than 5m`.
    List {
        #[command(flatten)]
        common: Common,
        /// Only records in this state.
        #[arg(long, value_enum)]
        state: Option<StateFilter>,
        /// Only records created at least this long ago (e.g. "5m", "1h").
        #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
        older_than: std::time::Duration,
        /// Only this tenant (as stored: with --hash-tenant, hashed first).
        #[arg(long)]
        tenant: Option<String>,
        /// The tenant is a `tenant_hash` route's header value: hash it first.
        #[arg(long, requires = "tenant")]
        hash_tenant: bool,
        /// At most this many records.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Print a key's record: state, attempt, owner, lease, times, stored status and body size.
    Show {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        target: KeyTarget,
        /// Also print the stored response body.
        #[arg(long)]
        body: bool,
    },
    /// Delete an in-flight record so the next retry executes (asks for confirmation).
    Release {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        target: KeyTarget,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
        /// Also delete a completed record (its next retry executes again).
        #[arg(long)]
        force: bool,
    },
}

/// `keys list --state`: the states as the records name them (`in_flight`);
/// `in-flight` is accepted too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateFilter {
    /// Claimed, upstream call in flight (or its owner died).
    #[value(name = "in_flight", alias = "in-flight")]
    InFlight,
    /// Response stored.
    Completed,
}

/// Which record.
#[derive(Debug, Args)]
pub struct KeyTarget {
    /// The tenant as the client sends it ("" for none).
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// The tenant is a `tenant_hash` route's header value: hash it before looking up.
    #[arg(long)]
    pub hash_tenant: bool,
    /// The idempotency key.
    #[arg(long)]
    pub key: String,
}

impl KeyTarget {
    fn stored_tenant(&self) -> String {
        if self.hash_tenant {
            TenantId::hashed(self.tenant.as_bytes()).as_str().to_owned()
        } else {
            self.tenant.clone()
        }
    }
}

fn load_config(common: &Common, flags: Overrides) -> anyhow::Result<Config> {
    let flags = with_database_url(common, flags);
    config::load_layers(
        common.config.as_deref(),
        &Environment::from_process(),
        &flags,
    )
    .map_err(|e| anyhow::anyhow!("invalid configuration:\n{e}"))
}

/// The flags, with `--database-url`.
fn with_database_url(common: &Common, mut flags: Overrides) -> Overrides {
    flags.database_url = common.database_url.clone().map(Secret::new);
    flags
}

/// SIGHUP, or nothing where there is no such signal.
struct Hangups {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangups {
    /// Installs the handler (before anything else can take time, so that
    /// an early SIGHUP does not kill the process).
    fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let signal = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
            Ok(Hangups {
                signal: Some(signal),
            })
        }
        #[cfg(not(unix))]
        Ok(Hangups {})
    }

    /// The next SIGHUP.
    async fn next(&mut self) {
        #[cfg(unix)]
        if let Some(signal) = &mut self.signal {
            if signal.recv().await.is_some() {
                return;
            }
            self.signal = None;
        }
        std::future::pending::<()>().await;
    }
}

/// `serve`: run, reload on SIGHUP, drain on SIGTERM.
async fn serve(
    common: Common,
    flags: Overrides,
    options: ServeOptions,
) -> anyhow::Result<ExitCode> {
    let mut hangups = Hangups::install()?;
    // Captured once: a reload re-applies the same variables (files named
    // by `_FILE` variables are read again), and flags still beat the file.
    let env = Environment::from_process();
    let flags = with_database_url(&common, flags);
    let path = common.config.clone();
    let read =
        || -> Result<Config, ConfigError> { config::load_layers(path.as_deref(), &env, &flags) };
    let config = read().map_err(|e| anyhow::anyhow!("invalid configuration:\n{e}"))?;
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    let running = app::start(config, options).await?;
    let reloader = running.reloader();
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            () = hangups.next() => {
                tracing::info!(file = ?path, "SIGHUP: reloading the configuration");
                reloader.reload(path.as_ref().map(|_| read())).await;
            }
        }
    }
    tracing::info!("shutting down: draining in-flight requests");
    let drain = running.shutdown();
    tokio::pin!(drain);
    loop {
        tokio::select! {
            _ = &mut drain => break,
            () = hangups.next() => reloader.skip("SIGHUP while draining"),
        }
    }
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve {
            common,
            listen,
            admin_listen,
            no_migrate,
        } => {
            serve(
                common,
                Overrides {
                    listen,
                    admin_listen,
                    ..Overrides::default()
                },
                ServeOptions {
                    migrate: !no_migrate,
                    sweeper: true,
                    workers: crate::workers::count_from_env().map_err(anyhow::Error::msg)?,
                },
            )
            .await
        }
        Command::Migrate {
            common,
            status,
            dry_run,
        } => {
            let config = load_config(&common, Overrides::default())?;
            let store = Store::new(&config.store)?;
            if status || dry_run {
                return migration_report(&store, dry_run).await;
            }
            let applied = store.migrate().await.context("migrating the database")?;
            if applied.is_empty() {
                println!("schema is current");
            } else {
                println!("applied migrations: {applied:?}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { common, print } => {
            match load_config(&common, Overrides::default()) {
                Ok(config) => {
                    if print {
                        let flags = with_database_url(&common, Overrides::default());
                        let text = config::explain(
                            common.config.as_deref(),
                            &Environment::from_process(),
                            &flags,
                        )
                        .map_err(|e| anyhow::anyhow!("invalid configuration:\n{e}"))?;
                        println!("{text}");
                    }
                    println!(
                        "configuration is valid: {} route(s), upstream {}",
                        config.routes.len(),
                        config.upstream.url
                    );
                    for warning in config.warnings() {
                        println!("warning: {warning}");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    eprintln!("{e}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Sweep { common } => {
            let config = load_config(&common, Overrides::default())?;
            let store = Store::new(&config.store)?;
            let metrics = Metrics::new();
            let n = crate::sweeper::sweep_configured(&store, &metrics, &config.sweeper).await?;
            println!("deleted {n} expired record(s)");
            Ok(ExitCode::SUCCESS)
        }
        Command::Keys { command } => keys(command).await,
        Command::Health {
            common,
            url,
            timeout,
        } => {
            let url = match url {
                Some(url) => url,
                None => {
                    let admin = load_config(&common, Overrides::default())?
                        .server
                        .admin_listen;
                    readyz_url(admin)?
                }
            };
            Ok(health(&url, timeout).await)
        }
    }
}

/// `migrate --status` (or `--dry-run`): reads the version table over a
/// direct connection, writes nothing.
async fn migration_report(store: &Store, dry_run: bool) -> anyhow::Result<ExitCode> {
    use crate::store::migrate::{self, Entry, Verdict};

    let (client, connection) = store
        .connect_dedicated()
        .await
        .context("connecting to the database")?;
    let driver = tokio::spawn(connection);
    let status = tokio::time::timeout(store.timeout(), migrate::status(&client)).await;
    drop(client);
    driver.abort();
    let status = status
        .map_err(|_| anyhow::anyhow!("reading the migrations table timed out"))?
        .context("reading the migrations table")?;

    println!(
        "idemproxy {} knows migrations up to {}",
        crate::version::LONG,
        migrate::latest_version()
    );
    let when = |a: &migrate::Applied| fmt_time(Some(a.applied_at));
    for entry in &status.entries {
        match entry {
            Entry::Applied(a) => println!("  applied   {}  ({})", a.name, when(a)),
            Entry::Pending(m) => println!("  pending   {}", m.name),
            Entry::Modified(a) => println!(
                "  MODIFIED  {}  ({}): applied with different contents than this binary's file",
                a.name,
                when(a)
            ),
            Entry::Newer(a) if a.requires > migrate::latest_version() => println!(
                "  newer     {}  ({}): a later release's; requires migration {}, which this binary does not know",
                a.name,
                when(a),
                a.requires
            ),
            Entry::Newer(a) => println!(
                "  newer     {}  ({}): a later release's expand step; this binary ignores it",
                a.name,
                when(a)
            ),
        }
    }
    if dry_run {
        let pending: Vec<_> = status
            .entries
            .iter()
            .filter_map(|e| match e {
                Entry::Pending(m) => Some(m),
                _ => None,
            })
            .collect();
        if status.verdict == Verdict::Incompatible {
            println!("dry run: `idemproxy migrate` would refuse (see above); nothing written");
            return Ok(ExitCode::from(4));
        }
        if pending.is_empty() {
            println!("dry run: nothing to apply; nothing written");
        } else {
            println!(
                "dry run: `idemproxy migrate` would apply {} migration(s) in one transaction; nothing written",
                pending.len()
            );
            for m in pending {
                println!("\n-- {}\n{}", m.name, m.sql.trim_end());
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    Ok(match status.verdict {
        Verdict::Current => {
            println!("schema is compatible with this binary: nothing pending");
            ExitCode::SUCCESS
        }
        Verdict::Pending => {
            println!("schema is behind this binary: run `idemproxy migrate` (the previous release keeps working meanwhile)");
            ExitCode::from(3)
        }
        Verdict::Incompatible => {
            println!("schema is NOT compatible with this binary: do not serve with it");
            ExitCode::from(4)
        }
    })
}

/// `/readyz` on an admin listener, reached through the loopback when the
/// listener binds every address.
fn readyz_url(mut admin: SocketAddr) -> anyhow::Result<http::Uri> {
    if admin.ip().is_unspecified() {
        admin.set_ip(match admin {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    Ok(format!("http://{admin}/readyz").parse()?)
}

/// One GET of `url`: success when a 2xx status arrives within `timeout`.
/// Prints the outcome (stdout on success, stderr on failure), which is what
/// `docker inspect` shows of a healthcheck.
async fn health(url: &http::Uri, timeout: std::time::Duration) -> ExitCode {
    use http_body_util::Empty;
    use hyper_util::client::legacy::{connect::HttpConnector, Client};
    use hyper_util::rt::TokioExecutor;

    if url.scheme() != Some(&http::uri::Scheme::HTTP) || url.authority().is_none() {
        eprintln!("unhealthy: {url}: only absolute http:// URLs can be probed");
        return ExitCode::FAILURE;
    }
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let request = match http::Request::get(url.clone()).body(Empty::<bytes::Bytes>::new()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("unhealthy: {url}: {e}");
            return ExitCode::FAILURE;
        }
    };
    match tokio::time::timeout(timeout, client.request(request)).await {
        Ok(Ok(resp)) if resp.status().is_success() => {
            println!("healthy: {url} answered {}", resp.status());
            ExitCode::SUCCESS
        }
        Ok(Ok(resp)) => {
            eprintln!("unhealthy: {url} answered {}", resp.status());
            ExitCode::FAILURE
        }
        Ok(Err(e)) => {
            // The client's own message is terse ("client error (Connect)"):
            // the cause chain says what went wrong.
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                message = format!("{message}: {cause}");
                source = cause.source();
            }
            eprintln!("unhealthy: {url}: {message}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("unhealthy: {url} did not answer within {timeout:?}");
            ExitCode::FAILURE
        }
    }
}

fn fmt_time(t: Option<SystemTime>) -> String {
    t.map_or_else(|| "-".into(), httpdate::fmt_http_date)
}

async fn keys(command: KeysCommand) -> anyhow::Result<ExitCode> {
    match command {
        KeysCommand::List {
            common,
            state,
            older_than,
            tenant,
            hash_tenant,
            limit,
        } => {
            let config = load_config(&common, Overrides::default())?;
            let store = Store::new(&config.store)?;
            let state = state.map(|s| match s {
                StateFilter::InFlight => "in_flight",
                StateFilter::Completed => "completed",
            });
            let tenant = tenant.map(|t| {
                if hash_tenant {
                    TenantId::hashed(t.as_bytes()).as_str().to_owned()
                } else {
                    t
                }
            });
            let rows = store
                .list(state, older_than, tenant.as_deref(), i64::from(limit))
                .await?;
            println!(
                "{:<29}  {:<10}  {:>7}  {:<24}  {:<20}  KEY",
                "CREATED", "STATE", "ATTEMPT", "LEASE / STATUS", "TENANT"
            );
            for r in &rows {
                let detail = match (r.state.as_str(), r.lease_valid) {
                    ("completed", _) => format!("status {}", r.response_status.unwrap_or(0)),
                    (_, true) => "lease valid".to_string(),
                    (_, false) => "lease EXPIRED".to_string(),
                };
                println!(
                    "{:<29}  {:<10}  {:>7}  {:<24}  {:<20}  {}",
                    fmt_time(Some(r.created_at)),
                    r.state,
                    r.attempt,
                    detail,
                    format!("{:?}", r.tenant),
                    r.key
                );
            }
            println!("{} record(s)", rows.len());
            Ok(ExitCode::SUCCESS)
        }
        KeysCommand::Show {
            common,
            target,
            body,
        } => {
            let config = load_config(&common, Overrides::default())?;
            let store = Store::new(&config.store)?;
            let Some(r) = store
                .show(&target.stored_tenant(), &target.key, body)
                .await?
            else {
                println!("no record for this tenant and key");
                return Ok(ExitCode::from(3));
            };
            let lease = match r.lease_expires_at {
                Some(l) => match l.duration_since(r.now) {
                    Ok(d) => format!("{} (valid for {:.1}s)", fmt_time(Some(l)), d.as_secs_f64()),
                    Err(_) => format!("{} (expired)", fmt_time(Some(l))),
                },
                None => "-".into(),
            };
            println!("tenant:          {:?}", r.tenant);
            println!("key:             {}", r.key);
            println!("state:           {}", r.state);
            println!("attempt:         {}", r.attempt);
            println!("owner:           {}", r.owner);
            println!("fingerprint:     {}", r.fingerprint);
            println!("lease expires:   {lease}");
            println!("created:         {}", fmt_time(Some(r.created_at)));
            println!("completed:       {}", fmt_time(r.completed_at));
            println!("expires:         {}", fmt_time(Some(r.expires_at)));
            println!(
                "response status: {}",
                r.response_status
                    .map_or_else(|| "-".into(), |s| s.to_string())
            );
            let size = match (r.response_body_omitted, r.response_body_len) {
                (true, _) => "not stored (exceeded max_stored_response)".into(),
                (false, Some(n)) => format!("{n} bytes"),
                (false, None) => "-".into(),
            };
            println!("response body:   {size}");
            if let Some(b) = r.response_body {
                println!();
                std::io::stdout().write_all(&b)?;
                println!();
            }
            Ok(ExitCode::SUCCESS)
        }
        KeysCommand::Release {
            common,
            target,
            yes,
            force,
        } => {
            let config = load_config(&common, Overrides::default())?;
            let store = Store::new(&config.store)?;
            let tenant = target.stored_tenant();
            let Some(r) = store.show(&tenant, &target.key, false).await? else {
                println!("no record for this tenant and key");
                return Ok(ExitCode::from(3));
            };
            if r.state == "completed" && !force {
                eprintln!(
                    "refusing: the record is completed (its response is replayed to retries); \
                     releasing it lets the next retry execute again. Use --force if that is what you want."
                );
                return Ok(ExitCode::FAILURE);
            }
            if !yes
                && !confirm(&format!(
                    "delete the {} record of key {}? [y/N] ",
                    r.state, r.key
                ))?
            {
                println!("nothing deleted");
                return Ok(ExitCode::FAILURE);
            }
            match store.force_release(&tenant, &target.key, force).await? {
                Some(state) => {
                    println!("deleted the {state} record; the next request with this key executes");
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    eprintln!(
                        "nothing deleted: the record changed meanwhile (completed or already gone)"
                    );
                    Ok(ExitCode::FAILURE)
                }
            }
        }
    }
}

fn confirm(prompt: &str) -> anyhow::Result<bool> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        anyhow::bail!("confirmation needed but standard input is not a terminal; pass --yes");
    }
    print!("{prompt}");
    std::io::stdout().flush()?;
    let mut line = String::new();
    stdin.lock().read_line(&mut line)?;
    Ok(matches!(line.trim(), "y" | "Y" | "yes"))
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Installs the tracing subscriber (see [`crate::logging`]).
pub fn init_logging(format: LogFormat) {
    crate::logging::init(match format {
        LogFormat::Text => crate::logging::Format::Text,
        LogFormat::Json => crate::logging::Format::Json,
    });
}
