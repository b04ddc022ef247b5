//! Unit tests of the metrics: series, buckets, and the documented list.

use super::*;
use std::sync::atomic::AtomicU64;

#[test]
fn requests_are_counted_by_status_class_route_and_outcome() {
    let m = Metrics::new();
    let ms = Duration::from_millis(3);
    m.request("payments", Outcome::Replayed, 201, ms);
    m.request("payments", Outcome::Replayed, 201, ms);
    m.request("payments", Outcome::Claimed, 201, ms);
    m.request("payments", Outcome::Claimed, 502, ms);
    let text = m.render();
    assert!(
        text.contains(
            r#"idemproxy_requests_total{status_class="2xx",route="payments",outcome="replayed"} 2"#
        ),
        "{text}"
    );
    assert!(text.contains(
        r#"idemproxy_requests_total{status_class="5xx",route="payments",outcome="claimed"} 1"#
    ));
    assert_eq!(m.request_count("payments", Outcome::Replayed), 2);
    assert_eq!(m.request_count("payments", Outcome::Claimed), 2);
    assert_eq!(m.request_count("other", Outcome::Claimed), 0);
}

#[test]
fn status_classes_cover_every_status() {
    let classes: Vec<&str> = [100, 204, 304, 499, 503, 600, 0]
        .iter()
        .map(|s| STATUS_CLASSES[status_class(*s)])
        .collect();
    assert_eq!(
        classes,
        ["1xx", "2xx", "3xx", "4xx", "5xx", "other", "other"]
    );
}

#[test]
fn request_duration_buckets_reach_past_the_upstream_timeout() {
    let m = Metrics::new();
    m.configure_durations(Duration::from_secs(30), Duration::from_secs(5));
    // A call cut by the 30 s timeout, plus store round trips.
    m.request(
        "legacy",
        Outcome::Claimed,
        504,
        Duration::from_millis(30_200),
    );
    m.upstream(Duration::from_millis(30_001));
    let text = m.render();
    let line = |series: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(series))
            .unwrap_or_else(|| panic!("{series} missing:\n{text}"))
            .trim()
            .to_owned()
    };
    let request = |le: &str| {
        format!(
            r#"idemproxy_request_duration_seconds_bucket{{le="{le}",route="legacy",outcome="claimed"}}"#
        )
    };
    assert_eq!(line(&request("30.0")), "0");
    assert_eq!(line(&request("37.5")), "1");
    let upstream = r#"idemproxy_upstream_duration_seconds_bucket{le="#;
    assert_eq!(line(&format!(r#"{upstream}"30.0"}}"#)), "0");
    assert_eq!(line(&format!(r#"{upstream}"37.5"}}"#)), "1");
}

#[test]
fn buckets_follow_the_longest_of_timeout_and_wait() {
    let b = DurationBuckets::for_limits(Duration::from_secs(2), Duration::from_secs(120));
    assert_eq!(b.upstream.last(), Some(&2.5));
    assert_eq!(b.request[b.request.len() - 3..], [120.0, 150.0, 240.0]);
    assert!(b.request.windows(2).all(|w| w[0] < w[1]), "{b:?}");
    let d = DurationBuckets::default();
    assert_eq!(d.request[..3], [0.001, 0.0025, 0.005]);
    assert_eq!(d.request[d.request.len() - 4..], [25.0, 30.0, 37.5, 60.0]);
}

#[test]
fn only_the_first_bucket_choice_counts() {
    let m = Metrics::new();
    m.configure_durations(Duration::from_secs(60), Duration::ZERO);
    m.configure_durations(Duration::from_secs(1), Duration::ZERO);
    assert_eq!(m.duration_buckets().upstream.last(), Some(&75.0));
}

#[test]
fn build_info_names_the_version_the_commit_and_pgo() {
    let text = Metrics::new().render();
    let line = format!(
        r#"idemproxy_build_info{{version="{}",commit="{}",pgo="{}"}} 1"#,
        crate::version::VERSION,
        crate::version::COMMIT,
        crate::version::PGO
    );
    assert!(text.contains(&line), "{text}");
    assert!(text.contains("# TYPE idemproxy_build_info gauge"), "{text}");
}

#[test]
fn counts_since_start_are_counters_that_never_go_back() {
    let m = Metrics::new();
    m.batching("claim", 10, 40, 8);
    // A scrape that read older figures cannot lower the counters.
    m.batching("claim", 9, 35, 8);
    m.cache(CacheSample {
        hits: 3,
        misses: 2,
        evictions: 1,
        bytes: 4096,
        entries: 2,
    });
    let text = m.render();
    for (line, value) in [
        (r#"idemproxy_store_batches_total{op="claim"}"#, "10"),
        (r#"idemproxy_store_batched_items_total{op="claim"}"#, "40"),
        ("idemproxy_cache_hits_total", "3"),
        ("idemproxy_cache_evictions_total", "1"),
        ("idemproxy_cache_bytes", "4096"),
    ] {
        assert!(
            text.contains(&format!("{line} {value}\n")),
            "{line}:\n{text}"
        );
    }
    assert!(
        text.contains("# TYPE idemproxy_store_batches counter"),
        "{text}"
    );
}

#[test]
fn the_sampler_runs_at_each_scrape() {
    let m = Metrics::new();
    let n = Arc::new(AtomicU64::new(0));
    let seen = n.clone();
    m.set_sampler(Box::new(move |m| {
        m.waiters(seen.fetch_add(1, Ordering::Relaxed) as usize + 1)
    }));
    assert!(m.render().contains("idemproxy_waiters 1\n"));
    assert!(m.render().contains("idemproxy_waiters 2\n"));
}

/// `(name, type)` of every row of docs/operations.md's metrics table.
fn documented() -> Vec<(String, String)> {
    let doc = include_str!("../../docs/operations.md");
    let section = doc
        .split("\n## Metrics\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/operations.md has a Metrics section");
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `idemproxy_"))
        .map(|l| {
            let mut cells = l.split('|');
            let name = cells.next().unwrap().trim().trim_end_matches('`');
            let kind = cells.next().unwrap().trim();
            (format!("idemproxy_{name}"), kind.to_owned())
        })
        .collect()
}

#[test]
fn every_family_is_documented_and_every_documented_family_exists() {
    let m = Metrics::new();
    // Families appear once they have a series: give each one.
    m.request("default", Outcome::Claimed, 201, Duration::from_millis(1));
    m.upstream(Duration::from_millis(1));
    m.store("claim", Duration::from_millis(1));
    m.renewal("ok");
    m.batching("claim", 1, 1, 1);
    m.worker_connections(&[1, 0]);
    let text = m.render();
    let mut exposed: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let (name, kind) = l.split_once(' ').unwrap();
            let name = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            (name, kind.to_owned())
        })
        .collect();
    let mut documented = documented();
    exposed.sort();
    documented.sort();
    assert_eq!(exposed, documented, "docs/operations.md vs /metrics");
}

#[test]
fn outcome_labels_are_the_documented_ones() {
    // Dashboards and alerts (deploy/grafana, docs/operations.md) match
    // these strings: renaming one is a breaking change.
    let labels: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
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
    for (i, o) in Outcome::ALL.iter().enumerate() {
        assert_eq!(o.index(), i);
    }
}
