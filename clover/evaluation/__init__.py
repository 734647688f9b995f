"""The evaluation layer: measures models from the outside, over HTTP.

It owns the agent harness (`harness`), its task suites (`suites`), the sandbox that runs model-written
code (`sandbox`), the streamed chat client shared by the harness and the serving benchmark (`client`)
and that benchmark (`bench`). It never imports a model: it talks to any OpenAI-compatible endpoint,
`clover serve` or the in-process one of `clover.serving.local`. It may use the task generators of the
training layer, and the model layer's atomic writes (`clover.model.files`, standard library only).
"""
