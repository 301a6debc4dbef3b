#!/usr/bin/env bash
# One prepared GPU check (issues 50, 61): each of the six real-shape builds (benchmarks/bench_gpu_configs.py MODELS)
# runs the real trainer (build_context, a warm-up epoch, a timed epoch) at its config's settings with steps and batches
# cut to fit (benchmarks/gpu_check_points.py GPU_CHECK), each in its own process under its own time-out (450 s in all,
# cheapest first, so that a hang late loses least), then one table, whatever the builds did (docs/performance.md, GPU
# check: its columns and the causes a failed build's status names).
#
#   scripts/gpu_check.sh --dry-run        # here, on a CPU: all six configs validated, planned and counted on "meta"
#   scripts/gpu_check.sh                  # on one 80 GB GPU: ends within GPU_CHECK_BUDGET (525 s) with its table
#   scripts/gpu_check.sh --only NAME      # one build again (NAME[,NAME...]); the other builds' rows already in
#                                         # $OUT/bench_gpu.jsonl are kept and shown
#   scripts/gpu_check.sh --simulate       # on a CPU: stand-in builds that end each way a build can (tests)
#
# The table always prints: a build killed by its time-out (or stuck past SIGTERM), killed by the host (OOM, exit
# 137), crashed with a CUDA or Python error, or interrupted gets a row naming the cause, written by Python
# (bench_gpu.py --build-result) from its exit status and its log; a SIGTERM / SIGINT to this script stops the running
# build and prints the table of what ran. The whole check ends by GPU_CHECK_BUDGET seconds after its start (a build's
# time-out is cut to what is left; one that cannot start in time gets a "not run" row), so that it fits one
# 10-minute command with its wheel install; run it last in that command.
#
# Output in $OUT if set (the device runner's folder), else bench_results/gpu_check: bench_gpu.jsonl (one row per
# build, appended as soon as measured), counts.json (plans and FLOPs), one log per build, gpu_check.md (the table).
# Exit 0 when every build finished within its tolerance; 1 when one failed, timed out or was off-policy; 2 for a bad
# argument or a host that cannot run it (one line, before any model is built).
set -u -o pipefail
cd "$(dirname "$0")/.."

usage="usage: scripts/gpu_check.sh [--dry-run | --simulate] [--only NAME[,NAME...]]"
DRY=0
SIM=0
ONLY=${GPU_CHECK_MODELS:-}  # (the older spelling of --only: space-separated names)
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --simulate) SIM=1 ;;
        --only)
            if [ $# -lt 2 ] || [ -z "$2" ]; then echo "error: --only needs a build name; $usage" >&2; exit 2; fi
            ONLY="$ONLY ${2//,/ }"; shift ;;
        --only=*) v=${1#--only=}; ONLY="$ONLY ${v//,/ }" ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "error: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline  # progress lines as they happen; nothing downloads
OUT_DIR=${OUT:-bench_results/gpu_check}
mkdir -p "$OUT_DIR"
BUDGET=${GPU_CHECK_BUDGET:-525}  # s from this script's start to its table's end
RESERVE=15                       # s kept for the counts' last wait and the table
KILL_AFTER=${GPU_CHECK_KILL_AFTER:-5}  # timeout -k: a build that ignores SIGTERM (stuck in a CUDA call) is killed
SIM_ARGS=()
if [ "$SIM" = 1 ]; then
    SIM_ARGS=(--simulate)
    KILL_AFTER=${GPU_CHECK_KILL_AFTER:-1}
fi

# The builds: "model time-out" lines, cheapest first; --only picks some, in GPU_CHECK's order
ALL=$("$PY" scripts/bench_gpu.py --list-gpu-check ${SIM_ARGS[@]+"${SIM_ARGS[@]}"}) || exit 2
BUILDS=$ALL
if [ -n "${ONLY// /}" ]; then
    for m in $ONLY; do
        grep -q "^$m " <<<"$ALL" || { echo "error: --only $m: not a build; choose from $(cut -d' ' -f1 <<<"$ALL" \
            | paste -sd, -)" >&2; exit 2; }
    done
    BUILDS=$(while read -r m t; do for o in $ONLY; do [ "$o" = "$m" ] && echo "$m $t"; done; done <<<"$ALL" | uniq)
fi

if [ "$SIM" = 0 ]; then
    # What a CUDA PyTorch image lacks (diffusers, ml_collections) comes from wheels (docs/performance.md); say so in
    # one line here rather than six tracebacks later. One interpreter imports them and prints their versions (~7 s of
    # imports on a CPU: a second call for the versions line cost as much again).
    if ! "$PY" -c "import torch, diffusers, ml_collections, accelerate, peft, transformers; print(f'torch \
{torch.__version__}, diffusers {diffusers.__version__}, transformers {transformers.__version__}, peft \
{peft.__version__}, accelerate {accelerate.__version__}, GPU: \
{torch.cuda.get_device_name() if torch.cuda.is_available() else None}')" 2>"$OUT_DIR/imports.log"
    then
        echo "error: $(tail -n 1 "$OUT_DIR/imports.log"); install the wheels first (docs/performance.md, GPU check)" >&2
        exit 2
    fi
fi

# Plans and FLOP counts are meta-device builds (no GPU, ~1-2 min of CPU): on the dry run they are the check; on the
# GPU run they are made by a CPU process beside the GPU runs (two threads, niced), so they cost the budget nothing.
COUNTS=(env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 "$PY" scripts/bench_gpu.py --gpu-check --all-models --dry-run
        ${SIM_ARGS[@]+"${SIM_ARGS[@]}"} --counts-out)
if [ "$DRY" = 1 ]; then
    "${COUNTS[@]}" "$OUT_DIR/counts.json" || exit $?
    echo "gpu check dry run: all six builds validated"
    exit 0
fi
if [ "$SIM" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: no CUDA device; on a CPU run scripts/gpu_check.sh --dry-run" >&2
    exit 2
fi

JSONL="$OUT_DIR/bench_gpu.jsonl"
if [ -z "${ONLY// /}" ]; then
    rm -f "$JSONL"  # a whole check: its own rows only (with --only the others' rows stay, and are shown)
fi
rm -f "$OUT_DIR/counts.new.json"
nice "${COUNTS[@]}" "$OUT_DIR/counts.new.json" >"$OUT_DIR/counts.log" 2>&1 &
COUNTS_PID=$!

models=()
BUILD_PID=""
CURRENT=""
finish() {  # the table of whatever ran, then exit: 0 only when every build of this run finished within tolerance
    trap '' TERM INT HUP
    while kill -0 "$COUNTS_PID" 2>/dev/null && [ "$SECONDS" -lt $((BUDGET - 5)) ]; do sleep 1; done
    if kill -0 "$COUNTS_PID" 2>/dev/null; then
        kill "$COUNTS_PID" 2>/dev/null
        echo "counts (plans, FLOPs) not done in time: MFU and plan shown '-'"
    elif wait "$COUNTS_PID"; then
        mv -f "$OUT_DIR/counts.new.json" "$OUT_DIR/counts.json"
    else
        echo "counts: $(tail -n 1 "$OUT_DIR/counts.log")"
    fi
    "$PY" scripts/bench_gpu.py --table "$JSONL" --counts "$OUT_DIR/counts.json" \
        --expect "$(IFS=,; echo "${models[*]}")" --show "$(cut -d' ' -f1 <<<"$ALL" | paste -sd, -)" \
        >"$OUT_DIR/gpu_check.md" 2>"$OUT_DIR/table.err"
    table_rc=$?
    cat "$OUT_DIR/gpu_check.md"
    if [ "$table_rc" -gt 1 ]; then  # the table script itself failed: the rows as they are, still readable
        echo "table failed (exit $table_rc): $(tail -n 1 "$OUT_DIR/table.err"); the rows:"
        cat "$JSONL" 2>/dev/null
    fi
    echo "gpu check: ${SECONDS} s; output in $OUT_DIR"
    [ "$1" = 0 ] && [ "$table_rc" = 0 ] && exit 0
    exit 1
}
on_signal() {  # the outer runner's time-out or ^C: stop the running build, name it, print the table
    trap '' TERM INT HUP
    echo "[$SECONDS s] gpu check: stopped by a signal"
    if [ -n "$BUILD_PID" ]; then
        kill -TERM -- "-$BUILD_PID" 2>/dev/null || kill -TERM "$BUILD_PID" 2>/dev/null  # timeout leads its group
        wait "$BUILD_PID" 2>/dev/null  # (timeout kills it KILL_AFTER s later if it ignores SIGTERM)
        "$PY" scripts/bench_gpu.py --build-result "$CURRENT" --table "$JSONL" --rc 143 --limit 0 \
            --log "$OUT_DIR/$CURRENT.log" --elapsed 0 --since-line "$SINCE" --interrupted </dev/null
    fi
    finish 1
}
trap on_signal TERM INT HUP

# --verbose: timeout says in the log when it sent SIGTERM / SIGKILL (the cause "time-out", not "OOM kill"); an older
# timeout without it leaves the cause to the exit status and the build's wall time
VERBOSE=(--verbose)
timeout --verbose 5 true 2>/dev/null || VERBOSE=()
SINCE=0
while read -r model limit; do
    [ -n "$model" ] || continue
    models+=("$model")
    left=$((BUDGET - RESERVE - SECONDS - KILL_AFTER))
    if [ "$left" -lt 5 ]; then
        echo "[$SECONDS s] $model: not run, the check's $BUDGET s are spent"
        "$PY" scripts/bench_gpu.py --build-result "$model" --table "$JSONL" --rc 0 --limit 0 --log /dev/null \
            --not-run "the check's $BUDGET s budget was spent before it" </dev/null
        continue
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    SINCE=$( { cat "$JSONL" 2>/dev/null || true; } | wc -l)
    CURRENT=$model
    echo "[$SECONDS s] $model: starting, time-out $limit s"
    start=$SECONDS
    timeout ${VERBOSE[@]+"${VERBOSE[@]}"} -k "$KILL_AFTER" "$limit" "$PY" scripts/bench_gpu.py --gpu-check --model "$model" \
        --out "$OUT_DIR" ${SIM_ARGS[@]+"${SIM_ARGS[@]}"} </dev/null >"$OUT_DIR/$model.log" 2>&1 &
    BUILD_PID=$!
    wait "$BUILD_PID" 2>/dev/null  # (bash's own "Killed" notice: the row says it)
    rc=$?
    BUILD_PID=""
    echo "[$SECONDS s] $model: exit $rc"
    "$PY" scripts/bench_gpu.py --build-result "$model" --table "$JSONL" --rc "$rc" --log "$OUT_DIR/$model.log" \
        --limit "$limit" --elapsed $((SECONDS - start)) --since-line "$SINCE" --kill-after "$KILL_AFTER" </dev/null \
        || echo "$model: its row could not be written (the table says 'no row')"
done <<<"$BUILDS"

finish 0
