#!/usr/bin/env bash
# One prepared GPU check (issue 50): each of the six real-shape builds (scripts/bench_gpu.py MODELS) runs the real
# trainer (build_context, a warm-up epoch, a timed epoch) at its config's settings with steps and batches cut to fit
# (bench_gpu.py GPU_CHECK), each in its own process under its own time-out (450 s in all, cheapest first, so that a
# hang late loses least), then one table: time to first sample (and its phases), s/epoch, samples/s, training
# steps/s, MFU, peak vs the memory plan, worst |r - 1| against its tolerance, the sampler gap.
#
#   scripts/gpu_check.sh --dry-run   # here, on a CPU: all six configs validated, planned and counted on "meta"
#   scripts/gpu_check.sh             # on one 80 GB GPU, within 8 minutes (docs/performance.md: the three commands)
#
# Output in $OUT if set (the device runner's folder), else bench_results/gpu_check: bench_gpu.jsonl (one row per
# build, appended as soon as measured), counts.json (plans and FLOPs), one log per build, gpu_check.md (the table).
# Exit 0 when every build finished within its tolerance; 1 when one failed, timed out or was off-policy; 2 for a bad
# argument or a host that cannot run it (one line, before any model is built).
set -u -o pipefail
cd "$(dirname "$0")/.."

usage="usage: scripts/gpu_check.sh [--dry-run]"
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "error: unknown argument '$arg'; $usage" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline  # progress lines as they happen; nothing downloads
OUT_DIR=${OUT:-bench_results/gpu_check}
mkdir -p "$OUT_DIR"

# What a CUDA PyTorch image lacks (diffusers, ml_collections) comes from wheels (docs/performance.md); say so in one
# line here rather than six tracebacks later.
if ! "$PY" -c "import torch, diffusers, ml_collections, accelerate, peft, transformers" 2>"$OUT_DIR/imports.log"; then
    echo "error: $(tail -n 1 "$OUT_DIR/imports.log"); install the wheels first (docs/performance.md, GPU check)" >&2
    exit 2
fi
"$PY" -c "import torch, diffusers, transformers, peft, accelerate; print(f'torch {torch.__version__}, diffusers \
{diffusers.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, accelerate \
{accelerate.__version__}, GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else None}')"

# Plans and FLOP counts are meta-device builds (no GPU, ~1-2 min of CPU): on the dry run they are the check; on the
# GPU run they are made by a CPU process beside the GPU runs (two threads, niced), so they cost the budget nothing.
COUNTS=(env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 "$PY" scripts/bench_gpu.py --gpu-check --all-models --dry-run
        --counts-out "$OUT_DIR/counts.json")
if [ "$DRY" = 1 ]; then
    "${COUNTS[@]}" || exit $?
    "$PY" scripts/bench_gpu.py --list-gpu-check >/dev/null || exit $?
    echo "gpu check dry run: all six builds validated"
    exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: no CUDA device; on a CPU run scripts/gpu_check.sh --dry-run" >&2
    exit 2
fi

JSONL="$OUT_DIR/bench_gpu.jsonl"
rm -f "$JSONL" "$OUT_DIR/counts.json"
nice "${COUNTS[@]}" >"$OUT_DIR/counts.log" 2>&1 &
COUNTS_PID=$!

failed=0
models=()
while read -r model limit; do
    models+=("$model")
    echo "[$SECONDS s] $model: starting, time-out $limit s"
    # -k: a process that ignores SIGTERM (stuck in a CUDA call) is killed 5 s later
    timeout -k 5 "$limit" "$PY" scripts/bench_gpu.py --gpu-check --model "$model" --out "$OUT_DIR" 2>&1 \
        | tee "$OUT_DIR/$model.log"
    rc=${PIPESTATUS[0]}
    echo "[$SECONDS s] $model: exit $rc"
    if [ "$rc" != 0 ]; then
        failed=1
        # bench_gpu.py writes a row with the error it caught; a killed or crashed process writes none: say why here
        if ! grep -q "\"model\": \"$model\"" "$JSONL" 2>/dev/null; then
            case "$rc" in
                124|137) why="timed out after $limit s" ;;
                *) why="exit $rc: $(grep -v '^\s*$' "$OUT_DIR/$model.log" | tail -n 1 | tr -d '"\\' | cut -c1-200)" ;;
            esac
            printf '{"model": "%s", "error": "%s"}\n' "$model" "$why" >>"$JSONL"
        fi
    fi
done <<<"$(
    # GPU_CHECK_MODELS="a b ...": only those builds, in that order (a rerun of the ones that matter, on little time)
    all=$("$PY" scripts/bench_gpu.py --list-gpu-check)
    if [ -n "${GPU_CHECK_MODELS:-}" ]; then for m in $GPU_CHECK_MODELS; do grep "^$m " <<<"$all"; done; else echo "$all"; fi
)"

for _ in $(seq 20); do  # the counts have had the whole run (2-3 min of CPU): wait at most another 20 s
    kill -0 "$COUNTS_PID" 2>/dev/null || break
    sleep 1
done
if kill -0 "$COUNTS_PID" 2>/dev/null; then
    kill "$COUNTS_PID"
    echo "counts (plans, FLOPs) not done: MFU and plan shown '-'"
fi
wait "$COUNTS_PID" 2>/dev/null || echo "counts: $(tail -n 1 "$OUT_DIR/counts.log")"

"$PY" scripts/bench_gpu.py --table "$JSONL" --counts "$OUT_DIR/counts.json" \
    --expect "$(IFS=,; echo "${models[*]}")" | tee "$OUT_DIR/gpu_check.md"
table_rc=${PIPESTATUS[0]}
echo "gpu check: ${SECONDS} s; output in $OUT_DIR"
[ "$failed" = 0 ] && [ "$table_rc" = 0 ]
