#!/usr/bin/env bash
# Create (or reuse) the project's Python 3.12 virtual environment and install the pinned set into it.
# Idempotent: a stamp file keyed on requirements/ci.txt and pyproject.toml skips the install when nothing changed.
# Usage: scripts/setup_env.sh [VENV_DIR]      (default: .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 python3 python; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  local root
  for root in "${PYENV_ROOT:-$HOME/.pyenv}/versions"/3.12*; do
    if [ -x "$root/bin/python3.12" ]; then echo "$root/bin/python3.12"; return 0; fi
  done
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  if ! py=$(find_python312); then
    echo "error: Python 3.12 is required (megatron-core 0.19 and megatron-bridge 0.6 need it) and none was found." >&2
    echo "       Looked at \$PYTHON312, python3.12/python3/python on PATH and \$PYENV_ROOT/versions/3.12*." >&2
    echo "       Install it (e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv')," >&2
    echo "       or point PYTHON312 at a 3.12 interpreter." >&2
    exit 1
  fi
  echo "[setup] creating $venv with $py"
  "$py" -m venv "$venv"
fi

stamp="$venv/.installed-$(cat requirements/ci.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
echo "[setup] installing the pinned set into $venv (requirements/ci.txt, several minutes on a fresh machine)"
start=$(date +%s)
pip_quiet() { grep -v -e '^WARNING: Location' -e 'neither a file nor a directory' || true; }
"$venv/bin/python" -m pip install -q --no-deps -r requirements/ci.txt 2>&1 | pip_quiet
test "${PIPESTATUS[0]}" -eq 0
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | pip_quiet
test "${PIPESTATUS[0]}" -eq 0
rm -f "$venv"/.installed-*
touch "$stamp"
echo "[setup] done in $(( $(date +%s) - start )) s"
