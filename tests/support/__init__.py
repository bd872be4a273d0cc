"""What the tests share: processes (servers, daemons, workers, a registry), waiting, free ports, tiny models built
once per session and cached on disk, and the transformers references the numerics are checked against.

Rules: a test module imports helpers from here (``from support.serve import ServeProcess``; tests/conftest.py puts
tests/ on sys.path), never from another test module; a wait is ``support.wait.wait_until``, never a hand-written
loop; processes, models and references are shared here, the claims about keepwarm stay in the tests.
"""
