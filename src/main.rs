//! The `idemproxy` binary: parse, log, run.

use std::process::ExitCode;

use clap::Parser;
use idemproxy::cli::{self, Cli};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    cli::init_logging(cli.log_format);
    match cli::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idemproxy: {e:#}");
            ExitCode::FAILURE
        }
    }
}
