# deploy/build-lib.sh: how the static binaries and the image are built,
# shared by deploy/smoke/image-smoke.sh (which then runs the image) and
# scripts/release (which ships it). Sourced, not run: the caller defines
# log and die, and runs as root for apt-get and buildah.

# shellcheck shell=bash

# shellcheck source=scripts/rustflags.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/rustflags.sh"

MUSL=x86_64-unknown-linux-musl
GNU=x86_64-unknown-linux-gnu

# ensure_apt CMD=PACKAGE...: installs the Debian packages whose command is
# missing.
ensure_apt() {
    local missing=() cmd pkg pair
    for pair in "$@"; do
        cmd=${pair%%=*}
        pkg=${pair#*=}
        command -v "$cmd" >/dev/null || missing+=("$pkg")
    done
    ((${#missing[@]} == 0)) && return 0
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

# build_static_binaries: `cargo build --locked --profile dist --workspace
# --bins` of the current directory, with the PGO profile
# (release_rustflags), for musl (glibc with crt-static when the musl target
# cannot be installed), into $CARGO_TARGET_DIR; checks both binaries are
# static and that idemproxy --version says whether the profile was passed
# (IDEMPROXY_STATIC_TARGET=x86_64-unknown-linux-gnu: glibc with
# crt-static without trying musl). Sets STATIC_TARGET (the Rust target) and STATIC_BIN (their
# directory).
build_static_binaries() {
    local target=$MUSL b flags
    # IDEMPROXY_STATIC_TARGET=x86_64-unknown-linux-gnu skips the musl
    # attempt (rustup target add needs the network).
    if [[ ${IDEMPROXY_STATIC_TARGET:-} == "$GNU" ]]; then
        target=$GNU
    elif ! prepare_rust_target "$MUSL"; then
        target=$GNU
        log "the $MUSL target cannot be installed here; building $GNU with crt-static instead"
    fi
    if [[ $target == "$MUSL" ]]; then
        # Crates with C parts (ring, for TLS) compile them with musl's gcc
        # wrapper (CC_x86_64_unknown_linux_musl, set by prepare_rust_target).
        ensure_apt musl-gcc=musl-tools
        flags=$(release_rustflags)
        log "+ CC_x86_64_unknown_linux_musl=musl-gcc CARGO_ENCODED_RUSTFLAGS='${flags//$'\x1f'/ }' cargo build --locked --profile dist --target $MUSL --workspace --bins"
        CARGO_ENCODED_RUSTFLAGS=$flags cargo build --locked --profile dist --target "$MUSL" --workspace --bins
    else
        flags=$(release_rustflags -Ctarget-feature=+crt-static)
        log "+ CARGO_ENCODED_RUSTFLAGS='${flags//$'\x1f'/ }' cargo build --locked --profile dist --target $GNU --workspace --bins"
        CARGO_ENCODED_RUSTFLAGS=$flags cargo build --locked --profile dist --target "$GNU" --workspace --bins
    fi
    # shellcheck disable=SC2034 # read by the caller
    STATIC_TARGET=$target
    STATIC_BIN=${CARGO_TARGET_DIR:-target}/$target/dist
    for b in idemproxy sample-upstream; do
        [[ -x $STATIC_BIN/$b ]] || die "$STATIC_BIN/$b was not built"
        if readelf -l "$STATIC_BIN/$b" | grep -q 'Requesting program interpreter'; then
            die "$b is dynamically linked"
        fi
        if readelf -d "$STATIC_BIN/$b" | grep -q NEEDED; then die "$b needs shared libraries"; fi
    done
    local pgo=none reported
    if [[ $flags == *-Cprofile-use=* ]]; then pgo="profile-guided"; fi
    reported=$("$STATIC_BIN/idemproxy" --version)
    [[ $reported == *", pgo $pgo)" ]] || die "idemproxy --version says '$reported', not pgo $pgo"
}

# build_image DOCKERFILE BIN_DIR WORK IMAGE OCI_TAG VERSION REVISION: the
# image from the repository's Dockerfile with the binaries of BIN_DIR
# (BINARY_SOURCE=prebuilt, nothing pulled), in buildah storage under WORK,
# pushed to the OCI layout WORK/oci as OCI_TAG. The build context is a
# directory with only dist/: the prebuilt stage reads nothing else.
build_image() {
    local dockerfile=$1 bin=$2 work=$3 image=$4 tag=$5 version=$6 revision=$7
    local ca=/etc/ssl/certs/ca-certificates.crt
    ensure_apt buildah=buildah
    mkdir -p "$work/context/dist"
    cp "$bin/idemproxy" "$bin/sample-upstream" "$work/context/dist/"
    [[ -f $ca ]] || ensure_apt update-ca-certificates=ca-certificates
    cp "$ca" "$work/context/dist/ca-certificates.crt"
    log "+ buildah bud --build-arg BINARY_SOURCE=prebuilt -f Dockerfile -t $image"
    bah "$work" bud --quiet --isolation chroot --pull=never --layers=false \
        --build-arg BINARY_SOURCE=prebuilt \
        --build-arg VERSION="$version" \
        --build-arg REVISION="$revision" \
        --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
        -f "$dockerfile" -t "$image" "$work/context" >"$work/buildah.log" 2>&1 ||
        die "buildah bud failed (log: $work/buildah.log)"
    bah "$work" push --quiet "$image" "oci:$work/oci:$tag" >>"$work/buildah.log" 2>&1 ||
        die "buildah push to an OCI layout failed"
}

# bah WORK ARGS...: buildah with its storage under WORK (vfs: works in any
# container, as root, without a daemon).
bah() {
    local work=$1
    shift
    buildah --root "$work/storage" --runroot "$work/storage-run" --storage-driver vfs "$@"
}
