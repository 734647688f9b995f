"""Clover's model for transformers (`trust_remote_code`): the causal mode, which is exactly transformers'
`Qwen3_5MoeForCausalLM` on the backbone weights. The block-diffusion extension tensors of each Gated DeltaNet
layer (`conv_right`, `preview_log_scale`, `history_bias`) serve only Clover's preview mode: they are held as
buffers that the forward does not use (not parameters: a fine-tune leaves them as they are, and data-parallel
training finds no parameter without a gradient), saved with the weights, so that `save_pretrained` writes them
back and Clover loads the result whole. Copied into Clover checkpoints; imports torch and transformers only."""

import math

import torch
from torch import nn
from transformers import Qwen3_5MoeForCausalLM

from .configuration_clover import CloverConfig


class CloverForCausalLM(Qwen3_5MoeForCausalLM):
    config_class = CloverConfig

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is None:
                continue
            channels, _, width = gdn.conv1d.weight.shape
            heads = config.linear_num_value_heads
            gdn.register_buffer("conv_right", torch.empty(channels, width - 1))
            gdn.register_buffer("preview_log_scale", torch.empty(heads))
            gdn.register_buffer("history_bias", torch.empty(heads))
            self._neutral(gdn)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(getattr(module, "conv_right", None), torch.Tensor):
            self._neutral(module)

    @torch.no_grad()
    def _neutral(self, gdn: nn.Module) -> None:
        """Clover's neutral values of the extension (where a checkpoint holds none: no effect on preview mode)."""
        gdn.conv_right.zero_()
        gdn.preview_log_scale.fill_(math.log(math.sqrt(self.config.linear_key_head_dim)))
        gdn.history_bias.zero_()
