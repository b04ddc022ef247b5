//! Configuration files: any text. Parsing and validation never panic, a
//! refused file reports at least one problem, and every reported line is in
//! the file.
#![no_main]

use idemproxy::config::{parse, Overrides};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(err) = parse(text, "fuzz.toml", &Overrides::default()) {
        assert!(!err.problems.is_empty());
        let lines = text.lines().count().max(1) + 1;
        for problem in &err.problems {
            if let Some(line) = problem.line {
                assert!(
                    line >= 1 && line <= lines,
                    "{problem} (file has {lines} lines)"
                );
            }
        }
        let _ = err.to_string();
    }
});
