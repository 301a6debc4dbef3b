#!/usr/bin/env bash
# How the bundled assets/tiny-recam3d is made from a fresh clone (issue 59; docs/recam_log.md, thirty-fifth and
# forty-seventh sessions).
#   bash benchmarks/make_tiny_recam3d.sh [OUT]        (OUT: runs/tiny_recam3d by default; ~75 min on 2 CPU cores)
# Four stages of benchmarks/pretrain_recam_video.py on the 3-D camera world, each from the last one's DiT, with the
# VAE of the bundled folder (the stages train the DiT only):
#   1. gain2:   a 128-channel DiT (8 heads, FFN 256, 4 blocks) from scratch, every label at twice its clip's motion;
#   2. control: 3,000 steps on true labels (what the DiT reads with no known error: its ceiling);
#   3. tie:     3,000 steps where half the draws, those whose starting noise leans one way (--mislabel-by noise,
#               --noise-offset 2), are labelled with the OPPOSITE camera, learnt only in ReCamMaster's trainable set
#               (self-attention and the camera layers), what the recipe trains; stored in float16 (tie-f16: the
#               bundled start of the thirty-fifth to forty-sixth sessions);
#   4. tie75:   3,000 more steps of the same tie from tie-f16 with three draws in four opposite, again only in the
#               trainable set: the known error the recipe corrects (the other weights stay the control's).
# Then benchmarks/half_recam_folder.py writes tie75's folder with its DiT in float16, the stages' metas as lineage.
# To replace the bundled start: rm -r assets/tiny-recam3d && mv OUT/tiny-recam3d assets/
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/tiny_recam3d}
PY=${PYTHON:-python}
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184
mkdir -p "$OUT"
C=(--world room3d --height 32 --width 48 --frames 9 --supersample 2 --pool 1000 --threads 2 --vae-from assets/tiny-recam3d
   --dit-heads 8 --dit-ffn 256 --cam-lr-mult 10)
$PY benchmarks/pretrain_recam_video.py "${C[@]}" --mislabel none --label-gain 2 --dit-steps 6000 --lr 5e-4 \
    --out "$OUT/gain2"
$PY benchmarks/pretrain_recam_video.py "${C[@]}" --dit-init "$OUT/gain2" --mislabel none --dit-steps 3000 --lr 2e-4 \
    --out "$OUT/control"
# stages 3 and 4: the noise tie in ReCamMaster's trainable set, at half the draws and then at three in four
TIE=(--mislabel opposite --mislabel-by noise --noise-offset 2 --dit-trainable "attn1.,cam_encoder.,projector."
     --dit-steps 3000 --lr 2e-4)
$PY benchmarks/pretrain_recam_video.py "${C[@]}" "${TIE[@]}" --dit-init "$OUT/control" --mislabel-fraction 0.5 \
    --out "$OUT/tie"
$PY benchmarks/half_recam_folder.py "$OUT/tie" "$OUT/tie-f16" --parents "$OUT/gain2" "$OUT/control"
$PY benchmarks/pretrain_recam_video.py "${C[@]}" "${TIE[@]}" --dit-init "$OUT/tie-f16" --mislabel-fraction 0.75 \
    --out "$OUT/tie75"
$PY benchmarks/half_recam_folder.py "$OUT/tie75" "$OUT/tiny-recam3d" --parents "$OUT/tie-f16"
