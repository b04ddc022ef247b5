//! Running the `idemproxy` binary as a command, the way an operator does.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_idemproxy");

/// What a finished command left behind.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// Both streams, for assertion messages.
    pub fn both(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }
}

/// A command with a clean environment for idemproxy's own variables, run
/// from the repository (so relative config paths resolve), plus `env`.
pub fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("IDEMPROXY_DATABASE_URL")
        .env_remove("IDEMPROXY_CONFIG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `idemproxy ARGS` to completion (at most 20 s).
pub async fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = tokio::time::timeout(Duration::from_secs(20), command(args, env).output())
        .await
        .unwrap_or_else(|_| panic!("idemproxy {args:?} did not finish"))
        .expect("running the idemproxy binary");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
