"""Checkpoint directories (spec section 7): save, load, and convert a transformers Qwen3.5-MoE checkpoint.

A directory holds `config.json`, `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards
plus `model.safetensors.index.json`) with the transformers tensor names and the Clover extras, and
`generation_config.json`. Directories are written beside the target and renamed into place, so an
interrupted save never leaves a half-written checkpoint under the target name.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from clover.model.config import CloverConfig, ConfigError, GenerationConfig
from clover.model.files import check_replaceable, read_json, write_directory
from clover.model.modeling import CloverForCausalLM, RotaryEmbedding
from clover.model.tokenizer import MASK_TOKEN, SPECIAL_TOKENS, Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 * 1024**3
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# The Clover parameters a Qwen3.5-MoE checkpoint lacks, created at their neutral init by `convert`.
CLOVER_EXTRAS = ("conv_right", "preview_log_scale", "history_bias")


DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "weights" / "clover-tiny"
# what a checkpoint directory holds (weights, configs, tokenizer, template, remote code, model card, trainer
# state; a transformers checkpoint's special_tokens_map.json; the temp file of an atomic write a kill left):
# a directory with anything else is not replaced by a command that writes a checkpoint
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "configuration_clover.py", "modeling_clover.py", "README.md",
                    "training_record.json", "trainer_state.pt", ".*.tmp")


def check_checkpoint_target(target: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse to write a checkpoint over a directory that is not one (`files.check_replaceable`), and over
    one that is unless `overwrite` (`clover init` over trained weights replaced them with random ones)."""
    check_replaceable(target, "config.json", "a checkpoint", CHECKPOINT_FILES)
    if not overwrite and (Path(target) / "config.json").is_file():
        raise ValueError(f"{target} holds a checkpoint already; pass --overwrite to replace it (its weights "
                         "would be lost), or choose another directory")


REMOTE_CODE = [Path(__file__).with_name("remote_code") / f for f in ("configuration_clover.py", "modeling_clover.py")]


def default_model_dir() -> Path:
    """The model used when none is named: $CLOVER_MODEL, else the shipped clover-tiny. An empty CLOVER_MODEL is
    an error (it would name the working directory)."""
    named = os.environ.get("CLOVER_MODEL")
    if named is not None and not named.strip():
        raise CheckpointError("CLOVER_MODEL is set but empty: name a model directory, or unset it for the shipped one")
    return Path(named or DEFAULT_MODEL_DIR)


def load_generation_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = read_json(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete, corrupted or does not match its config."""


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(set(DTYPES))} or 'auto'")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:   # torch's message lists two dozen backends this code does not run on
        raise ValueError(f"unknown device {device!r}; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device {device!r}; use cpu or cuda")
    return dev


# -- writing -----------------------------------------------------------------------------------------


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_weights(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(directory / INDEX_NAME, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def default_generation_config(config: CloverConfig) -> dict:
    return {**GenerationConfig(block_size=config.block_size).to_file(), "eos_token_id": config.eos_token_ids,
            "mask_token_id": config.mask_token_id}


def _kept_generation_config(directory: Path, config: CloverConfig) -> str | None:
    """The `generation_config.json` in `directory`, to keep over a new save of a model with `config` (None where
    there is none). It is someone's choice of decoding defaults, except where it states the model: its block
    size and special tokens follow the new model where they were the old model's (a checkpoint converted
    again with another --block-size decodes at the new one), and a file from before `do_sample` is spelled as
    transformers reads it too (`GenerationConfig.to_file`: the same defaults). A file that is not a JSON object,
    or one beside no readable config.json, is kept as it is."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    text = path.read_text()
    try:
        kept = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if not isinstance(kept, dict):
        return text
    try:
        before = read_json(directory / "config.json")
    except (OSError, ValueError):
        before = None
    if not isinstance(before, dict):
        return text
    now = default_generation_config(config)
    stale = [key for key in ("block_size", "eos_token_id", "mask_token_id")
             if key in kept and key in before and kept[key] == before[key] != now[key]]
    respelled = None
    if "do_sample" not in kept:
        try:
            defaults = GenerationConfig.from_dict(kept)
        except ConfigError:
            pass   # (said when the checkpoint is loaded)
        else:
            names = {f.name for f in dataclasses.fields(GenerationConfig)}
            respelled = {**{k: v for k, v in kept.items() if k not in names}, **defaults.to_file()}
    if not stale and respelled is None:
        return text
    return json.dumps({**(respelled or kept), **{key: now[key] for key in stale}}, indent=2) + "\n"


def save_checkpoint(
    model: CloverForCausalLM, directory: str | os.PathLike, dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES, extra_files: dict[str, str | bytes] | None = None,
) -> None:
    """Write `model` to `directory` (atomically). `extra_files` maps file names to contents to include
    (tokenizer files, model card); an existing `generation_config.json` in `directory` is kept."""
    target_dtype = resolve_dtype(dtype)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied to model.embed_tokens.weight
        t = t.detach().to("cpu")
        tensors[name] = (t.to(target_dtype) if target_dtype is not None and t.is_floating_point() else t).contiguous()
    target = Path(directory)
    generation = _kept_generation_config(target, model.config)

    def fill(tmp: Path) -> None:
        model.config.save(tmp)
        _write_weights(tensors, tmp, max_shard_bytes)
        for src in REMOTE_CODE:  # transformers loads the causal mode with these (trust_remote_code)
            shutil.copyfile(src, tmp / src.name)
        (tmp / "generation_config.json").write_text(
            generation or json.dumps(default_generation_config(model.config), indent=2) + "\n"
        )
        for name, content in (extra_files or {}).items():
            if name == "tokenizer_config.json":
                content = _with_context(content, model.config.max_position_embeddings)
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode) as f:
                f.write(content)

    write_directory(target, fill)


# -- reading -----------------------------------------------------------------------------------------


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (one file, or the shards its index lists); a
    `CheckpointError` where they are missing or the index is unreadable."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = read_json(index)["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f and "/" not in f
                                                       for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names in {directory}")
        files = sorted({directory / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{directory}: shard(s) listed in {INDEX_NAME} are missing: {', '.join(missing)}")
        return files
    single = directory / SINGLE_NAME
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory} holds no {SINGLE_NAME} and no {INDEX_NAME}")


# the floating dtypes a checkpoint may store (safetensors' names); others (float8...) are refused by name
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def tensor_headers(directory: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of a checkpoint's tensors, from the files' headers (no tensor data
    read); a CheckpointError for a file that cannot be read, or a tensor that two shards hold."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    where: dict[str, str] = {}
    for path in weight_files(Path(directory)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in where:
                        raise CheckpointError(f"{directory}: tensor {name} is in both {where[name]} and {path.name}")
                    part = f.get_slice(name)
                    found[name], where[name] = (tuple(part.get_shape()), part.get_dtype()), path.name
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is corrupted or truncated: {exc}") from exc
    return found


def iter_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of a checkpoint directory, file by file."""
    for path in weight_files(Path(directory)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is corrupted or truncated: {exc}") from exc
        except (RuntimeError, MemoryError) as exc:   # (a tensor larger than memory, or than its file maps)
            raise CheckpointError(f"{path}: a tensor could not be read: {exc}") from None


def _some(names: list[str], limit: int = 6) -> str:
    """A list of names for an error message: the first few, and how many in all (a config of 1,024 layers against
    weights of 4 listed 888 KB of names)."""
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _check_headers(config: CloverConfig, found: dict[str, tuple[tuple[int, ...], str]], source: str) -> None:
    """The checkpoint's tensor names, shapes and dtypes (from its headers) against what `config` builds, before any
    tensor data is read: a stray tensor of gigabytes is refused by name, not read into memory first."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in CloverForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:   # (a head of its own is refused after reading, unless equal to the embeddings)
        expected.pop("lm_head.weight", None)
        found = {k: v for k, v in found.items() if k != "lm_head.weight"}
    problems = []
    odd = sorted(f"{k} ({d})" for k, (_, d) in found.items()
                 if k in expected and d not in FLOAT_DTYPES and d.startswith(("F", "BF", "E")))
    if odd:
        problems.append(f"tensors in a floating dtype Clover does not run (float64, float32, bfloat16 and float16 "
                        f"only): {_some(odd)}")
    problems += _mismatches(expected, {k: shape for k, (shape, _) in found.items()})
    if problems:
        raise CheckpointError(f"{source} does not match its config; " + "; ".join(problems))


def _mismatches(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> list[str]:
    """The missing, unexpected and mis-shaped tensors of a checkpoint (name -> shape) against a model's."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    misshaped = sorted(f"{k} (checkpoint {found[k]}, config expects {expected[k]})"
                       for k in set(expected) & set(found) if found[k] != expected[k])
    return [f"{what} tensors: {_some(names)}" for what, names in
            (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if names]


def _check_and_assign(model: CloverForCausalLM, tensors: dict[str, torch.Tensor], source: str) -> None:
    expected = {k: v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        head, emb = tensors.pop("lm_head.weight", None), tensors.get("model.embed_tokens.weight")
        if head is not None and emb is not None and not torch.equal(head, emb):
            raise CheckpointError(f"{source}: config.json ties the output head to the embeddings "
                                  "(tie_word_embeddings) but the weights hold an lm_head.weight of its own, which "
                                  "would be dropped")
    mistyped = sorted(f"{k} ({str(tensors[k].dtype).removeprefix('torch.')})" for k in set(expected) & set(tensors)
                      if expected[k].is_floating_point() and not tensors[k].is_floating_point())
    problems = [f"tensors that are not floating point: {_some(mistyped)}"] if mistyped else []
    problems += _mismatches({k: tuple(v.shape) for k, v in expected.items()},
                            {k: tuple(v.shape) for k, v in tensors.items()})
    if problems:
        raise CheckpointError(f"{source} does not match its config; " + "; ".join(problems))
    model.load_state_dict(tensors, strict=not model.config.tie_word_embeddings, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def build_model(
    config: CloverConfig, tensors: dict[str, torch.Tensor], source: str,
    dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
) -> CloverForCausalLM:
    """A model whose parameters are `tensors` (checked by name and shape), cast to dtype, on device."""
    device = resolve_device(device)
    if dtype is None:   # as stored: the floating dtype that holds most of the parameters (a checkpoint may mix)
        sizes: dict[torch.dtype, int] = {}
        for t in tensors.values():
            if t.is_floating_point():
                sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
        dtype = max(sizes, key=sizes.get) if sizes else torch.float32
    # fresh, owned buffers (not views of a file mapping): the same memory layout as a model built in
    # place, so that kernels take the same paths and a resumed run repeats an uninterrupted one bit for bit
    tensors = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)).clone()
               for k, v in tensors.items()}
    with torch.device("meta"):
        model = CloverForCausalLM(config)
    _check_and_assign(model, tensors, source)
    model.rotary = RotaryEmbedding(config).to(device)  # non-persistent buffer: rebuilt, never stored
    return model.eval()


def checkpoint_directory(directory: str | os.PathLike) -> Path:
    """`directory`, or, where it is missing because a save is between its two renames (or was killed there),
    the previous version where that save moved it (read without touching anything: the writer, or the next
    write, completes or recovers the swap)."""
    directory = Path(directory)
    if not directory.is_dir() and directory.parent.is_dir():
        olds = sorted(directory.parent.glob(f".{glob.escape(directory.name)}.old-*"), key=lambda p: p.stat().st_mtime)
        if olds:
            return olds[-1]
    return directory


def load_checkpoint(
    directory: str | os.PathLike, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> CloverForCausalLM:
    """Load a Clover checkpoint directory. dtype: float32 / bfloat16 / float16 / None (as stored)."""
    directory = checkpoint_directory(directory)
    if not directory.is_dir():
        if directory == DEFAULT_MODEL_DIR:
            raise CheckpointError(
                f"the shipped model is not in this checkout ({directory}); build it with `make model` or pass "
                "--model DIR (a random-weight one: `clover init DIR --preset tiny`)"
            )
        if directory.exists():
            raise CheckpointError(f"{directory} is a file, not a checkpoint directory")
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    try:
        config = CloverConfig.load(directory)
    except (ConfigError, FileNotFoundError) as exc:
        raise CheckpointError(f"{directory}: {exc}") from exc
    _check_headers(config, tensor_headers(directory), str(directory))
    tensors = dict(iter_tensors(directory))
    return build_model(config, tensors, str(directory), resolve_dtype(dtype), device)


# -- conversion from transformers ----------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def sanitize_transformers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a transformers Qwen3.5-MoE state dict (text or multimodal, packed or per-expert experts)
    onto Clover names; drops the vision tower and multi-token-prediction heads."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith(("mtp.", "model.visual.", "visual.")):
            continue
        name = name.replace("model.language_model.", "model.")
        m = _PER_EXPERT.match(name)
        if m:
            per_expert.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
            continue
        out[name] = t
    prefixes = sorted({p for p, _ in per_expert})
    for prefix in prefixes:
        gate, up, down = (per_expert.get((prefix, k), {}) for k in ("gate_proj", "up_proj", "down_proj"))
        n = len(gate)
        if not (len(up) == len(down) == n and sorted(gate) == list(range(n))):
            raise CheckpointError(f"{prefix}: incomplete per-expert tensors")
        try:
            out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]], dim=0) for e in range(n)])
            out[f"{prefix}.down_proj"] = torch.stack([down[e] for e in range(n)])
        except RuntimeError as exc:   # experts of different shapes
            raise CheckpointError(f"{prefix}: the per-expert tensors differ in shape: {exc}") from None
    return out


def convert_transformers_checkpoint(
    source: str | os.PathLike, target: str | os.PathLike, dtype: str | torch.dtype | None = None,
    block_size: int | None = None, mask_token_id: int | None = None, keep_mask_row: bool = False,
) -> CloverConfig:
    """Turn a transformers `Qwen3_5MoeForCausalLM` (or multimodal) checkpoint into a Clover one.

    Backbone tensors are kept exactly; the Clover GDN extras start at their neutral init, which
    leaves causal mode unchanged; the mask token's embedding row is set to the mean embedding (an AR
    model never trained it), unless `keep_mask_row` (a source already trained for block diffusion).
    """
    source = Path(source)
    cfg_path = source / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.json in {source}")
    try:
        data = read_json(cfg_path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")
    if block_size is not None:
        data["block_size"] = block_size
    own = None   # the mask token of a tokenizer with Clover's (an exported Clover checkpoint)
    if (source / "tokenizer.json").is_file():
        try:
            own = Tokenizer.load(source).mask_token_id
        except TokenizerError:
            pass
    if own is not None and mask_token_id is not None and mask_token_id != own:
        raise CheckpointError(f"--mask-token-id {mask_token_id}: {source}'s tokenizer has its own mask token ({own}); "
                              "another id would mask with an ordinary token")
    if mask_token_id is None and "mask_token_id" not in data:
        mask_token_id = own   # that token, not the last row
    if mask_token_id is not None:
        data["mask_token_id"] = mask_token_id
    config = CloverConfig.from_dict(data)
    tensors = sanitize_transformers(dict(iter_tensors(source)))
    with torch.device("meta"):
        shapes = CloverForCausalLM(config).state_dict()
    for name, meta in shapes.items():
        if name.rsplit(".", 1)[-1] in CLOVER_EXTRAS and name not in tensors:
            tensors[name] = _neutral(name, meta.shape, config)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    emb = tensors.get("model.embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(f"{source}: model.embed_tokens.weight is {tuple(emb.shape)}, config.json says "
                              f"({config.vocab_size}, {config.hidden_size})")
    if emb is not None and not keep_mask_row:
        emb = emb.clone()
        emb[config.mask_token_id] = emb.float().mean(0).to(emb.dtype)
        tensors["model.embed_tokens.weight"] = emb
    model = build_model(config, tensors, str(source), resolve_dtype(dtype))
    extra = {}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            extra[name] = (source / name).read_bytes()
    if "tokenizer.json" in extra and own is None:
        extra.update(_with_mask_token(extra, config, source))
    save_checkpoint(model, target, extra_files=extra)
    return config


def _with_context(tokenizer_config: str | bytes, context: int) -> str | bytes:
    """tokenizer_config.json with the model's context as `model_max_length` where it states one (transformers
    warns past it; `Tokenizer.files` cannot know the model's), else as given."""
    try:
        data = json.loads(tokenizer_config)
    except (ValueError, RecursionError):
        return tokenizer_config
    if not isinstance(data, dict) or "model_max_length" not in data or data["model_max_length"] == context:
        return tokenizer_config
    return json.dumps({**data, "model_max_length": context}, indent=2, ensure_ascii=False)


def _with_mask_token(files: dict[str, bytes], config: CloverConfig, source: Path) -> dict[str, bytes]:
    """A source tokenizer without Clover's mask token (a Qwen one) gets it, at the config's mask_token_id, in
    tokenizer.json and tokenizer_config.json's added_tokens_decoder (found by a hostile pass: the conversion
    succeeded and every command then refused the checkpoint: "tokenizer lacks the special token(s) ['<|mask|>']").
    Refused where that id is one of the tokenizer's tokens (the mask would be ordinary text, or its end of turn),
    or where the tokenizer lacks other tokens of Clover's chat format."""
    try:
        data = json.loads(files["tokenizer.json"])
        added = data.setdefault("added_tokens", [])
        vocab = data.get("model", {}).get("vocab") or {}
        # (a BPE or WordPiece vocabulary maps tokens to ids; a Unigram one lists [token, score] pairs by id)
        used = dict(enumerate(e[0] for e in vocab)) if isinstance(vocab, list) else {i: t for t, i in vocab.items()}
        used.update({int(t["id"]): t["content"] for t in added})
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{source}/tokenizer.json is not a tokenizer file transformers writes: {exc}") from None
    contents = set(used.values())
    missing = [t for t in SPECIAL_TOKENS if t != MASK_TOKEN and t not in contents]
    if missing:
        raise CheckpointError(f"{source}'s tokenizer lacks {missing} of Clover's chat format; convert a checkpoint "
                              "whose tokenizer has them (Qwen3.5's has)")
    mask = config.mask_token_id
    if mask in used:
        raise CheckpointError(f"{source}'s tokenizer has no {MASK_TOKEN} token, and the mask token id {mask} is its "
                              f"token {used[mask]!r}: give --mask-token-id a row no token uses (the tokenizer has "
                              f"{len(used)} tokens, the model {config.vocab_size} rows)")
    if isinstance(vocab, list) and mask != len(vocab):   # (a list places a token at its index only)
        raise CheckpointError(f"{source}'s tokenizer has no {MASK_TOKEN} token and lists its vocabulary (Unigram): "
                              f"the mask token can only take the next row, {len(vocab)}; give --mask-token-id {len(vocab)}")
    entry = {"content": MASK_TOKEN, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
    added.append({"id": mask, **entry})
    # the model's vocabulary holds it too: tokenizers gives an added token that its model lacks the next free id,
    # whatever id the file says
    if isinstance(vocab, list):
        vocab.append([MASK_TOKEN, 0.0])
    else:
        vocab[MASK_TOKEN] = mask
    data["model"]["vocab"] = vocab
    out = {"tokenizer.json": json.dumps(data, ensure_ascii=False).encode()}
    if "tokenizer_config.json" in files:
        try:
            cfg = json.loads(files["tokenizer_config.json"])
        except ValueError:
            cfg = None
        if isinstance(cfg, dict):
            if isinstance(cfg.get("added_tokens_decoder"), dict):
                cfg["added_tokens_decoder"][str(mask)] = entry
            cfg.setdefault("mask_token", MASK_TOKEN)
            out["tokenizer_config.json"] = json.dumps(cfg, indent=2, ensure_ascii=False).encode()   # (as `files`)
    return out


def export_causal(source: str | os.PathLike, target: str | os.PathLike, dtype: str | torch.dtype | None = None) -> int:
    """Write the causal (AR) model of a Clover checkpoint as a plain transformers `Qwen3_5MoeForCausalLM`
    checkpoint: the backbone tensors only (the block-diffusion extension is left out), a Qwen3.5-MoE
    text config, and the tokenizer, chat template and generation files. Returns the tensor count."""
    source = Path(source)
    model = load_checkpoint(source, dtype=dtype if dtype is not None else "auto")
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("block_size", "mask_token_id")}
    config.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()
               if name.rsplit(".", 1)[-1] not in CLOVER_EXTRAS
               and not (name == "lm_head.weight" and model.config.tie_word_embeddings)}

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_weights(tensors, tmp, DEFAULT_SHARD_BYTES)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)

    write_directory(target, fill)
    return len(tensors)


def _neutral(name: str, shape: torch.Size, config: CloverConfig) -> torch.Tensor:
    if name.endswith("preview_log_scale"):
        return torch.full(tuple(shape), math.log(math.sqrt(config.linear_key_head_dim)))
    return torch.zeros(tuple(shape))


@dataclass
class Loaded:
    model: CloverForCausalLM
    tokenizer: Tokenizer
    generation: GenerationConfig
    directory: Path   # where it was loaded from (the shipped model's, or $CLOVER_MODEL's, when none was named)


def load_for_generation(model_dir: str | None, dtype: str = "auto", device: str = "cpu") -> Loaded:
    """A checkpoint ready to decode: the model, its tokenizer and its generation defaults."""
    if model_dir is not None and not model_dir.strip():   # e.g. `--model "$UNSET"`: not the shipped model
        raise ValueError("the model directory is empty; give a checkpoint directory, or leave the option out "
                         "for the shipped model")
    # (where a save is between its renames, the model, its tokenizer and its settings all come from the copy read)
    directory = checkpoint_directory(Path(model_dir) if model_dir else default_model_dir())
    model = load_checkpoint(directory, dtype=dtype, device=device)
    tokenizer = Tokenizer.load(directory)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"{directory}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size}")
    # the model and its tokenizer agree on the special tokens (else decoding masks, stops at, or never stops at
    # ordinary text: config.json's mask id 511 was the token "col" of one a hostile pass edited)
    if model.config.mask_token_id != tokenizer.mask_token_id:
        raise CheckpointError(f"{directory}: config.json mask_token_id {model.config.mask_token_id} is not the "
                              f"tokenizer's mask token ({tokenizer.mask_token_id}); convert the source again, or set "
                              "mask_token_id in config.json to the tokenizer's")
    if not model.config.eos_token_ids and tokenizer.eos_token_ids:   # (a reply would never end)
        raise CheckpointError(f"{directory}: config.json has no eos_token_id; the tokenizer's end-of-sequence "
                              f"tokens are {tokenizer.eos_token_ids}")
    ordinary = [t for t in model.config.eos_token_ids if t not in tokenizer.special_ids.values()]
    if ordinary:
        raise CheckpointError(f"{directory}: config.json eos_token_id holds {ordinary}, not special tokens of the "
                              f"tokenizer (its end-of-sequence tokens are {tokenizer.eos_token_ids})")
    settings = load_generation_config(directory)
    try:
        generation = GenerationConfig.from_dict(settings)
    except ConfigError as exc:
        raise CheckpointError(f"{directory / 'generation_config.json'}: {exc}") from None
    ids = lambda v: sorted(map(str, v)) if isinstance(v, list) else [str(v)]  # noqa: E731
    for key, mine in (("eos_token_id", model.config.eos_token_ids), ("mask_token_id", model.config.mask_token_id)):
        theirs = settings.get(key)   # (decoding reads config.json's: say so where the two disagree)
        if theirs is not None and ids(theirs) != ids(mine):
            logger.warning("%s: generation_config.json's %s %s differs from config.json's %s, which is used",
                           directory, key, theirs, mine)
    return Loaded(model, tokenizer, generation, directory)
