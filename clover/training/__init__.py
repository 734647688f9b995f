"""The training layer: data, objectives and the trainer that make a Clover model.

It owns corpus building and token files (`data`), the synthetic task generators (`synthetic`,
`agent_data`), the losses of each training stage (`objectives`), the resumable trainer (`trainer`),
self-distillation data (`distill`) and the held-out scores of a checkpoint used by its model card
(`scores`: bits per byte, continuation match). It imports the model and engine layers.
"""
