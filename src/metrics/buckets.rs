//! Histogram buckets: the request and upstream ladders derived from the
//! configured limits, and the store's fixed range.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::metrics::family::MetricConstructor;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

/// Store operations: 250 µs … ~2 min (they are bounded by `store.timeout`).
pub(super) fn store_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.00025, 2.0, 20))
}

/// Upper bounds (seconds) of the request and upstream histograms.
#[derive(Debug, Clone, PartialEq)]
pub struct DurationBuckets {
    /// `idemproxy_request_duration_seconds`.
    pub request: Vec<f64>,
    /// `idemproxy_upstream_duration_seconds`.
    pub upstream: Vec<f64>,
}

/// The 1–2.5–5 ladder from 1 ms, up to (excluded) `below` seconds.
fn ladder(below: f64) -> impl Iterator<Item = f64> {
    (-3..6)
        .flat_map(|exp| [1.0, 2.5, 5.0].map(|m| m * 10f64.powi(exp)))
        .take_while(move |b| *b < below)
}

impl DurationBuckets {
    /// Buckets for an upstream `timeout` and a longest duplicate `wait`.
    ///
    /// The upstream's reach to `timeout`, then 1.25 × `timeout`: a call cut
    /// by the timeout lands between the two, not in `+Inf`. A request
    /// spends at most about the longer of the two in the upstream or
    /// waiting, plus store round trips; its ladder reaches that ceiling,
    /// 1.25 × and 2 × the ceiling.
    pub fn for_limits(timeout: Duration, longest_wait: Duration) -> Self {
        let t = timeout.as_secs_f64().max(0.001);
        let ceiling = t.max(longest_wait.as_secs_f64());
        let mut upstream: Vec<f64> = ladder(t).collect();
        upstream.extend([t, t * 1.25]);
        let mut request: Vec<f64> = ladder(ceiling).collect();
        request.extend([ceiling, ceiling * 1.25, ceiling * 2.0]);
        DurationBuckets { request, upstream }
    }
}

impl Default for DurationBuckets {
    /// Those of the default `upstream.timeout` (30 s), no `wait`.
    fn default() -> Self {
        DurationBuckets::for_limits(Duration::from_secs(30), Duration::ZERO)
    }
}

/// Builds histograms with the configured buckets (the defaults until
/// [`Metrics::configure_durations`] is called).
#[derive(Clone)]
pub(super) struct DurationHistograms {
    pub(super) buckets: Arc<OnceLock<DurationBuckets>>,
    pub(super) request: bool,
}

impl MetricConstructor<Histogram> for DurationHistograms {
    fn new_metric(&self) -> Histogram {
        let b = self.buckets.get_or_init(DurationBuckets::default);
        let bounds = if self.request {
            &b.request
        } else {
            &b.upstream
        };
        Histogram::new(bounds.iter().copied())
    }
}
