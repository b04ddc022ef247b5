//! Value rules: the text of one value to its typed value, or why not.
//!
//! Each rule is a pure function of the value alone (the key, the line and
//! the file are the checker's business, see [`super::check`]); the error is
//! the message shown after `file:line: key:`. Rules that span keys (lease
//! shorter than retention, distinct listeners, route order) live with their
//! section in `check/`.

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use bytesize::ByteSize;
use http::{HeaderName, Method, StatusCode, Uri};

/// A flag: any boolean (its TOML type is all there is to check).
pub(super) fn flag(on: &bool) -> Result<bool, String> {
    Ok(*on)
}

/// A file path: anything but empty (an absent key means no file).
pub(super) fn path(text: &str) -> Result<PathBuf, String> {
    if text.trim().is_empty() {
        Err("must not be empty (leave the key out instead)".to_string())
    } else {
        Ok(PathBuf::from(text))
    }
}

/// `IP:port`.
pub(super) fn socket_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse().map_err(|_| {
        format!(
            "invalid socket address {text:?}: expected IP:port, such as \"0.0.0.0:8080\" or \"[::1]:8080\""
        )
    })
}

/// A duration such as `"250ms"`, `"30s"`, `"24h"`; zero allowed.
pub(super) fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|err| {
        format!("invalid duration {text:?}: {err} (expected e.g. \"250ms\", \"30s\", \"24h\")")
    })
}

/// A duration greater than zero.
pub(super) fn positive_duration(text: &str) -> Result<Duration, String> {
    match duration(text)? {
        Duration::ZERO => Err("must be greater than 0".to_string()),
        duration => Ok(duration),
    }
}

/// A lease: at least 100ms, since the owner renews it about every third of
/// it.
pub(super) fn lease(text: &str) -> Result<Duration, String> {
    const MIN: Duration = Duration::from_millis(100);
    match duration(text)? {
        lease if lease < MIN => Err(format!(
            "must be at least 100ms, not {} (the owner renews its lease about every third of it)",
            humantime::format_duration(lease)
        )),
        lease => Ok(lease),
    }
}

/// A size in bytes: `"1000"`, `"512KiB"`, `"1MiB"`.
pub(super) fn size(text: &str) -> Result<u64, String> {
    match text.parse::<ByteSize>() {
        Ok(size) => Ok(size.as_u64()),
        Err(err) => Err(format!(
            "invalid size {text:?}: {err} (expected bytes such as \"1000\" or a number with a unit such as \"512KiB\", \"1MiB\")"
        )),
    }
}

/// An integer in `range` (an open-ended range ends at `i64::MAX`).
pub(super) fn int_in(n: i64, range: RangeInclusive<i64>) -> Result<i64, String> {
    if range.contains(&n) {
        Ok(n)
    } else if *range.end() == i64::MAX {
        Err(format!("must be at least {}, not {n}", range.start()))
    } else {
        Err(format!(
            "must be between {} and {}, not {n}",
            range.start(),
            range.end()
        ))
    }
}

/// One of a fixed set of names.
pub(super) fn choice<U: Copy>(text: &str, options: &[(&str, U)]) -> Result<U, String> {
    match options.iter().find(|(name, _)| *name == text) {
        Some((_, value)) => Ok(*value),
        None => {
            let names: Vec<String> = options
                .iter()
                .map(|(name, _)| format!("{name:?}"))
                .collect();
            Err(format!("must be {}, not {text:?}", names.join(" or ")))
        }
    }
}

/// An HTTP header name.
pub(super) fn header_name(text: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(text.as_bytes()).map_err(|_| format!("invalid header name {text:?}"))
}

/// An HTTP method, in uppercase.
pub(super) fn method(text: &str) -> Result<Method, String> {
    match Method::from_bytes(text.as_bytes()) {
        // Methods are case-sensitive: "post" is a valid token, but not
        // POST, and surely not what was meant.
        Ok(_) if text.bytes().any(|b| b.is_ascii_lowercase()) => Err(format!(
            "methods are case-sensitive: {text:?} is not {:?}; write methods in uppercase",
            text.to_ascii_uppercase()
        )),
        Ok(method) => Ok(method),
        Err(_) => Err(format!(
            "invalid method {text:?}: expected an HTTP method token such as \"POST\""
        )),
    }
}

/// An HTTP status, 100 to 599.
pub(super) fn status(n: i64) -> Result<StatusCode, String> {
    u16::try_from(n)
        .ok()
        .filter(|code| (100..=599).contains(code))
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or_else(|| format!("invalid HTTP status {n}: expected 100 to 599"))
}

/// A route's path prefix: starts with `/`.
pub(super) fn path_prefix(text: &str) -> Result<String, String> {
    if text.starts_with('/') {
        Ok(text.to_string())
    } else {
        Err(format!("must start with \"/\", not {text:?}"))
    }
}

/// The upstream's base URL: absolute `http://` or `https://` with a host,
/// optionally a path; no query, fragment or credentials.
pub(super) fn upstream_url(text: &str) -> Result<Uri, String> {
    let uri: Uri = match text.parse() {
        Ok(uri) => uri,
        // The text is not echoed if it might hold credentials.
        Err(err) if text.contains('@') => return Err(format!("invalid URL: {err}")),
        Err(err) => return Err(format!("invalid URL {text:?}: {err}")),
    };
    let Some(authority) = uri.authority() else {
        return Err(format!(
            "must be an absolute http:// or https:// URL with a host, not {text:?}"
        ));
    };
    if authority.as_str().contains('@') {
        return Err("must not contain credentials (user@host); the value is not shown".to_string());
    }
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!("must start with http:// or https://, not {text:?}"));
    }
    let host = authority.host();
    if host.is_empty() {
        return Err(format!("has no host: {text:?}"));
    }
    let port_text = authority.as_str().strip_prefix(host).unwrap_or_default();
    if !port_text.is_empty() && authority.port_u16().is_none() {
        return Err(format!("has an invalid port: {text:?}"));
    }
    if uri.query().is_some() || text.contains('#') {
        return Err(format!("must not have a query or fragment: {text:?}"));
    }
    Ok(uri)
}

/// The rules for the database URL. The messages never include the value: it
/// may hold a password.
pub(super) fn database_url(url: &str) -> Result<(), &'static str> {
    let url = url.trim();
    if url.is_empty() {
        return Err("must not be empty");
    }
    match url.split_once("://") {
        Some(("postgres" | "postgresql", _)) => {}
        Some(_) => return Err("must be a postgres:// or postgresql:// URL (the value is not shown: it may contain a password)"),
        None if url.contains('=') => {}
        None => return Err(
            "must be a postgres:// or postgresql:// URL or a key=value connection string (the value is not shown: it may contain a password)",
        ),
    }
    // What `serve` will parse: check-config must not pass what serve rejects.
    match crate::pg_url::parse_url(url) {
        Ok(_) => Ok(()),
        Err(_) => Err("does not parse as a PostgreSQL connection string (bad port, host, option or sslmode?); the value is not shown: it may contain a password"),
    }
}
