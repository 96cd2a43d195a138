#!/usr/bin/env bash
# Prepare this checkout on a fresh machine: a virtual environment with the project
# installed (CPU torch pinned), and a redis-server binary. Idempotent and quiet when
# everything is already in place; `make test` and `make demo` both start here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${PBSD_VENV:-.venv}
# The CPU build: PyPI's Linux torch is the CUDA build, several GB. A local wheel or index that has
# the +cpu build is used first; otherwise PyTorch's CPU index; where no +cpu build exists
# (macOS, whose torch is CPU-only) the plain version.
TORCH_PIN=${PBSD_TORCH:-torch==2.13.0+cpu}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"pbsd needs Python >= 3.11, found {sys.version.split()[0]}; set PYTHON=python3.11")
PY

# A .venv left by a `python -m venv` that failed for want of ensurepip has a python but no pip:
# made again, once the OS packages below have brought the venv module.
if [[ -x "$VENV/bin/python" ]] && ! "$VENV/bin/python" -c "import pip" >/dev/null 2>&1; then
    echo "bootstrap: $VENV has no pip (made without Python's venv module): making it again"
    rm -rf "$VENV"
fi

# OS packages: Python's venv module (Debian and Ubuntu ship it apart, as python3.X-venv),
# redis-server (the bus, for the demo and the tests) and Chromium (the credit viewer's browser
# test; PBSD_BROWSER=0, as `make demo` sets, leaves it out). Installed only when missing.
missing=()
if [[ ! -x "$VENV/bin/python" ]] && ! "$PYTHON" -c "import ensurepip, venv" >/dev/null 2>&1; then
    missing+=("python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if [[ ${PBSD_BROWSER:-1} != 0 ]]; then
    command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
fi
if ((${#missing[@]})); then
    echo "bootstrap: installing ${missing[*]} from the OS packages"
    sudo_cmd=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || { echo "bootstrap: ${missing[*]} missing and neither root nor sudo is available" >&2; exit 1; }
        sudo_cmd=(sudo)
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! "${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; then
        "${sudo_cmd[@]}" apt-get update -q >/dev/null
        "${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}" >/dev/null
    fi
    # The packages may start system instances; the project always runs its own on free ports.
    command -v redis-server >/dev/null 2>&1 || { echo "bootstrap: redis-server still missing after install" >&2; exit 1; }
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "bootstrap: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the project's requirements changed since the last install.
stamp="$VENV/.pbsd-install-stamp"
EXTRAS=${PBSD_EXTRAS:-dev}   # the slow tests add "gpu" (DeepSpeed, which also runs on the CPU accelerator)
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1) $TORCH_PIN $EXTRAS"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "bootstrap: installing $TORCH_PIN and the project into $VENV"
    pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" "$TORCH_PIN" 2>/dev/null \
        || "${pip[@]}" --extra-index-url "$TORCH_CPU_INDEX" "$TORCH_PIN" 2>/dev/null \
        || "${pip[@]}" "${TORCH_PIN%+cpu}"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    echo "$want" > "$stamp"
fi

