#!/usr/bin/env bash
# Set up (virtual environment + install), check with ruff, and run the test suite.
#
# With arguments, they go to one pytest run. Without, the suite runs as two streams side by side:
# the tests marked `ray` on the shared local Ray (they spend much of their time waiting on Ray's
# start-up and its controller's polls), and beside them the others (CPU-bound: gloo process groups,
# the engine) followed by the multi-node tests (`multinode`: a two-node Ray cluster of their own,
# started once those are done). The Ray part's output comes last; the exit status is non-zero if
# any part failed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
log=$(mktemp)
.venv/bin/python -m pytest -q -m "ray and not multinode" -p no:cacheprovider --durations=12 >"$log" 2>&1 &
ray_part=$!
trap 'kill $ray_part 2>/dev/null || true' INT TERM
status=0
echo "== tests without Ray (the tests marked ray run beside them; their output follows) =="
.venv/bin/python -m pytest -q -m "not ray" --durations=8 || status=$?
echo "== multi-node tests (a two-node Ray cluster of their own, beside the rest of the Ray tests) =="
.venv/bin/python -m pytest -q -m multinode -p no:cacheprovider --durations=5 || status=$?
wait "$ray_part" || status=$?
echo "== tests marked ray =="
cat "$log"
rm -f "$log"
exit "$status"
