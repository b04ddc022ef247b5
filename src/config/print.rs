//! The effective configuration as text (`check-config --print`): every key
//! of the typed [`Config`] in the file's own syntax, each followed by where
//! its value came from, secrets redacted. The same entries tell a reload
//! which keys changed (see `reload`).

use std::fmt::Write as _;
use std::time::Duration;

use super::locate::line_of_key;
use super::{Config, DerivedKey, KeyRequirement, OnStoreError, Policy, Resolved, Route, Secret};
use crate::idempotency::fingerprint::FingerprintMode;

/// One key of the effective configuration.
pub(super) struct Entry {
    /// `server`, `defaults`, `route`.
    pub(super) section: &'static str,
    /// The route's index, for `route`.
    pub(super) index: Option<usize>,
    /// The key in its section.
    pub(super) key: &'static str,
    /// The value in TOML syntax (secrets redacted); `None`: not set.
    pub(super) shown: Option<String>,
    /// What a reload compares: the value itself, secrets included. Never
    /// printed nor logged.
    pub(super) compared: String,
}

impl Entry {
    /// `store.pool_size`, `route[1].lease`.
    pub(super) fn dotted(&self) -> String {
        match self.index {
            Some(index) => format!("{}[{index}].{}", self.section, self.key),
            None => format!("{}.{}", self.section, self.key),
        }
    }
}

/// A TOML string.
fn text(value: impl AsRef<str>) -> String {
    toml::Value::String(value.as_ref().to_string()).to_string()
}

fn duration(value: Duration) -> String {
    text(humantime::format_duration(value).to_string())
}

/// A size, in the largest binary unit that divides it.
fn size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes > 0 && bytes.is_multiple_of(unit) {
            return text(format!("{}{name}", bytes / unit));
        }
    }
    text(bytes.to_string())
}

fn list<T>(items: &[T], show: impl Fn(&T) -> String) -> String {
    let items: Vec<String> = items.iter().map(show).collect();
    format!("[{}]", items.join(", "))
}

/// Collects entries; `plain` for values that are not secrets.
struct Entries {
    out: Vec<Entry>,
    section: &'static str,
    index: Option<usize>,
}

impl Entries {
    fn at(&mut self, section: &'static str, index: Option<usize>) {
        self.section = section;
        self.index = index;
    }
    fn plain(&mut self, key: &'static str, value: String) {
        self.out.push(Entry {
            section: self.section,
            index: self.index,
            key,
            compared: value.clone(),
            shown: Some(value),
        });
    }
    fn optional(&mut self, key: &'static str, value: Option<String>) {
        self.out.push(Entry {
            section: self.section,
            index: self.index,
            key,
            compared: value.clone().unwrap_or_default(),
            shown: value,
        });
    }
    fn secret(&mut self, key: &'static str, value: Option<&Secret>) {
        self.out.push(Entry {
            section: self.section,
            index: self.index,
            key,
            shown: value.map(|secret| text(redact_database_url(secret.expose()))),
            compared: value.map(|s| s.expose().to_string()).unwrap_or_default(),
        });
    }
    fn policy(&mut self, policy: &Policy) {
        self.plain("key_header", text(policy.key_header.as_str()));
        self.plain("methods", list(&policy.methods, |m| text(m.as_str())));
        self.plain(
            "key",
            text(match policy.key {
                KeyRequirement::Optional => "optional",
                KeyRequirement::Required => "required",
            }),
        );
        self.plain("lease", duration(policy.lease));
        self.plain("retention", duration(policy.retention));
        self.plain("max_key_length", policy.max_key_length.to_string());
        self.plain(
            "fingerprint",
            text(match policy.fingerprint {
                FingerprintMode::Json => "json",
                FingerprintMode::Bytes => "bytes",
            }),
        );
        self.plain(
            "release_on",
            list(&policy.release_on, |s| s.as_u16().to_string()),
        );
        self.plain("max_stored_response", size(policy.max_stored_response));
        self.plain("wait", duration(policy.wait));
        self.plain(
            "derived_key_header",
            text(
                policy
                    .derived_key_header
                    .as_ref()
                    .map_or("", |h| h.as_str()),
            ),
        );
        self.plain(
            "derived_key",
            text(match policy.derived_key {
                DerivedKey::Sha256 => "sha256",
                DerivedKey::TenantKey => "tenant_key",
            }),
        );
    }
    fn route(&mut self, route: &Route) {
        self.plain("name", text(&route.name));
        self.plain("path_prefix", text(&route.path_prefix));
        self.optional(
            "tenant_header",
            route.tenant_header.as_ref().map(|h| text(h.as_str())),
        );
        self.plain("tenant_required", route.tenant_required.to_string());
        self.plain("tenant_hash", route.tenant_hash.to_string());
        self.policy(&route.policy);
    }
}

/// Every key of `config`, in the file's order. `[defaults]` is not part of
/// the typed configuration: each route carries its policy.
pub(super) fn entries(config: &Config) -> Vec<Entry> {
    let mut e = Entries {
        out: Vec::new(),
        section: "server",
        index: None,
    };
    let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| text(p.display().to_string()));

    let server = &config.server;
    e.at("server", None);
    e.plain("listen", text(server.listen.to_string()));
    e.plain("admin_listen", text(server.admin_listen.to_string()));
    e.plain("max_request_body", size(server.max_request_body));
    e.plain("shutdown_grace", duration(server.shutdown_grace));
    e.plain("header_read_timeout", duration(server.header_read_timeout));
    e.optional(
        "tls_cert_file",
        server
            .tls
            .as_ref()
            .map(|t| text(t.cert_file.display().to_string())),
    );
    e.optional(
        "tls_key_file",
        server
            .tls
            .as_ref()
            .map(|t| text(t.key_file.display().to_string())),
    );
    e.plain("max_waiters", server.max_waiters.to_string());
    e.plain("body_read_timeout", duration(server.body_read_timeout));
    e.plain("max_connections", server.max_connections.to_string());
    e.plain(
        "h2_max_concurrent_streams",
        server.h2_max_concurrent_streams.to_string(),
    );
    e.plain("idle_timeout", duration(server.idle_timeout));

    let upstream = &config.upstream;
    e.at("upstream", None);
    e.plain("url", text(upstream.url.to_string()));
    e.plain("connect_timeout", duration(upstream.connect_timeout));
    e.plain("timeout", duration(upstream.timeout));
    e.optional("ca_file", path(&upstream.ca_file));

    let store = &config.store;
    e.at("store", None);
    e.secret("database_url", Some(&store.database_url));
    e.plain("pool_size", store.pool_size.to_string());
    e.plain("timeout", duration(store.timeout));
    e.plain(
        "on_store_error",
        text(match store.on_store_error {
            OnStoreError::Reject => "reject",
            OnStoreError::PassThrough => "pass_through",
        }),
    );
    e.optional("ca_file", path(&store.ca_file));
    e.plain("response_cache", size(store.response_cache));
    e.plain("response_cache_ttl", duration(store.response_cache_ttl));
    e.plain("prepared_statements", store.prepared_statements.to_string());
    e.secret("listen_url", store.listen_url.as_ref());

    let sweeper = &config.sweeper;
    e.at("sweeper", None);
    e.plain("interval", duration(sweeper.interval));
    e.plain("batch_size", sweeper.batch_size.to_string());
    e.plain("pause", duration(sweeper.pause));

    for (index, route) in config.routes.iter().enumerate() {
        e.at("route", Some(index));
        e.route(route);
    }
    e.out
}

/// Where the value of `entry` came from: a flag, a variable, `FILE:LINE`,
/// the `[defaults]` key a route inherits it from, or `default`.
fn source(resolved: &Resolved, section: &str, index: Option<usize>, key: &str) -> String {
    let dotted = match index {
        Some(index) => format!("{section}[{index}].{key}"),
        None => format!("{section}.{key}"),
    };
    if let Some(origin) = resolved.origins.get(&dotted) {
        return origin.clone();
    }
    if let Some(line) = line_of_key(&resolved.text, section, index, key) {
        return format!("{}:{line}", resolved.origin);
    }
    let is_policy_key = super::env::fields_of::<super::raw::RawPolicy>().contains(&key);
    if section == "route" && is_policy_key {
        return format!(
            "defaults.{key}: {}",
            source(resolved, "defaults", None, key)
        );
    }
    "default".to_string()
}

/// The text of `check-config --print`.
pub(super) fn render(resolved: &Resolved) -> String {
    let rows: Vec<(String, Option<usize>, String, String)> = entries(&resolved.config)
        .into_iter()
        .map(|entry| {
            let line = match &entry.shown {
                Some(value) => format!("{} = {value}", entry.key),
                None => format!("# {} is not set", entry.key),
            };
            let from = source(resolved, entry.section, entry.index, entry.key);
            (entry.section.to_string(), entry.index, line, from)
        })
        .collect();
    let width = rows
        .iter()
        .map(|(_, _, line, _)| line.len())
        .filter(|&len| len <= 56)
        .max()
        .unwrap_or(0);
    let mut out = String::from(
        "# The effective configuration (idemproxy check-config --print).\n\
         # After each value, where it came from: a flag, an environment variable,\n\
         # FILE:LINE, the [defaults] key a route inherits it from, or the built-in\n\
         # default. Secrets are redacted. [defaults] is shown through each route.\n",
    );
    let mut current: Option<(String, Option<usize>)> = None;
    for (section, index, line, from) in rows {
        if current.as_ref() != Some(&(section.clone(), index)) {
            match index {
                Some(_) => {
                    let _ = write!(out, "\n[[{section}]]\n");
                }
                None => {
                    let _ = write!(out, "\n[{section}]\n");
                }
            }
            current = Some((section, index));
        }
        let _ = writeln!(out, "{line:<width$}  # {from}");
    }
    out
}

/// A database URL without its password: the password of a URL's user
/// information, and any `password` parameter (URL query or `key=value`
/// string), become `<redacted>`.
pub(super) fn redact_database_url(url: &str) -> String {
    const REDACTED: &str = "<redacted>";
    let url = url.trim();
    if let Some((scheme, rest)) = url.split_once("://") {
        // Authority: up to the first `/` or `?`.
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let authority = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:{REDACTED}@{hosts}"),
                None => format!("{userinfo}@{hosts}"),
            },
            None => authority.to_string(),
        };
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                let params: Vec<String> = query
                    .split('&')
                    .map(|param| match param.split_once('=') {
                        Some((name, _)) if is_password(name) => format!("{name}={REDACTED}"),
                        _ => param.to_string(),
                    })
                    .collect();
                format!("{path}?{}", params.join("&"))
            }
            None => tail.to_string(),
        };
        return format!("{scheme}://{authority}{tail}");
    }
    // `key=value` pairs, values bare or in single quotes with `\` escapes.
    let mut out = Vec::new();
    let mut chars = url.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut name = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            name.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            // Not a key=value string after all: show nothing of it.
            return REDACTED.to_string();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            value.push(chars.next().unwrap_or('\''));
            while let Some(c) = chars.next() {
                value.push(c);
                if c == '\\' {
                    if let Some(escaped) = chars.next() {
                        value.push(escaped);
                    }
                } else if c == '\'' {
                    break;
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        if is_password(&name) {
            value = REDACTED.to_string();
        }
        out.push(format!("{name}={value}"));
    }
    out.join(" ")
}

/// A connection parameter that holds a password.
fn is_password(name: &str) -> bool {
    name.eq_ignore_ascii_case("password") || name.eq_ignore_ascii_case("sslpassword")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::env::fields_of;
    use crate::config::raw::{RawPolicy, RawRoute, RawServer, RawStore, RawSweeper, RawUpstream};
    use crate::config::{parse, Overrides};

    #[test]
    fn passwords_are_redacted_in_every_form() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db:5432/app?sslmode=require",
                "postgres://app:<redacted>@db:5432/app?sslmode=require",
            ),
            (
                "postgresql://app:p%40ss:x@db1,db2/app",
                "postgresql://app:<redacted>@db1,db2/app",
            ),
            ("postgres://app@db/app", "postgres://app@db/app"),
            (
                "postgres://db/app?user=app&password=s3cret",
                "postgres://db/app?user=app&password=<redacted>",
            ),
            (
                "host=db user=app password='s3 cret\\'x' dbname=app",
                "host=db user=app password=<redacted> dbname=app",
            ),
            ("host=db password = s3cret", "host=db password=<redacted>"),
            ("garbage s3cret", "<redacted>"),
        ] {
            assert_eq!(redact_database_url(url), shown, "{url}");
        }
    }

    #[test]
    fn every_key_is_printed() {
        let config = parse("", "t.toml", &Overrides::default()).unwrap();
        let entries = entries(&config);
        let keys_of = |section: &str| -> Vec<&str> {
            entries
                .iter()
                .filter(|e| e.section == section)
                .map(|e| e.key)
                .collect()
        };
        assert_eq!(keys_of("server"), fields_of::<RawServer>());
        assert_eq!(keys_of("upstream"), fields_of::<RawUpstream>());
        assert_eq!(keys_of("store"), fields_of::<RawStore>());
        assert_eq!(keys_of("sweeper"), fields_of::<RawSweeper>());
        let mut route: Vec<&str> = keys_of("route");
        let mut expected: Vec<&str> = fields_of::<RawRoute>().to_vec();
        route.sort_unstable();
        expected.sort_unstable();
        assert_eq!(route, expected);
        assert_eq!(fields_of::<RawPolicy>().len(), 12);
    }

    #[test]
    fn the_printed_configuration_reads_back_as_the_same() {
        let file = "[server]\nlisten = \"127.0.0.1:8081\"\nmax_request_body = \"3000\"\n\
                    [store]\ndatabase_url = \"postgres://u@db/x\"\npool_size = 5\n\
                    [defaults]\nrelease_on = [429, 503]\nwait = \"1500ms\"\n\
                    [[route]]\nname = \"pay\"\npath_prefix = \"/pay\"\ntenant_header = \"X-Tenant\"\nlease = \"30s\"\n";
        let config = parse(file, "t.toml", &Overrides::default()).unwrap();
        let resolved = crate::config::resolve(
            file,
            "t.toml",
            &crate::config::Environment::default(),
            &Overrides::default(),
        )
        .unwrap();
        let printed = render(&resolved);
        let again = parse(&printed, "printed.toml", &Overrides::default())
            .unwrap_or_else(|e| panic!("{e}\n{printed}"));
        let values = |c: &Config| -> Vec<(String, String)> {
            entries(c)
                .into_iter()
                .map(|e| (e.dotted(), e.compared))
                .collect()
        };
        assert_eq!(values(&config), values(&again), "{printed}");
        assert!(printed.contains("pool_size = 5"), "{printed}");
        assert!(printed.contains("# t.toml:6"), "{printed}");
        assert!(
            printed.contains("# defaults.release_on: t.toml:8"),
            "{printed}"
        );
        assert!(printed.contains("# default"), "{printed}");
    }
}
