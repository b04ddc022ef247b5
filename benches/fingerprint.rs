//! Throughput of request fingerprinting (`cargo bench --bench fingerprint`).
//!
//! Every keyed request is fingerprinted once before its claim, so this is
//! per-request CPU on the hot path. Measured on JSON bodies of about 200 B,
//! 10, 16 and 64 KiB and 1 MiB:
//!
//! * `canonical_json`: parse and re-serialise canonically (keys sorted,
//!   whitespace removed), the part that `fingerprint = "json"` adds;
//! * `fingerprint/json`: the whole fingerprint of a JSON request (canonical
//!   form + SHA-256), what a default route computes;
//! * `fingerprint/bytes`: the same body hashed as raw bytes (SHA-256 only),
//!   what `fingerprint = "bytes"` and non-JSON bodies cost;
//! * `spawn_blocking_round_trip`: handing work to tokio's blocking pool and
//!   back, what a body over the inline bound pays on top (src/proxy/admit.rs).
//!
//! Criterion reports the throughput in bytes of request body per second.

use std::fmt::Write as _;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use idemproxy::idempotency::fingerprint::canonical_json;
use idemproxy::idempotency::{Fingerprint, FingerprintMode};

/// A small deterministic generator (xorshift), so every run hashes the same
/// bodies without a `rand` dependency.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One order line as a client might send it: keys deliberately not sorted,
/// some whitespace, strings, integers, decimals, a nested object, booleans.
fn order_item(g: &mut Gen, i: usize) -> String {
    format!(
        r#"{{"sku": "SKU-{:06}", "qty": {}, "unit_price": {}.{:02}, "name": "Item {} \u00e9t\u00e9 \"special\"", "attrs": {{"colour": "c{}", "size": {}, "gift": {}}}, "tags": ["t{}", "t{}"]}}"#,
        g.below(1_000_000),
        1 + g.below(9),
        g.below(500),
        g.below(100),
        i,
        g.below(16),
        g.below(50),
        g.below(2) == 0,
        g.below(100),
        g.below(100),
    )
}

/// A JSON order body of about `target` bytes.
fn json_body(target: usize) -> Vec<u8> {
    let mut g = Gen(0x9e37_79b9_7f4a_7c15);
    let mut s = String::with_capacity(target + 512);
    let _ = write!(
        s,
        r#"{{"customer": "cus_{:012}", "currency": "EUR", "amount": {}, "metadata": {{"channel": "web", "retry": false}}, "items": ["#,
        g.below(1_000_000_000_000),
        g.below(1_000_000)
    );
    let mut i = 0;
    while s.len() + 2 < target {
        let item = order_item(&mut g, i);
        if i > 0 && s.len() + item.len() + 4 > target {
            break;
        }
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&item);
        i += 1;
    }
    s.push_str("]}");
    s.into_bytes()
}

fn sizes() -> Vec<(&'static str, Vec<u8>)> {
    let bodies = vec![
        ("small_200B", json_body(200)),
        ("medium_10KB", json_body(10 * 1024)),
        ("medium_16KB", json_body(16 * 1024)),
        ("medium_64KB", json_body(64 * 1024)),
        ("large_1MB", json_body(1024 * 1024)),
    ];
    for (name, body) in &bodies {
        assert!(
            canonical_json(body).is_some(),
            "the {name} body must be valid JSON"
        );
    }
    bodies
}

fn bench(c: &mut Criterion) {
    let bodies = sizes();

    let mut group = c.benchmark_group("canonical_json");
    for (name, body) in &bodies {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), body, |b, body| {
            b.iter(|| canonical_json(black_box(body)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("fingerprint");
    for (name, body) in &bodies {
        group.throughput(Throughput::Bytes(body.len() as u64));
        for (mode_name, mode) in [
            ("json", FingerprintMode::Json),
            ("bytes", FingerprintMode::Bytes),
        ] {
            group.bench_with_input(BenchmarkId::new(mode_name, name), body, |b, body| {
                b.iter(|| {
                    Fingerprint::compute(
                        mode,
                        "POST",
                        black_box("/v1/orders"),
                        None,
                        Some(b"application/json"),
                        black_box(body),
                    )
                })
            });
        }
    }
    group.finish();

    // What moving a large body's fingerprint to the blocking pool costs
    // (src/proxy/admit.rs): a round trip to a blocking thread and back
    // from a task, on the runtime idemproxy runs.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("a runtime");
    c.bench_function("spawn_blocking_round_trip", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = std::time::Instant::now();
                for _ in 0..iters {
                    tokio::task::spawn_blocking(|| black_box(1))
                        .await
                        .expect("no panic");
                }
                start.elapsed()
            })
        })
    });
}

criterion_group! {
    name = benches;
    // Short enough for a quick look; pass --measurement-time for more.
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
