//! What the compiler flags of a build say of it, read by `build.rs` (which
//! includes this file) and unit-tested with the crate.

/// What the flags say of PGO: "profile-guided" (`-Cprofile-use`: the
/// scripts pass the committed profile, scripts/rustflags.sh), "instrumented"
/// (`-Cprofile-generate`: a training build, slower and writing counts on
/// exit, never one to deploy) or "none". Whether the profile matched this
/// build's functions is `scripts/pgo check`'s question, not this one's.
pub(crate) fn pgo(flags: &[String]) -> &'static str {
    // `-Cprofile-use=P`, `-C profile-use=P` (two flags), `--codegen …`.
    let options = flags
        .iter()
        .enumerate()
        .filter_map(|(i, f)| match f.as_str() {
            "-C" | "--codegen" => flags.get(i + 1).map(String::as_str),
            f => f
                .strip_prefix("-C")
                .or_else(|| f.strip_prefix("--codegen=")),
        });
    let mut found = "none";
    for option in options {
        let name = option.split('=').next().unwrap_or_default();
        match name {
            "profile-generate" => return "instrumented",
            "profile-use" => found = "profile-guided",
            _ => {}
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::pgo;

    fn flags(list: &[&str]) -> Vec<String> {
        list.iter().map(|f| f.to_string()).collect()
    }

    #[test]
    fn the_committed_profile_in_any_spelling_is_profile_guided() {
        for list in [
            &[
                "-Cprofile-use=/src/pgo/idemproxy.profdata",
                "-Cllvm-args=-no-pgo-warn-mismatch",
            ][..],
            &["-C", "profile-use=/src/pgo/idemproxy.profdata"],
            &["--codegen=profile-use=/p.profdata"],
            &["--codegen", "profile-use=/p.profdata"],
            &["-Ctarget-feature=+crt-static", "-Cprofile-use=/p.profdata"],
        ] {
            assert_eq!(pgo(&flags(list)), "profile-guided", "{list:?}");
        }
    }

    #[test]
    fn a_training_build_is_instrumented_whatever_else_it_has() {
        assert_eq!(
            pgo(&flags(&["-Cprofile-generate=/build/pgo"])),
            "instrumented"
        );
        assert_eq!(
            pgo(&flags(&["-Cprofile-use=/p", "-C", "profile-generate"])),
            "instrumented"
        );
    }

    #[test]
    fn other_flags_or_none_are_no_pgo() {
        assert_eq!(pgo(&[]), "none");
        assert_eq!(
            pgo(&flags(&[
                "-Ctarget-cpu=native",
                "-C",
                "opt-level=3",
                "--cfg",
                "profile_use"
            ])),
            "none"
        );
        // A value that merely mentions the option is not the option.
        assert_eq!(pgo(&flags(&["-Cllvm-args=-profile-use"])), "none");
        // A trailing `-C` with nothing after it.
        assert_eq!(pgo(&flags(&["-C"])), "none");
    }
}
