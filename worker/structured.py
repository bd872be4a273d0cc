"""Structured outputs by constrained decoding: a grammar per request, a token mask per sequence per step.

The engine is llguidance (why, measured against xgrammar and outlines-core: docs/benchmarks.md). Rules (the JSON
semantics in full: docs/vllm-compat.md, "Structured outputs"; the limits: docs/reliability.md):
- A :class:`StructuredOutputs` (JSON schema, any JSON object, regex, choice, Lark / GBNF grammar) compiles
  (:meth:`GrammarCompiler.compile`) into a validated :class:`CompiledGrammar` (else :class:`GrammarError`, a 400
  naming the field), kept in a bounded LRU keyed by the grammar text. Each sequence gets its own
  :class:`GrammarMatcher`; the sampler applies every constrained row's mask in one batched ``masked_fill`` (free
  rows untouched, so constrained and free requests share a batch).
- JSON is compact (OpenAI's separators) and objects are closed (no ``additionalProperties``: ``false``, vLLM's
  default), so a small model cannot wander into whitespace or invented keys. EOS only where the grammar accepts.
- Bounded before anything is compiled (:meth:`StructuredOutputs.check_limits`); ``$ref`` recursion that can never
  end is refused; compiling runs on ``COMPILE_THREADS`` threads with ``COMPILE_STACK_BYTES`` stacks (llguidance
  recurses on nesting); a compiler's error is one line, never a Rust panic or backtrace.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import torch
from tokenizers import Tokenizer

log = logging.getLogger("keepwarm.structured")

DEFAULT_CACHE_SIZE = 128
KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Request limits (docs/reliability.md). llguidance panics past ~65k grammar symbols (100k choices: 25 s, then a
# panic); 50k choices take 4 s, 4096 take 0.05 s. A 15k-value schema compiles in 1 s, 30k in 4 s.
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 256 << 10
MAX_REGEX_CHARS = 64 << 10
MAX_GRAMMAR_CHARS = 128 << 10
MAX_GBNF_RULES = 512  # llguidance's GBNF converter is quadratic in rules: 1000 take 1.2 s, 3000 take 11 s
MAX_SCHEMA_NODES = 10_000  # JSON values in a schema
MAX_SCHEMA_DEPTH = 64  # nesting of objects and arrays in a schema (llguidance stops near 128)
MAX_SCHEMA_CHARS = 1 << 20  # characters in a schema's keys and strings
COMPILE_THREADS = 2
COMPILE_STACK_BYTES = 256 << 20  # virtual: only the pages a deep grammar touches are ever resident


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


def _pointer(path: list[Any]) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _resolve(root: Any, ref: Any) -> Any:
    """What a local ``$ref`` ("#", "#/$defs/a", with JSON pointer escapes) points at; None for any other ref."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _object_only(schema: dict[str, Any], kind: str) -> bool:
    t = schema.get("type")
    return t == kind or t == [kind]


class _RefGraph:
    """A schema as an AND/OR graph over its subschemas: a schema has a finite instance iff every one of its
    conditions has (its ``$ref`` target, ``allOf`` members, required properties, the first ``minItems`` items)
    and, for each ``anyOf`` / ``oneOf``, one member has. Anything else is taken as satisfiable."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.kind: list[str] = []  # "and" | "or"
        self.children: list[list[int]] = []
        self.reach: list[list[int]] = []  # subschemas generation may enter (children and optional ones)
        self.where: dict[int, str] = {}  # vertex -> JSON pointer, for schemas with a $ref
        self.ids: dict[int, int] = {}
        self.refs: list[tuple[int, Any]] = []

    def _vertex(self, kind: str) -> int:
        self.kind.append(kind)
        self.children.append([])
        self.reach.append([])
        return len(self.kind) - 1

    def node(self, schema: Any, path: list[Any]) -> int:
        if not isinstance(schema, dict):
            return self._vertex("or" if schema is False else "and")  # false: an empty OR, never satisfied
        if id(schema) in self.ids:
            return self.ids[id(schema)]
        v = self.ids[id(schema)] = self._vertex("and")
        props: dict[str, int] = {}
        for key in _SUBSCHEMA_MAPS:
            mapping = schema.get(key)
            if not isinstance(mapping, dict):
                continue
            for k, x in mapping.items():
                c = self.node(x, [*path, key, k])
                if key == "properties":
                    props[k] = c
                if key not in ("$defs", "definitions"):
                    self.reach[v].append(c)
        for key in (*_SUBSCHEMA_LISTS, "items"):
            members = schema.get(key)
            if not isinstance(members, list) or not members:
                continue
            cs = [self.node(x, [*path, key, i]) for i, x in enumerate(members)]
            self.reach[v] += cs
            if key == "allOf":
                self.children[v] += cs
            elif key in ("anyOf", "oneOf"):
                alt = self._vertex("or")
                self.children[alt] = cs
                self.children[v].append(alt)
        subs = {key: self.node(schema[key], [*path, key]) for key in _SUBSCHEMAS
                if isinstance(schema.get(key), dict | bool)}
        self.reach[v] += subs.values()
        self._structure(v, schema, props, subs)
        if "$ref" in schema:
            self.where[v] = _pointer(path)
            self.refs.append((v, schema["$ref"]))
        return v

    def _structure(self, v: int, schema: dict[str, Any], props: dict[str, int], subs: dict[str, int]) -> None:
        """The conditions an object's required properties and an array's first minItems items add."""
        if _object_only(schema, "object") and isinstance(schema.get("required"), list):
            for name in schema["required"]:
                c = props.get(name, subs.get("additionalProperties")) if isinstance(name, str) else None
                if c is not None:
                    self.children[v].append(c)
        min_items = schema.get("minItems")
        if _object_only(schema, "array") and isinstance(min_items, int) and min_items > 0:
            given = schema.get("prefixItems")
            prefix = [self.ids[id(x)] for x in given if isinstance(x, dict)] if isinstance(given, list) else []
            self.children[v] += prefix[:min_items]
            if min_items > len(prefix) and "items" in subs:
                self.children[v].append(subs["items"])

    def link_refs(self) -> None:
        for v, ref in self.refs:
            target = _resolve(self.root, ref)
            if target is False:
                self.children[v].append(self._vertex("or"))
            elif isinstance(target, dict) and id(target) in self.ids:
                self.children[v].append(self.ids[id(target)])
                self.reach[v].append(self.ids[id(target)])

    def settle(self, need: list[int]) -> list[bool]:
        """The least fixpoint: a vertex holds once ``need[v]`` of its children hold."""
        parents: list[list[int]] = [[] for _ in self.kind]
        for v, cs in enumerate(self.children):
            for c in cs:
                parents[c].append(v)
        left = list(need)
        done = [n <= 0 for n in left]
        queue = [v for v, d in enumerate(done) if d]
        while queue:
            for p in parents[queue.pop()]:
                left[p] -= 1
                if not done[p] and left[p] <= 0:
                    done[p] = True
                    queue.append(p)
        return done


def unending_ref(schema: Any) -> str | None:
    """The JSON pointer of a schema the root can lead to whose ``$ref`` recursion has no way to end (no finite
    JSON value matches it, and only because of the recursion); None when there is none."""
    if not isinstance(schema, dict):
        return None
    g = _RefGraph(schema)
    root = g.node(schema, [])
    g.link_refs()
    ends = g.settle([len(cs) if k == "and" else 1 for k, cs in zip(g.kind, g.children, strict=True)])
    fails = g.settle([1 if k == "and" else len(cs) for k, cs in zip(g.kind, g.children, strict=True)])
    seen, stack = {root}, [root]
    while stack:
        v = stack.pop()
        for c in (*g.children[v], *g.reach[v]):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    # The last in document order: for a -> b -> a that is b, inside the cycle rather than the root leading to it.
    bad = [v for v in sorted(seen) if v in g.where and not ends[v] and not fails[v]]
    return g.where[bad[-1]] if bad else None


class GrammarError(ValueError):
    """An invalid schema, regex, choice list or grammar; ``field`` names the request field (an HTTP 400)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def one_line(message: str, kind: str) -> str:
    """A compiler's error as one short line; a panic (with its backtrace) becomes a plain sentence."""
    text = str(message).strip()
    if not text or "panic" in text.lower() or "backtrace" in text.lower():
        return f"the {kind} is too large or too complex to compile"
    first = text.splitlines()[0].strip()
    return first if len(first) <= 300 else first[:300] + "..."


def _schema_shape(schema: Any) -> tuple[int, int, int]:
    """(values, deepest nesting, characters) of a JSON document, stopping once a limit is passed."""
    nodes = deepest = chars = 0
    stack = [(schema, 1)]
    while stack:
        v, depth = stack.pop()
        nodes += 1
        deepest = max(deepest, depth)
        if nodes > MAX_SCHEMA_NODES or deepest > MAX_SCHEMA_DEPTH or chars > MAX_SCHEMA_CHARS:
            break
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, dict):
            chars += sum(len(k) for k in v if isinstance(k, str))
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return nodes, deepest, chars


def _check_schema(schema: Any, field: str) -> None:
    nodes, deepest, chars = _schema_shape(schema)
    if nodes > MAX_SCHEMA_NODES:
        raise GrammarError(f"{field}: the JSON schema has more than {MAX_SCHEMA_NODES} values", field)
    if deepest > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{field}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", field)
    if chars > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{field}: the JSON schema holds more than {MAX_SCHEMA_CHARS} characters", field)
    where = unending_ref(schema)
    if where is not None:
        raise GrammarError(f"{field}: the JSON schema is recursive with no way to end: {where!r} refers back to "
                           "itself through $ref with nothing to stop it, so no finite JSON value matches it", field)


@dataclass(frozen=True)
class StructuredOutputs:
    """One request's constraint: ``kind`` is one of KINDS; ``value`` its schema (a dict), regex, choices or grammar.

    ``field`` is the request field it came from (``response_format``, ``guided_json``, ``tool_choice``...), named
    in errors.
    """

    kind: str
    value: Any
    field: str = "structured_outputs"

    def check_limits(self) -> Any:
        """The value to compile, after the checks that cost little next to compiling it (types, the limits, a
        schema's recursion); a GrammarError naming the field otherwise. Runs before llguidance sees anything."""
        k, v, field = self.kind, self.value, self.field
        if k not in KINDS:
            raise GrammarError(f"unknown structured output kind {k!r} (choose one of {', '.join(KINDS)})", field)
        if k == "json_object":
            return {"type": "object"}
        if k == "json":
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except (json.JSONDecodeError, RecursionError) as e:
                    raise GrammarError(f"{field}: the JSON schema is not valid JSON: {one_line(str(e), 'schema')}",
                                       field) from None
            if not isinstance(v, dict | bool):
                raise GrammarError(f"{field}: a JSON schema must be an object", field)
            _check_schema(v, field)
            return v
        if k == "choice":
            if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
                raise GrammarError(f"{field}: choice must be a non-empty list of non-empty strings", field)
            if len(v) > MAX_CHOICES:
                raise GrammarError(f"{field} has {len(v)} choices (limit {MAX_CHOICES})", field)
            if sum(map(len, v)) > MAX_CHOICE_CHARS:
                raise GrammarError(f"{field}'s choices hold more than {MAX_CHOICE_CHARS} characters", field)
            return v
        if not isinstance(v, str) or not v.strip():
            what = "a regex must be a non-empty string" if k == "regex" else \
                "a grammar must be a non-empty string (Lark or GBNF)"
            raise GrammarError(f"{field}: {what}", field)
        limit = MAX_REGEX_CHARS if k == "regex" else MAX_GRAMMAR_CHARS
        if len(v) > limit:
            raise GrammarError(f"{field}: the {k} is {len(v)} characters long (limit {limit})", field)
        if k == "grammar" and v.count("::=") > MAX_GBNF_RULES:
            raise GrammarError(f"{field}: the grammar has more than {MAX_GBNF_RULES} GBNF rules", field)
        return v

    def grammar_text(self) -> str:
        """llguidance's grammar text for this constraint (pure: no tokenizer needed)."""
        import llguidance  # deferred: ~35 ms, paid at the first structured request, not at every worker start

        k, v = self.kind, self.check_limits()
        try:
            if k in ("json", "json_object"):
                return llguidance.LLMatcher.grammar_from_json_schema(close_objects(v), defaults={
                    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
            if k == "regex":
                return llguidance.LLMatcher.grammar_from_regex(v)
            if k == "choice":  # Lark string literals use JSON's escapes.
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in v))
            if "::=" in v:  # GBNF (llama.cpp's, which vLLM's xgrammar backend takes)
                from llguidance.gbnf_to_lark import gbnf_to_lark  # deferred with llguidance

                v = gbnf_to_lark(v)
            return llguidance.LLMatcher.grammar_from_lark(v)
        except (ValueError, TypeError, RecursionError) as e:  # llguidance's errors, json's, the GBNF converter's
            raise GrammarError(f"{self.field}: invalid {k}: {one_line(str(e), k)}", self.field) from None


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


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it: a forked child makes its own)
_pool_lock = threading.Lock()


def _on_compile_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a compile thread (COMPILE_STACK_BYTES of stack), waiting for it; inline on one already."""
    global _pool
    if threading.current_thread().name.startswith("grammar-compile"):
        return fn(*args)
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile"))
        try:
            previous = threading.stack_size(COMPILE_STACK_BYTES)  # threads start on submit: they get this stack
        except (ValueError, RuntimeError):  # a platform that cannot size stacks: compile here
            return fn(*args)
        try:
            future = _pool[1].submit(fn, *args)
        finally:
            threading.stack_size(previous)
    return future.result()


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
            import llguidance  # deferred: ~35 ms, paid at the first structured request, not at every worker start

            t0 = time.perf_counter()
            tj = self._tokenizer_json
            self._lltok = llguidance.LLTokenizer(tj if isinstance(tj, str) else tj(), n_vocab=self.vocab_size,
                                                 eos_token=list(self.eos_token_ids))
            log.info("grammar engine ready: llguidance %s, %d-token vocabulary indexed in %.2fs",
                     llguidance.__version__ if hasattr(llguidance, "__version__") else "",
                     self.vocab_size, time.perf_counter() - t0)
        return self._lltok

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar (cached); a GrammarError naming the field if it is invalid or past a limit."""
        return _on_compile_thread(self._compile, spec)

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        import llguidance  # deferred: ~35 ms, paid at the first structured request, not at every worker start

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
            raise GrammarError(f"{spec.field}: invalid {spec.kind}: {one_line(matcher.get_error(), spec.kind)}",
                               spec.field)
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
