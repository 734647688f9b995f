"""Pictures of block diffusion: how each block was drafted, then sharpened.

`render_steps_ansi` colours every generated token by the denoising step (within its block) that
accepted it; `write_trace_html` writes a self-contained page that replays a generation step by
step (drafts shown faintly by confidence, accepted tokens solid).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path

from clover.engine.engine import GenerationResult
from clover.engine.sequence import NO_DRAFT, GenerationStats
from clover.model.files import write_text_atomic

_NO_DRAFT_PIECE = "\u00b7"   # shown for a slot with no draft

# 256-colour ramp from early (blue) to late (red) steps
_RAMP = [33, 39, 45, 51, 50, 49, 48, 82, 118, 154, 190, 226, 220, 214, 208, 202, 196]


def _colour(rank: int, count: int) -> int:
    if count <= 1:
        return _RAMP[0]
    return _RAMP[round(rank * (len(_RAMP) - 1) / (count - 1))]


def token_texts(ids: list[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Per-token text such that the pieces concatenate to decode(ids) (multi-byte characters stay whole)."""
    pieces, prev = [], ""
    for i in range(1, len(ids) + 1):
        text = decode(ids[:i])
        if text.endswith("\ufffd") and i < len(ids):
            pieces.append("")
            continue
        pieces.append(text[len(prev):])
        prev = text
    return pieces


def block_steps(result: GenerationResult) -> list[tuple[int, int]]:
    """Per generated token: (block, step within that block, 1-based). AR tokens are each their own block."""
    if result.accept_steps is None or result.trace is None:
        raise ValueError("the generation was not recorded: set record_steps=True")
    if not result.trace:
        return [(i, 1) for i in range(len(result.token_ids))]
    first, sizes = {}, {}
    for rec in result.trace:
        first.setdefault(rec.block, rec.step)
        sizes[rec.block] = len(rec.tokens) - rec.fixed
    out: list[tuple[int, int]] = []
    for block in first:
        for _ in range(sizes[block]):
            if len(out) < len(result.accept_steps):
                out.append((block, result.accept_steps[len(out)] - first[block] + 1))
    return out


def render_steps_ansi(result: GenerationResult, decode: Callable[[list[int]], str]) -> str:
    """The generated text with each token coloured by the step of its block that accepted it."""
    steps = block_steps(result)
    texts = token_texts(result.token_ids, decode)
    most = max((s for _, s in steps), default=1)
    prompt_len = len(result.prompt_ids)
    fixed = {rec.start + slot - prompt_len for rec in result.trace or [] for slot in rec.rejected}
    out = []
    last_block = None
    for i, ((block, step), text) in enumerate(zip(steps, texts, strict=True)):
        if last_block is not None and block != last_block:
            out.append("\033[2m|\033[0m")
        last_block = block
        underline = "4;" if i in fixed else ""
        out.append(f"\033[{underline}38;5;{_colour(step - 1, most)}m{text}\033[0m")
    legend = " ".join(f"\033[38;5;{_colour(s - 1, most)}m{s}\033[0m" for s in range(1, most + 1))
    stats = result.stats
    checks = (f", {stats.check_forwards} causal forwards, {stats.draft_checks} with drafts: kept "
              f"{stats.drafts_accepted} of {stats.drafts_proposed} (underlined: the causal head's token over a "
              f"rejected draft){_unpreviewed(stats)}" if stats.check_forwards else "")
    return ("".join(out) + f"\n\033[2msteps within a block: {legend}   ('|' marks a block boundary)   "
            f"{stats.generated_tokens} tokens, {stats.nfe} forwards, TPF {stats.tpf:.2f}{checks}\033[0m")


_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Clover denoising trace</title>
<style>
body{font:15px/1.5 system-ui,sans-serif;margin:2rem;max-width:70rem;color:#222}
#text{font-family:ui-monospace,monospace;white-space:pre-wrap;border:1px solid #ddd;padding:1rem;border-radius:6px;
min-height:6rem;background:#fafafa}
.tok{border-radius:3px}.draft{color:#999;font-style:italic}.new{outline:2px solid #e33}
.fix{text-decoration:underline wavy #c00}
.prompt{color:#555}.blk{border-left:2px dashed #bbb;margin-left:1px}
#bar{display:flex;gap:.6rem;align-items:center;margin:1rem 0}#info{color:#555}
</style></head><body>
<h1>Block diffusion, step by step</h1>
<p>Each block starts as masks; every step drafts all unknown positions (grey, faint where unsure) and
accepts the confident ones (coloured by the step that accepted them). Red outline: accepted at this
step. With <code>verify</code>, a step is a check by the causal head: it keeps the drafts that agree with it
and writes its own token (wavy underline) over the first that does not. __SUMMARY__</p>
<div id="bar"><button id="play">play</button><button id="prev">&lsaquo;</button><button id="next">&rsaquo;</button>
<input id="slider" type="range" min="0" value="0" style="flex:1"><span id="info"></span></div>
<div id="text"></div>
<script>
const D = __DATA__;
const slider = document.getElementById('slider'), text = document.getElementById('text'),
      info = document.getElementById('info');
slider.max = D.steps.length;
const hue = s => 220 - 220 * Math.min(1, (s - 1) / Math.max(1, D.maxStep - 1));
function esc(s){return s.replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;');}
function show(n){
  slider.value = n;
  const blocks = {};
  for (let i = 0; i < n; i++) blocks[D.steps[i].block] = D.steps[i];
  let out = '<span class="prompt">' + esc(D.prompt) + '</span>';
  for (const b of Object.keys(blocks).map(Number).sort((a,b)=>a-b)) {
    const s = blocks[b], last = (s === D.steps[n-1]);
    out += '<span class="blk"></span>';
    s.pieces.forEach((p, i) => {
      if (i < s.fixed) return;
      const acc = s.acceptedAt[i];
      if (acc > 0) {
        const isNew = last && s.accepted.includes(i), fix = s.fixedBy[i] ? ' fix' : '';
        const why = s.fixedBy[i] ? `; the draft ${JSON.stringify(s.fixedBy[i])} was rejected` : '';
        out += `<span class="tok${isNew?' new':''}${fix}" style="background:hsl(${hue(acc - s.firstStep + 1)},80%,85%)"`
            + ` title="accepted at step ${acc - s.firstStep + 1} of block ${b}${esc(why)}">${esc(p)}</span>`;
      } else {
        out += `<span class="tok draft" style="opacity:${0.25 + 0.75 * s.conf[i]}" `
            + `title="${s.drafted[i] ? 'draft, confidence ' + s.conf[i].toFixed(2)
                      : 'no draft: a block decoded without a preview'}">${esc(p)}</span>`;
      }
    });
  }
  text.innerHTML = out;
  info.textContent = n ? `step ${n} / ${D.steps.length} (block ${D.steps[n-1].block}, `
      + `${D.steps[n-1].accepted.length} accepted)` : `0 / ${D.steps.length}`;
}
let timer = null;
document.getElementById('play').onclick = () => {
  if (timer) { clearInterval(timer); timer = null; return; }
  if (+slider.value >= D.steps.length) show(0);
  timer = setInterval(() => { if (+slider.value >= D.steps.length) { clearInterval(timer); timer = null; }
                             else show(+slider.value + 1); }, 350);
};
document.getElementById('prev').onclick = () => show(Math.max(0, +slider.value - 1));
document.getElementById('next').onclick = () => show(Math.min(D.steps.length, +slider.value + 1));
slider.oninput = () => show(+slider.value);
const hash = location.hash.match(/step=(\d+)/);
show(hash ? Math.min(+hash[1], D.steps.length) : D.steps.length);
</script></body></html>
"""


def trace_data(result: GenerationResult, prompt_text: str, decode: Callable[[list[int]], str]) -> dict:
    """The JSON the trace page replays: per step, the block's tokens, drafts and confidences."""
    if result.trace is None:
        raise ValueError("the generation was not recorded: set record_steps=True")
    steps, accepted_at, first_step, fixed_by = [], {}, {}, {}
    for rec in result.trace:
        first_step.setdefault(rec.block, rec.step)
        at = accepted_at.setdefault(rec.block, [0] * len(rec.tokens))
        fixes = fixed_by.setdefault(rec.block, [""] * len(rec.tokens))
        for slot in rec.accepted:
            at[slot] = rec.step
        for slot in rec.rejected:  # verify: the causal head's token replaced this draft
            fixes[slot] = decode([rec.draft[slot]])
        known = [i < rec.fixed or at[i] > 0 for i in range(len(rec.tokens))]
        steps.append({
            "block": rec.block, "fixed": rec.fixed, "firstStep": first_step[rec.block], "accepted": rec.accepted,
            "acceptedAt": list(at), "conf": [round(c, 3) for c in rec.confidence], "fixedBy": list(fixes),
            "pieces": [decode([t]) if k else _NO_DRAFT_PIECE if d == NO_DRAFT else decode([d])
                       for t, d, k in zip(rec.tokens, rec.draft, known, strict=True)],
            "drafted": [d != NO_DRAFT for d in rec.draft],
        })
    max_step = max((s["acceptedAt"][i] - s["firstStep"] + 1 for s in steps for i in range(len(s["acceptedAt"]))
                    if s["acceptedAt"][i]), default=1)
    return {"prompt": prompt_text, "steps": steps, "maxStep": max_step}


def _unpreviewed(stats: GenerationStats) -> str:
    n = stats.previews_skipped
    return f"; {n} block{'s' * (n != 1)} decoded without a preview" if n else ""


def write_trace_html(path: str | Path, result: GenerationResult, prompt_text: str,
                     decode: Callable[[list[int]], str]) -> None:
    data = trace_data(result, prompt_text, decode)
    s = result.stats
    checks = (f", {s.check_forwards} causal forwards, {s.draft_checks} with drafts, keeping {s.drafts_accepted} "
              f"of {s.drafts_proposed}{_unpreviewed(s)}" if s.check_forwards else "")
    summary = html.escape(f"{s.generated_tokens} tokens in {s.nfe} forwards ({s.preview_forwards} previews, "
                          f"{s.commit_forwards} commits{checks}), TPF {s.tpf:.2f}, {s.blocks} blocks.")
    page = _PAGE.replace("__SUMMARY__", summary).replace("__DATA__", json.dumps(data).replace("</", "<\\/"))
    write_text_atomic(path, page)   # (a failed write leaves the earlier trace whole)
