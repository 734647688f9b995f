"""Model configuration: one dataclass, named presets, `config.json` round trip.

Field names are those of transformers' `Qwen3_5MoeTextConfig`, so a Qwen3.5/3.6-MoE text
`config.json` loads as it is; Clover adds `model_type` "clover_moe", `block_size` and
`mask_token_id` (spec sections 2, 3 and 7).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from clover.model.files import read_json, write_text_atomic

log = logging.getLogger(__name__)

LAYER_TYPES = ("linear_attention", "full_attention")
MODEL_TYPE = "clover_moe"
# Keys a transformers `config.json` carries that describe the file, not the model.
_IGNORED_KEYS = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "output_hidden_states",
    "output_attentions", "return_dict", "output_router_logits", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "_name_or_path", "full_attention_interval", "auto_map",
}
# Upper bounds far above any real model (Clover-35B-A3B: 248,320 vocabulary, 40 layers, 131,072
# positions, 256 experts): a config beyond them is a mistake or an attack, refused before allocation.
SANITY_MAX = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_hidden_layers": 1024, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "head_dim": 4096, "max_position_embeddings": 1 << 24, "linear_conv_kernel_dim": 64,
    "linear_key_head_dim": 4096, "linear_value_head_dim": 4096, "linear_num_key_heads": 1024,
    "linear_num_value_heads": 1024, "moe_intermediate_size": 1 << 18, "shared_expert_intermediate_size": 1 << 18,
    "num_experts_per_tok": 1024, "num_experts": 4096, "block_size": 1024,
}

# What transformers reads to load a Clover checkpoint (`trust_remote_code=True`): the classes of the two
# files `clover.model.remote_code` puts next to config.json.
TRANSFORMERS_FIELDS = {
    "architectures": ["CloverForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_clover.CloverConfig",
                 "AutoModelForCausalLM": "modeling_clover.CloverForCausalLM"},
}


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent with the others."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


LAYOUT_LETTERS = {"L": "linear_attention", "F": "full_attention"}   # a layout: one letter per layer, e.g. LLLF


def layer_types_of(layout: str) -> list[str]:
    """The layer types a layout names, one letter per layer: L Gated DeltaNet, F full attention (LFLF)."""
    if not layout or set(layout) - set(LAYOUT_LETTERS):
        raise ValueError(f"layout {layout!r}: one letter per layer, L (Gated DeltaNet) or F (full attention)")
    return [LAYOUT_LETTERS[c] for c in layout]


def default_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Every `interval`-th layer (index % interval == interval - 1) is full attention, the rest GDN."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


@dataclass
class CloverConfig:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    )
    attention_bias: bool = False
    attention_dropout: float = 0.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    router_aux_loss_coef: float = 0.001
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Clover extensions
    model_type: str = MODEL_TYPE
    block_size: int = 32
    mask_token_id: int = 248319

    def __post_init__(self) -> None:
        self._check_types()
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        self.validate()

    # -- derived sizes ------------------------------------------------------------------------------
    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10_000.0))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.rope_parameters.get("partial_rotary_factor", 1.0)))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    # -- validation ---------------------------------------------------------------------------------
    def _check_types(self) -> None:
        """Each field holds a value of its kind (a config.json or --override of the wrong shape is named here,
        not met later as a TypeError deep in the model)."""
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
            "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "block_size",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
            if value > SANITY_MAX[name]:   # checked before anything is allocated
                raise ConfigError(f"{name} = {value} is beyond any model this code runs (at most {SANITY_MAX[name]})")
        for name in ("initializer_range", "rms_norm_eps", "attention_dropout", "router_aux_loss_coef"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.rope_parameters, dict):
            raise ConfigError(f"rope_parameters must be an object, got {self.rope_parameters!r}")
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in self.rope_parameters and not _is_number(self.rope_parameters[key]):
                raise ConfigError(f"rope_parameters.{key} must be a finite number, got {self.rope_parameters[key]!r}")
        if self.layer_types is not None and (not isinstance(self.layer_types, list)
                                             or not all(isinstance(t, str) for t in self.layer_types)):
            raise ConfigError(f"layer_types must be a list of layer type names, got {self.layer_types!r}")
        if not _is_int(self.mask_token_id):
            raise ConfigError(f"mask_token_id must be an integer, got {self.mask_token_id!r}")
        eos = self.eos_token_id
        if not (eos is None or _is_int(eos) or (isinstance(eos, list) and all(_is_int(t) for t in eos))):
            raise ConfigError(f"eos_token_id must be an integer, a list of integers or null, got {eos!r}")
        for name in ("pad_token_id", "bos_token_id"):
            if getattr(self, name) is not None and not _is_int(getattr(self, name)):
                raise ConfigError(f"{name} must be an integer or null, got {getattr(self, name)!r}")

    def validate(self) -> None:
        """Raise `ConfigError` naming the first inconsistent value."""
        self._check_types()
        if self.model_type != MODEL_TYPE:
            raise ConfigError(f"model_type must be {MODEL_TYPE!r}, got {self.model_type!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu' (the Qwen3.5-MoE activation), got {self.hidden_act!r}")
        if self.max_position_embeddings < self.block_size:   # (`clover check` failed on an empty input)
            raise ConfigError(f"max_position_embeddings ({self.max_position_embeddings}) must be at least block_size "
                              f"({self.block_size}): a block must fit in the context")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) cannot exceed num_experts ({self.num_experts})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if unknown:
            raise ConfigError(f"unknown layer type(s) {unknown}; expected one of {list(LAYER_TYPES)}")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is implemented")
        factor = float(self.rope_parameters.get("partial_rotary_factor", 1.0))
        if not 0.0 < factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(
                f"head_dim * partial_rotary_factor = {self.head_dim} * {factor} must be an even integer >= 2"
            )
        if not 1.0 <= self.rope_theta <= 1e12:   # (1e-300 loaded, and failed at decode time blaming the weights)
            raise ConfigError(f"rope_theta must be in [1, 1e12], got {self.rope_theta}")
        if self.attention_bias:
            raise ConfigError("attention_bias=True is not supported (Qwen3.5-MoE has no attention bias)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        for tok in self.eos_token_ids + [t for t in (self.pad_token_id, self.bos_token_id) if t is not None]:
            if not 0 <= tok < self.vocab_size:
                raise ConfigError(f"special token id {tok} is outside the vocabulary [0, {self.vocab_size})")
        if self.mask_token_id in self.eos_token_ids:
            raise ConfigError(f"mask_token_id {self.mask_token_id} must differ from the end-of-sequence ids")
        if not 0 < self.rms_norm_eps < 1:   # (1e300 loaded, and every reply was empty)
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.attention_dropout >= 1:
            raise ConfigError(f"attention_dropout must be in [0, 1), got {self.attention_dropout}")

    # -- serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CloverConfig:
        """Build from a Clover or transformers Qwen3.5-MoE (text or multimodal) config dict."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        if "text_config" in data:  # a Qwen3_5MoeConfig: the language model lives in text_config
            if not isinstance(data["text_config"], dict):
                raise ConfigError(f"text_config must be an object, got {type(data['text_config']).__name__}")
            top = data
            data = dict(data["text_config"])
            # transformers keeps a multimodal model's tying at the top (its language model's head ties too)
            if "tie_word_embeddings" in top and "tie_word_embeddings" not in data:
                data["tie_word_embeddings"] = top["tie_word_embeddings"]
        model_type = data.pop("model_type", MODEL_TYPE)
        if model_type not in (MODEL_TYPE, "qwen3_5_moe_text", "qwen3_5_moe"):
            raise ConfigError(f"model_type {model_type!r} is neither Clover ({MODEL_TYPE!r}) nor Qwen3.5-MoE")
        rope = data.pop("rope_parameters", None) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters must be an object, got {rope!r:.80}")
        rope = dict(rope)
        for legacy in ("rope_theta", "partial_rotary_factor", "rope_type"):  # older flat layout
            if legacy in data:
                rope.setdefault(legacy, data.pop(legacy))
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10_000.0)
        rope.setdefault("partial_rotary_factor", 0.25)
        names = {f.name for f in dataclasses.fields(cls)}
        interval = data.get("full_attention_interval")
        if interval is not None and (not _is_int(interval) or interval < 1):
            raise ConfigError(f"full_attention_interval must be a positive integer, got {interval!r}")
        kwargs: dict[str, Any] = {"rope_parameters": rope}
        ignored = []
        for key, value in data.items():
            if key in names:
                kwargs[key] = value
            elif key not in _IGNORED_KEYS:
                ignored.append(key)
        if ignored:
            log.warning("config keys not used by Clover, ignored: %s", ", ".join(sorted(ignored)))
        layers, vocab = kwargs.get("num_hidden_layers", 40), kwargs.get("vocab_size", cls.vocab_size)
        if kwargs.get("layer_types") is None and interval and _is_int(layers):   # (else validation names it)
            kwargs["layer_types"] = default_layer_types(layers, interval)
        if "mask_token_id" not in kwargs and _is_int(vocab):   # a plain Qwen checkpoint: the last row is the mask
            kwargs["mask_token_id"] = vocab - 1
        try:
            return cls(**kwargs)
        except TypeError as exc:  # wrong value types surface here
            raise ConfigError(str(exc)) from exc

    def save(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        write_text_atomic(os.path.join(directory, "config.json"),
                          json.dumps({**self.to_dict(), **TRANSFORMERS_FIELDS}, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CloverConfig:
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {directory}")
        try:
            data = read_json(path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls.from_dict(data)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> CloverConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}")
        return cls(**{**PRESETS[name], **overrides})

    def num_parameters(self) -> tuple[int, int]:
        """(total, active per token) parameter counts, computed from the shapes."""
        d, v = self.hidden_size, self.vocab_size
        attn = d * self.num_attention_heads * self.head_dim * 2 + 2 * d * self.num_key_value_heads * self.head_dim
        attn += self.num_attention_heads * self.head_dim * d + 2 * self.head_dim
        k = self.linear_conv_kernel_dim
        hv = self.linear_num_value_heads
        gdn = d * self.linear_conv_dim + d * self.linear_value_dim + 2 * d * hv + self.linear_conv_dim * k
        gdn += self.linear_conv_dim * (k - 1) + 4 * hv + self.linear_value_head_dim + self.linear_value_dim * d
        expert = 3 * d * self.moe_intermediate_size
        shared = 3 * d * self.shared_expert_intermediate_size + d
        router = self.num_experts * d
        total = active = v * d * (1 if self.tie_word_embeddings else 2) + d
        for t in self.layer_types:
            mixer = attn if t == "full_attention" else gdn
            base = mixer + shared + router + 2 * d
            total += base + self.num_experts * expert
            active += base + self.num_experts_per_tok * expert
        return total, active


PRESETS: dict[str, dict[str, Any]] = {
    # Tests: every mode in milliseconds. 4 layers = 3 GDN + 1 attention.
    "debug": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=1024, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, block_size=8,
        mask_token_id=511, eos_token_id=510, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                             "partial_rotary_factor": 0.25},
    ),
    # The releases of clover-tiny before 2026-12-02: 13.4M total / 8.7M active parameters.
    "tiny": dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=4096, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, block_size=32,
        mask_token_id=8191, eos_token_id=8190, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                               "partial_rotary_factor": 0.25},
    ),
    # A mid-size shape for CPU benchmarks (about 150M total parameters).
    "small": dict(
        vocab_size=32000, hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=8192, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_experts=32, num_experts_per_tok=4, block_size=32,
        mask_token_id=31999, eos_token_id=31998, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                                                 "partial_rotary_factor": 0.25},
    ),
    # Clover-35B-A3B-Preview (spec section 2). The mask id is our choice: the last vocabulary row.
    "clover-35b-a3b": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, max_position_embeddings=131072, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, block_size=32,
        mask_token_id=248319,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    ),
}

# `tiny`'s parameter count spent wider and shallower (hidden 384, 4 layers = 3 GDN + 1 attention): the winner of
# the shape sweep per CPU-minute (benchmarks/sweep.py "wide-shallow"; model card), ~13M total / 10M active;
# the shipped clover-tiny's shape since 2026-12-02.
PRESETS["tiny-wide"] = {**PRESETS["tiny"], "hidden_size": 384, "num_hidden_layers": 4}


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding defaults (`generation_config.json` of a checkpoint): the one place they are written.

    `SamplingParams` takes its defaults from here; the CLI, the server, evaluations and benchmarks
    override fields per request and never restate them. Block size None means the model's.
    """

    algorithm: str = "low_confidence"
    block_size: int | None = None
    threshold: float = 0.95
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationConfig:
        """The decoding fields of a generation_config.json (other keys, such as eos ids, are left out). transformers'
        `do_sample` is read as transformers reads it: false decodes greedily (temperature 0, whatever temperature
        the file gives: a file transformers saved may hold one), true samples at the file's temperature, else
        transformers' 1.0. A field the file leaves out takes Clover's default (top_k: off)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in data.items() if k in names}
        sample = data.get("do_sample")
        if sample is not None and not isinstance(sample, bool):
            raise ConfigError(f"do_sample must be true or false, got {sample!r}")
        if sample is False:
            kept["temperature"] = 0.0
        elif sample is True and "temperature" not in kept:
            kept["temperature"] = 1.0
        for name, value in kept.items():   # kinds only here; ranges are checked per request (SamplingParams)
            whole = _is_number(value) and float(value).is_integer()   # (20.0 is 20)
            kind_ok = {"algorithm": isinstance(value, str), "block_size": value is None or whole,
                       "top_k": whole}.get(name, _is_number(value))
            if not kind_ok:
                want = {"algorithm": "a string", "block_size": "an integer or null", "top_k": "an integer"}
                raise ConfigError(f"{name} must be {want.get(name, 'a finite number')}, got {value!r}")
        for name in ("block_size", "top_k"):
            if kept.get(name) is not None:
                kept[name] = int(kept[name])
        return cls(**kept)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_file(self) -> dict[str, Any]:
        """The fields generation_config.json holds, spelled as transformers reads them too: `do_sample` for whether
        the default samples; greedy, no temperature 0 or top_k 0 (its generate() refused a temperature of 0 once a
        user asked it to sample; a top_k it ignores when greedy drew a warning at every load): left out, they are
        Clover's defaults again when read (`from_dict`). Sampling keeps top_k 0 (off: transformers' own default
        would be 50)."""
        out = {"do_sample": self.temperature > 0, **self.to_dict()}
        if not out["do_sample"]:
            del out["temperature"]
            if out["top_k"] == 0:
                del out["top_k"]
        return out

    @staticmethod
    def resolve_block_size(requested: int | None, model: CloverConfig) -> int:
        """The block size a request decodes with: its own, else the model's (None means the model's
        here and in generation_config.json). The one place this is decided."""
        return requested or model.block_size

    def merged(self, **overrides: Any) -> dict[str, Any]:
        """These defaults with every override that is not None applied (a request's explicit settings)."""
        return {**self.to_dict(), **{k: v for k, v in overrides.items() if v is not None}}
