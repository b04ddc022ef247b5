//! Configuration: one TOML file (DESIGN.md §3), the environment, then flags.
//!
//! Parsing happens in two steps, in the style of pingora and oauth2-proxy:
//! the file is deserialised into *raw* structs that mirror the TOML (every
//! value that has rules is kept as text with its location), then one
//! `validate` turns them into the typed [`Config`] below, collecting every
//! problem (unknown keys, bad durations, bad sizes, bad URLs…) into one
//! report instead of stopping at the first.
//!
//! Precedence: flags > environment (`IDEMPROXY_DATABASE_URL`) > file.
//!
//! Every default lives in one place, `BUILTIN_DEFAULTS`, written in the
//! file's own syntax and validated by the same code; the file is layered
//! over it key by key, and each `[[route]]` over `[defaults]`.
//! `docs/configuration.md` is the reference; a test keeps its table in step
//! with the raw structs (their keys and their defaults).

use std::fmt;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::ops::{Range, RangeInclusive};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use http::{HeaderName, Method, StatusCode, Uri};
use serde::Deserialize;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::idempotency::fingerprint::FingerprintMode;

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

/// `[store]`.
#[derive(Clone)]
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

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("database_url", &self.database_url)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("on_store_error", &self.on_store_error)
            .field("ca_file", &self.ca_file)
            .field("response_cache", &self.response_cache)
            .field("response_cache_ttl", &self.response_cache_ttl)
            .field("prepared_statements", &self.prepared_statements)
            .field("listen_url", &self.listen_url)
            .finish()
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
    /// `tenant:key` in clear (the stored tenant: a digest on `tenant_hash` routes).
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

/// The environment variable that overrides `store.database_url`.
pub const DATABASE_URL_ENV: &str = "IDEMPROXY_DATABASE_URL";

/// Values that come from outside the file (environment, flags).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// Replaces `store.database_url`.
    pub database_url: Option<Secret>,
    /// Replaces `server.listen`.
    pub listen: Option<SocketAddr>,
    /// Replaces `server.admin_listen`.
    pub admin_listen: Option<SocketAddr>,
}

impl Overrides {
    /// Layers two sets of overrides: per field, `later` wins where it is set.
    /// Call it as `Overrides::merge(env, flags)` so that flags beat the
    /// environment.
    pub fn merge(earlier: Overrides, later: Overrides) -> Overrides {
        Overrides {
            database_url: later.database_url.or(earlier.database_url),
            listen: later.listen.or(earlier.listen),
            admin_listen: later.admin_listen.or(earlier.admin_listen),
        }
    }
}

/// Reads the environment variables the config honours
/// (`IDEMPROXY_DATABASE_URL`) through a closure so tests never touch the real
/// environment.
///
/// A variable that is set but empty still overrides (and then fails
/// validation): silently falling back to the file's URL when a secret failed
/// to mount would connect to the wrong database.
pub fn env_overrides(get: impl Fn(&str) -> Option<String>) -> Overrides {
    Overrides {
        database_url: get(DATABASE_URL_ENV).map(Secret::new),
        ..Overrides::default()
    }
}

/// Parse + validate. `origin` is the file name used in messages.
///
/// Env overrides are applied first, then flag overrides (flags win): pass
/// them merged by the caller via [`Overrides::merge`]`(env, flags)`. An
/// overridden key's file value is not used, so it is not checked either.
///
/// Every problem is reported at once: unknown keys anywhere and every value
/// that breaks a rule. Only a syntax error, or a value of the wrong TOML type
/// (`pool_size = "x"`), stops the parse early; it is then reported with the
/// unknown keys found so far.
pub fn parse(text: &str, origin: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
    let builtin = builtin_config()?;
    let raw = deserialize(text, origin)?;
    let mut checker = Checker::new(origin, text);
    checker.problems.extend(raw.unknown_keys);
    let config = checker.validate(&raw.config, Some(&builtin), overrides);
    checker.finish(config)
}

/// Reads the file then [`parse`]. A missing/unreadable file is a
/// [`ConfigError`] too.
pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
    let origin = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, &origin, overrides),
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

/// Everything wrong with a configuration, in file order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// One entry per problem; never empty.
    pub problems: Vec<Problem>,
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
    /// The file name (or `environment/flags` for an override).
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

/// The origin named in problems about values that came from an override.
const OVERRIDE_ORIGIN: &str = "environment/flags";
/// The origin named in problems about the built-in defaults (a bug).
const BUILTIN_ORIGIN: &str = "built-in defaults";

// ---------------------------------------------------------------------------
// Defaults: the one place.

/// Every default, in the file's own syntax.
///
/// It is validated by the same code as the file (tests keep it valid,
/// complete and in step with `docs/configuration.md`), and the file is
/// layered over it key by key. Its one `[[route]]` is the catch-all used when
/// the file has no route, and lends its route-only keys (`path_prefix`,
/// `tenant_required`, `tenant_hash`) to file routes that leave them out; a
/// file route's `name` defaults to its own `path_prefix` instead.
const BUILTIN_DEFAULTS: &str = r#"
[server]
listen = "0.0.0.0:8080"
admin_listen = "127.0.0.1:9090"
max_request_body = "1MiB"
shutdown_grace = "35s"
header_read_timeout = "10s"
max_waiters = 1024

[upstream]
url = "http://127.0.0.1:3000"
connect_timeout = "2s"
timeout = "30s"

[store]
database_url = "postgres://idemproxy@127.0.0.1:5432/idemproxy"
pool_size = 16
timeout = "2s"
on_store_error = "reject"
response_cache = "16MiB"
response_cache_ttl = "60s"
prepared_statements = true

[sweeper]
interval = "60s"
batch_size = 1000
pause = "10ms"

[defaults]
key_header = "Idempotency-Key"
methods = ["POST", "PATCH"]
key = "optional"
lease = "10s"
retention = "24h"
max_key_length = 255
fingerprint = "json"
release_on = []
max_stored_response = "1MiB"
wait = "0s"
derived_key_header = ""
derived_key = "sha256"

[[route]]
name = "default"
path_prefix = "/"
tenant_required = false
tenant_hash = false
"#;

/// The built-in defaults as a typed [`Config`].
fn builtin_config() -> Result<Config, ConfigError> {
    let raw = deserialize(BUILTIN_DEFAULTS, BUILTIN_ORIGIN)?;
    let mut checker = Checker::new(BUILTIN_ORIGIN, BUILTIN_DEFAULTS);
    checker.problems.extend(raw.unknown_keys);
    let config = checker.validate(&raw.config, None, &Overrides::default());
    checker.finish(config)
}

// ---------------------------------------------------------------------------
// Raw structs: the TOML as written.
//
// Every field is an `Option` (absent: inherit) and every value that has rules
// is `Spanned`, so a problem can name its line. Integers are read as `i64`
// so that `pool_size = -1` is a rule problem collected with the others, not a
// serde type error that stops the parse.
//
// There is no `deny_unknown_fields`: it stops at the first unknown key, while
// `serde_ignored` (see `deserialize`) reports them all.

/// The whole file; every section is optional.
#[derive(Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    /// `[server]`: the listeners.
    server: RawServer,
    /// `[upstream]`: the legacy service behind the proxy.
    upstream: RawUpstream,
    /// `[store]`: the PostgreSQL that holds the records.
    store: RawStore,
    /// `[sweeper]`: the background deletion of expired records.
    sweeper: RawSweeper,
    /// `[defaults]`: the policy every route inherits.
    defaults: RawPolicy,
    /// `[[route]]`, in file order; none: one catch-all route.
    route: Vec<RawRoute>,
}

/// `[server]`.
#[derive(Default, Deserialize)]
#[serde(default)]
struct RawServer {
    /// Address of the proxy listener, `IP:port`.
    listen: Option<Spanned<String>>,
    /// Address of the admin listener (`/healthz`, `/readyz`, `/metrics`), `IP:port`; must differ from `listen`.
    admin_listen: Option<Spanned<String>>,
    /// Largest keyed request body (keyed bodies are buffered to be fingerprinted; larger ones get 413). Pass-through requests are streamed.
    max_request_body: Option<Spanned<String>>,
    /// How long in-flight requests may take to finish after SIGTERM.
    shutdown_grace: Option<Spanned<String>>,
    /// How long a client may take to send a request's headers; greater than 0.
    header_read_timeout: Option<Spanned<String>>,
    /// PEM file with the certificate chain (leaf first) of the proxy listener; with `tls_key_file`, the listener speaks TLS only (HTTP/1.1 and h2 by ALPN) and forwards `X-Forwarded-Proto: https`. Read at start.
    tls_cert_file: Option<Spanned<String>>,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1) of `tls_cert_file`; set both or neither.
    tls_key_file: Option<Spanned<String>>,
    /// Most duplicates that may wait for their in-flight originals at once (see `wait`); past it a duplicate gets 409 at once; at least 0.
    max_waiters: Option<Spanned<i64>>,
}

/// `[upstream]`.
#[derive(Default, Deserialize)]
#[serde(default)]
struct RawUpstream {
    /// Base URL of the upstream: absolute `http://` or `https://` with a host, optionally with a path prefix that is prepended to every forwarded path; no query, fragment or credentials.
    url: Option<Spanned<String>>,
    /// Bound on establishing a TCP connection to the upstream; greater than 0.
    connect_timeout: Option<Spanned<String>>,
    /// Bound on a whole upstream exchange (request sent to response headers); greater than 0.
    timeout: Option<Spanned<String>>,
    /// PEM file of CA certificates trusted for an `https://` upstream, in addition to the system store (`/etc/ssl/certs`, `SSL_CERT_FILE`); only with an `https://` URL. Read at start.
    ca_file: Option<Spanned<String>>,
}

/// `[store]`.
#[derive(Default, Deserialize)]
#[serde(default)]
struct RawStore {
    /// PostgreSQL URL (`postgres://` or `postgresql://`) or `key=value` connection string. A secret: never logged nor echoed in errors. `IDEMPROXY_DATABASE_URL` overrides it.
    database_url: Option<Spanned<String>>,
    /// Maximum number of pooled connections; at least 3 (one each for the claim and completion batch workers, and one that lease renewals, takeovers and reads can always get). A replica holds at most `pool_size` + 1 connections (the extra one listens for notifications).
    pool_size: Option<Spanned<i64>>,
    /// Bound on any one store operation, pool wait included; greater than 0.
    timeout: Option<Spanned<String>>,
    /// When the store fails: `"reject"` (503 + `Retry-After`, nothing forwarded) or `"pass_through"` (forward unprotected, loudly).
    on_store_error: Option<Spanned<String>>,
    /// PEM file of CA certificates that verify the database server's certificate under `sslmode=verify-ca`/`verify-full` (or `require`, which then verifies the chain, as libpq does); without it those modes use the system store. The URL's `sslrootcert` may name it instead. Read at start.
    ca_file: Option<Spanned<String>>,
    /// Memory for completed responses replayed without a database round trip (they are immutable until they expire); `"0"` turns the cache off. Bounds the cache, not the process.
    response_cache: Option<Spanned<String>>,
    /// Longest time a cached response is replayed without asking the database: an operator's `keys release --force` of a completed key reaches every replica within it; greater than 0.
    response_cache_ttl: Option<Spanned<String>>,
    /// Use named prepared statements, cached per connection (one round trip per operation either way). Set `false` behind a pooler in transaction or statement mode (PgBouncer before 1.21), which cannot keep a named statement between transactions.
    prepared_statements: Option<Spanned<bool>>,
    /// A direct (session-mode) URL used only for `LISTEN` and for migrations, which need a session; unset: `database_url`. Set it when `database_url` points at a pooler in transaction mode. A secret, like `database_url`.
    listen_url: Option<Spanned<String>>,
}

/// `[sweeper]` (an extension to DESIGN.md §3).
#[derive(Default, Deserialize)]
#[serde(default)]
struct RawSweeper {
    /// Pause between sweeper passes; greater than 0.
    interval: Option<Spanned<String>>,
    /// Rows deleted per statement (bounded batches keep transactions short); at least 1.
    batch_size: Option<Spanned<i64>>,
    /// Pause between the batches of a pass, which paces the deletion of a
    /// large backlog; 0 for none.
    pause: Option<Spanned<String>>,
}

/// Declares the policy keys once. They make up `[defaults]` and are repeated,
/// flat, in every `[[route]]`: serde's `flatten` would lose both the spans
/// and the unknown-key report, so the macro writes the fields out twice.
macro_rules! policy_keys {
    ($( $(#[doc = $doc:literal])* $key:ident: $ty:ty, )*) => {
        /// `[defaults]`: the idempotency policy every route inherits.
        #[derive(Default, Deserialize)]
        #[serde(default)]
        struct RawPolicy {
            $( $(#[doc = $doc])* $key: Option<Spanned<$ty>>, )*
        }

        /// One `[[route]]`: its own keys, plus any `[defaults]` key as an
        /// override.
        #[derive(Default, Deserialize)]
        #[serde(default)]
        struct RawRoute {
            /// Label used in metrics and logs; defaults to the route's `path_prefix`.
            name: Option<Spanned<String>>,
            /// Path prefix this route covers; starts with `/`. The first route whose prefix matches wins, so list specific prefixes first.
            path_prefix: Option<Spanned<String>>,
            /// Header that names the tenant; absent: every request is the empty tenant.
            tenant_header: Option<Spanned<String>>,
            /// A keyed request without the tenant header gets 400 (false: it is the empty tenant). Needs `tenant_header`.
            tenant_required: Option<Spanned<bool>>,
            /// Store `sha256:` and the hex SHA-256 of the tenant header value, never the value (for secrets such as `Authorization`); plain tenants may not start with `sha256:`, so the two kinds never meet. Needs `tenant_header`.
            tenant_hash: Option<Spanned<bool>>,
            $( $(#[doc = $doc])* $key: Option<Spanned<$ty>>, )*
        }

        impl RawRoute {
            /// The policy keys this route sets (the others are inherited).
            fn policy(&self) -> RawPolicy {
                RawPolicy { $( $key: self.$key.clone(), )* }
            }
        }
    };
}

policy_keys! {
    /// Header that carries the idempotency key.
    key_header: String,
    /// Methods that are keyed (uppercase HTTP method tokens); other methods pass through untouched.
    methods: Vec<Spanned<String>>,
    /// `"optional"`: a keyed request without the key passes through; `"required"`: it gets 400.
    key: String,
    /// How long a claim is owned without renewal (the owner renews it about every third of it); at least 100ms and shorter than `retention`.
    lease: String,
    /// How long a completed record is remembered (and replayed); longer than `lease`.
    retention: String,
    /// Longest accepted key, in bytes; 1 to 1024.
    max_key_length: i64,
    /// `"json"`: JSON bodies are canonicalised before hashing (other bodies hashed as bytes); `"bytes"`: bodies are always hashed as bytes.
    fingerprint: String,
    /// Upstream statuses (100 to 599) that release the claim instead of being stored, e.g. `[429, 503]`.
    release_on: Vec<Spanned<i64>>,
    /// Largest upstream response body that is stored for replay; a larger response is never replayed truncated.
    max_stored_response: String,
    /// How long a duplicate waits for an in-flight original before getting 409; `"0s"`: answer 409 at once.
    wait: String,
    /// Header in which a key derived from tenant and key is forwarded to the upstream (the client's key header is forwarded too, unchanged); `""`: none.
    derived_key_header: String,
    /// Form of the derived key: `"sha256"` (hex SHA-256 of tenant and key) or `"tenant_key"` (`tenant:key`, the stored tenant).
    derived_key: String,
}

// ---------------------------------------------------------------------------
// Deserialising, with unknown keys collected and located.

/// The raw file plus every key in it that no raw field took.
struct Deserialized {
    config: RawConfig,
    unknown_keys: Vec<Problem>,
}

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// Deserialises `text` into the raw structs, collecting every unknown key.
fn deserialize(text: &str, origin: &str) -> Result<Deserialized, ConfigError> {
    let mut unknown = Vec::new();
    let result = toml::Deserializer::parse(text).and_then(|de| {
        serde_ignored::deserialize(de, |path| {
            let mut segments = Vec::new();
            collect_segments(&path, &mut segments);
            unknown.push(segments);
        })
    });
    // Spans of keys come from a second, lossless parse; only needed when
    // something is wrong.
    let document = if unknown.is_empty() && result.is_ok() {
        None
    } else {
        document(text)
    };
    let mut problems: Vec<Problem> = unknown
        .iter()
        .map(|segments| Problem {
            origin: origin.to_string(),
            line: document
                .as_ref()
                .and_then(|doc| span_of(doc, segments))
                .map(|span| line_of(text, span.start)),
            key: dotted(segments),
            message: "unknown key (see docs/configuration.md for the valid keys)".to_string(),
        })
        .collect();
    match result {
        Ok(config) => Ok(Deserialized {
            config,
            unknown_keys: problems,
        }),
        Err(err) => {
            let span = err.span();
            let key = match (&document, &span) {
                (Some(doc), Some(span)) => {
                    let mut path = Vec::new();
                    path_at(doc, span.start, &mut path);
                    dotted(&path)
                }
                _ => String::new(),
            };
            problems.push(Problem {
                origin: origin.to_string(),
                line: span.map(|span| line_of(text, span.start)),
                key,
                message: err.message().to_string(),
            });
            Err(ConfigError::sorted(problems))
        }
    }
}

/// Flattens a `serde_ignored` path into key and index steps.
fn collect_segments(path: &serde_ignored::Path<'_>, out: &mut Vec<Segment>) {
    use serde_ignored::Path as P;
    match path {
        P::Root => {}
        P::Seq { parent, index } => {
            collect_segments(parent, out);
            out.push(Segment::Index(*index));
        }
        P::Map { parent, key } => {
            collect_segments(parent, out);
            out.push(Segment::Key(key.clone()));
        }
        P::Some { parent } | P::NewtypeStruct { parent } | P::NewtypeVariant { parent } => {
            collect_segments(parent, out);
        }
    }
}

/// `route[1].lease`; keys that are not bare TOML keys are quoted.
fn dotted(segments: &[Segment]) -> String {
    let mut out = String::new();
    for segment in segments {
        match segment {
            Segment::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                let bare = !key.is_empty()
                    && key
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                if bare {
                    out.push_str(key);
                } else {
                    let _ = write!(out, "{key:?}");
                }
            }
            Segment::Index(index) => {
                let _ = write!(out, "[{index}]");
            }
        }
    }
    out
}

/// The document with the span of every key and value.
fn document(text: &str) -> Option<DeValue<'_>> {
    DeTable::parse(text)
        .ok()
        .map(|table| DeValue::Table(table.into_inner()))
}

/// The span of the key (or array item) at `segments`.
fn span_of(document: &DeValue<'_>, segments: &[Segment]) -> Option<Range<usize>> {
    let mut value = document;
    let mut span = None;
    for segment in segments {
        match (segment, value) {
            (Segment::Key(wanted), DeValue::Table(table)) => {
                let (key, next) = table.iter().find(|(key, _)| key.get_ref() == wanted)?;
                span = Some(key.span());
                value = next.get_ref();
            }
            (Segment::Index(index), DeValue::Array(array)) => {
                let next = array.get(*index)?;
                span = Some(next.span());
                value = next.get_ref();
            }
            _ => return None,
        }
    }
    span
}

/// Fills `path` with the deepest key whose value covers `offset` (table
/// values only span their `[header]`, so every child is searched).
fn path_at(value: &DeValue<'_>, offset: usize, path: &mut Vec<Segment>) -> bool {
    let children: Vec<(Segment, &Spanned<DeValue<'_>>)> = match value {
        DeValue::Table(table) => table
            .iter()
            .map(|(key, child)| (Segment::Key(key.get_ref().to_string()), child))
            .collect(),
        DeValue::Array(array) => array
            .iter()
            .enumerate()
            .map(|(index, child)| (Segment::Index(index), child))
            .collect(),
        _ => return false,
    };
    for (segment, child) in children {
        path.push(segment);
        if path_at(child.get_ref(), offset, path) || child.span().contains(&offset) {
            return true;
        }
        path.pop();
    }
    false
}

/// The 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()
        .iter()
        .take(offset)
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

impl ConfigError {
    /// Problems in file order; those without a line (overrides) last.
    fn sorted(mut problems: Vec<Problem>) -> Self {
        problems.sort_by_key(|p| (p.line.is_none(), p.line));
        ConfigError { problems }
    }
}

// ---------------------------------------------------------------------------
// Validation: raw → typed, every problem collected.

/// Walks the raw structs of one text, collecting problems. Each check returns
/// `None` after recording why, so the typed value is only assembled (with
/// `?`) once every check has run.
struct Checker<'a> {
    origin: &'a str,
    text: &'a str,
    problems: Vec<Problem>,
}

impl<'a> Checker<'a> {
    fn new(origin: &'a str, text: &'a str) -> Self {
        Checker {
            origin,
            text,
            problems: Vec::new(),
        }
    }

    /// The result, or every problem found.
    fn finish(mut self, config: Option<Config>) -> Result<Config, ConfigError> {
        match config {
            Some(config) if self.problems.is_empty() => Ok(config),
            _ => {
                if self.problems.is_empty() {
                    // Only reachable if the built-in defaults miss a key.
                    self.report(
                        "",
                        None,
                        "incomplete configuration (a bug: a key has no default)",
                    );
                }
                Err(ConfigError::sorted(self.problems))
            }
        }
    }

    fn report(&mut self, key: &str, span: Option<Range<usize>>, message: impl Into<String>) {
        self.problems.push(Problem {
            origin: self.origin.to_string(),
            line: span.map(|span| line_of(self.text, span.start)),
            key: key.to_string(),
            message: message.into(),
        });
    }

    /// Records a problem with `value` and yields `None`.
    fn bad<T, U>(
        &mut self,
        key: &str,
        value: &Spanned<T>,
        message: impl Into<String>,
    ) -> Option<U> {
        self.report(key, Some(value.span()), message);
        None
    }

    /// The file's value, checked, if it is set; else the inherited one.
    fn get<T, U>(
        &mut self,
        key: &str,
        raw: &Option<Spanned<T>>,
        inherited: Option<U>,
        check: impl FnOnce(&mut Self, &str, &Spanned<T>) -> Option<U>,
    ) -> Option<U> {
        match raw {
            Some(value) => check(self, key, value),
            None => inherited,
        }
    }

    /// The typed configuration: `raw` layered over `base` (the built-in
    /// defaults; `None` while validating those), then the overrides.
    fn validate(
        &mut self,
        raw: &RawConfig,
        base: Option<&Config>,
        overrides: &Overrides,
    ) -> Option<Config> {
        let server = self.server(&raw.server, base.map(|b| &b.server), overrides);
        let upstream = self.upstream(&raw.upstream, base.map(|b| &b.upstream));
        let store = self.store(&raw.store, base.map(|b| &b.store), overrides);
        let sweeper = self.sweeper(&raw.sweeper, base.map(|b| &b.sweeper));
        // The built-in catch-all route carries the built-in policy and the
        // defaults of the route-only keys.
        let template = base.and_then(|b| b.routes.first());
        let defaults = self.policy("defaults", &raw.defaults, template.map(|t| &t.policy));
        let routes = self.routes(&raw.route, template, defaults.as_ref());
        Some(Config {
            server: server?,
            upstream: upstream?,
            store: store?,
            sweeper: sweeper?,
            routes: routes?,
        })
    }

    fn server(
        &mut self,
        raw: &RawServer,
        base: Option<&ServerConfig>,
        overrides: &Overrides,
    ) -> Option<ServerConfig> {
        let listen = match overrides.listen {
            Some(addr) => Some(addr),
            None => self.get(
                "server.listen",
                &raw.listen,
                base.map(|b| b.listen),
                Self::socket_addr,
            ),
        };
        let admin_listen = match overrides.admin_listen {
            Some(addr) => Some(addr),
            None => self.get(
                "server.admin_listen",
                &raw.admin_listen,
                base.map(|b| b.admin_listen),
                Self::socket_addr,
            ),
        };
        if let (Some(listen), Some(admin)) = (listen, admin_listen) {
            // Port 0 asks for any free port, so two of them do not collide.
            if listen == admin && listen.port() != 0 {
                let span = match overrides.admin_listen {
                    Some(_) => None,
                    None => raw.admin_listen.as_ref().map(Spanned::span),
                };
                self.report(
                    "server.admin_listen",
                    span,
                    format!("must differ from server.listen (both are {listen})"),
                );
            }
        }
        let max_request_body = self.get(
            "server.max_request_body",
            &raw.max_request_body,
            base.map(|b| b.max_request_body),
            Self::size,
        );
        let shutdown_grace = self.get(
            "server.shutdown_grace",
            &raw.shutdown_grace,
            base.map(|b| b.shutdown_grace),
            Self::duration,
        );
        let header_read_timeout = self.get(
            "server.header_read_timeout",
            &raw.header_read_timeout,
            base.map(|b| b.header_read_timeout),
            Self::positive_duration,
        );
        let max_waiters = self.get(
            "server.max_waiters",
            &raw.max_waiters,
            base.map(|b| b.max_waiters),
            |c, key, v| {
                c.int_in(key, v, 0..=1_000_000)
                    .and_then(|n| usize::try_from(n).ok())
            },
        );
        let tls = self.listener_tls(raw, base);
        Some(ServerConfig {
            listen: listen?,
            admin_listen: admin_listen?,
            max_request_body: max_request_body?,
            shutdown_grace: shutdown_grace?,
            header_read_timeout: header_read_timeout?,
            tls: tls?,
            max_waiters: max_waiters?,
        })
    }

    fn upstream(
        &mut self,
        raw: &RawUpstream,
        base: Option<&UpstreamConfig>,
    ) -> Option<UpstreamConfig> {
        let url = self.get(
            "upstream.url",
            &raw.url,
            base.map(|b| b.url.clone()),
            Self::upstream_url,
        );
        let connect_timeout = self.get(
            "upstream.connect_timeout",
            &raw.connect_timeout,
            base.map(|b| b.connect_timeout),
            Self::positive_duration,
        );
        let timeout = self.get(
            "upstream.timeout",
            &raw.timeout,
            base.map(|b| b.timeout),
            Self::positive_duration,
        );
        let ca_file =
            self.optional_path("upstream.ca_file", &raw.ca_file, base.map(|b| &b.ca_file));
        if let (Some(url), Some(v)) = (&url, &raw.ca_file) {
            if url.scheme() != Some(&http::uri::Scheme::HTTPS) {
                self.report(
                    "upstream.ca_file",
                    Some(v.span()),
                    "is only used with an https:// upstream.url",
                );
            }
        }
        Some(UpstreamConfig {
            url: url?,
            connect_timeout: connect_timeout?,
            ca_file: ca_file?,
            timeout: timeout?,
        })
    }

    fn store(
        &mut self,
        raw: &RawStore,
        base: Option<&StoreConfig>,
        overrides: &Overrides,
    ) -> Option<StoreConfig> {
        const KEY: &str = "store.database_url";
        let database_url = match &overrides.database_url {
            Some(url) => match check_database_url(url.expose()) {
                Ok(()) => Some(url.clone()),
                Err(message) => {
                    self.problems.push(Problem {
                        origin: OVERRIDE_ORIGIN.to_string(),
                        line: None,
                        key: KEY.to_string(),
                        message: message.to_string(),
                    });
                    None
                }
            },
            None => self.get(
                KEY,
                &raw.database_url,
                base.map(|b| b.database_url.clone()),
                |c, key, v| match check_database_url(v.get_ref()) {
                    Ok(()) => Some(Secret::new(v.get_ref().as_str())),
                    Err(message) => c.bad(key, v, message),
                },
            ),
        };
        let pool_size = self.get(
            "store.pool_size",
            &raw.pool_size,
            base.map(|b| b.pool_size),
            |c, key, v| {
                if *v.get_ref() < 3 {
                    return c.bad(
                        key,
                        v,
                        format!(
                            "must be at least 3, not {}: the claim and completion batch workers hold one connection each, and lease renewals need one they can always get",
                            v.get_ref()
                        ),
                    );
                }
                usize::try_from(*v.get_ref()).ok()
            },
        );
        let timeout = self.get(
            "store.timeout",
            &raw.timeout,
            base.map(|b| b.timeout),
            Self::positive_duration,
        );
        let on_store_error = self.get(
            "store.on_store_error",
            &raw.on_store_error,
            base.map(|b| b.on_store_error),
            |c, key, v| {
                c.choice(
                    key,
                    v,
                    &[
                        ("reject", OnStoreError::Reject),
                        ("pass_through", OnStoreError::PassThrough),
                    ],
                )
            },
        );
        let ca_file = self.optional_path("store.ca_file", &raw.ca_file, base.map(|b| &b.ca_file));
        let response_cache = self.get(
            "store.response_cache",
            &raw.response_cache,
            base.map(|b| b.response_cache),
            Self::size,
        );
        let response_cache_ttl = self.get(
            "store.response_cache_ttl",
            &raw.response_cache_ttl,
            base.map(|b| b.response_cache_ttl),
            Self::positive_duration,
        );
        let prepared_statements = self.get(
            "store.prepared_statements",
            &raw.prepared_statements,
            base.map(|b| b.prepared_statements),
            |_, _, v| Some(*v.get_ref()),
        );
        let listen_url = match &raw.listen_url {
            Some(v) => match check_database_url(v.get_ref()) {
                Ok(()) => Some(Some(Secret::new(v.get_ref().as_str()))),
                Err(message) => self.bad("store.listen_url", v, message),
            },
            None => Some(base.and_then(|b| b.listen_url.clone())),
        };
        Some(StoreConfig {
            prepared_statements: prepared_statements?,
            listen_url: listen_url?,
            response_cache: response_cache?,
            response_cache_ttl: response_cache_ttl?,
            database_url: database_url?,
            pool_size: pool_size?,
            timeout: timeout?,
            on_store_error: on_store_error?,
            ca_file: ca_file?,
        })
    }

    fn sweeper(&mut self, raw: &RawSweeper, base: Option<&SweeperConfig>) -> Option<SweeperConfig> {
        let interval = self.get(
            "sweeper.interval",
            &raw.interval,
            base.map(|b| b.interval),
            Self::positive_duration,
        );
        let batch_size = self.get(
            "sweeper.batch_size",
            &raw.batch_size,
            base.map(|b| b.batch_size),
            |c, key, v| {
                c.int_in(key, v, 1..=i64::from(u32::MAX))
                    .and_then(|n| u32::try_from(n).ok())
            },
        );
        let pause = self.get(
            "sweeper.pause",
            &raw.pause,
            base.map(|b| b.pause),
            Self::duration,
        );
        Some(SweeperConfig {
            interval: interval?,
            batch_size: batch_size?,
            pause: pause?,
        })
    }

    /// The policy at `at` (`defaults` or `route[i]`), layered over `base`.
    fn policy(&mut self, at: &str, raw: &RawPolicy, base: Option<&Policy>) -> Option<Policy> {
        let key = |name: &str| format!("{at}.{name}");
        let key_header = self.get(
            &key("key_header"),
            &raw.key_header,
            base.map(|b| b.key_header.clone()),
            Self::header_name,
        );
        let methods = self.get(
            &key("methods"),
            &raw.methods,
            base.map(|b| b.methods.clone()),
            Self::methods,
        );
        let requirement = self.get(&key("key"), &raw.key, base.map(|b| b.key), |c, key, v| {
            c.choice(
                key,
                v,
                &[
                    ("optional", KeyRequirement::Optional),
                    ("required", KeyRequirement::Required),
                ],
            )
        });
        let lease = self.get(
            &key("lease"),
            &raw.lease,
            base.map(|b| b.lease),
            Self::lease,
        );
        let retention = self.get(
            &key("retention"),
            &raw.retention,
            base.map(|b| b.retention),
            Self::positive_duration,
        );
        // Checked where either is set; an inherited pair was checked where it
        // was set.
        if let (Some(lease), Some(retention)) = (lease, retention) {
            if lease >= retention {
                let at_key = match (&raw.lease, &raw.retention) {
                    (Some(v), _) => Some(("lease", v.span())),
                    (None, Some(v)) => Some(("retention", v.span())),
                    (None, None) => None,
                };
                if let Some((name, span)) = at_key {
                    self.report(
                        &key(name),
                        Some(span),
                        format!(
                            "lease ({}) must be shorter than retention ({}): a record must outlive its claim",
                            humantime::format_duration(lease),
                            humantime::format_duration(retention)
                        ),
                    );
                }
            }
        }
        let max_key_length = self.get(
            &key("max_key_length"),
            &raw.max_key_length,
            base.map(|b| b.max_key_length),
            |c, key, v| {
                c.int_in(key, v, 1..=1024)
                    .and_then(|n| usize::try_from(n).ok())
            },
        );
        let fingerprint = self.get(
            &key("fingerprint"),
            &raw.fingerprint,
            base.map(|b| b.fingerprint),
            |c, key, v| {
                c.choice(
                    key,
                    v,
                    &[
                        ("json", FingerprintMode::Json),
                        ("bytes", FingerprintMode::Bytes),
                    ],
                )
            },
        );
        let release_on = self.get(
            &key("release_on"),
            &raw.release_on,
            base.map(|b| b.release_on.clone()),
            Self::statuses,
        );
        let max_stored_response = self.get(
            &key("max_stored_response"),
            &raw.max_stored_response,
            base.map(|b| b.max_stored_response),
            Self::size,
        );
        let wait = self.get(
            &key("wait"),
            &raw.wait,
            base.map(|b| b.wait),
            Self::duration,
        );
        let derived_key_header = self.get(
            &key("derived_key_header"),
            &raw.derived_key_header,
            base.map(|b| b.derived_key_header.clone()),
            |c, key, v| {
                if v.get_ref().is_empty() {
                    Some(None)
                } else {
                    c.header_name(key, v).map(Some)
                }
            },
        );
        let derived_key = self.get(
            &key("derived_key"),
            &raw.derived_key,
            base.map(|b| b.derived_key),
            |c, key, v| {
                c.choice(
                    key,
                    v,
                    &[
                        ("sha256", DerivedKey::Sha256),
                        ("tenant_key", DerivedKey::TenantKey),
                    ],
                )
            },
        );
        Some(Policy {
            derived_key_header: derived_key_header?,
            derived_key: derived_key?,
            key_header: key_header?,
            methods: methods?,
            key: requirement?,
            lease: lease?,
            retention: retention?,
            max_key_length: max_key_length?,
            fingerprint: fingerprint?,
            release_on: release_on?,
            max_stored_response: max_stored_response?,
            wait: wait?,
        })
    }

    /// The routes; none in the file: the catch-all with the `[defaults]`
    /// policy.
    fn routes(
        &mut self,
        raw: &[RawRoute],
        template: Option<&Route>,
        defaults: Option<&Policy>,
    ) -> Option<Vec<Route>> {
        if raw.is_empty() {
            let (template, defaults) = (template?, defaults?);
            return Some(vec![Route {
                policy: defaults.clone(),
                ..template.clone()
            }]);
        }
        let routes: Vec<Option<Route>> = raw
            .iter()
            .enumerate()
            .map(|(index, route)| self.route(index, route, template, defaults))
            .collect();
        self.check_route_order(raw, template);
        routes.into_iter().collect()
    }

    fn route(
        &mut self,
        index: usize,
        raw: &RawRoute,
        template: Option<&Route>,
        defaults: Option<&Policy>,
    ) -> Option<Route> {
        let at = format!("route[{index}]");
        let key = |name: &str| format!("{at}.{name}");
        let path_prefix = self.get(
            &key("path_prefix"),
            &raw.path_prefix,
            template.map(|t| t.path_prefix.clone()),
            Self::path_prefix,
        );
        let tenant_header = match &raw.tenant_header {
            Some(v) => self.header_name(&key("tenant_header"), v).map(Some),
            None => Some(template.and_then(|t| t.tenant_header.clone())),
        };
        let tenant_required = self.get(
            &key("tenant_required"),
            &raw.tenant_required,
            template.map(|t| t.tenant_required),
            |_, _, v| Some(*v.get_ref()),
        );
        let tenant_hash = self.get(
            &key("tenant_hash"),
            &raw.tenant_hash,
            template.map(|t| t.tenant_hash),
            |_, _, v| Some(*v.get_ref()),
        );
        if let Some(None) = tenant_header {
            for (name, flag) in [
                ("tenant_required", &raw.tenant_required),
                ("tenant_hash", &raw.tenant_hash),
            ] {
                if let Some(v) = flag.as_ref().filter(|v| *v.get_ref()) {
                    self.report(
                        &key(name),
                        Some(v.span()),
                        format!("{name} = true needs tenant_header: without it there is no tenant"),
                    );
                }
            }
        }
        let name = match &raw.name {
            Some(v) if v.get_ref().trim().is_empty() => {
                self.bad(&key("name"), v, "must not be empty")
            }
            Some(v) => Some(v.get_ref().clone()),
            None => path_prefix.clone(),
        };
        let policy = self.policy(&at, &raw.policy(), defaults);
        Some(Route {
            name: name?,
            path_prefix: path_prefix?,
            tenant_header: tenant_header?,
            tenant_required: tenant_required?,
            tenant_hash: tenant_hash?,
            policy: policy?,
        })
    }

    /// First match wins, so a route after a shorter prefix of its own is
    /// dead; and names label metrics, so explicit names must be unique.
    /// Works from the prefixes and names alone, so a route with other
    /// problems is still checked.
    fn check_route_order(&mut self, raw: &[RawRoute], template: Option<&Route>) {
        let prefixes: Vec<Option<&str>> = raw
            .iter()
            .map(|route| match &route.path_prefix {
                Some(v) => Some(v.get_ref().as_str()).filter(|p| p.starts_with('/')),
                None => template.map(|t| t.path_prefix.as_str()),
            })
            .collect();
        let names: Vec<Option<&str>> = raw
            .iter()
            .zip(&prefixes)
            .map(|(route, prefix)| match &route.name {
                Some(v) => Some(v.get_ref().as_str()),
                None => *prefix,
            })
            .collect();
        for (later, (route, prefix)) in raw.iter().zip(&prefixes).enumerate() {
            let shadowing =
                prefix.and_then(|prefix| {
                    prefixes.iter().take(later).enumerate().find_map(|(i, p)| {
                        p.filter(|p| prefix.starts_with(p)).map(|p| (i, p, prefix))
                    })
                });
            if let Some((earlier, earlier_prefix, prefix)) = shadowing {
                let span = match &route.path_prefix {
                    Some(v) => Some(v.span()),
                    None => self.route_span(later),
                };
                self.report(
                    &format!("route[{later}].path_prefix"),
                    span,
                    format!(
                        "unreachable: route[{earlier}] ({earlier_prefix:?}) comes first and matches every path {prefix:?} matches; list the more specific prefix first"
                    ),
                );
            }
            if let Some(name) = &route.name {
                let duplicate = names
                    .iter()
                    .take(later)
                    .position(|n| *n == Some(name.get_ref().as_str()));
                if let Some(earlier) = duplicate {
                    self.bad::<_, ()>(
                        &format!("route[{later}].name"),
                        name,
                        format!(
                            "duplicate route name {:?} (also route[{earlier}])",
                            name.get_ref()
                        ),
                    );
                }
            }
        }
    }

    /// The span of the `index`th `[[route]]` header.
    fn route_span(&self, index: usize) -> Option<Range<usize>> {
        let document = document(self.text)?;
        span_of(
            &document,
            &[Segment::Key("route".to_string()), Segment::Index(index)],
        )
    }

    /// `server.tls_cert_file` and `server.tls_key_file`: both or neither.
    fn listener_tls(
        &mut self,
        raw: &RawServer,
        base: Option<&ServerConfig>,
    ) -> Option<Option<crate::tls::TlsFiles>> {
        const CERT: &str = "server.tls_cert_file";
        const KEY: &str = "server.tls_key_file";
        match (&raw.tls_cert_file, &raw.tls_key_file) {
            (None, None) => Some(base.and_then(|b| b.tls.clone())),
            (Some(cert), Some(key)) => {
                let cert_file = self.path(CERT, cert);
                let key_file = self.path(KEY, key);
                Some(Some(crate::tls::TlsFiles {
                    cert_file: cert_file?,
                    key_file: key_file?,
                }))
            }
            (Some(v), None) => self.bad(
                CERT,
                v,
                "needs server.tls_key_file too: a TLS listener needs a certificate and its key",
            ),
            (None, Some(v)) => self.bad(
                KEY,
                v,
                "needs server.tls_cert_file too: a TLS listener needs a certificate and its key",
            ),
        }
    }

    /// An optional file path: the file's value if set, else the inherited
    /// one (which may be none).
    fn optional_path(
        &mut self,
        key: &str,
        raw: &Option<Spanned<String>>,
        inherited: Option<&Option<PathBuf>>,
    ) -> Option<Option<PathBuf>> {
        match raw {
            Some(v) => self.path(key, v).map(Some),
            None => Some(inherited.cloned().flatten()),
        }
    }

    // --- value rules ---------------------------------------------------

    fn path(&mut self, key: &str, v: &Spanned<String>) -> Option<PathBuf> {
        if v.get_ref().trim().is_empty() {
            self.bad(key, v, "must not be empty (leave the key out instead)")
        } else {
            Some(PathBuf::from(v.get_ref()))
        }
    }

    fn socket_addr(&mut self, key: &str, v: &Spanned<String>) -> Option<SocketAddr> {
        match v.get_ref().parse() {
            Ok(addr) => Some(addr),
            Err(_) => self.bad(
                key,
                v,
                format!(
                    "invalid socket address {:?}: expected IP:port, such as \"0.0.0.0:8080\" or \"[::1]:8080\"",
                    v.get_ref()
                ),
            ),
        }
    }

    fn duration(&mut self, key: &str, v: &Spanned<String>) -> Option<Duration> {
        match humantime::parse_duration(v.get_ref()) {
            Ok(duration) => Some(duration),
            Err(err) => self.bad(
                key,
                v,
                format!(
                    "invalid duration {:?}: {err} (expected e.g. \"250ms\", \"30s\", \"24h\")",
                    v.get_ref()
                ),
            ),
        }
    }

    fn positive_duration(&mut self, key: &str, v: &Spanned<String>) -> Option<Duration> {
        match self.duration(key, v)? {
            Duration::ZERO => self.bad(key, v, "must be greater than 0"),
            duration => Some(duration),
        }
    }

    fn lease(&mut self, key: &str, v: &Spanned<String>) -> Option<Duration> {
        const MIN: Duration = Duration::from_millis(100);
        match self.duration(key, v)? {
            lease if lease < MIN => self.bad(
                key,
                v,
                format!(
                    "must be at least 100ms, not {} (the owner renews its lease about every third of it)",
                    humantime::format_duration(lease)
                ),
            ),
            lease => Some(lease),
        }
    }

    fn size(&mut self, key: &str, v: &Spanned<String>) -> Option<u64> {
        match v.get_ref().parse::<ByteSize>() {
            Ok(size) => Some(size.as_u64()),
            Err(err) => self.bad(
                key,
                v,
                format!(
                    "invalid size {:?}: {err} (expected bytes such as \"1000\" or a number with a unit such as \"512KiB\", \"1MiB\")",
                    v.get_ref()
                ),
            ),
        }
    }

    fn int_in(&mut self, key: &str, v: &Spanned<i64>, range: RangeInclusive<i64>) -> Option<i64> {
        let n = *v.get_ref();
        if range.contains(&n) {
            Some(n)
        } else if *range.end() == i64::MAX {
            self.bad(
                key,
                v,
                format!("must be at least {}, not {n}", range.start()),
            )
        } else {
            self.bad(
                key,
                v,
                format!(
                    "must be between {} and {}, not {n}",
                    range.start(),
                    range.end()
                ),
            )
        }
    }

    fn choice<U: Copy>(
        &mut self,
        key: &str,
        v: &Spanned<String>,
        options: &[(&str, U)],
    ) -> Option<U> {
        match options.iter().find(|(name, _)| name == v.get_ref()) {
            Some((_, value)) => Some(*value),
            None => {
                let names: Vec<String> = options
                    .iter()
                    .map(|(name, _)| format!("{name:?}"))
                    .collect();
                self.bad(
                    key,
                    v,
                    format!("must be {}, not {:?}", names.join(" or "), v.get_ref()),
                )
            }
        }
    }

    fn header_name(&mut self, key: &str, v: &Spanned<String>) -> Option<HeaderName> {
        match HeaderName::from_bytes(v.get_ref().as_bytes()) {
            Ok(name) => Some(name),
            Err(_) => self.bad(key, v, format!("invalid header name {:?}", v.get_ref())),
        }
    }

    fn methods(&mut self, key: &str, v: &Spanned<Vec<Spanned<String>>>) -> Option<Vec<Method>> {
        let mut methods = Vec::new();
        let mut valid = true;
        for (index, item) in v.get_ref().iter().enumerate() {
            let text = item.get_ref();
            let item_key = format!("{key}[{index}]");
            match Method::from_bytes(text.as_bytes()) {
                // Methods are case-sensitive: "post" is a valid token, but
                // not POST, and surely not what was meant.
                Ok(_) if text.bytes().any(|b| b.is_ascii_lowercase()) => {
                    valid = false;
                    self.report(
                        &item_key,
                        Some(item.span()),
                        format!(
                            "methods are case-sensitive: {text:?} is not {:?}; write methods in uppercase",
                            text.to_ascii_uppercase()
                        ),
                    );
                }
                Ok(method) => methods.push(method),
                Err(_) => {
                    valid = false;
                    self.report(
                        &item_key,
                        Some(item.span()),
                        format!("invalid method {text:?}: expected an HTTP method token such as \"POST\""),
                    );
                }
            }
        }
        valid.then_some(methods)
    }

    fn statuses(&mut self, key: &str, v: &Spanned<Vec<Spanned<i64>>>) -> Option<Vec<StatusCode>> {
        let mut statuses = Vec::new();
        let mut valid = true;
        for (index, item) in v.get_ref().iter().enumerate() {
            let status = u16::try_from(*item.get_ref())
                .ok()
                .filter(|code| (100..=599).contains(code))
                .and_then(|code| StatusCode::from_u16(code).ok());
            match status {
                Some(status) => statuses.push(status),
                None => {
                    valid = false;
                    self.report(
                        &format!("{key}[{index}]"),
                        Some(item.span()),
                        format!(
                            "invalid HTTP status {}: expected 100 to 599",
                            item.get_ref()
                        ),
                    );
                }
            }
        }
        valid.then_some(statuses)
    }

    fn path_prefix(&mut self, key: &str, v: &Spanned<String>) -> Option<String> {
        if v.get_ref().starts_with('/') {
            Some(v.get_ref().clone())
        } else {
            self.bad(
                key,
                v,
                format!("must start with \"/\", not {:?}", v.get_ref()),
            )
        }
    }

    fn upstream_url(&mut self, key: &str, v: &Spanned<String>) -> Option<Uri> {
        let text = v.get_ref();
        let uri: Uri = match text.parse() {
            Ok(uri) => uri,
            // The text is not echoed if it might hold credentials.
            Err(err) if text.contains('@') => {
                return self.bad(key, v, format!("invalid URL: {err}"))
            }
            Err(err) => return self.bad(key, v, format!("invalid URL {text:?}: {err}")),
        };
        let Some(authority) = uri.authority() else {
            return self.bad(
                key,
                v,
                format!("must be an absolute http:// or https:// URL with a host, not {text:?}"),
            );
        };
        if authority.as_str().contains('@') {
            return self.bad(
                key,
                v,
                "must not contain credentials (user@host); the value is not shown",
            );
        }
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return self.bad(
                key,
                v,
                format!("must start with http:// or https://, not {text:?}"),
            );
        }
        let host = authority.host();
        if host.is_empty() {
            return self.bad(key, v, format!("has no host: {text:?}"));
        }
        let port_text = authority.as_str().strip_prefix(host).unwrap_or_default();
        if !port_text.is_empty() && authority.port_u16().is_none() {
            return self.bad(key, v, format!("has an invalid port: {text:?}"));
        }
        if uri.query().is_some() || text.contains('#') {
            return self.bad(
                key,
                v,
                format!("must not have a query or fragment: {text:?}"),
            );
        }
        Some(uri)
    }
}

/// The rules for the database URL. The messages never include the value: it
/// may hold a password.
fn check_database_url(url: &str) -> Result<(), &'static str> {
    let url = url.trim();
    if url.is_empty() {
        return Err("must not be empty");
    }
    match url.split_once("://") {
        Some(("postgres" | "postgresql", _)) => {}
        Some(_) => return Err("must be a postgres:// or postgresql:// URL (the value is not shown: it may contain a password)"),
        None if url.contains('=') => {}
        None => return Err(
            "must be a postgres:// or postgresql:// URL or a key=value connection string (the value is not shown: it may contain a password)",
        ),
    }
    // What `serve` will parse: check-config must not pass what serve rejects.
    match crate::store::tls::parse_url(url) {
        Ok(_) => Ok(()),
        Err(_) => Err("does not parse as a PostgreSQL connection string (bad port, host, option or sslmode?); the value is not shown: it may contain a password"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn database_url_that_the_driver_rejects_is_a_problem_without_echoing_it() {
        let overrides = Overrides {
            database_url: Some(Secret::new("postgres://u:pw@127.0.0.1:notaport/x")),
            ..Overrides::default()
        };
        let err = parse("", "t.toml", &overrides).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("store.database_url"), "{text}");
        assert!(!text.contains("pw@"), "{text}");
    }

    /// DESIGN.md §3's example with the documented deviation of the
    /// defaults: `shutdown_grace` is 35s, not 30s.
    fn deviating(design: &str) -> String {
        assert!(design.contains("shutdown_grace = \"30s\""));
        design.replace("shutdown_grace = \"30s\"", "shutdown_grace = \"35s\"")
    }

    /// DESIGN.md §3, verbatim.
    const DESIGN_EXAMPLE: &str = r#"[server]
listen = "0.0.0.0:8080"
admin_listen = "127.0.0.1:9090"      # /healthz, /readyz, /metrics
max_request_body = "1MiB"
shutdown_grace = "30s"

[upstream]
url = "http://127.0.0.1:3000"
connect_timeout = "2s"
timeout = "30s"

[store]
database_url = "postgres://idemproxy@127.0.0.1:5432/idemproxy"
pool_size = 16
timeout = "2s"                        # bound on any one store operation
on_store_error = "reject"             # or "pass_through"

[defaults]                            # every route inherits these
key_header = "Idempotency-Key"
methods = ["POST", "PATCH"]
key = "optional"                      # or "required"
lease = "10s"
retention = "24h"
max_key_length = 255
fingerprint = "json"                  # or "bytes"
release_on = []                       # e.g. [429, 503]
max_stored_response = "1MiB"
wait = "0s"                           # > 0: duplicates wait for the original

[[route]]
path_prefix = "/v1/payments"
tenant_header = "X-Tenant-ID"
tenant_required = true
lease = "30s"                         # any [defaults] key may be overridden

[[route]]
path_prefix = "/v1/"
tenant_header = "Authorization"
tenant_hash = true                    # store SHA-256 of the value, never the secret
"#;

    const MIB: u64 = 1024 * 1024;

    fn parse_ok(text: &str) -> Config {
        match parse(text, "test.toml", &Overrides::default()) {
            Ok(config) => config,
            Err(err) => panic!("expected a valid config, got:\n{err}"),
        }
    }

    fn problems(text: &str) -> Vec<Problem> {
        match parse(text, "test.toml", &Overrides::default()) {
            Ok(config) => panic!("expected problems, got {config:?}"),
            Err(err) => err.problems,
        }
    }

    fn problem<'a>(problems: &'a [Problem], key: &str) -> &'a Problem {
        problems
            .iter()
            .find(|p| p.key == key)
            .unwrap_or_else(|| panic!("no problem for {key} in {problems:#?}"))
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn design_example_parses_to_the_expected_values() {
        let config = parse_ok(DESIGN_EXAMPLE);
        assert_eq!(config.server.listen, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(
            config.server.admin_listen,
            "127.0.0.1:9090".parse().unwrap()
        );
        assert_eq!(config.server.max_request_body, MIB);
        assert_eq!(config.server.shutdown_grace, secs(30));
        assert_eq!(
            config.upstream.url,
            Uri::from_static("http://127.0.0.1:3000")
        );
        assert_eq!(config.upstream.connect_timeout, secs(2));
        assert_eq!(config.upstream.timeout, secs(30));
        assert_eq!(
            config.store.database_url.expose(),
            "postgres://idemproxy@127.0.0.1:5432/idemproxy"
        );
        assert_eq!(config.store.pool_size, 16);
        assert_eq!(config.store.timeout, secs(2));
        assert_eq!(config.store.on_store_error, OnStoreError::Reject);

        assert_eq!(config.routes.len(), 2);
        let payments = &config.routes[0];
        assert_eq!(payments.name, "/v1/payments");
        assert_eq!(payments.path_prefix, "/v1/payments");
        assert_eq!(
            payments.tenant_header,
            Some(HeaderName::from_static("x-tenant-id"))
        );
        assert!(payments.tenant_required);
        assert!(!payments.tenant_hash);
        assert_eq!(payments.policy.lease, secs(30));
        assert_eq!(payments.policy.retention, secs(24 * 3600));

        let v1 = &config.routes[1];
        assert_eq!(v1.path_prefix, "/v1/");
        assert_eq!(v1.tenant_header, Some(http::header::AUTHORIZATION));
        assert!(!v1.tenant_required);
        assert!(v1.tenant_hash);
        let policy = &v1.policy;
        assert_eq!(
            policy.key_header,
            HeaderName::from_static("idempotency-key")
        );
        assert_eq!(policy.methods, vec![Method::POST, Method::PATCH]);
        assert_eq!(policy.key, KeyRequirement::Optional);
        assert_eq!(policy.lease, secs(10));
        assert_eq!(policy.retention, secs(24 * 3600));
        assert_eq!(policy.max_key_length, 255);
        assert_eq!(policy.fingerprint, FingerprintMode::Json);
        assert!(policy.release_on.is_empty());
        assert_eq!(policy.max_stored_response, MIB);
        assert_eq!(policy.wait, Duration::ZERO);

        assert_eq!(
            config.route_for("/v1/payments/42").map(|r| r.name.as_str()),
            Some("/v1/payments")
        );
        assert_eq!(
            config.route_for("/v1/refunds").map(|r| r.name.as_str()),
            Some("/v1/")
        );
        assert!(config.route_for("/health").is_none());
    }

    #[test]
    fn the_defaults_drain_an_owned_request_within_the_grace() {
        assert_eq!(parse_ok("").warnings(), Vec::<String>::new());
    }

    #[test]
    fn a_grace_shorter_than_upstream_and_store_timeouts_is_warned_about() {
        let config = parse_ok("[server]\nshutdown_grace = \"10s\"\n");
        let warnings = config.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("server.shutdown_grace (10s)"),
            "{warnings:?}"
        );
        assert!(warnings[0].contains("(32s)"), "{warnings:?}");
    }

    #[test]
    fn pool_sizes_below_three_are_refused_with_the_reason() {
        for n in [1, 2] {
            let problems = problems(&format!("[store]\npool_size = {n}\n"));
            let p = problem(&problems, "store.pool_size");
            assert!(p.message.contains("must be at least 3"), "{}", p.message);
            assert!(p.message.contains("renewals"), "{}", p.message);
        }
        assert_eq!(parse_ok("[store]\npool_size = 3\n").store.pool_size, 3);
    }

    #[test]
    fn pooler_settings_default_to_prepared_statements_and_the_database_url() {
        let config = parse_ok("");
        assert!(config.store.prepared_statements);
        assert!(config.store.listen_url.is_none());
        let config = parse_ok(
            "[store]\nprepared_statements = false\nlisten_url = \"postgres://u:pw@db:5432/x\"\n",
        );
        assert!(!config.store.prepared_statements);
        assert_eq!(
            config.store.listen_url.as_ref().map(Secret::expose),
            Some("postgres://u:pw@db:5432/x")
        );
        assert!(!format!("{:?}", config.store).contains("pw@"));
        let problems = problems("[store]\nlisten_url = \"mysql://db/x\"\n");
        assert_eq!(problem(&problems, "store.listen_url").line, Some(2));
    }

    #[test]
    fn empty_file_is_valid_and_every_key_has_its_default() {
        let config = parse_ok("");
        assert_eq!(config.server.listen, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(
            config.server.admin_listen,
            "127.0.0.1:9090".parse().unwrap()
        );
        assert_eq!(config.server.max_request_body, MIB);
        assert_eq!(config.server.shutdown_grace, secs(35));
        assert_eq!(config.server.header_read_timeout, secs(10));
        assert_eq!(
            config.upstream.url,
            Uri::from_static("http://127.0.0.1:3000")
        );
        assert_eq!(config.upstream.connect_timeout, secs(2));
        assert_eq!(config.upstream.timeout, secs(30));
        assert_eq!(
            config.store.database_url.expose(),
            "postgres://idemproxy@127.0.0.1:5432/idemproxy"
        );
        assert_eq!(config.store.pool_size, 16);
        assert_eq!(config.store.timeout, secs(2));
        assert_eq!(config.store.on_store_error, OnStoreError::Reject);
        assert_eq!(config.sweeper.interval, secs(60));
        assert_eq!(config.sweeper.batch_size, 1000);
        assert_eq!(config.sweeper.pause, Duration::from_millis(10));
        let policy = &config.routes[0].policy;
        assert_eq!(
            policy.key_header,
            HeaderName::from_static("idempotency-key")
        );
        assert_eq!(policy.methods, vec![Method::POST, Method::PATCH]);
        assert_eq!(policy.key, KeyRequirement::Optional);
        assert_eq!(policy.lease, secs(10));
        assert_eq!(policy.retention, secs(24 * 3600));
        assert_eq!(policy.max_key_length, 255);
        assert_eq!(policy.fingerprint, FingerprintMode::Json);
        assert!(policy.release_on.is_empty());
        assert_eq!(policy.max_stored_response, MIB);
        assert_eq!(policy.wait, Duration::ZERO);
        // Empty sections are as good as absent ones.
        let sections = "[server]\n[upstream]\n[store]\n[sweeper]\n[defaults]\n";
        assert_eq!(format!("{:?}", parse_ok(sections)), format!("{config:?}"));
    }

    #[test]
    fn builtin_defaults_are_the_design_example_without_routes() {
        let Some((without_routes, _)) = DESIGN_EXAMPLE.split_once("[[route]]") else {
            panic!("the example has routes");
        };
        // One deliberate deviation (docs/configuration.md): the grace
        // covers upstream.timeout + store.timeout, 30s + 2s.
        let without_routes = deviating(without_routes);
        assert_eq!(
            format!("{:?}", parse_ok(&without_routes)),
            format!("{:?}", parse_ok(""))
        );
    }

    #[test]
    fn no_route_means_one_catch_all_route_with_the_defaults_policy() {
        let config = parse_ok("[defaults]\nkey = \"required\"\nlease = \"3s\"\n");
        assert_eq!(config.routes.len(), 1);
        let route = &config.routes[0];
        assert_eq!(route.name, "default");
        assert_eq!(route.path_prefix, "/");
        assert_eq!(route.tenant_header, None);
        assert!(!route.tenant_required);
        assert!(!route.tenant_hash);
        assert_eq!(route.policy.key, KeyRequirement::Required);
        assert_eq!(route.policy.lease, secs(3));
        assert_eq!(
            config.route_for("/anything").map(|r| r.name.as_str()),
            Some("default")
        );
    }

    #[test]
    fn route_inherits_the_defaults_and_overrides_one_key() {
        let config = parse_ok(
            "[defaults]\nmethods = [\"POST\"]\nwait = \"2s\"\nrelease_on = [429]\n\n\
             [[route]]\npath_prefix = \"/a\"\nwait = \"5s\"\n\n\
             [[route]]\npath_prefix = \"/b\"\n",
        );
        let (a, b) = (&config.routes[0].policy, &config.routes[1].policy);
        assert_eq!(a.wait, secs(5));
        assert_eq!(b.wait, secs(2));
        for policy in [a, b] {
            assert_eq!(policy.methods, vec![Method::POST]);
            assert_eq!(policy.release_on, vec![StatusCode::TOO_MANY_REQUESTS]);
            assert_eq!(policy.lease, secs(10));
        }
    }

    #[test]
    fn route_name_defaults_to_its_path_prefix_and_path_prefix_to_slash() {
        let config = parse_ok(
            "[[route]]\nname = \"payments\"\npath_prefix = \"/pay\"\n\
             [[route]]\npath_prefix = \"/v1/\"\n\
             [[route]]\ntenant_header = \"X-Tenant\"\n",
        );
        let names: Vec<&str> = config.routes.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["payments", "/v1/", "/"]);
        assert_eq!(config.routes[2].path_prefix, "/");
    }

    #[test]
    fn unknown_keys_in_several_sections_are_reported_together_with_their_lines() {
        let text = "\
[server]
listen = \"0.0.0.0:8080\"
lisen = \"0.0.0.0:8081\"

[store]
pool = 3

[[route]]
path_prefix = \"/a\"

[[route]]
path_prefix = \"/b\"
leese = \"1s\"

[extra]
x = 1
";
        let problems = problems(text);
        let expected = [
            ("server.lisen", 3),
            ("store.pool", 6),
            ("route[1].leese", 13),
            ("extra", 15),
        ];
        assert_eq!(problems.len(), expected.len(), "{problems:#?}");
        for (key, line) in expected {
            let p = problem(&problems, key);
            assert_eq!(p.line, Some(line), "{p:?}");
            assert!(p.message.contains("unknown key"), "{p:?}");
            assert_eq!(p.origin, "test.toml");
        }
        // In file order.
        let lines: Vec<_> = problems.iter().map(|p| p.line).collect();
        assert!(lines.windows(2).all(|w| w[0] <= w[1]), "{lines:?}");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_reported_together() {
        let problems = problems("[server]\nbogus = 1\nshutdown_grace = \"soon\"\n");
        assert_eq!(problem(&problems, "server.bogus").line, Some(2));
        assert_eq!(problem(&problems, "server.shutdown_grace").line, Some(3));
    }

    #[test]
    fn every_bad_value_is_reported_together() {
        let text = "\
[server]
listen = \"localhost\"
admin_listen = \"127.0.0.1:99999\"
max_request_body = \"1 parsec\"
shutdown_grace = \"10 parsecs\"
header_read_timeout = \"0s\"

[upstream]
url = \"ftp://example.com\"
connect_timeout = \"0ms\"
timeout = \"forever\"

[store]
database_url = \"mysql://root@db/app\"
pool_size = 2
timeout = \"0s\"
on_store_error = \"ignore\"

[sweeper]
interval = \"0s\"
batch_size = -5

[defaults]
key_header = \"Idempotency Key\"
methods = [\"post\", \"GET\", \"BAD METHOD\"]
key = \"sometimes\"
lease = \"50ms\"
max_key_length = 2000
fingerprint = \"xml\"
release_on = [429, 99, 600]
max_stored_response = \"lots\"
wait = \"-1s\"

[[route]]
path_prefix = \"v1\"
tenant_header = \"X Tenant\"
retention = \"0s\"
";
        let problems = problems(text);
        let expected = [
            ("server.listen", 2),
            ("server.admin_listen", 3),
            ("server.max_request_body", 4),
            ("server.shutdown_grace", 5),
            ("server.header_read_timeout", 6),
            ("upstream.url", 9),
            ("upstream.connect_timeout", 10),
            ("upstream.timeout", 11),
            ("store.database_url", 14),
            ("store.pool_size", 15),
            ("store.timeout", 16),
            ("store.on_store_error", 17),
            ("sweeper.interval", 20),
            ("sweeper.batch_size", 21),
            ("defaults.key_header", 24),
            ("defaults.methods[0]", 25),
            ("defaults.methods[2]", 25),
            ("defaults.key", 26),
            ("defaults.lease", 27),
            ("defaults.max_key_length", 28),
            ("defaults.fingerprint", 29),
            ("defaults.release_on[1]", 30),
            ("defaults.release_on[2]", 30),
            ("defaults.max_stored_response", 31),
            ("defaults.wait", 32),
            ("route[0].path_prefix", 35),
            ("route[0].tenant_header", 36),
            ("route[0].retention", 37),
        ];
        for (key, line) in expected {
            assert_eq!(problem(&problems, key).line, Some(line), "{key}");
        }
        assert_eq!(problems.len(), expected.len(), "{problems:#?}");
        let shutdown = problem(&problems, "server.shutdown_grace");
        assert!(
            shutdown.to_string().starts_with(
                "test.toml:5: server.shutdown_grace: invalid duration \"10 parsecs\": "
            ),
            "{shutdown}"
        );
        assert!(problem(&problems, "defaults.methods[0]")
            .message
            .contains("\"POST\""));
    }

    #[test]
    fn a_wrong_toml_type_is_reported_with_its_line_and_key() {
        let problems = problems("[server]\nlisten = \"0.0.0.0:1\"\n\n[store]\npool_size = \"x\"\n");
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert_eq!(problems[0].line, Some(5));
        assert_eq!(problems[0].key, "store.pool_size");

        let problems = self::problems("[[route]]\npath_prefix = \"/\"\n[[route]]\nlease = 10\n");
        assert_eq!(problems[0].line, Some(4));
        assert_eq!(problems[0].key, "route[1].lease");
    }

    #[test]
    fn a_syntax_error_is_reported_with_its_line() {
        let problems = problems("[server]\nlisten = \"0.0.0.0:1\n");
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert_eq!(problems[0].line, Some(2));
    }

    #[test]
    fn lease_not_shorter_than_retention_is_rejected() {
        let p = problems("[defaults]\nlease = \"1h\"\nretention = \"1h\"\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].key, "defaults.lease");
        assert_eq!(p[0].line, Some(2));

        // Against an inherited retention, reported on the route's own key.
        let p = problems("[defaults]\nretention = \"1m\"\n[[route]]\nlease = \"2m\"\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].key, "route[0].lease");
        assert_eq!(p[0].line, Some(4));

        let p = problems("[[route]]\nretention = \"5s\"\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].key, "route[0].retention");

        parse_ok("[defaults]\nlease = \"59s\"\nretention = \"1m\"\n");
    }

    #[test]
    fn lease_below_100ms_is_rejected() {
        let p = problems("[defaults]\nlease = \"99ms\"\n");
        assert_eq!(p[0].key, "defaults.lease");
        parse_ok("[defaults]\nlease = \"100ms\"\n");
    }

    #[test]
    fn tenant_rules_without_a_tenant_header_are_rejected() {
        let p = problems(
            "[[route]]\npath_prefix = \"/\"\ntenant_required = true\ntenant_hash = true\n",
        );
        assert_eq!(problem(&p, "route[0].tenant_required").line, Some(3));
        assert_eq!(problem(&p, "route[0].tenant_hash").line, Some(4));
        assert_eq!(p.len(), 2);
        parse_ok("[[route]]\npath_prefix = \"/\"\ntenant_required = false\n");
    }

    #[test]
    fn a_route_behind_a_shorter_prefix_is_unreachable() {
        let p = problems(
            "[[route]]\npath_prefix = \"/v1/\"\n[[route]]\npath_prefix = \"/v1/payments\"\n",
        );
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].key, "route[1].path_prefix");
        assert_eq!(p[0].line, Some(4));
        assert!(p[0].message.contains("route[0]"));

        // Checked even when the route has other problems.
        let p = problems(
            "[[route]]\npath_prefix = \"/v1/\"\n[[route]]\npath_prefix = \"/v1/x\"\nlease = \"soon\"\n",
        );
        assert_eq!(problem(&p, "route[1].path_prefix").line, Some(4));
        assert_eq!(problem(&p, "route[1].lease").line, Some(5));

        // Without a path_prefix of its own, the [[route]] header is named.
        let p = problems("[[route]]\npath_prefix = \"/\"\n\n[[route]]\nlease = \"5s\"\n");
        assert_eq!(p[0].key, "route[1].path_prefix");
        assert_eq!(p[0].line, Some(4));
    }

    #[test]
    fn explicit_route_names_are_unique() {
        let p = problems("[[route]]\nname = \"x\"\npath_prefix = \"/a\"\n[[route]]\nname = \"x\"\npath_prefix = \"/b\"\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].key, "route[1].name");
        assert_eq!(p[0].line, Some(5));
    }

    #[test]
    fn listen_and_admin_listen_must_differ_unless_port_zero() {
        let p =
            problems("[server]\nlisten = \"127.0.0.1:9000\"\nadmin_listen = \"127.0.0.1:9000\"\n");
        assert_eq!(p[0].key, "server.admin_listen");
        parse_ok("[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n");
    }

    #[test]
    fn upstream_url_must_be_absolute_http_with_a_host_and_no_query() {
        for bad in [
            "127.0.0.1:3000",
            "/relative",
            "ftp://host",
            "http://host/?q=1",
            "http://host/#frag",
            "http://host:99999",
            "http://",
        ] {
            let p = problems(&format!("[upstream]\nurl = {bad:?}\n"));
            assert_eq!(p.len(), 1, "{bad}: {p:#?}");
            assert_eq!(p[0].key, "upstream.url", "{bad}");
        }
        let p = problems("[upstream]\nurl = \"http://user:hunter2@host\"\n");
        assert!(!p[0].message.contains("hunter2"), "{p:?}");
        let config = parse_ok("[upstream]\nurl = \"https://legacy.internal:8443/api\"\n");
        assert_eq!(config.upstream.url.path(), "/api");
    }

    #[test]
    fn database_url_accepts_postgres_urls_and_conninfo_strings() {
        for good in [
            "postgres://u@h/db",
            "postgresql://u:p@h:5432/db?sslmode=require",
            "host=db user=app dbname=app",
        ] {
            let config = parse_ok(&format!("[store]\ndatabase_url = {good:?}\n"));
            assert_eq!(config.store.database_url.expose(), good);
        }
        for bad in ["", "  ", "mysql://u@h/db", "db.internal:5432"] {
            let p = problems(&format!("[store]\ndatabase_url = {bad:?}\n"));
            assert_eq!(p[0].key, "store.database_url", "{bad:?}");
        }
    }

    #[test]
    fn the_database_url_never_shows_in_debug_display_or_problems() {
        const PASSWORD: &str = "s3cr3t-pa55";
        let url = format!("postgres://app:{PASSWORD}@db:5432/app");
        let secret = Secret::new(url.as_str());
        assert!(!format!("{secret:?}").contains(PASSWORD));
        assert!(!format!("{secret}").contains(PASSWORD));

        let config = parse_ok(&format!("[store]\ndatabase_url = {url:?}\n"));
        assert_eq!(config.store.database_url.expose(), url);
        assert!(!format!("{config:?}").contains(PASSWORD));
        assert!(!format!("{:?}", config.store).contains(PASSWORD));

        // Invalid, from the file: reported, never echoed.
        let bad = format!("mysql://app:{PASSWORD}@db/app");
        let err = parse(
            &format!("[store]\ndatabase_url = {bad:?}\n"),
            "t.toml",
            &Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(err.problems[0].key, "store.database_url");
        assert!(!err.to_string().contains(PASSWORD), "{err}");
        assert!(!format!("{err:?}").contains(PASSWORD), "{err:?}");

        // Invalid, from the environment: reported, never echoed.
        let overrides = Overrides {
            database_url: Some(Secret::new(format!("app:{PASSWORD}@db"))),
            ..Overrides::default()
        };
        let err = parse("", "t.toml", &overrides).unwrap_err();
        assert_eq!(err.problems[0].origin, OVERRIDE_ORIGIN);
        assert_eq!(err.problems[0].key, "store.database_url");
        assert!(!err.to_string().contains(PASSWORD), "{err}");
    }

    #[test]
    fn environment_overrides_the_file_and_flags_override_both() {
        let file = "[server]\nlisten = \"127.0.0.1:1000\"\nadmin_listen = \"127.0.0.1:1001\"\n\
                    [store]\ndatabase_url = \"postgres://file@h/db\"\n";
        let env = env_overrides(|name| {
            (name == DATABASE_URL_ENV).then(|| "postgres://env@h/db".to_string())
        });
        let flags = Overrides {
            listen: Some("127.0.0.1:2000".parse().unwrap()),
            ..Overrides::default()
        };

        let from_file = parse(file, "t.toml", &Overrides::default()).unwrap();
        assert_eq!(
            from_file.store.database_url.expose(),
            "postgres://file@h/db"
        );

        let with_env = parse(file, "t.toml", &env).unwrap();
        assert_eq!(with_env.store.database_url.expose(), "postgres://env@h/db");
        assert_eq!(with_env.server.listen, "127.0.0.1:1000".parse().unwrap());

        let with_both = parse(file, "t.toml", &Overrides::merge(env.clone(), flags)).unwrap();
        assert_eq!(with_both.store.database_url.expose(), "postgres://env@h/db");
        assert_eq!(with_both.server.listen, "127.0.0.1:2000".parse().unwrap());
        assert_eq!(
            with_both.server.admin_listen,
            "127.0.0.1:1001".parse().unwrap()
        );

        let flag_url = Overrides {
            database_url: Some(Secret::new("postgres://flag@h/db")),
            ..Overrides::default()
        };
        let flags_win = parse(file, "t.toml", &Overrides::merge(env, flag_url)).unwrap();
        assert_eq!(
            flags_win.store.database_url.expose(),
            "postgres://flag@h/db"
        );
    }

    #[test]
    fn an_overridden_key_is_not_checked_in_the_file() {
        let overrides = Overrides {
            listen: Some("127.0.0.1:2000".parse().unwrap()),
            database_url: Some(Secret::new("postgres://env@h/db")),
            ..Overrides::default()
        };
        let config = parse(
            "[server]\nlisten = \"nonsense\"\n[store]\ndatabase_url = \"\"\n",
            "t.toml",
            &overrides,
        )
        .unwrap();
        assert_eq!(config.server.listen, "127.0.0.1:2000".parse().unwrap());
    }

    #[test]
    fn merge_takes_the_later_value_per_field() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let earlier = Overrides {
            database_url: Some(Secret::new("postgres://earlier@h/db")),
            listen: Some(a),
            admin_listen: Some(a),
        };
        let later = Overrides {
            listen: Some(b),
            ..Overrides::default()
        };
        let merged = Overrides::merge(earlier, later);
        assert_eq!(merged.listen, Some(b));
        assert_eq!(merged.admin_listen, Some(a));
        assert_eq!(
            merged.database_url.unwrap().expose(),
            "postgres://earlier@h/db"
        );
    }

    #[test]
    fn env_overrides_reads_the_database_url_variable_only() {
        let seen = std::cell::RefCell::new(Vec::new());
        let overrides = env_overrides(|name| {
            seen.borrow_mut().push(name.to_string());
            Some("postgres://env@h/db".to_string())
        });
        assert_eq!(seen.into_inner(), [DATABASE_URL_ENV]);
        assert_eq!(
            overrides.database_url.unwrap().expose(),
            "postgres://env@h/db"
        );
        assert!(overrides.listen.is_none());
        assert!(env_overrides(|_| None).database_url.is_none());
        // Set but empty still overrides, and fails loudly.
        let empty = env_overrides(|_| Some(String::new()));
        let err = parse("", "t.toml", &empty).unwrap_err();
        assert_eq!(err.problems[0].key, "store.database_url");
    }

    #[test]
    fn problems_display_file_line_key_and_message() {
        let problem = Problem {
            origin: "example.toml".into(),
            line: Some(12),
            key: "route[1].lease".into(),
            message: "invalid duration \"10 parsecs\"".into(),
        };
        assert_eq!(
            problem.to_string(),
            "example.toml:12: route[1].lease: invalid duration \"10 parsecs\""
        );
        let no_line = Problem {
            line: None,
            key: String::new(),
            ..problem.clone()
        };
        assert_eq!(
            no_line.to_string(),
            "example.toml: invalid duration \"10 parsecs\""
        );
        let err = ConfigError {
            problems: vec![problem, no_line],
        };
        assert_eq!(err.to_string().lines().count(), 2);
    }

    #[test]
    fn load_reads_the_file_and_reports_a_missing_one() {
        let missing = Path::new("/nonexistent/idemproxy/config.toml");
        let err = load(missing, &Overrides::default()).unwrap_err();
        assert_eq!(err.problems.len(), 1);
        assert_eq!(err.problems[0].origin, missing.display().to_string());

        let path =
            std::env::temp_dir().join(format!("idemproxy-config-test-{}.toml", std::process::id()));
        std::fs::write(&path, "[server]\nlisten = \"127.0.0.1:7000\"\nbogus = 1\n").unwrap();
        let err = load(&path, &Overrides::default()).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(err.problems[0].origin, path.display().to_string());
        assert_eq!(err.problems[0].line, Some(3));
    }

    #[test]
    fn shipped_config_files_parse() {
        let example = parse(
            include_str!("../config/example.toml"),
            "example.toml",
            &Overrides::default(),
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(
            format!("{:?}", example),
            format!("{:?}", parse_ok(&deviating(DESIGN_EXAMPLE)))
        );

        let dev = parse(
            include_str!("../config/dev.toml"),
            "dev.toml",
            &Overrides::default(),
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(dev.server.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(dev.server.admin_listen, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(dev.upstream.url, Uri::from_static("http://127.0.0.1:3000"));
        assert_eq!(
            dev.store.database_url.expose(),
            "postgres://postgres@127.0.0.1:5432/idemproxy"
        );
        assert_eq!(dev.routes.len(), 1);
        assert_eq!(dev.routes[0].path_prefix, "/");
        assert_eq!(dev.routes[0].policy.lease, secs(5));
    }

    // --- the reference in docs/configuration.md ------------------------

    /// The field names of `T`, straight from its derived `Deserialize`.
    fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
        #[derive(Debug)]
        struct Fields(&'static [&'static str]);
        impl fmt::Display for Fields {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:?}", self.0)
            }
        }
        impl std::error::Error for Fields {}
        impl serde::de::Error for Fields {
            fn custom<M: fmt::Display>(_: M) -> Self {
                Fields(&[])
            }
        }
        struct Probe;
        impl<'de> serde::Deserializer<'de> for Probe {
            type Error = Fields;
            fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Fields> {
                Err(Fields(&[]))
            }
            fn deserialize_struct<V: serde::de::Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Fields> {
                Err(Fields(fields))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
                bytes byte_buf option unit unit_struct newtype_struct seq tuple
                tuple_struct map enum identifier ignored_any
            }
        }
        match T::deserialize(Probe) {
            Err(Fields(fields)) => fields,
            Ok(_) => &[],
        }
    }

    /// Every `(section, key)` of the file, derived from the raw structs.
    /// Route keys are its own; its `[defaults]` keys are documented once.
    fn every_key() -> Vec<(&'static str, &'static str)> {
        let route_only: Vec<&str> = fields_of::<RawRoute>()
            .iter()
            .copied()
            .filter(|key| !fields_of::<RawPolicy>().contains(key))
            .collect();
        let sections: Vec<(&str, Vec<&str>)> = vec![
            ("server", fields_of::<RawServer>().to_vec()),
            ("upstream", fields_of::<RawUpstream>().to_vec()),
            ("store", fields_of::<RawStore>().to_vec()),
            ("sweeper", fields_of::<RawSweeper>().to_vec()),
            ("defaults", fields_of::<RawPolicy>().to_vec()),
            ("route", route_only),
        ];
        let mut names: Vec<&str> = sections.iter().map(|(s, _)| *s).collect();
        let mut top: Vec<&str> = fields_of::<RawConfig>().to_vec();
        names.sort_unstable();
        top.sort_unstable();
        assert_eq!(names, top, "a section is missing from every_key()");
        for policy_key in fields_of::<RawPolicy>() {
            assert!(
                fields_of::<RawRoute>().contains(policy_key),
                "route misses {policy_key}"
            );
        }
        sections
            .into_iter()
            .flat_map(|(section, keys)| keys.into_iter().map(move |key| (section, key)))
            .collect()
    }

    /// `(section, key, default cell)` of every row of the reference tables.
    fn doc_rows() -> Vec<(String, String, String)> {
        include_str!("../docs/configuration.md")
            .lines()
            .filter(|line| line.starts_with('|'))
            .filter_map(|line| {
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                let section = cells
                    .get(1)?
                    .trim_matches(|c| c == '`' || c == '[' || c == ']');
                let key = cells.get(2)?.trim_matches('`');
                Some((
                    section.to_string(),
                    key.to_string(),
                    cells.get(4)?.to_string(),
                ))
            })
            .collect()
    }

    #[test]
    fn sweeper_pause_is_a_duration_and_zero_means_none() {
        let config = parse(
            "[sweeper]\npause = \"20ms\"\n",
            "p.toml",
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(config.sweeper.pause, Duration::from_millis(20));
        let config = parse(
            "[sweeper]\npause = \"0s\"\n",
            "p.toml",
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(config.sweeper.pause, Duration::ZERO);
        let err = parse(
            "[sweeper]\npause = \"soon\"\n",
            "p.toml",
            &Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert_eq!(err.problems[0].key, "sweeper.pause");
        assert_eq!(err.problems[0].line, Some(2));
    }

    #[test]
    fn raw_structs_have_the_expected_keys() {
        let keys = every_key();
        assert!(keys.contains(&("server", "header_read_timeout")));
        assert!(keys.contains(&("sweeper", "batch_size")));
        assert!(keys.contains(&("route", "name")));
        assert!(keys.contains(&("defaults", "wait")));
        assert_eq!(keys.len(), 8 + 4 + 9 + 3 + 12 + 5);
    }

    #[test]
    fn builtin_defaults_set_every_key_but_the_optional_ones() {
        let builtin: toml::Table = toml::from_str(BUILTIN_DEFAULTS).unwrap();
        for (section, key) in every_key() {
            let table = match &builtin[section] {
                toml::Value::Array(routes) => &routes[0],
                table => table,
            };
            let optional = matches!(
                (section, key),
                ("route", "tenant_header")
                    | ("server", "tls_cert_file" | "tls_key_file")
                    | ("upstream" | "store", "ca_file")
                    | ("store", "listen_url")
            );
            assert_eq!(table.get(key).is_some(), !optional, "{section}.{key}");
        }
    }

    #[test]
    fn docs_describe_every_key_with_its_default() {
        let rows = doc_rows();
        let builtin: toml::Table = toml::from_str(BUILTIN_DEFAULTS).unwrap();
        for (section, key) in every_key() {
            let row = rows
                .iter()
                .find(|(s, k, _)| s == section && k == key)
                .unwrap_or_else(|| panic!("docs/configuration.md has no row for {section}.{key}"));
            let table = match &builtin[section] {
                toml::Value::Array(routes) => &routes[0],
                table => table,
            };
            // A route's name defaults to its path_prefix, not to the
            // catch-all's name.
            if let (Some(default), false) = (table.get(key), (section, key) == ("route", "name")) {
                let shown = format!("`{default}`");
                assert!(
                    row.2.contains(&shown),
                    "{section}.{key}: default {shown} not in {:?}",
                    row.2
                );
            }
        }
        // And no row documents a key that does not exist.
        let keys = every_key();
        for (section, key, _) in &rows {
            if section == "Section" || section.starts_with('-') || key.contains(' ') {
                continue; // header, separator, prose rows
            }
            assert!(
                keys.iter().any(|(s, k)| s == section && k == key),
                "docs/configuration.md documents unknown key {section}.{key}"
            );
        }
    }

    // --- never panics -------------------------------------------------

    proptest! {
        #[test]
        fn parse_never_panics_on_arbitrary_text(text in any::<String>()) {
            let _ = parse(&text, "p.toml", &Overrides::default());
        }

        #[test]
        fn parse_never_panics_on_toml_like_text(text in "(\\[+[a-z\\[\\]]{0,8}\\]+|[a-z_.]{1,12} = (\"[^\"\\\\]{0,12}\"|[0-9-]{1,4}|\\[[0-9, \"A-Z]{0,10}\\]|true)|#.{0,5}|)(\n[a-z_ =\"\\[\\].0-9]{0,20}){0,12}") {
            let _ = parse(&text, "p.toml", &Overrides::default());
        }

        #[test]
        fn parse_never_panics_on_arbitrary_durations_and_sizes(
            lease in any::<String>(),
            retention in "[0-9]{0,25}(\\.[0-9]{0,5})? ?(ns|us|ms|s|m|h|d|w|M|y|years|)",
            size in "[0-9.]{0,25} ?(B|KiB|MiB|GiB|EiB|PB|kb|x|)",
        ) {
            let text = format!(
                "[defaults]\nlease = {}\nretention = {}\nmax_stored_response = {}\n",
                toml::Value::String(lease),
                toml::Value::String(retention),
                toml::Value::String(size),
            );
            let _ = parse(&text, "p.toml", &Overrides::default());
        }
    }

    // --- properties of the whole report ---------------------------------

    /// Keys no section has (every real key is in lower-case ASCII without
    /// this prefix).
    fn unknown_key() -> impl Strategy<Value = String> {
        "zz_[a-z]{1,8}"
    }

    proptest! {
        #[test]
        fn every_unknown_key_is_reported_with_its_section_and_line(
            placed in proptest::collection::vec((0usize..5, unknown_key()), 1..8),
        ) {
            const SECTIONS: [&str; 5] = ["server", "upstream", "store", "sweeper", "defaults"];
            let mut text = String::new();
            let mut expected = Vec::new();
            for (i, section) in SECTIONS.iter().enumerate() {
                text.push_str(&format!("[{section}]\n"));
                let mut seen = std::collections::HashSet::new();
                for (_, key) in placed.iter().filter(|(s, _)| *s == i) {
                    if seen.insert(key.clone()) {
                        text.push_str(&format!("{key} = 1\n"));
                        expected.push((format!("{section}.{key}"), text.lines().count()));
                    }
                }
            }
            let err = parse(&text, "p.toml", &Overrides::default()).unwrap_err();
            prop_assert_eq!(err.problems.len(), expected.len(), "{}", err);
            for (key, line) in expected {
                let p = err.problems.iter().find(|p| p.key == key);
                prop_assert!(p.is_some(), "{} not reported in {}", key, err);
                prop_assert_eq!(p.unwrap().line, Some(line));
            }
        }

        #[test]
        fn every_bad_value_is_reported_at_once(mask in 1u8..32) {
            let bad = [
                ("server.listen", "[server]\nlisten = \"nonsense\"\n"),
                ("store.pool_size", "[store]\npool_size = -1\n"),
                ("sweeper.interval", "[sweeper]\ninterval = \"10 parsecs\"\n"),
                ("defaults.methods[0]", "[defaults]\nmethods = [\"post\"]\n"),
                ("route[0].path_prefix", "[[route]]\npath_prefix = \"v1\"\n"),
            ];
            let chosen: Vec<_> = bad.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, b)| b).collect();
            let text: String = chosen.iter().map(|(_, t)| *t).collect();
            let err = parse(&text, "p.toml", &Overrides::default()).unwrap_err();
            for (key, _) in &chosen {
                prop_assert!(err.problems.iter().any(|p| p.key == *key), "{} missing from {}", key, err);
            }
            prop_assert_eq!(err.problems.len(), chosen.len(), "{}", err);
        }

        #[test]
        fn durations_and_sizes_round_trip(
            lease_ms in 100u64..86_400_000,
            body in 0u64..(1 << 40),
        ) {
            let lease = Duration::from_millis(lease_ms);
            let text = format!(
                "[server]\nmax_request_body = \"{body}\"\n[defaults]\nlease = \"{}\"\nretention = \"400days\"\n",
                humantime::format_duration(lease)
            );
            let config = parse(&text, "p.toml", &Overrides::default()).unwrap();
            prop_assert_eq!(config.routes[0].policy.lease, lease);
            prop_assert_eq!(config.server.max_request_body, body);
            let kib = format!("[server]\nmax_request_body = \"{}KiB\"\n", body >> 10);
            let config = parse(&kib, "p.toml", &Overrides::default()).unwrap();
            prop_assert_eq!(config.server.max_request_body, (body >> 10) * 1024);
        }

        #[test]
        fn every_problem_line_is_a_line_of_the_file(text in "(\\[[a-z]{0,8}\\]|[a-z_]{1,10} = (\"[^\"\\\\]{0,8}\"|-?[0-9]{1,3}|\\[\\]))(\n(\\[\\[?[a-z]{0,8}\\]\\]?|[a-z_]{1,10} = (\"[^\"\\\\]{0,8}\"|-?[0-9]{1,3}|true))){0,15}") {
            if let Err(err) = parse(&text, "p.toml", &Overrides::default()) {
                prop_assert!(!err.problems.is_empty());
                let lines = text.lines().count().max(1);
                for p in &err.problems {
                    if let Some(line) = p.line {
                        prop_assert!((1..=lines).contains(&line), "{} (file has {} lines)", p, lines);
                    }
                }
            }
        }
    }
}
