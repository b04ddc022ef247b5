//! Prometheus metrics, served by the admin listener. Routes are labelled by
//! their configured name, never by raw path; nothing is labelled by key or
//! tenant. The families and what each means are listed in
//! docs/operations.md ("Metrics"); a test keeps that list and `/metrics`
//! in step.
//!
//! The request path records into per-route handles found by a lookup on
//! the route's name (a read lock and a hash, no allocation): a series is
//! created on its first use only, so `/metrics` shows the combinations
//! that happened rather than every route × outcome × status class.
//!
//! Latency buckets must reach past the longest a request may take, or slow
//! calls all land in `+Inf`. Those of the request and upstream histograms
//! are derived from `upstream.timeout` (and the longest route `wait`) when
//! the proxy is built ([`Metrics::configure_durations`]); store operations
//! are bounded by `store.timeout` and keep a fixed range up to two minutes.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

mod buckets;

pub use buckets::DurationBuckets;
use buckets::{store_histogram, DurationHistograms};

/// How a request ended, as counted in `idemproxy_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Claimed and forwarded (the first execution, or a takeover).
    Claimed,
    /// Answered from the stored response.
    Replayed,
    /// Refused: the original is in flight (409).
    Conflict,
    /// Refused: the key was reused with a different request (422).
    Mismatch,
    /// Not keyed: forwarded untouched.
    Passthrough,
    /// The claim was released (connect failure or a `release_on` status).
    Released,
    /// Our lease was lost: the completion was refused by the fence (the
    /// response still went to the client), or the claim's lease ran out
    /// before it was forwarded (409, nothing forwarded).
    LostLease,
    /// The store failed.
    StoreError,
    /// Refused as bad input (400, 413).
    Rejected,
}

impl Outcome {
    /// Every outcome, in label order.
    pub const ALL: [Outcome; 9] = [
        Outcome::Claimed,
        Outcome::Replayed,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::Passthrough,
        Outcome::Released,
        Outcome::LostLease,
        Outcome::StoreError,
        Outcome::Rejected,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Claimed => "claimed",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::Passthrough => "passthrough",
            Outcome::Released => "released",
            Outcome::LostLease => "lost_lease",
            Outcome::StoreError => "store_error",
            Outcome::Rejected => "rejected",
        }
    }

    /// Its position in [`Outcome::ALL`].
    fn index(self) -> usize {
        self as usize
    }
}

/// The `status_class` label values; a status outside 100–599 is "other".
const STATUS_CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "other"];

/// The index in [`STATUS_CLASSES`] of an HTTP status.
fn status_class(status: u16) -> usize {
    match status / 100 {
        c @ 1..=5 => usize::from(c) - 1,
        _ => 5,
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    // First, so that a match on `route=…,outcome=…"}` still finds a line.
    status_class: &'static str,
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    commit: &'static str,
    pgo: &'static str,
}

/// The label set of a family with a single, unlabelled series.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Unlabelled;

impl EncodeLabelSet for Unlabelled {
    fn encode(
        &self,
        _: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        Ok(())
    }
}

/// A route's name and the handles of its series ([`Metrics::route_metrics`]).
#[derive(Clone)]
pub struct RouteMetrics {
    name: Box<str>,
    series: Arc<RouteSeries>,
}

impl RouteMetrics {
    /// The route's name, as the series label it.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The series of one route, created on first use.
struct RouteSeries {
    /// `idemproxy_requests_total` by outcome, then status class.
    requests: [[OnceLock<Counter>; STATUS_CLASSES.len()]; Outcome::ALL.len()],
    /// `idemproxy_request_duration_seconds` by outcome.
    durations: [OnceLock<Histogram>; Outcome::ALL.len()],
}

impl RouteSeries {
    fn new() -> Self {
        RouteSeries {
            requests: std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())),
            durations: std::array::from_fn(|_| OnceLock::new()),
        }
    }
}

/// What the response cache holds and did, sampled at each scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheSample {
    /// Replays answered from memory, since start.
    pub hits: u64,
    /// Lookups that found nothing usable, since start.
    pub misses: u64,
    /// Entries pushed out by the byte budget, since start.
    pub evictions: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// Entries held now.
    pub entries: u64,
}

/// Reads state owned elsewhere (cache, waiters) into the metrics at each
/// scrape.
pub type Sampler = Box<dyn Fn(&Metrics) + Send + Sync>;

/// All of the process's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_duration: Family<DurationLabels, Histogram, DurationHistograms>,
    /// Per-route handles into the two families above.
    routes: RwLock<HashMap<Box<str>, Arc<RouteSeries>>>,
    /// The buckets chosen for the request and upstream histograms.
    buckets: Arc<OnceLock<DurationBuckets>>,
    upstream_duration: Family<Unlabelled, Histogram, DurationHistograms>,
    /// The one series of `upstream_duration`, once created.
    upstream_histogram: OnceLock<Histogram>,
    store_duration: Family<OpLabels, Histogram, fn() -> Histogram>,
    in_flight: Gauge,
    takeovers: Counter,
    takeovers_declined: Counter,
    held_here: Counter,
    renewals: Family<ResultLabels, Counter>,
    sweeper_deleted: Counter,
    pool_size: Gauge,
    pool_available: Gauge,
    pool_waiting: Gauge,
    batches: Family<OpLabels, Counter>,
    batched_items: Family<OpLabels, Counter>,
    largest_batch: Family<OpLabels, Gauge>,
    store_up: Gauge,
    lost_leases: Counter,
    cache_hits: Counter,
    cache_misses: Counter,
    cache_evictions: Counter,
    cache_bytes: Gauge,
    cache_entries: Gauge,
    waiters: Gauge,
    worker_connections: Family<WorkerLabels, Gauge>,
    /// The workers' connection counts, read at each scrape.
    worker_load: OnceLock<crate::workers::Load>,
    sampler: Mutex<Option<Sampler>>,
    config_reloads: Family<ResultLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Raises a counter to `total` (a count kept elsewhere since start); never
/// lowers it, so concurrent scrapes cannot make it go backwards.
fn raise_to(counter: &Counter, total: u64) {
    counter.inner().fetch_max(total, Ordering::Relaxed);
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("idemproxy");
        let buckets = Arc::new(OnceLock::new());
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by status class, route and outcome",
            requests.clone(),
        );
        let request_duration = Family::new_with_constructor(DurationHistograms {
            buckets: buckets.clone(),
            request: true,
        });
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to its response head, by route and outcome",
            request_duration.clone(),
        );
        let upstream_duration = Family::new_with_constructor(DurationHistograms {
            buckets: buckets.clone(),
            request: false,
        });
        registry.register(
            "upstream_duration_seconds",
            "Duration of upstream exchanges",
            upstream_duration.clone(),
        );
        let store_duration =
            Family::<OpLabels, Histogram, fn() -> Histogram>::new_with_constructor(store_histogram);
        registry.register(
            "store_duration_seconds",
            "Duration of store operations by operation",
            store_duration.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "in_flight",
            "Keyed requests currently owned by this process",
            in_flight.clone(),
        );
        let takeovers = Counter::default();
        registry.register(
            "takeovers",
            "Claims taken over after an expired lease",
            takeovers.clone(),
        );
        let takeovers_declined = Counter::default();
        registry.register(
            "takeovers_declined",
            "Duplicates that found the lease of a claim still running in this process expired, and did not take it over (once per duplicate)",
            takeovers_declined.clone(),
        );
        let held_here = Counter::default();
        registry.register(
            "duplicates_held_here",
            "Duplicates of a key this process holds in flight, answered 409 or 422 without reading the store",
            held_here.clone(),
        );
        let renewals = Family::<ResultLabels, Counter>::default();
        registry.register(
            "lease_renewals",
            "Lease renewals by result",
            renewals.clone(),
        );
        let sweeper_deleted = Counter::default();
        registry.register(
            "sweeper_deleted",
            "Expired records deleted by the sweeper",
            sweeper_deleted.clone(),
        );
        let pool_size = Gauge::default();
        registry.register(
            "store_pool_connections",
            "Open database connections",
            pool_size.clone(),
        );
        let pool_available = Gauge::default();
        registry.register(
            "store_pool_available",
            "Idle database connections",
            pool_available.clone(),
        );
        let pool_waiting = Gauge::default();
        registry.register(
            "store_pool_waiting",
            "Tasks waiting for a database connection",
            pool_waiting.clone(),
        );
        let batches = Family::<OpLabels, Counter>::default();
        registry.register(
            "store_batches",
            "Group-commit statements sent, by operation",
            batches.clone(),
        );
        let batched_items = Family::<OpLabels, Counter>::default();
        registry.register(
            "store_batched_items",
            "Items carried by group-commit statements, by operation (÷ batches: mean batch size)",
            batched_items.clone(),
        );
        let largest_batch = Family::<OpLabels, Gauge>::default();
        registry.register(
            "store_largest_batch",
            "Largest group-commit batch since start, by operation",
            largest_batch.clone(),
        );
        let store_up = Gauge::default();
        registry.register(
            "store_up",
            "1 when the store answered its last check and its schema is current, else 0",
            store_up.clone(),
        );
        let lost_leases = Counter::default();
        registry.register(
            "lost_leases",
            "Responses the fence refused to store (the lease was lost), whether the request was still waiting or the completion was being retried in the background",
            lost_leases.clone(),
        );
        let cache_hits = Counter::default();
        registry.register(
            "cache_hits",
            "Replays answered from this replica's response cache",
            cache_hits.clone(),
        );
        let cache_misses = Counter::default();
        registry.register(
            "cache_misses",
            "Response cache lookups that found nothing usable (the store was read)",
            cache_misses.clone(),
        );
        let cache_evictions = Counter::default();
        registry.register(
            "cache_evictions",
            "Response cache entries pushed out by the byte budget",
            cache_evictions.clone(),
        );
        let cache_bytes = Gauge::default();
        registry.register(
            "cache_bytes",
            "Bytes held by the response cache (allocator overhead included)",
            cache_bytes.clone(),
        );
        let cache_entries = Gauge::default();
        registry.register(
            "cache_entries",
            "Completions held by the response cache",
            cache_entries.clone(),
        );
        let waiters = Gauge::default();
        registry.register(
            "waiters",
            "Duplicates waiting now for their original to finish (route setting wait)",
            waiters.clone(),
        );
        let worker_connections = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_connections",
            "Client connections each worker thread serves now",
            worker_connections.clone(),
        );
        // Constant 1: its labels say which release (and commit) a replica
        // runs, so a rolling upgrade's mix of versions shows on a dashboard,
        // and whether it was built with the PGO profile.
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: crate::version::VERSION,
                commit: crate::version::COMMIT,
                pgo: crate::version::PGO,
            })
            .set(1);
        registry.register(
            "build_info",
            "Always 1; the labels name the version and the commit this binary was built from, and its PGO build (profile-guided, instrumented or none)",
            build_info,
        );
        let config_reloads = config_reloads(&mut registry);
        Metrics {
            config_reloads,
            lost_leases,
            store_up,
            batches,
            batched_items,
            largest_batch,
            registry,
            requests,
            request_duration,
            routes: RwLock::new(HashMap::new()),
            buckets,
            upstream_duration,
            upstream_histogram: OnceLock::new(),
            store_duration,
            in_flight,
            takeovers,
            takeovers_declined,
            held_here,
            renewals,
            sweeper_deleted,
            pool_size,
            pool_available,
            pool_waiting,
            cache_hits,
            cache_misses,
            cache_evictions,
            cache_bytes,
            cache_entries,
            waiters,
            worker_connections,
            worker_load: OnceLock::new(),
            sampler: Mutex::new(None),
        }
    }

    /// Chooses the request and upstream histograms' buckets from the
    /// configured limits (see [`DurationBuckets::for_limits`]). Only the
    /// first call counts, and only before the first observation: buckets
    /// cannot change under a live series.
    pub fn configure_durations(&self, upstream_timeout: Duration, longest_wait: Duration) {
        let _ = self
            .buckets
            .set(DurationBuckets::for_limits(upstream_timeout, longest_wait));
    }

    /// The buckets in use.
    pub fn duration_buckets(&self) -> &DurationBuckets {
        self.buckets.get_or_init(DurationBuckets::default)
    }

    /// The handles of `route`'s series: a read lock and a lookup, no
    /// allocation but on a route's first request.
    fn route(&self, route: &str) -> Arc<RouteSeries> {
        let found = self
            .routes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(route)
            .cloned();
        found.unwrap_or_else(|| {
            self.routes
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(route.into())
                .or_insert_with(|| Arc::new(RouteSeries::new()))
                .clone()
        })
    }

    fn request_counter<'s>(
        &self,
        series: &'s RouteSeries,
        route: &str,
        outcome: Outcome,
        status: u16,
    ) -> &'s Counter {
        let class = status_class(status);
        series.requests[outcome.index()][class].get_or_init(|| {
            self.requests
                .get_or_create(&RequestLabels {
                    status_class: STATUS_CLASSES[class],
                    route: route.to_owned(),
                    outcome: outcome.as_str(),
                })
                .clone()
        })
    }

    /// Counts a finished request and records how long it took to its
    /// response head.
    pub fn request(&self, route: &str, outcome: Outcome, status: u16, took: Duration) {
        self.request_on(&self.route_metrics(route), outcome, status, took);
    }

    /// The handles of `route`'s series, for [`Metrics::request_on`]: kept
    /// by whoever counts the route's requests, so that counting one takes
    /// no lock and no lookup.
    pub fn route_metrics(&self, route: &str) -> RouteMetrics {
        RouteMetrics {
            name: route.into(),
            series: self.route(route),
        }
    }

    /// [`Metrics::request`] on a route's handles.
    pub fn request_on(&self, route: &RouteMetrics, outcome: Outcome, status: u16, took: Duration) {
        let (name, series) = (&*route.name, &*route.series);
        self.request_counter(series, name, outcome, status).inc();
        series.durations[outcome.index()]
            .get_or_init(|| {
                self.request_duration
                    .get_or_create(&DurationLabels {
                        route: name.to_owned(),
                        outcome: outcome.as_str(),
                    })
                    .clone()
            })
            .observe(took.as_secs_f64());
    }

    /// How many requests ended with `outcome` on `route`, whatever their
    /// status (for tests).
    pub fn request_count(&self, route: &str, outcome: Outcome) -> u64 {
        let series = self.route(route);
        series.requests[outcome.index()]
            .iter()
            .filter_map(OnceLock::get)
            .map(Counter::get)
            .sum()
    }

    /// Records an upstream exchange's duration.
    pub fn upstream(&self, d: Duration) {
        self.upstream_histogram
            .get_or_init(|| self.upstream_duration.get_or_create(&Unlabelled).clone())
            .observe(d.as_secs_f64());
    }

    /// Records a store operation's duration.
    pub fn store(&self, op: &'static str, d: Duration) {
        self.store_duration
            .get_or_create(&OpLabels { op })
            .observe(d.as_secs_f64());
    }

    /// The in-flight gauge.
    pub fn in_flight(&self) -> &Gauge {
        &self.in_flight
    }

    /// Records the outcome of the last store check.
    pub fn store_up(&self, up: bool) {
        self.store_up.set(i64::from(up));
    }

    /// Counts a lease its owner found lost: a completion refused by the
    /// fence, or a claim whose lease ran out before it was forwarded.
    pub fn lost_lease(&self) {
        self.lost_leases.inc();
    }

    /// Counts a takeover.
    pub fn takeover(&self) {
        self.takeovers.inc();
    }

    /// Counts a duplicate that declined a takeover (once per request): the
    /// claim's lease ran out in the database, but its owner is still
    /// running in this process.
    pub fn takeover_declined(&self) {
        self.takeovers_declined.inc();
    }

    /// Counts a duplicate answered from the renewer's knowledge of a key
    /// this process holds, without the store.
    pub fn duplicate_held_here(&self) {
        self.held_here.inc();
    }

    /// Counts a renewal: `ok`, `lost` or `error`.
    pub fn renewal(&self, result: &'static str) {
        self.renewals.get_or_create(&ResultLabels { result }).inc();
    }

    /// Counts deleted records.
    pub fn swept(&self, n: u64) {
        self.sweeper_deleted.inc_by(n);
    }

    /// Updates the pool gauges.
    pub fn pool(&self, size: usize, available: usize, waiting: usize) {
        self.pool_size.set(size as i64);
        self.pool_available.set(available as i64);
        self.pool_waiting.set(waiting as i64);
    }

    /// Updates the group-commit series from the store's counts since start.
    pub fn batching(&self, op: &'static str, batches: u64, items: u64, largest: u64) {
        let labels = OpLabels { op };
        raise_to(&self.batches.get_or_create(&labels), batches);
        raise_to(&self.batched_items.get_or_create(&labels), items);
        self.largest_batch
            .get_or_create(&labels)
            .set(i64::try_from(largest).unwrap_or(i64::MAX));
    }

    /// Updates the response cache's series from its own counts.
    pub fn cache(&self, s: CacheSample) {
        raise_to(&self.cache_hits, s.hits);
        raise_to(&self.cache_misses, s.misses);
        raise_to(&self.cache_evictions, s.evictions);
        self.cache_bytes
            .set(i64::try_from(s.bytes).unwrap_or(i64::MAX));
        self.cache_entries
            .set(i64::try_from(s.entries).unwrap_or(i64::MAX));
    }

    /// Sets the number of duplicates waiting now.
    pub fn waiters(&self, waiting: usize) {
        self.waiters.set(i64::try_from(waiting).unwrap_or(i64::MAX));
    }

    /// Installs the function that reads state owned elsewhere at each
    /// scrape (replacing any earlier one: one proxy per process).
    pub fn set_sampler(&self, sampler: Sampler) {
        *self.sampler.lock().unwrap_or_else(PoisonError::into_inner) = Some(sampler);
    }

    /// Reads the worker threads' connection counts at each scrape (the
    /// first call counts: one proxy listener per process).
    pub fn set_worker_load(&self, load: crate::workers::Load) {
        let _ = self.worker_load.set(load);
    }

    /// Sets each worker's connection count.
    pub fn worker_connections(&self, counts: &[usize]) {
        for (worker, &n) in counts.iter().enumerate() {
            self.worker_connections
                .get_or_create(&WorkerLabels { worker })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        if let Some(sample) = &*self.sampler.lock().unwrap_or_else(PoisonError::into_inner) {
            sample(self);
        }
        if let Some(load) = self.worker_load.get() {
            self.worker_connections(&load.connections());
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The results of `idemproxy_config_reloads_total` (SIGHUP): applied;
/// applied except changes that need a restart; refused (the running
/// configuration kept); not attempted (no file, or draining).
pub const RELOAD_RESULTS: [&str; 4] = ["ok", "restart_required", "error", "skipped"];

fn config_reloads(registry: &mut Registry) -> Family<ResultLabels, Counter> {
    let reloads = Family::<ResultLabels, Counter>::default();
    for result in RELOAD_RESULTS {
        // Every result shows, at 0, before the first reload.
        let _ = reloads.get_or_create(&ResultLabels { result });
    }
    registry.register(
        "config_reloads",
        "Configuration reloads (SIGHUP) by result: ok, restart_required (applied but for changes that need a restart), error (refused; the running configuration kept), skipped (no configuration file, or draining)",
        reloads.clone(),
    );
    reloads
}

impl Metrics {
    /// Counts a reload; `result` is one of [`RELOAD_RESULTS`].
    pub fn config_reload(&self, result: &'static str) {
        self.config_reloads
            .get_or_create(&ResultLabels { result })
            .inc();
    }
}

#[cfg(test)]
mod tests;
