//! PostgreSQL connection strings as libpq writes them: `postgres://` URLs
//! and `key=value` strings, with libpq's TLS parameters (`sslmode`,
//! `sslrootcert`) taken out for [`crate::store::tls`].
//!
//! A leaf module: `config` checks a URL with it (check-config must not pass
//! what `serve` refuses) and the store connects with it, without either
//! depending on the other. Error messages never contain the URL: it may
//! hold the password.

use std::str::FromStr;

use thiserror::Error;

/// Why a connection string was refused (never quoting it).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid database URL: {0}")]
pub struct UrlError(pub String);

/// The driver's URL parse errors may quote the URL; keep only a generic
/// description.
fn redacted_parse_error(e: &tokio_postgres::Error) -> String {
    let text = e.to_string();
    if text.contains("://") || text.contains('@') || text.contains("password") {
        "the URL could not be parsed (details withheld: they may contain the password)".into()
    } else {
        text
    }
}

/// libpq's `sslmode`, as far as idemproxy supports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it, unverified.
    Prefer,
    /// TLS, verified only when a CA file is given.
    Require,
    /// TLS, chain verified.
    VerifyCa,
    /// TLS, chain and host name verified.
    VerifyFull,
}

impl SslMode {
    pub(crate) fn parse(value: &str) -> Result<Self, UrlError> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => {
                return Err(UrlError(
                    "sslmode=allow is not supported (it tries plaintext first); use prefer, require, verify-ca or verify-full".into(),
                ))
            }
            other => {
                return Err(UrlError(format!(
                    "invalid sslmode {other:?}: expected disable, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }
}

/// A database URL as understood here, before any file is read.
#[derive(Debug)]
pub struct ParsedUrl {
    /// What the driver understands.
    pub config: tokio_postgres::Config,
    /// The `sslmode` (default `prefer`).
    pub mode: SslMode,
    /// libpq's `sslrootcert`, if given.
    pub sslrootcert: Option<String>,
}

/// Parses a database URL or `key=value` string, libpq's TLS parameters
/// included, without reading any file (for `check-config` as much as for
/// the start). Error messages never contain the URL.
pub fn parse_url(url: &str) -> Result<ParsedUrl, UrlError> {
    let split = split_tls_params(url)?;
    let config = tokio_postgres::Config::from_str(&split.rest)
        .map_err(|e| UrlError(redacted_parse_error(&e)))?;
    let mode = match &split.sslmode {
        Some(value) => SslMode::parse(value)?,
        None => SslMode::Prefer,
    };
    Ok(ParsedUrl {
        config,
        mode,
        sslrootcert: split.sslrootcert,
    })
}

/// The URL with `sslmode` and `sslrootcert` taken out.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Split {
    pub(crate) rest: String,
    pub(crate) sslmode: Option<String>,
    pub(crate) sslrootcert: Option<String>,
}

/// Takes `sslmode` and `sslrootcert` out of a `postgres://` URL's query or a
/// `key=value` connection string, leaving everything else as written.
pub(crate) fn split_tls_params(url: &str) -> Result<Split, UrlError> {
    let mut split = Split {
        rest: String::new(),
        sslmode: None,
        sslrootcert: None,
    };
    let is_url = url.trim_start().starts_with("postgres://")
        || url.trim_start().starts_with("postgresql://");
    if is_url {
        let Some((base, query)) = url.split_once('?') else {
            split.rest = url.to_owned();
            return Ok(split);
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "sslmode" => split.sslmode = Some(percent_decode(v)?),
                "sslrootcert" => split.sslrootcert = Some(percent_decode(v)?),
                _ => kept.push(pair),
            }
        }
        split.rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok(split);
    }
    let mut kept = Vec::new();
    for (key, raw, value) in conninfo_pairs(url)? {
        match key.as_str() {
            "sslmode" => split.sslmode = Some(value),
            "sslrootcert" => split.sslrootcert = Some(value),
            _ => kept.push(raw),
        }
    }
    split.rest = kept.join(" ");
    Ok(split)
}

/// `%XX` decoding of a URL query value.
pub(crate) fn percent_decode(value: &str) -> Result<String, UrlError> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    UrlError("invalid percent-encoding in the URL's TLS parameters".into())
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| UrlError("the URL's TLS parameters are not UTF-8".into()))
}

/// The `key = value` pairs of a libpq connection string: (key, the pair as
/// written, the unquoted value).
pub(crate) fn conninfo_pairs(s: &str) -> Result<Vec<(String, String, String)>, UrlError> {
    let malformed = || {
        UrlError("the key=value connection string is malformed (details withheld: it may contain the password)".into())
    };
    let chars: Vec<char> = s.chars().collect();
    let mut pairs = Vec::new();
    let mut i = 0;
    loop {
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if i == chars.len() {
            return Ok(pairs);
        }
        let start = i;
        while i < chars.len() && chars[i] != '=' && !chars[i].is_whitespace() {
            i += 1;
        }
        let key: String = chars[start..i].iter().collect();
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if key.is_empty() || chars.get(i) != Some(&'=') {
            return Err(malformed());
        }
        i += 1;
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let mut value = String::new();
        if chars.get(i) == Some(&'\'') {
            i += 1;
            loop {
                match chars.get(i) {
                    None => return Err(malformed()),
                    Some('\'') => {
                        i += 1;
                        break;
                    }
                    Some('\\') => {
                        value.push(*chars.get(i + 1).ok_or_else(malformed)?);
                        i += 2;
                    }
                    Some(c) => {
                        value.push(*c);
                        i += 1;
                    }
                }
            }
        } else {
            while i < chars.len() && !chars[i].is_whitespace() {
                if chars[i] == '\\' {
                    value.push(*chars.get(i + 1).ok_or_else(malformed)?);
                    i += 2;
                } else {
                    value.push(chars[i]);
                    i += 1;
                }
            }
        }
        let raw: String = chars[start..i].iter().collect();
        pairs.push((key, raw, value));
    }
}
