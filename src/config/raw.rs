//! The raw structs: the TOML as written, before any rule is checked.
//!
//! Every field is an `Option` (absent: inherit) and every value that has
//! rules is `Spanned`, so a problem can name its line. Integers are read as
//! `i64` so that `pool_size = -1` is a rule problem collected with the
//! others, not a serde type error that stops the parse.
//!
//! There is no `deny_unknown_fields`: it stops at the first unknown key,
//! while `serde_ignored` (see [`super::locate`]) reports them all.
//!
//! The doc comment of every field is the one-line reference of its key: a
//! test keeps `docs/configuration.md` in step with these structs (their keys
//! and their defaults).

use serde::Deserialize;
use toml::Spanned;

/// Declares one section's raw struct, and its `overlay`: a layer (the
/// environment) replaces every key it sets. Written once, so a new key
/// cannot be forgotten by the overlay.
macro_rules! section {
    ($(#[$meta:meta])* struct $name:ident { $( $(#[doc = $doc:literal])* $key:ident: $ty:ty, )* }) => {
        $(#[$meta])*
        #[derive(Default, Deserialize)]
        #[serde(default)]
        pub(super) struct $name {
            $( $(#[doc = $doc])* pub(super) $key: Option<Spanned<$ty>>, )*
        }

        impl $name {
            /// Every key `layer` sets replaces this one's.
            pub(super) fn overlay(&mut self, layer: $name) {
                $( if layer.$key.is_some() { self.$key = layer.$key; } )*
            }
        }
    };
}

/// The whole file; every section is optional.
#[derive(Default, Deserialize)]
#[serde(default)]
pub(super) struct RawConfig {
    /// `[server]`: the listeners.
    pub(super) server: RawServer,
    /// `[upstream]`: the legacy service behind the proxy.
    pub(super) upstream: RawUpstream,
    /// `[store]`: the PostgreSQL that holds the records.
    pub(super) store: RawStore,
    /// `[sweeper]`: the background deletion of expired records.
    pub(super) sweeper: RawSweeper,
    /// `[defaults]`: the policy every route inherits.
    pub(super) defaults: RawPolicy,
    /// `[[route]]`, in file order; none: one catch-all route.
    pub(super) route: Vec<RawRoute>,
}

impl RawConfig {
    /// The sections `layer` (the environment) sets keys of replace this
    /// one's keys; routes stay the file's.
    pub(super) fn overlay(&mut self, layer: RawConfig) {
        self.server.overlay(layer.server);
        self.upstream.overlay(layer.upstream);
        self.store.overlay(layer.store);
        self.sweeper.overlay(layer.sweeper);
        self.defaults.overlay(layer.defaults);
    }
}

section! {
/// `[server]`.
struct RawServer {
    /// Address of the proxy listener, `IP:port`.
    listen: String,
    /// Address of the admin listener (`/healthz`, `/readyz`, `/metrics`), `IP:port`; must differ from `listen`.
    admin_listen: String,
    /// Largest keyed request body (keyed bodies are buffered to be fingerprinted; larger ones get 413). Pass-through requests are streamed.
    max_request_body: String,
    /// How long in-flight requests may take to finish after SIGTERM.
    shutdown_grace: String,
    /// How long a client may take to send a request's headers; greater than 0.
    header_read_timeout: String,
    /// PEM file with the certificate chain (leaf first) of the proxy listener; with `tls_key_file`, the listener speaks TLS only (HTTP/1.1 and h2 by ALPN) and forwards `X-Forwarded-Proto: https`. Read at start.
    tls_cert_file: String,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1) of `tls_cert_file`; set both or neither.
    tls_key_file: String,
    /// Most duplicates that may wait for their in-flight originals at once (see `wait`); past it a duplicate gets 409 at once; at least 0.
    max_waiters: i64,
    /// How long a keyed request's whole body may take to arrive after its headers; a body still incomplete then gets 408 and nothing is stored or forwarded; greater than 0.
    body_read_timeout: String,
    /// Most client connections open at once on the proxy listener; a connection past it is closed as soon as it is accepted; 1 to 1000000.
    max_connections: i64,
    /// Most concurrent streams (requests) on one h2 connection, advertised to the client; 1 to 10000.
    h2_max_concurrent_streams: i64,
    /// How long a client connection (HTTP/1.1 or h2) may stay open with no request in progress before it is closed gracefully (h2: GOAWAY); greater than 0.
    idle_timeout: String,
}
}

section! {
/// `[upstream]`.
struct RawUpstream {
    /// Base URL of the upstream: absolute `http://` or `https://` with a host, optionally with a path prefix that is prepended to every forwarded path; no query, fragment or credentials.
    url: String,
    /// Bound on establishing a TCP connection to the upstream; greater than 0.
    connect_timeout: String,
    /// Bound on a whole upstream exchange (request sent to response headers); greater than 0.
    timeout: String,
    /// PEM file of CA certificates trusted for an `https://` upstream, in addition to the system store (`/etc/ssl/certs`, `SSL_CERT_FILE`); only with an `https://` URL. Read at start.
    ca_file: String,
}
}

section! {
/// `[store]`.
struct RawStore {
    /// PostgreSQL URL (`postgres://` or `postgresql://`) or `key=value` connection string. A secret: never logged nor echoed in errors. `IDEMPROXY_DATABASE_URL` overrides it.
    database_url: String,
    /// Maximum number of pooled connections; at least 3 (one each for the claim and completion batch workers, and one that lease renewals, takeovers and reads can always get). A replica holds at most `pool_size` + 1 connections (the extra one listens for notifications).
    pool_size: i64,
    /// Bound on any one store operation, pool wait included; greater than 0.
    timeout: String,
    /// When the store fails: `"reject"` (503 + `Retry-After`, nothing forwarded) or `"pass_through"` (forward unprotected, loudly).
    on_store_error: String,
    /// PEM file of CA certificates that verify the database server's certificate under `sslmode=verify-ca`/`verify-full` (or `require`, which then verifies the chain, as libpq does); without it those modes use the system store. The URL's `sslrootcert` may name it instead. Read at start.
    ca_file: String,
    /// Memory for completed responses replayed without a database round trip (they are immutable until they expire); `"0"` turns the cache off. Bounds the cache, not the process.
    response_cache: String,
    /// Longest time a cached response is replayed without asking the database: an operator's `keys release --force` of a completed key reaches every replica within it; greater than 0.
    response_cache_ttl: String,
    /// Use named prepared statements, cached per connection (one round trip per operation either way). Set `false` behind a pooler in transaction or statement mode (PgBouncer before 1.21), which cannot keep a named statement between transactions.
    prepared_statements: bool,
    /// A direct (session-mode) URL used only for `LISTEN` and for migrations, which need a session; unset: `database_url`. Set it when `database_url` points at a pooler in transaction mode. A secret, like `database_url`.
    listen_url: String,
}
}

section! {
/// `[sweeper]` (an extension to DESIGN.md §3).
struct RawSweeper {
    /// Pause between sweeper passes; greater than 0.
    interval: String,
    /// Rows deleted per statement (bounded batches keep transactions short); at least 1.
    batch_size: i64,
    /// Pause between the batches of a pass, which paces the deletion of a
    /// large backlog; 0 for none.
    pause: String,
}
}

/// Declares the policy keys once. They make up `[defaults]` and are repeated,
/// flat, in every `[[route]]`: serde's `flatten` would lose both the spans
/// and the unknown-key report, so the macro writes the fields out twice.
macro_rules! policy_keys {
    ($( $(#[doc = $doc:literal])* $key:ident: $ty:ty, )*) => {
        /// `[defaults]`: the idempotency policy every route inherits.
        #[derive(Default, Deserialize)]
        #[serde(default)]
        pub(super) struct RawPolicy {
            $( $(#[doc = $doc])* pub(super) $key: Option<Spanned<$ty>>, )*
        }

        /// One `[[route]]`: its own keys, plus any `[defaults]` key as an
        /// override.
        #[derive(Default, Deserialize)]
        #[serde(default)]
        pub(super) struct RawRoute {
            /// Label used in metrics and logs; defaults to the route's `path_prefix`.
            pub(super) name: Option<Spanned<String>>,
            /// Path prefix this route covers; starts with `/`. The first route whose prefix matches wins, so list specific prefixes first.
            pub(super) path_prefix: Option<Spanned<String>>,
            /// Header that names the tenant; absent: every request is the empty tenant.
            pub(super) tenant_header: Option<Spanned<String>>,
            /// A keyed request without the tenant header gets 400 (false: it is the empty tenant). Needs `tenant_header`.
            pub(super) tenant_required: Option<Spanned<bool>>,
            /// Store `sha256:` and the hex SHA-256 of the tenant header value, never the value (for secrets such as `Authorization`); plain tenants may not start with `sha256:`, so the two kinds never meet. Needs `tenant_header`.
            pub(super) tenant_hash: Option<Spanned<bool>>,
            $( $(#[doc = $doc])* pub(super) $key: Option<Spanned<$ty>>, )*
        }

        impl RawPolicy {
            /// Every key `layer` sets replaces this one's.
            pub(super) fn overlay(&mut self, layer: RawPolicy) {
                $( if layer.$key.is_some() { self.$key = layer.$key; } )*
            }
        }

        impl RawRoute {
            /// The policy keys this route sets (the others are inherited).
            pub(super) fn policy(&self) -> RawPolicy {
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
    /// Header in which a key derived from tenant and key is forwarded to the upstream (the client's key header is forwarded too, unchanged); `""`: none. A client's own value is removed from every request.
    derived_key_header: String,
    /// Form of the derived key: `"sha256"` (hex SHA-256 of tenant and key) or `"tenant_key"` (the stored tenant with `%` and `:` percent-encoded, `:`, then the key).
    derived_key: String,
}
