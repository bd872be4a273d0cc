"""The HTTP front of `keepwarm serve`: the OpenAI-compatible API over the engine.

Owns: the FastAPI app (``app``: auth, OpenAI-shaped errors, the handoff's ``Connection: close``), the routers by
resource (``routes/``), the pipeline every front end runs a request through (``pipeline``), the connection limits
and admission (``limits``), what one request may cost (``budget``), the Prometheus metrics (``metrics``), the
published schema (``openapi``) and what the front ends share (``state``).
May import: keepwarm.worker.openai (what requests and answers mean), keepwarm.worker.process (the config, a
worker's link), the engine through keepwarm.worker.async_engine and its value types, fastapi, starlette,
prometheus_client. Never imported by keepwarm.worker.openai or keepwarm.worker.process (import-linter's layers).
"""
