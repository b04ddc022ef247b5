//! Child processes a test can kill, pause and restart ([`Proc`]), with
//! their output in a log file; the ports and directories they use.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::poll;
use super::rng::splitmix;

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

/// A child process with its output in a log file; killed when dropped.
pub struct Proc {
    pub name: String,
    program: PathBuf,
    pub(super) args: Vec<String>,
    envs: Vec<(String, String)>,
    pub log_path: PathBuf,
    child: Option<Child>,
    stdout: Option<BufReader<ChildStdout>>,
    /// How many times the process was started.
    pub starts: u32,
}

impl Proc {
    pub fn new(
        name: &str,
        program: impl Into<PathBuf>,
        args: Vec<String>,
        log_path: PathBuf,
    ) -> Proc {
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
        let child = &mut self.child;
        poll(timeout, || {
            // Some(None): there is no process to wait for.
            let seen = match child {
                Some(c) => match c.try_wait() {
                    Ok(Some(status)) => {
                        *child = None;
                        Some(Some(status))
                    }
                    _ => None,
                },
                None => Some(None),
            };
            std::future::ready(seen)
        })
        .await
        .flatten()
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

/// Whether a TCP connection to `addr` is refused right now.
pub async fn connection_refused(addr: SocketAddr) -> bool {
    matches!(
        tokio::net::TcpStream::connect(addr).await,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
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
