//! The `idemproxy` binary: parse, log, run.

use std::process::ExitCode;

use clap::Parser;
use idemproxy::cli::{self, Cli};

/// mimalloc rather than the system allocator: a proxied request makes a
/// few dozen small, short-lived allocations on one worker and frees some
/// on another, which glibc's malloc serves slower (bench/allocators,
/// BENCHMARKS.md). Through `idemproxy-alloc` (the workspace's `alloc/`),
/// which skips mimalloc's aligned paths where every block is aligned.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: idemproxy_alloc::Mimalloc = idemproxy_alloc::Mimalloc;

/// jemalloc, for comparison (`--no-default-features --features jemalloc`).
#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("idemproxy: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        cli::init_logging(cli.log_format);
        match cli::run(cli).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("idemproxy: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}

/// The main runtime: the command itself and, under `serve`, everything but
/// the proxy listener's requests (admin endpoints, renewals, group commit,
/// the sweeper, reloads), which needs one thread. The requests are served
/// by `serve`'s own worker threads, one per CPU available to the process
/// (affinity and cgroup quota included) or `TOKIO_WORKER_THREADS`
/// (docs/operations.md, "CPU and memory"). tokio would panic on a value
/// that is not a positive whole number; it is refused here, for every
/// command, with a clear message instead.
fn runtime() -> Result<tokio::runtime::Runtime, String> {
    idemproxy::workers::count_from_env()?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}
