//! The previous release, built from its commit, for the mixed-version test
//! (`tests/mixed_versions.rs`).
//!
//! The release is the newest one in CHANGELOG.md (`## 0.1.0 — DATE —
//! commit 3d45772`): the heading names the commit, so a clone without tags
//! still finds it. Its sources are exported with `git archive` into a cache
//! outside the repository (`$IDEMPROXY_CI_CACHE`, default
//! `~/.cache/idemproxy-ci`, then `previous/<full commit>/`) and built there
//! with `cargo build --locked --bins` (debug, no debug info: the test needs
//! behaviour, not speed). Only the binary is kept, so a machine pays for
//! the build once per release and keeps a few dozen megabytes.
//!
//! A clone that lacks the commit (a shallow CI checkout) makes the test
//! FAIL with what to do: a skipped compatibility test is one nobody reads.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use http::StatusCode;

use super::process::{free_port, Proc, TempDir};
use super::proxy_proc::{ProxyConfig, ProxyProc};

/// A release as CHANGELOG.md records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// `0.1.0`.
    pub version: String,
    /// The commit as written in the heading (short or full).
    pub commit: String,
}

/// The newest release heading of a Keep-a-Changelog file:
/// `## VERSION — DATE — commit SHA` (an ASCII `-` is accepted for `—`).
/// `## Unreleased` and other headings are skipped.
pub fn newest_release(changelog: &str) -> Option<Release> {
    changelog.lines().find_map(|line| {
        let rest = line.strip_prefix("## ")?;
        let parts: Vec<&str> = rest
            .split(['—', '–'])
            .flat_map(|p| p.split(" - "))
            .map(str::trim)
            .collect();
        let [version, _date, commit] = parts[..] else {
            return None;
        };
        let commit = commit.strip_prefix("commit ")?.trim();
        let version = version.trim_start_matches(['[', 'v']).trim_end_matches(']');
        let valid = version.split('.').count() >= 3
            && commit.len() >= 7
            && commit.chars().all(|c| c.is_ascii_hexdigit());
        valid.then(|| Release {
            version: version.to_owned(),
            commit: commit.to_owned(),
        })
    })
}

/// The previous release's `idemproxy` binary, ready to run.
#[derive(Debug)]
pub struct PreviousBinary {
    pub release: Release,
    /// The full commit.
    pub commit: String,
    pub bin: PathBuf,
    /// Whether this call built it (false: found in the cache).
    pub built: bool,
    pub build_time: Duration,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("IDEMPROXY_CI_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("idemproxy-ci")
}

/// Builds (once per machine) or finds the previous release's binary.
/// Panics, never skips, when it cannot.
pub fn previous_binary() -> &'static PreviousBinary {
    static BIN: OnceLock<PreviousBinary> = OnceLock::new();
    BIN.get_or_init(build_previous)
}

fn git(args: &[&str]) -> Result<String, String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running git: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn build_previous() -> PreviousBinary {
    let changelog_path = repo().join("CHANGELOG.md");
    let changelog = std::fs::read_to_string(&changelog_path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", changelog_path.display()));
    let release = newest_release(&changelog)
        .expect("CHANGELOG.md has no release heading of the form `## VERSION — DATE — commit SHA`");
    let commit = git(&[
        "rev-parse",
        "--verify",
        "--quiet",
        &format!("{}^{{commit}}", release.commit),
    ])
    .unwrap_or_else(|e| {
        panic!(
            "the previous release {} (CHANGELOG.md: commit {}) is not in this clone{}.\n\
             The mixed-version test builds that commit and does not skip: fetch the history \
             (`git fetch --unshallow --tags`, or a full-depth checkout in CI) and run it again.",
            release.version,
            release.commit,
            if e.is_empty() {
                String::from(" (a shallow clone?)")
            } else {
                format!(" ({e}; a shallow clone?)")
            }
        )
    });
    let dir = cache_root().join("previous").join(&commit);
    let bin = dir.join("bin").join("idemproxy");
    if bin.is_file() {
        return PreviousBinary {
            release,
            commit,
            bin,
            built: false,
            build_time: Duration::ZERO,
        };
    }
    let started = Instant::now();
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("src");
    if !src.join("Cargo.toml").is_file() {
        let tmp = dir.join(format!("src.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let archive = Command::new("sh")
            .arg("-c")
            .arg(r#"git -C "$1" archive --format=tar "$2" | tar -x -C "$3""#)
            .args(["sh", &repo().display().to_string(), &commit])
            .arg(&tmp)
            .status()
            .expect("running git archive | tar");
        assert!(archive.success(), "git archive {commit} | tar failed");
        // Another test process may have won the race: its copy is as good.
        if std::fs::rename(&tmp, &src).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    let target = dir.join("target");
    let log_path = dir.join("build.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!(
        "building the previous release {} (commit {}) in {} (once per machine)",
        release.version,
        release.commit,
        dir.display()
    );
    let status = Command::new(cargo)
        .args(["build", "--locked", "--bins", "--manifest-path"])
        .arg(src.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .env("CARGO_INCREMENTAL", "0")
        .env("CARGO_PROFILE_DEV_DEBUG", "0")
        .env("IDEMPROXY_BUILD_COMMIT", &release.commit)
        .current_dir(&src)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .status()
        .expect("running cargo build for the previous release");
    if !status.success() {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        panic!(
            "building the previous release {} (commit {commit}) failed; log {}:\n{}",
            release.version,
            log_path.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    let staged = dir.join(format!("idemproxy.tmp-{}", std::process::id()));
    std::fs::copy(target.join("debug").join("idemproxy"), &staged).unwrap();
    std::fs::rename(&staged, &bin).unwrap();
    // Only the binary is worth keeping.
    let _ = std::fs::remove_dir_all(&target);
    let _ = std::fs::remove_dir_all(&src);
    PreviousBinary {
        release,
        commit,
        bin,
        built: true,
        build_time: started.elapsed(),
    }
}

/// Which binary a replica runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// The previous release (CHANGELOG.md).
    Previous,
    /// This tree.
    Current,
}

impl Version {
    pub fn bin(self) -> PathBuf {
        match self {
            Version::Previous => previous_binary().bin.clone(),
            Version::Current => PathBuf::from(env!("CARGO_BIN_EXE_idemproxy")),
        }
    }

    /// The admin path that answers 200 once keyed requests can succeed:
    /// 0.1.0's `/readyz` followed the store; since the readiness split
    /// (DESIGN §8.1) that is `/readyz/store`.
    fn ready_path(self) -> &'static str {
        match self {
            Version::Previous => "/readyz",
            Version::Current => "/readyz/store",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Version::Previous => "previous",
            Version::Current => "current",
        }
    }

    /// Runs `idemproxy ARGS` of this version against `database_url`.
    pub fn run(self, args: &[&str], database_url: &str) -> std::process::Output {
        Command::new(self.bin())
            .args(args)
            .env_remove("IDEMPROXY_CONFIG")
            .env("IDEMPROXY_DATABASE_URL", database_url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("running the {} idemproxy: {e}", self.label()))
    }
}

/// An `idemproxy serve` replica of either version.
pub struct Replica {
    pub version: Version,
    pub proxy: ProxyProc,
}

impl Replica {
    /// Starts a replica and waits until it can serve keyed requests.
    pub async fn start(dir: &TempDir, name: &str, version: Version, config: &ProxyConfig) -> Self {
        let listen = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let path = dir.join(&format!("{name}.toml"));
        std::fs::write(&path, config.toml(listen, admin)).unwrap();
        let mut proc = Proc::new(
            name,
            version.bin().display().to_string(),
            vec![
                "serve".into(),
                "--config".into(),
                path.display().to_string(),
            ],
            dir.join(&format!("{name}.log")),
        )
        .env("RUST_LOG", "info");
        proc.spawn(false);
        let replica = Replica {
            version,
            proxy: ProxyProc {
                proc,
                listen,
                admin,
                config_path: path,
            },
        };
        replica.wait_ready().await;
        replica
    }

    pub async fn wait_ready(&self) {
        let started = Instant::now();
        let timeout = Duration::from_secs(20);
        loop {
            if let Some(r) = self.proxy.admin_get(self.version.ready_path()).await {
                if r.status == StatusCode::OK {
                    return;
                }
            }
            assert!(
                started.elapsed() < timeout,
                "{} not ready within {timeout:?}\n{}",
                self.proxy.proc.name,
                self.proxy.proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// SIGKILL, then start again on the same ports.
    pub async fn restart(&mut self) {
        self.proxy.proc.kill();
        self.proxy.proc.spawn(false);
        self.wait_ready().await;
    }

    pub fn name(&self) -> &str {
        &self.proxy.proc.name
    }
}
