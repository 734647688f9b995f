"""Clover's model for transformers (`trust_remote_code`): the causal mode, which is exactly transformers'
`Qwen3_5MoeForCausalLM` on the backbone weights. The block-diffusion extension tensors (`conv_right`,
`preview_log_scale`, `history_bias`) serve only Clover's preview mode and are not loaded. Copied into
Clover checkpoints; imports transformers only."""

from transformers import Qwen3_5MoeForCausalLM

from .configuration_clover import CloverConfig


class CloverForCausalLM(Qwen3_5MoeForCausalLM):
    config_class = CloverConfig
    _keys_to_ignore_on_load_unexpected = [r"\.conv_right$", r"\.preview_log_scale$", r"\.history_bias$"]
