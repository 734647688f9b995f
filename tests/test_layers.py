"""The layers import downwards only, and no module imports itself back through others.

The layers are the subpackages of `clover` (see `clover/__init__.py`): model < engine < serving;
training builds on model and engine; evaluation talks to models over HTTP only (it may use the task
generators of training, and the model layer's atomic writes, `model.files`); the command line sits on top
of everything. Imports under `if TYPE_CHECKING:` are annotations only and are not counted.
"""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "clover"
LAYERS = ("model", "engine", "serving", "training", "evaluation", "cli")
MAY_IMPORT = {
    "model": {"model"},
    "engine": {"model", "engine"},
    "serving": {"model", "engine", "serving"},
    "training": {"model", "engine", "training"},
    # task generators and atomic writes (model.files, standard library only), never a model in process
    "evaluation": {"evaluation", "training", "model.files"},
    "cli": set(LAYERS),
}


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _imports(path: Path) -> set[str]:
    """Clover modules ("layer.module") a file imports at run time (anywhere in it, lazy imports included)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clover."):
            parts = node.module.split(".")[1:]
            if len(parts) == 1:   # from clover.layer import module
                out |= {f"{parts[0]}.{a.name}" for a in node.names}
            else:
                out.add(".".join(parts[:2]))
        elif isinstance(node, ast.ImportFrom) and node.module == "clover":
            raise AssertionError(f"{path}: import layers by name (from clover.<layer> import ...)")
        elif isinstance(node, ast.Import):
            out |= {".".join(a.name.split(".")[1:3]) for a in node.names if a.name.startswith("clover.")}
    return out


def _graph() -> dict[str, set[str]]:
    # clover/weights holds checkpoints (data): their remote-code files are copies for transformers
    mods = [p for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")
            and PACKAGE / "weights" not in p.parents]
    return {_name(p): _imports(p) - {_name(p)} for p in mods}


def test_every_module_lives_in_a_layer():
    assert {m.split(".")[0] for m in _graph()} == set(LAYERS)
    assert not [p.name for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")]
    for layer in LAYERS:   # each says what it owns and what it may import
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
        assert doc and "import" in doc, layer


def test_layers_import_downwards_only():
    graph = _graph()
    assert all(d in graph for deps in graph.values() for d in deps), "an import names no module"
    bad = [f"{m} imports {i}" for m, deps in graph.items() for i in sorted(deps)
           if i.split(".")[0] not in MAY_IMPORT[m.split(".")[0]] and i not in MAY_IMPORT[m.split(".")[0]]]
    assert not bad, "\n".join(bad)


def test_the_atomic_writes_the_evaluation_layer_may_use_need_only_the_standard_library():
    tree = ast.parse((PACKAGE / "model" / "files.py").read_text())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


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
    for path in [*PACKAGE.rglob("*.py"), *(root / "benchmarks").glob("*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0]
            if literal.search(code) and not any(w in code for w in ("betas", "thresholds")):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    allowed = {"clover/model/config.py"}
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []
    assert any(o.startswith("clover/model/config.py") for o in offenders)  # the one place (the pattern still matches)
