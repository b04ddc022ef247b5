//! Fixtures for the fault tests: the real `idemproxy` and `sample-upstream`
//! binaries as child processes that a test can kill, pause and restart,
//! private PostgreSQL clusters ([`pgcluster`]), a real PgBouncer
//! ([`pgbouncer`]) and a TCP link whose latency a test can turn up
//! ([`slowlink`]).
//!
//! A test that uses this module also declares `mod common;` (the HTTP client
//! and the shared-server test databases live there).
#![allow(dead_code, unreachable_pub)]

pub mod chaos;
pub mod pgbouncer;
pub mod pgcluster;
pub mod previous;
pub mod slowlink;

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::common::{HttpClient, Req, Resp};

// ---------------------------------------------------------------------------
// Ports and directories.

static PORT_SEQ: AtomicU64 = AtomicU64::new(0);
static PORTS_GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// A free TCP port on 127.0.0.1 for a child process to listen on.
///
/// Chosen below the kernel's ephemeral range, so that the port cannot be
/// taken by some outgoing connection while a killed process is being
/// restarted on it, and never handed out twice by this test binary.
pub fn free_port() -> u16 {
    let (low, _) = ephemeral_range();
    let (from, to) = if low > 12_000 {
        (10_000u32, u32::from(low))
    } else {
        (0, 0)
    };
    if to > from {
        let seed = u64::from(std::process::id()).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
        for _ in 0..2000 {
            let n = splitmix(seed ^ PORT_SEQ.fetch_add(1, Ordering::SeqCst));
            let port = (from + (n % u64::from(to - from)) as u32) as u16;
            let mut given = PORTS_GIVEN.lock().unwrap();
            if given.contains(&port) {
                continue;
            }
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return port;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

/// SplitMix64: the mixing step of the seeded generators in these tests.
pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A small seeded generator (no dependency, reproducible from the seed).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix(self.0)
    }
    /// Uniform in `lo..hi` (`lo` if the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next_u64() % (hi - lo)
        }
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    pub fn pick(&mut self, n: usize) -> usize {
        self.range(0, n as u64) as usize
    }
}

/// A directory removed when dropped; kept (and named on stderr) when the
/// test fails, for its logs, unless `keep_on_failure` is off.
pub struct TempDir {
    pub path: PathBuf,
    pub keep_on_failure: bool,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "idemproxy-{tag}-{}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir {
            path,
            keep_on_failure: true,
        }
    }
    pub fn join(&self, p: &str) -> PathBuf {
        self.path.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep_on_failure && std::thread::panicking() {
            eprintln!("test failed: its files are kept in {}", self.path.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

// ---------------------------------------------------------------------------
// Child processes.

/// A child process with its output in a log file; killed when dropped.
pub struct Proc {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    pub log_path: PathBuf,
    child: Option<Child>,
    stdout: Option<BufReader<ChildStdout>>,
    /// How many times the process was started.
    pub starts: u32,
}

impl Proc {
    pub fn new(name: &str, program: &str, args: Vec<String>, log_path: PathBuf) -> Proc {
        Proc {
            name: name.into(),
            program: program.into(),
            args,
            envs: Vec::new(),
            log_path,
            child: None,
            stdout: None,
            starts: 0,
        }
    }

    pub fn env(mut self, k: &str, v: &str) -> Proc {
        self.envs.push((k.into(), v.into()));
        self
    }

    /// Starts the process; its stderr (and stdout unless `pipe_stdout`) is
    /// appended to the log file.
    pub fn spawn(&mut self, pipe_stdout: bool) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap();
        let mut marker = log.try_clone().unwrap();
        let _ = writeln!(marker, "=== start #{} of {}", self.starts + 1, self.name);
        let stdout = if pipe_stdout {
            Stdio::piped()
        } else {
            Stdio::from(log.try_clone().unwrap())
        };
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::from(log))
            .env("NO_COLOR", "1");
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.program.display()));
        self.stdout = child.stdout.take().map(BufReader::new);
        self.child = Some(child);
        self.starts += 1;
    }

    /// Reads one line of the child's piped stdout (blocking, bounded).
    pub fn read_stdout_line(&mut self, timeout: Duration) -> String {
        let mut reader = self.stdout.take().expect("stdout not piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let r = reader.read_line(&mut line).map(|_| line);
            // Keep the pipe open (the reader) for the process's lifetime.
            let _ = tx.send((r, reader));
        });
        match rx.recv_timeout(timeout) {
            Ok((Ok(line), reader)) => {
                self.stdout = Some(reader);
                line
            }
            Ok((Err(e), _)) => panic!("reading the stdout of {}: {e}", self.name),
            Err(_) => panic!(
                "{} printed nothing on stdout within {timeout:?}\n{}",
                self.name,
                self.log_tail(30)
            ),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("process not running").id()
    }

    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`, …) with kill(1):
    /// the crate forbids `unsafe`, so no direct libc call.
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args(["-s", sig, &self.pid().to_string()])
            .status()
            .expect("running kill(1)");
        assert!(status.success(), "kill -s {sig} {} failed", self.name);
    }

    pub fn pause(&self) {
        self.signal("STOP");
    }

    pub fn resume(&self) {
        self.signal("CONT");
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stdout = None;
    }

    /// Waits for the process to exit by itself.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = &mut self.child {
                if let Ok(Some(status)) = c.try_wait() {
                    self.child = None;
                    return Some(status);
                }
            } else {
                return None;
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        let from = all.len().saturating_sub(lines);
        format!(
            "--- last lines of {} ({}) ---\n{}",
            self.name,
            self.log_path.display(),
            all[from..].join("\n")
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail(40));
        }
        self.kill();
    }
}

// ---------------------------------------------------------------------------
// The sample upstream.

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
            env!("CARGO_BIN_EXE_sample-upstream"),
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
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.executions(key).await;
            if seen >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the upstream saw {seen} executions of {key}, waited for {n}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

// ---------------------------------------------------------------------------
// The proxy.

/// The knobs the fault tests turn; everything else is the built-in default.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub upstream: String,
    pub database_url: String,
    pub lease: String,
    pub upstream_timeout: String,
    pub shutdown_grace: String,
    pub store_timeout: String,
    pub pool_size: usize,
    /// Extra `[defaults]` lines.
    pub defaults: String,
    /// Extra `[store]` lines (`prepared_statements`, `listen_url`, …).
    pub store: String,
    /// `[[route]]` tables (none: the built-in catch-all route).
    pub routes: String,
}

impl ProxyConfig {
    pub fn new(upstream: &str, database_url: &str) -> ProxyConfig {
        ProxyConfig {
            upstream: upstream.into(),
            database_url: database_url.into(),
            lease: "1s".into(),
            upstream_timeout: "10s".into(),
            shutdown_grace: "5s".into(),
            store_timeout: "1s".into(),
            pool_size: 8,
            defaults: String::new(),
            store: String::new(),
            routes: String::new(),
        }
    }
    /// Behind a pooler in transaction mode: no named prepared statements,
    /// and `listen_url` (a direct session) for LISTEN and migrations.
    pub fn pooled(mut self, direct_url: &str) -> Self {
        self.store.push_str(&format!(
            "prepared_statements = false\nlisten_url = \"{direct_url}\"\n"
        ));
        self
    }
    pub fn lease(mut self, d: &str) -> Self {
        self.lease = d.into();
        self
    }
    pub fn upstream_timeout(mut self, d: &str) -> Self {
        self.upstream_timeout = d.into();
        self
    }
    pub fn shutdown_grace(mut self, d: &str) -> Self {
        self.shutdown_grace = d.into();
        self
    }
    pub fn store_timeout(mut self, d: &str) -> Self {
        self.store_timeout = d.into();
        self
    }

    fn toml(&self, listen: SocketAddr, admin: SocketAddr) -> String {
        format!(
            r#"# Written by a fault test.
[server]
listen = "{listen}"
admin_listen = "{admin}"
shutdown_grace = "{grace}"

[upstream]
url = "{upstream}"
connect_timeout = "1s"
timeout = "{upstream_timeout}"

[store]
database_url = "{db}"
timeout = "{store_timeout}"
pool_size = {pool}
{store}

[sweeper]
interval = "1h"

[defaults]
lease = "{lease}"
{defaults}

{routes}
"#,
            grace = self.shutdown_grace,
            upstream = self.upstream,
            upstream_timeout = self.upstream_timeout,
            db = self.database_url,
            store_timeout = self.store_timeout,
            pool = self.pool_size,
            lease = self.lease,
            defaults = self.defaults,
            store = self.store,
            routes = self.routes,
        )
    }
}

/// An `idemproxy serve` process on fixed ports (restarts keep them).
pub struct ProxyProc {
    pub proc: Proc,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
}

impl ProxyProc {
    /// Writes the configuration and starts the process; does not wait.
    pub fn spawn(dir: &TempDir, name: &str, config: &ProxyConfig) -> ProxyProc {
        let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let path = dir.join(&format!("{name}.toml"));
        std::fs::write(&path, config.toml(listen, admin)).unwrap();
        let mut proc = Proc::new(
            name,
            env!("CARGO_BIN_EXE_idemproxy"),
            vec![
                "serve".into(),
                "--config".into(),
                path.display().to_string(),
            ],
            dir.join(&format!("{name}.log")),
        )
        .env("RUST_LOG", "info");
        proc.spawn(false);
        ProxyProc {
            proc,
            listen,
            admin,
        }
    }

    /// Starts the process and waits until `/readyz/store` answers 200 (the
    /// store reachable and migrated: keyed requests can succeed).
    pub async fn start(dir: &TempDir, name: &str, config: &ProxyConfig) -> ProxyProc {
        let p = ProxyProc::spawn(dir, name, config);
        p.wait_ready(Duration::from_secs(20)).await;
        p
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// `GET /readyz` (None if the admin listener does not answer).
    pub async fn readyz(&self) -> Option<Resp> {
        self.admin_get("/readyz").await
    }

    async fn admin_get(&self, path: &str) -> Option<Resp> {
        tokio::time::timeout(
            Duration::from_secs(3),
            HttpClient::new().try_send(Req::get(&self.admin_url(path))),
        )
        .await
        .ok()?
        .ok()
    }

    /// `GET /readyz/store` (None if the admin listener does not answer).
    pub async fn store_readyz(&self) -> Option<Resp> {
        self.admin_get("/readyz/store").await
    }

    /// Waits until `/readyz/store` answers 200.
    pub async fn wait_ready(&self, timeout: Duration) -> Duration {
        let started = Instant::now();
        loop {
            if let Some(r) = self.store_readyz().await {
                if r.status == StatusCode::OK {
                    return started.elapsed();
                }
            }
            assert!(
                started.elapsed() < timeout,
                "{} not ready within {timeout:?}\n{}",
                self.proc.name,
                self.proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> String {
        HttpClient::new()
            .send(Req::get(&self.admin_url("/metrics")))
            .await
            .text()
    }

    /// The value of one sample line of `/metrics` (0 if absent).
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics().await, series)
    }

    /// SIGKILL, then start again on the same ports and wait until ready.
    pub async fn restart(&mut self) {
        self.proc.kill();
        self.proc.spawn(false);
        self.wait_ready(Duration::from_secs(20)).await;
    }

    /// Sends a keyed POST (fresh connection) with a bounded wait.
    pub async fn post(&self, key: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
        self.try_post(key, body, headers, Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("POST {key} via {}: {e}", self.proc.name))
    }

    pub async fn try_post(
        &self,
        key: &str,
        body: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Resp, String> {
        let mut req = Req::post(&self.url("/v1/orders")).key(key).json(body);
        for (n, v) in headers {
            req = req.header(n, v);
        }
        match tokio::time::timeout(timeout, HttpClient::new().try_send(req)).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {timeout:?}")),
        }
    }
}

/// Reads one series (`name{labels}`) from Prometheus text.
pub fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

/// Whether a TCP connection to `addr` is refused right now.
pub async fn connection_refused(addr: SocketAddr) -> bool {
    matches!(
        tokio::net::TcpStream::connect(addr).await,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// The record of one key, read directly from the database.
#[derive(Debug, Clone)]
pub struct Row {
    pub state: String,
    pub attempt: i32,
    pub owner: uuid::Uuid,
    pub lease_expired: Option<bool>,
    pub status: Option<i16>,
    pub body: Option<Vec<u8>>,
}

pub async fn read_row(db: &tokio_postgres::Client, tenant: &str, key: &str) -> Option<Row> {
    db.query_opt(
        "SELECT state, attempt, owner_token, lease_expires_at <= now(),
                response_status, response_body
           FROM idempotency_records WHERE tenant_id = $1 AND idempotency_key = $2",
        &[&tenant, &key],
    )
    .await
    .unwrap()
    .map(|r| Row {
        state: r.get(0),
        attempt: r.get(1),
        owner: r.get(2),
        lease_expired: r.get(3),
        status: r.get(4),
        body: r.get(5),
    })
}

/// Waits until the key's lease has run out by the database's clock.
pub async fn wait_lease_expired(db: &tokio_postgres::Client, key: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let row = read_row(db, "", key).await.expect("no record");
        if row.lease_expired == Some(true) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the lease of {key} never ran out: {row:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Connects to a database URL (used for private clusters).
pub async fn connect(url: &str) -> tokio_postgres::Client {
    crate::common::connect(url).await
}

/// Appends a line to a file (used for cluster configuration).
pub fn append(path: &Path, text: &str) {
    let mut f = OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

/// Writes a file.
pub fn write(path: &Path, text: &str) {
    let mut f = File::create(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}
