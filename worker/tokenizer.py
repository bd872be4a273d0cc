"""A small tokenizer over `tokenizers` + jinja2, for the serving path.

transformers' AutoTokenizer costs ~1 s to import and ~1 s to load SmolLM2's tokenizer: most of a warm restart. A model
directory with `tokenizer.json` needs neither: the `tokenizers` library encodes and decodes and jinja2 renders the chat
template as transformers does (sandboxed, trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`). Directories without `tokenizer.json` (slow tokenizers) still go through AutoTokenizer.

Chat templates are code, and a request may bring its own (only with ``--trust-request-chat-template``), so rendering is
bounded (rules; the limits: docs/reliability.md): sandboxed (jinja2's ImmutableSandboxedEnvironment, ``range`` capped);
in time (``timeout``: a line tracer on the template's own code checks the deadline, so a loop that calls nothing still
stops: :class:`TemplateLimitError`); in size, checked *before* a result is built (every string an operation makes under
``MAX_TEMPLATE_CHARS``, every list under ``MAX_TEMPLATE_ITEMS``, and the rendered text; ``lipsum`` is gone); compiled
templates in an LRU of ``TEMPLATE_CACHE_SIZE``. Callers run :meth:`FastTokenizer.apply_chat_template` and ``encode``
off the event loop.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from keepwarm.formats.paths import keepwarm_home

TEMPLATE_CACHE_SIZE = 16
DEFAULT_RENDER_TIMEOUT_S = 2.0
MAX_TEMPLATE_CHARS = 4 << 20  # 4 Mi characters, far above any prompt a context window holds
MAX_TEMPLATE_ITEMS = 1 << 20  # elements of a list a template builds (each costs a pointer, often an object)
MAX_TEMPLATE_SLICES = 100_000  # lists made by the slice filter: jinja2's bound on range()
_TEMPLATE_FILENAME = "<template>"  # what jinja2 names code compiled from a string
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_BRACE_FIELD = re.compile(r"\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


class TokenizerError(ValueError):
    pass


class TemplateLimitError(TokenizerError):
    """A chat template ran past its time or size bound."""


_render = threading.local()  # the running render's deadline, per thread


def _check_deadline() -> None:
    deadline = getattr(_render, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateLimitError(f"the chat template did not finish within {_render.timeout:g}s")


def _check_size(n: int, what: str) -> None:
    if n > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"the chat template made {what} of {n} characters (limit {MAX_TEMPLATE_CHARS})")


def _check_items(n: int, what: str) -> None:
    if n > MAX_TEMPLATE_ITEMS:
        raise TemplateLimitError(f"the chat template made {what} of {n} elements (limit {MAX_TEMPLATE_ITEMS})")


def _check_ints(args: Any, kwargs: dict[str, Any], what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and a > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"the chat template passes {a} to {what} (limit {MAX_TEMPLATE_CHARS})")


def _check_result(result: Any, what: str) -> Any:
    """A backstop after an operation whose growth is bounded by a small factor (escaping, upper-casing...)."""
    if isinstance(result, str | bytes):
        _check_size(len(result), what)
    elif isinstance(result, list | tuple):
        _check_items(len(result), what)
    return result


def _str_size(value: Any, budget: int = MAX_TEMPLATE_CHARS, per_item: int = 2, per_level: int = 0) -> int:
    """About ``len(str(value))`` (``per_item`` characters around each element, ``per_level`` more per level of
    nesting, as an indented dump adds), counted without building it: the walk stops once past ``budget``, so it
    costs at most ``budget`` steps whatever ``value`` holds (``[s] * n`` shares one string n times)."""
    total, stack, steps = 0, [(value, 0)], 0
    while stack and total <= budget:
        v, depth = stack.pop()
        steps += 1
        if not steps & 0xFFFF:
            _check_deadline()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, bytes):
            total += 4 * len(v) + 3
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() * 31 // 100 + 2
        elif isinstance(v, float):
            total += 24
        elif type(v).__name__ == "Namespace":  # jinja2's namespace(): str() shows its attributes
            stack.append((getattr(v, "_Namespace__attrs", {}), depth))
        elif isinstance(v, dict):
            total += 2 + len(v) * (2 * per_item + per_level * (depth + 1))
            if total <= budget:
                stack.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, list | tuple | set | frozenset):
            total += 2 + len(v) * (per_item + per_level * (depth + 1))
            if total <= budget:
                stack.extend((x, depth + 1) for x in v)
        else:  # Undefined, macros, loop objects: a short repr
            total += 64
    return total


def _total_size(items: Any) -> int:
    """The sum of ``_str_size`` over ``items``, stopping once past the limit (strings counted directly)."""
    total = 0
    for i, x in enumerate(items):
        total += len(x) + 2 if type(x) is str else _str_size(x, MAX_TEMPLATE_CHARS - total)
        if total > MAX_TEMPLATE_CHARS:
            break
        if not i & 0xFFFF:
            _check_deadline()
    return total


def _bounded_list(value: Any, what: str) -> list[Any]:
    """``list(value)``, refused as soon as it passes MAX_TEMPLATE_ITEMS (a generator is consumed one by one)."""
    if isinstance(value, list | tuple | str | dict):
        _check_items(len(value), what)
        return list(value)
    out: list[Any] = []
    for x in value:
        out.append(x)
        if not len(out) & 0xFFFF:
            _check_deadline()
            _check_items(len(out), what)
    _check_items(len(out), what)
    return out


def _num(digits: str | None) -> int:
    return 0 if not digits else MAX_TEMPLATE_CHARS + 1 if len(digits) > 9 else int(digits)


def _percent_size(fmt: str, args: Any) -> int:
    """Characters ``fmt % args`` may make: every conversion may print the widest argument, padded."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    widest = max((_str_size(v) for v in values), default=0)
    total = len(fmt)
    for m in _PERCENT_SPEC.finditer(fmt):
        if "*" in (m.group(1), m.group(2)):
            raise TemplateLimitError("the chat template formats with a '*' width or precision")
        total += widest + _num(m.group(1)) + _num(m.group(2))
        if total > MAX_TEMPLATE_CHARS:
            break
    return total


def _brace_size(fmt: str, args: Any, kwargs: dict[str, Any]) -> int:
    """Characters ``fmt.format(*args, **kwargs)`` may make: each field the widest argument, its widths, and a
    nested width (``{:{}}``) as large as the largest integer argument."""
    values = [*args, *kwargs.values()]
    widest = max((_str_size(v) for v in values), default=0)
    largest = max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)
    total = len(fmt)
    for m in _BRACE_FIELD.finditer(fmt):
        spec = m.group(1).partition(":")[2]
        total += widest + sum(_num(d) for d in re.findall(r"\d+", spec)) + spec.count("{") * max(largest, 0)
        if total > MAX_TEMPLATE_CHARS:
            break
    return total


def _size_of_replace(s: str, old: Any = "", new: Any = "") -> None:
    if isinstance(old, str) and isinstance(new, str):
        count = len(s) + 1 if not old else s.count(old)
        _check_size(len(s) + count * (len(new) - len(old)), "a replaced string")


def _size_of_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str) and isinstance(times, int):
                _check_size(len(seq) * max(times, 0), "a repeated string")
            elif isinstance(seq, list | tuple) and isinstance(times, int):
                _check_items(len(seq) * max(times, 0), "a repeated list")
    elif op == "+":
        if isinstance(left, str) and isinstance(right, str):
            _check_size(len(left) + len(right), "a string sum")
        elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
            _check_items(len(left) + len(right), "a list sum")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _check_size(abs(left).bit_length() * right // 8, "a power (bytes)")
    elif op == "%" and isinstance(left, str):
        _check_size(_percent_size(left, right), "a formatted string")


def _method_args(obj: Any, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """Check what a ``str`` method would build before it runs; the arguments to call it with (an iterable to
    join is read into a list once, bounded)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return args
    if name == "join" and args:
        items = _bounded_list(args[0], "a joined list")
        _check_size(_total_size(items) + len(owner) * len(items), "a joined string")
        return (items, *args[1:])
    if name == "replace":
        _size_of_replace(owner, *args[:2])
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _check_size(len(owner) + owner.count("\t") * max(tab, 0), "an expanded string")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _check_size(len(owner) * max(longest, 1), "a translated string")
    return args


def _tojson_size(a: dict[str, Any]) -> int:
    indent, seps = a.get("indent"), a.get("separators") or (", ", ": ")
    step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    per_item = 2 + sum(len(str(s)) for s in seps) + (1 if indent is not None else 0)
    return _str_size(a["x"], per_item=per_item, per_level=max(step, 0))


def _wordwrap_size(a: dict[str, Any]) -> int:
    s, width, wrap = str(a["s"]), a["width"], a["wrapstring"]
    breaks = len(s) // max(width, 1) + s.count("\n") + 1 if isinstance(width, int) else len(s) + 1
    return len(s) + breaks * len(str(wrap if wrap is not None else "\n"))


def _indent_size(a: dict[str, Any]) -> int:
    s, width = str(a["s"]), a["width"]
    return len(s) + (s.count("\n") + 1) * (len(width) if isinstance(width, str) else max(int(width), 0))


def _urlize_size(a: dict[str, Any]) -> int:
    s = str(a["value"])
    return 3 * len(s) + (len(s) // 3 + 1) * (len(str(a["target"] or "")) + len(str(a["rel"] or "")))


def _escape_size(value: Any) -> int:
    if isinstance(value, str):  # each of & < > ' " becomes an entity of 4-5 characters
        return len(value) + 4 * sum(value.count(c) for c in "&<>'\"")
    return 6 * _str_size(value)


def _format_filter_size(a: dict[str, Any]) -> int:
    return _percent_size(str(a["value"]), a["kwargs"] or tuple(a["args"]))


# What a filter may build, estimated from its (bound) arguments before it runs; the ones not listed grow their
# input by a small factor at most (upper-casing, escaping) and are checked on their result.
_FILTER_SIZES: dict[str, Callable[[dict[str, Any]], int]] = {
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "format": _format_filter_size,
    "tojson": _tojson_size,
    "urlize": _urlize_size,
    "center": lambda a: max(len(str(a["value"])), a["width"] if isinstance(a["width"], int) else 0),
    "truncate": lambda a: min(len(str(a["s"])), max(a["length"], 0)) + len(str(a["end"])),
    "string": lambda a: _str_size(a["s"]),
    "pprint": lambda a: _str_size(a["value"], per_item=3, per_level=1),
    "escape": lambda a: _escape_size(a["s"]),
    "e": lambda a: _escape_size(a["s"]),
    "forceescape": lambda a: _escape_size(a["value"]),
    "urlencode": lambda a: 3 * _str_size(a["value"]),
    "xmlattr": lambda a: 6 * _str_size(a["d"]),
}
_MATERIALIZED = {"join": "value", "sum": "iterable", "list": "value"}  # read into a bounded list first


def _filter_args(name: str, sig: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Check what filter ``name`` would build; the arguments to call it with."""
    if name not in _FILTER_SIZES and name not in _MATERIALIZED and name not in ("replace", "slice", "batch"):
        return args, kwargs
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if name in _MATERIALIZED:
        a[_MATERIALIZED[name]] = items = _bounded_list(a[_MATERIALIZED[name]], f"the {name} filter's input")
        if name == "join":
            _check_size(_total_size(items) + len(str(a["d"])) * len(items), "a joined string")
        elif name == "sum":  # of lists (Python's sum refuses strings): the elements of the result
            _check_items(sum(len(x) for x in (a["start"], *items) if isinstance(x, list | tuple)), "a summed list")
    elif name == "replace":
        _size_of_replace(str(a["s"]), a["old"], a["new"])
    elif name == "slice" and isinstance(a["slices"], int) and a["slices"] > MAX_TEMPLATE_SLICES:
        raise TemplateLimitError(f"the chat template slices into {a['slices']} lists (limit "
                                 f"{MAX_TEMPLATE_SLICES})")
    elif name == "batch" and isinstance(a["linecount"], int):
        _check_items(a["linecount"], "a batch")
    else:
        _check_size(_FILTER_SIZES[name](a), f"the output of the {name} filter")
    return bound.args, bound.kwargs


def _checked_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its output bounded: checked before it runs (see _FILTER_SIZES), and its result after."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # the context / environment argument
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if skip and params and params[0].name in ("eval_ctx", "context", "environment", "env"):
        sig = sig.replace(parameters=params[1:])  # bound without it (async variants hide it from inspect)

    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        _check_ints(args[skip + 1:], kwargs, f"the {name} filter")
        rest, kwargs = _filter_args(name, sig, args[skip:], kwargs)
        return _check_result(fn(*args[:skip], *rest, **kwargs), f"the output of the {name} filter")

    if skip:
        checked.jinja_pass_arg = fn.jinja_pass_arg  # type: ignore[attr-defined]
    checked.__name__ = getattr(fn, "__name__", name)
    return checked


def _sized_parts(parts: tuple) -> tuple:
    """The operands of ``~``, checked before they are joined."""
    _check_size(_total_size(parts) - 2 * len(parts), "a concatenated string")
    return parts


def _bounded_concat(parts: Any) -> str:
    """The environment's ``concat``: joins a block's, a macro's or a ``{% set %}`` capture's output."""
    parts = parts if isinstance(parts, list) else list(parts)
    _check_size(sum(len(p) for p in parts), "a captured block")
    return "".join(parts)


def _finalize(value: Any) -> Any:
    """Every ``{{ ... }}``: the text of what it prints is counted before ``str()`` builds it."""
    if not isinstance(value, str):
        _check_size(_str_size(value), "an output")
    return value


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    _check_size(len(fmt) + str(fmt).count("%") * 64, "a date format")
    return datetime.now().strftime(fmt)


def _raise_exception(message: Any) -> None:
    text = str(message)
    raise TokenizerError(text if len(text) <= 500 else text[:500] + "...")


def _bounded_sandbox():
    """jinja2's immutable sandbox with every operation that can grow a string or a list checked before it
    builds its result: ``*``, ``+``, ``%``, ``**`` (call_binop), ``~`` (its code generator), captured blocks
    (``concat``), printed values (``finalize``), filters (each wrapped) and method calls (``call``)."""
    # deferred, these three: jinja2 (~30 ms), paid at the first chat template compiled, not at import
    from jinja2.compiler import CodeGenerator, optimizeconst
    from jinja2.ext import loopcontrols  # deferred (above)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred (above)

    class SizedConcat(CodeGenerator):
        @optimizeconst
        def visit_Concat(self, node, frame) -> None:
            # jinja2's own, with the operands passing environment.sized_parts before str_join builds the result.
            if frame.eval_ctx.volatile:
                func = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                func = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"{func}(environment.sized_parts((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write(")))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = SizedConcat
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        concat = staticmethod(_bounded_concat)
        sized_parts = staticmethod(_sized_parts)

        def call_binop(self, context, operator, left, right):
            _size_of_binop(operator, left, right)
            return _check_result(super().call_binop(context, operator, left, right), f"'{operator}'")

        def wrap_str_format(self, value):
            # str.format / format_map reach templates through this wrapper (jinja2 >= 3.1.5), not through call.
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt, is_map = value.__self__, value.__name__ == "format_map"

            def checked(*args, **kwargs):
                if not is_map:
                    _check_size(_brace_size(fmt, args, kwargs), "a formatted string")
                elif len(args) == 1 and isinstance(args[0], dict):
                    _check_size(_brace_size(fmt, (), args[0]), "a formatted string")
                return wrapped(*args, **kwargs)

            return checked

        def call(self, context, obj, /, *args, **kwargs):
            _check_deadline()
            _check_ints(args, kwargs, "a call")
            args = _method_args(obj, args, kwargs)
            return _check_result(super().call(context, obj, *args, **kwargs), "a call's result")

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _checked_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.pop("lipsum", None)  # paragraphs of filler text, n of them: no template needs it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _render_bounded(template, timeout: float, **context: Any) -> str:
    """Render with a deadline (checked on every line of the template's code) and a bound on the output size."""
    def local(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimitError(f"the chat template did not finish within {timeout:g}s")
        return local

    def global_trace(frame, event, arg):
        return local if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    deadline = time.monotonic() + timeout
    _render.deadline, _render.timeout = deadline, timeout
    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        parts, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            _check_size(size, "a rendered prompt")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)
        _render.deadline = None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # transformers' serialized AddedToken
        return value.get("content")
    return value


class FastTokenizer:
    """The subset of a transformers tokenizer keepwarm uses: encode, decode, apply_chat_template, special ids."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.name_or_path = str(d)
        self.backend_tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.unk_token = _token_text(cfg.get("unk_token"))
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._compiled_lock = threading.Lock()  # renders run in a thread pool
        self.render_timeout = DEFAULT_RENDER_TIMEOUT_S

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one vocabulary entry has (a prompt's bound: keepwarm.worker.http.limits)."""
        return max((len(t) for t in self.backend_tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def _template(self, source: str):
        with self._compiled_lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return template
        _check_size(len(source), "a template source")
        env = _bounded_sandbox()
        template = env.from_string(source)
        with self._compiled_lock:
            self._compiled[source] = template
            while len(self._compiled) > TEMPLATE_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, **kwargs: Any) -> str | list[int]:
        source = chat_template or self.chat_template
        if source is None:
            raise TokenizerError("this tokenizer has no chat template")
        text = _render_bounded(
            self._template(source), self.render_timeout, messages=messages,
            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", pad_token=self.pad_token or "", unk_token=self.unk_token or "",
            **kwargs)
        if continue_final_message and messages:
            final = messages[-1].get("content") or ""
            if isinstance(final, str) and final.strip() and final.strip() in text:
                # transformers cuts everything after the final message's content, so generation continues it.
                text = text[:text.rindex(final.strip()) + len(final.strip())]
        return self.encode(text, add_special_tokens=False) if tokenize else text


def gguf_tokenizer_dir(path: Path) -> Path:
    """A directory with the tokenizer of a .gguf file: the file's own directory when it holds tokenizer.json,
    else one converted once from the GGUF metadata (transformers' GGUF tokenizer) under $KEEPWARM_HOME/tokenizers,
    keyed by the file's name, size and mtime."""
    if (path.parent / "tokenizer.json").is_file():
        return path.parent
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = keepwarm_home() / "tokenizers" / f"{path.stem}-{key}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "tokenizer.json").is_file():
            from transformers import AutoTokenizer  # deferred: transformers (~0.7 s) only for a GGUF's tokenizer

            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=target.parent))
            tok.save_pretrained(tmp)
            os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    return target


# FastTokenizers loaded ahead by a worker zygote (keepwarm.worker.process.zygote) for the workers it forks, keyed by
# their files (path, size, mtime): a tokenizer changed on disk is loaded afresh. Empty in any other process.
_PRELOADED: dict[tuple, FastTokenizer] = {}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _files_key(d: Path) -> tuple:
    key: list[Any] = [str(d.resolve())]
    for name in _TOKENIZER_FILES:
        try:
            st = (d / name).stat()
            key.append((name, st.st_size, st.st_mtime_ns))
        except FileNotFoundError:
            key.append((name, None))
    return tuple(key)


def preload_tokenizer(path: str | Path) -> bool:
    """Load the FastTokenizer of the directory ``path`` now and hand it to this process's later ``load_tokenizer``
    calls, in it and in its forks (the zygote, before it forks workers). Loading starts no thread and runs no
    torch op. Only a directory with tokenizer.json (no GGUF conversion, no transformers); False otherwise."""
    d = Path(path)
    if not (d / "tokenizer.json").is_file():
        return False
    key = _files_key(d)
    if key not in _PRELOADED:
        _PRELOADED.clear()  # one server's tokenizer: the previous one (changed flags, changed files) goes
        tok = FastTokenizer(d)
        if tok.chat_template is not None:
            tok._template(tok.chat_template)  # jinja2 imported and the template compiled, once
        tok.longest_token_chars  # noqa: B018  (computed once, for every worker)
        _PRELOADED[key] = tok
    return True


def preloaded_tokenizers() -> list[str]:
    """The directories whose tokenizer this process preloaded (a zygote's probe shows them)."""
    return [key[0] for key in _PRELOADED]


def load_tokenizer(path: str | Path):
    """FastTokenizer when the directory has tokenizer.json (the one preloaded for these files, if any), else
    transformers' AutoTokenizer; for a .gguf file, the tokenizer beside it or converted from its metadata (see
    gguf_tokenizer_dir)."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        p = gguf_tokenizer_dir(p)
    if (p / "tokenizer.json").is_file():
        if _PRELOADED:
            hit = _PRELOADED.get(_files_key(p))
            if hit is not None:
                return hit
        return FastTokenizer(p)
    from transformers import AutoTokenizer  # deferred: ~0.7 s, only for a model without tokenizer.json

    return AutoTokenizer.from_pretrained(str(p))
