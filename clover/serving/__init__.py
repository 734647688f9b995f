"""The serving layer: an OpenAI-compatible HTTP server over the engine.

It owns the thread that runs the engine for asyncio callers (`async_engine`), the request and response
schemas (`protocol`), turning chat requests into prompts (`prompts`: messages, tools, tool_choice,
thinking), the Prometheus metrics (`metrics`), the HTTP routes (`app`) and an in-process server for
evaluation (`local`). It imports the model and engine layers.
"""
