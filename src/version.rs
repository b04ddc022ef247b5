//! What this binary is: the package version and the commit it was built
//! from (recorded by `build.rs`; "unknown" outside a git work tree unless
//! `IDEMPROXY_BUILD_COMMIT` was set). Shown by `idemproxy --version` and
//! the `idemproxy_build_info` gauge.

/// The package version (`Cargo.toml`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The short commit the binary was built from, or "unknown".
pub const COMMIT: &str = env!("IDEMPROXY_BUILD_COMMIT");

/// How the build used profile-guided optimisation (`build.rs`):
/// "profile-guided" (built with the committed profile), "instrumented" (a
/// training build: slower, and it writes counts when it exits; never one
/// to deploy) or "none".
pub const PGO: &str = env!("IDEMPROXY_BUILD_PGO");

/// `0.1.0 (commit 3d45772, pgo profile-guided)`: what `--version` prints
/// after the name.
pub const LONG: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("IDEMPROXY_BUILD_COMMIT"),
    ", pgo ",
    env!("IDEMPROXY_BUILD_PGO"),
    ")"
);
