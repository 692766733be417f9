#!/usr/bin/env bash
# Set up (virtual environment + install), check with ruff, and run the test suite.
#
# With arguments, they go to one pytest run. Without, two pytest processes run side by side: the
# tests marked `ray` (mostly waiting on Ray), and the others at nice 19 in the CPU time left, except
# those marked `deadline` (wall-clock bounds), which run first at normal priority. Why this split:
# docs/benchmarks.md, "The test suite". The exit status is non-zero if any part failed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
# Byte-code for the project's own modules, once: where PYTHONDONTWRITEBYTECODE is set, each of the
# suite's hundreds of processes (Ray's workers, the CLI's drivers) would otherwise compile them again
# (0.15 s of CPU a process here).
.venv/bin/python -m compileall -q raytrain_loops tests examples >/dev/null
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
log=$(mktemp)
.venv/bin/python -m pytest -q -m ray -p no:cacheprovider --durations=12 >"$log" 2>&1 &
ray_part=$!
trap 'kill $ray_part 2>/dev/null || true' INT TERM
status=0
echo "== tests without Ray (the tests marked ray run beside them; their output follows) =="
echo "-- those marked deadline, at normal priority --"
.venv/bin/python -m pytest -q -m "not ray and deadline" -p no:cacheprovider || status=$?
echo "-- the others, at nice 19 --"
nice -n 19 .venv/bin/python -m pytest -q -m "not ray and not deadline" --durations=8 || status=$?
wait "$ray_part" || status=$?
echo "== tests marked ray =="
cat "$log"
rm -f "$log"
exit "$status"
