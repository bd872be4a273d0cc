"""The `keepwarm` command line (typer): ``main`` (the app and its small commands), ``serve_cmd``, ``daemon_cmds``,
``snapshot_cmds``, the one error shape (``errors``) and the benches (``bench*``, with ``peer_vllm`` for the vLLM
peer and ``heldout`` for the quality set).

The top layer: it may import every keepwarm package and nothing imports it. Heavy modules (torch, transformers) are
imported inside the commands that need them, so `keepwarm --help` and `keepwarm status` start fast.
"""
