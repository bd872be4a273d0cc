"""Structured outputs by constrained decoding: a grammar per request, a token mask per sequence per step.

The engine is llguidance (chosen over xgrammar and outlines-core by `benchmarks/grammar_engines.py`; the figures
and the reasons are in docs/benchmarks.md). Rules:

- A request's constraint is a :class:`StructuredOutputs` (JSON schema, any JSON object, regex, choice or a Lark /
  GBNF grammar). :meth:`GrammarCompiler.compile` turns it into a :class:`CompiledGrammar`, validated (an invalid
  schema or grammar raises :class:`GrammarError`, a 400 naming the field) and kept in a bounded LRU cache keyed by
  the grammar text, so a repeated schema costs no compile.
- The compiled grammar travels in the request's ``SamplingParams.structured``; each sequence of the request gets
  its own :class:`GrammarMatcher` (``n > 1`` samples diverge). The sampler asks every constrained row for its mask
  and applies them all in one batched ``masked_fill``; free rows are untouched, so constrained and free requests
  share a batch.
- JSON is generated compactly with OpenAI's separators (``", "`` and ``": "``, no other whitespace), so a small
  model cannot wander into endless whitespace; a schema may override this with llguidance's ``x-guidance`` key.
- Objects are closed: a schema object with ``properties`` and no ``additionalProperties`` gets
  ``additionalProperties: false`` (xgrammar's strict mode, vLLM's default; OpenAI's strict schemas say so
  explicitly). Otherwise a small model fills the open object with invented keys until ``max_tokens``. A schema
  that sets ``additionalProperties`` keeps its choice.
- EOS is allowed only where the grammar accepts; once the grammar cannot take another token the engine ends the
  sequence (finish reason ``stop``) without sampling the EOS.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("keepwarm.structured")

DEFAULT_CACHE_SIZE = 128
KINDS = ("json", "json_object", "regex", "choice", "grammar")


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains", "additionalProperties",
               "unevaluatedProperties", "propertyNames")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects with ``properties`` but no ``additionalProperties`` are closed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(v) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarError(ValueError):
    """An invalid schema, regex, choice list or grammar; ``field`` names the request field (an HTTP 400)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StructuredOutputs:
    """One request's constraint: ``kind`` is one of KINDS; ``value`` its schema (a dict), regex, choices or grammar.

    ``field`` is the request field it came from (``response_format``, ``guided_json``, ``tool_choice``...), named
    in errors.
    """

    kind: str
    value: Any
    field: str = "structured_outputs"

    def grammar_text(self) -> str:
        """llguidance's grammar text for this constraint (pure: no tokenizer needed)."""
        import llguidance

        k, v = self.kind, self.value
        if k not in KINDS:
            raise GrammarError(f"unknown structured output kind {k!r} (choose one of {', '.join(KINDS)})", self.field)
        try:
            if k in ("json", "json_object"):
                schema = {"type": "object"} if k == "json_object" else v
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as e:
                        raise GrammarError(f"the JSON schema is not valid JSON: {e}", self.field) from None
                if not isinstance(schema, dict) and not isinstance(schema, bool):
                    raise GrammarError("a JSON schema must be an object", self.field)
                return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults={
                    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
            if k == "regex":
                if not isinstance(v, str) or not v:
                    raise GrammarError("a regex must be a non-empty string", self.field)
                return llguidance.LLMatcher.grammar_from_regex(v)
            if k == "choice":
                if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
                    raise GrammarError("choice must be a non-empty list of non-empty strings", self.field)
                # Lark string literals use JSON's escapes.
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in v))
            if not isinstance(v, str) or not v.strip():
                raise GrammarError("a grammar must be a non-empty string (Lark or GBNF)", self.field)
            if "::=" in v:  # GBNF (llama.cpp's, which vLLM's xgrammar backend takes)
                from llguidance.gbnf_to_lark import gbnf_to_lark

                v = gbnf_to_lark(v)
            return llguidance.LLMatcher.grammar_from_lark(v)
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:  # includes json.JSONDecodeError and llguidance's ValueError
            raise GrammarError(f"invalid {k}: {e}", self.field) from None


class GrammarMatcher:
    """One sequence's position in its grammar: fills its mask row, accepts the sampled token."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bits (bit ``t % 32`` of word ``t // 32``) into a contiguous int32 CPU row."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False (with the reason in :attr:`error`) if the grammar rejected it."""
        return self._m.consume_token(token)

    @property
    def is_stopped(self) -> bool:
        """True once the grammar can take no token but EOS: the output is complete."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()


class CompiledGrammar:
    """A validated grammar; :meth:`matcher` hands each sequence its own state (a cheap copy of a pristine one)."""

    def __init__(self, text: str, prototype: Any) -> None:
        self.text = text
        self._prototype = prototype

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` against one tokenizer, with a bounded LRU cache. Thread-safe.

    ``tokenizer_json`` is the Hugging Face ``tokenizers`` JSON of the served tokenizer; ``vocab_size`` the width of
    the model's logits (ids past the tokenizer's vocabulary are never allowed); ``eos_token_ids`` the ids that end
    a sequence (allowed where the grammar accepts). The tokenizer index llguidance builds from it (about a second
    for a 49k vocabulary) is built on first use and logged.
    """

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if not eos_token_ids:
            raise ValueError("constrained decoding needs at least one EOS token id")
        self._tokenizer_json = tokenizer_json  # or a function giving it: serialized only on first use
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self._lltok: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                      cache_size: int = DEFAULT_CACHE_SIZE) -> GrammarCompiler:
        """From a keepwarm FastTokenizer or a transformers fast tokenizer (both expose ``backend_tokenizer``)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)

        def tokenizer_json() -> str:
            if backend is None:
                raise GrammarError("structured outputs need a fast tokenizer (tokenizer.json); this model's "
                                   "tokenizer is a slow one", "response_format")
            return backend.to_str()

        return cls(tokenizer_json, vocab_size, eos_token_ids, cache_size)

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance

            t0 = time.perf_counter()
            tj = self._tokenizer_json
            self._lltok = llguidance.LLTokenizer(tj if isinstance(tj, str) else tj(), n_vocab=self.vocab_size,
                                                 eos_token=list(self.eos_token_ids))
            log.info("grammar engine ready: llguidance %s, %d-token vocabulary indexed in %.2fs",
                     llguidance.__version__ if hasattr(llguidance, "__version__") else "",
                     self.vocab_size, time.perf_counter() - t0)
        return self._lltok

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        import llguidance

        text = spec.grammar_text()
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return hit
            lltok = self._tokenizer()
        # Compile outside the lock (llguidance drops the GIL while it builds the grammar).
        matcher = llguidance.LLMatcher(lltok, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}", spec.field)
        compiled = CompiledGrammar(text, matcher)
        with self._lock:
            self.misses += 1
            self._cache[text] = compiled
            self._cache.move_to_end(text)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def cache_len(self) -> int:
        return len(self._cache)


def token_bytes(tokenizer_json: str) -> list[bytes | None]:
    """Each token id's bytes for a byte-level BPE tokenizer (GPT-2's byte-to-character map undone); None for added
    (special) tokens. For tests and the engine benchmark: the grammar engine does this itself."""
    from tokenizers import Tokenizer

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    tok = Tokenizer.from_str(tokenizer_json)
    added = set(tok.get_added_tokens_decoder())
    out: list[bytes | None] = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        s = tok.id_to_token(i)
        out.append(None if i in added or s is None else bytes(dec[c] for c in s if c in dec))
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bit words -> [rows, vocab] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
