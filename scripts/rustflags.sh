# scripts/rustflags.sh: the rustc flags and targets of release builds,
# shared by scripts/lib.sh (scripts/dev, bench/, scripts/pgo) and
# deploy/build-lib.sh (the image, scripts/release). Sourced, not run: the
# caller defines log.

# shellcheck shell=bash

# The major version of the LLVM that rustc uses (rustc -vV).
rustc_llvm_major() {
    rustc -vV | sed -n 's/^LLVM version: \([0-9][0-9]*\).*/\1/p' | grep .
}

# The rustc flags of a release build, for CARGO_ENCODED_RUSTFLAGS (which
# takes them separated by 0x1f, so the checkout's path may hold spaces):
# RUSTFLAGS from the environment, -Cprofile-use with the committed PGO
# profile (scripts/pgo) when this rustc can read it, then the arguments.
# Without a usable profile it says why (on stderr) and leaves it out: the
# build is then the plain release build.
# shellcheck disable=SC2120 # the arguments are optional
release_rustflags() {
    local root profile major have flags=()
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
    profile=$root/pgo/idemproxy.profdata
    # shellcheck disable=SC2206 # RUSTFLAGS is whitespace-separated, as cargo reads it
    [[ -n ${RUSTFLAGS:-} ]] && flags=($RUSTFLAGS)
    if [[ ! -f $profile ]]; then
        log "no PGO profile (pgo/idemproxy.profdata): building without one"
    elif ! major=$(rustc_llvm_major); then
        log "cannot tell rustc's LLVM version: building without the PGO profile"
    elif have=$(sed -n 's/^llvm_major=//p' "$root/pgo/PROFILE" 2>/dev/null) && [[ -n $have ]] && ((major < have)); then
        log "the PGO profile was written by LLVM $have; this rustc's LLVM $major cannot read it: building without it"
    else
        flags+=("-Cprofile-use=$profile")
        if [[ ${PGO_WARNINGS:-} == 1 ]]; then
            # scripts/pgo check: a warning for each function built without
            # counts, whether it changed since the training or has none.
            flags+=(-Cllvm-args=-pgo-warn-missing-function)
        else
            # Functions changed since the training are built as without a
            # profile; LLVM would warn about each.
            flags+=(-Cllvm-args=-no-pgo-warn-mismatch)
        fi
    fi
    flags+=("$@")
    local IFS=$'\x1f'
    printf '%s' "${flags[*]}"
}

# `cargo build --release ARGS…` with the flags of release_rustflags.
release_build() {
    CARGO_ENCODED_RUSTFLAGS=$(release_rustflags) cargo build --release "$@"
}

# prepare_rust_target TRIPLE: the Rust target installed (rustup target add
# when missing; that needs the Rust distribution server) and, for musl,
# CC_<target>=musl-gcc exported for the crates with C parts (ring): the
# caller installs musl-gcc (Debian's musl-tools). Fails when the target
# cannot be installed.
prepare_rust_target() {
    local target=$1
    if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
        log "adding the Rust target $target"
        rustup target add "$target" >&2 || return 1
    fi
    if [[ $target == *-musl ]]; then
        export "CC_${target//-/_}=musl-gcc"
    fi
}
