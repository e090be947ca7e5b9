"""``tickloom serve``: an OpenAI-compatible HTTP server over the embedded engine (Starlette on hypercorn's trio
worker, in the engine's own trio run).

Modules: ``openai_types`` (the wire schema, validated by msgspec), ``translate`` (schema <-> engine), ``chunks``
(answers built from frames), ``sse`` (event streams that watch for the client leaving), ``metrics``
(Prometheus), ``app`` (the routes), ``server`` (hypercorn, signals and drain).
"""
