#!/usr/bin/env bash
# The model card's held-out figures for a built model, written into RUNS (read by scripts/model_card.py):
#   eval_bpb_ar.json     bits per byte of the AR parent (RUNS/ar/model) on the test split
#   eval_bpb_final.json  the same for MODEL's AR head
#   eval_match.json      held-out code continuations: ar, block diffusion at 0.7 / 0.9 / 0.95, verify
#   eval_copy_ar.json    copying on agent conversations of test seeds (clover eval copy), the AR parent
#   eval_copy_final.json the same for MODEL
#   eval_tasks.json      `clover eval tasks` (harness suite synthetic, in process), 20 tasks, thinking off, ar
#   eval_turns_final.json `clover eval turns`: greedy ar turns on 60 agent conversations of validation seeds
#   eval_turns_grammar.json the same with each call held to the offered tools (--tool-grammar, as served)
#   bench_train.json     benchmarks/train.py (training throughput of the model's shape, PRESET)
# The agent suites run through `clover serve`: scripts/agent_reports.sh agent.
# usage: scripts/evaluate_model.sh [MODEL_DIR] [RUNS_DIR]     (about 15 minutes on 2 idle cores)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
MODEL=${1:-clover/weights/clover-tiny}
RUNS=${2:-runs/recipe}
DATA=${DATA:-data}
PRESET=${PRESET:-tiny-wide}   # the shape timed by benchmarks/train.py: the model's (scripts/make_model.sh PRESET)
step() { echo "== $* ($(date +%H:%M:%S))" >&2; }

# the AR parent: what scripts/make_model.sh converted (RUNS/diff-init/PARENT: the extension stage's model where
# the recipe had one, EXT_STEPS), else RUNS/ar/model
PARENT=$(cat "$RUNS/diff-init/PARENT" 2> /dev/null || echo "$RUNS/ar/model")
step "bits per byte: AR parent and $MODEL"
# (the AR parent's figures only where RUNS has it: a build continued from a release carries them in
# RUNS/base_record.json, see scripts/model_card.py; measured again each time, as the model's are: figures kept from
# an earlier run could be of other code, printed beside the model's)
[ ! -d "$PARENT" ] || "$BIN/clover" eval bpb --model "$PARENT" --data "$DATA" --out "$RUNS/eval_bpb_ar.json"
"$BIN/clover" eval bpb --model "$MODEL" --data "$DATA" --out "$RUNS/eval_bpb_final.json"
step "copying: AR parent and $MODEL"
[ ! -d "$PARENT" ] || "$BIN/clover" eval copy --model "$PARENT" --out "$RUNS/eval_copy_ar.json"
"$BIN/clover" eval copy --model "$MODEL" --out "$RUNS/eval_copy_final.json"
step "code continuations"
"$BIN/clover" eval match --model "$MODEL" --data "$DATA" --out "$RUNS/eval_match.json"
step "synthetic agent tasks"
"$BIN/clover" eval tasks --model "$MODEL" --count 20 --thinking off --algorithm ar --out "$RUNS/eval_tasks.json"
step "validation turns"
"$BIN/clover" eval turns --model "$MODEL" --out "$RUNS/eval_turns_final.json"
"$BIN/clover" eval turns --model "$MODEL" --tool-grammar --out "$RUNS/eval_turns_grammar.json"
step "training throughput"
# (through a temp file: a failed or killed benchmark leaves the previous table, never an empty one)
"$BIN/python" benchmarks/train.py --shapes "$PRESET" --steps 3 --compile | tail -1 > "$RUNS/bench_train.json.tmp"
mv "$RUNS/bench_train.json.tmp" "$RUNS/bench_train.json"
step "done"
