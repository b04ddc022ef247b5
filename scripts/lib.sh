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

# usage_from_header FILE: the comment block that opens FILE (after its #!
# line), without the comment marks: what the scripts print for --help, so
# that the help grows with the header instead of by a line count.
usage_from_header() {
    awk 'NR == 1 { next } !/^#/ { exit } { sub(/^# ?/, ""); print }' "$1"
}

# How this machine's idle CPUs wait, for the benchmarks' reports: the
# cpuidle driver and governor and, where the haltpoll driver runs (a
# virtual machine's guest), how long an idle virtual CPU polls before it
# halts (haltpoll.guest_halt_poll_ns). A halted virtual CPU is woken
# through the hypervisor, a cost each hop between two processes may pay.
HALT_POLL_NS_FILE=/sys/module/haltpoll/parameters/guest_halt_poll_ns
cpu_idle_description() {
    local dir=/sys/devices/system/cpu/cpuidle driver governor
    driver=$(cat "$dir/current_driver" 2>/dev/null || echo none)
    governor=$(cat "$dir/current_governor_ro" 2>/dev/null || cat "$dir/current_governor" 2>/dev/null || echo none)
    printf 'cpuidle driver %s, governor %s' "$driver" "$governor"
    if [[ -r $HALT_POLL_NS_FILE ]]; then
        printf ', guest halt polling %s ns' "$(cat "$HALT_POLL_NS_FILE")"
    fi
    echo
}

# rustc_llvm_major and release_rustflags (the PGO profile of release builds).
# shellcheck source=scripts/rustflags.sh
. "$(dirname "${BASH_SOURCE[0]}")/rustflags.sh"
