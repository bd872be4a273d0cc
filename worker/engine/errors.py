"""What the engine raises to its callers, and what each means to a front end: a request refused (HTTP 400), a
request that failed alone inside the engine (500), an engine that cannot go on (the server exits non-zero)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take (e.g. longer than ``max_model_len``); maps to an HTTP 400."""


class RequestFailed(RuntimeError):
    """A request the engine took failed inside it (an internal error tied to that request alone); maps to a 500."""


class EngineDeadError(RuntimeError):
    """The engine failed in a step shared by every request and cannot go on."""
