//! The client examples of `examples/` (Python, Node, Go) do retries right:
//! each is run against idemproxy in front of the sample upstream made slow
//! (every execution takes longer than the example's per-attempt timeout),
//! so the first attempt times out and the example retries. The upstream
//! must have executed the order exactly once, the example must have sent
//! more than one attempt with one key, and its answer must be the
//! original's.
//!
//! Each toolchain is required: `python3` and `node` on PATH (or
//! IDEMPROXY_PYTHON, IDEMPROXY_NODE), `go` on PATH or in /usr/lib/go/bin
//! (or IDEMPROXY_GO). `scripts/dev test` installs Debian's `golang-go`
//! when Go is missing and it runs as root; a missing toolchain fails the
//! test, with what to install.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use sample_upstream::{Options, SampleUpstream};
use support::db::TestDb;
use support::harness::{start_proxy, Setup};
use support::process::TempDir;
use tokio::process::Command;

/// Every execution at the upstream takes this long...
const UPSTREAM_DELAY: Duration = Duration::from_millis(1500);
/// ...and every attempt of an example gives up after this long.
const CLIENT_TIMEOUT_MS: &str = "500";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A toolchain binary: the variable, else the first candidate that runs.
fn tool(var: &str, candidates: &[&str], install: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        return PathBuf::from(path);
    }
    for candidate in candidates {
        let runs = std::process::Command::new(candidate)
            .arg(if candidate.ends_with("go") {
                "version"
            } else {
                "--version"
            })
            .output()
            .is_ok_and(|o| o.status.success());
        if runs {
            return PathBuf::from(candidate);
        }
    }
    panic!(
        "{candidates:?} not found: {install}, or set {var} (scripts/dev test installs Go as root)"
    );
}

/// Builds the Go example once into `dir` and returns the binary.
async fn build_go(dir: &Path) -> PathBuf {
    let go = tool(
        "IDEMPROXY_GO",
        &["go", "/usr/lib/go/bin/go"],
        "install Go 1.19 or newer (Debian/Ubuntu: apt-get install golang-go)",
    );
    let bin = dir.join("create-order-go");
    let out = Command::new(&go)
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(repo().join("examples/go"))
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .output()
        .await
        .expect("running go build");
    assert!(
        out.status.success(),
        "go build of examples/go failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

struct Run {
    outcome: serde_json::Value,
    stderr: String,
}

async fn run_example(mut cmd: Command, base: &str) -> Run {
    cmd.arg(base)
        .env("EXAMPLE_TIMEOUT_MS", CLIENT_TIMEOUT_MS)
        .env("EXAMPLE_ATTEMPTS", "10")
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the example did not finish within 60 s")
        .expect("running the example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "the example failed ({}):\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    let line = stdout.lines().last().unwrap_or_default();
    let outcome = serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("the example's last line is not JSON ({e}): {stdout}"));
    Run { outcome, stderr }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn examples_retry_with_one_key_and_the_upstream_executes_once() {
    let dir = TempDir::new("examples");
    // Go first: a cold build is the slow part, and a missing toolchain
    // should fail before anything else starts.
    let go_bin = build_go(&dir.path).await;
    let python = tool(
        "IDEMPROXY_PYTHON",
        &["python3"],
        "install Python 3 (Debian/Ubuntu: apt-get install python3)",
    );
    let node = tool(
        "IDEMPROXY_NODE",
        &["node"],
        "install Node.js 18 or newer (Debian/Ubuntu: apt-get install nodejs)",
    );

    let db = TestDb::new().await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let options = Options {
        delay: Some(UPSTREAM_DELAY),
        charges: false,
    };
    let upstream = SampleUpstream::start_with("127.0.0.1:0".parse().unwrap(), options, async {
        let _ = stop_rx.await;
    })
    .await
    .unwrap();
    let setup = Setup::default().defaults("lease = \"3s\"\n");
    let proxy = start_proxy(&setup, &upstream.url(), &db.url, true).await;
    let base = format!("http://{}", proxy.proxy_addr);

    let mut python_cmd = Command::new(python);
    python_cmd.arg(repo().join("examples/python/create_order.py"));
    let mut node_cmd = Command::new(node);
    node_cmd.arg(repo().join("examples/node/create_order.mjs"));
    let go_cmd = Command::new(go_bin);

    // Side by side: each example has its own key.
    let (py, js, go) = tokio::join!(
        run_example(python_cmd, &base),
        run_example(node_cmd, &base),
        run_example(go_cmd, &base),
    );
    for (name, run) in [("python", py), ("node", js), ("go", go)] {
        let o = &run.outcome;
        let key = o["key"].as_str().expect("a key in the outcome");
        let attempts = o["attempts"].as_u64().unwrap();
        assert!(
            attempts > 1,
            "{name}: the first attempt should have timed out and been retried: {o}\n{}",
            run.stderr
        );
        assert!(
            run.stderr.lines().count() as u64 >= attempts,
            "{name}: one stderr line per attempt: {}",
            run.stderr
        );
        assert_eq!(o["status"], 201, "{name}: {o}");
        assert_eq!(
            o["replayed"], true,
            "{name}: the answer is the original's, replayed: {o}"
        );
        assert_eq!(o["body"]["key"], key, "{name}: {o}");
        assert_eq!(o["body"]["key_executions"], 1, "{name}: {o}");
        assert_eq!(o["body"]["attempt"], "1", "{name}: {o}");
        // All attempts carried the same key: the upstream saw it once, and
        // no other key.
        assert_eq!(upstream.executions(key), 1, "{name}: executions of {key}");
    }
    assert_eq!(
        upstream.total_requests(),
        3,
        "one execution per example: {:?}",
        upstream
            .requests()
            .iter()
            .map(|r| &r.key)
            .collect::<Vec<_>>()
    );

    proxy.shutdown().await;
    let _ = stop_tx.send(());
    upstream.stopped().await;
}
