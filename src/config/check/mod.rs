//! Validation: raw → typed, every problem collected.
//!
//! One [`Checker`] walks the raw structs of one text, a file per section in
//! the spirit of oauth2-proxy's `pkg/validation`: `server`, `upstream`,
//! `store`, `sweeper`, `policy` (`[defaults]` and each route's overrides),
//! `routes`. Each check records why a value is refused and yields `None`, so
//! every check runs and the typed value is only assembled (with `?`) at the
//! end of its section.
//!
//! A key's dotted name is never typed apart from its field: `key!` derives
//! it from the section and the field identifier, and `get!` reads the raw
//! field, names its key and inherits the same field of the base, all from
//! one identifier.

use std::collections::BTreeMap;
use std::ops::Range;

use toml::Spanned;

use super::locate::{line_of, Deserialized};
use super::raw::RawConfig;
use super::{Config, ConfigError, Overrides, Problem};

/// The dotted key of a field: `key!(store.pool_size)` is the `&'static str`
/// `"store.pool_size"`; `key!([at].lease)` is `format!("{at}.lease")`, for
/// sections named at run time (`defaults`, `route[1]`).
macro_rules! key {
    ([$at:expr] . $field:ident) => {
        format!("{}.{}", $at, stringify!($field))
    };
    ($section:ident . $field:ident) => {
        concat!(stringify!($section), ".", stringify!($field))
    };
}

/// Reads one raw field through [`Checker::get`]: the key is named with
/// `key!` and the rule's result is inherited, when the field is absent,
/// from the same field of a base. The forms:
///
/// * `get!(self, store.pool_size, raw, base, rule)`: inherits
///   `base.pool_size` (`base` is an `Option<&StoreConfig>`);
/// * `get!(self, [at].lease, raw, base, rule)`: the same in a section named
///   at run time;
/// * `get!(self, upstream.ca_file, raw, optional base, rule)`: a key without
///   a default; `rule` yields the value, the field is an `Option` of it;
/// * `get!(self, [at].methods, raw, base, each rule)`: a list, `rule`
///   applied to each item (problems name `key[index]`);
/// * `get!(self, [at].name, raw, else value, rule)`: inherits `value`.
macro_rules! get {
    (@ $checker:expr, $key:expr, $field:ident, $raw:ident, optional $base:ident, $rule:expr) => {
        $checker.get(
            $key,
            &$raw.$field,
            Some($base.and_then(|b| b.$field.clone())),
            |v| ($rule)(v).map(Some),
        )
    };
    (@ $checker:expr, $key:expr, $field:ident, $raw:ident, else $inherited:expr, $rule:expr) => {
        $checker.get($key, &$raw.$field, $inherited, $rule)
    };
    (@ $checker:expr, $key:expr, $field:ident, $raw:ident, $base:ident, each $rule:expr) => {
        $checker.get_each(
            $key,
            &$raw.$field,
            $base.map(|b| &b.$field).cloned(),
            $rule,
        )
    };
    (@ $checker:expr, $key:expr, $field:ident, $raw:ident, $base:ident, $rule:expr) => {
        $checker.get(
            $key,
            &$raw.$field,
            $base.map(|b| &b.$field).cloned(),
            $rule,
        )
    };
    ($checker:expr, [$at:expr] . $field:ident, $($rest:tt)*) => {
        get!(@ $checker, &key!([$at].$field), $field, $($rest)*)
    };
    ($checker:expr, $section:ident . $field:ident, $($rest:tt)*) => {
        get!(@ $checker, key!($section.$field), $field, $($rest)*)
    };
}

/// A raw field with the name of its key: `named!(raw.lease)` is
/// `("lease", &raw.lease)`.
macro_rules! named {
    ($raw:ident . $field:ident) => {
        (stringify!($field), &$raw.$field)
    };
}

mod policy;
mod routes;
mod server;
mod store;
mod sweeper;
mod upstream;

/// The typed configuration of one deserialised text: `raw` (the file, with
/// the environment laid over it) layered over `base` (the built-in
/// defaults; `None` while validating those), then the overrides. Every
/// problem, the unknown keys included, or the config.
///
/// `origins` names, by dotted key, the variable or flag a value came from
/// instead of the file: a problem with it names that, not a line.
pub(super) fn check(
    origin: &str,
    text: &str,
    raw: Deserialized,
    base: Option<&Config>,
    overrides: &Overrides,
    origins: &BTreeMap<String, String>,
) -> Result<Config, ConfigError> {
    let mut checker = Checker::new(origin, text);
    checker.origins = origins.clone();
    checker.problems.extend(raw.unknown_keys);
    let config = checker.validate(&raw.config, base, overrides);
    checker.finish(config)
}

/// What a rule reads of a raw value: text as `str`, numbers and flags as
/// they are.
trait Value {
    type Ref: ?Sized;
    fn value(&self) -> &Self::Ref;
}

impl Value for String {
    type Ref = str;
    fn value(&self) -> &str {
        self
    }
}

impl Value for i64 {
    type Ref = i64;
    fn value(&self) -> &i64 {
        self
    }
}

impl Value for bool {
    type Ref = bool;
    fn value(&self) -> &bool {
        self
    }
}

/// Walks the raw structs of one text, collecting problems.
struct Checker<'a> {
    origin: &'a str,
    text: &'a str,
    problems: Vec<Problem>,
    /// Dotted key → the variable or flag that set it.
    origins: BTreeMap<String, String>,
}

impl<'a> Checker<'a> {
    fn new(origin: &'a str, text: &'a str) -> Self {
        Checker {
            origin,
            text,
            problems: Vec::new(),
            origins: BTreeMap::new(),
        }
    }

    /// The result, or every problem found.
    fn finish(mut self, config: Option<Config>) -> Result<Config, ConfigError> {
        match config {
            Some(config) if self.problems.is_empty() => Ok(config),
            _ => {
                if self.problems.is_empty() {
                    // Only reachable if the built-in defaults miss a key.
                    self.report(
                        "",
                        None,
                        "incomplete configuration (a bug: a key has no default)",
                    );
                }
                Err(ConfigError::sorted(self.problems))
            }
        }
    }

    fn report(&mut self, key: &str, span: Option<Range<usize>>, message: impl Into<String>) {
        // A list item (`defaults.methods[1]`) came from where its list did.
        let whole = match key.rfind('[') {
            Some(at) if key.ends_with(']') && !key[at..].contains('.') => &key[..at],
            _ => key,
        };
        if let Some(origin) = self.origins.get(whole) {
            self.problems.push(Problem {
                origin: origin.clone(),
                line: None,
                key: key.to_string(),
                message: message.into(),
            });
            return;
        }
        self.problems.push(Problem {
            origin: self.origin.to_string(),
            line: span.map(|span| line_of(self.text, span.start)),
            key: key.to_string(),
            message: message.into(),
        });
    }

    /// Records a problem with `value` and yields `None`.
    fn bad<T, U>(
        &mut self,
        key: &str,
        value: &Spanned<T>,
        message: impl Into<String>,
    ) -> Option<U> {
        self.report(key, Some(value.span()), message);
        None
    }

    /// `rule` applied to `value`; a refusal is recorded at its line.
    fn check<T: Value, U, E: Into<String>>(
        &mut self,
        key: &str,
        value: &Spanned<T>,
        rule: impl FnOnce(&T::Ref) -> Result<U, E>,
    ) -> Option<U> {
        match rule(value.get_ref().value()) {
            Ok(typed) => Some(typed),
            Err(message) => self.bad(key, value, message),
        }
    }

    /// The file's value, checked, if it is set; else the inherited one.
    fn get<T: Value, U, E: Into<String>>(
        &mut self,
        key: &str,
        raw: &Option<Spanned<T>>,
        inherited: Option<U>,
        rule: impl FnOnce(&T::Ref) -> Result<U, E>,
    ) -> Option<U> {
        match raw {
            Some(value) => self.check(key, value, rule),
            None => inherited,
        }
    }

    /// A list: the file's, each item checked (a problem names `key[index]`
    /// and the item's line), if it is set; else the inherited one.
    fn get_each<T: Value, U, E: Into<String>>(
        &mut self,
        key: &str,
        raw: &Option<Spanned<Vec<Spanned<T>>>>,
        inherited: Option<Vec<U>>,
        rule: impl Fn(&T::Ref) -> Result<U, E>,
    ) -> Option<Vec<U>> {
        let Some(list) = raw else {
            return inherited;
        };
        let mut items = Vec::new();
        let mut valid = true;
        for (index, item) in list.get_ref().iter().enumerate() {
            match self.check(&format!("{key}[{index}]"), item, &rule) {
                Some(typed) => items.push(typed),
                None => valid = false,
            }
        }
        valid.then_some(items)
    }

    /// The typed configuration: `raw` layered over `base` (the built-in
    /// defaults; `None` while validating those), then the overrides.
    fn validate(
        &mut self,
        raw: &RawConfig,
        base: Option<&Config>,
        overrides: &Overrides,
    ) -> Option<Config> {
        let server = self.server(&raw.server, base.map(|b| &b.server), overrides);
        let upstream = self.upstream(&raw.upstream, base.map(|b| &b.upstream));
        let store = self.store(&raw.store, base.map(|b| &b.store), overrides);
        let sweeper = self.sweeper(&raw.sweeper, base.map(|b| &b.sweeper));
        // The built-in catch-all route carries the built-in policy and the
        // defaults of the route-only keys.
        let template = base.and_then(|b| b.routes.first());
        let defaults = self.policy("defaults", &raw.defaults, template.map(|t| &t.policy));
        let routes = self.routes(&raw.route, template, defaults.as_ref());
        Some(Config {
            server: server?,
            upstream: upstream?,
            store: store?,
            sweeper: sweeper?,
            routes: routes?,
        })
    }
}
