//! Properties of parsing: it never panics, and its report is whole.

use proptest::prelude::*;

use super::*;

// --- never panics -------------------------------------------------

proptest! {
    #[test]
    fn parse_never_panics_on_arbitrary_text(text in any::<String>()) {
        let _ = parse(&text, "p.toml", &Overrides::default());
    }

    #[test]
    fn parse_never_panics_on_toml_like_text(text in "(\\[+[a-z\\[\\]]{0,8}\\]+|[a-z_.]{1,12} = (\"[^\"\\\\]{0,12}\"|[0-9-]{1,4}|\\[[0-9, \"A-Z]{0,10}\\]|true)|#.{0,5}|)(\n[a-z_ =\"\\[\\].0-9]{0,20}){0,12}") {
        let _ = parse(&text, "p.toml", &Overrides::default());
    }

    #[test]
    fn parse_never_panics_on_arbitrary_durations_and_sizes(
        lease in any::<String>(),
        retention in "[0-9]{0,25}(\\.[0-9]{0,5})? ?(ns|us|ms|s|m|h|d|w|M|y|years|)",
        size in "[0-9.]{0,25} ?(B|KiB|MiB|GiB|EiB|PB|kb|x|)",
    ) {
        let text = format!(
            "[defaults]\nlease = {}\nretention = {}\nmax_stored_response = {}\n",
            toml::Value::String(lease),
            toml::Value::String(retention),
            toml::Value::String(size),
        );
        let _ = parse(&text, "p.toml", &Overrides::default());
    }
}

// --- properties of the whole report ---------------------------------

/// Keys no section has (every real key is in lower-case ASCII without
/// this prefix).
fn unknown_key() -> impl Strategy<Value = String> {
    "zz_[a-z]{1,8}"
}

proptest! {
    #[test]
    fn every_unknown_key_is_reported_with_its_section_and_line(
        placed in proptest::collection::vec((0usize..5, unknown_key()), 1..8),
    ) {
        const SECTIONS: [&str; 5] = ["server", "upstream", "store", "sweeper", "defaults"];
        let mut text = String::new();
        let mut expected = Vec::new();
        for (i, section) in SECTIONS.iter().enumerate() {
            text.push_str(&format!("[{section}]\n"));
            let mut seen = std::collections::HashSet::new();
            for (_, key) in placed.iter().filter(|(s, _)| *s == i) {
                if seen.insert(key.clone()) {
                    text.push_str(&format!("{key} = 1\n"));
                    expected.push((format!("{section}.{key}"), text.lines().count()));
                }
            }
        }
        let err = parse(&text, "p.toml", &Overrides::default()).unwrap_err();
        prop_assert_eq!(err.problems.len(), expected.len(), "{}", err);
        for (key, line) in expected {
            let p = err.problems.iter().find(|p| p.key == key);
            prop_assert!(p.is_some(), "{} not reported in {}", key, err);
            prop_assert_eq!(p.unwrap().line, Some(line));
        }
    }

    #[test]
    fn every_bad_value_is_reported_at_once(mask in 1u8..32) {
        let bad = [
            ("server.listen", "[server]\nlisten = \"nonsense\"\n"),
            ("store.pool_size", "[store]\npool_size = -1\n"),
            ("sweeper.interval", "[sweeper]\ninterval = \"10 parsecs\"\n"),
            ("defaults.methods[0]", "[defaults]\nmethods = [\"post\"]\n"),
            ("route[0].path_prefix", "[[route]]\npath_prefix = \"v1\"\n"),
        ];
        let chosen: Vec<_> = bad.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, b)| b).collect();
        let text: String = chosen.iter().map(|(_, t)| *t).collect();
        let err = parse(&text, "p.toml", &Overrides::default()).unwrap_err();
        for (key, _) in &chosen {
            prop_assert!(err.problems.iter().any(|p| p.key == *key), "{} missing from {}", key, err);
        }
        prop_assert_eq!(err.problems.len(), chosen.len(), "{}", err);
    }

    #[test]
    fn durations_and_sizes_round_trip(
        lease_ms in 100u64..86_400_000,
        body in 0u64..(1 << 40),
    ) {
        let lease = Duration::from_millis(lease_ms);
        let text = format!(
            "[server]\nmax_request_body = \"{body}\"\n[defaults]\nlease = \"{}\"\nretention = \"400days\"\n",
            humantime::format_duration(lease)
        );
        let config = parse(&text, "p.toml", &Overrides::default()).unwrap();
        prop_assert_eq!(config.routes[0].policy.lease, lease);
        prop_assert_eq!(config.server.max_request_body, body);
        let kib = format!("[server]\nmax_request_body = \"{}KiB\"\n", body >> 10);
        let config = parse(&kib, "p.toml", &Overrides::default()).unwrap();
        prop_assert_eq!(config.server.max_request_body, (body >> 10) * 1024);
    }

    #[test]
    fn every_problem_line_is_a_line_of_the_file(text in "(\\[[a-z]{0,8}\\]|[a-z_]{1,10} = (\"[^\"\\\\]{0,8}\"|-?[0-9]{1,3}|\\[\\]))(\n(\\[\\[?[a-z]{0,8}\\]\\]?|[a-z_]{1,10} = (\"[^\"\\\\]{0,8}\"|-?[0-9]{1,3}|true))){0,15}") {
        if let Err(err) = parse(&text, "p.toml", &Overrides::default()) {
            prop_assert!(!err.problems.is_empty());
            let lines = text.lines().count().max(1);
            for p in &err.problems {
                if let Some(line) = p.line {
                    prop_assert!((1..=lines).contains(&line), "{} (file has {} lines)", p, lines);
                }
            }
        }
    }
}
