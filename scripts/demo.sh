#!/usr/bin/env bash
# Set up (virtual environment + install) and train the default recipe: a small CNN on the
# bundled 8x8 digits, 2 CPU workers on a local Ray instance. Extra arguments are config
# overrides, e.g. scripts/demo.sh loop.epochs=5
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/raytrain-loops train default "$@"
