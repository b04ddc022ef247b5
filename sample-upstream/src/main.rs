//! `sample-upstream`: a stand-in "legacy", non-idempotent HTTP API that counts
//! executions per `Idempotency-Key` (see [`sample_upstream`]).
//!
//! ```text
//! sample-upstream --listen 127.0.0.1:3000
//! sample-upstream --listen 127.0.0.1:3001 --delay-ms 2500 --charges   # the demo's legacy payment service
//! ```
//!
//! Once bound, it prints `listening on http://ADDR` as the first line on
//! stdout (useful with `--listen 127.0.0.1:0`); logs go to stderr
//! (`RUST_LOG` overrides the default `info` level). It stops cleanly on
//! SIGINT or SIGTERM.

use std::io::{IsTerminal as _, Write as _};
use std::net::SocketAddr;

use clap::Parser;
use sample_upstream::{Options, SampleUpstream};
use tracing_subscriber::EnvFilter;

/// A sample non-idempotent upstream that counts executions per Idempotency-Key.
#[derive(Debug, Parser)]
#[command(name = "sample-upstream", version, about)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "SAMPLE_UPSTREAM_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Delay every execution by this many milliseconds (a request's own
    /// x-sample-delay-ms wins): a slow legacy service.
    #[arg(long, env = "SAMPLE_UPSTREAM_DELAY_MS", value_name = "MS")]
    delay_ms: Option<u64>,
    /// Add "id": "ch_<n>" and "object": "charge" to every JSON answer, so that
    /// a Stripe SDK pointed here reads it as a Charge.
    #[arg(long, env = "SAMPLE_UPSTREAM_CHARGES")]
    charges: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let shutdown = shutdown_signal()?;
    let options = Options {
        delay: args.delay_ms.map(std::time::Duration::from_millis),
        charges: args.charges,
    };
    let upstream = SampleUpstream::start_with(args.listen, options, shutdown).await?;
    tracing::info!(addr = %upstream.addr(), "sample upstream listening");
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {}", upstream.url())?;
    stdout.flush()?;
    drop(stdout);

    upstream.stopped().await;
    tracing::info!(total = upstream.total_requests(), "sample upstream stopped");
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM. The handlers are
/// installed before returning, so an early signal is not lost.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    #[cfg(unix)]
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    Ok(async move {
        #[cfg(unix)]
        let signal = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        #[cfg(not(unix))]
        let signal = match tokio::signal::ctrl_c().await {
            Ok(()) => "Ctrl-C",
            Err(_) => std::future::pending().await,
        };
        tracing::info!(signal, "shutting down");
    })
}
