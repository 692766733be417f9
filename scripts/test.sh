#!/usr/bin/env bash
# Set up (virtual environment + install), check with ruff, and run the test suite.
#
# With arguments, they go to one pytest run. Without, the suite runs as two pytest processes side
# by side: the tests marked `ray` (they spend most of their time waiting on Ray's start-up and its
# controller's polls) and the others (CPU-bound: gloo process groups, the engine). The Ray part is the
# longer one and waits on chains of process starts: the others run at the lowest priority (nice 19),
# in the CPU time it leaves (about as much as they take: at nice 10 they still took CPU from the Ray
# part's bursts). Except the few marked `deadline`: they assert on wall-clock time (a group that
# ends together, a request that times out in seconds, rates timed on two workers), which a process
# at nice 19 beside the Ray part's bursts can miss while it waits for a CPU (two 1 s timeouts took
# 6.7 s on CI). They run first, at normal priority, while the Ray part starts (its tests with the
# tightest bounds, the preemption's among them, come last). The Ray part's output follows the
# others'; the exit status is non-zero if any part failed.
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
