//! The environment: every key of `[server]`, `[upstream]`, `[store]`,
//! `[sweeper]` and `[defaults]` as `IDEMPROXY_<SECTION>_<KEY>` (DESIGN.md
//! §8.9), and each of them with `_FILE` to read the value from a file.
//! Route tables stay in the file.
//!
//! The variables are turned into one more layer of raw structs, laid over
//! the file's before the checker runs, so a value from the environment
//! meets exactly the rules of the same value in the file; each problem then
//! names the variable instead of a line.
//!
//! Which variables are configuration: `IDEMPROXY_DATABASE_URL` (the short
//! form of `IDEMPROXY_STORE_DATABASE_URL`) and every name that starts with
//! `IDEMPROXY_` and a section (`IDEMPROXY_SERVER_`, `IDEMPROXY_UPSTREAM_`,
//! `IDEMPROXY_STORE_`, `IDEMPROXY_SWEEPER_`, `IDEMPROXY_DEFAULTS_`). Such a
//! name that matches no key is an error: a typo must not be ignored. Other
//! `IDEMPROXY_*` names (`IDEMPROXY_CONFIG`, the test and build variables)
//! are not configuration.
//!
//! How values are written: text as it is (no quotes); integers in decimal;
//! flags `true` or `false`; lists comma-separated (`POST,PATCH`, `429,503`;
//! empty: the empty list); durations and sizes as in the file (`30s`,
//! `1MiB`). A variable that is set but empty still overrides.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

use serde::Deserialize;

use super::locate;
use super::raw::{RawConfig, RawPolicy, RawServer, RawStore, RawSweeper, RawUpstream};
use super::Problem;

/// Every configuration variable starts with this.
pub(super) const PREFIX: &str = "IDEMPROXY_";
/// The short form of `IDEMPROXY_STORE_DATABASE_URL`.
pub const DATABASE_URL_ENV: &str = "IDEMPROXY_DATABASE_URL";
/// Appended to a variable's name: its value is read from the file it names.
pub const FILE_SUFFIX: &str = "_FILE";

/// The sections that can be set from the environment.
pub(super) const SECTIONS: [&str; 5] = ["server", "upstream", "store", "sweeper", "defaults"];

/// The TOML type of a key, which says how its variable is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A string (durations, sizes, addresses, URLs, names): as it is.
    Text,
    /// An integer, in decimal.
    Integer,
    /// `true` or `false`.
    Flag,
    /// A list of strings, comma-separated.
    TextList,
    /// A list of integers, comma-separated.
    IntegerList,
}

impl Kind {
    /// How a value is written, for the reference.
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Text => "text",
            Kind::Integer => "integer",
            Kind::Flag => "true or false",
            Kind::TextList => "comma-separated list",
            Kind::IntegerList => "comma-separated integers",
        }
    }
}

/// One key that can be set from the environment.
#[derive(Debug, Clone)]
pub struct EnvKey {
    /// Its section, as in the file (`store`).
    pub section: &'static str,
    /// Its key, as in the file (`pool_size`).
    pub key: &'static str,
    /// How its value is written.
    pub kind: Kind,
}

impl EnvKey {
    /// `IDEMPROXY_STORE_POOL_SIZE`.
    pub fn var(&self) -> String {
        format!(
            "{PREFIX}{}_{}",
            self.section.to_ascii_uppercase(),
            self.key.to_ascii_uppercase()
        )
    }

    /// `store.pool_size`.
    pub fn dotted(&self) -> String {
        format!("{}.{}", self.section, self.key)
    }
}

/// Every key that can be set from the environment, in file order; derived
/// from the raw structs, so a new key gets its variable without a line here.
pub(super) fn keys() -> &'static [EnvKey] {
    static KEYS: OnceLock<Vec<EnvKey>> = OnceLock::new();
    KEYS.get_or_init(|| {
        let sections: [(&'static str, &'static [&'static str]); 5] = [
            ("server", fields_of::<RawServer>()),
            ("upstream", fields_of::<RawUpstream>()),
            ("store", fields_of::<RawStore>()),
            ("sweeper", fields_of::<RawSweeper>()),
            ("defaults", fields_of::<RawPolicy>()),
        ];
        sections
            .into_iter()
            .flat_map(|(section, keys)| {
                keys.iter().map(move |&key| EnvKey {
                    section,
                    key,
                    kind: kind_of(section, key),
                })
            })
            .collect()
    })
}

/// The TOML type a key accepts, found by trying one value of each type
/// on the raw structs.
fn kind_of(section: &str, key: &str) -> Kind {
    const PROBES: [(Kind, &str); 5] = [
        (Kind::Text, "\"x\""),
        (Kind::Integer, "1"),
        (Kind::Flag, "true"),
        (Kind::TextList, "[\"x\"]"),
        (Kind::IntegerList, "[1]"),
    ];
    PROBES
        .iter()
        .find(|(_, literal)| {
            toml::from_str::<RawConfig>(&format!("[{section}]\n{key} = {literal}\n")).is_ok()
        })
        .map_or(Kind::Text, |(kind, _)| *kind)
}

/// The field names of `T`, straight from its derived `Deserialize`.
pub(super) fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    #[derive(Debug)]
    struct Fields(&'static [&'static str]);
    impl fmt::Display for Fields {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{:?}", self.0)
        }
    }
    impl std::error::Error for Fields {}
    impl serde::de::Error for Fields {
        fn custom<M: fmt::Display>(_: M) -> Self {
            Fields(&[])
        }
    }
    struct Probe;
    impl<'de> serde::Deserializer<'de> for Probe {
        type Error = Fields;
        fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Fields> {
            Err(Fields(&[]))
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Fields> {
            Err(Fields(fields))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
    match T::deserialize(Probe) {
        Err(Fields(fields)) => fields,
        Ok(_) => &[],
    }
}

/// Whether a variable is configuration (see the module's documentation).
pub(super) fn is_config_var(name: &str) -> bool {
    if name == DATABASE_URL_ENV || name == format!("{DATABASE_URL_ENV}{FILE_SUFFIX}") {
        return true;
    }
    let Some(rest) = name.strip_prefix(PREFIX) else {
        return false;
    };
    SECTIONS.iter().any(|section| {
        rest.strip_prefix(section.to_ascii_uppercase().as_str())
            .is_some_and(|after| after.starts_with('_'))
    })
}

/// The process's configuration variables, captured once: `serve` re-applies
/// the same ones on every reload (a process's environment does not change;
/// the files named by `_FILE` variables are read again).
///
/// `Debug` shows the names only: values may be secrets.
#[derive(Clone, Default)]
pub struct Environment {
    /// Name and value (`None`: not valid UTF-8), in name order.
    vars: Vec<(String, Option<String>)>,
}

impl fmt::Debug for Environment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.vars.iter().map(|(name, _)| name))
            .finish()
    }
}

impl Environment {
    /// The configuration variables of this process.
    pub fn from_process() -> Self {
        Self::from_vars(std::env::vars_os().filter_map(|(name, value)| {
            let name = name.into_string().ok()?;
            Some((name, value.into_string().ok()))
        }))
    }

    /// The configuration variables among `vars` (a value of `None` is not
    /// valid UTF-8); the others are dropped.
    pub fn from_vars(vars: impl IntoIterator<Item = (String, Option<String>)>) -> Self {
        let mut vars: Vec<_> = vars
            .into_iter()
            .filter(|(name, _)| is_config_var(name))
            .collect();
        vars.sort();
        Environment { vars }
    }

    /// From names and values (tests).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self::from_vars(
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string()))),
        )
    }

    /// Whether no configuration variable is set.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }
}

/// What the environment sets: a layer of raw structs, which variable set
/// each key, and what is wrong with them.
pub(super) struct EnvLayer {
    pub(super) raw: RawConfig,
    /// Dotted key → the variable that set it (with `_FILE` if it was one).
    pub(super) sources: BTreeMap<String, String>,
    pub(super) problems: Vec<Problem>,
}

/// A variable that sets a key, and its value.
type Setter = (String, String);

/// A problem with a variable.
fn problem(var: &str, key: &str, message: impl Into<String>) -> Problem {
    Problem {
        origin: var.to_string(),
        line: None,
        key: key.to_string(),
        message: message.into(),
    }
}

/// Reads `env` into a layer; `_FILE` variables are read now.
pub(super) fn layer(env: &Environment) -> EnvLayer {
    let mut problems = Vec::new();
    // Dotted key → its key and every (variable, value) that sets it.
    let mut found: BTreeMap<String, (&EnvKey, Vec<Setter>)> = BTreeMap::new();
    for (name, value) in &env.vars {
        let (env_key, from_file) = match lookup(name) {
            Some(found) => found,
            None => {
                problems.push(problem(
                    name,
                    "",
                    "unknown configuration variable: it names no key (see \"Configure from the environment\" in docs/configuration.md); a mistyped name would be ignored otherwise",
                ));
                continue;
            }
        };
        let dotted = env_key.dotted();
        let Some(value) = value else {
            problems.push(problem(name, &dotted, "the value is not valid UTF-8"));
            continue;
        };
        let value = if from_file {
            match std::fs::read_to_string(Path::new(value)) {
                Ok(text) => strip_one_newline(text),
                Err(err) => {
                    // The path is shown, never the contents.
                    problems.push(problem(
                        name,
                        &dotted,
                        format!("cannot read the file {value:?}: {err}"),
                    ));
                    continue;
                }
            }
        } else {
            value.clone()
        };
        found
            .entry(dotted)
            .or_insert_with(|| (env_key, Vec::new()))
            .1
            .push((name.clone(), value));
    }

    let mut table = toml::Table::new();
    let mut sources = BTreeMap::new();
    for (dotted, (env_key, mut setters)) in found {
        if setters.len() > 1 {
            let names: Vec<&str> = setters.iter().map(|(name, _)| name.as_str()).collect();
            problems.push(problem(
                &names.join(", "),
                &dotted,
                format!(
                    "set by {} variables at once ({}): set only one",
                    names.len(),
                    names.join(" and ")
                ),
            ));
            continue;
        }
        let (name, text) = setters.remove(0);
        match value_of(env_key.kind, &text) {
            Ok(value) => {
                table
                    .entry(env_key.section)
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                    .as_table_mut()
                    .expect("a section is a table")
                    .insert(env_key.key.to_string(), value);
                sources.insert(dotted, name);
            }
            Err(message) => problems.push(problem(&name, &dotted, message)),
        }
    }

    let raw = match toml::to_string(&table)
        .map_err(|err| err.to_string())
        .and_then(|text| {
            locate::deserialize(&text, "environment")
                .map(|d| d.config)
                .map_err(|err| err.to_string())
        }) {
        Ok(raw) => raw,
        Err(err) => {
            // Only reachable if a key's probed type were wrong (a bug).
            problems.push(problem(
                "environment",
                "",
                format!("the environment could not be applied: {err}"),
            ));
            RawConfig::default()
        }
    };
    EnvLayer {
        raw,
        sources,
        problems,
    }
}

/// The key a configuration variable names, and whether it is the `_FILE`
/// form. A key's own name may end in `_file` (`ca_file`): the exact name
/// is tried first.
fn lookup(name: &str) -> Option<(&'static EnvKey, bool)> {
    let alias = |name: &str| {
        if name == DATABASE_URL_ENV {
            "IDEMPROXY_STORE_DATABASE_URL".to_string()
        } else {
            name.to_string()
        }
    };
    let exact = |candidate: &str| keys().iter().find(|k| k.var() == alias(candidate));
    if let Some(key) = exact(name) {
        return Some((key, false));
    }
    let stem = name.strip_suffix(FILE_SUFFIX)?;
    exact(stem).map(|key| (key, true))
}

/// A file's contents without one trailing newline (`echo` and editors add
/// one; a secret never ends with it).
fn strip_one_newline(mut text: String) -> String {
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    text
}

/// A variable's text as the TOML value its key takes.
fn value_of(kind: Kind, text: &str) -> Result<toml::Value, String> {
    let integer = |item: &str| {
        item.trim()
            .parse::<i64>()
            .map_err(|_| format!("expected an integer, not {item:?}"))
    };
    let items = |text: &str| -> Vec<String> {
        if text.trim().is_empty() {
            Vec::new()
        } else {
            text.split(',')
                .map(|item| item.trim().to_string())
                .collect()
        }
    };
    Ok(match kind {
        Kind::Text => toml::Value::String(text.to_string()),
        Kind::Integer => toml::Value::Integer(integer(text)?),
        Kind::Flag => match text.trim() {
            "true" => toml::Value::Boolean(true),
            "false" => toml::Value::Boolean(false),
            other => return Err(format!("expected true or false, not {other:?}")),
        },
        Kind::TextList => {
            toml::Value::Array(items(text).into_iter().map(toml::Value::String).collect())
        }
        Kind::IntegerList => toml::Value::Array(
            items(text)
                .iter()
                .map(|item| integer(item).map(toml::Value::Integer))
                .collect::<Result<_, _>>()?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_has_a_variable_and_a_type() {
        let keys = keys();
        assert_eq!(keys.len(), 12 + 4 + 9 + 3 + 12);
        let kind = |var: &str| keys.iter().find(|k| k.var() == var).map(|k| k.kind);
        assert_eq!(kind("IDEMPROXY_UPSTREAM_URL"), Some(Kind::Text));
        assert_eq!(kind("IDEMPROXY_STORE_POOL_SIZE"), Some(Kind::Integer));
        assert_eq!(
            kind("IDEMPROXY_STORE_PREPARED_STATEMENTS"),
            Some(Kind::Flag)
        );
        assert_eq!(kind("IDEMPROXY_DEFAULTS_METHODS"), Some(Kind::TextList));
        assert_eq!(
            kind("IDEMPROXY_DEFAULTS_RELEASE_ON"),
            Some(Kind::IntegerList)
        );
        for key in keys {
            // The probe found the type the raw struct takes.
            let text = format!(
                "[{}]\n{} = {}\n",
                key.section,
                key.key,
                match key.kind {
                    Kind::Text => "\"x\"",
                    Kind::Integer => "1",
                    Kind::Flag => "true",
                    Kind::TextList => "[\"x\"]",
                    Kind::IntegerList => "[1]",
                }
            );
            assert!(toml::from_str::<RawConfig>(&text).is_ok(), "{}", key.var());
        }
    }

    #[test]
    fn no_variable_is_another_ones_file_form() {
        for key in keys() {
            let file_form = format!("{}{FILE_SUFFIX}", key.var());
            assert!(
                keys().iter().all(|other| other.var() != file_form),
                "{file_form} would be ambiguous"
            );
        }
        assert_eq!(
            lookup("IDEMPROXY_STORE_CA_FILE").map(|(k, f)| (k.dotted(), f)),
            Some(("store.ca_file".to_string(), false))
        );
        assert_eq!(
            lookup("IDEMPROXY_STORE_CA_FILE_FILE").map(|(k, f)| (k.dotted(), f)),
            Some(("store.ca_file".to_string(), true))
        );
        assert_eq!(
            lookup("IDEMPROXY_DATABASE_URL_FILE").map(|(k, f)| (k.dotted(), f)),
            Some(("store.database_url".to_string(), true))
        );
    }

    #[test]
    fn only_section_prefixed_names_are_configuration() {
        for name in [
            "IDEMPROXY_DATABASE_URL",
            "IDEMPROXY_DATABASE_URL_FILE",
            "IDEMPROXY_STORE_POOL_SIZE",
            "IDEMPROXY_STORE_POOL_SIZ",
            "IDEMPROXY_DEFAULTS_LEASE_FILE",
        ] {
            assert!(is_config_var(name), "{name}");
        }
        // Variables the project's scripts and tests use are not.
        for name in [
            "IDEMPROXY_CONFIG",
            "IDEMPROXY_TEST_DATABASE_URL",
            "IDEMPROXY_PGBOUNCER",
            "IDEMPROXY_PG_BINDIR",
            "IDEMPROXY_DB_PASSWORD",
            "IDEMPROXY_BENCH_DATABASE_URL",
            "IDEMPROXY_STOREX",
            "DATABASE_URL",
        ] {
            assert!(!is_config_var(name), "{name}");
        }
    }

    #[test]
    fn values_are_read_by_type() {
        assert_eq!(
            value_of(Kind::TextList, "POST, PATCH").unwrap(),
            toml::Value::Array(vec!["POST".into(), "PATCH".into()])
        );
        assert_eq!(
            value_of(Kind::IntegerList, "").unwrap(),
            toml::Value::Array(vec![])
        );
        assert_eq!(
            value_of(Kind::IntegerList, "429,503").unwrap(),
            toml::Value::Array(vec![429.into(), 503.into()])
        );
        assert!(value_of(Kind::IntegerList, "429,x").is_err());
        assert!(value_of(Kind::Integer, "").is_err());
        assert!(value_of(Kind::Flag, "yes").is_err());
        assert_eq!(
            value_of(Kind::Text, " a ").unwrap(),
            toml::Value::from(" a ")
        );
    }

    #[test]
    fn one_trailing_newline_is_dropped() {
        assert_eq!(strip_one_newline("pw\n".into()), "pw");
        assert_eq!(strip_one_newline("pw\r\n".into()), "pw");
        assert_eq!(strip_one_newline("pw\n\n".into()), "pw\n");
        assert_eq!(strip_one_newline("pw".into()), "pw");
    }

    #[test]
    fn a_layer_names_its_variables_and_their_problems() {
        let env = Environment::from_pairs([
            ("IDEMPROXY_STORE_POOL_SIZE", "x"),
            ("IDEMPROXY_STORE_POOL_SIZ", "4"),
            ("IDEMPROXY_DATABASE_URL", "postgres://a@h/db"),
            ("IDEMPROXY_STORE_DATABASE_URL", "postgres://b@h/db"),
            ("IDEMPROXY_UPSTREAM_URL", "http://up:1"),
            ("IDEMPROXY_CONFIG", "ignored.toml"),
        ]);
        assert!(!format!("{env:?}").contains("postgres://"));
        let layer = layer(&env);
        assert_eq!(
            layer.sources.get("upstream.url").map(String::as_str),
            Some("IDEMPROXY_UPSTREAM_URL")
        );
        let origins: Vec<&str> = layer.problems.iter().map(|p| p.origin.as_str()).collect();
        assert!(
            origins.contains(&"IDEMPROXY_STORE_POOL_SIZE"),
            "{origins:?}"
        );
        assert!(origins.contains(&"IDEMPROXY_STORE_POOL_SIZ"), "{origins:?}");
        assert!(
            origins.contains(&"IDEMPROXY_DATABASE_URL, IDEMPROXY_STORE_DATABASE_URL"),
            "{origins:?}"
        );
        assert_eq!(layer.problems.len(), 3);
        assert!(layer
            .problems
            .iter()
            .all(|p| !p.to_string().contains("postgres://")));
    }
}
