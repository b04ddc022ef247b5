//! Prometheus metrics, served by the admin listener. Routes are labelled by
//! their configured name, never by raw path; nothing is labelled by key or
//! tenant.

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
    /// Our completion was refused by the fence.
    LostLease,
    /// The store failed.
    StoreError,
    /// Refused as bad input (400, 413).
    Rejected,
}

impl Outcome {
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
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: &'static str,
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
}

fn latency_histogram() -> Histogram {
    // 250µs … ~8s.
    Histogram::new(exponential_buckets(0.00025, 2.0, 16))
}

/// All of the process's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    upstream_duration: Histogram,
    store_duration: Family<OpLabels, Histogram, fn() -> Histogram>,
    in_flight: Gauge,
    takeovers: Counter,
    renewals: Family<ResultLabels, Counter>,
    sweeper_deleted: Counter,
    pool_size: Gauge,
    pool_available: Gauge,
    pool_waiting: Gauge,
    batches: Family<OpLabels, Gauge>,
    batched_items: Family<OpLabels, Gauge>,
    largest_batch: Family<OpLabels, Gauge>,
    store_up: Gauge,
    lost_leases: Counter,
    config_reloads: Family<ResultLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("idemproxy");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by route and outcome",
            requests.clone(),
        );
        let upstream_duration = latency_histogram();
        registry.register(
            "upstream_duration_seconds",
            "Duration of upstream exchanges",
            upstream_duration.clone(),
        );
        let store_duration = Family::<OpLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
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
        let batches = Family::<OpLabels, Gauge>::default();
        registry.register(
            "store_batches",
            "Group-commit statements sent since start, by operation",
            batches.clone(),
        );
        let batched_items = Family::<OpLabels, Gauge>::default();
        registry.register(
            "store_batched_items",
            "Items carried by group-commit statements since start, by operation (÷ batches: mean batch size)",
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
        // Constant 1: its labels say which release (and commit) a replica
        // runs, so a rolling upgrade's mix of versions shows on a dashboard.
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: crate::version::VERSION,
                commit: crate::version::COMMIT,
            })
            .set(1);
        registry.register(
            "build_info",
            "Always 1; the labels name the version and the commit this binary was built from",
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
            upstream_duration,
            store_duration,
            in_flight,
            takeovers,
            renewals,
            sweeper_deleted,
            pool_size,
            pool_available,
            pool_waiting,
        }
    }

    /// Counts a finished request.
    pub fn request(&self, route: &str, outcome: Outcome) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                outcome: outcome.as_str(),
            })
            .inc();
    }

    /// How many requests ended with `outcome` on `route` (for tests).
    pub fn request_count(&self, route: &str, outcome: Outcome) -> u64 {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                outcome: outcome.as_str(),
            })
            .get()
    }

    /// Records an upstream exchange's duration.
    pub fn upstream(&self, d: Duration) {
        self.upstream_duration.observe(d.as_secs_f64());
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

    /// Counts a completion refused by the fence.
    pub fn lost_lease(&self) {
        self.lost_leases.inc();
    }

    /// Counts a takeover.
    pub fn takeover(&self) {
        self.takeovers.inc();
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

    /// Updates the group-commit gauges from the store's counters.
    pub fn batching(&self, op: &'static str, batches: u64, items: u64, largest: u64) {
        let labels = OpLabels { op };
        let as_gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.batches.get_or_create(&labels).set(as_gauge(batches));
        self.batched_items
            .get_or_create(&labels)
            .set(as_gauge(items));
        self.largest_batch
            .get_or_create(&labels)
            .set(as_gauge(largest));
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
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
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_by_route_and_outcome() {
        let m = Metrics::new();
        m.request("payments", Outcome::Replayed);
        m.request("payments", Outcome::Replayed);
        m.request("payments", Outcome::Claimed);
        let text = m.render();
        assert!(
            text.contains(r#"idemproxy_requests_total{route="payments",outcome="replayed"} 2"#),
            "{text}"
        );
        assert!(text.contains(r#"idemproxy_requests_total{route="payments",outcome="claimed"} 1"#));
        assert_eq!(m.request_count("payments", Outcome::Replayed), 2);
    }

    #[test]
    fn build_info_names_the_version_and_the_commit() {
        let text = Metrics::new().render();
        let line = format!(
            r#"idemproxy_build_info{{version="{}",commit="{}"}} 1"#,
            crate::version::VERSION,
            crate::version::COMMIT
        );
        assert!(text.contains(&line), "{text}");
        assert!(text.contains("# TYPE idemproxy_build_info gauge"), "{text}");
    }

    #[test]
    fn every_documented_family_is_exposed() {
        let m = Metrics::new();
        // Families appear once they have a series.
        m.request("default", Outcome::Claimed);
        m.store("claim", Duration::from_millis(1));
        m.renewal("ok");
        let text = m.render();
        for name in [
            "idemproxy_requests_total",
            "idemproxy_upstream_duration_seconds",
            "idemproxy_store_duration_seconds",
            "idemproxy_in_flight",
            "idemproxy_takeovers_total",
            "idemproxy_lease_renewals_total",
            "idemproxy_sweeper_deleted_total",
            "idemproxy_store_pool_connections",
            "idemproxy_store_pool_available",
            "idemproxy_store_pool_waiting",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }

    #[test]
    fn outcome_labels_are_the_documented_ones() {
        // Dashboards and alerts (deploy/grafana, docs/operations.md) match
        // these strings: renaming one is a breaking change.
        use Outcome::*;
        let labels: Vec<&str> = [
            Claimed,
            Replayed,
            Conflict,
            Mismatch,
            Passthrough,
            Released,
            LostLease,
            StoreError,
            Rejected,
        ]
        .iter()
        .map(|o| o.as_str())
        .collect();
        assert_eq!(
            labels,
            [
                "claimed",
                "replayed",
                "conflict",
                "mismatch",
                "passthrough",
                "released",
                "lost_lease",
                "store_error",
                "rejected"
            ]
        );
    }
}
