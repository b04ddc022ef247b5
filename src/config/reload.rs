//! What a reload (SIGHUP) may change in a running process.
//!
//! Routes, policies (`[defaults]` and each route's), the upstream (URL,
//! timeouts, CA file), `server.max_request_body`,
//! `server.body_read_timeout` and `store.on_store_error` apply to the
//! requests that start after the reload. Everything else is read once, at
//! start, by the listeners, the pool, the cache or the sweeper: a change to
//! it needs a restart, is reported, and keeps its running value (the rest
//! of the reload applies).

use super::print::entries;
use super::Config;

/// Keys a reload applies; every other key needs a restart.
const RELOADABLE: [&str; 3] = [
    "server.max_request_body",
    "server.body_read_timeout",
    "store.on_store_error",
];

/// Whether a change to `dotted` (`server.listen`, `route[0].lease`) needs
/// a restart.
pub fn restart_only(dotted: &str) -> bool {
    let section = dotted.split(['.', '[']).next().unwrap_or_default();
    match section {
        "upstream" | "defaults" | "route" => false,
        _ => !RELOADABLE.contains(&dotted),
    }
}

/// The keys whose change from `running` to `new` needs a restart, with
/// both values as shown by `check-config --print` (secrets redacted).
pub fn restart_only_changes(running: &Config, new: &Config) -> Vec<(String, String, String)> {
    let shown = |value: Option<String>| value.unwrap_or_else(|| "(not set)".to_string());
    entries(running)
        .into_iter()
        .zip(entries(new))
        .filter(|(old, _)| restart_only(&old.dotted()))
        .filter(|(old, new)| old.dotted() == new.dotted() && old.compared != new.compared)
        .map(|(old, new)| (old.dotted(), shown(old.shown), shown(new.shown)))
        .collect()
}

impl Config {
    /// This configuration with every restart-only value taken from
    /// `running`: what a reload applies.
    pub fn keeping_restart_only(mut self, running: &Config) -> Config {
        let reloadable = |c: &Config| (c.server.max_request_body, c.server.body_read_timeout);
        let (max_request_body, body_read_timeout) = reloadable(&self);
        let on_store_error = self.store.on_store_error;
        self.server = running.server.clone();
        self.server.max_request_body = max_request_body;
        self.server.body_read_timeout = body_read_timeout;
        self.store = running.store.clone();
        self.store.on_store_error = on_store_error;
        self.sweeper = running.sweeper.clone();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse, Overrides};

    fn config(text: &str) -> Config {
        parse(text, "t.toml", &Overrides::default()).unwrap()
    }

    #[test]
    fn listeners_and_the_store_need_a_restart_routes_and_timeouts_do_not() {
        for key in [
            "server.listen",
            "server.admin_listen",
            "server.max_connections",
            "store.database_url",
            "store.pool_size",
            "sweeper.interval",
        ] {
            assert!(restart_only(key), "{key}");
        }
        for key in [
            "route[2].lease",
            "defaults.wait",
            "upstream.timeout",
            "upstream.url",
            "store.on_store_error",
            "server.max_request_body",
        ] {
            assert!(!restart_only(key), "{key}");
        }
    }

    #[test]
    fn a_reload_keeps_restart_only_values_and_applies_the_rest() {
        let running = config(
            "[server]\nlisten = \"127.0.0.1:1000\"\n[store]\ndatabase_url = \"postgres://a:pw1@h/x\"\n",
        );
        let new = config(
            "[server]\nlisten = \"127.0.0.1:2000\"\nmax_request_body = \"10KiB\"\n\
             [store]\ndatabase_url = \"postgres://a:pw2@h/x\"\non_store_error = \"pass_through\"\n\
             [upstream]\ntimeout = \"7s\"\n",
        );
        let changes = restart_only_changes(&running, &new);
        let keys: Vec<&str> = changes.iter().map(|(k, _, _)| k.as_str()).collect();
        assert_eq!(keys, ["server.listen", "store.database_url"]);
        let shown = format!("{changes:?}");
        assert!(!shown.contains("pw1") && !shown.contains("pw2"), "{shown}");

        let applied = new.keeping_restart_only(&running);
        assert!(restart_only_changes(&running, &applied).is_empty());
        assert_eq!(applied.server.listen, running.server.listen);
        assert_eq!(applied.server.max_request_body, 10 * 1024);
        assert_eq!(
            applied.store.on_store_error,
            crate::config::OnStoreError::PassThrough
        );
        assert_eq!(applied.upstream.timeout, std::time::Duration::from_secs(7));
        assert_eq!(applied.store.database_url.expose(), "postgres://a:pw1@h/x");
    }
}
