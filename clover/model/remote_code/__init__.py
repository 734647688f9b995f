"""transformers' side of a Clover checkpoint (`trust_remote_code`): these two files are copied into every
checkpoint directory, next to config.json's `auto_map`. They import transformers only (never Clover), so a
checkpoint loads in transformers (and PEFT, TRL, lm-eval's `hf` model) without Clover installed. They give
the causal (autoregressive) mode: the backbone is transformers' `Qwen3_5MoeForCausalLM`, and the tensors of
Clover's block-diffusion extension, which the causal mode does not use, are left out on load.
"""
