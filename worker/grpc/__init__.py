"""The gRPC front of `keepwarm serve --grpc` (service ``keepwarm.v1.Keepwarm``, ``keepwarm.proto``).

Owns: the server (``server``) and the code `make proto` generates from ``keepwarm.proto`` (``grpc_gen/``,
committed). A room beside keepwarm.worker.http rather than inside it: a second front end, whose requests go through
the HTTP front's pipeline, state and limits (so every limit is defined once), and whose wire is protobuf, not HTTP.
May import: keepwarm.worker.http (pipeline, state, limits), keepwarm.worker.openai (the request model it validates
with), grpcio and protobuf; nothing imports it but keepwarm.worker.serve, which starts it with ``--grpc``.
"""
