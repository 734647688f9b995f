#!/usr/bin/env bash
# Rebuild the shipped model clover-tiny from scratch (spec section 4, Clover's recipe at laptop scale):
#   data -> AR pretraining -> clover convert -> block-diffusion adaptation (AR loss kept) -> chat/agent SFT
#   -> self-distillation (the noisy stream learns the model's own greedy ar outputs) -> release.
# Every stage resumes where it stopped: after an interruption, run the same command again.
# Step counts are sized for about 3 hours on 2 idle CPU cores; override them with the variables below.
# Chat rows are packed with several conversations (--pack); SFT keeps code and English in the mix.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
DATA=${DATA:-data}
RUNS=${RUNS:-runs/recipe}
OUT=${OUT:-clover/weights/clover-tiny}
AR_STEPS=${AR_STEPS:-1800}
DIFF_STEPS=${DIFF_STEPS:-550}
SFT_STEPS=${SFT_STEPS:-500}
DISTILL_STEPS=${DISTILL_STEPS:-300}
DISTILL_CHAT=${DISTILL_CHAT:-1500}
DISTILL_CODE=${DISTILL_CODE:-300}
MIX=code=0.45,english=0.25,chat=0.3
SFT_MIX=chat=0.8,code=0.15,english=0.05

stage() { echo "== $* ($(date +%H:%M:%S))" >&2; }
# timed NAME CMD...: run a step and append its wall time to $RUNS/times.jsonl (the model card sums the
# records of every sitting, so a recipe run in several sittings still gets its true total)
timed() {
  local name=$1 t0; shift
  t0=$(date +%s)
  "$@"
  mkdir -p "$RUNS"
  echo "{\"step\": \"$name\", \"seconds\": $(( $(date +%s) - t0 )), \"finished\": \"$(date -Iseconds)\"}" \
    >> "$RUNS/times.jsonl"
}

# train RUN_DIR ARGS...: continue the run if it has a checkpoint, skip it if it finished, else start it.
train() {
  local out=$1; shift
  if [ -f "$out/DONE" ]; then return; fi
  if [ -f "$out/checkpoint/trainer_state.pt" ]; then
    timed "train $(basename "$out")" "$BIN/clover" train --out "$out" "$@" --resume
  else
    rm -rf "$out"
    timed "train $(basename "$out")" "$BIN/clover" train --out "$out" "$@"
  fi
  touch "$out/DONE"
}

start=$(date +%s)
if [ ! -f "$DATA/tokens/counts.json" ]; then
  stage "data: corpus, tokenizer, token shards"
  rm -rf "$DATA"
  timed "data build" "$BIN/clover" data build --out "$DATA" --vocab-size 8192 --chat-train 40000
fi
stage "AR pretraining"
train "$RUNS/ar" --data "$DATA" --init preset:tiny --objective ar --steps "$AR_STEPS" --batch-size 8 \
  --seq-len 512 --lr 3e-3 --warmup 100 --mix "$MIX" --pack --eval-every 300 --save-every 50
stage "convert the AR parent into a block-diffusion model"
[ -f "$RUNS/diff-init/config.json" ] || timed convert "$BIN/clover" convert "$RUNS/ar/model" "$RUNS/diff-init"
stage "block-diffusion adaptation"
train "$RUNS/diff" --data "$DATA" --init "$RUNS/diff-init" --objective diffusion --ar-loss-weight 1.0 \
  --steps "$DIFF_STEPS" --batch-size 8 --seq-len 512 --lr 1e-3 --warmup 50 --mix "$MIX" --pack --eval-every 350 \
  --save-every 25
stage "chat and agent SFT"
train "$RUNS/sft" --data "$DATA" --init "$RUNS/diff/model" --objective diffusion --sft --ar-loss-weight 1.0 \
  --steps "$SFT_STEPS" --batch-size 4 --seq-len 1024 --lr 5e-4 --warmup 30 --mix "$SFT_MIX" --pack --eval-every 200 \
  --save-every 25
stage "self-distillation data: the SFT model's greedy ar replies and code continuations"
[ -f "$RUNS/distill-data/tokens/counts.json" ] || timed "data distill" "$BIN/clover" data distill --model "$RUNS/sft/model" --data "$DATA" \
  --out "$RUNS/distill-data" --chat "$DISTILL_CHAT" --code "$DISTILL_CODE"
stage "self-distillation"
train "$RUNS/distill" --data "$RUNS/distill-data" --init "$RUNS/sft/model" --objective diffusion --sft \
  --ar-loss-weight 1.0 --steps "$DISTILL_STEPS" --batch-size 4 --seq-len 1024 --lr 3e-4 --warmup 20 \
  --mix chat=0.6,code=0.3,english=0.1 --pack --eval-every 150 --save-every 25
stage "release to $OUT (bfloat16)"
"$BIN/python" - "$RUNS/distill/model" "$OUT" <<'PY'
import sys
from clover.model.checkpoint import load_checkpoint, save_checkpoint
from clover.model.tokenizer import Tokenizer
src, dst = sys.argv[1:]
save_checkpoint(load_checkpoint(src), dst, dtype="bfloat16", extra_files=Tokenizer.load(src).files())
PY
stage "done; this sitting took $(( ($(date +%s) - start) / 60 )) minutes (every sitting: $RUNS/times.jsonl)"
