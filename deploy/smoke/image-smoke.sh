#!/usr/bin/env bash
# deploy/smoke/image-smoke.sh: build the container image from the Dockerfile
# and run it, without a Docker engine and without pulling any base image.
#
#   1. builds static binaries on the host (musl; glibc + crt-static if the
#      musl target cannot be installed),
#   2. builds the image with buildah from the repository's Dockerfile, using
#      those binaries (BINARY_SOURCE=prebuilt) and a `scratch` runtime,
#   3. unpacks it with umoci into an OCI runtime bundle and runs it with runc
#      on the host's network, as the image's user, with a read-only root
#      filesystem and no capabilities:
#        - the image's sample-upstream, as the legacy API,
#        - `idemproxy migrate` against a fresh database (as the Kubernetes Job),
#        - `idemproxy serve --no-migrate` (as the sidecar),
#   4. checks: /readyz becomes 200; a keyed POST sent twice executes once (the
#      second answer carries Idempotent-Replayed: true and the same body, and
#      the upstream counted one execution); /metrics counts the replay;
#      `idemproxy health` works inside the container; SIGTERM exits 0.
#
# Runs as root, offline, with Debian's buildah, umoci and runc (installed on
# demand). PostgreSQL: IDEMPROXY_TEST_DATABASE_URL or DATABASE_URL (an admin
# URL whose user may CREATE DATABASE), else 127.0.0.1:5432 as user postgres,
# else the throwaway cluster of `scripts/dev db start`.
#
# Environment: IDEMPROXY_CI_CACHE (default ~/.cache/idemproxy-ci) holds the
# cargo target directory of the static build; KEEP_SMOKE_DIR=1 keeps the
# work directory (image, bundle, logs) for inspection.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
cd "$ROOT"
CACHE=${IDEMPROXY_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/idemproxy-ci}
IMAGE=localhost/idemproxy:smoke

log() { printf 'smoke: %s\n' "$*" >&2; }
die() {
    printf 'smoke: FAILED: %s\n' "$*" >&2
    exit 1
}

[[ $EUID -eq 0 ]] || die "runs as root (runc and buildah storage)"

# ---------------------------------------------------------------------------
# Tools: Debian packages, installed when missing.

# shellcheck source=deploy/build-lib.sh
source "$ROOT/deploy/build-lib.sh"

ensure_apt buildah=buildah umoci=umoci runc=runc jq=jq curl=curl psql=postgresql-client
log "tools: $(buildah --version | head -n1); $(umoci --version); $(runc --version | head -n1)"

# ---------------------------------------------------------------------------
# Work directory and cleanup.

WORK=$(mktemp -d -t idemproxy-smoke.XXXXXX)
chmod 0755 "$WORK"
RUNC_ROOT=$WORK/runc-state
CONTAINERS=()
PIDS=()
DB_NAME=
ADMIN_URL=
PG_STARTED=0

cleanup() {
    local rc=$? id
    trap - EXIT
    for id in ${CONTAINERS[@]+"${CONTAINERS[@]}"}; do
        runc --root "$RUNC_ROOT" kill "$id" KILL 2>/dev/null || true
        runc --root "$RUNC_ROOT" delete --force "$id" 2>/dev/null || true
    done
    for id in ${PIDS[@]+"${PIDS[@]}"}; do
        wait "$id" 2>/dev/null || true
    done
    if [[ -n $DB_NAME ]]; then
        psql "$ADMIN_URL" -w -X -q -c "DROP DATABASE IF EXISTS \"$DB_NAME\" WITH (FORCE)" \
            </dev/null >/dev/null 2>&1 || true
    fi
    if [[ $PG_STARTED == 1 ]]; then scripts/dev db stop || true; fi
    if ((rc != 0)); then
        for f in "$WORK"/*.log; do
            [[ -f $f ]] || continue
            printf -- '--- %s (last 40 lines)\n' "${f##*/}" >&2
            tail -n 40 "$f" >&2
        done
    fi
    if [[ ${KEEP_SMOKE_DIR:-0} == 1 ]]; then
        log "kept $WORK"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------
# 1. Static binaries.

start=$SECONDS
export CARGO_TARGET_DIR="$CACHE/target"
# Incremental compilation in the cached target directory: a fresh clone
# whose sources did not change rebuilds in seconds instead of minutes. The
# binaries are the dist profile's otherwise.
export CARGO_PROFILE_DIST_INCREMENTAL=true
build_static_binaries
target=$STATIC_TARGET
BIN=$STATIC_BIN
log "static binaries ($target) in $((SECONDS - start))s: idemproxy $(stat -c %s "$BIN/idemproxy") bytes, sample-upstream $(stat -c %s "$BIN/sample-upstream") bytes"

# ---------------------------------------------------------------------------
# 2. The image, from the repository's Dockerfile. The build context is a
# directory with only dist/: the prebuilt stage reads nothing else.

start=$SECONDS
revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
build_image "$ROOT/Dockerfile" "$BIN" "$WORK" "$IMAGE" smoke "$version" "$revision"

# What the image promises: its config, read back from the OCI layout.
manifest=$(jq -r '.manifests[0].digest' "$WORK/oci/index.json")
manifest=$WORK/oci/blobs/${manifest/://}
config=$WORK/oci/blobs/$(jq -r '.config.digest' "$manifest" | tr : /)
user=$(jq -r '.config.User' "$config")
[[ $user =~ ^[1-9][0-9]*(:[0-9]+)?$ ]] || die "image user is $user, not a numeric non-root user"
[[ $(jq -r '.config.ExposedPorts | keys | join(",")' "$config") == "8080/tcp,9090/tcp" ]] ||
    die "image does not expose 8080 and 9090"
[[ $(jq -r '.config.Entrypoint | join(" ")' "$config") == /usr/local/bin/idemproxy ]] ||
    die "unexpected entrypoint"
[[ $(jq -r '.config.Labels["org.opencontainers.image.title"]' "$config") == idemproxy ]] ||
    die "OCI labels missing"
for label in source documentation; do
    [[ $(jq -r ".config.Labels[\"org.opencontainers.image.$label\"] // \"\"" "$config") == https://* ]] ||
        die "OCI label $label missing"
done
[[ $(jq '.layers | length' "$manifest") -ge 1 ]] || die "image has no layers"
compressed=$(jq '[.layers[].size] | add' "$manifest")

umoci unpack --image "$WORK/oci:smoke" "$WORK/bundle" >"$WORK/umoci.log" 2>&1 ||
    die "umoci unpack failed"
ROOTFS=$WORK/bundle/rootfs
unpacked=$(du -sb "$ROOTFS" | cut -f1)
files=$(find "$ROOTFS" -type f -printf '/%P\n' | sort | tr '\n' ' ')
[[ ! -e $ROOTFS/bin/sh ]] || die "the image has a shell"
log "image built in $((SECONDS - start))s: user $user, $compressed bytes compressed, $unpacked bytes unpacked; files: $files"

# ---------------------------------------------------------------------------
# 3. PostgreSQL: a fresh database for this run.

for var in IDEMPROXY_TEST_DATABASE_URL DATABASE_URL; do
    if [[ -n ${!var:-} ]]; then
        ADMIN_URL=${!var}
        break
    fi
done
if [[ -z $ADMIN_URL ]]; then
    ADMIN_URL=postgres://postgres@127.0.0.1:5432/postgres
    if ! psql "$ADMIN_URL" -w -X -Atc 'select 1' </dev/null >/dev/null 2>&1; then
        log "no PostgreSQL on 127.0.0.1:5432; starting the throwaway cluster of scripts/dev"
        if ! scripts/dev db status >/dev/null 2>&1; then PG_STARTED=1; fi
        ADMIN_URL=$(scripts/dev db start | tail -n1)
    fi
fi
psql "$ADMIN_URL" -w -X -Atc 'select 1' </dev/null >/dev/null ||
    die "cannot connect to PostgreSQL (set IDEMPROXY_TEST_DATABASE_URL)"
DB_NAME=idemproxy_smoke_$$
psql "$ADMIN_URL" -w -X -q -c "CREATE DATABASE \"$DB_NAME\"" </dev/null >/dev/null
re='^(postgres(ql)?://[^/?]*)(/[^?]*)?(\?.*)?$'
[[ $ADMIN_URL =~ $re ]] || die "cannot derive a database URL from the admin URL"
DB_URL="${BASH_REMATCH[1]}/$DB_NAME${BASH_REMATCH[4]}"
log "database: $DB_NAME (fresh)"

# ---------------------------------------------------------------------------
# 4. Containers: the image's bundle config, on the host's network, with the
# image's user, a read-only root, no capabilities and no new privileges.

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
UPSTREAM_PORT=$(free_port)
PROXY_PORT=$(free_port)
ADMIN_PORT=$(free_port)

mkdir -p "$WORK/etc"
cat >"$WORK/etc/idemproxy.toml" <<EOF
[server]
listen = "127.0.0.1:$PROXY_PORT"
admin_listen = "127.0.0.1:$ADMIN_PORT"
shutdown_grace = "5s"

[upstream]
url = "http://127.0.0.1:$UPSTREAM_PORT"

[store]
pool_size = 4

[[route]]
name = "all"
path_prefix = "/"
EOF
chmod -R a+rX "$WORK/etc"

# bundle NAME ARG...: a runc bundle directory sharing the unpacked rootfs.
bundle() {
    local name=$1
    shift
    mkdir -p "$WORK/$name"
    local args
    args=$(printf '%s\n' "$@" | jq -R . | jq -s .)
    jq --arg rootfs "$ROOTFS" --arg etc "$WORK/etc" --arg db "$DB_URL" \
        --argjson args "$args" '
        .root = {path: $rootfs, readonly: true}
        | .process.terminal = false
        | .process.args = $args
        | .process.env += ["IDEMPROXY_DATABASE_URL=" + $db, "RUST_LOG=info"]
        | .process.noNewPrivileges = true
        | .process.capabilities = {bounding: [], effective: [], inheritable: [], permitted: [], ambient: []}
        | .linux.namespaces |= map(select(.type != "network"))
        | .mounts += [{destination: "/etc/idemproxy", type: "bind", source: $etc,
                       options: ["rbind", "ro"]}]
        ' <"$WORK/bundle/config.json" >"$WORK/$name/config.json"
}

# start NAME ARG...: runs a container in the background, logging to NAME.log.
start() {
    local name=$1
    shift
    bundle "$name" "$@"
    local id=smoke-$name-$$
    CONTAINERS+=("$id")
    runc --root "$RUNC_ROOT" run --bundle "$WORK/$name" "$id" >"$WORK/$name.log" 2>&1 &
    PIDS+=($!)
}

# wait_http URL SECONDS: until URL answers 200.
wait_http() {
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        if [[ $(curl -s -o /dev/null -w '%{http_code}' "$1" 2>/dev/null) == 200 ]]; then
            return 0
        fi
        sleep 0.1
    done
    return 1
}

start upstream /usr/local/bin/sample-upstream --listen "127.0.0.1:$UPSTREAM_PORT"
wait_http "http://127.0.0.1:$UPSTREAM_PORT/__sample/health" 10 ||
    die "the image's sample-upstream did not come up"
log "sample-upstream (from the image) listens on 127.0.0.1:$UPSTREAM_PORT"

bundle migrate /usr/local/bin/idemproxy migrate --config /etc/idemproxy/idemproxy.toml
runc --root "$RUNC_ROOT" run --bundle "$WORK/migrate" "smoke-migrate-$$" >"$WORK/migrate.log" 2>&1 ||
    die "idemproxy migrate failed in the container"
log "idemproxy migrate: $(grep -v '^$' "$WORK/migrate.log" | tail -n1)"

start proxy /usr/local/bin/idemproxy --log-format json serve \
    --config /etc/idemproxy/idemproxy.toml --no-migrate
PROXY_PID=${PIDS[-1]}
wait_http "http://127.0.0.1:$ADMIN_PORT/readyz" 30 || die "/readyz did not become 200"
log "/readyz: 200"

# ---------------------------------------------------------------------------
# 5. A keyed POST, twice.

post() {
    curl -sS -o "$WORK/$1.body" -D "$WORK/$1.headers" -w '%{http_code}' \
        -X POST "http://127.0.0.1:$PROXY_PORT/v1/orders" \
        -H 'Idempotency-Key: smoke-order-1' -H 'Content-Type: application/json' \
        -d '{"amount": 100, "currency": "EUR"}'
}
replayed() { grep -i '^idempotent-replayed:' "$WORK/$1.headers" | tr -d '\r' | cut -d' ' -f2; }

status1=$(post first)
status2=$(post second)
[[ $status1 == 201 ]] || die "first POST answered $status1: $(cat "$WORK/first.body")"
[[ -z $(replayed first) ]] || die "the first answer claims to be a replay"
[[ $status2 == 201 ]] || die "second POST answered $status2"
[[ $(replayed second) == true ]] || die "the second answer lacks Idempotent-Replayed: true"
cmp -s "$WORK/first.body" "$WORK/second.body" || die "the replayed body differs"
executions=$(curl -s "http://127.0.0.1:$UPSTREAM_PORT/__sample/executions?key=smoke-order-1" |
    jq -r .executions)
[[ $executions == 1 ]] || die "the upstream executed the key $executions times"
log "keyed POST twice: 201 then 201 with Idempotent-Replayed: true, same body; upstream executions: 1"

metrics=$(curl -s "http://127.0.0.1:$ADMIN_PORT/metrics")
for series in 'idemproxy_requests_total{status_class="2xx",route="all",outcome="claimed"} 1' \
    'idemproxy_requests_total{status_class="2xx",route="all",outcome="replayed"} 1'; do
    grep -qF "$series" <<<"$metrics" || die "/metrics lacks: $series"
done
log "/metrics: claimed 1, replayed 1"

runc --root "$RUNC_ROOT" exec --user "$user" "smoke-proxy-$$" /usr/local/bin/idemproxy health \
    --url "http://127.0.0.1:$ADMIN_PORT/readyz" >"$WORK/health.log" 2>&1 ||
    die "idemproxy health failed inside the container"
if runc --root "$RUNC_ROOT" exec --user "$user" "smoke-proxy-$$" /usr/local/bin/idemproxy health \
    --url "http://127.0.0.1:$ADMIN_PORT/nope" >>"$WORK/health.log" 2>&1; then
    die "idemproxy health succeeded on a 404"
fi
log "idemproxy health in the container: 0 on /readyz, 1 on a 404"

# ---------------------------------------------------------------------------
# 6. SIGTERM: drains and exits 0.

runc --root "$RUNC_ROOT" kill "smoke-proxy-$$" TERM
rc=0
wait "$PROXY_PID" || rc=$?
[[ $rc == 0 ]] || die "idemproxy exited with $rc after SIGTERM"
grep -q '"stopped"' "$WORK/proxy.log" || die "no 'stopped' log line after SIGTERM"
log "SIGTERM: exit 0"
log "PASSED"
