//! The `idemproxy` binary: parse, log, run.

use std::process::ExitCode;

use clap::Parser;
use idemproxy::cli::{self, Cli};

/// mimalloc rather than the system allocator: a proxied request makes a
/// few dozen small, short-lived allocations on one worker and frees some
/// on another, which glibc's malloc serves slower (bench/allocators,
/// BENCHMARKS.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// jemalloc, for comparison (`--no-default-features --features jemalloc`).
#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
