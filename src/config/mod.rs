//! Configuration: one TOML file (DESIGN.md §3), the environment, then flags.
//!
//! # Design
//!
//! Parsing happens in steps, in the style of pingora and oauth2-proxy, each
//! in its own module:
//!
//! 1. `raw`: the file is deserialised into *raw* structs that mirror the
//!    TOML; every value that has rules is kept as written, with its span.
//!    Their doc comments are the key reference: a test keeps
//!    `docs/configuration.md` in step with them.
//! 2. `locate`: every key that no raw field took is reported (through
//!    `serde_ignored`, which finds them all where `deny_unknown_fields` would
//!    stop at the first), and spans become lines.
//! 3. `check`: one `Checker`, a file per section, turns the raw structs
//!    into the typed [`Config`] below through the value `rules`. It
//!    collects every problem (unknown keys, bad durations, bad sizes, bad
//!    URLs…) into one report, each with its file, line and dotted key,
//!    instead of stopping at the first. A key's dotted name is derived from
//!    its section and field, never typed apart from them.
//!
//! Only a syntax error, or a value of the wrong TOML type, stops before step
//! 3; it is then reported with the unknown keys found so far.
//!
//! Precedence: flags > environment > file. The environment (see `env`:
//! `IDEMPROXY_<SECTION>_<KEY>`, `_FILE` variants) is one more layer of raw
//! structs laid over the file's before step 3, so its values meet the same
//! rules; a problem with one names its variable.
//!
//! Every default lives in one place, `defaults.toml` (`BUILTIN_DEFAULTS`),
//! written in the file's own syntax and validated by the same code; the file
//! is layered over it key by key, and each `[[route]]` over `[defaults]`.
//! `docs/configuration.md` is the reference; a test keeps its table in step
//! with the raw structs (their keys and their defaults).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, Uri};

use crate::idempotency::fingerprint::FingerprintMode;

mod check;
mod env;
mod locate;
mod print;
mod raw;
mod reload;
mod rules;
#[cfg(test)]
mod tests;

/// The validated configuration every component is built from.
#[derive(Debug, Clone)]
pub struct Config {
    /// `[server]`: the listeners.
    pub server: ServerConfig,
    /// `[upstream]`: the legacy service behind the proxy.
    pub upstream: UpstreamConfig,
    /// `[store]`: the PostgreSQL that holds the records.
    pub store: StoreConfig,
    /// `[sweeper]`: the background deletion of expired records.
    pub sweeper: SweeperConfig,
    /// `[[route]]`, in file order; the first whose prefix matches wins.
    /// When the file has no route, one catch-all route (`/`) with the
    /// `[defaults]` policy is used.
    pub routes: Vec<Route>,
}

/// `[server]`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address of the proxy listener (HTTP/1.1 and h2c).
    pub listen: SocketAddr,
    /// Address of the admin listener (`/healthz`, `/readyz`, `/metrics`).
    pub admin_listen: SocketAddr,
    /// Largest keyed request body that is buffered and fingerprinted.
    pub max_request_body: u64,
    /// How long in-flight requests may take to finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// How long a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// TLS on the proxy listener (HTTP/1.1 and h2 by ALPN); `None`: plain
    /// HTTP/1.1 and h2c.
    pub tls: Option<crate::tls::TlsFiles>,
    /// Most duplicates that may wait for their originals at once (`wait`);
    /// past it a duplicate gets 409 at once.
    pub max_waiters: usize,
    /// How long a keyed request's body may take to arrive after its
    /// headers (408 past it).
    pub body_read_timeout: Duration,
    /// Most client connections open at once on the proxy listener.
    pub max_connections: usize,
    /// Most concurrent streams on one h2 connection.
    pub h2_max_concurrent_streams: u32,
    /// How long a client connection may stay open with no request in
    /// progress.
    pub idle_timeout: Duration,
}

/// `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Base URL of the upstream (`http://host:port`, optionally with a path
    /// prefix that is prepended to every forwarded path).
    pub url: Uri,
    /// Bound on establishing a TCP connection to the upstream.
    pub connect_timeout: Duration,
    /// Bound on a whole upstream exchange (request sent to response headers).
    pub timeout: Duration,
    /// CA certificates (PEM) trusted for an `https://` upstream, in addition
    /// to the system store.
    pub ca_file: Option<PathBuf>,
}

/// What to do with a keyed request when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnStoreError {
    /// Fail closed: 503 + `Retry-After`, nothing forwarded.
    Reject,
    /// Forward unprotected (loudly logged and counted).
    PassThrough,
}

/// `[store]`. `Debug` is derived: the URLs are [`Secret`]s, which redact
/// themselves.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// The PostgreSQL URL (a secret: never logged).
    pub database_url: Secret,
    /// Maximum number of pooled connections.
    pub pool_size: usize,
    /// Bound on any one store operation, pool wait included.
    pub timeout: Duration,
    /// Behaviour when the store fails.
    pub on_store_error: OnStoreError,
    /// CA certificates (PEM) that verify the database's certificate
    /// (`sslmode=verify-ca`/`verify-full`, or `require` with a CA).
    pub ca_file: Option<PathBuf>,
    /// Bytes of completed responses kept in memory for replays (0: none).
    pub response_cache: u64,
    /// Longest time a response is replayed from memory without asking the
    /// database (bounds how long an operator's manual release goes
    /// unnoticed by a replica).
    pub response_cache_ttl: Duration,
    /// Use named prepared statements (cached per connection). `false` for
    /// a pooler in transaction or statement mode (PgBouncer before 1.21),
    /// which cannot keep a statement between transactions.
    pub prepared_statements: bool,
    /// A direct (session) URL for `LISTEN` and migrations; `None`: the
    /// database URL. A secret, like the database URL.
    pub listen_url: Option<Secret>,
}

#[cfg(test)]
impl StoreConfig {
    /// A store on `url` with `pool_size` connections and `timeout`, the
    /// response cache off and no TLS, for the unit tests of the store.
    pub(crate) fn for_test(url: &str, pool_size: usize, timeout: Duration) -> Self {
        StoreConfig {
            database_url: Secret::new(url.to_owned()),
            pool_size,
            timeout,
            on_store_error: OnStoreError::Reject,
            ca_file: None,
            response_cache: 0,
            response_cache_ttl: Duration::from_secs(1),
            prepared_statements: false,
            listen_url: None,
        }
    }
}

/// `[sweeper]`: deletion of records past their retention.
#[derive(Debug, Clone)]
pub struct SweeperConfig {
    /// Pause between sweeper passes.
    pub interval: Duration,
    /// Rows deleted per statement (bounded batches keep transactions short).
    pub batch_size: u32,
    /// Pause between the batches of a pass (paces a large backlog).
    pub pause: Duration,
}

/// Whether a keyed route requires the key header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRequirement {
    /// No key: pass-through.
    Optional,
    /// No key: 400.
    Required,
}

/// The idempotency policy of a route (`[defaults]`, overridable per route).
#[derive(Debug, Clone)]
pub struct Policy {
    /// Header that carries the idempotency key.
    pub key_header: HeaderName,
    /// Methods that are keyed on this route; others pass through.
    pub methods: Vec<Method>,
    /// Whether the key is required.
    pub key: KeyRequirement,
    /// How long a claim is owned without renewal.
    pub lease: Duration,
    /// How long a record is remembered after it completes.
    pub retention: Duration,
    /// Longest accepted key, in bytes.
    pub max_key_length: usize,
    /// How the request body is fingerprinted.
    pub fingerprint: FingerprintMode,
    /// Upstream statuses that release the claim instead of being stored.
    pub release_on: Vec<StatusCode>,
    /// Largest response body that is stored for replay.
    pub max_stored_response: u64,
    /// How long a duplicate waits for an in-flight original (0: answer 409).
    pub wait: Duration,
    /// Header in which a key derived from (tenant, key) is forwarded, so an
    /// upstream that deduplicates on its own never confuses two tenants'.
    pub derived_key_header: Option<HeaderName>,
    /// How the derived key is formed.
    pub derived_key: DerivedKey,
}

/// The form of the key forwarded in `derived_key_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DerivedKey {
    /// Hex SHA-256 of the tenant and the key: stable, opaque, fixed length.
    Sha256,
    /// `tenant:key` in clear, `%` and `:` percent-encoded in the tenant so
    /// that the first `:` ends it (the stored tenant: a digest on
    /// `tenant_hash` routes).
    TenantKey,
}

/// One `[[route]]`.
#[derive(Debug, Clone)]
pub struct Route {
    /// Label used in metrics and logs: the route's `name`, else its prefix.
    pub name: String,
    /// Path prefix this route covers.
    pub path_prefix: String,
    /// Header that names the tenant; `None`: every request is the empty tenant.
    pub tenant_header: Option<HeaderName>,
    /// A keyed request without the tenant header gets 400.
    pub tenant_required: bool,
    /// Store the SHA-256 of the tenant header value, never the value.
    pub tenant_hash: bool,
    /// The idempotency policy.
    pub policy: Policy,
}

impl Config {
    /// Settings that are valid but work against each other; `check-config`
    /// prints them and `serve` logs them at start.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        // Drain waits for every owned claim: its upstream call (bounded by
        // upstream.timeout), then the store write (bounded by store.timeout).
        let needed = self.upstream.timeout + self.store.timeout;
        if self.server.shutdown_grace < needed {
            out.push(format!(
                "server.shutdown_grace ({}) is shorter than upstream.timeout + store.timeout ({}): \
                 on SIGTERM a slow owned request may be cut before its response is stored, \
                 and its key then waits for its lease to expire",
                humantime::format_duration(self.server.shutdown_grace),
                humantime::format_duration(needed)
            ));
        }
        out
    }

    /// The first route whose prefix matches `path`.
    pub fn route_for(&self, path: &str) -> Option<&Route> {
        self.routes
            .iter()
            .find(|r| path.starts_with(&r.path_prefix))
    }
}

/// A secret string (the database URL): `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    /// The secret itself; only for handing to the database driver.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

// ---------------------------------------------------------------------------
// Public entry points.

pub use env::{EnvKey, Environment, Kind, DATABASE_URL_ENV, FILE_SUFFIX};
pub use reload::{restart_only, restart_only_changes};

/// Every key that can be set from the environment, with its variable.
pub fn env_keys() -> &'static [EnvKey] {
    env::keys()
}

/// Values given as command-line flags (they beat the environment and the
/// file).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// Replaces `store.database_url` (`--database-url`).
    pub database_url: Option<Secret>,
    /// Replaces `server.listen` (`--listen`).
    pub listen: Option<SocketAddr>,
    /// Replaces `server.admin_listen` (`--admin-listen`).
    pub admin_listen: Option<SocketAddr>,
}

impl Overrides {
    /// Layers two sets of overrides: per field, `later` wins where it is set.
    pub fn merge(earlier: Overrides, later: Overrides) -> Overrides {
        Overrides {
            database_url: later.database_url.or(earlier.database_url),
            listen: later.listen.or(earlier.listen),
            admin_listen: later.admin_listen.or(earlier.admin_listen),
        }
    }

    /// Dotted key → the flag, for every key set.
    fn origins(&self) -> impl Iterator<Item = (String, String)> {
        [
            (
                "store.database_url",
                "--database-url",
                self.database_url.is_some(),
            ),
            ("server.listen", "--listen", self.listen.is_some()),
            (
                "server.admin_listen",
                "--admin-listen",
                self.admin_listen.is_some(),
            ),
        ]
        .into_iter()
        .filter(|(_, _, set)| *set)
        .map(|(key, flag, _)| (key.to_string(), flag.to_string()))
    }
}

/// Parse + validate the file's text with flag overrides, ignoring the
/// environment. `origin` is the file name used in messages.
///
/// Every problem is reported at once: unknown keys anywhere and every value
/// that breaks a rule. Only a syntax error, or a value of the wrong TOML type
/// (`pool_size = "x"`), stops the parse early; it is then reported with the
/// unknown keys found so far.
pub fn parse(text: &str, origin: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
    parse_layers(text, origin, &Environment::default(), overrides)
}

/// Parse + validate the file's text, the environment laid over it, then
/// the flags: flags > environment > file > built-in defaults. An overridden
/// key's lower value is not used, so it is not checked either.
pub fn parse_layers(
    text: &str,
    origin: &str,
    env: &Environment,
    flags: &Overrides,
) -> Result<Config, ConfigError> {
    resolve(text, origin, env, flags).map(|resolved| resolved.config)
}

/// Reads the file then [`parse`] (the environment ignored). A
/// missing/unreadable file is a [`ConfigError`] too.
pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
    load_layers(Some(path), &Environment::default(), overrides)
}

/// Reads the file (none: the built-in defaults) then [`parse_layers`].
pub fn load_layers(
    path: Option<&Path>,
    env: &Environment,
    flags: &Overrides,
) -> Result<Config, ConfigError> {
    let (text, origin) = read(path)?;
    parse_layers(&text, &origin, env, flags)
}

/// What `check-config --print` shows: the effective configuration as TOML,
/// every value followed by where it came from, secrets redacted.
pub fn explain(
    path: Option<&Path>,
    env: &Environment,
    flags: &Overrides,
) -> Result<String, ConfigError> {
    let (text, origin) = read(path)?;
    let resolved = resolve(&text, &origin, env, flags)?;
    Ok(print::render(&resolved))
}

/// The file's text and the name problems give it.
fn read(path: Option<&Path>) -> Result<(String, String), ConfigError> {
    let Some(path) = path else {
        return Ok((String::new(), NO_FILE_ORIGIN.to_string()));
    };
    let origin = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((text, origin)),
        Err(err) => Err(ConfigError {
            problems: vec![Problem {
                origin,
                line: None,
                key: String::new(),
                message: format!("cannot read the configuration file: {err}"),
            }],
        }),
    }
}

/// A configuration with what it was made of.
struct Resolved {
    config: Config,
    /// The file's text and name.
    text: String,
    origin: String,
    /// Dotted key → the variable or flag that set it.
    origins: BTreeMap<String, String>,
}

/// The layers, checked: built-in defaults < file < environment < flags.
fn resolve(
    text: &str,
    origin: &str,
    env: &Environment,
    flags: &Overrides,
) -> Result<Resolved, ConfigError> {
    let builtin = builtin_config()?;
    let layer = env::layer(env);
    let mut origins = layer.sources;
    origins.extend(flags.origins());
    let mut file = match locate::deserialize(text, origin) {
        Ok(file) => file,
        Err(mut err) => {
            err.problems.extend(layer.problems);
            return Err(ConfigError::sorted(err.problems));
        }
    };
    file.config.overlay(layer.raw);
    file.unknown_keys.extend(layer.problems);
    let config = check::check(origin, text, file, Some(&builtin), flags, &origins)?;
    Ok(Resolved {
        config,
        text: text.to_string(),
        origin: origin.to_string(),
        origins,
    })
}

/// Everything wrong with a configuration, in file order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// One entry per problem; never empty.
    pub problems: Vec<Problem>,
}

impl ConfigError {
    /// Problems in file order; those without a line (overrides) last.
    fn sorted(mut problems: Vec<Problem>) -> Self {
        problems.sort_by_key(|p| (p.line.is_none(), p.line));
        ConfigError { problems }
    }
}

impl fmt::Display for ConfigError {
    /// One line per problem.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, problem) in self.problems.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{problem}")?;
        }
        Ok(())
    }
}

/// One problem: where it is and what is wrong.
///
/// Displays as `example.toml:12: route[1].lease: invalid duration "10
/// parsecs": …`; the line is left out when unknown (an override, an
/// unreadable file), the key when the problem is not about one key (a syntax
/// error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file name, or the environment variable (`IDEMPROXY_STORE_POOL_SIZE`)
    /// or flag (`--database-url`) the value came from.
    pub origin: String,
    /// 1-based line in the file, when known.
    pub line: Option<usize>,
    /// Dotted path of the key, such as `route[1].lease` (routes are counted
    /// from 0, in file order); empty when the problem is not about one key.
    pub key: String,
    /// What is wrong. Never contains the database URL.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// The origin named when `serve` runs without a file.
const NO_FILE_ORIGIN: &str = "<defaults>";
/// The origin named in problems about the built-in defaults (a bug).
const BUILTIN_ORIGIN: &str = "built-in defaults";

// ---------------------------------------------------------------------------
// Defaults: the one place.

/// Every default, in the file's own syntax (`defaults.toml`).
///
/// It is validated by the same code as the file (tests keep it valid,
/// complete and in step with `docs/configuration.md`), and the file is
/// layered over it key by key. Its one `[[route]]` is the catch-all used when
/// the file has no route, and lends its route-only keys (`path_prefix`,
/// `tenant_required`, `tenant_hash`) to file routes that leave them out; a
/// file route's `name` defaults to its own `path_prefix` instead.
const BUILTIN_DEFAULTS: &str = include_str!("defaults.toml");

/// The built-in defaults as a typed [`Config`].
fn builtin_config() -> Result<Config, ConfigError> {
    let raw = locate::deserialize(BUILTIN_DEFAULTS, BUILTIN_ORIGIN)?;
    check::check(
        BUILTIN_ORIGIN,
        BUILTIN_DEFAULTS,
        raw,
        None,
        &Overrides::default(),
        &BTreeMap::new(),
    )
}
