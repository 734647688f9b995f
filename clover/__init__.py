"""Clover: a block-diffusion mixture-of-experts language model system.

The package is layered; each layer imports only the ones below it (tests/test_layers.py checks):

    cli         the `clover` command: wires the layers below to argv
    evaluation  agent harness, task suites, sandbox, serving benchmark: models only over HTTP
    serving     OpenAI-compatible HTTP app over the engine          training  data, objectives, trainer
    engine      continuous batching, decoding policies, sampling, prefix cache
    model       config, kernels (Gated DeltaNet, MoE), caches, the network, checkpoints, tokenizer, chat format
"""
