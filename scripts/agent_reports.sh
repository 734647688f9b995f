#!/usr/bin/env bash
# The committed reports under reports/, against a fresh `clover serve` with the shipped model:
#   agent      clover eval agent: tools, memory, heldout (tool schemas never used in training), coding;
#              ar, verify, block diffusion at blocks 16 and 32 (threshold 0.95), every call held to the
#              offered tools (the server's default), and ar without that; 3 runs (TASKS per suite)
#   humaneval  clover eval agent: all 164 HumanEval problems; ar, verify, block 32; 1 run
#   bench      clover bench serve at concurrency 1 and 8
#   sft        two endpoints side by side: the shipped model and the recipe's checkpoint before SFT
#              ($RECIPE/diff/model, RECIPE default runs/recipe: from `make model`)
# usage: scripts/agent_reports.sh [agent] [humaneval] [bench] [sft]   (no argument: all four)
# Each part replaces its report. TASKS (default 8) sets the tasks per suite of the agent part, REPEATS (default 3)
# the runs of each task (at temperature 0 they repeat each other but for timing; not RUNS, which the recipe's
# scripts use for a run directory). The agent report's weights.txt names the weights it measured (the first 16
# hex digits of `clover.cli.evaluate.weights_digest`): scripts/model_card.py reads no report of other weights.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
PORT=${PORT:-8300}
PARTS=${*:-agent humaneval bench sft}
URL=http://127.0.0.1:$PORT/v1
AR='{"algorithm": "ar"}'
AR_FREE='{"algorithm": "ar", "constrain_tool_calls": false}'   # the calls as the model writes them, unheld
VERIFY='{"algorithm": "verify"}'
TASKS=${TASKS:-8}
REPEATS=${REPEATS:-3}
RECIPE=${RECIPE:-runs/recipe}
block() { echo "{\"algorithm\": \"low_confidence\", \"block_size\": $1, \"threshold\": 0.95}"; }

# serve PORT ARGS...: start `clover serve` in the background and wait until it answers /health; stop if the port
# already answers (another server would be measured instead), if the server exits, or after 10 minutes
serve() {
  local port=$1 pid waited=0; shift
  if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
    echo "port $port already answers /health: stop that server first, or set PORT" >&2
    exit 1
  fi
  "$BIN/clover" serve --port "$port" "$@" > "/tmp/clover-serve-$port.log" 2>&1 &
  pid=$!
  SERVERS="${SERVERS:-} $pid"
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    if ! kill -0 "$pid" 2> /dev/null || [ "$waited" -ge 600 ]; then
      echo "clover serve $* did not start (/tmp/clover-serve-$port.log):" >&2
      tail -5 "/tmp/clover-serve-$port.log" >&2
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
}
trap 'kill ${SERVERS:-} 2> /dev/null || true' EXIT

has() { [[ " $PARTS " == *" $1 "* ]]; }

# fresh DIR: empty a report directory; a hand-written reading of the old figures is set aside as
# notes.previous.md (left out of the new report until someone has checked it against the new figures)
fresh() {
  if [ -f "$1/notes.md" ]; then mv "$1/notes.md" "/tmp/clover-notes.$$"; fi
  rm -rf "$1"
  mkdir -p "$1"
  if [ -f "/tmp/clover-notes.$$" ]; then mv "/tmp/clover-notes.$$" "$1/notes.previous.md"; fi
}

if has agent || has humaneval || has bench; then
  serve "$PORT" --served-model-name clover-tiny   # started right before: the first task run is a real cold start
fi
if has agent; then
  fresh reports/agent-clover-tiny
  "$BIN/clover" eval agent --endpoint "clover-tiny=$URL" --model clover-tiny --suite tools,memory,heldout,coding \
    --tasks "$TASKS" --runs "$REPEATS" --max-tokens 128 --condition "$AR" --condition "$AR_FREE" --condition "$VERIFY" --condition "$(block 16)" \
    --condition "$(block 32)" --out reports/agent-clover-tiny
  "$BIN/python" -c 'from clover.cli.evaluate import weights_digest; print(weights_digest(None)[:16])' \
    > reports/agent-clover-tiny/weights.txt
fi
if has humaneval; then
  fresh reports/humaneval-clover-tiny
  "$BIN/clover" eval agent --endpoint "clover-tiny=$URL" --model clover-tiny --suite humaneval --runs 1 \
    --max-tokens 128 --condition "$AR" --condition "$VERIFY" --condition "$(block 32)" --out reports/humaneval-clover-tiny
fi
if has bench; then
  for c in 1 8; do
    "$BIN/clover" bench serve --endpoint "$URL" --model clover-tiny --concurrency "$c" --num-prompts 24 \
      --input-len 64 --output-len 64 --ttft-limit-ms 2000 --tpot-limit-ms 200 \
      --extra-body '{"ignore_eos": true, "chat_template_kwargs": {"enable_thinking": false}}' \
      --out "reports/bench-serve-clover-tiny-c$c.json"
  done
fi
if has sft; then
  kill ${SERVERS:-} 2> /dev/null || true
  SERVERS=
  serve $((PORT + 1)) --served-model-name clover-tiny
  serve $((PORT + 2)) --model "$RECIPE/diff/model" --served-model-name before-sft
  fresh reports/agent-sft-vs-before-sft
  "$BIN/clover" eval agent --endpoint "shipped=http://127.0.0.1:$((PORT + 1))/v1" --model clover-tiny \
    --endpoint "before-sft=http://127.0.0.1:$((PORT + 2))/v1" --model before-sft --suite tools,memory,coding \
    --tasks 4 --runs 1 --max-tokens 128 --condition "$AR" --condition "$(block 32)" \
    --out reports/agent-sft-vs-before-sft
fi
