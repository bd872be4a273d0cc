"""Model code: the architectures the worker runs (``llama``, ``gemma``, ``moe``), their shared layers (``layers``),
the architecture registry (``registry``: config.json's ``architectures`` -> a class, unknown ones refused by name),
the random models the tests and benches build (``random_model``), and the native decode step (``native_step``: a
decode-only CPU step's Llama layers in one C call).

May import: keepwarm.kernels (every op goes through its dispatch point) and keepwarm.formats; never the engine or the
front ends.
"""
