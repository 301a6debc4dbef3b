#!/usr/bin/env bash
# The 3-D camera world's start model on a lent GPU (issue 59): a DiT trained far longer than a CPU session allows, then
# measured held-out. One device command after scripts/gpu_check.sh. By default a fresh 8-block DiT 128 channels wide
# (8 heads of 16) whose camera layers take 10 x the lr (`--dit-layers 8 --dit-heads 8 --dit-ffn 256 --cam-lr-mult 10`):
# each of the three learnt the camera faster per step on this CPU (docs/recam_log.md: seventeenth session, 8 blocks read
# a camera gain of 0.43 on true labels in 14,761 steps where 4 blocks read 0.37 after 33,836; nineteenth, the camera
# layers at 10 x the lr take 4 blocks from 0.300 to 0.431 at step 6,000; twenty-second, 128 channels instead of 64
# take that to 0.515, and with true labels to 1.03, whose samples read 0.290 held-out: the first CPU DiT whose
# translations and arcs leave ~0). Then the same held-out measurement as the bundled model's
# (benchmarks/recam3d_start.py: 64 held-out conditions x 4 seeds, 256 deterministic samples), on the device's CPUs.
#
#   scripts/gpu_recam3d.sh --dry-run     # here: the same two commands on the CPU, a few seconds of training
#   scripts/gpu_recam3d.sh               # on the device: DIT_SECONDS (150) of training, then the measurement
#   scripts/gpu_recam3d.sh --grpo FOLDER # then (a second command, the folder carried back): recam3d_tiny_grpo with
#                                        # its defaults from FOLDER, seeds GRPO_SEEDS (42 1 2) side by side: the issue's
#                                        # three curves (grpo.json, grpo_seedS.log; the runs, each export with
#                                        # them, in WORK/grpo/seedS/, their summary.json files in grpo_summaries.tar)
#
# Output in $OUT if set (the device runner's folder), else bench_results/gpu_recam3d: tiny-recam3d-gpu-f16.tar (the
# model folder with its DiT in float16, as assets/tiny-recam3d is bundled: benchmarks/half_recam_folder.py; ~9 MB, one
# file, written as soon as pretraining ends, so that it comes back whatever follows: the runner returns 8 files of
# at most 16 MiB, and the float32 folder is 12 files, 17 MB), pretrain.log, start.json, start.log; --grpo:
# grpo.json, grpo_seedS.log, grpo_summaries.tar. The float32 folder and the runs (WORK: $OUT on a --dry-run, else
# /tmp/gpu_recam3d) stay on the device. Unpack here with `tar -xf tiny-recam3d-gpu-f16.tar -C runs/`. Environment:
# DIT_SECONDS, POOL (4000), DIT_BATCH (256), DIT_LR (5e-4), DIT_ARGS (default "--dit-layers 8 --dit-heads 8
# --dit-ffn 256 --cam-lr-mult 10"; with DIT_ARGS="--dit-init assets/tiny-recam3d --dit-heads 8 --dit-ffn 256"
# DIT_LR=2e-4 it trains the bundled 4-block DiT on), WORKERS (the estimator's processes, 12).
# Then here: benchmarks/recam3d_dit_loss.py --labels true on the folder (a minute), and recam3d_start.py's
# translations: they must read well above 0.08-0.12 (the best CPU DiT's: 128 channels, 12,000 steps, docs/recam_log.md
# twenty-third session) before the folder goes into the GRPO runs (--config.pretrained.model=FOLDER) or
# assets/tiny-recam3d.
set -u -o pipefail
cd "$(dirname "$0")/.."
USAGE="usage: scripts/gpu_recam3d.sh [--dry-run] [--grpo FOLDER]"
DRY=0
GRPO_FROM=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --grpo)
            [ $# -ge 2 ] || { echo "error: --grpo needs a model folder; $USAGE" >&2; exit 2; }
            GRPO_FROM=$2
            shift ;;
        *) echo "error: unknown argument '$1'; $USAGE" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$GRPO_FROM" ] && [ ! -f "$GRPO_FROM/recammaster.ckpt" ]; then
    echo "error: --grpo $GRPO_FROM: not a model folder of this script (no recammaster.ckpt in it)" >&2
    exit 2
fi
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT_DIR=${OUT:-bench_results/gpu_recam3d}
BASELINE=${BASELINE:-docs/recam3d_start_s47.json}  # the bundled start's read (256 clips, its clip scores kept)
mkdir -p "$OUT_DIR"
if [ "$DRY" = 1 ]; then
    DEVICE=cpu SECONDS_=${DIT_SECONDS:-5} POOL=16 THREADS=1 MEASURE=(--limit 2 --seeds 0)
else
    # a pool of 4000 (the bundled DiT's 1000 begin to be learnt by heart after ~12,000 more steps of 16 on the CPU:
    # docs/recam_log.md, ninth session), rendered by every core in under a minute
    # the measurement pairs each clip with the bundled start's read of it (recam3d_start.py --baseline)
    DEVICE=cuda SECONDS_=${DIT_SECONDS:-150} POOL=${POOL:-4000} THREADS=$(nproc) MEASURE=(--baseline "$BASELINE")
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" \
        || { echo "error: no CUDA device (scripts/gpu_recam3d.sh --dry-run runs on the CPU)" >&2; exit 2; }
fi

WORK=$OUT_DIR
[ "$DRY" = 1 ] || WORK=${GPU_RECAM3D_WORK:-/tmp/gpu_recam3d}
mkdir -p "$WORK"
# the model adapters and cam_score are ddpo_grpo's entry points; a checkout on PYTHONPATH finds them too
# (ddpo_grpo/plugins.py), so say it in one line here rather than after minutes of pretraining
"$PY" -c "from ddpo_grpo.models.registry import supported_classes; from ddpo_grpo.rewards.registry import \
available_rewards; import sys; sys.exit(0 if 'WanPipeline' in supported_classes() and 'cam_score' in \
available_rewards() else 1)" 2>/dev/null \
    || { echo "error: ddpo_grpo's WanPipeline adapter or cam_score reward cannot be found from $PY" >&2; exit 2; }

if [ -n "$GRPO_FROM" ]; then
    # Stage 2: recam3d_tiny_grpo with its defaults from the folder, one trainer per seed side by side (the DiT on the
    # device, cam_score's exact estimator on nproc / seeds worker processes each), then each seed's held-out curve.
    read -r -a SEEDS <<< "${GRPO_SEEDS:-42 1 2}"
    if [ "$DRY" = 1 ]; then  # one epoch of one group of 4, two held-out clips: the commands and the table, not a result
        WORKERS_EACH=1 TORCH_THREADS=1
        SHRINK=(--config.num_epochs=1 --config.eval_freq=1 --config.eval.num_samples=2 --config.eval.batch_size=2
                --config.sample.batch_size=4 --config.sample.num_batches_per_epoch=1 --config.sample.k=4
                --config.train.batch_size=4 --config.train.gradient_accumulation_steps=1)
    else
        WORKERS_EACH=$(( $(nproc) / ${#SEEDS[@]} )) TORCH_THREADS=2 SHRINK=()
        [ "$WORKERS_EACH" -ge 1 ] || WORKERS_EACH=1
    fi
    pids=()
    for s in "${SEEDS[@]}"; do
        OMP_NUM_THREADS=$TORCH_THREADS "$PY" scripts/train.py --config config/grpo.py:recam3d_tiny_grpo \
            --config.seed="$s" --config.pretrained.model="$GRPO_FROM" --config.logging.wandb=False \
            --config.logging.tensorboard=False --config.logdir="$WORK/grpo" --config.run_name="seed$s" \
            --config.save_freq=0 --config.reward.kwargs.cam_score.workers="$WORKERS_EACH" ${SHRINK[@]+"${SHRINK[@]}"} \
            > "$OUT_DIR/grpo_seed$s.log" 2>&1 &
        pids+=($!)
    done
    failed=0
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { failed=1; echo "seed ${SEEDS[$i]} failed; the end of $OUT_DIR/grpo_seed${SEEDS[$i]}.log:" >&2
                                tail -n 20 "$OUT_DIR/grpo_seed${SEEDS[$i]}.log" >&2; }
    done
    "$PY" - "$OUT_DIR" "$WORK" "$GRPO_FROM" "${SEEDS[@]}" <<'EOF'
import json, os, sys
from benchmarks.bench_efficacy import curve as eval_curve, run_history  # the efficacy bench's reading of a run
out, work, folder, seeds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
res = {"model": folder, "seeds": {}}
for s in seeds:
    path = os.path.join(work, "grpo", f"seed{s}", "summary.json")
    if not os.path.exists(path):
        print(f"seed {s}: no summary ({path})")
        continue
    history, final_eval, _ = run_history(path)
    curve = [(p["epoch"], p["eval_reward_mean"]) for p in eval_curve(history, "eval/reward_mean", final_eval)]
    res["seeds"][s] = curve
    gain = curve[-1][1] - curve[0][1] if curve else float("nan")
    print(f"seed {s}: held-out cam_score " + " -> ".join(f"{v:.3f} (epoch {e})" for e, v in curve) + f"; gain {gain:+.3f}")
json.dump(res, open(os.path.join(out, "grpo.json"), "w"), indent=1)
EOF
    tar -C "$WORK" -cf "$OUT_DIR/grpo_summaries.tar" $(cd "$WORK" && ls grpo/seed*/summary.json 2>/dev/null) \
        || echo "no summaries to pack" >&2
    exit $failed
fi
DIT_ARGS=${DIT_ARGS:---dit-layers 8 --dit-heads 8 --dit-ffn 256 --cam-lr-mult 10}
# shellcheck disable=SC2086  # DIT_ARGS is a list of options
"$PY" benchmarks/pretrain_recam_video.py --world room3d --height 32 --width 48 --frames 9 --supersample 2 \
    --mislabel opposite --mislabel-fraction 0.25 --pool "$POOL" --threads "$THREADS" --vae-from assets/tiny-recam3d \
    $DIT_ARGS --dit-steps 1000000 --dit-seconds "$SECONDS_" --batch "${DIT_BATCH:-256}" --lr "${DIT_LR:-5e-4}" \
    --snapshot-every 1000000 --device "$DEVICE" --out "$WORK/tiny-recam3d-gpu" > "$OUT_DIR/pretrain.log" 2>&1
rc=$?
grep -E "^(room3d pool|pool|latents|dit [0-9]+/|saved)" "$OUT_DIR/pretrain.log" | tail -n 12
if [ $rc -ne 0 ]; then
    echo "pretraining failed (exit $rc); the end of $OUT_DIR/pretrain.log:" >&2
    tail -n 20 "$OUT_DIR/pretrain.log" >&2
    exit 1
fi
rm -rf "$WORK/f16" && mkdir -p "$WORK/f16" \
    && "$PY" benchmarks/half_recam_folder.py "$WORK/tiny-recam3d-gpu" "$WORK/f16/tiny-recam3d-gpu-f16" >/dev/null \
    && tar -C "$WORK/f16" -cf "$OUT_DIR/tiny-recam3d-gpu-f16.tar" tiny-recam3d-gpu-f16 \
    || { echo "packing the folder failed" >&2; exit 1; }
"$PY" benchmarks/recam3d_start.py --model "$WORK/tiny-recam3d-gpu" --workers "${WORKERS:-12}" \
    --estimator-kwargs '{"sigmas": [0.05, 0.02], "iters": 2}' ${MEASURE[@]+"${MEASURE[@]}"} \
    --out "$OUT_DIR/start.json" > "$OUT_DIR/start.log" 2>&1 || { tail -n 20 "$OUT_DIR/start.log" >&2; exit 1; }
"$PY" - "$OUT_DIR/start.json" "$BASELINE" <<'EOF'
import json, sys
r, base = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
pair = f", paired {r['paired']['mean']:+.3f} +- {r['paired']['se']:.3f}" if "paired" in r else ""
print(f"held-out cam_score {r['cam_score_mean']:.3f} +- {r['cam_score_se']:.3f} (bundled: "
      f"{base['cam_score_mean']:.3f}{pair}), "
      f"pass@1 {r['pass1']:.3f}, pass@4 {r.get('pass4', float('nan')):.3f}, opposite {r['opposite_score_mean']:.3f}, "
      f"{r['n_samples']} samples")
for p, v in sorted(r["per_preset"].items()):
    print(f"  {p:16s} {v['cam_score']:.3f}")
EOF
