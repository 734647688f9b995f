"""Clover's configuration for transformers (`trust_remote_code`): Qwen3.5-MoE's text configuration plus
the block size and the mask token of block diffusion. Copied into Clover checkpoints; imports
transformers only."""

from transformers import Qwen3_5MoeTextConfig


class CloverConfig(Qwen3_5MoeTextConfig):
    model_type = "clover_moe"

    def __init__(self, block_size: int = 32, mask_token_id: int | None = None, **kwargs) -> None:  # noqa: ANN003
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)
