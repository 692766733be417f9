#!/usr/bin/env bash
# The GPU checks of the lm_gpt step (docs/benchmarks.md, "Feeding the step"), in at most 8 minutes
# on one H100 or H200, each part under its own time limit:
#   1. the step's parts on lm_gpt at full size, as the loop runs it, beside a bare loop (scripts/bench_feed.py);
#   2. lm_gpt's tokens/s and MFU under DDP and FSDP2, compile off and on, each with its data wait share
#      and where the device's time went (scripts/bench_gpu.py --strategies --profile);
#   3. the gpu-marked tests (pinned batches, the copy ahead, fused AdamW, the lm recipe under NCCL, ...).
# Everything printed also goes to $OUT/gpu_check.txt (a temporary directory when OUT is unset), and
# bench_feed.py's figures to $OUT/bench_feed_full_cuda.json. PYTHON picks the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d -t gpu-check-XXXXXX)}
export OUT
mkdir -p "$OUT"
log="$OUT/gpu_check.txt"
: >"$log"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>>"$log"; then
    echo "gpu_check.sh: no CUDA device ($PY: torch.cuda.is_available() is False, or torch is missing); nothing was run" | tee -a "$log" >&2
    exit 2
fi
if ! "$PY" -c 'import pyarrow, pytest, raytrain_loops.runtime.local' 2>>"$log"; then
    echo "gpu_check.sh: $PY cannot import the project and its test needs (pyarrow, pytest; see $log); nothing was run" | tee -a "$log" >&2
    exit 2
fi
"$PY" -c 'import torch; print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")' | tee -a "$log"

status=0
part() {  # part NAME SECONDS COMMAND...: run COMMAND under a time limit, its output into the log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s) ==" | tee -a "$log"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "-- $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

part "the step's parts, lm_gpt at full size (3 runs)" 75 \
    "$PY" scripts/bench_feed.py --size full --device cuda --parts step --runs 3 --steps 10 --warmup 3
part "lm_gpt: DDP and FSDP2, compile off and on" 215 \
    "$PY" scripts/bench_gpu.py --strategies ddp fsdp --compiles off on --profile --warmup 3 --steps 10 --batches 30
part "gpu-marked tests" 260 "$PY" -m pytest -q -m gpu tests/engine/test_cuda_engine.py tests/engine/test_memory_plan.py -p no:cacheprovider
echo "figures: $log" | tee -a "$log"
exit "$status"
