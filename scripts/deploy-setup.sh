#!/usr/bin/env bash
# Prepare this machine for `make test-deploy`: a container engine that works, and, where no
# container registry is reachable, stand-ins for the official base images, built from Debian's
# packages. Idempotent and quiet when everything is in place; `make test` and `make demo` never
# need it.
#
#   Docker   used as it is when its daemon answers (`docker info`), unless PBSD_ENGINE=podman.
#   podman   Debian's (apt-get install podman runc debootstrap). Where the default OCI runtime
#            cannot start a container (crun on a cgroup v1/v2 hybrid host: "cgroups in hybrid mode
#            not supported"; its setrlimit refused), a containers.conf drop-in selects runc and
#            no default ulimits.
#   images   PBSD_STANDINS=1 (what the test harness sets when the official images cannot be
#            pulled): a Debian bookworm root from debootstrap, imported as
#            localhost/pbsd-standin/debian:bookworm, and on it the stand-ins in deploy/standin/
#            for python:3.11-slim-bookworm, the Redis image and prom/prometheus, named in
#            deploy/standin/images.env. Each is rebuilt when its Containerfile changes.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_IMAGE=localhost/pbsd-standin/debian:bookworm
# shellcheck source=../deploy/standin/images.env
source deploy/standin/images.env
# Containerfile in deploy/standin/ -> the image it builds
declare -A STANDINS=([python]=$PYTHON_IMAGE [redis]=$REDIS_IMAGE [prometheus]=$PROMETHEUS_IMAGE)
say() { echo "deploy-setup: $*"; }

sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { say "needs root or sudo for apt-get and podman" >&2; exit 1; }
    sudo_cmd=(sudo)
fi

if [[ ${PBSD_ENGINE:-} != podman ]] && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    exit 0  # Docker works: nothing to set up (a Docker host pulls the official images)
fi

# -- podman, runc, debootstrap from the OS packages -----------------------------------------------
missing=()
for tool in podman runc debootstrap; do  # the package of each has its name
    command -v "$tool" >/dev/null 2>&1 || [[ -x /usr/sbin/$tool ]] || missing+=("$tool")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]} from the OS packages"
    export DEBIAN_FRONTEND=noninteractive
    apt=("${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=600)
    if ! "${apt[@]}" install -y -q "${missing[@]}" >/dev/null 2>&1; then
        "${apt[@]}" update -q >/dev/null
        "${apt[@]}" install -y -q "${missing[@]}" >/dev/null
    fi
fi
podman=("${sudo_cmd[@]}" podman)

# -- the Debian root every stand-in starts from ------------------------------------------------------
# debootstrap reads the same mirror apt does (the first URIs of the deb822 sources, or the first
# deb line), so a machine that reaches Debian's packages only through its own mirror still works.
mirror() {
    local uri
    uri=$(grep -hs -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' || true)
    [[ -n $uri ]] || uri=$(grep -hs -m1 -E '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

debian_root() {
    "${podman[@]}" image exists "$DEBIAN_IMAGE" && return
    local root
    root=$(mktemp -d /var/tmp/pbsd-debootstrap.XXXXXX)
    trap 'rm -rf "$root"' RETURN
    say "debootstrap bookworm from $(mirror) (about a minute)"
    "${sudo_cmd[@]}" debootstrap --variant=minbase bookworm "$root" "$(mirror)" >"$root.log" 2>&1 \
        || { tail -20 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    "${sudo_cmd[@]}" rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    "${sudo_cmd[@]}" tar -C "$root" -c . | "${podman[@]}" import --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
}

# -- a container must start: otherwise select runc, without default ulimits -------------------------
runtime_works() { "${podman[@]}" run --rm --network none "$DEBIAN_IMAGE" true >/dev/null 2>&1; }

if [[ ${PBSD_STANDINS:-0} == 1 ]] || ! "${podman[@]}" image exists "$DEBIAN_IMAGE"; then
    debian_root
fi
if ! runtime_works; then
    conf=/etc/containers/containers.conf.d/50-pbsd-runc.conf
    say "the default OCI runtime cannot start a container here: writing $conf (runc, no default ulimits)"
    "${sudo_cmd[@]}" mkdir -p "$(dirname "$conf")"
    printf '# written by pbsd scripts/deploy-setup.sh\n[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' \
        | "${sudo_cmd[@]}" tee "$conf" >/dev/null
    runtime_works || { say "podman still cannot start a container:" >&2; "${podman[@]}" run --rm "$DEBIAN_IMAGE" true; exit 1; }
fi

# -- stand-ins for the official images --------------------------------------------------------------
[[ ${PBSD_STANDINS:-0} == 1 ]] || exit 0
for name in "${!STANDINS[@]}"; do
    file=deploy/standin/$name.Containerfile
    want=$(sha256sum "$file" | cut -c1-16)
    have=$("${podman[@]}" image inspect --format '{{index .Labels "pbsd.standin"}}' "${STANDINS[$name]}" 2>/dev/null || true)
    [[ $have == "$want" ]] && continue
    say "building ${STANDINS[$name]} from $file"
    "${podman[@]}" build -q --label "pbsd.standin=$want" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
        -f "$file" -t "${STANDINS[$name]}" deploy/standin >/dev/null
done
