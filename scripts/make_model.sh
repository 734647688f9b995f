#!/usr/bin/env bash
# Rebuild the shipped model clover-tiny from scratch (spec section 4, Clover's recipe at laptop scale):
#   data -> AR pretraining -> clover convert -> block-diffusion adaptation (AR loss kept) -> chat/agent SFT -> release.
# Every stage resumes where it stopped: after an interruption, run the same command again.
# Step counts are sized for under an hour on 2 CPU cores (37 minutes here); override them with the variables below.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
DATA=${DATA:-data}
RUNS=${RUNS:-runs/recipe}
OUT=${OUT:-clover/models/clover-tiny}
AR_STEPS=${AR_STEPS:-450}
DIFF_STEPS=${DIFF_STEPS:-200}
SFT_STEPS=${SFT_STEPS:-100}
MIX=code=0.45,english=0.35,chat=0.2

stage() { echo "== $* ($(date +%H:%M:%S))" >&2; }

# train RUN_DIR ARGS...: continue the run if it has a checkpoint, skip it if it finished, else start it.
train() {
  local out=$1; shift
  if [ -f "$out/DONE" ]; then return; fi
  if [ -f "$out/checkpoint/trainer_state.pt" ]; then
    "$BIN/clover" train --out "$out" "$@" --resume
  else
    rm -rf "$out"
    "$BIN/clover" train --out "$out" "$@"
  fi
  touch "$out/DONE"
}

start=$(date +%s)
if [ ! -f "$DATA/tokens/counts.json" ]; then
  stage "data: corpus, tokenizer, token shards"
  rm -rf "$DATA"
  "$BIN/clover" data build --out "$DATA" --vocab-size 8192
fi
stage "AR pretraining"
train "$RUNS/ar" --data "$DATA" --init preset:tiny --objective ar --steps "$AR_STEPS" --batch-size 16 \
  --seq-len 256 --lr 3e-3 --warmup 50 --mix "$MIX" --eval-every 150 --save-every 50
stage "convert the AR parent into a block-diffusion model"
[ -f "$RUNS/diff-init/config.json" ] || "$BIN/clover" convert "$RUNS/ar/model" "$RUNS/diff-init"
stage "block-diffusion adaptation"
train "$RUNS/diff" --data "$DATA" --init "$RUNS/diff-init" --objective diffusion --ar-loss-weight 1.0 \
  --steps "$DIFF_STEPS" --batch-size 16 --seq-len 256 --lr 1e-3 --warmup 20 --mix "$MIX" --eval-every 150 --save-every 50
stage "chat and agent SFT"
train "$RUNS/sft" --data "$DATA" --init "$RUNS/diff/model" --objective diffusion --sft --ar-loss-weight 1.0 \
  --steps "$SFT_STEPS" --batch-size 8 --seq-len 512 --lr 5e-4 --warmup 10 --mix chat=1 --eval-every 50 --save-every 25
stage "release to $OUT (bfloat16)"
"$BIN/python" - "$RUNS/sft/model" "$OUT" <<'PY'
import sys
from clover.checkpoint import load_checkpoint, save_checkpoint
from clover.tokenizer import Tokenizer
src, dst = sys.argv[1:]
save_checkpoint(load_checkpoint(src), dst, dtype="bfloat16", extra_files=Tokenizer.load(src).files())
PY
echo "{\"recipe_wall_seconds\": $(( $(date +%s) - start ))}" > "$RUNS/wall_time.json"
stage "done in $(( ($(date +%s) - start) / 60 )) minutes"
