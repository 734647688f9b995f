#!/usr/bin/env bash
# Rebuild the shipped model clover-tiny from scratch (spec section 4, Clover's recipe at laptop scale):
#   data -> AR pretraining -> clover convert -> block-diffusion adaptation (AR loss kept) -> chat/agent SFT
#   -> self-distillation (the noisy stream learns the model's own greedy ar outputs) -> a second round of
#   SFT and self-distillation -> a third SFT round -> two rounds of SFT with recall drills -> release.
# Every stage resumes where it stopped: after an interruption, run the same command again.
# Training time depends on the CPU (2 cores; measured, stage wall time): 160 minutes on an AVX-512 EPYC in bf16
# autocast (session 34); with EXT_STEPS=300, 1,015 minutes on an AVX2 EPYC at 2 GHz in fp32 (session 44, compiled);
# 189 minutes on a Xeon with AMX in bf16 autocast, compiled (session 52: the shipped build), 191.7 when rebuilt (session 56). AR pretraining runs at ~3,200 tokens/s
# on a Xeon with AMX (bf16, compiled), ~2,650 on the AVX-512 EPYC (fp32), 868 on the AVX2 EPYC (fp32, eager).
# Override the step counts with the variables below.
# Chat rows are packed with several conversations (--pack); SFT keeps code and English in the mix.
set -euo pipefail
cd "$(dirname "$0")/.."
# The whole script is one compound command, read before it runs: editing this file while a build runs (e.g. a
# step count for the next sitting) cannot change or break the running build.
{
BIN=${BIN:-.venv/bin}
DATA=${DATA:-data}
RUNS=${RUNS:-runs/recipe}
OUT=${OUT:-clover/weights/clover-tiny}
PRESET=${PRESET:-tiny-wide}   # the shape (clover/model/config.py PRESETS): the shape sweep's winner; tiny: the previous release's
GDN_GATE_Z=${GDN_GATE_Z:-0}    # the from-scratch GDN init of the AR stage (`clover train --gdn-gate-z / --gdn-dt-max`):
GDN_DT_MAX=${GDN_DT_MAX:-0}    # 0 and 0, the transformers-style init the shipped weights were trained from (see below)
ISOLATE_SPACES=${ISOLATE_SPACES:-0}   # 1: the data's tokenizer spells a word the same after a space and a newline
                                      # (`clover data build --isolate-spaces`; its one run, session 35, did not
                                      # learn to copy digits: docs/measurements.md)
AR_STEPS=${AR_STEPS:-1800}
DIFF_STEPS=${DIFF_STEPS:-550}
SFT_STEPS=${SFT_STEPS:-500}
DISTILL_STEPS=${DISTILL_STEPS:-300}
SFT2_STEPS=${SFT2_STEPS:-500}
SFT3_STEPS=${SFT3_STEPS:-500}
SFT4_STEPS=${SFT4_STEPS:-500}
SFT5_STEPS=${SFT5_STEPS:-600}   # (189 and 192 minutes on the Xeon; 200/400/450 took 150 minutes but lost 6.8
                                # points of validation turns on both pools, more than its rule allowed: session 59)
AR_SEQ=${AR_SEQ:-512}       # rows of AR pretraining and block-diffusion adaptation: AR_BATCH x AR_SEQ tokens
AR_BATCH=${AR_BATCH:-8}
SFT_SEQ=${SFT_SEQ:-1024}    # rows of the SFT and distillation stages: SFT_BATCH x SFT_SEQ tokens
SFT_BATCH=${SFT_BATCH:-4}
EXT_STEPS=${EXT_STEPS:-0}   # >0: an AR stage more after pretraining, in EXT_BATCH x EXT_SEQ rows from the AR parent, lr 1e-3
EXT_SEQ=${EXT_SEQ:-2048}    # (its 300 steps at 8 x 2,048 took the AR parent from 0.148 / 0.128 to 0.237 / 0.185 of the
EXT_BATCH=${EXT_BATCH:-8}   # validation agent turns and 0.956x the code bits per byte, session 37); 0: none
case $EXT_STEPS in ''|*[!0-9]*) echo "EXT_STEPS must be a whole number, got '$EXT_STEPS'" >&2; exit 2;; esac
LAYOUT=${LAYOUT:-}          # the layers' mixers, one letter each (L: Gated DeltaNet, F: full attention), e.g. LFLF;
                            # empty: the preset's (tiny-wide: LLLF)
DISTILL_CHAT=${DISTILL_CHAT:-1500}
DISTILL_CODE=${DISTILL_CODE:-300}
MIX=code=0.45,english=0.25,chat=0.3
SFT_MIX=chat=0.8,code=0.15,english=0.05
SFT2_MIX=chat=0.7,code=0.25,english=0.05
SFT4_MIX=chat=0.6,recall=0.2,code=0.15,english=0.05
SFT5_MIX=chat=0.45,recall=0.35,code=0.15,english=0.05

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

# Training runs in bf16 autocast (fp32 master weights) where the CPU multiplies bf16 natively (avx512_bf16,
# amx_bf16): on an AVX-512 EPYC 1.26x the tokens/s of fp32 for AR and 1.36x for the diffusion objective, with
# validation bits per byte 0.994x and 1.0001x (docs/measurements.md, session 30); elsewhere bf16 products are
# emulated and slower, so fp32. DTYPE overrides. (The shipped weights were trained in bf16 autocast, compiled.)
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2> /dev/null; then DTYPE=${DTYPE:-bfloat16}; else DTYPE=${DTYPE:-float32}; fi

# PROCS > 1 trains on that many processes (torchrun, DistributedDataParallel: gloo on CPU, each process with THREADS
# threads; nccl on one GPU each where torch sees CUDA); each takes its share of the rows of every batch, so the
# batches, masks and loss are those of one process and a run may change PROCS between sittings. On 2 cores it gained
# little: 2 x 1 thread against 1 x 2 threads, 1.06x the tokens/s of AR pretraining and 0.99x of SFT (AVX2 EPYC,
# session 38; one thread alone 0.56x), so the default is one process with every core.
CORES=$(nproc 2> /dev/null || echo 1)
PROCS=${PROCS:-1}
case $PROCS in ''|*[!0-9]*|0*) echo "PROCS must be a whole number >= 1, got '$PROCS'" >&2; exit 2;; esac
THREADS=${THREADS:-$(( CORES / PROCS > 0 ? CORES / PROCS : 1 ))}
case $THREADS in ''|*[!0-9]*|0*) echo "THREADS must be a whole number >= 1, got '$THREADS'" >&2; exit 2;; esac

# COMPILE=1 trains through torch.compile (`clover train --compile`: the forward of the layer stack): on 2 AVX2 cores
# at 8 x 512, 1.07x the tokens/s of AR and 1.15-1.20x of block diffusion, 1.25x of SFT at 4 x 1,024,
# after a first step that compiles for ~3 minutes a stage and shape (~30 s when inductor's cache already holds the
# graphs: the cache is kept in $RUNS/inductor-cache, so later sittings find it). It may change between sittings.
# bf16 runs and PROCS > 1 compile too (since 2026-12-06; each process compiles its own graphs). COMPILE=0: eager.
COMPILE=${COMPILE:-1}
case $COMPILE in 0|1) ;; *) echo "COMPILE must be 0 or 1, got '$COMPILE'" >&2; exit 2;; esac
case $RUNS in /*) runs_abs=$RUNS;; *) runs_abs=$PWD/$RUNS;; esac
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$runs_abs/inductor-cache}

# train RUN_DIR ARGS...: continue the run if it has a checkpoint, skip it if it finished, else start it (in
# DTYPE). A started run keeps its dtype, on another machine too (`clover train --resume` refuses changed settings).
# A kill between the two renames of a checkpoint swap leaves the checkpoint moved aside (.checkpoint.old-PID):
# that run is continued too (`--resume` moves it back), not started over.
train() {
  local out=$1 dtype; shift
  if [ -f "$out/DONE" ]; then return; fi
  local saved=""
  for f in "$out"/checkpoint/trainer_state.pt "$out"/.checkpoint.old-*/trainer_state.pt; do
    if [ -f "$f" ]; then saved=$f; fi
  done
  if [ -n "$saved" ]; then
    dtype=$("$BIN/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["dtype"])' "$out/train_config.json")
    timed "train $(basename "$out")" clover_train --out "$out" "$@" --dtype "$dtype" --resume
  else
    rm -rf "$out"
    timed "train $(basename "$out")" clover_train --out "$out" "$@" --dtype "$DTYPE"
  fi
  touch "$out/DONE"
}
# clover_train ARGS...: `clover train ARGS...` on ${PROCS:-1} processes
clover_train() {
  local compile=--no-compile; if [ "$COMPILE" = 1 ]; then compile=--compile; fi
  if [ "${PROCS:-1}" -gt 1 ]; then
    OMP_NUM_THREADS=${THREADS:-1} "$BIN/torchrun" --standalone --nproc_per_node "$PROCS" -m clover train "$@" "$compile"
  else
    "$BIN/clover" train "$@" "$compile"
  fi
}

start=$(date +%s)
if [ ! -f "$DATA/tokens/counts.json" ]; then
  stage "data: corpus, tokenizer, token shards"
  rm -rf "$DATA"
  spaces=(); if [ "$ISOLATE_SPACES" = 1 ]; then spaces=(--isolate-spaces); fi
  timed "data build" "$BIN/clover" data build --out "$DATA" --vocab-size 8192 --chat-train 40000 "${spaces[@]}"
fi
stage "AR pretraining"
# from random weights with the transformers-style GDN init (GDN_GATE_Z=0 GDN_DT_MAX=0: gates z 0, dt_bias 1), as
# the shipped weights were. The opened-gate, slow-decay init (z 2, dt_max 0.1: 4-5% lower bits per byte after 400
# steps, docs/measurements.md, sessions 23-24) built a release that copied numbers worse and answered 0.116 /
# 0.102 of the validation agent turns (sessions 30-32); this init rebuilt one at 0.290 / 0.222 against the
# shipped 0.288 / 0.237 (session 34)
init=(--init "preset:$PRESET" --gdn-gate-z "$GDN_GATE_Z" --gdn-dt-max "$GDN_DT_MAX")
if [ -n "$LAYOUT" ]; then   # random weights of the preset with other mixers (`clover init --layout`), seed 0
  [ -f "$RUNS/init-$LAYOUT/config.json" ] || "$BIN/clover" init "$RUNS/init-$LAYOUT" --preset "$PRESET" --layout "$LAYOUT" \
    --tokenizer "$DATA/tokenizer" --seed 0 --gdn-gate-z "$GDN_GATE_Z" --gdn-dt-max "$GDN_DT_MAX"
  init=(--init "$RUNS/init-$LAYOUT")
fi
train "$RUNS/ar" --data "$DATA" "${init[@]}" \
  --objective ar --steps "$AR_STEPS" --batch-size "$AR_BATCH" --seq-len "$AR_SEQ" --lr 3e-3 --warmup 100 --mix "$MIX" --pack \
  --eval-every 300 --save-every 50
parent="$RUNS/ar/model"
if [ "$EXT_STEPS" -gt 0 ]; then
  stage "AR extension: longer rows"
  train "$RUNS/ext" --data "$DATA" --init "$RUNS/ar/model" --objective ar --steps "$EXT_STEPS" --batch-size "$EXT_BATCH" \
    --seq-len "$EXT_SEQ" --lr 1e-3 --warmup 30 --mix "$MIX" --pack --eval-every 100 --save-every 25
  parent="$RUNS/ext/model"
fi
stage "convert the AR parent into a block-diffusion model"
if [ -f "$RUNS/diff-init/config.json" ] && [ ! -f "$RUNS/diff-init/PARENT" ] && [ ! -e "$RUNS/diff" ]; then
  rm -rf "$RUNS/diff-init"   # a sitting stopped between the conversion and its PARENT note: convert again (seconds)
fi
if [ -f "$RUNS/diff-init/config.json" ]; then   # converted in an earlier sitting: from the same parent?
  # (no PARENT: a run from before the note existed, which converted the AR stage's model)
  was=$(cat "$RUNS/diff-init/PARENT" 2> /dev/null || echo "$RUNS/ar/model")
  if [ "$was" != "$parent" ]; then
    echo "$RUNS/diff-init was converted from $was, this run's parent is $parent (EXT_STEPS changed?):" \
      "remove $RUNS/diff-init and the stages after it, or run with the settings it was built with" >&2
    exit 2
  fi
else
  timed convert "$BIN/clover" convert "$parent" "$RUNS/diff-init"
  [ ! -d "$RUNS/diff-init" ] || echo "$parent" > "$RUNS/diff-init/PARENT"
fi
stage "block-diffusion adaptation"
train "$RUNS/diff" --data "$DATA" --init "$RUNS/diff-init" --objective diffusion --ar-loss-weight 1.0 \
  --steps "$DIFF_STEPS" --batch-size "$AR_BATCH" --seq-len "$AR_SEQ" --lr 1e-3 --warmup 50 --mix "$MIX" --pack --eval-every 350 \
  --save-every 25
# sft_round SUFFIX INIT SEED STEPS LR MIX: chat/agent SFT from INIT, then self-distillation: the SFT model's
# greedy ar replies and code continuations become the targets of the noisy stream (its own outputs, so the
# drafts learn to agree with the causal head). Each round draws its own windows and prompts (SEED).
sft_round() {
  local sfx=$1 init=$2 seed=$3 steps=$4 lr=$5 mix=$6
  stage "chat and agent SFT$sfx"
  train "$RUNS/sft$sfx" --data "$DATA" --init "$init" --objective diffusion --sft --ar-loss-weight 1.0 \
    --steps "$steps" --batch-size "$SFT_BATCH" --seq-len "$SFT_SEQ" --lr "$lr" --warmup 30 --mix "$mix" --pack --eval-every 200 \
    --save-every 25 --seed "$seed"
  stage "self-distillation data$sfx: the SFT model's greedy ar replies and code continuations"
  [ -f "$RUNS/distill-data$sfx/tokens/counts.json" ] || timed "data distill$sfx" "$BIN/clover" data distill \
    --model "$RUNS/sft$sfx/model" --data "$DATA" --out "$RUNS/distill-data$sfx" --chat "$DISTILL_CHAT" \
    --code "$DISTILL_CODE" --seed "$seed"
  stage "self-distillation$sfx"
  train "$RUNS/distill$sfx" --data "$RUNS/distill-data$sfx" --init "$RUNS/sft$sfx/model" --objective diffusion \
    --sft --ar-loss-weight 1.0 --steps "$DISTILL_STEPS" --batch-size "$SFT_BATCH" --seq-len "$SFT_SEQ" --lr 3e-4 --warmup 20 \
    --mix chat=0.6,code=0.3,english=0.1 --pack --eval-every 150 --save-every 25 --seed "$seed"
}
sft_round "" "$RUNS/diff/model" 0 "$SFT_STEPS" 5e-4 "$SFT_MIX"
# a second round from the distilled model: more agent data (fresh windows), more code in the mix to win back
# the code bits per byte that SFT costs, and distillation of the improved model's own outputs
sft_round 2 "$RUNS/distill/model" 1 "$SFT2_STEPS" 3e-4 "$SFT2_MIX"
# a third SFT round on the coined-tool-name agent data (the SFT2 mix again, another seed), then SFT with the
# recall drills in the mix (random strings written twice: copying from the context); no distillation after
# them (it would teach the model its own outputs, tool names it should have copied included)
stage "chat and agent SFT3"
train "$RUNS/sft3" --data "$DATA" --init "$RUNS/distill2/model" --objective diffusion --sft --ar-loss-weight 1.0 \
  --steps "$SFT3_STEPS" --batch-size "$SFT_BATCH" --seq-len "$SFT_SEQ" --lr 3e-4 --warmup 30 --mix "$SFT2_MIX" --pack --save-every 25 \
  --seed 2
stage "SFT4: agent chats with recall drills"
train "$RUNS/sft4" --data "$DATA" --init "$RUNS/sft3/model" --objective diffusion --sft --ar-loss-weight 1.0 \
  --steps "$SFT4_STEPS" --batch-size "$SFT_BATCH" --seq-len "$SFT_SEQ" --lr 3e-4 --warmup 30 --mix "$SFT4_MIX" --pack --save-every 25 \
  --seed 3
# more recall drills (35%), the code share kept at 15% (with 10% code, the run named sft5 in
# docs/measurements.md lost 2.1% code bits per byte). The shipped sft5 stage (sft6 there) started from the
# bf16 release of sft4; this script starts it from the fp32 sft4 checkpoint.
stage "SFT5: agent chats with more recall drills"
train "$RUNS/sft5" --data "$DATA" --init "$RUNS/sft4/model" --objective diffusion --sft --ar-loss-weight 1.0 \
  --steps "$SFT5_STEPS" --batch-size "$SFT_BATCH" --seq-len "$SFT_SEQ" --lr 3e-4 --warmup 30 --mix "$SFT5_MIX" --pack --save-every 25 \
  --seed 5
stage "release to $OUT (bfloat16)"
"$BIN/python" - "$RUNS/sft5/model" "$OUT" <<'PY'
import sys
from clover.model.checkpoint import load_checkpoint, save_checkpoint
from clover.model.tokenizer import Tokenizer
src, dst = sys.argv[1:]
save_checkpoint(load_checkpoint(src), dst, dtype="bfloat16", extra_files=Tokenizer.load(src).files())
PY
stage "done; this sitting took $(( ($(date +%s) - start) / 60 )) minutes (every sitting: $RUNS/times.jsonl)"
exit
}
