#!/usr/bin/env bash
# Creates or refreshes the kernels' Python environment at kernels/.venv.
#
# Idempotent: does nothing when the venv works and kernels/requirements.txt has not changed
# since the last successful install (its SHA-256 is kept in .venv/.requirements.sha256).
# When the requirements changed, pip brings the existing venv to the pinned versions;
# when the venv is missing or broken, it is created from scratch.
#
# Environment:
#   KERNEL_PYTHON        base interpreter for a new venv (default: python3)
#   KERNEL_VENV_REBUILD  set to 1 to delete and recreate the venv
#   PIP_ARGS             extra arguments for pip install (e.g. --index-url ...)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
requirements="$here/requirements.txt"
stamp="$venv/.requirements.sha256"
python="${KERNEL_PYTHON:-python3}"

want="$(sha256sum "$requirements" | cut -d' ' -f1)"

if [[ "${KERNEL_VENV_REBUILD:-0}" == 1 && -e "$venv" ]]; then
    echo "setup.sh: KERNEL_VENV_REBUILD=1, removing $venv"
    rm -rf "$venv"
fi

if [[ -e "$venv" ]] && ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "setup.sh: $venv is broken (its interpreter does not run), recreating it"
    rm -rf "$venv"
fi

if [[ ! -e "$venv" ]]; then
    if ! command -v "$python" >/dev/null 2>&1; then
        echo "setup.sh: $python not found; set KERNEL_PYTHON to a Python 3 interpreter" >&2
        exit 1
    fi
    echo "setup.sh: creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi

if [[ "$(cat "$stamp" 2>/dev/null || true)" == "$want" ]] && "$venv/bin/python" -c 'import ipykernel' 2>/dev/null; then
    echo "setup.sh: $venv is up to date"
    exit 0
fi

# shellcheck disable=SC2086 # PIP_ARGS is a list of words on purpose
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input ${PIP_ARGS:-} -r "$requirements"
"$venv/bin/python" -c 'import ipykernel' # fail here rather than at the first kernel launch
echo "$want" > "$stamp"
echo "setup.sh: $venv is ready"
