#!/usr/bin/env bash
# Set up (virtual environment + install) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
