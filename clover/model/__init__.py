"""The model layer: everything needed to run one forward pass and to read or write a checkpoint.

It owns the configuration (`config`, including the typed `GenerationConfig` that holds every decoding
default), the kernels (`gdn`: Gated DeltaNet recurrences, `moe`: the sparse expert layer), the per-sequence
caches (`cache`), the network and its forward modes (`modeling`), checkpoints and conversion
(`checkpoint`), writes a kill cannot leave half done (`files`), the invariant checks behind
`clover check` (`checks`), the tokenizer and the chat format (`tokenizer`, `chat`). It imports nothing
else of Clover.
"""
