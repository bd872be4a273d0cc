"""Model code: the architectures the worker runs (``llama``, ``gemma``, ``moe``), their shared layers (``layers``),
the architecture registry (``registry``: config.json's ``architectures`` -> a class, unknown ones refused by name),
and the random models the tests and benches build (``random_model``).

May import: keepwarm.kernels (every op goes through its dispatch point) and keepwarm.formats; never the engine or the
front ends.
"""
