//! The `sample-upstream` binary as a child process ([`UpstreamProc`]), for
//! tests that kill and restart the upstream.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use http::StatusCode;

use super::http::{HttpClient, Req};
use super::poll_until;
use super::process::{Proc, TempDir};

/// The `sample-upstream` binary, restartable on the same address.
pub struct UpstreamProc {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl UpstreamProc {
    /// Starts it on a port-0 socket and reads the address from the first
    /// line it prints (`listening on http://ADDR`).
    pub async fn start(dir: &TempDir) -> UpstreamProc {
        let mut proc = Proc::new(
            "sample-upstream",
            sample_upstream_bin(),
            vec!["--listen".into(), "127.0.0.1:0".into()],
            dir.join("sample-upstream.log"),
        )
        .env("RUST_LOG", "warn");
        proc.spawn(true);
        let line = proc.read_stdout_line(Duration::from_secs(20));
        let url = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"));
        let addr: SocketAddr = url.parse().unwrap();
        // Restarts reuse the address, so proxies need no new configuration.
        proc.args = vec!["--listen".into(), addr.to_string()];
        UpstreamProc { proc, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Starts it again on the same address (its counters start from zero).
    pub async fn restart(&mut self) {
        self.proc.kill();
        self.proc.spawn(true);
        let line = self.proc.read_stdout_line(Duration::from_secs(20));
        assert!(line.contains(&self.addr.to_string()), "{line}");
    }

    /// `GET /__sample/stats`: `{"total": n, "keys": {key: n}}`.
    pub async fn stats(&self) -> serde_json::Value {
        let r = HttpClient::new()
            .send(Req::get(&format!("{}/__sample/stats", self.url())))
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        r.json()
    }

    /// Executions of `key` counted by this process (since its last start).
    pub async fn executions(&self, key: &str) -> u64 {
        let r = HttpClient::new()
            .send(Req::get(&format!(
                "{}/__sample/executions?key={key}",
                self.url()
            )))
            .await;
        r.json()["executions"].as_u64().unwrap()
    }

    /// Waits until the upstream has counted `n` executions of `key`.
    pub async fn wait_executions(&self, key: &str, n: u64, timeout: Duration) {
        let what = format!("{n} executions of {key} at the upstream");
        poll_until(timeout, what, || async {
            let seen = self.executions(key).await;
            if seen >= n {
                Ok(())
            } else {
                Err(format!("{seen} executions"))
            }
        })
        .await
    }
}

/// The `sample-upstream` binary of this build.
///
/// It belongs to another package of the workspace, and Cargo hands a test
/// only its own package's binaries (`CARGO_BIN_EXE_*`), so it is found
/// beside the test executable: `target/<profile>/deps/<test>` →
/// `target/<profile>/sample-upstream`. Once per test process, when run by
/// Cargo, `cargo build -p sample-upstream` makes sure it is there and up to
/// date (a no-op after `cargo test --workspace` or `scripts/dev test`,
/// which build it first), so `cargo test --test faults` alone works too.
pub fn sample_upstream_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test executable's path");
        let profile_dir = exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("the test executable is in target/<profile>/deps");
        let bin = profile_dir.join(format!("sample-upstream{}", std::env::consts::EXE_SUFFIX));
        if let Some(cargo) = std::env::var_os("CARGO") {
            let mut cmd = std::process::Command::new(cargo);
            cmd.args([
                "build",
                "--quiet",
                "-p",
                "sample-upstream",
                "--bin",
                "sample-upstream",
            ]);
            match profile_dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") | None => {}
                Some("release") => {
                    cmd.arg("--release");
                }
                Some(profile) => {
                    cmd.args(["--profile", profile]);
                }
            }
            let out = cmd
                .output()
                .expect("running cargo build -p sample-upstream");
            assert!(
                out.status.success(),
                "cargo build -p sample-upstream failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            bin.is_file(),
            "no {} (build it with `cargo build -p sample-upstream`, or run \
             `cargo test --workspace` or `scripts/dev test`)",
            bin.display()
        );
        bin
    })
    .clone()
}
