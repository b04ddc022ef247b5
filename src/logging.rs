//! The tracing subscriber, and the ceiling that keeps bodies and stored
//! header values out of the log at every level (DESIGN.md §5, §8.7).
//!
//! `RUST_LOG` chooses what is logged, with one exception: dependencies that
//! print what they carry are held at `info` whatever it says.
//! tokio-postgres logs every statement's parameters at `debug` — the stored
//! response bodies and header values such as `Set-Cookie` —, and h2 prints
//! a `TE` header value at `trace`. Our own `debug!`/`trace!` sites name
//! keys, addresses and errors, never a body or a header value.
//!
//! Why a second filter rather than `tokio_postgres=info` appended to the
//! user's `EnvFilter`: an appended directive replaces one for the same
//! target only; the most specific directive wins, so
//! `RUST_LOG=tokio_postgres::query=debug` would still print parameters.
//! [`dependency_ceiling`] is a separate [`Targets`] layer that every event
//! must also pass, and a `Targets` entry covers every module under its
//! target.

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// How lines are written (the command's `--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Human-readable.
    Text,
    /// One JSON object per line, fields flattened.
    Json,
}

/// Dependencies held at `info` or quieter, whatever `RUST_LOG` says.
pub const CAPPED_TARGETS: &[&str] = &[
    // Statement parameters at debug: stored bodies and header values.
    "tokio_postgres",
    "postgres_protocol",
    "tokio_postgres_rustls",
    // A TE header value at trace; frames (without their contents) at debug.
    "h2",
    // No events unless built with hyper's unstable tracing; capped so that
    // turning it on cannot leak either.
    "hyper",
    "hyper_util",
    // Handshake details only; capped for the same reason.
    "rustls",
];

/// The ceiling every event must pass besides the `RUST_LOG` filter.
pub fn dependency_ceiling() -> Targets {
    CAPPED_TARGETS.iter().fold(
        Targets::new().with_default(LevelFilter::TRACE),
        |t, target| t.with_target(*target, LevelFilter::INFO),
    )
}

/// Installs the tracing subscriber: `RUST_LOG`-style filter (default
/// `info`) under [`dependency_ceiling`], text or JSON, to standard error.
/// `log` records (tokio-postgres, rustls) are converted and filtered alike.
pub fn init(format: Format) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(dependency_ceiling());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        Format::Text => registry.with(fmt).init(),
        Format::Json => registry.with(fmt.json().flatten_event(true)).init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    #[test]
    fn dependencies_that_print_parameters_are_capped_at_info_in_every_module() {
        let ceiling = dependency_ceiling();
        for target in [
            "tokio_postgres::query",
            "tokio_postgres",
            "postgres_protocol::message",
            "h2::frame",
        ] {
            assert!(!ceiling.would_enable(target, &Level::DEBUG), "{target}");
            assert!(ceiling.would_enable(target, &Level::INFO), "{target}");
        }
    }

    #[test]
    fn our_own_modules_keep_every_level() {
        let ceiling = dependency_ceiling();
        assert!(ceiling.would_enable("idemproxy::proxy::execute", &Level::TRACE));
    }
}
