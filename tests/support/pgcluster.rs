//! Private PostgreSQL clusters for tests that stop, restart or fail over
//! their database. Never the machine's shared server: each cluster is
//! initialised in a temporary directory from the installed server binaries,
//! listens on 127.0.0.1 only, and is stopped and deleted when dropped (also
//! when the test fails).
//!
//! As root, PostgreSQL refuses to run, so every server command runs as an
//! unprivileged user through `runuser` (the `postgres` user when it exists,
//! else `nobody`; `IDEMPROXY_TEST_PG_USER` overrides), as `scripts/dev` does.
//!
//! The clusters run with `fsync = off`: the tests kill processes, not the
//! machine, and nothing written to the kernel is lost when a process dies.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::process::{append, free_port, TempDir};

/// One cluster.
pub struct PgCluster {
    pub name: String,
    bindir: PathBuf,
    dir: TempDir,
    pub data: PathBuf,
    pub port: u16,
    log: PathBuf,
    run_as: Option<String>,
    /// Every process of the server is stopped (SIGSTOP): a hung host.
    frozen: AtomicBool,
}

/// The directory with `initdb`, `pg_ctl` and `postgres`:
/// `IDEMPROXY_PG_BINDIR`, else the newest `/usr/lib/postgresql/*/bin`.
pub fn bindir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("IDEMPROXY_PG_BINDIR") {
        return Some(d.into());
    }
    let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let version: Vec<u32> = e
                .file_name()
                .to_str()?
                .split('.')
                .map(|p| p.parse().ok())
                .collect::<Option<_>>()?;
            let bin = e.path().join("bin");
            ["initdb", "pg_ctl", "postgres", "pg_basebackup"]
                .iter()
                .all(|t| bin.join(t).is_file())
                .then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, b)| b)
}

/// The server binaries; panics, naming what to install, when there are
/// none. A test that cannot run fails: a skip that passes would hide the
/// missing coverage, in CI and on a developer's machine alike.
pub fn require_bindir(test: &str) -> PathBuf {
    bindir().unwrap_or_else(|| {
        panic!(
            "{test} needs the PostgreSQL server binaries (initdb, pg_ctl, postgres, \
             pg_basebackup), found in neither IDEMPROXY_PG_BINDIR nor \
             /usr/lib/postgresql/*/bin: install the PostgreSQL server package \
             (Debian/Ubuntu: postgresql) or set IDEMPROXY_PG_BINDIR"
        )
    })
}

/// [`require_bindir`], under its former name: it no longer skips (a test
/// that cannot run fails), so it always returns `Some`.
pub fn bindir_or_skip(test: &str) -> Option<PathBuf> {
    Some(require_bindir(test))
}

pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// The unprivileged user that server processes run as when the tests run
/// as root (`None` otherwise).
pub(crate) fn server_user() -> Option<String> {
    if !is_root() {
        return None;
    }
    if let Ok(u) = std::env::var("IDEMPROXY_TEST_PG_USER") {
        return Some(u);
    }
    let exists = |u: &str| {
        Command::new("id")
            .arg("-u")
            .arg(u)
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    Some(
        if exists("postgres") {
            "postgres"
        } else {
            "nobody"
        }
        .into(),
    )
}

impl PgCluster {
    /// `initdb` a new cluster (not started). `conf` is appended to its
    /// `postgresql.conf`.
    pub fn init(bindir: &Path, name: &str, conf: &str) -> PgCluster {
        let c = PgCluster::empty(bindir, name);
        c.run(
            "initdb",
            &[
                "-D",
                &c.data.display().to_string(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        );
        c.configure(conf);
        c
    }

    /// A streaming standby of `primary` made with `pg_basebackup -R`
    /// (not started). `conf` is appended after the primary's settings.
    pub fn standby_of(primary: &PgCluster, name: &str, conf: &str) -> PgCluster {
        let c = PgCluster::empty(&primary.bindir, name);
        c.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-D",
                &c.data.display().to_string(),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        );
        c.configure(conf);
        c
    }

    fn empty(bindir: &Path, name: &str) -> PgCluster {
        let run_as = server_user();
        let mut dir = TempDir::new(&format!("pg-{name}"));
        // Its server log is printed on failure; the data is not worth keeping.
        dir.keep_on_failure = false;
        if let Some(user) = &run_as {
            let ok =
                |out: std::io::Result<std::process::ExitStatus>| out.is_ok_and(|s| s.success());
            let chown = |p: &Path| {
                ok(Command::new("chown")
                    .arg(format!("{user}:"))
                    .arg(p)
                    .status())
            };
            assert!(chown(&dir.path), "chown {user} {}", dir.path.display());
            // The server user must be able to reach the directory; a private
            // TMPDIR may not let it, /tmp does.
            let reachable = ok(Command::new("runuser")
                .args(["-u", user, "--", "test", "-w"])
                .arg(&dir.path)
                .status());
            if !reachable {
                let fallback = PathBuf::from("/tmp").join(dir.path.file_name().unwrap());
                std::fs::create_dir_all(&fallback).unwrap();
                assert!(chown(&fallback), "chown {user} {}", fallback.display());
                dir = TempDir {
                    path: fallback,
                    keep_on_failure: false,
                };
            }
        }
        let data = dir.join("data");
        let log = dir.join("server.log");
        PgCluster {
            name: name.into(),
            bindir: bindir.into(),
            data,
            port: free_port(),
            log,
            run_as,
            frozen: AtomicBool::new(false),
            dir,
        }
    }

    fn configure(&self, conf: &str) {
        append(
            &self.data.join("postgresql.conf"),
            &format!(
                "\n# Written by the idemproxy fault tests.\n\
                 listen_addresses = '127.0.0.1'\n\
                 port = {}\n\
                 unix_socket_directories = ''\n\
                 fsync = off\n\
                 shared_buffers = 16MB\n\
                 max_connections = 60\n\
                 {conf}\n",
                self.port
            ),
        );
    }

    /// Runs a server binary as the cluster's user; panics with its output
    /// on failure.
    fn run(&self, tool: &str, args: &[&str]) -> Output {
        let out = self.try_run(tool, args);
        assert!(
            out.status.success(),
            "{tool} {args:?} failed for cluster {}:\n{}{}\n{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log_tail(20)
        );
        out
    }

    fn try_run(&self, tool: &str, args: &[&str]) -> Output {
        let program = self.bindir.join(tool);
        let mut cmd = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        cmd.args(args)
            .current_dir("/")
            .env("LC_ALL", "C")
            .env_remove("PGDATA")
            .env_remove("PGPORT")
            .env_remove("PGHOST");
        cmd.output()
            .unwrap_or_else(|e| panic!("running {}: {e}", program.display()))
    }

    fn pg_ctl(&self, args: &[&str]) -> Output {
        let data = self.data.display().to_string();
        let log = self.log.display().to_string();
        let mut all = vec!["-D", &data, "-l", &log, "-w", "-t", "60"];
        all.extend_from_slice(args);
        self.run("pg_ctl", &all)
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) {
        self.pg_ctl(&["start"]);
    }

    /// `pg_ctl stop -m fast`: clients are disconnected, a checkpoint is
    /// written.
    pub fn stop_fast(&self) {
        self.pg_ctl(&["-m", "fast", "stop"]);
    }

    /// `pg_ctl stop -m immediate`: as if the server crashed.
    pub fn stop_immediate(&self) {
        self.pg_ctl(&["-m", "immediate", "stop"]);
    }

    /// Promotes a standby and waits until it accepts writes.
    pub fn promote(&self) {
        self.pg_ctl(&["promote"]);
    }

    /// Stops (`freeze(true)`) or continues every process of the server —
    /// postmaster and backends — as a hung host would: connections are
    /// still accepted by the kernel, and then nothing answers.
    pub fn freeze(&self, frozen: bool) {
        let postmaster: u32 = std::fs::read_to_string(self.data.join("postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse().ok())
            .expect("the server is not running");
        let mut pids = vec![postmaster];
        // Its children, from /proc (no procps needed).
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // pid (comm) state ppid …: comm may hold spaces, so split after ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if ppid == Some(postmaster) {
                pids.push(pid);
            }
        }
        let sig = if frozen { "STOP" } else { "CONT" };
        for pid in pids {
            let _ = Command::new("kill")
                .args(["-s", sig, &pid.to_string()])
                .status();
        }
        self.frozen.store(frozen, Ordering::SeqCst);
    }

    pub fn is_running(&self) -> bool {
        self.data.join("postmaster.pid").exists()
    }

    /// `postgres://postgres@127.0.0.1:PORT/DB`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The whole server log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let from = all.len().saturating_sub(lines);
        format!(
            "--- last lines of the {} server log ---\n{}",
            self.name,
            all[from..].join("\n")
        )
    }

    /// Waits until a connection succeeds (e.g. after a promotion).
    pub async fn wait_accepting(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls)
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "{} does not accept connections",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail(30));
        }
        if self.frozen.load(Ordering::SeqCst) {
            self.freeze(false);
        }
        if self.is_running() {
            let data = self.data.display().to_string();
            let _ = self.try_run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
        }
        // TempDir removes the directory (root may remove the server user's
        // files; a non-root user owns them).
    }
}
