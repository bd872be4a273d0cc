"""A small tokenizer over `tokenizers` + jinja2, for the serving path.

transformers' AutoTokenizer costs ~1 s to import and ~1 s to load SmolLM2's tokenizer on this machine: most of a
warm restart. A model directory with `tokenizer.json` needs neither: the `tokenizers` library does the encoding
and decoding (transformers' fast tokenizers are the same library underneath) and jinja2 renders the chat template
the way transformers does (sandboxed, trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`). Directories without `tokenizer.json` (slow tokenizers) still go through AutoTokenizer.

Chat templates are code, and a request may bring its own (only with ``--trust-request-chat-template``), so
rendering is bounded (rules):

- sandboxed: jinja2's ImmutableSandboxedEnvironment (no attribute escapes, no mutation, ``range`` capped);
- bounded in time: a render past ``timeout`` seconds raises :class:`TemplateLimitError` (a line tracer on the
  template's own code checks the deadline, so a loop that calls nothing still stops);
- bounded in size: strings made by ``*``, ``%``, ``**`` and the width/replace filters, and the rendered text,
  stay under ``MAX_TEMPLATE_CHARS``;
- compiled templates are kept in an LRU of ``TEMPLATE_CACHE_SIZE`` entries, never without bound.

Callers run :meth:`FastTokenizer.apply_chat_template` and ``encode`` off the event loop (a thread pool).
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

TEMPLATE_CACHE_SIZE = 16
DEFAULT_RENDER_TIMEOUT_S = 2.0
MAX_TEMPLATE_CHARS = 4 << 20  # 4 Mi characters, far above any prompt a context window holds
_TEMPLATE_FILENAME = "<template>"  # what jinja2 names code compiled from a string
_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\*|\d+)")


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
        raise TemplateLimitError(f"the chat template made {what} of {n} items (limit {MAX_TEMPLATE_CHARS})")


def _size_of_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(times, int):
                _check_size(len(seq) * max(times, 0), "a repeated sequence")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _check_size(abs(left).bit_length() * right // 8, "a power (bytes)")
    elif op == "%" and isinstance(left, str):
        for width in _FORMAT_WIDTH.findall(left):
            if width == "*" or int(width) > MAX_TEMPLATE_CHARS:
                raise TemplateLimitError("the chat template formats with a width past the limit")


def _bounded_sandbox():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            _size_of_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, *args, **kwargs):
            _check_deadline()
            for a in (*args, *kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool) and a > MAX_TEMPLATE_CHARS:
                    raise TemplateLimitError(f"the chat template passes {a} to a call (limit {MAX_TEMPLATE_CHARS})")
            if getattr(obj, "__name__", None) == "replace" and isinstance(getattr(obj, "__self__", None), str):
                _size_of_replace(obj.__self__, *args[:2])
            return super().call(context, obj, *args, **kwargs)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    for name in ("center", "indent", "wordwrap", "truncate"):
        env.filters[name] = _width_checked(env.filters[name])
    replace = env.filters["replace"]

    def checked_replace(eval_ctx, s, old, new, count=None):
        _size_of_replace(str(s), str(old), str(new))
        return replace(eval_ctx, s, old, new, count)

    checked_replace.jinja_pass_arg = replace.jinja_pass_arg
    env.filters["replace"] = checked_replace
    return env


def _size_of_replace(s: str, old: Any = "", new: Any = "") -> None:
    if isinstance(old, str) and isinstance(new, str):
        count = len(s) + 1 if not old else s.count(old)
        _check_size(len(s) + count * (len(new) - len(old)), "a replaced string")


def _width_checked(fn):
    def checked(*args, **kwargs):
        for a in (*args[1:], *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and a > MAX_TEMPLATE_CHARS:
                raise TemplateLimitError(f"the chat template asks {fn.__name__} for width {a}")
        return fn(*args, **kwargs)

    if hasattr(fn, "jinja_pass_arg"):
        checked.jinja_pass_arg = fn.jinja_pass_arg
    checked.__name__ = fn.__name__
    return checked


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
        from tokenizers import Tokenizer

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
        """The most characters one vocabulary entry has (a prompt's bound: keepwarm.worker.api.limits)."""
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

        def raise_exception(message: str) -> None:
            raise TokenizerError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = _bounded_sandbox()
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
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
    import fcntl
    import hashlib
    import os
    import shutil
    import tempfile

    from keepwarm.formats.paths import keepwarm_home

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = keepwarm_home() / "tokenizers" / f"{path.stem}-{key}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=target.parent))
            tok.save_pretrained(tmp)
            os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    return target


# FastTokenizers loaded ahead by a worker zygote (keepwarm.worker.api.zygote) for the workers it forks, keyed by
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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))
