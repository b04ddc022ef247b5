# scripts/lib.sh: shell helpers shared by scripts/dev, bench/run and
# bench/sweeper. Sourced, not run: the caller sets LOG_PREFIX first.
#
# Nothing here prints a password: every URL that reaches a log goes through
# redact_url.

# shellcheck shell=bash

log() { printf '%s: %s\n' "${LOG_PREFIX:-idemproxy}" "$*" >&2; }
die() {
    printf '%s: error: %s\n' "${LOG_PREFIX:-idemproxy}" "$*" >&2
    exit 1
}

# A database URL (or key=value conninfo) with any password masked: the
# user:password@ of a URL and every password=… pair.
redact_url() {
    sed -E -e 's#(://[^:/?@]*):.*@#\1:***@#' \
        -e 's#(password=)[^&[:space:]]*#\1***#g' <<<"$1"
}

# Is something accepting TCP connections on 127.0.0.1:PORT?
port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# Runs a libpq tool without ambient password sources, never prompting.
pg_noenv() {
    env -u PGPASSWORD -u PGSERVICE -u PGSERVICEFILE PGPASSFILE=/dev/null \
        PGCONNECT_TIMEOUT=5 "$@" </dev/null
}

# URL $1 with its database name replaced by $2 (postgres:// URLs only).
url_with_database() {
    local re='^(postgres(ql)?://[^/?]*)(/[^?]*)?(\?.*)?$'
    [[ $1 =~ $re ]] || die "cannot derive a database URL from $(redact_url "$1"): a postgres:// URL is needed"
    printf '%s/%s%s\n' "${BASH_REMATCH[1]}" "$2" "${BASH_REMATCH[4]}"
}

# Installs Debian packages when we are root on a system with apt-get
# (apt-get update only when the first try fails); returns 1 otherwise.
apt_install() {
    [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null || return 1
    log "installing $* (apt-get)"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" </dev/null >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" </dev/null >/dev/null
    fi
}

# rustc_llvm_major and release_rustflags (the PGO profile of release builds).
# shellcheck source=scripts/rustflags.sh
. "$(dirname "${BASH_SOURCE[0]}")/rustflags.sh"
