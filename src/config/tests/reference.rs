//! `docs/configuration.md` and `defaults.toml` against the raw structs:
//! every key documented with its default, every default set.

use super::*;
use crate::config::raw::{
    RawConfig, RawPolicy, RawRoute, RawServer, RawStore, RawSweeper, RawUpstream,
};

// --- the reference in docs/configuration.md ------------------------

use crate::config::env::fields_of;

/// Every `(section, key)` of the file, derived from the raw structs.
/// Route keys are its own; its `[defaults]` keys are documented once.
fn every_key() -> Vec<(&'static str, &'static str)> {
    let route_only: Vec<&str> = fields_of::<RawRoute>()
        .iter()
        .copied()
        .filter(|key| !fields_of::<RawPolicy>().contains(key))
        .collect();
    let sections: Vec<(&str, Vec<&str>)> = vec![
        ("server", fields_of::<RawServer>().to_vec()),
        ("upstream", fields_of::<RawUpstream>().to_vec()),
        ("store", fields_of::<RawStore>().to_vec()),
        ("sweeper", fields_of::<RawSweeper>().to_vec()),
        ("defaults", fields_of::<RawPolicy>().to_vec()),
        ("route", route_only),
    ];
    let mut names: Vec<&str> = sections.iter().map(|(s, _)| *s).collect();
    let mut top: Vec<&str> = fields_of::<RawConfig>().to_vec();
    names.sort_unstable();
    top.sort_unstable();
    assert_eq!(names, top, "a section is missing from every_key()");
    for policy_key in fields_of::<RawPolicy>() {
        assert!(
            fields_of::<RawRoute>().contains(policy_key),
            "route misses {policy_key}"
        );
    }
    sections
        .into_iter()
        .flat_map(|(section, keys)| keys.into_iter().map(move |key| (section, key)))
        .collect()
}

/// `(section, key, default cell)` of every row of the reference tables.
fn doc_rows() -> Vec<(String, String, String)> {
    include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .lines()
    .filter(|line| line.starts_with('|'))
    .filter_map(|line| {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let section = cells
            .get(1)?
            .trim_matches(|c| c == '`' || c == '[' || c == ']');
        let key = cells.get(2)?.trim_matches('`');
        Some((
            section.to_string(),
            key.to_string(),
            cells.get(4)?.to_string(),
        ))
    })
    .collect()
}

#[test]
fn raw_structs_have_the_expected_keys() {
    let keys = every_key();
    assert!(keys.contains(&("server", "header_read_timeout")));
    assert!(keys.contains(&("sweeper", "batch_size")));
    assert!(keys.contains(&("route", "name")));
    assert!(keys.contains(&("defaults", "wait")));
    assert_eq!(keys.len(), 12 + 4 + 9 + 3 + 12 + 5);
}

#[test]
fn builtin_defaults_set_every_key_but_the_optional_ones() {
    let builtin: toml::Table = toml::from_str(BUILTIN_DEFAULTS).unwrap();
    for (section, key) in every_key() {
        let table = match &builtin[section] {
            toml::Value::Array(routes) => &routes[0],
            table => table,
        };
        let optional = matches!(
            (section, key),
            ("route", "tenant_header")
                | ("server", "tls_cert_file" | "tls_key_file")
                | ("upstream" | "store", "ca_file")
                | ("store", "listen_url")
        );
        assert_eq!(table.get(key).is_some(), !optional, "{section}.{key}");
    }
}

#[test]
fn docs_describe_every_key_with_its_default() {
    let rows = doc_rows();
    let builtin: toml::Table = toml::from_str(BUILTIN_DEFAULTS).unwrap();
    for (section, key) in every_key() {
        let row = rows
            .iter()
            .find(|(s, k, _)| s == section && k == key)
            .unwrap_or_else(|| panic!("docs/configuration.md has no row for {section}.{key}"));
        let table = match &builtin[section] {
            toml::Value::Array(routes) => &routes[0],
            table => table,
        };
        // A route's name defaults to its path_prefix, not to the
        // catch-all's name.
        if let (Some(default), false) = (table.get(key), (section, key) == ("route", "name")) {
            let shown = format!("`{default}`");
            assert!(
                row.2.contains(&shown),
                "{section}.{key}: default {shown} not in {:?}",
                row.2
            );
        }
    }
    // And no row documents a key that does not exist.
    let keys = every_key();
    for (section, key, _) in &rows {
        if section == "Section" || section.starts_with('-') || key.contains(' ') {
            continue; // header, separator, prose rows
        }
        if section == "Variable" || section.starts_with("IDEMPROXY_") {
            continue; // the environment's table, checked below
        }
        assert!(
            keys.iter().any(|(s, k)| s == section && k == key),
            "docs/configuration.md documents unknown key {section}.{key}"
        );
    }
}

#[test]
fn docs_name_the_variable_of_every_key() {
    let rows = doc_rows();
    let keys = crate::config::env_keys();
    for key in keys {
        assert!(
            rows.iter()
                .any(|(var, dotted, _)| *var == key.var() && *dotted == key.dotted()),
            "docs/configuration.md has no row `{}` | `{}`",
            key.var(),
            key.dotted()
        );
    }
    let documented = rows
        .iter()
        .filter(|(var, _, _)| var.starts_with("IDEMPROXY_"))
        .count();
    assert_eq!(
        documented,
        keys.len(),
        "a row names a variable that does not exist"
    );
}
