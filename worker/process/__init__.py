"""The process side of `keepwarm serve`: the processes a server is, never the model or the API they run.

Owns: the server's configuration (``config``: ``ServerConfig``, ``vllm_flags``: vLLM's flags), the listening socket
(``listen``), the messages between the processes (``ipc``), the supervisor (``supervisor``, with ``children``: its
zygotes and workers, ``handoff``: a restart's steps, ``standby``: the worker kept warm), the zygote's fork loop
(``zygote``), a worker's end of its status socket (``link``) and a serving worker's drain, handoff and fatal exit
(``lifecycle``).
May import: the standard library, keepwarm.formats (paths, the wire codec ``ipc``'s frames are), uvicorn where a
serving worker runs it; never torch, directly or through another module (an import-linter contract), so the
supervisor starts in a fraction of a second and stays small. What needs torch (the tokenizer a zygote preloads,
its probe, the server a forked child runs, the prefix-cache export and adoption) comes in as callables from
keepwarm.worker.zygote and keepwarm.worker.serve.
"""
