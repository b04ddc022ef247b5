//! The rustc flags of release builds (`release_rustflags`,
//! scripts/rustflags.sh): the committed PGO profile goes to rustc when this
//! rustc's LLVM can read it, and is left out, with a reason on stderr, when
//! it is missing or was written by a newer LLVM; `scripts/pgo check` keeps
//! LLVM's warnings about functions built without counts. Run through bash
//! as the build scripts run it (docs/deploy.md, "Profile-guided
//! optimisation").

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `release_rustflags EXTRA…` sourced from `<checkout>/scripts/rustflags.sh`,
/// with `RUSTFLAGS` set to `rustflags`: the flags (split at 0x1f) and
/// stderr.
fn release_rustflags(checkout: &Path, rustflags: &str, extra: &[&str]) -> (Vec<String>, String) {
    release_rustflags_with(checkout, rustflags, extra, None)
}

/// The same with `PGO_WARNINGS` set to `warnings` (unset: `None`), as
/// `scripts/pgo check` sets it.
fn release_rustflags_with(
    checkout: &Path,
    rustflags: &str,
    extra: &[&str],
    warnings: Option<&str>,
) -> (Vec<String>, String) {
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(r#"set -euo pipefail; log() { printf '%s\n' "$*" >&2; }; . "$1"; shift; release_rustflags "$@""#)
        .arg("bash")
        .arg(checkout.join("scripts/rustflags.sh"))
        .args(extra)
        .env("RUSTFLAGS", rustflags)
        .env_remove("PGO_WARNINGS");
    if let Some(value) = warnings {
        command.env("PGO_WARNINGS", value);
    }
    let out = command.output().expect("bash runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "release_rustflags failed: {stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let flags = if stdout.is_empty() {
        Vec::new()
    } else {
        stdout.split('\x1f').map(str::to_owned).collect()
    };
    (flags, stderr)
}

/// rustc's LLVM major version, as the script reads it.
fn llvm_major() -> u32 {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc runs");
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .expect("rustc -vV names its LLVM version");
    line.split('.').next().unwrap().parse().unwrap()
}

/// A checkout of its own holding scripts/rustflags.sh and, when given,
/// pgo/PROFILE (a profile file beside it when `profile` is set).
fn scratch_checkout(name: &str, profile_llvm: Option<u32>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idemproxy-release-flags-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("scripts")).unwrap();
    std::fs::copy(
        root().join("scripts/rustflags.sh"),
        dir.join("scripts/rustflags.sh"),
    )
    .unwrap();
    if let Some(major) = profile_llvm {
        std::fs::create_dir_all(dir.join("pgo")).unwrap();
        std::fs::write(
            dir.join("pgo/idemproxy.profdata"),
            b"not read by the script",
        )
        .unwrap();
        std::fs::write(dir.join("pgo/PROFILE"), format!("llvm_major={major}\n")).unwrap();
    }
    dir
}

/// The `-Cprofile-use` flag of `checkout`'s profile.
fn profile_use(checkout: &Path) -> String {
    format!(
        "-Cprofile-use={}",
        checkout
            .canonicalize()
            .unwrap()
            .join("pgo/idemproxy.profdata")
            .display()
    )
}

#[test]
fn the_committed_profile_is_passed_to_this_rustc_after_rustflags_and_before_the_arguments() {
    let checkout = root().canonicalize().unwrap();
    let (flags, stderr) =
        release_rustflags(&checkout, "-Copt-level=3 -Cdebuginfo=1", &["-Cextra=1"]);
    let profile = checkout.join("pgo/idemproxy.profdata");
    assert_eq!(
        flags,
        vec![
            "-Copt-level=3".to_owned(),
            "-Cdebuginfo=1".to_owned(),
            format!("-Cprofile-use={}", profile.display()),
            "-Cllvm-args=-no-pgo-warn-mismatch".to_owned(),
            "-Cextra=1".to_owned(),
        ],
        "stderr: {stderr}"
    );
    assert!(profile.is_file(), "pgo/idemproxy.profdata is committed");
}

#[test]
fn a_profile_from_a_newer_llvm_is_left_out_and_the_build_is_told_why() {
    let major = llvm_major();
    let checkout = scratch_checkout("newer", Some(major + 1));
    let (flags, stderr) = release_rustflags(&checkout, "", &["-Ctarget-feature=+crt-static"]);
    assert_eq!(flags, vec!["-Ctarget-feature=+crt-static".to_owned()]);
    assert!(
        stderr.contains(&format!("written by LLVM {}", major + 1)),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&checkout);
}

#[test]
fn a_profile_from_this_llvm_is_used() {
    let checkout = scratch_checkout("same", Some(llvm_major()));
    let (flags, stderr) = release_rustflags(&checkout, "", &[]);
    assert_eq!(
        flags,
        vec![
            profile_use(&checkout),
            "-Cllvm-args=-no-pgo-warn-mismatch".to_owned(),
        ],
        "stderr: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&checkout);
}

#[test]
fn without_a_profile_the_build_is_the_plain_one_and_says_so() {
    let checkout = scratch_checkout("none", None);
    let (flags, stderr) = release_rustflags(&checkout, "", &[]);
    assert!(flags.is_empty(), "{flags:?}");
    assert!(stderr.contains("no PGO profile"), "{stderr}");
    let _ = std::fs::remove_dir_all(&checkout);
}

#[test]
fn the_check_build_keeps_llvm_s_warnings_about_functions_without_counts() {
    let checkout = scratch_checkout("warnings", Some(llvm_major()));
    let profile = profile_use(&checkout);
    let (flags, stderr) = release_rustflags_with(&checkout, "", &[], Some("1"));
    assert_eq!(
        flags,
        vec![
            profile.clone(),
            "-Cllvm-args=-pgo-warn-missing-function".to_owned()
        ],
        "stderr: {stderr}"
    );
    // Anything but 1 is the shipped build's: the warnings stay off.
    let (flags, stderr) = release_rustflags_with(&checkout, "", &[], Some("0"));
    assert_eq!(
        flags,
        vec![profile, "-Cllvm-args=-no-pgo-warn-mismatch".to_owned()],
        "stderr: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&checkout);
}
