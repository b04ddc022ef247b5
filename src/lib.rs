//! idemproxy: a reverse-proxy sidecar that makes a legacy HTTP API safe to
//! retry. A request carrying an `Idempotency-Key` is executed by the
//! upstream once; every retry gets the original answer.
//!
//! # Layout
//!
//! A keyed request walks through the modules in this order:
//!
//! * [`server`] accepts the connection (HTTP/1.1 or h2, in clear or over
//!   TLS, see [`tls`]) and hands the request to [`proxy::Proxy`].
//! * [`proxy`] matches a [`config::Route`], validates the key and tenant
//!   ([`idempotency::key`], [`idempotency::tenant`]), buffers the body and
//!   computes its [`idempotency::fingerprint`].
//! * [`store`] claims `(tenant, key)` in PostgreSQL in one statement, or
//!   returns the record the key already has; [`idempotency::decision`]
//!   (pure: no I/O, no clock) decides between replay, 409, 422 and takeover.
//! * An owned claim is forwarded once by [`proxy::upstream`] while
//!   [`lease`] renews it; the outcome is settled by the decision module:
//!   the response is stored (fenced by the owner token), or the claim is
//!   released, or it is left to expire when the outcome is unknown.
//! * A duplicate of an in-flight key on a route with `wait` sleeps in
//!   [`waiters`] until the original completes (pushed by `NOTIFY`).
//! * A replica replays completions it has seen from [`cache`] (bounded,
//!   short-lived) without a round trip.
//! * Every answer the proxy makes itself is built in [`proxy::problem`].
//!
//! Around the request path: [`config`] (TOML → validated `Config`),
//! [`app`] (wiring), [`workers`] (the threads serving the proxy port),
//! [`lifecycle`] (who owns each task, and the drain),
//! [`admin`] and [`metrics`] (health, readiness, Prometheus), [`sweeper`]
//! (retention) and [`cli`] (the `idemproxy` command). [`store::notify`]
//! keeps the one LISTEN connection that wakes [`waiters`] and invalidates
//! the [`cache`]. The counting stand-in for a legacy API that the quick
//! start and the tests run is not part of this library: it is the
//! workspace's `sample-upstream` package.
//!
//! # Architecture: which module may use which
//!
//! Dependencies point one way, from the pure core out to the binary; no
//! module uses one to its right:
//!
//! ```text
//! idempotency → config → store → {lease, waiters, cache} → proxy → server → admin → app → logging → cli
//!   (pure)                 ↑                                  ↑
//!   leaves used anywhere: pg_url, tls, backoff, metrics, lifecycle, workers
//! ```
//!
//! * [`idempotency`]: keys, tenants, fingerprints, [`idempotency::KeyId`]
//!   and the state machine; no I/O, no clock.
//! * [`config`]: raw TOML → checked → typed; every problem with file,
//!   line and key.
//! * [`store`]: the fenced SQL (`src/store/sql/*.sql`), group commit,
//!   bounded connections, the LISTEN loop, migrations.
//! * [`lease`], [`waiters`], [`cache`]: per-process state around the store.
//! * [`proxy`]: the request path; [`server`]: listeners; [`admin`]: the
//!   admin endpoints; [`app`]: wiring; [`logging`]: the subscriber and
//!   the ceiling that keeps bodies out of any log level; [`cli`]: the
//!   command.

pub mod admin;
pub mod app;
pub mod backoff;
// Included by build.rs; here for its unit tests.
#[cfg(test)]
mod build_flags;
pub mod cache;
pub mod cli;
pub mod config;
pub mod idempotency;
pub mod lease;
pub mod lifecycle;
pub mod logging;
pub mod metrics;
pub mod pg_url;
pub mod proxy;
pub mod server;
pub mod store;
pub mod sweeper;
pub mod timer;
pub mod tls;
pub mod version;
pub mod waiters;
pub mod workers;
