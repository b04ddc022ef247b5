# syntax=docker/dockerfile:1
#
# idemproxy: a static binary on an empty (`scratch`) base. The image holds
# two programs: /usr/local/bin/idemproxy (the entrypoint) and
# /usr/local/bin/sample-upstream (a counting stand-in for a legacy API, used
# by deploy/compose; the workspace's sample-upstream/ package, hence
# `--workspace`). No shell, no package manager, no libc.
#
# Two ways to get the binaries (docs/deploy.md has the details); the first
# builds for amd64 and arm64 alike:
#
#   # 1. compile them in a Rust image (needs BuildKit and network access):
#   docker build -t idemproxy .
#
#   # 2. package binaries built on the host (no base image is pulled):
#   CC_x86_64_unknown_linux_musl=musl-gcc \
#   RUSTFLAGS="-Cprofile-use=$PWD/pgo/idemproxy.profdata -Cllvm-args=-no-pgo-warn-mismatch" \
#     cargo build --locked --profile dist --target x86_64-unknown-linux-musl --workspace --bins
#   mkdir -p dist
#   cp target/x86_64-unknown-linux-musl/dist/idemproxy \
#      target/x86_64-unknown-linux-musl/dist/sample-upstream dist/
#   cp /etc/ssl/certs/ca-certificates.crt dist/
#   docker build --build-arg BINARY_SOURCE=prebuilt -t idemproxy .
#
# BINARY_SOURCE names the stage whose /out/ holds idemproxy, sample-upstream
# and ca-certificates.crt. Builders that skip unused stages (BuildKit,
# buildah) then never touch the other one.

# The rustc the PGO profile was trained with (pgo/PROFILE), to the patch
# release: cargo's metadata, and so every symbol the profile names, depends
# on it; with another rustc the build works but gets none of its counts.
ARG RUST_VERSION=1.95.0
ARG BINARY_SOURCE=builder

# ---------------------------------------------------------------------------
# builder: compiles static (musl) binaries for the image's architecture
# (TARGETARCH: amd64 or arm64), on the build machine's own (BUILDPLATFORM):
# cross-compiling is much faster than emulating the target. musl-tools
# gives the C compiler (musl-gcc) that crates with C or assembly parts,
# such as ring, use for x86_64; for aarch64 the Debian cross gcc compiles
# those parts and links.
#
#   docker buildx build --platform linux/amd64,linux/arm64 -t idemproxy .
#
# (The cross compilers are those of an amd64 build machine.)
FROM --platform=$BUILDPLATFORM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS builder
ARG TARGETARCH
# The commit `idemproxy --version` names: .git stays out of the build
# context, so build.rs reads it from IDEMPROXY_BUILD_COMMIT.
ARG REVISION=""
ENV CC_x86_64_unknown_linux_musl=musl-gcc \
    CC_aarch64_unknown_linux_musl=aarch64-linux-gnu-gcc \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER=aarch64-linux-gnu-gcc
# hadolint ignore=DL3008
RUN case "${TARGETARCH:-amd64}" in \
        amd64) echo x86_64-unknown-linux-musl >/rust-target; set -- musl-tools ;; \
        arm64) echo aarch64-unknown-linux-musl >/rust-target; set -- gcc-aarch64-linux-gnu libc6-dev-arm64-cross ;; \
        *) echo "unsupported TARGETARCH ${TARGETARCH}" >&2; exit 1 ;; \
    esac \
    && apt-get update \
    && apt-get install -y --no-install-recommends "$@" \
    && rm -rf /var/lib/apt/lists/* \
    && rustup target add "$(cat /rust-target)"
WORKDIR /src
COPY . .
# With the PGO profile of pgo/ when this rustc can read it, as every
# release build (scripts/rustflags.sh).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=idemproxy-target-${TARGETARCH} \
    TARGET="$(cat /rust-target)" \
    && log() { echo "idemproxy build: $*" >&2; } \
    && . scripts/rustflags.sh \
    && CARGO_ENCODED_RUSTFLAGS="$(release_rustflags)" IDEMPROXY_BUILD_COMMIT="${REVISION}" \
       cargo build --locked --profile dist --target "${TARGET}" --workspace --bins \
    && mkdir -p /out \
    && cp "target/${TARGET}/dist/idemproxy" "target/${TARGET}/dist/sample-upstream" \
          /etc/ssl/certs/ca-certificates.crt /out/

# ---------------------------------------------------------------------------
# prebuilt: binaries built elsewhere, taken from the build context.
FROM scratch AS prebuilt
ARG DIST_DIR=dist
COPY ${DIST_DIR}/idemproxy ${DIST_DIR}/sample-upstream ${DIST_DIR}/ca-certificates.crt /out/

# ---------------------------------------------------------------------------
FROM ${BINARY_SOURCE} AS binaries

# ---------------------------------------------------------------------------
# runtime
FROM scratch
# Set by whoever builds a release: the git commit and an RFC 3339 time.
ARG VERSION=0.1.0
ARG REVISION=""
ARG CREATED=""
# Where the sources and the documentation are published.
ARG SOURCE_URL="https://github.com/idemproxy/idemproxy"
ARG DOCUMENTATION_URL="https://github.com/idemproxy/idemproxy/blob/main/docs/deploy.md"
LABEL org.opencontainers.image.title="idemproxy" \
      org.opencontainers.image.description="Reverse-proxy sidecar that makes non-idempotent HTTP APIs safe to retry with Idempotency-Key" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.documentation="${DOCUMENTATION_URL}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}"
# Trust anchors for TLS to the database or an https:// upstream.
COPY --from=binaries /out/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=binaries /out/idemproxy /out/sample-upstream /usr/local/bin/
# Numeric, so Kubernetes' runAsNonRoot can verify it without an /etc/passwd.
USER 65532:65532
# 8080: the proxy; 9090: /healthz, /readyz, /metrics (when admin_listen
# binds a non-loopback address, as deploy/ does).
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/idemproxy"]
# The configuration comes from IDEMPROXY_CONFIG (or --config) and the
# database URL from IDEMPROXY_DATABASE_URL.
CMD ["serve"]
