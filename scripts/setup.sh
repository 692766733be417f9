#!/usr/bin/env bash
# Create .venv and install the package with its test extra. Re-running is cheap: the install is
# skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.raytrain-loops-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # Take the CPU build of torch when it is on hand (seconds, no CUDA download); otherwise the
    # range in pyproject.toml picks one.
    .venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null || echo "setup: torch 2.13.0 not on hand; pip will choose a torch build"
    .venv/bin/python -m pip install -q -e ".[test]"
    echo "$want" > "$stamp"
fi
