"""Memory of the prefix cache on one long prefill: the process's peak resident memory and the bytes the cache holds.

One prompt of --tokens random tokens is prefilled (and one token decoded, `ar`) by an engine without the prefix cache
and by engines with it for each --state-every (GDN states after every that many blocks, besides the prompt's end:
`clover.engine.prefix_cache`; 1: every block). Each setting runs in a fresh process, so its peak resident set size
(VmHWM) is its own: the figure is the peak over the prefill minus the resident size just before it (after the model
was built and a short warm-up). The model is a preset with random weights (the sizes matter, not the values).
Prints its conditions, a table, and one JSON line last.

    python benchmarks/prefix_memory.py [--preset small] [--tokens 4096] [--state-every 16,1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def one(preset: str, tokens: int, every: int) -> dict:
    """In this process: peak RSS growth over the prefill with the cache at `every` (0: no cache)."""
    import torch

    from clover.engine.engine import Engine
    from clover.engine.sampling import SamplingParams
    from clover.model.config import CloverConfig
    from clover.model.modeling import CloverForCausalLM

    torch.manual_seed(0)
    model = CloverForCausalLM(CloverConfig.preset(preset)).eval()
    engine = Engine(model, prefix_cache_bytes=(4 << 30) if every else 0, **({"prefix_state_every": every} if every else {}))
    high = min(model.config.vocab_size, model.config.mask_token_id) - 2   # (a preset's mask id is its last row)
    prompt = torch.randint(0, high, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True, algorithm="ar")
    Engine(model).generate([prompt[:64]], params)   # warm-up (a separate engine: this one's cache stays empty)
    with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM to the current RSS
        f.write("5")
    before = _kib("VmRSS")
    engine.generate([prompt], params)
    peak = _kib("VmHWM")
    held = engine.prefix.nbytes if engine.prefix is not None else 0
    states = engine.prefix.stats.snapshots if engine.prefix is not None else 0
    return {"state_every": every or None, "peak_growth_mib": (peak - before) / 1024, "cache_mib": held / 2**20,
            "gdn_states": states}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="model preset (random weights)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--state-every", default="16,1", help="comma-separated intervals of GDN states, one run each")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)   # (the child process: one setting)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.preset, args.tokens, args.one)))
        return
    import torch

    from clover.model.config import CloverConfig

    settings = [0] + [int(x) for x in args.state_every.split(",")]
    config = CloverConfig.preset(args.preset)
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "preset": args.preset, "block_size": config.block_size,
                  "prompt_tokens": args.tokens, "dtype": "float32", "budget_bytes": 4 << 30}
    print("conditions:", json.dumps(conditions))
    rows = []
    for every in settings:
        out = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--tokens", str(args.tokens),
                              "--one", str(every)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\n{'prefix cache':>22} {'peak growth':>12} {'cache holds':>12} {'GDN states':>11}")
    for r in rows:
        name = "off" if r["state_every"] is None else f"states every {r['state_every']}"
        print(f"{name:>22} {r['peak_growth_mib']:>8.1f} MiB {r['cache_mib']:>8.1f} MiB {r['gdn_states']:>11}")
    print(json.dumps({"benchmark": "prefix_memory", "conditions": conditions, "rows": rows}))


if __name__ == "__main__":
    main()
