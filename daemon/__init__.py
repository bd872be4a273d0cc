"""The daemon process: keeps model weights resident and lends them to workers.

Owns: the socket server and its request loop (``server``), load jobs (``jobs``, ``loads``), what is resident and its
memory accounting (``residency``), the leases workers hold (``leases``), LoRA adapters kept warm (``adapters``),
arena images for snapshots (``image``), and the interface other processes use: the typed messages (``protocol``, on
keepwarm.formats.wire) and the client (``client``), the only module the worker may import.
May import: keepwarm.weights (reading and building arenas), keepwarm.kernels, keepwarm.formats.
"""
