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
//! [`dependency_ceiling`] is a separate [`Targets`] filter that every event
//! must also pass, and a `Targets` entry covers every module under its
//! target.
//!
//! The two are one filter ([`FilterExt::and`]) on the output layer rather
//! than two layers: layered filters report the more verbose of their level
//! hints, and the ceiling's default is `trace`, so the subscriber's hint
//! was `trace` whatever `RUST_LOG` said. That hint becomes the `log`
//! crate's maximum level, and with it every `log::debug!`/`trace!` of
//! tokio-postgres (one per statement, more per message) was built into a
//! record and sent through the subscriber only to be dropped: about 4,000
//! instructions of a new key's (BENCHMARKS.md, "Eighth pass"). An `and`
//! reports the quieter hint, so those calls stop at one comparison.

use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::{Filter, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

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

/// What is written: `user` (the `RUST_LOG` filter) and, under it,
/// [`dependency_ceiling`]. Its level hint is the quieter of the two.
pub fn event_filter<S>(user: EnvFilter) -> impl Filter<S>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    user.and(dependency_ceiling())
}

/// Installs the tracing subscriber: `RUST_LOG`-style filter (default
/// `info`) under [`dependency_ceiling`], text or JSON, to standard error.
/// `log` records (tokio-postgres, rustls) are converted and filtered alike,
/// and the `log` crate's maximum level is the filter's, so a record no
/// filter would pass is not built at all.
pub fn init(format: Format) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry();
    match format {
        Format::Text => registry.with(fmt.with_filter(event_filter(filter))).init(),
        Format::Json => registry
            .with(
                fmt.json()
                    .flatten_event(true)
                    .with_filter(event_filter(filter)),
            )
            .init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::{Level, Subscriber};

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

    /// The subscriber `init` installs, with `RUST_LOG` = `user`, writing
    /// nowhere.
    fn subscriber(user: &str) -> impl tracing::Subscriber + Send + Sync {
        let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::sink);
        tracing_subscriber::registry().with(fmt.with_filter(event_filter(EnvFilter::new(user))))
    }

    #[test]
    fn the_level_hint_is_the_users_not_the_ceilings_default() {
        // The hint becomes the `log` crate's maximum level: `trace` here
        // would send every tokio-postgres debug record through the
        // subscriber.
        for (user, hint) in [
            ("warn", LevelFilter::WARN),
            ("info", LevelFilter::INFO),
            ("idemproxy=debug,warn", LevelFilter::DEBUG),
        ] {
            assert_eq!(subscriber(user).max_level_hint(), Some(hint), "{user}");
        }
    }

    #[test]
    fn the_installed_filter_still_caps_dependencies_and_passes_our_own() {
        let under = |user: &str, check: fn() -> bool| {
            tracing::subscriber::with_default(subscriber(user), check)
        };
        let pg_debug = || tracing::enabled!(target: "tokio_postgres::query", Level::DEBUG);
        let pg_info = || tracing::enabled!(target: "tokio_postgres::query", Level::INFO);
        let own_debug = || tracing::enabled!(target: "idemproxy::proxy", Level::DEBUG);
        assert!(!under("trace", pg_debug));
        assert!(!under("tokio_postgres::query=trace", pg_debug));
        assert!(under("trace", pg_info));
        assert!(under("debug", own_debug));
        assert!(!under("info", own_debug));
    }
}
