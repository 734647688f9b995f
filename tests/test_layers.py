"""The layers import downwards only, and no module imports itself back through others.

model (config, kernels, cache, model, checkpoints, tokenizer and chat format) < engine (sampling,
sequences, policies, prefix cache, engine, traces) < serving (async bridge, HTTP app). Training
(data, task generators, objectives, trainer, distillation) builds on model and engine. Evaluation
talks to models over HTTP (harness, suites, sandbox, serving benchmark) except `evaluate.py`, the
one in-process path used by the model card. The command line sits on top of everything.
Imports under `if TYPE_CHECKING:` are annotations only and are not counted.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "clover"
LAYERS = {
    "model": {"config", "gdn", "moe", "cache", "model", "checkpoint", "verify", "tokenizer", "chat", "testing"},
    "engine": {"sampling", "sequence", "policies", "prefix_cache", "engine", "trace"},
    "serving": {"async_engine", "server"},
    "training": {"data", "synthetic", "agent_data", "objectives", "train", "distill"},
    "evaluation": {"harness", "agent_suites", "sandbox", "bench"},
    "in_process_eval": {"evaluate"},
    "cli": {"cli", "cli_generate", "cli_train"},
}
MAY_IMPORT = {
    "model": {"model"},
    "engine": {"model", "engine"},
    "serving": {"model", "engine", "serving"},
    "training": {"model", "engine", "training"},
    "evaluation": {"evaluation", "training"},            # task generators, never a model in process
    "in_process_eval": {"model", "engine", "training"},
    "cli": set(LAYERS),
}


def _layer(module: str) -> str:
    return next(name for name, mods in LAYERS.items() if module in mods)


def _imports(path: Path) -> set[str]:
    """Clover modules a file imports at run time (anywhere in it, lazy imports included)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "clover":
                out |= {a.name for a in node.names}
            elif node.module.startswith("clover."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("clover.")}
    return out


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) - {p.stem} for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def test_every_module_has_a_layer():
    assert set(_graph()) == set().union(*LAYERS.values())


def test_layers_import_downwards_only():
    bad = [f"{m} ({_layer(m)}) imports {i} ({_layer(i)})" for m, deps in _graph().items() for i in sorted(deps)
           if _layer(i) not in MAY_IMPORT[_layer(m)]]
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(d):], d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_decoding_defaults_are_written_only_in_generation_config():
    """The threshold and the default algorithm as literals appear in `config.GenerationConfig` alone;
    everything else reads them from it (issue 12: one source for every setting). Threshold sweeps
    (`thresholds`, a grid of values to measure) and AdamW's betas are not decoding defaults."""
    import re

    root = PACKAGE.parent
    literal = re.compile(r"""(?<![\w.])0\.95(?![\d])|=\s*["']low_confidence["']|["']low_confidence["']\s*\)""")
    offenders = []
    for path in [*PACKAGE.glob("*.py"), *(root / "benchmarks").glob("*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0]
            if literal.search(code) and not any(w in code for w in ("betas", "thresholds")):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    allowed = {"clover/config.py"}
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []
    assert any(o.startswith("clover/config.py") for o in offenders)  # the one place (the pattern still matches)
