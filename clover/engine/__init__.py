"""The engine layer: turns prompts into generated tokens with a model.

It owns sampling (`sampling`: parameters, token picking, speculative acceptance), per-sequence state and
results (`sequence`), the decoding algorithms as policies (`policies`: ar, low_confidence, verify), the
cross-request prefix cache (`prefix_cache`), the continuous-batching loop (`engine`) and the step traces
(`trace`). It imports the model layer only: nothing of serving, training, evaluation or the command line.
"""
