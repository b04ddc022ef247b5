//! Records the commit the binary is built from, and whether it was built
//! with profile-guided optimisation, for `idemproxy --version` and the
//! `idemproxy_build_info` gauge (`src/version.rs`).
//!
//! The commit comes from git when the sources are this repository's work
//! tree; otherwise (a source archive, a container build that leaves `.git`
//! out) from `IDEMPROXY_BUILD_COMMIT`; otherwise it is "unknown".
//!
//! Only `HEAD`, the branch it points to and `packed-refs` trigger a rerun
//! (plus the environment variable): a commit recompiles this crate, never
//! its dependencies, and an edit to a source file does not run git again.

use std::path::{Path, PathBuf};
use std::process::Command;

// Shared with the crate, where its unit tests run.
#[path = "src/build_flags.rs"]
mod build_flags;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/build_flags.rs");
    println!("cargo:rerun-if-env-changed=IDEMPROXY_BUILD_COMMIT");
    // The flags are part of this script's fingerprint, except (cargo issue
    // 13003) a --target build's: our scripts pass them in the environment.
    println!("cargo:rerun-if-env-changed=CARGO_ENCODED_RUSTFLAGS");
    println!("cargo:rerun-if-env-changed=RUSTFLAGS");
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let commit = from_git(&manifest)
        .or_else(|| {
            std::env::var("IDEMPROXY_BUILD_COMMIT")
                .ok()
                .map(|c| c.trim().to_owned())
                .filter(|c| !c.is_empty())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=IDEMPROXY_BUILD_COMMIT={commit}");
    println!(
        "cargo:rustc-env=IDEMPROXY_BUILD_PGO={}",
        build_flags::pgo(&rustflags())
    );
}

/// The flags rustc compiles this crate with (cargo hands them to build
/// scripts, one per `\x1f`-separated field; a change rebuilds every crate).
fn rustflags() -> Vec<String> {
    std::env::var("CARGO_ENCODED_RUSTFLAGS")
        .unwrap_or_default()
        .split('\x1f')
        .filter(|f| !f.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The short commit of HEAD, if `dir` is the top of a git work tree (not a
/// source archive unpacked somewhere inside another repository).
fn from_git(dir: &Path) -> Option<String> {
    let top = PathBuf::from(git(dir, &["rev-parse", "--show-toplevel"])?);
    if top.canonicalize().ok()? != dir.canonicalize().ok()? {
        return None;
    }
    let git_dir = PathBuf::from(git(dir, &["rev-parse", "--absolute-git-dir"])?);
    let common = git(dir, &["rev-parse", "--git-common-dir"])
        .map(|c| dir.join(c))
        .unwrap_or_else(|| git_dir.clone());
    let head = git_dir.join("HEAD");
    println!("cargo:rerun-if-changed={}", head.display());
    if let Ok(text) = std::fs::read_to_string(&head) {
        if let Some(reference) = text.trim().strip_prefix("ref: ") {
            // A worktree's branch lives in the common directory.
            for base in [&git_dir, &common] {
                let path = base.join(reference);
                if path.exists() {
                    println!("cargo:rerun-if-changed={}", path.display());
                }
            }
        }
    }
    let packed = common.join("packed-refs");
    if packed.exists() {
        println!("cargo:rerun-if-changed={}", packed.display());
    }
    git(dir, &["rev-parse", "--short=7", "HEAD"])
}
