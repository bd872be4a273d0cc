"""The HTTP API by resource: each module builds one FastAPI router over the shared ``ServerState``.

``completions`` and ``chat`` run generation through ``keepwarm.worker.http.pipeline``; ``models`` lists what can be
named in ``model``; ``adapters`` loads and unloads LoRA adapters at run time; ``admin`` is health, version,
metrics and the effective config; ``responses`` is the Responses API over ``chat``'s completion; ``tokenize`` is
/tokenize and /detokenize. ``keepwarm.worker.http.app`` puts them together with auth and error handling.
"""
