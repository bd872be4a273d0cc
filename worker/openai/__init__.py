"""OpenAI's API semantics, whatever front end carries them.

Owns: the request and response shapes and their validation (``protocol``), a chat completion's answer as typed
objects (``chat_output``), chat messages through the model's template (``chat_render``), tool calls (``tool_calls``),
the structured-output fields (``structured_fields``) and the Responses API over chat (``responses``).
May import: pydantic and the engine's value types (keepwarm.worker.sampling_params, keepwarm.worker.structured);
never the HTTP front, the process side or a web framework: keepwarm.worker.http and keepwarm.worker.grpc import it
(import-linter's layers).
"""
